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


def test_reference_plans_a_sample_over_the_cap_alone() -> None:
    # The same minibatches as the other plans: an oversize sample gets a microbatch of its own (one of its
    # rank's k), every rank still runs k microbatches, and the rest stay under the cap.
    cost = CostModel(a=0.0, b=1.0)
    lengths = [100, 900, 200, 300, 50, 450]
    base = make_plan(
        "lb_micro", list(range(6)), lengths, 2, cap_tokens=500, cost_model=cost, too_long="alone"
    )
    ref = reference_lb_micro(base)
    assert sorted(ref.sample_ids()) == list(range(6))
    assert len(set(ref.num_microbatches())) == 1
    owner = next(r for r, mbs in enumerate(ref.microbatches) if any(1 in mb for mb in mbs))
    assert (1,) in ref.microbatches[owner]
    for mbs in ref.microbatches:
        assert all(sum(lengths[s] for s in mb) <= 500 for mb in mbs if mb != (1,))
