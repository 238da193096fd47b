"""Tests of megatron_odc.data.sampler: plan agreement across ranks, coverage, resume, edge cases.

Layer 1 (pure functions, no process group): every rank's sampler is built in this process from the same
arguments, as the ranks of a job would, and the ranks' views are compared against each other and against
the dataset (each sample exactly once per epoch).
"""

from __future__ import annotations

import collections
import json
import random

import pytest

from megatron_odc.balance.cost import CostModel
from megatron_odc.balance.plan import PLAN_KINDS
from megatron_odc.data.sampler import LengthBalancedSampler


def _lengths(num_samples: int, seed: int = 0, low: int = 5, high: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [int(min(high, max(low, rng.lognormvariate(3.5, 0.8)))) for _ in range(num_samples)]


def _samplers(lengths, dp_size, **kwargs):
    return [
        LengthBalancedSampler(lengths, dp_size=dp_size, dp_rank=r, **kwargs) for r in range(dp_size)
    ]


def _check_minibatch(views, dp_size):
    """All ranks' views of one minibatch agree and cover it exactly once."""
    first = views[0]
    seen = collections.Counter()
    for rank, view in enumerate(views):
        assert (view.epoch, view.index) == (first.epoch, first.index)
        assert view.global_sample_ids == first.global_sample_ids
        assert view.num_microbatches_per_rank == first.num_microbatches_per_rank
        assert len(view.microbatches) == first.num_microbatches_per_rank[rank]
        # Every rank's plan says the same about every rank.
        for other in range(dp_size):
            assert (
                tuple(map(tuple, view.plan.rank_microbatches(other))) == views[other].microbatches
            )
        for mb in view.microbatches:
            seen.update(mb)  # lb_micro may give a rank empty microbatches to keep counts equal
    assert sorted(seen) == sorted(first.global_sample_ids)
    assert all(count == 1 for count in seen.values())
    return first.global_sample_ids


@pytest.mark.parametrize("plan_kind", PLAN_KINDS)
def test_ranks_agree_and_cover_each_epoch(plan_kind):
    lengths = _lengths(37)
    for dp_size in (1, 2, 3, 4):
        samplers = _samplers(
            lengths, dp_size, global_batch_size=10, seed=5, plan_kind=plan_kind, cap_tokens=256
        )
        orders = []
        for epoch in range(2):
            for s in samplers:
                s.set_epoch(epoch)
            per_rank = [list(s) for s in samplers]
            assert all(len(views) == len(samplers[0]) == 4 for views in per_rank)
            epoch_ids = []
            for views in zip(*per_rank, strict=True):
                epoch_ids += _check_minibatch(views, dp_size)
            assert sorted(epoch_ids) == list(range(len(lengths)))
            orders.append(epoch_ids)
        assert orders[0] != orders[1], "epochs should be shuffled differently"
    # The epoch order depends only on (seed, epoch), not on dp_size or the plan.
    other = LengthBalancedSampler(lengths, global_batch_size=7, dp_size=1, dp_rank=0, seed=5)
    assert other.epoch_order(1) == orders[1]
    assert (
        LengthBalancedSampler(
            lengths, global_batch_size=7, dp_size=1, dp_rank=0, seed=6
        ).epoch_order(1)
        != orders[1]
    )


def test_no_shuffle_follows_dataset_order():
    lengths = _lengths(11)
    (sampler,) = _samplers(lengths, 1, global_batch_size=4, shuffle=False)
    assert [v.global_sample_ids for v in sampler] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10)]


def test_partial_last_minibatch_and_drop_last():
    lengths = _lengths(23, seed=1)
    for drop_last, expected_sizes in ((False, [8, 8, 7]), (True, [8, 8])):
        samplers = _samplers(lengths, 3, global_batch_size=8, drop_last=drop_last, seed=2)
        assert len(samplers[0]) == len(expected_sizes)
        sizes, all_ids = [], []
        for views in zip(*[list(s) for s in samplers], strict=True):
            ids = _check_minibatch(views, 3)
            sizes.append(len(ids))
            all_ids += ids
        assert sizes == expected_sizes
        assert len(set(all_ids)) == len(all_ids) == sum(expected_sizes)
        order = samplers[0].epoch_order(0)
        assert all_ids == order[: sum(expected_sizes)]


@pytest.mark.parametrize("plan_kind", PLAN_KINDS)
def test_dp_size_larger_than_minibatch(plan_kind):
    lengths = _lengths(7, seed=3)
    samplers = _samplers(lengths, 5, global_batch_size=3, plan_kind=plan_kind, seed=0)
    for views in zip(*[list(s) for s in samplers], strict=True):
        ids = _check_minibatch(views, 5)
        assert len(views[0].num_microbatches_per_rank) == 5
        ranks_with_samples = [r for r in range(5) if any(views[r].microbatches)]
        assert 1 <= len(ranks_with_samples) <= len(ids) < 5


def test_too_long_samples():
    lengths = [10, 20, 30, 500, 40, 15, 25, 35]
    with pytest.raises(ValueError, match=r"sample 3 .*500"):
        LengthBalancedSampler(lengths, global_batch_size=4, dp_size=2, dp_rank=0, cap_tokens=100)
    samplers = _samplers(lengths, 2, global_batch_size=4, cap_tokens=100, too_long="truncate")
    seen = []
    for views in zip(*[list(s) for s in samplers], strict=True):
        seen += _check_minibatch(views, 2)
        plan = views[0].plan
        for sample_id in views[0].global_sample_ids:
            assert plan.lengths[sample_id] == min(lengths[sample_id], 100)
        for rank in range(2):
            for mb in plan.rank_microbatches(rank):
                assert sum(plan.lengths[i] for i in mb) <= 100
    assert sorted(seen) == list(range(len(lengths))), "truncation must not drop a sample"
    # 'alone': the long sample runs by itself, untruncated.
    samplers = _samplers(lengths, 2, global_batch_size=4, cap_tokens=100, too_long="alone")
    found = False
    for views in zip(*[list(s) for s in samplers], strict=True):
        _check_minibatch(views, 2)
        for view in views:
            for mb in view.microbatches:
                if 3 in mb:
                    assert mb == (3,)
                    assert view.plan.lengths[3] == 500
                    found = True
    assert found


def test_default_cap_is_longest_sample():
    lengths = _lengths(9, seed=4)
    (sampler,) = _samplers(lengths, 1, global_batch_size=9)
    assert sampler.cap_tokens == max(lengths)


def _run(sampler, num_epochs, stop_after=None):
    out = []
    for epoch in range(sampler.epoch, num_epochs):
        sampler.set_epoch(epoch)
        for view in sampler:
            out.append((view.epoch, view.index, view.global_sample_ids, view.microbatches))
            if stop_after is not None and len(out) == stop_after:
                return out
    return out


@pytest.mark.parametrize("stop_after", [0, 3, 5, 6, 9])
def test_resume_mid_epoch_matches_uninterrupted(stop_after):
    lengths = _lengths(29, seed=7)  # 5 minibatches of 6 per epoch (the last has 5)
    kwargs = {"global_batch_size": 6, "seed": 11, "plan_kind": "lb_mini", "cap_tokens": 300}
    for dp_rank in range(3):
        full = _run(LengthBalancedSampler(lengths, dp_size=3, dp_rank=dp_rank, **kwargs), 3)
        assert len(full) == 15
        first = LengthBalancedSampler(lengths, dp_size=3, dp_rank=dp_rank, **kwargs)
        head = _run(first, 3, stop_after=stop_after) if stop_after else []
        state = json.loads(json.dumps(first.state_dict()))  # a checkpoint holds plain types
        resumed = LengthBalancedSampler(lengths, dp_size=3, dp_rank=dp_rank, **kwargs)
        resumed.load_state_dict(state)
        assert head + _run(resumed, 3) == full


def test_resume_with_new_dp_size_keeps_samples():
    lengths = _lengths(29, seed=7)
    kwargs = {"global_batch_size": 6, "seed": 11, "cap_tokens": 300}
    full = _run(LengthBalancedSampler(lengths, dp_size=3, dp_rank=0, **kwargs), 2)
    first = LengthBalancedSampler(lengths, dp_size=3, dp_rank=0, **kwargs)
    _run(first, 2, stop_after=7)
    state = first.state_dict()
    resumed = _samplers(lengths, 2, **kwargs)
    for s in resumed:
        s.load_state_dict(state)
    rest = []
    for epoch in range(state["epoch"], 2):
        for s in resumed:
            s.set_epoch(epoch)
        for views in zip(*[list(s) for s in resumed], strict=True):
            rest.append(_check_minibatch(views, 2))
    assert rest == [ids for _, _, ids, _ in full[7:]]


def test_mismatched_state_is_rejected():
    lengths = _lengths(20)
    sampler = LengthBalancedSampler(lengths, global_batch_size=4, dp_size=2, dp_rank=0, seed=1)
    next(iter(sampler))
    state = sampler.state_dict()
    cases = [
        ("num_samples", {"lengths": lengths[:-1]}),
        ("global_batch_size", {"global_batch_size": 5}),
        ("seed", {"seed": 2}),
        ("shuffle", {"shuffle": False}),
    ]
    for field, change in cases:
        kwargs = {"lengths": lengths, "global_batch_size": 4, "dp_size": 2, "dp_rank": 0, "seed": 1}
        kwargs.update(change)
        other = LengthBalancedSampler(**kwargs)
        with pytest.raises(ValueError, match=field):
            other.load_state_dict(state)
    bad = dict(state, next_index=99)
    fresh = LengthBalancedSampler(lengths, global_batch_size=4, dp_size=2, dp_rank=0, seed=1)
    with pytest.raises(ValueError, match="next_index"):
        fresh.load_state_dict(bad)


def test_invalid_arguments():
    lengths = _lengths(8)
    with pytest.raises(ValueError, match="dp_rank"):
        LengthBalancedSampler(lengths, global_batch_size=4, dp_size=2, dp_rank=2)
    with pytest.raises(ValueError, match="plan_kind"):
        LengthBalancedSampler(lengths, global_batch_size=4, dp_size=2, dp_rank=0, plan_kind="x")
    with pytest.raises(ValueError, match="too_long"):
        LengthBalancedSampler(lengths, global_batch_size=4, dp_size=2, dp_rank=0, too_long="drop")
    with pytest.raises(ValueError, match="sample 2"):
        LengthBalancedSampler([3, 4, 0], global_batch_size=2, dp_size=1, dp_rank=0)
    with pytest.raises(ValueError, match="global_batch_size"):
        LengthBalancedSampler(lengths, global_batch_size=0, dp_size=1, dp_rank=0)


def test_cost_model_changes_split_not_samples():
    lengths = _lengths(24, seed=9, high=400)
    token_views = list(
        LengthBalancedSampler(lengths, global_batch_size=12, dp_size=3, dp_rank=0, cap_tokens=800)
    )
    quad = CostModel(1.0, 0.0)
    quad_views = list(
        LengthBalancedSampler(
            lengths, global_batch_size=12, dp_size=3, dp_rank=0, cap_tokens=800, cost_model=quad
        )
    )
    assert [v.global_sample_ids for v in token_views] == [v.global_sample_ids for v in quad_views]
