"""The 1F1B model against hand-computed schedules and its bounds, and pipeline-aware plans (issue 16)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from megatron_odc.balance import CostModel, make_plan
from megatron_odc.balance.pipeline import PipelineCost, one_f_one_b_time

TOKENS = CostModel(a=0.0, b=1.0)
QUADRATIC = CostModel(a=1.0, b=2.0e3)


@pytest.mark.parametrize(
    ("count", "stages"), [(1, 1), (5, 1), (1, 4), (3, 4), (4, 4), (9, 2), (7, 3)]
)
def test_equal_microbatches_take_m_plus_p_minus_1_slots(count: int, stages: int) -> None:
    forward, backward = 1.5, 3.0
    time = one_f_one_b_time([forward] * count, [backward] * count, stages)
    assert time == pytest.approx((count + stages - 1) * (forward + backward))


def test_hand_computed_schedule_with_unequal_microbatches() -> None:
    # p = 2, F = (1, 2), B = (2, 4). Stage 0 runs F0 F1 B0 B1, stage 1 F0 B0 F1 B1:
    # s0.F0 0-1, s1.F0 1-2, s1.B0 2-4, s0.F1 1-3, s0.B0 4-6, s1.F1 4-6, s1.B1 6-10, s0.B1 10-14.
    assert one_f_one_b_time([1, 2], [2, 4], 2) == pytest.approx(14.0)
    # A hop of 0.5 per microbatch and direction: s1.F0 1.5-2.5, s1.B0 2.5-4.5, s0.B0 5-7,
    # s1.F1 4.5-6.5, s1.B1 6.5-10.5, s0.B1 11-15.
    assert one_f_one_b_time([1, 2], [2, 4], 2, hop=[0.5, 0.5]) == pytest.approx(15.0)
    assert one_f_one_b_time([], [], 3) == 0.0
    with pytest.raises(ValueError, match="stages"):
        one_f_one_b_time([1.0], [2.0], 0)


@pytest.mark.parametrize("seed", range(6))
def test_time_between_the_bounds_and_one_stage_is_the_sum(seed: int) -> None:
    rng = random.Random(seed)
    costs = [rng.uniform(1.0, 50.0) for _ in range(rng.randint(1, 12))]
    stages = rng.randint(2, 6)
    time = PipelineCost(stages).time(costs)
    lower = sum(costs) / stages + (stages - 1) * min(costs) / stages
    upper = (len(costs) + stages - 1) * max(costs) / stages
    assert lower - 1e-9 <= time <= upper + 1e-9
    assert PipelineCost(1).time(costs) == pytest.approx(sum(costs))
    # The chosen order is a permutation and never slower than heaviest first.
    model = PipelineCost(stages)
    order, best = model.best_order(costs)
    assert sorted(order) == list(range(len(costs)))
    assert best == model.time([costs[i] for i in order])
    assert best <= model.time(sorted(costs, reverse=True)) + 1e-9


def test_overhead_and_floor() -> None:
    model = PipelineCost(1, microbatch_overhead=1.0, microbatch_floor=10.0)
    assert model.time([2.0, 20.0]) == pytest.approx(10.0 + 21.0)
    with pytest.raises(ValueError, match="microbatch_floor"):
        PipelineCost(2, microbatch_floor=-1.0)


def _lengths(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [int(rng.lognormvariate(7.0, 0.8)) + 1 for _ in range(count)]


@pytest.mark.parametrize("kind", ["lb_mini", "lb_micro", "local_sort", "round_robin"])
def test_one_stage_plans_are_the_plans_without_the_option(kind: str) -> None:
    lengths = _lengths(1, 40)
    ids = list(range(100, 140))
    base = make_plan(kind, ids, lengths, 5, cap_tokens=4000, cost_model=QUADRATIC, too_long="alone")
    same = make_plan(
        kind,
        ids,
        lengths,
        5,
        cap_tokens=4000,
        cost_model=QUADRATIC,
        too_long="alone",
        pipeline_stages=1,
        microbatch_overhead=123.0,
        microbatch_floor=1e9,
    )
    assert same.microbatches == base.microbatches
    assert "bubble_pipeline_odc" not in base.metrics()


def test_the_bubble_term_splits_a_replica_into_more_microbatches() -> None:
    # One replica, a cap that fits all 8 samples in one microbatch: without pipelines that is the
    # plan (FFD's count); with 4 stages one microbatch leaves 3 of 4 stages idle, so the planner
    # splits, and its modelled time beats the one-microbatch packing run through the pipeline.
    lengths = [100, 90, 80, 70, 60, 50, 40, 30]
    ids = list(range(8))
    flat = make_plan("lb_mini", ids, lengths, 1, cap_tokens=10_000, cost_model=TOKENS)
    assert flat.num_microbatches() == [1]
    piped = make_plan(
        "lb_mini", ids, lengths, 1, cap_tokens=10_000, cost_model=TOKENS, pipeline_stages=4
    )
    assert piped.num_microbatches()[0] > 1
    as_pipeline = dataclasses.replace(flat, pipeline_stages=4)
    assert piped.pipeline_odc_time() < as_pipeline.pipeline_odc_time()
    assert as_pipeline.pipeline_odc_time() == pytest.approx(sum(lengths))  # (1 + 3) slots of 1/4
    # A floor per microbatch (the parameter fetches every microbatch pays) makes small microbatches
    # cost: the planner trades back to fewer, larger ones.
    floored = make_plan(
        "lb_mini",
        ids,
        lengths,
        1,
        cap_tokens=10_000,
        cost_model=TOKENS,
        pipeline_stages=4,
        microbatch_floor=200.0,
    )
    assert floored.num_microbatches()[0] < piped.num_microbatches()[0]


@pytest.mark.parametrize("seed", range(4))
def test_pipeline_plans_keep_invariants_and_never_lose_to_the_flat_plan(seed: int) -> None:
    rng = random.Random(seed)
    replicas, stages = rng.randint(2, 5), rng.randint(2, 4)
    lengths = _lengths(seed, replicas * rng.randint(2, 8))
    ids = list(range(len(lengths)))
    options = {"cap_tokens": 3000, "cost_model": QUADRATIC, "too_long": "alone"}
    oversize = {i for i, n in enumerate(lengths) if n > 3000}
    for kind in ("lb_mini", "lb_micro"):
        plan = make_plan(kind, ids, lengths, replicas, pipeline_stages=stages, **options)
        assert sorted(plan.sample_ids()) == ids
        for mbs in plan.microbatches:
            for mb in mbs:
                if not (len(mb) == 1 and mb[0] in oversize):
                    assert sum(lengths[i] for i in mb) <= 3000
        flat = dataclasses.replace(
            make_plan(kind, ids, lengths, replicas, **options), pipeline_stages=stages
        )
        if kind == "lb_micro":
            assert len(set(plan.num_microbatches())) == 1  # equal counts for lockstep replicas
            assert plan.pipeline_lockstep_time() <= flat.pipeline_lockstep_time() * (1 + 1e-9)
        else:
            assert plan.pipeline_odc_time() <= flat.pipeline_odc_time() * (1 + 1e-9)
        metrics = plan.metrics()
        assert 0.0 <= metrics["bubble_pipeline_odc"] < 1.0
        assert metrics["pipeline_stages"] == stages
        again = make_plan(kind, ids, lengths, replicas, pipeline_stages=stages, **options)
        assert again.microbatches == plan.microbatches


def test_bad_pipeline_arguments_name_the_argument() -> None:
    with pytest.raises(ValueError, match="pipeline_stages"):
        make_plan("lb_mini", [0], [10], 1, cap_tokens=None, cost_model=TOKENS, pipeline_stages=0)
    with pytest.raises(ValueError, match="microbatch_overhead"):
        make_plan(
            "lb_mini",
            [0],
            [10],
            1,
            cap_tokens=None,
            cost_model=TOKENS,
            pipeline_stages=2,
            microbatch_overhead=-1.0,
        )
