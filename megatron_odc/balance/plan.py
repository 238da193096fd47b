"""Per-minibatch microbatch plans: which DP rank runs which samples, in which microbatches.

Owns :class:`Plan` and :func:`make_plan`. A plan is a pure function of (kind, sample ids, lengths, DP size, cap,
cost model, too_long policy), so every rank computes the same plan with no communication. Plans also predict
their bubble rate under the cost model for an ODC schedule and for a lockstep (collective) schedule; see
[Note: pipelines]
With ``pipeline_stages = p > 1`` a "rank" of the plan is one DP replica: a pipeline of ``p`` stages that all run
the replica's one microbatch list, so the counts of a replica's stages are equal by construction; replicas may
differ (``lb_mini``), including 0. A replica's time is its 1F1B makespan (``balance/pipeline.py``), which adds
the fill/drain bubble, about ``p - 1`` stage slots, to ``sum(c) / p``. That bubble shrinks with smaller
microbatches, so the token cap's fewest microbatches are no longer the best choice:
- ``lb_mini``: the split over replicas starts as without pipelines (KK + refine by cost); each replica then
  tries k = its FFD count, k + 1, ... (each packed like a rank's microbatches, at most one sample each), puts
  each packing in the order the 1F1B model finds fastest (heaviest first, lightest first, or light at both
  ends) and keeps the count with the shortest modelled time, stopping after ``PIPELINE_PATIENCE`` counts
  without gain. What makes more, smaller microbatches cost something is ``microbatch_overhead`` (added to every
  microbatch) and ``microbatch_floor`` (the least a microbatch takes: under ODC each microbatch fetches every
  layer's parameters, which a small one cannot hide); with both 0 the search splits as far as it helps.
  Equal costs are not equal pipeline times (a heavy microbatch lengthens fill and drain), so samples then move
  from the slowest replica to the fastest while that shortens the slowest (``PIPELINE_MOVE_CANDIDATES`` tries per
  round, at most one round per replica).
- ``lb_micro``: the same per-replica count M for every replica, tried from the smallest that fits upward the
  same way, scored by the lockstep 1F1B time of the per-index max over replicas.
- ``local_sort`` and ``round_robin`` do not change.
With ``p = 1`` nothing of this runs: every plan is bit-identical to a plan made without the option, unless a
``microbatch_overhead`` is given ([Note: microbatch overhead]).

[Note: microbatch overhead]
Without pipelines LB-Mini balances the samples' costs, so a rank of one long sample and a rank of seven short
ones get the same share, although the second pays the fixed cost of a microbatch (kernel launches, Python,
parameter fetches) seven times. With ``microbatch_overhead > 0`` (``p = 1``) each rank's time is the sum of
its microbatches' costs plus the overhead per microbatch, and LB-Mini moves samples from the slowest rank to
the fastest as for pipelines (each rank's count is its packing's, at least the token cap's FFD count). A
measured cost model (``CostModel.fit``) gives the overhead; with 0 the plans are as before.

[Note: bubble rates]. Pure Python; imports neither torch nor megatron.

[Note: plan kinds]
- ``lb_mini`` (ODC): KK + refine over the whole minibatch into ``dp_size`` parts of balanced cost (sample counts
  may differ; a rank may get no sample). Each rank packs its part into microbatches under the cap: first-fit-
  decreasing by tokens gives the count k, then the k microbatches are re-balanced by cost (KK + cap repair +
  refine, or FFD + refine, whichever has the lighter heaviest microbatch).
- ``lb_micro`` (collective baseline): every rank runs the same number M of microbatches, the smallest M for
  which the packer finds ``dp_size * M`` microbatches under the cap. The samples are split into those
  microbatches by cost (KK + refine under the cap), the microbatches sorted by cost and dealt in rounds of
  ``dp_size``, heaviest round first, each microbatch of a round to the rank with the lightest running total.
  Only when there are fewer samples than ``dp_size * M`` does a rank get an empty microbatch (an empty tuple):
  it still runs that slot (a forward/backward on no tokens) so the collective counts match.
- ``local_sort`` (LongAlign's sorted batching): rank r takes the r-th contiguous slice of the given order
  (counts differ by at most one), sorted by length descending, one sample per microbatch.
- ``round_robin``: sample i of the given order goes to rank ``i % dp_size``, packed first-fit in that order.
In every plan a rank's microbatches are ordered heaviest first (cost, then first sample position), and a
sample longer than the cap is, by ``too_long``, an error, truncated to the cap, or put alone in its own
microbatch (the only case where a microbatch exceeds the cap). No sample is ever dropped.

[Note: bubble rates]
With c_r the cost of rank r's microbatches and N ranks:
- ODC: ranks synchronize once per minibatch, so T = max_r sum(c_r); bubble = sum_r (T - sum(c_r)) / (N * T).
- Lockstep: collectives put a barrier at every layer of every microbatch, so microbatch index i takes
  t_i = max_r c_r[i] (0 for a rank without an i-th microbatch); T = sum_i t_i;
  bubble = sum_r (T - sum(c_r)) / (N * T). Per-layer barriers scale every layer by the same factor under this
  cost model, so the per-layer max equals the per-microbatch max.
Both ignore communication time and kernel efficiency: they are the imbalance bubbles of the cost model, as in
the ODC paper's Table 6.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Mapping, Sequence

from megatron_odc.balance.cost import CostModel
from megatron_odc.balance.partition import (
    balanced_partition,
    first_fit,
    first_fit_decreasing,
    heaviest_lower_bound,
    karmarkar_karp,
    part_costs,
    refine,
    repair_cap,
)
from megatron_odc.balance.pipeline import PipelineCost

__all__ = ["EQUAL_COUNT_PLAN_KINDS", "PLAN_KINDS", "TOO_LONG_POLICIES", "Plan", "make_plan"]

PLAN_KINDS = ("lb_mini", "lb_micro", "local_sort", "round_robin")
"""Every plan kind; see [Note: plan kinds]."""

EQUAL_COUNT_PLAN_KINDS = ("lb_micro",)
"""Plan kinds that give every DP rank the same number of microbatches (what lockstep backends need)."""

TOO_LONG_POLICIES = ("error", "truncate", "alone")

BALANCE_TOLERANCE = 1e-4
"""A split (of a minibatch over ranks, of a rank's samples over microbatches) stops improving once its heaviest
part is within this relative distance of the lower bound max(mean part, largest sample): at most 0.01 points
of bubble above the best possible split, and far less search at scale (see docs/balancing.md, planner speed)."""

PIPELINE_PATIENCE = 3
"""With pipelines, the search over microbatch counts stops after this many counts in a row that do not shorten the
modelled 1F1B time (see [Note: pipelines])."""

PIPELINE_MOVE_CANDIDATES = 3
"""With pipelines, ``lb_mini`` tries this many samples per round when moving work off the slowest replica."""

_PIPELINE_MIN_GAIN = 1e-9
"""A count must shorten the modelled pipeline time by more than this fraction to count as better (float noise)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The microbatches of every DP rank for one minibatch (see [Note: plan kinds]).

    Attributes:
        kind: one of :data:`PLAN_KINDS`.
        dp_size: number of DP ranks.
        cap_tokens: token cap per microbatch, or ``None`` for no cap.
        microbatches: ``[dp_rank][microbatch] -> sample ids``, heaviest microbatch first.
        lengths: sample id -> length as planned (after truncation).
        cost_model: the cost model the plan was balanced with.
        pipeline_stages: pipeline stages per DP replica ``p``; with ``p > 1`` a "rank" of the plan is
            one replica, whose every stage runs its microbatches (see [Note: pipelines]).
        microbatch_overhead: fixed cost per microbatch (cost units) the pipeline model adds.
        microbatch_floor: least cost of a microbatch in the pipeline model (see
            :class:`~megatron_odc.balance.pipeline.PipelineCost`).
    """

    kind: str
    dp_size: int
    cap_tokens: int | None
    microbatches: tuple[tuple[tuple[int, ...], ...], ...]
    lengths: Mapping[int, int]
    cost_model: CostModel
    pipeline_stages: int = 1
    microbatch_overhead: float = 0.0
    microbatch_floor: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in PLAN_KINDS:
            raise ValueError(f"plan kind must be one of {PLAN_KINDS}, got {self.kind!r}")
        if len(self.microbatches) != self.dp_size:
            raise ValueError(
                f"plan has microbatches for {len(self.microbatches)} ranks, dp_size={self.dp_size}"
            )

    def rank_microbatches(self, dp_rank: int) -> tuple[tuple[int, ...], ...]:
        """Returns the microbatches (tuples of sample ids) of ``dp_rank``, heaviest first."""
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={self.dp_size})")
        return self.microbatches[dp_rank]

    def num_microbatches(self) -> list[int]:
        """Returns the number of microbatches of each rank."""
        return [len(mbs) for mbs in self.microbatches]

    def sample_ids(self) -> list[int]:
        """Returns every planned sample id, rank by rank, microbatch by microbatch."""
        return [sid for mbs in self.microbatches for mb in mbs for sid in mb]

    def microbatch_costs(self, dp_rank: int) -> list[float]:
        """Returns the cost of each microbatch of ``dp_rank``."""
        model = self.cost_model
        return [
            math.fsum(model.sample_cost(self.lengths[sid]) for sid in mb)
            for mb in self.rank_microbatches(dp_rank)
        ]

    def rank_costs(self) -> list[float]:
        """Returns the total cost of each rank."""
        return [math.fsum(self.microbatch_costs(r)) for r in range(self.dp_size)]

    def rank_tokens(self) -> list[int]:
        """Returns the planned tokens of each rank."""
        return [sum(self.lengths[sid] for mb in mbs for sid in mb) for mbs in self.microbatches]

    def bubble_odc(self) -> float:
        """Returns the ODC-schedule bubble rate (see [Note: bubble rates])."""
        totals = self.rank_costs()
        longest = max(totals)
        if longest <= 0:
            return 0.0
        return math.fsum(longest - t for t in totals) / (self.dp_size * longest)

    def lockstep_time(self) -> float:
        """Returns the lockstep-schedule time: sum over microbatch index of the max cost over ranks."""
        per_rank = [self.microbatch_costs(r) for r in range(self.dp_size)]
        depth = max(len(c) for c in per_rank)
        return math.fsum(max(c[i] if i < len(c) else 0.0 for c in per_rank) for i in range(depth))

    def bubble_lockstep(self) -> float:
        """Returns the lockstep-schedule bubble rate (see [Note: bubble rates])."""
        total = self.lockstep_time()
        if total <= 0:
            return 0.0
        return math.fsum(total - t for t in self.rank_costs()) / (self.dp_size * total)

    def pipeline_cost(self) -> PipelineCost:
        """The pipeline model of this plan (see [Note: pipelines])."""
        return PipelineCost(self.pipeline_stages, self.microbatch_overhead, self.microbatch_floor)

    def replica_pipeline_time(self, dp_rank: int) -> float:
        """Returns the modelled 1F1B time of replica ``dp_rank`` (see [Note: pipelines])."""
        return self.pipeline_cost().time(self.microbatch_costs(dp_rank))

    def pipeline_odc_time(self) -> float:
        """Returns the ODC step time with pipelines: the slowest replica's 1F1B time."""
        return max(self.replica_pipeline_time(r) for r in range(self.dp_size))

    def pipeline_lockstep_time(self) -> float:
        """Returns the lockstep step time with pipelines: 1F1B of the max over replicas per index."""
        per_rank = [self.microbatch_costs(r) for r in range(self.dp_size)]
        depth = max(len(c) for c in per_rank)
        slots = [max(c[i] if i < len(c) else 0.0 for c in per_rank) for i in range(depth)]
        return self.pipeline_cost().time(slots)

    def _pipeline_bubble(self, total: float) -> float:
        """Idle stage-time / (replicas * stages * ``total``); a stage's busy time is its compute share."""
        if total <= 0:
            return 0.0
        overhead = self.microbatch_overhead
        busy = [
            (math.fsum(self.microbatch_costs(r)) + overhead * len(self.microbatches[r]))
            / self.pipeline_stages
            for r in range(self.dp_size)
        ]
        return math.fsum(total - b for b in busy) / (self.dp_size * total)

    def bubble_pipeline_odc(self) -> float:
        """Returns the ODC bubble rate with pipelines (fill/drain and imbalance)."""
        return self._pipeline_bubble(self.pipeline_odc_time())

    def bubble_pipeline_lockstep(self) -> float:
        """Returns the lockstep bubble rate with pipelines (fill/drain and imbalance)."""
        return self._pipeline_bubble(self.pipeline_lockstep_time())

    def metrics(self) -> dict:
        """Returns balance metrics of the plan.

        Keys: ``kind``, ``dp_size``, ``num_samples``, ``max_cost``, ``mean_cost``, ``min_cost``, ``spread``
        (max - min cost), ``imbalance_ratio`` (max / mean cost), ``tokens_per_rank``, ``sum_sq_tokens_per_rank``
        (sum of s**2 per rank), ``num_microbatches_per_rank``, ``max_microbatch_tokens``, ``odc_time``
        (max rank cost), ``lockstep_time``, ``bubble_odc``, ``bubble_lockstep``.
        """
        costs = self.rank_costs()
        mean = math.fsum(costs) / self.dp_size
        mb_tokens = [sum(self.lengths[s] for s in mb) for mbs in self.microbatches for mb in mbs]
        return {
            "kind": self.kind,
            "dp_size": self.dp_size,
            "num_samples": len(self.lengths),
            "max_cost": max(costs),
            "mean_cost": mean,
            "min_cost": min(costs),
            "spread": max(costs) - min(costs),
            "imbalance_ratio": max(costs) / mean if mean > 0 else 1.0,
            "tokens_per_rank": self.rank_tokens(),
            "sum_sq_tokens_per_rank": [
                sum(self.lengths[s] ** 2 for mb in mbs for s in mb) for mbs in self.microbatches
            ],
            "num_microbatches_per_rank": self.num_microbatches(),
            "max_microbatch_tokens": max(mb_tokens, default=0),
            "odc_time": max(costs),
            "lockstep_time": self.lockstep_time(),
            "bubble_odc": self.bubble_odc(),
            "bubble_lockstep": self.bubble_lockstep(),
        } | (
            {
                "pipeline_stages": self.pipeline_stages,
                "pipeline_odc_time": self.pipeline_odc_time(),
                "pipeline_lockstep_time": self.pipeline_lockstep_time(),
                "bubble_pipeline_odc": self.bubble_pipeline_odc(),
                "bubble_pipeline_lockstep": self.bubble_pipeline_lockstep(),
            }
            if self.pipeline_stages > 1
            else {}
        )


def make_plan(
    kind: str,
    sample_ids: Sequence[int],
    lengths: Sequence[int],
    dp_size: int,
    *,
    cap_tokens: int | None,
    cost_model: CostModel,
    too_long: str = "error",
    pipeline_stages: int = 1,
    microbatch_overhead: float = 0.0,
    microbatch_floor: float = 0.0,
) -> Plan:
    """Plans one minibatch (see [Note: plan kinds]).

    Args:
        kind: one of :data:`PLAN_KINDS`.
        sample_ids: distinct sample ids of the minibatch, in order (the order matters for ``local_sort`` and
            ``round_robin``, and for tie-breaking).
        lengths: token length of each sample, aligned with ``sample_ids``.
        dp_size: number of DP ranks.
        cap_tokens: token cap per microbatch, or ``None`` for no cap.
        cost_model: per-sample cost model.
        too_long: what to do with a sample longer than ``cap_tokens``: ``"error"`` (ValueError), ``"truncate"``
            (plan it at ``cap_tokens`` tokens) or ``"alone"`` (its own microbatch, over the cap).
        pipeline_stages: pipeline stages per DP replica; with more than 1, ``dp_size`` counts replicas
            (pipelines), each replica's microbatch list is what every one of its stages runs, and
            ``lb_mini`` / ``lb_micro`` choose the microbatches that minimise the modelled 1F1B time
            (see [Note: pipelines]). With 1 (the default) every plan is what it was without the option.
        microbatch_overhead: fixed cost per microbatch, in cost units, that the pipeline model adds
            (kernel launches, stage-to-stage sends); used with ``pipeline_stages > 1``, and by ``lb_mini``
            without pipelines (see [Note: microbatch overhead]).
        microbatch_floor: least cost of a microbatch in the pipeline model (the parameter fetches a
            microbatch pays whatever its size); used only with ``pipeline_stages > 1``.

    Returns:
        The plan; identical on every rank for identical inputs.

    Raises:
        ValueError: an argument is invalid, or a sample is longer than the cap with ``too_long="error"``.
    """
    if kind not in PLAN_KINDS:
        raise ValueError(f"plan kind must be one of {PLAN_KINDS}, got {kind!r}")
    if too_long not in TOO_LONG_POLICIES:
        raise ValueError(f"too_long must be one of {TOO_LONG_POLICIES}, got {too_long!r}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if cap_tokens is not None and cap_tokens < 1:
        raise ValueError(f"cap_tokens must be >= 1 or None, got {cap_tokens}")
    pipeline = PipelineCost(pipeline_stages, microbatch_overhead, microbatch_floor)  # validates
    if len(sample_ids) != len(lengths):
        raise ValueError(f"got {len(sample_ids)} sample ids but {len(lengths)} lengths")
    if len(set(sample_ids)) != len(sample_ids):
        seen: set[int] = set()
        dup = next(s for s in sample_ids if s in seen or seen.add(s))
        raise ValueError(f"sample id {dup} appears more than once in the minibatch")

    tokens: list[int] = []
    oversize: set[int] = set()  # positions planned alone over the cap
    for pos, (sid, length) in enumerate(zip(sample_ids, lengths, strict=True)):
        if length < 0:
            raise ValueError(f"sample {sid} has negative length {length}")
        if cap_tokens is not None and length > cap_tokens:
            if too_long == "error":
                raise ValueError(
                    f"sample {sid} has length {length} > cap_tokens={cap_tokens}; "
                    "pass too_long='truncate' or too_long='alone'"
                )
            if too_long == "truncate":
                length = cap_tokens
            else:
                oversize.add(pos)
        tokens.append(int(length))
    costs = cost_model.costs(tokens)

    if kind == "lb_mini":
        per_rank = _plan_lb_mini(costs, tokens, dp_size, cap_tokens, oversize, pipeline)
    elif kind == "lb_micro":
        per_rank = _plan_lb_micro(costs, tokens, dp_size, cap_tokens, oversize, pipeline)
    elif kind == "local_sort":
        per_rank = _plan_local_sort(tokens, dp_size)
    else:
        per_rank = _plan_round_robin(costs, tokens, dp_size, cap_tokens, oversize)

    microbatches = tuple(
        tuple(tuple(sample_ids[pos] for pos in sorted(mb)) for mb in mbs) for mbs in per_rank
    )
    plan = Plan(
        kind=kind,
        dp_size=dp_size,
        cap_tokens=cap_tokens,
        microbatches=microbatches,
        lengths=dict(zip(sample_ids, tokens, strict=True)),
        cost_model=cost_model,
        pipeline_stages=pipeline_stages,
        microbatch_overhead=microbatch_overhead,
        microbatch_floor=microbatch_floor,
    )
    assert sorted(plan.sample_ids()) == sorted(sample_ids), "plan lost or duplicated a sample"
    return plan


# Helpers work on positions 0..n-1 of the minibatch; make_plan maps them back to sample ids.


def _heaviest_first(costs: Sequence[float], mbs: list[list[int]]) -> list[list[int]]:
    """Orders microbatches by cost descending, then by first position; empty ones last."""
    return sorted(mbs, key=lambda mb: (-math.fsum(costs[i] for i in mb), min(mb, default=math.inf)))


def _fill_empty(costs: Sequence[float], parts: list[list[int]]) -> list[list[int]]:
    """Gives every empty part one item while another part has two or more.

    The cheapest item of the part with the most items moves, so the heaviest part never gets heavier.
    """
    parts = [list(p) for p in parts]
    # Donors by (most items, lowest index). Only a donor's count changes, and it is popped to change.
    donors = [(-len(p), d) for d, p in enumerate(parts) if len(p) >= 2]
    heapq.heapify(donors)
    for j in range(len(parts)):
        if parts[j]:
            continue
        if not donors:
            break
        _, donor = heapq.heappop(donors)
        item = min(parts[donor], key=lambda i: (costs[i], i))
        parts[donor].remove(item)
        parts[j].append(item)
        if len(parts[donor]) >= 2:
            heapq.heappush(donors, (-len(parts[donor]), donor))
    return parts


def _pack_k(
    costs: Sequence[float],
    tokens: Sequence[int],
    items: Sequence[int],
    k: int,
    cap_tokens: int,
    ffd: list[list[int]] | None = None,
) -> list[list[int]] | None:
    """Splits ``items`` into ``k`` microbatches under the cap, balanced by cost; ``None`` if not found.

    Two candidates: KK by cost (repaired under the cap if needed) and FFD by tokens (if it needs at most k bins),
    both refined by cost under the cap; the one with the lighter heaviest microbatch wins (KK on ties). FFD is
    not tried when KK is already within :data:`BALANCE_TOLERANCE` of the lower bound. ``ffd``: FFD's bins of
    ``items`` (positions in ``items``) when the caller has them already.
    """
    sub_costs = [costs[i] for i in items]
    sub_tokens = [tokens[i] for i in items]
    good_enough = heaviest_lower_bound(sub_costs, k) * (1.0 + BALANCE_TOLERANCE)

    if k == 1 and sum(sub_tokens) <= cap_tokens:
        return [list(items)]

    def ffd_candidate() -> list[list[int]] | None:
        bins = first_fit_decreasing(sub_tokens, cap_tokens) if ffd is None else ffd
        return (
            [list(b) for b in bins] + [[] for _ in range(k - len(bins))] if len(bins) <= k else None
        )

    def kk_candidate() -> list[list[int]] | None:
        kk = karmarkar_karp(sub_costs, k)
        if any(sum(sub_tokens[i] for i in p) > cap_tokens for p in kk):
            return repair_cap(sub_costs, sub_tokens, kk, cap_tokens)
        return kk

    best: list[list[int]] | None = None
    best_max = math.inf
    for candidate in (kk_candidate, ffd_candidate):
        if best_max <= good_enough:
            break  # KK is already within the tolerance of the bound: FFD cannot win by more
        parts = candidate()
        if parts is None:
            continue
        parts = refine(
            sub_costs, parts, tokens=sub_tokens, cap_tokens=cap_tokens, rel_tol=BALANCE_TOLERANCE
        )
        parts = _fill_empty(sub_costs, parts)
        heaviest = max(part_costs(sub_costs, parts), default=0.0)
        if heaviest < best_max:
            best, best_max = parts, heaviest
    if best is None:
        return None
    assert all(sum(sub_tokens[i] for i in p) <= cap_tokens for p in best), "packer broke the cap"
    return [[items[i] for i in p] for p in best]


def _pack_rank(
    costs: Sequence[float],
    tokens: Sequence[int],
    items: Sequence[int],
    cap_tokens: int | None,
    oversize: set[int],
) -> list[list[int]]:
    """Packs one rank's samples into the fewest microbatches FFD finds, balanced by cost, heaviest first."""
    alone = [[i] for i in items if i in oversize]
    rest = [i for i in items if i not in oversize]
    if not rest:
        packed: list[list[int]] = []
    elif cap_tokens is None:
        packed = [list(rest)]
    else:
        ffd = first_fit_decreasing([tokens[i] for i in rest], cap_tokens)
        packed = _pack_k(costs, tokens, rest, len(ffd), cap_tokens, ffd)
        assert packed is not None, "FFD's own packing is always a candidate"
    return _heaviest_first(costs, alone + packed)


def _plan_lb_mini(costs, tokens, dp_size, cap_tokens, oversize, pipeline) -> list[list[list[int]]]:
    parts = balanced_partition(costs, dp_size, rel_tol=BALANCE_TOLERANCE)
    if pipeline.stages > 1 or pipeline.microbatch_overhead > 0:  # [Note: microbatch overhead]
        return _balance_replicas(costs, tokens, parts, cap_tokens, oversize, pipeline)
    return [_pack_rank(costs, tokens, part, cap_tokens, oversize) for part in parts]


def _balance_replicas(
    costs, tokens, parts, cap_tokens, oversize, pipeline
) -> list[list[list[int]]]:
    """Packs every replica's part, then moves samples from the slowest replica to the fastest.

    A replica with a heavy microbatch pays more fill/drain, so equal costs are not equal pipeline times.
    Each round tries moving one of the slowest replica's samples (the :data:`PIPELINE_MOVE_CANDIDATES`
    whose cost is nearest the one that would equalise the two replicas' shares) to the fastest replica,
    repacks both and keeps the first move that shortens the slower of the two below the slowest's time.
    It stops when no candidate does, or after ``len(parts)`` rounds (see [Note: pipelines]).
    """
    parts = [list(p) for p in parts]
    packed = [_pack_replica(costs, tokens, p, cap_tokens, oversize, pipeline) for p in parts]
    for _ in range(len(parts)):
        times = [t for _, t in packed]
        slow = max(range(len(parts)), key=lambda j: (times[j], -j))
        fast = min(range(len(parts)), key=lambda j: (times[j], j))
        # Moving cost x shortens the slow replica by about x / p and lengthens the fast one as much.
        target = (times[slow] - times[fast]) * pipeline.stages / 2.0
        candidates = sorted(parts[slow], key=lambda i: (abs(costs[i] - target), i))
        # The repacks start a few counts below the replicas' current ones (their times change little).
        slow_k, fast_k = (
            _packed_count(packed[j][0], oversize) - PIPELINE_PATIENCE for j in (slow, fast)
        )
        for i in candidates[:PIPELINE_MOVE_CANDIDATES]:
            slow_part = [x for x in parts[slow] if x != i]
            fast_part = sorted([*parts[fast], i])
            slow_packed = _pack_replica(
                costs, tokens, slow_part, cap_tokens, oversize, pipeline, slow_k
            )
            fast_packed = _pack_replica(
                costs, tokens, fast_part, cap_tokens, oversize, pipeline, fast_k
            )
            if max(slow_packed[1], fast_packed[1]) < times[slow] * (1.0 - _PIPELINE_MIN_GAIN):
                parts[slow], parts[fast] = slow_part, fast_part
                packed[slow], packed[fast] = slow_packed, fast_packed
                break
        else:
            break
    return [mbs for mbs, _ in packed]


def _microbatch_cost_list(costs: Sequence[float], mbs: list[list[int]]) -> list[float]:
    return [math.fsum(costs[i] for i in mb) for mb in mbs]


def _packed_count(mbs: list[list[int]], oversize: set[int]) -> int:
    """Microbatches of ``mbs`` other than the ones of a sample over the cap alone."""
    return sum(1 for mb in mbs if not (len(mb) == 1 and mb[0] in oversize))


def _pack_replica(
    costs, tokens, items, cap_tokens, oversize, pipeline, first_k: int = 0
) -> tuple[list[list[int]], float]:
    """Packs one replica's samples into the microbatches with the shortest modelled 1F1B time.

    Returns the microbatches in run order and their modelled time.

    Tries k = max(the FFD count, ``first_k``), k + 1, ... (at most one sample per microbatch), each
    packed by :func:`_pack_k` and put in the pipeline's best order; stops after
    :data:`PIPELINE_PATIENCE` counts in a row that do not shorten the time (see [Note: pipelines]).
    """
    alone = [[i] for i in items if i in oversize]
    rest = [i for i in items if i not in oversize]
    if not rest:
        return _pipeline_ordered(costs, alone, pipeline)
    cap = sum(tokens[i] for i in rest) if cap_tokens is None else cap_tokens
    ffd = first_fit_decreasing([tokens[i] for i in rest], max(cap, 1))
    best: list[list[int]] = []
    best_time = math.inf
    misses = 0
    for k in range(max(len(ffd), min(first_k, len(rest))), len(rest) + 1):
        packed = _pack_k(costs, tokens, rest, k, max(cap, 1), ffd)
        assert packed is not None, "FFD's own packing fits every k >= its count"
        mbs, time = _pipeline_ordered(costs, alone + packed, pipeline)
        if time < best_time * (1.0 - _PIPELINE_MIN_GAIN):
            best, best_time, misses = mbs, time, 0
        else:
            misses += 1
            if misses >= PIPELINE_PATIENCE:
                break
    return best, best_time


def _pipeline_ordered(
    costs, mbs: list[list[int]], pipeline: PipelineCost
) -> tuple[list[list[int]], float]:
    """``mbs`` in the pipeline's best order (from heaviest first), and their modelled time."""
    mbs = _heaviest_first(costs, mbs)
    mb_costs = _microbatch_cost_list(costs, mbs)
    order, time = pipeline.best_order(mb_costs)
    return [mbs[j] for j in order], time


def _lb_micro_pack(costs, tokens, dp_size, cap_tokens, alone, rest, num_per_rank):
    """``dp_size * num_per_rank`` microbatches (some maybe empty) under the cap, or ``None``."""
    num_free = dp_size * num_per_rank - len(alone)
    if num_free < 1 and rest:
        return None
    found = _pack_k(costs, tokens, rest, max(num_free, 0), cap_tokens) if rest else []
    if found is None:
        return None
    return found + [[] for _ in range(num_free - len(found))]


def _plan_lb_micro(costs, tokens, dp_size, cap_tokens, oversize, pipeline) -> list[list[list[int]]]:
    n = len(costs)
    if n == 0:
        return [[] for _ in range(dp_size)]
    alone = [[i] for i in range(n) if i in oversize]
    rest = [i for i in range(n) if i not in oversize]
    if pipeline.stages > 1:
        return _plan_lb_micro_pipeline(costs, tokens, dp_size, cap_tokens, alone, rest, pipeline)
    if cap_tokens is None:
        num_per_rank = 1
        packed = [[rest[i] for i in p] for p in karmarkar_karp([costs[i] for i in rest], dp_size)]
        packed = _fill_empty(costs, packed)
    else:
        lower = len(alone) + math.ceil(sum(tokens[i] for i in rest) / cap_tokens)
        num_per_rank = max(1, math.ceil(lower / dp_size))
        while True:
            packed = _lb_micro_pack(costs, tokens, dp_size, cap_tokens, alone, rest, num_per_rank)
            if packed is not None:
                break
            num_per_rank += 1
    return _deal_rounds(costs, alone + packed, dp_size, num_per_rank)


def _plan_lb_micro_pipeline(
    costs, tokens, dp_size, cap_tokens, alone, rest, pipeline
) -> list[list[list[int]]]:
    """LB-Micro for pipelines: the count M per replica with the shortest lockstep 1F1B time.

    From the smallest M the packer fits, M + 1, ... are tried until :data:`PIPELINE_PATIENCE` counts in
    a row do not shorten the time (or every further round would be empty); each is dealt as without
    pipelines, and its microbatch indices are put in the pipeline's best order of the per-index max cost.
    """
    cap = max(1, sum(tokens[i] for i in rest)) if cap_tokens is None else cap_tokens
    lower = len(alone) + math.ceil(sum(tokens[i] for i in rest) / cap)
    first = max(1, math.ceil(lower / dp_size))
    # From ceil(samples / dp_size) on, every further round would be empty on every replica.
    last = max(first, math.ceil((len(rest) + len(alone)) / dp_size))
    best: list[list[list[int]]] | None = None
    best_time = math.inf
    misses = 0
    for num_per_rank in range(first, last + 1):
        packed = _lb_micro_pack(costs, tokens, dp_size, cap, alone, rest, num_per_rank)
        if packed is None:
            continue
        per_rank = _deal_rounds(costs, alone + packed, dp_size, num_per_rank)
        slots = [
            max(math.fsum(costs[i] for i in mbs[j]) for mbs in per_rank)
            for j in range(num_per_rank)
        ]
        order, time = pipeline.best_order(slots)
        if time < best_time * (1.0 - _PIPELINE_MIN_GAIN):
            best = [[mbs[j] for j in order] for mbs in per_rank]
            best_time, misses = time, 0
        else:
            misses += 1
            if misses >= PIPELINE_PATIENCE:
                break
    assert best is not None, "one sample per microbatch always fits the cap"
    return best


def _deal_rounds(costs, microbatches, dp_size, num_per_rank) -> list[list[list[int]]]:
    """Deals microbatches (heaviest first) in rounds of ``dp_size`` (see [Note: plan kinds])."""
    mbs = _heaviest_first(costs, microbatches)
    assert len(mbs) == dp_size * num_per_rank
    per_rank: list[list[list[int]]] = [[] for _ in range(dp_size)]
    totals = [0.0] * dp_size
    for start in range(0, len(mbs), dp_size):
        # Round of dp_size microbatches (already heaviest first): each to the lightest rank so far (lowest
        # rank on ties) that has none of this round yet.
        free_ranks = [(totals[r], r) for r in range(dp_size)]
        heapq.heapify(free_ranks)
        for mb in mbs[start : start + dp_size]:
            _, r = heapq.heappop(free_ranks)
            per_rank[r].append(mb)
            totals[r] += math.fsum(costs[i] for i in mb)
    return per_rank


def _plan_local_sort(tokens, dp_size) -> list[list[list[int]]]:
    n = len(tokens)
    base, extra = divmod(n, dp_size)
    per_rank = []
    start = 0
    for r in range(dp_size):
        count = base + (1 if r < extra else 0)
        chunk = sorted(range(start, start + count), key=lambda i: (-tokens[i], i))
        per_rank.append([[i] for i in chunk])
        start += count
    return per_rank


def _plan_round_robin(costs, tokens, dp_size, cap_tokens, oversize) -> list[list[list[int]]]:
    return [
        _heaviest_first(
            costs, first_fit(range(r, len(tokens), dp_size), tokens, cap_tokens, alone=oversize)
        )
        for r in range(dp_size)
    ]
