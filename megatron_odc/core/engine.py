"""The ODC bucket runtime: sharded parameters, fetch / release / push, one fence per minibatch.

``ODCEngine`` owns, for one data-parallel group, every bucket of a model's parameters (``layout.py``):

- each rank's *param shard* (compute dtype) and fp32 *grad accumulator* live in transport memory, so peers
  read and accumulate into them one-sidedly;
- every parameter's ``.data`` is a view into an unsharded flat buffer per storage group (consecutive buckets
  of one unit and dtype) whose storage is freed (resized to 0) while the unit is released, and refilled by a
  fetch (the same trick FSDP2 uses, so tensors autograd saved in forward see the refetched data in backward);
- ``fetch(unit)`` gathers the unit's buckets from every owner (own shard locally), ``release(unit)`` frees
  them; ``begin_backward(unit)`` binds ``param.main_grad`` views into an unsharded grad buffer,
  ``grad_ready(param)`` is called once per parameter per backward and pushes the unit's buckets to the owners
  once every parameter's gradient is in (parameters used several times, like tied embeddings, are complete
  when autograd accumulates them, once);
- ``finish_minibatch()`` (after the last push) and ``end_step()`` (after the optimizer wrote the new
  shards and zeroed the accumulators) hold the only two DP-wide fences of a minibatch; ``begin_minibatch``
  fences only when the previous minibatch did not end with ``end_step``.

Every buffer lives on the transport's device. On a GPU, fetches run on a fetch stream and pushes on a push
stream while compute runs on the current stream ([Note: overlap streams] in ``transport/streams.py``):
``start_fetch(unit)`` only issues the gather (a prefetch), ``finish_fetch(unit)`` makes compute wait for
it; ``push`` issues the unit's accumulates after the compute that produced its gradients, and keeps at most
``max_pushes_in_flight`` unsharded gradient buffers alive (compute waits for the oldest push before its
buffer is dropped). On CPU the streams run everything in order.

FP8 parameters (a ``Float8ParamCodec`` recognises them) are stored as raw bytes in uint8 buckets, never
split over buckets, so each rank owns one contiguous range of each and fetches FP8 bytes.

[Note: bucket lifecycle] Per bucket: SHARDED -> FETCHING -> UNSHARDED -> (backward) PUSHING -> UNSHARDED
-> SHARDED. Any other transition raises ``RuntimeError`` naming the rank, bucket and a parameter.

No megatron import: the Megatron-facing wrapper (``data_parallel.py``) and the hooks (``hooks.py``) drive it.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_odc.core.fp8 import Float8ParamCodec
from megatron_odc.core.layout import (
    BucketLayout,
    Layout,
    ParamSpec,
    build_layout,
    check_same_layout,
)
from megatron_odc.core.streams import StreamOps, TorchStreams
from megatron_odc.core.telemetry import Telemetry
from megatron_odc.transport.base import Transport
from megatron_odc.transport.devices import collective_device

logger = logging.getLogger(__name__)


class BucketState(enum.Enum):
    """Where a bucket's parameters are."""

    SHARDED = "sharded"
    """Only the owners' shards exist; the unsharded storage is freed."""
    FETCHING = "fetching"
    """A fetch is assembling the unsharded bucket."""
    UNSHARDED = "unsharded"
    """The whole bucket is present; forward (and backward) may use it."""
    PUSHING = "pushing"
    """Backward is running: gradients accumulate into the unsharded grad buffer, then go to the owners."""


_ALLOWED = {
    (BucketState.SHARDED, BucketState.FETCHING),
    (BucketState.FETCHING, BucketState.UNSHARDED),
    (BucketState.UNSHARDED, BucketState.SHARDED),
    (BucketState.UNSHARDED, BucketState.PUSHING),
    (BucketState.PUSHING, BucketState.UNSHARDED),
}


@dataclasses.dataclass
class _StorageGroup:
    """Consecutive buckets of one unit and dtype that share one unsharded flat buffer."""

    unit: str
    dtype: torch.dtype
    bucket_indices: list[int]
    bucket_starts: list[int]  # element offset of each bucket inside the flat buffer
    numel: int
    params_flat: torch.Tensor  # 1D; storage resized to 0 while released
    grad_flat: torch.Tensor | None = None  # 1D, allocated by begin_backward


@dataclasses.dataclass(frozen=True)
class OwnedPiece:
    """A run of one parameter that this DP rank owns: ``param[param_start : param_start + numel]`` (flat)
    lives at ``[shard_lo, shard_hi)`` of bucket ``bucket_index``'s param shard and grad accumulator."""

    name: str
    bucket_index: int
    shard_lo: int
    shard_hi: int
    param_start: int

    @property
    def numel(self) -> int:
        """Elements in the run."""
        return self.shard_hi - self.shard_lo


@dataclasses.dataclass
class _ParamEntry:
    name: str
    param: torch.nn.Parameter
    unit: str
    group: _StorageGroup
    flat_start: int  # element offset of the parameter in the group's flat buffer
    bucket_indices: tuple[int, ...]


class ODCEngine:
    """Sharded parameters and gradient accumulators of one model over one data-parallel group.

    Args:
        named_params: ``(name, parameter, unit)`` triples in forward order; every parameter of a unit is
            fetched and released together. Parameters must be identical on every DP rank.
        transport: this rank's transport endpoint over the DP group (its ``world_size`` is the DP size).
        group: the DP process group (used only at construction and by ``gather_telemetry``).
        bucket_numel: bucket size in elements.
        alignment: element alignment of parameter starts and shards.
        grad_dtype: dtype of the unsharded gradient buffer (default float32); pushes add it into the
            owners' fp32 accumulators.
        buffer_prefix: prefix of the transport buffer names (several engines may share a transport).
        check_params_equal: verify at construction that every DP rank holds the same parameter values.
        streams: the stream implementation (default: ``TorchStreams`` on the transport's device).
        max_pushes_in_flight: unsharded gradient buffers whose push may still run while compute goes on.
        fp8_codec: recognises FP8 parameters and handles their bytes (``None``: no FP8 parameters).
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter, str]],
        transport: Transport,
        group: dist.ProcessGroup | None = None,
        *,
        bucket_numel: int = 40_000_000,
        alignment: int = 64,
        grad_dtype: torch.dtype = torch.float32,
        buffer_prefix: str = "odc",
        check_params_equal: bool = True,
        streams: StreamOps | None = None,
        max_pushes_in_flight: int = 1,
        fp8_codec: Float8ParamCodec | None = None,
    ) -> None:
        if max_pushes_in_flight < 1:
            raise ValueError(f"max_pushes_in_flight must be >= 1, got {max_pushes_in_flight}")
        self.transport = transport
        self.group = group
        self.dp_rank = transport.rank
        self.dp_size = transport.world_size
        self.device = transport.device
        self.grad_dtype = grad_dtype
        self.telemetry = Telemetry()
        self.fp8_codec = fp8_codec
        self.max_pushes_in_flight = max_pushes_in_flight
        self._prefix = buffer_prefix
        self._closed = False
        self._ops = streams if streams is not None else TorchStreams(self.device)
        self._compute_stream = self._ops.stream("compute")
        self._fetch_stream = self._ops.stream("fetch")
        self._push_stream = self._ops.stream("push")
        self._fetch_events: dict[str, object] = {}
        # (push event, unsharded gradient buffers it reads), oldest first.
        self._pushes_in_flight: collections.deque[tuple[object, list[torch.Tensor]]] = (
            collections.deque()
        )

        self.fp8_names: frozenset[str] = frozenset(
            name for name, p, _ in named_params if fp8_codec is not None and fp8_codec.is_fp8(p)
        )
        for name, p, _ in named_params:
            if name in self.fp8_names:
                fp8_codec.check(p, name)
            if p.device != self.device:
                raise ValueError(
                    f"DP rank {self.dp_rank}: parameter {name!r} is on {p.device} but the "
                    f"{type(transport).__name__}'s memory is on {self.device}; move the model to "
                    f"{self.device} before wrapping it"
                )
        specs = [
            ParamSpec(
                name,
                tuple(p.shape),
                torch.uint8 if name in self.fp8_names else p.dtype,
                unit,
                splittable=name not in self.fp8_names,
            )
            for name, p, unit in named_params
        ]
        self.layout: Layout = build_layout(
            specs, self.dp_size, bucket_numel=bucket_numel, alignment=alignment
        )
        self._check_same_layout()
        params = {name: p for name, p, _ in named_params}
        if check_params_equal:
            self._check_params_equal([(name, p) for name, p, _ in named_params])

        self.states: list[BucketState] = [BucketState.SHARDED] * len(self.layout.buckets)
        for bucket in self.layout.buckets:
            transport.register(
                self._param_buffer(bucket.index), bucket.shard_numel, bucket.dtype, accumulate=False
            )
            transport.register(self._grad_buffer(bucket.index), bucket.shard_numel, torch.float32)

        self._groups: dict[str, list[_StorageGroup]] = {}
        self._entries: dict[str, _ParamEntry] = {}
        self._build_storage(params)
        self._unit_names: dict[str, list[str]] = {unit: [] for unit in self.layout.units}
        for name, entry in self._entries.items():
            self._unit_names[entry.unit].append(name)
        # Per unit, its FP8 parameters (what the codec processes after a fetch and before a release).
        self._unit_fp8: dict[str, list[torch.Tensor]] = {
            unit: [self._entries[n].param for n in names if n in self.fp8_names]
            for unit, names in self._unit_names.items()
        }
        self._pending: dict[str, set[str]] = {unit: set() for unit in self.layout.units}
        self._ready: dict[str, set[str]] = {unit: set() for unit in self.layout.units}
        self.transport.fence()
        # Accumulators are zero and every shard is visible: the next minibatch may start without a fence.
        self._clean = True

    # ------------------------------------------------------------------ construction

    def _param_buffer(self, bucket_index: int) -> str:
        return f"{self._prefix}.param.{bucket_index}"

    def _grad_buffer(self, bucket_index: int) -> str:
        return f"{self._prefix}.grad.{bucket_index}"

    def _check_same_layout(self) -> None:
        if self.dp_size == 1 or not dist.is_initialized():
            return
        fingerprints: list[str | None] = [None] * self.dp_size
        dist.all_gather_object(fingerprints, self.layout.fingerprint(), group=self.group)
        if len(set(fingerprints)) == 1:
            return
        records: list[list[str] | None] = [None] * self.dp_size
        dist.all_gather_object(records, self.layout.records(), group=self.group)
        check_same_layout(self.layout, records)  # raises, naming the first differing parameter
        raise ValueError(f"DP rank {self.dp_rank}: bucket layouts differ across DP ranks")

    def _check_params_equal(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        if self.dp_size == 1 or not dist.is_initialized() or not named:
            return
        device = collective_device(self.group)
        sums = []
        for name, p in named:
            values = self.fp8_codec.raw_data(p) if name in self.fp8_names else p.detach()
            flat = values.reshape(-1).to(device=device, dtype=torch.float64)
            weights = torch.arange(
                1, flat.numel() + 1, dtype=torch.float64, device=device
            ).remainder_(997.0)
            sums.append(torch.stack([flat.sum(), (flat * weights).sum()]))
        mine = torch.stack(sums)
        gathered = [torch.empty_like(mine) for _ in range(self.dp_size)]
        dist.all_gather(gathered, mine, group=self.group)
        for other_rank, other in enumerate(gathered):
            differs = (other != mine).any(dim=1) & ~(other.isnan() & mine.isnan()).any(dim=1)
            if bool(differs.any()):
                index = int(differs.nonzero()[0])
                raise ValueError(
                    f"DP rank {self.dp_rank}: parameter {named[index][0]!r} differs between DP rank "
                    f"{self.dp_rank} and DP rank {other_rank}; every DP rank must start from the same "
                    "weights (same seed, or call broadcast_params on the plain model first)"
                )

    def _build_storage(self, params: dict[str, torch.nn.Parameter]) -> None:
        """Write the owned shards, then rebind every parameter to a released unsharded view."""
        buckets = self.layout.buckets
        for piece in self.owned_pieces():
            src = self._values(piece.name, params[piece.name]).reshape(-1)
            self.param_shard(piece.bucket_index)[piece.shard_lo : piece.shard_hi].copy_(
                src[piece.param_start : piece.param_start + piece.numel]
            )
        # Storage groups: maximal runs of consecutive buckets with the same unit and dtype.
        runs: list[list[BucketLayout]] = []
        for bucket in buckets:
            if runs and runs[-1][-1].unit == bucket.unit and runs[-1][-1].dtype == bucket.dtype:
                runs[-1].append(bucket)
            else:
                runs.append([bucket])
        for run in runs:
            starts, total = [], 0
            for bucket in run:
                starts.append(total)
                total += bucket.padded_numel
            flat = torch.zeros(total, dtype=run[0].dtype, device=self.device)
            group = _StorageGroup(
                unit=run[0].unit,
                dtype=run[0].dtype,
                bucket_indices=[b.index for b in run],
                bucket_starts=starts,
                numel=total,
                params_flat=flat,
            )
            self._groups.setdefault(group.unit, []).append(group)
            first_slot_seen: set[str] = set()
            for bucket, bucket_start in zip(run, starts):
                for slot in bucket.slots:
                    if slot.name in first_slot_seen:
                        continue
                    first_slot_seen.add(slot.name)
                    assert slot.param_offset == 0, slot
                    p = params[slot.name]
                    flat_start = bucket_start + slot.bucket_offset
                    slots = self.layout.slots_of(slot.name)
                    self._entries[slot.name] = _ParamEntry(
                        name=slot.name,
                        param=p,
                        unit=group.unit,
                        group=group,
                        flat_start=flat_start,
                        bucket_indices=tuple(s.bucket_index for s in slots),
                    )
                    view = flat[flat_start : flat_start + p.numel()]
                    if slot.name in self.fp8_names:
                        self.fp8_codec.bind(p, view)
                    else:
                        p.data = view.view(p.shape)
            flat.untyped_storage().resize_(0)

    def _values(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """What the buckets store of a parameter: its values, or its FP8 bytes."""
        if name in self.fp8_names:
            return self.fp8_codec.raw_data(param)
        return param.detach()

    # ------------------------------------------------------------------ state machine

    def _transition(self, bucket_index: int, new: BucketState, action: str) -> None:
        old = self.states[bucket_index]
        if (old, new) not in _ALLOWED:
            bucket = self.layout.buckets[bucket_index]
            param = bucket.slots[0].name if bucket.slots else "<none>"
            raise RuntimeError(
                f"DP rank {self.dp_rank}: illegal {action} of bucket {bucket_index} (unit "
                f"{bucket.unit!r}, first parameter {param!r}): {old.value} -> {new.value}"
            )
        self.states[bucket_index] = new

    def unit_state(self, unit: str) -> BucketState:
        """The state of a unit's buckets (they move together)."""
        return self.states[self._unit_buckets(unit)[0]]

    def _unit_buckets(self, unit: str) -> tuple[int, ...]:
        buckets = self.layout.buckets_of_unit(unit)
        if not buckets:
            raise ValueError(f"DP rank {self.dp_rank}: unknown unit {unit!r}")
        return buckets

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"DP rank {self.dp_rank}: the ODC engine is closed")

    # ------------------------------------------------------------------ fetch / release

    def start_fetch(self, unit: str) -> None:
        """Issue the gather of the unit's buckets from every owner on the fetch stream (a prefetch).

        A no-op unless the unit is released. ``finish_fetch`` makes compute wait for it.
        """
        self._check_open()
        if self.unit_state(unit) is not BucketState.SHARDED:
            return
        with self.telemetry.timed("fetch_wait_s"):
            # The freed storage may be reused by the allocator for this fetch: compute's earlier reads of
            # whatever lived there must be done before the fetch stream overwrites it.
            self._ops.wait(self._fetch_stream, self._ops.record(self._compute_stream))
            for group in self._groups[unit]:
                group.params_flat.untyped_storage().resize_(
                    group.numel * group.params_flat.element_size()
                )
                for bucket_index in group.bucket_indices:
                    self._transition(bucket_index, BucketState.FETCHING, "fetch")
            self._ops.launch(
                self._fetch_stream, f"fetch:{unit}", lambda: self._gather_unit(unit), 0.0
            )
            self._fetch_events[unit] = self._ops.record(self._fetch_stream)

    def _gather_unit(self, unit: str) -> None:
        for group in self._groups[unit]:
            for bucket_index, start in zip(group.bucket_indices, group.bucket_starts):
                bucket = self.layout.buckets[bucket_index]
                self.transport.gather_shards(
                    self._param_buffer(bucket_index),
                    group.params_flat[start : start + bucket.padded_numel],
                )
                self.telemetry.fetch_bytes += bucket.shard_nbytes * (self.dp_size - 1)
                self.telemetry.num_fetches += 1

    def finish_fetch(self, unit: str) -> None:
        """Make compute wait for the unit's fetch; afterwards its parameters may be used."""
        self._check_open()
        if self.unit_state(unit) is not BucketState.FETCHING:
            return
        with self.telemetry.timed("fetch_wait_s"):
            self._ops.wait(self._compute_stream, self._fetch_events.pop(unit))
            for bucket_index in self._unit_buckets(unit):
                self._transition(bucket_index, BucketState.UNSHARDED, "fetch")
            fp8 = self._unit_fp8[unit]
            if fp8:
                self.fp8_codec.after_fetch(fp8)

    def fetch(self, unit: str) -> None:
        """Assemble the unit's parameters from every owner; a no-op if they are already present."""
        self.start_fetch(unit)
        self.finish_fetch(unit)

    def release(self, unit: str) -> None:
        """Free the unit's unsharded parameters; a no-op if already released."""
        state = self.unit_state(unit)
        if state is BucketState.SHARDED:
            return
        # A prefetch nobody used: its writes must end before the memory is reused.
        self.finish_fetch(unit)
        fp8 = self._unit_fp8[unit]
        if fp8:
            self.fp8_codec.before_release(fp8)
        for bucket_index in self._unit_buckets(unit):
            self._transition(bucket_index, BucketState.SHARDED, "release")
        for group in self._groups[unit]:
            group.params_flat.untyped_storage().resize_(0)

    def release_all(self) -> None:
        """Release every unit (after pushing any partial gradients)."""
        for unit in self.layout.units:
            if self.unit_state(unit) is BucketState.PUSHING:
                self.push(unit)
            self.release(unit)

    # ------------------------------------------------------------------ backward and push

    def begin_backward(self, unit: str) -> None:
        """Start collecting the unit's gradients: bind ``param.main_grad`` into a zeroed grad buffer."""
        self._check_open()
        if self.unit_state(unit) is BucketState.PUSHING:
            return
        for bucket_index in self._unit_buckets(unit):
            self._transition(bucket_index, BucketState.PUSHING, "begin_backward")
        for group in self._groups[unit]:
            group.grad_flat = torch.zeros(group.numel, dtype=self.grad_dtype, device=self.device)
        for name in self._unit_param_names(unit):
            entry = self._entries[name]
            p = entry.param
            p.main_grad = entry.group.grad_flat[
                entry.flat_start : entry.flat_start + p.numel()
            ].view(p.shape)
            p.grad_added_to_main_grad = False
        self._pending[unit] = {
            name for name in self._unit_param_names(unit) if self._entries[name].param.requires_grad
        }
        self._ready[unit] = set()

    def _unit_param_names(self, unit: str) -> list[str]:
        return self._unit_names[unit]

    def grad_ready(self, param: torch.nn.Parameter, name: str) -> str | None:
        """Take ``param``'s gradient for this backward; push the unit once all of its gradients are in.

        Returns:
            The unit's name if this gradient completed it and it was pushed, else ``None``.
        """
        entry = self._entries[name]
        unit = entry.unit
        state = self.unit_state(unit)
        if state is BucketState.UNSHARDED:
            self.begin_backward(unit)
        elif state is not BucketState.PUSHING:
            raise RuntimeError(
                f"DP rank {self.dp_rank}: gradient of parameter {name!r} arrived while its bucket "
                f"{entry.bucket_indices[0]} (unit {unit!r}) is {state.value}; its parameters were not "
                "fetched for backward"
            )
        if name in self._ready[unit]:
            raise RuntimeError(
                f"DP rank {self.dp_rank}: gradient of parameter {name!r} (bucket "
                f"{entry.bucket_indices[0]}) arrived twice in one backward"
            )
        if getattr(param, "grad_added_to_main_grad", False):
            param.grad_added_to_main_grad = False  # fused wgrad wrote main_grad directly
        elif param.grad is not None:
            param.main_grad.add_(param.grad)
        param.grad = None
        self._ready[unit].add(name)
        if self._ready[unit] >= self._pending[unit]:
            self.push(unit)
            return unit
        return None

    def push(self, unit: str) -> None:
        """Accumulate each owner's slice of the unit's unsharded gradient into the owner's shard.

        Issued on the push stream after the compute that produced the gradients; the unsharded gradient
        buffers stay alive until compute has waited for their push (see ``max_pushes_in_flight``).
        """
        self._check_open()
        if self.unit_state(unit) is not BucketState.PUSHING:
            for bucket_index in self._unit_buckets(unit):
                self._transition(bucket_index, BucketState.UNSHARDED, "push")
        groups = self._groups[unit]
        with self.telemetry.timed("push_s"):
            self._ops.wait(self._push_stream, self._ops.record(self._compute_stream))
            self._ops.launch(
                self._push_stream, f"push:{unit}", lambda: self._scatter_unit(groups), 0.0
            )
            grads = [g.grad_flat for g in groups if g.grad_flat is not None]
            self._pushes_in_flight.append((self._ops.record(self._push_stream), grads))
            for group in groups:
                for bucket_index in group.bucket_indices:
                    self._transition(bucket_index, BucketState.UNSHARDED, "push")
                group.grad_flat = None
            while len(self._pushes_in_flight) > self.max_pushes_in_flight:
                self._retire_oldest_push()
        for name in self._unit_param_names(unit):
            self._entries[name].param.main_grad = None
        self._pending[unit] = set()
        self._ready[unit] = set()

    def _scatter_unit(self, groups: list[_StorageGroup]) -> None:
        for group in groups:
            assert group.grad_flat is not None
            for bucket_index, start in zip(group.bucket_indices, group.bucket_starts):
                bucket = self.layout.buckets[bucket_index]
                self.transport.scatter_accumulate(
                    self._grad_buffer(bucket_index),
                    group.grad_flat[start : start + bucket.padded_numel],
                )
                self.telemetry.push_bytes += (
                    bucket.shard_numel * group.grad_flat.element_size() * (self.dp_size - 1)
                )
                self.telemetry.num_pushes += 1

    def _retire_oldest_push(self) -> None:
        """Compute waits for the oldest push; then its gradient buffers may be freed and reused."""
        event, _ = self._pushes_in_flight.popleft()
        self._ops.wait(self._compute_stream, event)

    def _retire_all_pushes(self) -> None:
        while self._pushes_in_flight:
            self._retire_oldest_push()

    def finish_backward(self) -> None:
        """End of one backward pass: push partial units (unused parameters) and release everything."""
        for unit in self.layout.units:
            if self.unit_state(unit) is BucketState.PUSHING:
                self.push(unit)
        for unit in self.layout.units:
            self.release(unit)

    # ------------------------------------------------------------------ minibatch protocol

    def begin_minibatch(self) -> None:
        """Start a minibatch: accumulators must be zero and the last step's shards visible everywhere.

        After ``end_step`` that already holds and nothing is communicated. Otherwise (no step since the
        last minibatch, or an abandoned one) fence, zero the owned accumulators, fence again: the first
        fence waits for peers' late pushes, the second for everyone's zeroing.
        """
        self._check_open()
        for unit in self.layout.units:
            if self.unit_state(unit) is BucketState.PUSHING:
                bucket = self._unit_buckets(unit)[0]
                raise RuntimeError(
                    f"DP rank {self.dp_rank}: a minibatch began while bucket {bucket} (unit {unit!r}) "
                    "still holds unpushed gradients; a backward pass did not finish"
                )
            self.release(unit)
        self.telemetry.begin_minibatch()
        if not self._clean:
            with self.telemetry.timed("fence_s"):
                self._retire_all_pushes()
                self.transport.flush()
                self.transport.fence()
                self._zero_accumulators()
                self.transport.fence()
        self._clean = False

    def _zero_accumulators(self) -> None:
        for bucket in self.layout.buckets:
            self.transport.local(self._grad_buffer(bucket.index)).zero_()

    def finish_minibatch(self) -> None:
        """Push what is left, flush, and fence: every owner now holds the full gradient sums."""
        self._check_open()
        self.finish_backward()
        with self.telemetry.timed("fence_s"):
            self._retire_all_pushes()
            self.transport.flush()
            self.transport.fence()
        self.telemetry.end_minibatch()

    def end_step(self) -> None:
        """After the optimizer step (or a skipped one): zero the accumulators, then fence.

        Every rank calls it once per minibatch. Afterwards the new parameter shards are visible to every
        rank (``full_parameters`` and state dicts read current values) and the next minibatch begins
        without communicating.
        """
        self._check_open()
        self._zero_accumulators()
        with self.telemetry.timed("fence_s"):
            self.transport.flush()
            self.transport.fence()
        self.telemetry.end_minibatch()
        self._clean = True

    # ------------------------------------------------------------------ owned shards

    def owned_pieces(self) -> list[OwnedPiece]:
        """Every run of a parameter this rank owns, in layout order (an unsplittable one: at most one)."""
        pieces = []
        for bucket in self.layout.buckets:
            shard_start, _ = bucket.shard_range(self.dp_rank)
            for slot, start, end in bucket.owned_pieces(self.dp_rank):
                lo = slot.bucket_offset + start - shard_start
                pieces.append(
                    OwnedPiece(
                        slot.name, bucket.index, lo, lo + end - start, slot.param_offset + start
                    )
                )
        return pieces

    def begin_shard_writes(self) -> None:
        """Collective: before writing owned parameter shards outside the optimizer step (a load).

        Peers may still be reading this rank's current shards (a ``full_parameters`` / ``state_dict``
        just before, a fetch of an abandoned minibatch); a fence after this rank's own operations
        completes waits for them, so the write cannot land under a peer's read.
        """
        self._check_open()
        self._retire_all_pushes()
        self.transport.flush()
        self.transport.fence()

    def write_owned(self, values: Callable[[OwnedPiece], torch.Tensor | None]) -> None:
        """Write new values into this rank's owned parameter slices (they become visible at the next fence).

        Outside the optimizer step, call ``begin_shard_writes`` first.

        ``values(piece)`` returns the ``piece.numel`` new values of an owned piece (any float dtype), or
        ``None`` to keep it. FP8 parameters are re-quantised through the codec with the amax reduced over
        the DP group, so this is collective when the model has FP8 parameters: every DP rank calls it.
        """
        fp8_values: dict[str, tuple[OwnedPiece, torch.Tensor]] = {}
        params = dict(self.parameters())
        for piece in self.owned_pieces():
            value = values(piece)
            shard = self.param_shard(piece.bucket_index)[piece.shard_lo : piece.shard_hi]
            if piece.name in self.fp8_names:
                if value is None:  # keep: re-quantise the current values with the new shared scale
                    value = self.fp8_codec.dequantize_bytes(params[piece.name], shard)
                fp8_values[piece.name] = (piece, value)
            elif value is not None:
                shard.copy_(value.reshape(-1))
        if not self.fp8_names:
            return
        fp8_params, mains, offsets, shards = [], [], [], []
        for name, param in params.items():  # layout order: the same on every DP rank
            if name not in self.fp8_names:
                continue
            fp8_params.append(param)
            piece, value = fp8_values.get(name, (None, None))
            mains.append(
                None if value is None else value.reshape(-1).to(self.device, torch.float32)
            )
            offsets.append(None if piece is None else piece.param_start)
            shards.append(
                None
                if piece is None
                else self.param_shard(piece.bucket_index)[piece.shard_lo : piece.shard_hi]
            )
        self.fp8_codec.quantize_shards(fp8_params, mains, offsets, shards, self.group)

    def param_shard(self, bucket_index: int) -> torch.Tensor:
        """This rank's compute-dtype parameter shard of a bucket (what peers fetch)."""
        return self.transport.local(self._param_buffer(bucket_index))

    def grad_shard(self, bucket_index: int) -> torch.Tensor:
        """This rank's fp32 gradient accumulator of a bucket (what peers push into)."""
        return self.transport.local(self._grad_buffer(bucket_index))

    def scale_gradients(self, factor: float) -> None:
        """Multiply every owned accumulator by ``factor``."""
        for bucket in self.layout.buckets:
            self.grad_shard(bucket.index).mul_(factor)

    def parameters(self) -> Iterable[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` in layout order."""
        return ((name, e.param) for name, e in self._entries.items())

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's current value, gathered one-sidedly from the owners (copies)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.layout.units:
            was_sharded = self.unit_state(unit) is BucketState.SHARDED
            self.fetch(unit)
            for name in self._unit_param_names(unit):
                param = self._entries[name].param
                if name in self.fp8_names:  # the values the FP8 bytes stand for
                    data = self.fp8_codec.raw_data(param).reshape(-1)
                    out[name] = self.fp8_codec.dequantize_bytes(param, data).view(param.shape)
                else:
                    out[name] = param.detach().clone()
            if was_sharded:
                self.release(unit)
        return out

    def persistent_nbytes(self) -> int:
        """Bytes of the owned parameter shards and gradient accumulators."""
        total = 0
        for bucket in self.layout.buckets:
            total += self.param_shard(bucket.index).nbytes + self.grad_shard(bucket.index).nbytes
        return total

    def unsharded_nbytes(self) -> int:
        """Bytes of unsharded parameter and gradient buffers currently allocated."""
        total = 0
        for groups in self._groups.values():
            for g in groups:
                total += g.params_flat.untyped_storage().nbytes()
                if g.grad_flat is not None:
                    total += g.grad_flat.nbytes
        return total

    def close(self) -> None:
        """Release the transport; the parameters become unusable."""
        if self._closed:
            return
        self._closed = True
        self._pushes_in_flight.clear()
        self.transport.close()
