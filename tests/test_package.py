"""The package root: its public names resolve lazily, and importing it loads neither torch nor megatron."""

from __future__ import annotations

import subprocess
import sys

import pytest

import megatron_odc


def test_public_names_resolve_to_their_modules() -> None:
    for name, module in megatron_odc._PUBLIC.items():
        obj = getattr(megatron_odc, name)
        assert obj.__module__ == module, name
    assert set(megatron_odc.__all__) == {"__version__", *megatron_odc._PUBLIC}
    with pytest.raises(AttributeError, match="no attribute 'OdcDataParallel'"):
        megatron_odc.OdcDataParallel  # noqa: B018  (the 0.1 name is gone; docs/architecture.md)


def test_import_is_light() -> None:
    code = (
        "import sys\n"
        "import megatron_odc\n"
        "heavy = [m for m in ('torch', 'megatron') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
