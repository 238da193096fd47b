"""Calibration from a benchmark file's telemetry, and the replay of its minibatches."""

from __future__ import annotations

import json

import pytest

from megatron_odc.balance import CostModel
from megatron_odc.tools.calibration import benchmark_report, calibrate_from_benchmark
from megatron_odc.tools.simulator import Hardware, ModelSpec

NO_COMM = Hardware(flops_per_s=1.0, intra_node_gbps=1e15, inter_node_gbps=1e15, gpus_per_node=8)


def _fake_benchmark() -> dict:
    """A two-rank benchmark file: one cell, one repeat, odc and fsdp on the same plan."""
    cost = {"a": 0.0, "b": 0.01}  # 0.01 s per token
    lengths = [100, 300, 200, 400]  # sample ids 0..3
    plan = [[[0, 2]], [[1], [3]]]  # rank 0: one microbatch of 3 s, rank 1: 3 s and 4 s

    def record(wall, events):
        return {"wall_s": wall, "events": events, "plan": plan, "lengths": lengths}

    odc = [
        record(
            7.0,
            [
                ["fetch_wait", 0.0, 0.5],
                ["push", 2.0, 2.6],
                ["fence", 6.0, 6.5],
                ["optimizer", 6.5, 7.0],
            ],
        ),
        record(7.0, [["fetch_wait", 0.0, 0.1], ["fetch_wait", 1.0, 1.3], ["optimizer", 6.5, 7.0]]),
    ]
    fsdp = [record(8.0, [["optimizer", 7.0, 7.2]]), record(8.0, [["optimizer", 7.0, 7.4]])]
    return {
        "meta": {"settings": {"cost": cost, "length_scale": 16}, "model": {"num_layers": 2}},
        "comm_probe": {"allgather_layer_s": 0.002},
        "results": [
            {
                "profile": "p",
                "minibatch": 1,
                "steps": {"odc+lb_mini": [odc], "fsdp+lb_micro": [fsdp]},
            }
        ],
    }


def test_calibration_from_benchmark_telemetry() -> None:
    hw = calibrate_from_benchmark(_fake_benchmark(), microbatch_overhead_s=0.5)
    # Predicted compute: rank 0 3 s + 0.5 s overhead, rank 1 7 s + 2 x 0.5 s: 11.5 s in all;
    # measured busy: rank 0 7 - 0.5 - 0.6 - 0.5 - 0.5 = 4.9 s, rank 1 7 - 0.1 - 0.3 - 0.5 = 6.1 s:
    # 11.5 / 11.0.
    assert hw.flops_per_s == pytest.approx(11.5 / 11.0)
    assert hw.push_latency_factor == pytest.approx(0.6 / 0.3)  # push median / fetch median
    assert hw.collective_push_latency_factor == 1.0  # no fsdp transfers recorded
    assert hw.latency_s == pytest.approx(0.3)  # median of the odc fetch waits 0.5, 0.1, 0.3
    assert hw.collective_latency_s == 0.002
    assert hw.step_overhead_s == pytest.approx(0.45)  # median of 0.5, 0.5, 0.2, 0.4
    assert hw.overlap is False
    assert hw.gpus_per_node == 2


def test_benchmark_report_replays_the_benchmark_minibatches(tmp_path) -> None:
    data = _fake_benchmark()
    data["rows"] = [
        {
            "profile": "p",
            "minibatch_per_rank": 1,
            "config": "fsdp+lb_micro",
            "step_s": [8.0],
            "speedup_vs_baseline_total": 1.0,
        },
        {
            "profile": "p",
            "minibatch_per_rank": 1,
            "config": "odc+lb_mini",
            "step_s": [7.0],
            "speedup_vs_baseline_total": 8.0 / 7.0,
        },
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    cost = CostModel(a=0.0, b=0.01)
    model = ModelSpec(
        num_layers=2, param_nbytes_per_layer=1.0, grad_nbytes_per_layer=1.0, cost=cost
    )
    cells = {c["config"]: c for c in benchmark_report(str(path), hw=NO_COMM, model=model)}
    # Oracle: the same four lengths planned by hand. At cap 4096 (65536 / 16) both plans give each
    # rank one microbatch of 500 tokens ({400, 100} and {300, 200}): 5 s per step.
    assert cells["fsdp+lb_micro"]["predicted_step_s"] == pytest.approx(5.0)
    assert cells["odc+lb_mini"]["predicted_step_s"] == pytest.approx(5.0)
    assert cells["odc+lb_mini"]["measured_step_s"] == 7.0
    assert cells["odc+lb_mini"]["ratio"] == pytest.approx(1.0 / (8.0 / 7.0))
