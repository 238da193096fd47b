"""The paper report: every published cell gets a prediction, and the text tables render them."""

from __future__ import annotations

import json
import random

import pytest

from megatron_odc.tools.paper import (
    PAPER_TABLE5,
    PAPER_TABLE6_15B_LONGALIGN,
    format_paper_report,
    paper_report,
)
from megatron_odc.tools.simulator import A100_ROCE


@pytest.fixture
def small_profiles(tmp_path):
    """Both paper profiles with 256 samples: one minibatch of the largest cell (32 GPUs x 8)."""
    rng = random.Random(0)
    path = tmp_path / "profiles.json"
    profiles = {
        name: {"lengths": [rng.randint(100, 20000) for _ in range(256)]}
        for name in ("longalign", "swe_smith")
    }
    path.write_text(json.dumps(profiles))
    return str(path)


def test_paper_report_covers_every_published_cell(small_profiles) -> None:
    report = paper_report(
        hw=A100_ROCE,
        num_minibatches=1,
        seed=0,
        cap_tokens=65536,
        profiles_file=small_profiles,
        table6_minibatches=1,
    )
    cells = {(e["model"], e["profile"], e["gpus"], e["minibatch"]): e for e in report["table5"]}
    assert len(cells) == 4 * len(PAPER_TABLE5)
    for (preset, profile, gpus), paper in PAPER_TABLE5.items():
        for col, minibatch in enumerate((1, 2, 4, 8)):
            entry = cells[(preset, profile, gpus, minibatch)]
            assert entry["num_minibatches"] == 1
            for name, values in paper.items():
                assert entry[name]["paper_pct"] == values[col]
    # One sample per rank: nothing to balance, every plan runs the same step.
    for entry in report["table5"]:
        if entry["minibatch"] == 1:
            assert entry["odc+lb_mini"]["predicted_pct"] == pytest.approx(0.0, abs=1e-9)
    assert [e["minibatch"] for e in report["table6_15b_longalign"]] == [1, 2, 4, 8]
    for col, entry in enumerate(report["table6_15b_longalign"]):
        for name, paper in PAPER_TABLE6_15B_LONGALIGN.items():
            assert entry[name]["paper"] == paper[col]
            assert 0.0 <= entry[name]["predicted"] < 100.0
    text = format_paper_report(report)
    assert text.startswith("Table 5")
    assert "Table 6, 1.5B LongAlign, 8 GPUs" in text
    assert len(text.splitlines()) == 2 + len(report["table5"]) + 3 + 4
