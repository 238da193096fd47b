"""The shipped length profiles: the generator rewrites them byte for byte, and the default path finds them."""

import json

from megatron_odc.balance.profiles import (
    PROFILES_ENV,
    SHIPPED_PROFILES_PATH,
    default_profiles_path,
    load_profile_lengths,
)
from megatron_odc.tools import length_profiles


def test_generator_reproduces_the_shipped_file(tmp_path):
    out = tmp_path / "profiles.json"
    assert length_profiles.main(["--output", str(out)]) == 0
    assert out.read_bytes() == SHIPPED_PROFILES_PATH.read_bytes()
    shipped = json.loads(SHIPPED_PROFILES_PATH.read_text())
    assert sorted(shipped) == sorted(length_profiles.PROFILES)
    for name, spec in length_profiles.PROFILES.items():
        lengths = shipped[name]["lengths"]
        assert len(lengths) == length_profiles.COUNT
        assert spec["lo"] <= min(lengths) <= max(lengths) <= spec["hi"]


def test_default_path_is_the_shipped_file(monkeypatch):
    monkeypatch.delenv(PROFILES_ENV, raising=False)
    assert default_profiles_path() == SHIPPED_PROFILES_PATH
    assert len(load_profile_lengths("longalign")) == length_profiles.COUNT
