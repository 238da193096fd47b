"""The sail-sg/odc code's LB-Micro packing, re-implemented as a baseline for the offline tools.

Owns :func:`reference_lb_micro`, which re-plans an ``lb_micro`` plan the way sail-sg/odc's
``DynamicSameMicro`` packing does. Both tools report it as the ``lb_micro_ref`` plan kind: the
balance CLI (:mod:`megatron_odc.tools.balance_cli`) and the step-time simulator
(:mod:`megatron_odc.tools.simulator`). See docs/balancing.md.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_odc.balance.partition import karmarkar_karp, part_costs
from megatron_odc.balance.plan import Plan

__all__ = ["reference_lb_micro"]


def reference_lb_micro(plan: Plan) -> Plan:
    """Re-plans ``plan``'s samples the way sail-sg/odc's ``DynamicSameMicro`` packing does.

    KK with equal sample counts splits the minibatch over the ranks; every rank then splits its
    share with KK into k microbatches, where k starts at the max over ranks of
    ceil(tokens / cap) and grows until every rank's split is under the cap; microbatches are
    ordered heaviest first. It balances at rank level first, so it is a weaker baseline than
    ``lb_micro`` (which balances microbatches over the whole minibatch). A sample longer than the
    cap (the ``too_long="alone"`` policy of the plan) is planned alone in its own microbatch, as
    the other plans do, and counts as one of its rank's k microbatches; so every minibatch the
    other plans cover is covered here too.

    Args:
        plan: any plan; only its samples, planned lengths, cap, DP size and cost model are used.

    Returns:
        A plan of kind ``lb_micro`` over the same samples and planned lengths.
    """
    ids = sorted(plan.lengths)
    lengths = [plan.lengths[s] for s in ids]
    cap = plan.cap_tokens
    costs = plan.cost_model.costs(lengths)
    shares = karmarkar_karp(costs, plan.dp_size, equal_count=True)
    if cap is None:
        alone = [[] for _ in shares]
        rests = shares
        k = 1
    else:
        alone = [[i for i in share if lengths[i] > cap] for share in shares]
        rests = [[i for i in share if lengths[i] <= cap] for share in shares]
        k = max(
            1,
            *(
                len(over) + math.ceil(sum(lengths[i] for i in rest) / cap)
                for over, rest in zip(alone, rests)
            ),
        )
    while True:
        splits = []
        for over, rest in zip(alone, rests):
            parts = karmarkar_karp([costs[i] for i in rest], k - len(over))
            splits.append([[i] for i in over] + [[rest[j] for j in part] for part in parts])
        packed = (mb for split, over in zip(splits, alone) for mb in split[len(over) :])
        if cap is None or all(sum(lengths[i] for i in mb) <= cap for mb in packed):
            break
        k += 1
    microbatches = tuple(
        tuple(
            tuple(ids[i] for i in mb)
            for mb in sorted(
                split, key=lambda mb: (-part_costs(costs, [mb])[0], min(mb, default=0))
            )
        )
        for split in splits
    )
    return dataclasses.replace(plan, kind="lb_micro", microbatches=microbatches)
