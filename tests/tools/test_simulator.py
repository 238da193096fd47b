"""The step-time model against hand-computed schedules, the paper's volumes and Plan bubbles."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from megatron_odc.balance import CostModel, Plan, make_plan
from megatron_odc.tools.simulator import (
    HYBRID_ROWS,
    PIPELINE_ROWS,
    Hardware,
    ModelSpec,
    layer_comm_s,
    minibatch_allreduce_s,
    simulate,
    simulate_minibatches,
    simulate_plan,
)

# cost = tokens, so with flops_per_s=1 a sample of n tokens takes n s
TOKENS = CostModel(a=0.0, b=1.0)
NO_COMM = Hardware(flops_per_s=1.0, intra_node_gbps=1e15, inter_node_gbps=1e15, gpus_per_node=8)


def _plan(microbatches, lengths, cost=TOKENS) -> Plan:
    return Plan(
        kind="lb_mini",
        dp_size=len(microbatches),
        cap_tokens=None,
        microbatches=microbatches,
        lengths=lengths,
        cost_model=cost,
    )


def test_hand_computed_lockstep_and_odc_schedules() -> None:
    # rank 0 runs one microbatch of 6 s, rank 1 two of 3 s; 2 layers; per layer get 1 s, push 0.5 s.
    # Per layer a microbatch of c seconds: forward max(c/6, 1) + backward max(c/3, 1.5).
    plan = _plan((((0,),), ((1,), (2,))), {0: 6, 1: 3, 2: 3})
    # 2 ranks on one node: each gathers the peer's half, P/2 bytes, at 1 GB/s.
    hw = Hardware(flops_per_s=1.0, intra_node_gbps=1.0, inter_node_gbps=1.0, gpus_per_node=8)
    model = ModelSpec(
        num_layers=2, param_nbytes_per_layer=2e9, grad_nbytes_per_layer=1e9, cost=TOKENS
    )
    fsdp = simulate_plan(plan, "fsdp", model, hw)
    # index 0: max(6, 3) = 6 -> 2 * (max(1, 1) + max(2, 1.5)) = 6; index 1: max(0, 3) = 3 ->
    # 2 * (max(0.5, 1) + max(1, 1.5)) = 5.
    assert fsdp.time_s == pytest.approx(11.0)
    assert fsdp.busy_s == pytest.approx((6.0, 6.0))
    assert fsdp.bubble == pytest.approx((5.0 + 5.0) / 22.0)
    odc = simulate_plan(plan, "odc", model, hw)
    # rank 0: 6; rank 1: 5 + 5 = 10.
    assert odc.time_s == pytest.approx(10.0)
    assert odc.bubble == pytest.approx((4.0 + 4.0) / 20.0)
    # Without overlap (one CPU thread) every layer adds 1 s forward and 1.5 s backward of transfers:
    # 2 layers * 2.5 s = 5 s per microbatch slot on top of the compute.
    serial = dataclasses.replace(hw, overlap=False)
    assert simulate_plan(plan, "fsdp", model, serial).time_s == pytest.approx(6 + 3 + 2 * 5.0)
    assert simulate_plan(plan, "odc", model, serial).time_s == pytest.approx(max(6 + 5, 6 + 2 * 5))


def test_overhead_is_compute_of_every_microbatch() -> None:
    plan = _plan((((0,),), ((1,), (2,))), {0: 6, 1: 3, 2: 3})
    hw = Hardware(
        flops_per_s=1.0,
        intra_node_gbps=1e15,
        inter_node_gbps=1e15,
        gpus_per_node=8,
        microbatch_overhead_s=0.5,
    )
    model = ModelSpec(num_layers=4, param_nbytes_per_layer=1, grad_nbytes_per_layer=1, cost=TOKENS)
    assert simulate_plan(plan, "odc", model, hw).time_s == pytest.approx(7.0)
    assert simulate_plan(plan, "fsdp", model, hw).time_s == pytest.approx(6.5 + 3.5)
    # A per-step overhead (optimizer) is busy time on every rank: it shifts time, not idle time.
    stepped = simulate_plan(plan, "odc", model, dataclasses.replace(hw, step_overhead_s=1.0))
    assert stepped.time_s == pytest.approx(8.0)
    assert stepped.bubble == pytest.approx((8.0 - 7.5) / 16.0)


def test_volumes_match_the_papers_table2() -> None:
    # D = 16 ranks, G = 8 per node, shard K = 1e9 bytes; intra 100 GB/s per rank, inter 100 GB/s per
    # node (12.5 GB/s per rank). Ring: 7/8*15*K intra, 15*K/8 inter; ODC: 7*K intra, 8*K inter.
    hw = Hardware(flops_per_s=1.0, intra_node_gbps=100.0, inter_node_gbps=100.0, gpus_per_node=8)
    nbytes = 16e9
    ring = max(7 / 8 * 15e9 / 100e9, 15e9 / 8 / 12.5e9)
    odc = max(7e9 / 100e9, 8e9 / 12.5e9)
    assert layer_comm_s(hw, nbytes, 16, "fsdp") == pytest.approx(ring)
    assert layer_comm_s(hw, nbytes, 16, "odc") == pytest.approx(odc)
    # Within a node both move (D-1) * K over the intra-node link; latency per collective vs per
    # peer.
    lat = Hardware(
        flops_per_s=1.0, intra_node_gbps=10.0, inter_node_gbps=1.0, gpus_per_node=8, latency_s=1e-3
    )
    assert layer_comm_s(lat, 4e9, 4, "fsdp") == pytest.approx(3e9 / 10e9 + 1e-3)
    assert layer_comm_s(lat, 4e9, 4, "odc") == pytest.approx(3e9 / 10e9 + 3e-3)
    assert layer_comm_s(lat, 4e9, 1, "odc") == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_communication_reduces_to_the_plan_bubbles(seed: int) -> None:
    rng = random.Random(seed)
    dp = rng.choice([2, 3, 4])
    lengths = [rng.randint(50, 4000) for _ in range(dp * rng.randint(1, 5))]
    cost = CostModel(a=3e-4, b=1.0)
    model = ModelSpec(
        num_layers=7, param_nbytes_per_layer=1e6, grad_nbytes_per_layer=2e6, cost=cost
    )
    ids = list(range(len(lengths)))
    for kind in ("lb_mini", "lb_micro", "local_sort"):
        plan = make_plan(kind, ids, lengths, dp, cap_tokens=4096, cost_model=cost)
        fsdp = simulate_plan(plan, "fsdp", model, NO_COMM)
        odc = simulate_plan(plan, "odc", model, NO_COMM)
        assert fsdp.time_s == pytest.approx(plan.lockstep_time(), rel=1e-9)
        assert fsdp.bubble == pytest.approx(plan.bubble_lockstep(), abs=1e-9)
        assert odc.time_s == pytest.approx(max(plan.rank_costs()), rel=1e-9)
        assert odc.bubble == pytest.approx(plan.bubble_odc(), abs=1e-9)


def test_simulate_aggregates_and_speedups() -> None:
    rng = random.Random(7)
    pool = [rng.randint(100, 8000) for _ in range(400)]
    cost = CostModel(a=1e-4, b=1.0)
    model = ModelSpec(
        num_layers=4, param_nbytes_per_layer=1e6, grad_nbytes_per_layer=2e6, cost=cost
    )
    rows = simulate(
        pool, dp_size=4, minibatch=3, cap_tokens=8192, model=model, hw=NO_COMM, num_minibatches=5
    )
    by_name = {f"{r['schedule']}+{r['plan']}": r for r in rows}
    assert by_name["fsdp+lb_micro"]["speedup"] == 1.0
    for row in rows:
        assert row["time_s"] == pytest.approx(math.fsum(row["step_times_s"]))
        assert row["speedup"] == pytest.approx(by_name["fsdp+lb_micro"]["time_s"] / row["time_s"])
    # ODC never waits longer than lockstep on the same plan (a rank's sum <= sum of per-index
    # maxima).
    assert by_name["odc+lb_micro"]["time_s"] <= by_name["fsdp+lb_micro"]["time_s"] * (1 + 1e-12)
    assert by_name["odc+local_sort"]["time_s"] <= by_name["fsdp+local_sort"]["time_s"] * (1 + 1e-12)


def test_balanced_work_gives_no_bubble_and_no_speedup() -> None:
    model = ModelSpec(
        num_layers=2, param_nbytes_per_layer=1.0, grad_nbytes_per_layer=1.0, cost=TOKENS
    )
    rows = simulate_minibatches(
        [[1000] * 8, [1000] * 8], dp_size=2, cap_tokens=4000, model=model, hw=NO_COMM
    )
    for row in rows:
        assert row["bubble"] == pytest.approx(0.0, abs=1e-12)
        if row["plan"] != "local_sort":
            assert row["speedup"] == pytest.approx(1.0)


def test_errors_name_the_flag() -> None:
    model = ModelSpec(
        num_layers=1, param_nbytes_per_layer=1.0, grad_nbytes_per_layer=1.0, cost=TOKENS
    )
    with pytest.raises(ValueError, match="--dp"):
        simulate([1] * 4096, dp_size=1025, minibatch=1, cap_tokens=None, model=model, hw=NO_COMM)
    with pytest.raises(ValueError, match="--gpus-per-node"):
        Hardware(flops_per_s=1.0, intra_node_gbps=1.0, inter_node_gbps=1.0, gpus_per_node=0)
    with pytest.raises(ValueError, match="--model"):
        ModelSpec.from_preset("3b")
    with pytest.raises(ValueError, match="multiple of dp_size"):
        simulate_minibatches([[1, 2, 3]], dp_size=2, cap_tokens=None, model=model, hw=NO_COMM)


def test_hybrid_odc_stays_in_the_node_and_all_reduces_once_per_minibatch() -> None:
    # D = 32 ranks, G = 8 per node: the shard group is the node, P = 8e9 bytes per layer, K = 1e9.
    # Gather: 7 * K over the intra-node link (100 GB/s) + 7 peers' latency; nothing inter-node.
    hw = Hardware(
        flops_per_s=1.0,
        intra_node_gbps=100.0,
        inter_node_gbps=100.0,
        gpus_per_node=8,
        latency_s=1e-3,
    )
    assert layer_comm_s(hw, 8e9, 32, "odc_hybrid") == pytest.approx(7e9 / 100e9 + 7e-3)
    # Within one node hybrid and full sharding are the same thing.
    assert layer_comm_s(hw, 8e9, 8, "odc_hybrid") == layer_comm_s(hw, 8e9, 8, "odc")
    # All-reduce of W = 64e9 gradient bytes: each rank's shard W/8 over R = 4 replicas, a ring sends
    # 2 * 3/4 * 8e9 = 12e9 bytes per rank at 100/8 GB/s, plus one collective latency.
    assert minibatch_allreduce_s(hw, 64e9, 32) == pytest.approx(12e9 / 12.5e9 + 1e-3)
    assert minibatch_allreduce_s(hw, 64e9, 8) == 0.0
    with pytest.raises(ValueError, match="multiple of --gpus-per-node"):
        minibatch_allreduce_s(hw, 64e9, 12)
    # A step: per layer as ODC with the node-local volumes, then the all-reduce (idle time).
    plan = _plan(tuple(((r,),) for r in range(32)), dict.fromkeys(range(32), 6))
    model = ModelSpec(
        num_layers=2, param_nbytes_per_layer=8e9, grad_nbytes_per_layer=16e9, cost=TOKENS
    )
    get_s = layer_comm_s(hw, 8e9, 32, "odc_hybrid")
    push_s = layer_comm_s(hw, 16e9, 32, "odc_hybrid", push=True)
    expected = 2 * (max(1.0, get_s) + max(2.0, get_s + push_s)) + minibatch_allreduce_s(
        hw, 32e9, 32
    )
    step = simulate_plan(plan, "odc_hybrid", model, hw)
    assert step.time_s == pytest.approx(expected)
    assert step.bubble == pytest.approx((expected - 6.0) / expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pipelines_without_communication_reduce_to_the_plan_pipeline_times(seed: int) -> None:
    rng = random.Random(seed)
    replicas, stages = rng.choice([2, 3]), rng.choice([2, 4])
    lengths = [rng.randint(50, 4000) for _ in range(replicas * rng.randint(2, 6))]
    cost = CostModel(a=3e-4, b=1.0)
    model = ModelSpec(
        num_layers=8, param_nbytes_per_layer=1e6, grad_nbytes_per_layer=2e6, cost=cost
    )
    ids = list(range(len(lengths)))
    for kind in ("lb_mini", "lb_micro"):
        plan = make_plan(
            kind, ids, lengths, replicas, cap_tokens=4096, cost_model=cost, pipeline_stages=stages
        )
        fsdp = simulate_plan(plan, "fsdp", model, NO_COMM)
        odc = simulate_plan(plan, "odc", model, NO_COMM)
        assert fsdp.time_s == pytest.approx(plan.pipeline_lockstep_time(), rel=1e-9)
        assert fsdp.bubble == pytest.approx(plan.bubble_pipeline_lockstep(), abs=1e-9)
        assert odc.time_s == pytest.approx(plan.pipeline_odc_time(), rel=1e-9)
        assert odc.bubble == pytest.approx(plan.bubble_pipeline_odc(), abs=1e-9)


def test_pipeline_hops_and_simulate_rows() -> None:
    # One microbatch of 600 tokens through 2 stages: F, hop, F, B, hop, B; 1 byte per token at 1 kB/s
    # (intra-node: 2 replicas < 8 per node) is 0.6 s per hop.
    plan = dataclasses.replace(_plan((((0,),), ((1,),)), {0: 600, 1: 600}), pipeline_stages=2)
    slow = Hardware(flops_per_s=1.0, intra_node_gbps=1e-6, inter_node_gbps=1e-6, gpus_per_node=8)
    model = ModelSpec(
        num_layers=2,
        param_nbytes_per_layer=0.0,
        grad_nbytes_per_layer=0.0,
        cost=TOKENS,
        activation_nbytes_per_token=1.0,
    )
    assert simulate_plan(plan, "odc", model, slow).time_s == pytest.approx(600 + 2 * 0.6)
    pool = [random.Random(3).randint(100, 8000) for _ in range(64)]
    rows = simulate(
        pool,
        dp_size=2,
        minibatch=8,
        cap_tokens=8192,
        model=dataclasses.replace(model, activation_nbytes_per_token=0.0),
        hw=NO_COMM,
        num_minibatches=2,
        rows=PIPELINE_ROWS + HYBRID_ROWS[3:],
        pipeline_stages=2,
    )
    by_name = {f"{r['schedule']}+{r['plan']}": r for r in rows}
    assert by_name["odc+lb_mini"]["speedup"] >= 1.0
    assert by_name["odc+lb_micro"]["time_s"] <= by_name["fsdp+lb_micro"]["time_s"] * (1 + 1e-12)
    with pytest.raises(ValueError, match="lb_micro_ref"):
        simulate(
            pool,
            dp_size=2,
            minibatch=8,
            cap_tokens=8192,
            model=model,
            hw=NO_COMM,
            num_minibatches=1,
            pipeline_stages=2,
        )
