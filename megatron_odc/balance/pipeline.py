"""Step time of one pipeline (one DP replica) under the 1F1B schedule, with variable microbatch sizes.

Owns :func:`one_f_one_b_time` (the schedule model) and :class:`PipelineCost` (a replica's microbatch
costs through it, and the order of its microbatches that the model finds fastest).
The planner (:mod:`megatron_odc.balance.plan`) uses them to choose microbatches for pipelines; the
simulator (:mod:`megatron_odc.tools.simulator`) uses :func:`one_f_one_b_time` with communication added.
Pure Python; imports neither torch nor megatron.

[Note: 1F1B with variable microbatches]
With ``p`` stages of equal layers, a microbatch of cost ``c`` spends ``c / (3p)`` in forward and
``2c / (3p)`` in backward on every stage. Megatron's non-interleaved 1F1B runs, on stage ``s``,
``w = min(p - s - 1, m)`` warm-up forwards, then ``m - w`` (forward, backward) pairs, then ``w``
backwards; F(s, i) needs F(s-1, i) (plus the activation hop), B(s, i) needs B(s+1, i). With equal
microbatches the makespan is ``(m + p - 1)`` stage slots of ``c / p``: the fill/drain bubble is
``(p - 1)`` slots. With packed microbatches of different costs no single "microbatch time" exists: the
fill costs the forwards of the first microbatch(es), the drain the backwards of the last ones, and in
the steady state a stage waits when a neighbour works on a heavier microbatch. So the model does not
use ``(m + p - 1) * max`` (an upper bound when hops are free) but replays the schedule's dependencies
exactly: each stage runs its fixed op sequence, each op starting when the stage is free and its
dependency is done. The result lies between ``sum(c) / p + (p - 1) * min(c) / p`` and
``(m + p - 1) * max(c) / p``, and equals ``sum(c)`` for ``p = 1``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["PipelineCost", "one_f_one_b_time"]


def _stage_ops(stage: int, stages: int, count: int) -> list[tuple[bool, int]]:
    """The 1F1B op sequence of ``stage``: ``(is_forward, microbatch)`` pairs."""
    warmup = min(stages - stage - 1, count)
    ops = [(True, i) for i in range(warmup)]
    for j in range(count - warmup):
        ops += [(True, warmup + j), (False, j)]
    ops += [(False, i) for i in range(count - warmup, count)]
    return ops


def one_f_one_b_time(
    forward: Sequence[float],
    backward: Sequence[float],
    stages: int,
    hop: Sequence[float] | None = None,
) -> float:
    """Makespan of the non-interleaved 1F1B schedule (see [Note: 1F1B with variable microbatches]).

    Args:
        forward: per-stage forward time of each microbatch, in run order (the same on every stage).
        backward: per-stage backward time of each microbatch.
        stages: pipeline stages ``p``.
        hop: time to send microbatch i's activation (or its gradient) to the next stage; default 0.

    Returns:
        Time from the first forward on stage 0 to the last backward on stage 0.

    Raises:
        ValueError: ``stages < 1`` or sequences of different lengths.
    """
    count = len(forward)
    if stages < 1:
        raise ValueError(f"pipeline stages must be >= 1, got {stages}")
    if len(backward) != count or (hop is not None and len(hop) != count):
        raise ValueError("forward, backward and hop need one entry per microbatch")
    if count == 0:
        return 0.0
    hops = [0.0] * count if hop is None else list(hop)
    fwd_done = [[-1.0] * count for _ in range(stages)]
    bwd_done = [[-1.0] * count for _ in range(stages)]
    ops = [_stage_ops(s, stages, count) for s in range(stages)]
    next_op = [0] * stages
    free = [0.0] * stages
    remaining = sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for s in range(stages):
            while next_op[s] < len(ops[s]):
                is_forward, i = ops[s][next_op[s]]
                if is_forward:
                    ready = 0.0 if s == 0 else fwd_done[s - 1][i] + hops[i]
                    dep_done = s == 0 or fwd_done[s - 1][i] >= 0
                else:
                    last = s == stages - 1
                    ready = fwd_done[s][i] if last else bwd_done[s + 1][i] + hops[i]
                    dep_done = fwd_done[s][i] >= 0 if last else bwd_done[s + 1][i] >= 0
                if not dep_done:
                    break
                start = max(free[s], ready)
                free[s] = start + (forward[i] if is_forward else backward[i])
                (fwd_done if is_forward else bwd_done)[s][i] = free[s]
                next_op[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, "1F1B schedule deadlocked"
    return max(free)


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """How the planner times one replica's microbatches through its pipeline.

    A microbatch of cost ``c`` takes ``max(c + microbatch_overhead, microbatch_floor)`` over the whole
    model, split evenly over the stages, 1/3 forward and 2/3 backward (the cost model's fwd+bwd = 3x
    fwd), then run through :func:`one_f_one_b_time`.

    Attributes:
        stages: pipeline stages ``p``.
        microbatch_overhead: fixed cost added to every microbatch (kernel launches, sends).
        microbatch_floor: least cost of a microbatch however small: the time to fetch every layer's
            parameters (ODC gathers them for each microbatch), when it is not hidden by compute.
    """

    stages: int
    microbatch_overhead: float = 0.0
    microbatch_floor: float = 0.0

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"pipeline_stages must be >= 1, got {self.stages}")
        for name in ("microbatch_overhead", "microbatch_floor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")

    def effective(self, cost: float) -> float:
        """The modelled whole-model time of a microbatch of ``cost``."""
        return max(cost + self.microbatch_overhead, self.microbatch_floor)

    def time(self, costs: Sequence[float]) -> float:
        """Modelled time of one replica running microbatches of ``costs`` in this order."""
        full = [self.effective(c) for c in costs]
        if self.stages == 1:
            return math.fsum(full)
        forward = [c / (3.0 * self.stages) for c in full]
        backward = [2.0 * c / (3.0 * self.stages) for c in full]
        return one_f_one_b_time(forward, backward, self.stages)

    def best_order(self, costs: Sequence[float]) -> tuple[list[int], float]:
        """The order of microbatches (indices into ``costs``) with the shortest :meth:`time`, and it.

        Candidates, in this order (the first of equal times wins): heaviest first (the order of every
        plan without pipelines), lightest first, and the lightest first with the second lightest last
        and the rest heaviest first between them (a light microbatch first shortens the fill, a light
        one last the drain). Equal costs keep index order.
        """
        heaviest = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
        candidates = [heaviest]
        if self.stages > 1 and len(costs) >= 2:
            candidates += [heaviest[::-1], [heaviest[-1], *heaviest[:-2], heaviest[-2]]]
        best, best_time = heaviest, math.inf
        for order in candidates:
            time = self.time([costs[i] for i in order])
            if time < best_time:
                best, best_time = order, time
        return best, best_time
