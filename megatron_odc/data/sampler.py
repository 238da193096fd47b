"""Length-balanced training sampler: each DP rank's microbatches of every minibatch, with no communication.

Owns :class:`LengthBalancedSampler` and :class:`MinibatchAssignment`. The partitioning itself (cost
model, Karmarkar-Karp, plan kinds) lives in :mod:`megatron_odc.balance`; this module only decides
which samples form each minibatch, asks for the plan, and keeps a resumable position. Pure Python with numpy,
torch-free; nothing here imports megatron.

[Note: sampler determinism]
Every rank builds the same objects from the same arguments: the epoch's order is a permutation
drawn from ``random.Random("megatron_odc.sampler:<seed>:<epoch>")`` (string seeds are hashed with
SHA-512, so this is stable across Python versions and processes), minibatch ``i`` is the slice
``order[i * global_batch_size : (i + 1) * global_batch_size]`` and its plan is
``make_plan(plan_kind, ids, lengths, dp_size, ...)``, which is deterministic. No rank ever needs
another rank's state. The last minibatch of an epoch is smaller when the dataset size is not a
multiple of ``global_batch_size`` (dropped with ``drop_last``).

[Note: sampler memory]
A rank's sampler keeps no Python object per sample: the lengths stay the array it was given (a memory-mapped
dataset's are file-backed pages, not copied) and the current epoch's order is one int32 array (4 bytes per
sample), shuffled in place with exactly the swaps of ``random.shuffle`` on a list (:func:`_shuffle`), so the
order is the one a list would get.

[Note: sampler resume]
``state_dict()`` records the epoch, the index of the next minibatch to yield, the seed and a
fingerprint of the configuration. ``load_state_dict`` requires the same number of samples,
``global_batch_size``, seed, ``shuffle`` and ``drop_last`` (else ``ValueError`` naming the field),
because those decide which samples form each minibatch. It allows a different ``dp_size``,
``dp_rank``, ``plan_kind``, ``cap_tokens``, cost model or ``too_long``: the remaining minibatches
hold exactly the same samples and their plans are recomputed for the new setting (logged). A
changed lengths checksum (for example a new tokenizer) is logged as a warning. ``set_epoch(e)``
with the epoch already current keeps the position, so the usual
``for e in range(start, n): sampler.set_epoch(e); for mb in sampler: ...`` loop resumes mid-epoch.
"""

from __future__ import annotations

import array
import dataclasses
import logging
import math
import random
import zlib
from collections.abc import Iterator, Sequence

import numpy as np

from megatron_odc.balance.cost import CostModel
from megatron_odc.balance.plan import PLAN_KINDS, TOO_LONG_POLICIES, Plan, make_plan

logger = logging.getLogger(__name__)

_STATE_VERSION = 1
# Fields that decide which samples form each minibatch: a mismatch on resume is an error.
_STRICT_FIELDS = ("num_samples", "global_batch_size", "seed", "shuffle", "drop_last")
# Fields that only change how a minibatch is split: a mismatch on resume is logged.
_LOOSE_FIELDS = ("dp_size", "plan_kind", "cap_tokens", "cost_model", "too_long", "pipeline_stages")


def _shuffle(items: array.array, rng: random.Random) -> None:
    """``rng.shuffle(items)`` in place on a compact array: the same swaps (the Fisher-Yates loop of CPython's
    ``random.shuffle``, one ``_randbelow`` per position), so the same order as shuffling a list."""
    randbelow = rng._randbelow
    for i in reversed(range(1, len(items))):
        j = randbelow(i + 1)
        items[i], items[j] = items[j], items[i]


def _lengths_crc32(lengths: np.ndarray, chunk: int = 1 << 16) -> int:
    """CRC-32 of ``",".join(map(str, lengths))`` (the resume check's value), a chunk at a time."""
    crc = 0
    for start in range(0, len(lengths), chunk):
        text = ",".join(map(str, lengths[start : start + chunk].tolist()))
        crc = zlib.crc32((text if start == 0 else "," + text).encode(), crc)
    return crc


@dataclasses.dataclass(frozen=True)
class MinibatchAssignment:
    """One minibatch, as seen by one DP rank.

    Attributes:
        epoch: the epoch of the minibatch.
        index: the minibatch index within the epoch.
        microbatches: this rank's microbatches (tuples of dataset indices), heaviest first; empty
            when this rank got no sample.
        global_sample_ids: every sample of the minibatch, all ranks, in epoch order.
        plan: the full plan (every rank's microbatches, planned lengths, balance metrics).
        num_microbatches_per_rank: microbatch count of each DP rank.
    """

    epoch: int
    index: int
    microbatches: tuple[tuple[int, ...], ...]
    global_sample_ids: tuple[int, ...]
    plan: Plan
    num_microbatches_per_rank: tuple[int, ...]

    @property
    def num_microbatches(self) -> int:
        """Microbatches of this rank."""
        return len(self.microbatches)


class LengthBalancedSampler:
    """Yields this DP rank's share of every minibatch, balanced by a cost model.

    See [Note: sampler determinism] and [Note: sampler resume].

    Args:
        lengths: tokens of every sample of the dataset.
        global_batch_size: samples per minibatch, over all DP ranks.
        dp_size: number of DP ranks; may exceed ``global_batch_size`` (some ranks get no sample).
        dp_rank: this rank, in ``[0, dp_size)``.
        seed: seed of the per-epoch shuffle.
        plan_kind: one of ``megatron_odc.balance.plan.PLAN_KINDS`` (``"lb_mini"`` for ODC).
        cap_tokens: memory cap, tokens per microbatch; default the longest sample of the dataset
            (the ODC paper's packing ratio 1).
        cost_model: per-sample cost; default :meth:`CostModel.tokens`.
        too_long: a sample longer than ``cap_tokens`` raises (``"error"``, reported at
            construction), is cut to the cap (``"truncate"``; ``Plan.lengths`` holds the planned
            length) or gets a microbatch of its own above the cap (``"alone"``). Never dropped.
        shuffle: shuffle the samples every epoch; else minibatches follow dataset order.
        drop_last: drop the last minibatch of an epoch when it is not full.
        pipeline_stages: pipeline stages per DP replica; with more than 1, ``dp_size`` and
            ``dp_rank`` count replicas and the plan's microbatches are chosen for the 1F1B schedule
            (``make_plan(pipeline_stages=...)``, [Note: pipelines] in ``balance/plan.py``).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        global_batch_size: int,
        dp_size: int,
        dp_rank: int,
        seed: int = 0,
        plan_kind: str = "lb_mini",
        cap_tokens: int | None = None,
        cost_model: CostModel | None = None,
        too_long: str = "error",
        shuffle: bool = True,
        drop_last: bool = False,
        pipeline_stages: int = 1,
    ) -> None:
        # A read-only integer array, not copied when it is one already (a memory-mapped dataset's lengths
        # stay file-backed): see [Note: sampler memory].
        self.lengths: np.ndarray = np.asarray(lengths)
        if not np.issubdtype(self.lengths.dtype, np.integer) or self.lengths.ndim != 1:
            self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        self.lengths = self.lengths.view()
        self.lengths.flags.writeable = False
        if not len(self.lengths):
            raise ValueError("the dataset has no samples (lengths is empty)")
        short = np.flatnonzero(self.lengths < 1)
        if len(short):
            i = int(short[0])
            raise ValueError(
                f"sample {i} has length {self.lengths[i]}; every sample needs >= 1 token"
            )
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        if plan_kind not in PLAN_KINDS:
            raise ValueError(f"unknown plan_kind {plan_kind!r}; expected one of {PLAN_KINDS}")
        if too_long not in TOO_LONG_POLICIES:
            raise ValueError(f"unknown too_long {too_long!r}; expected one of {TOO_LONG_POLICIES}")
        if drop_last and len(self.lengths) < global_batch_size:
            raise ValueError(
                f"drop_last with {len(self.lengths)} samples and global_batch_size "
                f"{global_batch_size} leaves no minibatch"
            )
        self.cap_tokens: int = int(self.lengths.max()) if cap_tokens is None else int(cap_tokens)
        if self.cap_tokens < 1:
            raise ValueError(f"cap_tokens must be >= 1, got {cap_tokens}")
        if too_long == "error":
            over = np.flatnonzero(self.lengths > self.cap_tokens)
            if len(over):
                i = int(over[0])
                raise ValueError(
                    f"sample {i} has {self.lengths[i]} tokens, more than cap_tokens={self.cap_tokens}; "
                    "raise the cap or pass too_long='truncate' or 'alone'"
                )
        self.global_batch_size = global_batch_size
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.plan_kind = plan_kind
        self.cost_model: CostModel = CostModel.tokens() if cost_model is None else cost_model
        self.too_long = too_long
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.pipeline_stages = pipeline_stages
        self._epoch = 0
        self._next_index = 0
        self._order_epoch: int | None = None
        self._order: np.ndarray = np.zeros(0, dtype=np.int64)
        self._lengths_crc32 = _lengths_crc32(self.lengths)

    # Configuration and position #

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    @property
    def next_index(self) -> int:
        """Index (within the epoch) of the next minibatch :meth:`__iter__` yields."""
        return self._next_index

    def __len__(self) -> int:
        """Minibatches per epoch."""
        num_samples = len(self.lengths)
        if self.drop_last:
            return num_samples // self.global_batch_size
        return math.ceil(num_samples / self.global_batch_size)

    def current(self) -> tuple[int, int]:
        """``(epoch, index)`` of the next minibatch to train on; a used-up epoch rolls to the next."""
        if self._next_index < len(self):
            return self._epoch, self._next_index
        return self._epoch + 1, 0

    def following(self, epoch: int, index: int) -> tuple[int, int]:
        """``(epoch, index)`` of the minibatch after minibatch ``index`` of ``epoch``."""
        return (epoch, index + 1) if index + 1 < len(self) else (epoch + 1, 0)

    def advance_past(self, epoch: int, index: int) -> None:
        """Moves the position to just after minibatch ``index`` of ``epoch`` (it was trained on)."""
        if not 0 <= index < len(self):
            raise ValueError(f"minibatch index {index} is outside [0, {len(self)})")
        self._epoch, self._next_index = epoch, index + 1

    def set_epoch(self, epoch: int) -> None:
        """Moves to the start of ``epoch``; keeps the position when ``epoch`` is already current."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._epoch = epoch
            self._next_index = 0

    def _fingerprint(self) -> dict:
        return {
            "num_samples": len(self.lengths),
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dp_size": self.dp_size,
            "plan_kind": self.plan_kind,
            "cap_tokens": self.cap_tokens,
            "cost_model": [float(self.cost_model.a), float(self.cost_model.b)],
            "too_long": self.too_long,
            "pipeline_stages": self.pipeline_stages,
            "lengths_crc32": self._lengths_crc32,
        }

    def state_dict(self) -> dict:
        """Returns the resumable position (plain Python types; see [Note: sampler resume])."""
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "next_index": self._next_index,
            "seed": self.seed,
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resumes from :meth:`state_dict` of a sampler over the same data.

        Raises:
            ValueError: the state is malformed, or a field that decides the minibatches differs
                (the message names it).
        """
        for key in ("version", "epoch", "next_index", "fingerprint"):
            if key not in state:
                raise ValueError(f"sampler state has no {key!r} entry")
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"sampler state version {state['version']} is not supported (expected "
                f"{_STATE_VERSION})"
            )
        saved, mine = state["fingerprint"], self._fingerprint()
        for field in _STRICT_FIELDS:
            if saved.get(field) != mine[field]:
                raise ValueError(
                    f"sampler state mismatch on {field!r}: saved {saved.get(field)!r}, this "
                    f"sampler has {mine[field]!r}"
                )
        for field in _LOOSE_FIELDS:
            if saved.get(field) != mine[field]:
                logger.info(
                    "sampler resume with %s %r (saved %r): remaining minibatches keep their "
                    "samples, plans are recomputed",
                    field,
                    mine[field],
                    saved.get(field),
                )
        if saved.get("lengths_crc32") != mine["lengths_crc32"]:
            logger.warning(
                "sampler resume: sample lengths differ from the saved run (same count); the "
                "minibatches keep their samples but plans change"
            )
        epoch, next_index = int(state["epoch"]), int(state["next_index"])
        if epoch < 0 or not 0 <= next_index <= len(self):
            raise ValueError(
                f"sampler state position epoch={epoch}, next_index={next_index} is outside "
                f"[0, {len(self)}] minibatches per epoch"
            )
        self._epoch = epoch
        self._next_index = next_index

    # Plans #

    def _cached_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order = np.zeros(0, dtype=np.int64)  # free the old epoch's order first
            num = len(self.lengths)
            order = array.array("i" if num < 2**31 else "q", range(num))
            if self.shuffle:
                _shuffle(order, random.Random(f"megatron_odc.sampler:{self.seed}:{epoch}"))
            self._order = np.frombuffer(
                order, dtype=np.int32 if order.typecode == "i" else np.int64
            )
            self._order_epoch = epoch
        return self._order

    def epoch_order(self, epoch: int) -> list[int]:
        """Returns the sample order of ``epoch`` (a copy of the per-epoch cache)."""
        return self._cached_order(epoch).tolist()

    def minibatch_sample_ids(self, epoch: int, index: int) -> tuple[int, ...]:
        """Returns the samples of minibatch ``index`` of ``epoch``, all ranks."""
        if not 0 <= index < len(self):
            raise ValueError(f"minibatch index {index} is outside [0, {len(self)})")
        start = index * self.global_batch_size
        return tuple(self._cached_order(epoch)[start : start + self.global_batch_size].tolist())

    def assignment(self, epoch: int, index: int) -> MinibatchAssignment:
        """Returns minibatch ``index`` of ``epoch`` for this rank, without moving the position."""
        sample_ids = self.minibatch_sample_ids(epoch, index)
        plan = make_plan(
            self.plan_kind,
            sample_ids,
            self.lengths[list(sample_ids)].tolist(),
            self.dp_size,
            cap_tokens=self.cap_tokens,
            cost_model=self.cost_model,
            too_long=self.too_long,
            pipeline_stages=self.pipeline_stages,
        )
        per_rank = tuple(
            tuple(tuple(mb) for mb in plan.rank_microbatches(r)) for r in range(self.dp_size)
        )
        return MinibatchAssignment(
            epoch=epoch,
            index=index,
            microbatches=per_rank[self.dp_rank],
            global_sample_ids=sample_ids,
            plan=plan,
            num_microbatches_per_rank=tuple(len(mbs) for mbs in per_rank),
        )

    def __iter__(self) -> Iterator[MinibatchAssignment]:
        """Yields the remaining minibatches of the current epoch, advancing the position."""
        epoch = self._epoch
        while self._epoch == epoch and self._next_index < len(self):
            index = self._next_index
            result = self.assignment(epoch, index)
            self._next_index = index + 1
            yield result
