"""The two state machines of ODC: where each bucket's parameters are, and where the minibatch is.

``BucketState`` follows one bucket through fetch, compute, push and release; ``MinibatchPhase`` follows
the DP group through one minibatch (accumulate, fence, step). Each has the one table of its legal
transitions, and ``BucketStates`` / ``MinibatchTracker`` refuse any other with a ``RuntimeError``
naming the rank and what was attempted. Pure bookkeeping: no tensors, no communication.

[Note: bucket lifecycle] Per bucket: SHARDED -> FETCHING -> UNSHARDED -> (backward) PUSHING -> UNSHARDED
-> SHARDED. The buckets of one unit move together.

[Note: minibatch protocol] READY -> ACCUMULATING (the first microbatch, or ``begin_minibatch``) ->
REDUCED (``finish_minibatch``: the push fence) -> READY (``end_step``: accumulators zeroed, the new
shards visible). ``begin_minibatch`` from ACCUMULATING or REDUCED abandons that minibatch (it fences,
zeroes the accumulators and fences again); from READY it communicates nothing. A push after the
fence, and a step before it, are refused (``PHASE_RULES``).
"""

from __future__ import annotations

import enum

from megatron_odc.core.layout import Layout


class BucketState(enum.Enum):
    """Where a bucket's parameters are, and what that costs in memory."""

    SHARDED = "sharded"
    """Only the owners' shards exist; the unsharded storage is freed (0 bytes beyond the shard)."""
    FETCHING = "fetching"
    """A fetch is writing the unsharded bucket (its storage is allocated; not yet readable)."""
    UNSHARDED = "unsharded"
    """The whole bucket is present (padded bucket bytes); forward and backward may read it."""
    PUSHING = "pushing"
    """Backward is running: an unsharded gradient buffer is allocated as well, then pushed to the owners."""


BUCKET_TRANSITIONS = frozenset(
    {
        (BucketState.SHARDED, BucketState.FETCHING),
        (BucketState.FETCHING, BucketState.UNSHARDED),
        (BucketState.UNSHARDED, BucketState.SHARDED),
        (BucketState.UNSHARDED, BucketState.PUSHING),
        (BucketState.PUSHING, BucketState.UNSHARDED),
    }
)
"""Every legal ``(from, to)`` of a bucket; see [Note: bucket lifecycle]."""


class MinibatchPhase(enum.Enum):
    """Where the DP group is in the minibatch protocol (see [Note: minibatch protocol])."""

    READY = "ready"
    """Accumulators are zero and the last step's shards are visible to every rank."""
    ACCUMULATING = "accumulating"
    """Microbatches run: pushes add into the owners' accumulators, which hold partial sums."""
    REDUCED = "reduced"
    """After the push fence: every owner holds the full gradient sums of its shards."""


PHASE_RULES: dict[str, tuple[frozenset[MinibatchPhase], MinibatchPhase, str]] = {
    "begin_minibatch": (frozenset(MinibatchPhase), MinibatchPhase.ACCUMULATING, ""),
    "push": (
        frozenset({MinibatchPhase.READY, MinibatchPhase.ACCUMULATING}),
        MinibatchPhase.ACCUMULATING,
        "a backward ran after the minibatch's push fence; begin the next minibatch first "
        "(the wrapper's zero_grad_buffer)",
    ),
    "finish_minibatch": (frozenset(MinibatchPhase), MinibatchPhase.REDUCED, ""),
    "end_step": (
        frozenset({MinibatchPhase.READY, MinibatchPhase.REDUCED}),
        MinibatchPhase.READY,
        "the optimizer would read partial gradient sums; fence the pushes first "
        "(finish_minibatch: the wrapper's finish_grad_sync, which finalize_model_grads calls)",
    ),
}
"""Per action: the phases it may start from, the phase it leaves, and why any other start is refused."""


class BucketStates:
    """The state of every bucket of one layout on one DP rank.

    Args:
        layout: the bucket layout.
        dp_rank: this rank, for messages.
    """

    def __init__(self, layout: Layout, dp_rank: int) -> None:
        self.layout = layout
        self.dp_rank = dp_rank
        self.states: list[BucketState] = [BucketState.SHARDED] * len(layout.buckets)

    def unit_buckets(self, unit: str) -> tuple[int, ...]:
        """The bucket indices of ``unit``.

        Raises:
            ValueError: no bucket belongs to ``unit``.
        """
        buckets = self.layout.buckets_of_unit(unit)
        if not buckets:
            raise ValueError(f"DP rank {self.dp_rank}: unknown unit {unit!r}")
        return buckets

    def of_unit(self, unit: str) -> BucketState:
        """The state of a unit's buckets (they move together)."""
        return self.states[self.unit_buckets(unit)[0]]

    def move_unit(self, unit: str, new: BucketState, action: str) -> None:
        """Move every bucket of ``unit`` to ``new``; see :meth:`move`."""
        for bucket_index in self.unit_buckets(unit):
            self.move(bucket_index, new, action)

    def move(self, bucket_index: int, new: BucketState, action: str) -> None:
        """Move one bucket to ``new``.

        Raises:
            RuntimeError: the transition is not in ``BUCKET_TRANSITIONS``; names the rank, bucket,
                unit and first parameter.
        """
        old = self.states[bucket_index]
        if (old, new) not in BUCKET_TRANSITIONS:
            bucket = self.layout.buckets[bucket_index]
            param = bucket.slots[0].name if bucket.slots else "<none>"
            raise RuntimeError(
                f"DP rank {self.dp_rank}: illegal {action} of bucket {bucket_index} (unit "
                f"{bucket.unit!r}, first parameter {param!r}): {old.value} -> {new.value}"
            )
        self.states[bucket_index] = new


class MinibatchTracker:
    """The minibatch phase of one DP rank; starts READY (a new engine has zero accumulators).

    Args:
        dp_rank: this rank, for messages.
    """

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.phase = MinibatchPhase.READY

    def check(self, action: str) -> None:
        """Raise unless ``action`` (a key of ``PHASE_RULES``) may start from the current phase.

        Raises:
            RuntimeError: naming the rank, the action and the phase, and saying why.
        """
        allowed, _, why = PHASE_RULES[action]
        if self.phase not in allowed:
            raise RuntimeError(
                f"DP rank {self.dp_rank}: {action} while the minibatch is {self.phase.value}: {why}"
            )

    def move(self, action: str) -> MinibatchPhase:
        """Apply ``action`` (a key of ``PHASE_RULES``); returns the phase it left.

        Raises:
            RuntimeError: ``action`` may not start from the current phase (see :meth:`check`).
        """
        self.check(action)
        old, self.phase = self.phase, PHASE_RULES[action][1]
        return old
