"""The sail-sg/odc LB-Micro baseline: same samples, equal counts per rank, under the cap, sorted."""

from __future__ import annotations

import random

import pytest

from megatron_odc.balance import CostModel, make_plan
from megatron_odc.tools.reference import reference_lb_micro


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_keeps_samples_counts_and_cap(seed: int) -> None:
    rng = random.Random(seed)
    dp, per_rank, cap = rng.choice([2, 4]), rng.randint(1, 6), 8192
    lengths = [rng.randint(50, cap) for _ in range(dp * per_rank)]
    cost = CostModel(a=1e-4, b=1.0)
    base = make_plan(
        "lb_micro", list(range(len(lengths))), lengths, dp, cap_tokens=cap, cost_model=cost
    )
    ref = reference_lb_micro(base)
    assert ref is not None
    assert ref.kind == "lb_micro"
    assert sorted(ref.sample_ids()) == sorted(base.sample_ids())
    assert [sum(len(mb) for mb in mbs) for mbs in ref.microbatches] == [per_rank] * dp
    # Every rank splits into the same number of microbatches, each under the cap, heaviest first.
    assert len(set(ref.num_microbatches())) == 1
    for rank, mbs in enumerate(ref.microbatches):
        assert all(sum(lengths[s] for s in mb) <= cap for mb in mbs)
        costs = ref.microbatch_costs(rank)
        assert costs == sorted(costs, reverse=True)


def test_reference_gives_up_on_a_sample_over_the_cap() -> None:
    cost = CostModel(a=0.0, b=1.0)
    base = make_plan(
        "lb_micro", [0, 1], [100, 900], 2, cap_tokens=500, cost_model=cost, too_long="alone"
    )
    assert reference_lb_micro(base) is None
