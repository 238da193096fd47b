"""The paper report: every published cell gets a prediction, and the text tables render them."""

from __future__ import annotations

import json
import random

import pytest

from megatron_odc.tools.paper import (
    MULTINODE_CELLS,
    PAPER_TABLE5,
    PAPER_TABLE6_15B_LONGALIGN,
    format_multinode_report,
    format_paper_report,
    multinode_report,
    paper_report,
)
from megatron_odc.tools.pipeline_report import format_pipeline_report, pipeline_report
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


def test_multinode_report_sets_every_multinode_cell_beside_full_and_hybrid_predictions(
    small_profiles,
) -> None:
    # Two of the cells at two minibatch sizes (the full report runs in ~20 s: docs/benchmarks.md).
    chosen = (MULTINODE_CELLS[0], MULTINODE_CELLS[3])
    report = multinode_report(
        hw=A100_ROCE,
        num_minibatches=1,
        seed=0,
        cap_tokens=65536,
        profiles_file=small_profiles,
        cells=chosen,
        minibatches=(1, 4),
    )
    cells = {(e["model"], e["profile"], e["gpus"], e["minibatch"]): e for e in report["cells"]}
    assert len(cells) == 2 * len(chosen)
    for key in chosen:
        for col, minibatch in ((0, 1), (2, 4)):
            entry = cells[(*key, minibatch)]
            for plan in ("odc+lb_micro", "odc+lb_mini"):
                assert entry[plan]["paper_pct"] == PAPER_TABLE5[key][plan][col]
                assert set(entry[plan]) == {"paper_pct", "odc", "odc_hybrid"}
    # App. E: the short setting divides lengths and cap by 8, for the LongAlign cells only.
    assert {(e["model"], e["cap_tokens"]) for e in report["short_cells"]} == {("14b", 8192)}
    text = format_multinode_report(report)
    assert text.startswith("Table 5 multi-node cells")
    assert "App. E short sequences" in text


def test_pipeline_report_cells(small_profiles) -> None:
    report = pipeline_report(
        hw=A100_ROCE,
        num_minibatches=1,
        seed=0,
        cap_tokens=65536,
        profiles_file=small_profiles,
        profiles=("longalign",),
        gpus=(16,),
        stages=(1, 2),
        minibatches=(2,),
    )
    assert [(c["pipeline_stages"], c["replicas"]) for c in report["cells"]] == [(1, 16), (2, 8)]
    for cell in report["cells"]:
        assert cell["odc+lb_micro_pct"] >= -1e-9  # same plan, ODC never waits longer
        assert set(cell["bubbles_pct"]) == {"fsdp+lb_micro", "odc+lb_micro", "odc+lb_mini"}
    assert format_pipeline_report(report).startswith("32b: speedup")
    with pytest.raises(ValueError, match="pipelines of 3 stages"):
        pipeline_report(
            hw=A100_ROCE,
            num_minibatches=1,
            seed=0,
            cap_tokens=65536,
            profiles_file=small_profiles,
            gpus=(16,),
            stages=(3,),
        )
