"""The ODC bucket runtime of one model over one data-parallel group: orchestration only.

``ODCEngine`` builds the layout (``layout.py``, checked equal on every rank), registers each bucket's
parameter shard and fp32 gradient accumulator in transport memory, and composes the parts that do the work:

- ``storage.UnshardedStorage``: the flat buffers every parameter is a view of, freed while released;
- ``owned.OwnedShards``: this rank's shards and every write into them (FP8 re-quantised);
- ``p2p``: the stateless fetch of a unit's buckets and push of its gradients;
- ``state``: the bucket states and the minibatch phase, each with its guarded transitions;
- ``streams``: on a GPU, fetches on a fetch stream and pushes on a push stream ([Note: overlap streams]);
- ``telemetry``: where time and bytes go.

Per unit (the parameters fetched and released together, e.g. one transformer layer): ``start_fetch`` issues
the gather (a prefetch), ``finish_fetch`` makes compute wait for it, ``release`` frees it;
``begin_backward`` binds ``param.main_grad`` into a zeroed gradient buffer, ``grad_ready`` takes each
parameter's gradient once per backward and pushes the unit once all are in (parameters used several
times, like tied embeddings, are complete when autograd accumulates them, once). At most
``max_pushes_in_flight`` gradient buffers stay alive while their pushes run. *Kept* units ([Note: kept
units] in ``budget.py``) skip both per-use steps: ``release`` leaves them unsharded and a complete
backward does not push them; ``finish_minibatch`` pushes and releases them once.

Per minibatch ([Note: minibatch protocol] in ``state.py``): ``finish_minibatch`` (after the last push)
and ``end_step`` (after the optimizer wrote the new shards) hold the only two DP-wide fences (with
hybrid sharding, fences of the shard group, and ``finish_minibatch`` then sums the accumulators over the
replica group: [Note: hybrid sharding] in ``groups.py``);
``begin_minibatch`` communicates only when the previous minibatch did not end with ``end_step``.

Between steps ``offload_shards`` / ``onload_shards`` move the owned shards to the host and back into
a new transport (the RL phases of ``mcore/rl/offload.py``); ``iter_full_parameters`` yields the full
parameters unit by unit (rollout weight sync).

No megatron import: the Megatron-facing wrapper (``mcore/data_parallel.py``) and the hooks (``hooks.py``)
drive it.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_odc.core import p2p
from megatron_odc.core.agreement import (
    check_same_layout_on_every_rank,
    check_same_values_on_every_rank,
)
from megatron_odc.core.budget import BUDGET_NONE, choose_kept_units, unit_kept_nbytes
from megatron_odc.core.fp8 import Float8ParamCodec
from megatron_odc.core.layout import Layout, ParamSpec, build_layout
from megatron_odc.core.owned import OwnedShards, OwnedValues
from megatron_odc.core.state import BucketState, BucketStates, MinibatchPhase, MinibatchTracker
from megatron_odc.core.storage import BufferNames, OwnedPiece, UnshardedStorage
from megatron_odc.core.streams import StreamOps, TorchStreams
from megatron_odc.core.telemetry import Telemetry
from megatron_odc.transport.base import Transport
from megatron_odc.transport.devices import all_reduce_on_group_device

logger = logging.getLogger(__name__)


class ODCEngine:
    """Sharded parameters and gradient accumulators of one model over one data-parallel group.

    Args:
        named_params: ``(name, parameter, unit)`` triples in forward order; every parameter of a unit is
            fetched and released together. Parameters must be identical on every DP rank.
        transport: this rank's transport endpoint over the DP group (its ``world_size`` is the DP size).
        group: the DP process group (layout and weight checks at construction, FP8 amax reductions).
        bucket_numel: bucket size in elements.
        alignment: element alignment of parameter starts and shards.
        grad_dtype: dtype of the unsharded gradient buffer (default float32); pushes add it into the
            owners' fp32 accumulators.
        buffer_prefix: prefix of the transport buffer names (several engines may share a transport).
        check_params_equal: verify at construction that every DP rank holds the same parameter values.
        streams: the stream implementation (default: ``TorchStreams`` on the transport's device).
        max_pushes_in_flight: unsharded gradient buffers whose push may still run while compute goes on.
        fp8_codec: recognises FP8 parameters and handles their bytes (``None``: no FP8 parameters).
        unsharded_budget: bytes of units kept unsharded, accumulating their gradients locally, from
            their first use in a minibatch to its fence: ``"none"``, ``"all"`` or a size
            (``budget.choose_kept_units`` picks the units; the same on every rank).
        root_unit: the unit of the parameters outside every unit module (ranked first among equals).
        replica_group: hybrid sharding ([Note: hybrid sharding] in ``groups.py``): the ranks holding
            the same shards in the other shard groups; ``transport`` and the layout then span this
            rank's shard group only, ``group`` the whole DP group, and ``finish_minibatch`` sums the
            owned accumulators over ``replica_group`` after the push fence (``None``: no replicas).
        own_buckets: parameters laid out in buckets of their own, whose owned ranges then depend only
            on their size and this layout's DP size, bucket size and alignment (``ParamSpec.
            own_bucket``: a tied embedding's copies on the first and last pipeline stage).
        gradients: register gradient accumulators; ``False`` builds a frozen model (a reference
            model for RL): forward-only fetches, no accumulators, no pushes (a backward is refused).
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
        unsharded_budget: str | int | float = BUDGET_NONE,
        root_unit: str | None = None,
        replica_group: dist.ProcessGroup | None = None,
        own_buckets: Collection[str] = (),
        gradients: bool = True,
    ) -> None:
        if max_pushes_in_flight < 1:
            raise ValueError(f"max_pushes_in_flight must be >= 1, got {max_pushes_in_flight}")
        self.transport = transport
        self.group = group
        self.replica_group = replica_group
        self.replica_rank = dist.get_rank(replica_group) if replica_group is not None else 0
        self.dp_rank = transport.rank  # in the shard group: which shard this rank owns
        self.dp_size = transport.world_size
        self.device = transport.device
        self.grad_dtype = grad_dtype
        self.telemetry = Telemetry()
        self.fp8_codec = fp8_codec
        self.max_pushes_in_flight = max_pushes_in_flight
        self.names = BufferNames(buffer_prefix)
        self._closed = False
        self.fp8_names: frozenset[str] = frozenset(
            name for name, p, _ in named_params if fp8_codec is not None and fp8_codec.is_fp8(p)
        )
        self._check_params(named_params)
        self.layout: Layout = build_layout(
            [
                ParamSpec(
                    name,
                    tuple(p.shape),
                    torch.uint8 if name in self.fp8_names else p.dtype,
                    unit,
                    splittable=name not in self.fp8_names,
                    own_bucket=name in own_buckets,
                )
                for name, p, unit in named_params
            ],
            self.dp_size,
            bucket_numel=bucket_numel,
            alignment=alignment,
        )
        check_same_layout_on_every_rank(self.layout, self.dp_rank, self.group)
        self.kept_units: frozenset[str] = choose_kept_units(
            self.layout, unsharded_budget, grad_dtype=grad_dtype, root_unit=root_unit
        )
        if self.kept_units:
            logger.info(
                "ODC unsharded budget %s: %d of %d units kept for whole minibatches (%.1f MiB)",
                unsharded_budget,
                len(self.kept_units),
                len(self.layout.units),
                sum(unit_kept_nbytes(self.layout, u, grad_dtype) for u in self.kept_units) / 2**20,
            )
        params = {name: p for name, p, _ in named_params}
        if check_params_equal:
            check_same_values_on_every_rank(
                [
                    (name, fp8_codec.raw_data(p) if name in self.fp8_names else p.detach())
                    for name, p in params.items()
                ],
                self.dp_rank,
                self.group,
            )
        self.gradients = gradients
        for bucket in self.layout.buckets:
            transport.register(
                self.names.param(bucket.index), bucket.shard_numel, bucket.dtype, accumulate=False
            )
            if gradients:
                transport.register(self.names.grad(bucket.index), bucket.shard_numel, torch.float32)
        self.owned = OwnedShards(
            transport, self.layout, self.names, params, group, fp8_codec, self.fp8_names, gradients
        )
        self.owned.write_initial()
        self.storage = UnshardedStorage(self.layout, params, self.device, fp8_codec, self.fp8_names)
        self.buckets = BucketStates(self.layout, self.dp_rank)
        self.minibatch = MinibatchTracker(self.dp_rank)

        self._ops = streams if streams is not None else TorchStreams(self.device)
        # Compute runs on the caller's stream; fetches and pushes on their own so that they overlap it.
        self._compute_stream = self._ops.stream("compute")
        self._fetch_stream = self._ops.stream("fetch")
        self._push_stream = self._ops.stream("push")
        self._fetch_events: dict[str, object] = {}
        # (push event, unsharded gradient buffers it reads), oldest first.
        self._pushes_in_flight: collections.deque[tuple[object, list[torch.Tensor]]] = (
            collections.deque()
        )
        self._pending: dict[str, set[str]] = {unit: set() for unit in self.layout.units}
        self._ready: dict[str, set[str]] = {unit: set() for unit in self.layout.units}
        self._host_shards: dict[str, torch.Tensor] | None = None  # while offloaded
        # Counts what changes or frees unsharded parameters (a release, a step, a write of shards):
        # a paused ``iter_full_parameters`` compares it when resumed.
        self._changes = 0
        self._host_specs: list = []
        self.transport.fence()  # every shard written and visible: the first minibatch needs no fence

    # ------------------------------------------------------------------ construction checks

    def _check_params(self, named_params: Sequence[tuple[str, torch.nn.Parameter, str]]) -> None:
        for name, p, _ in named_params:
            if name in self.fp8_names:
                self.fp8_codec.check(p, name)
            if p.device != self.device:
                raise ValueError(
                    f"DP rank {self.dp_rank}: parameter {name!r} is on {p.device} but the "
                    f"{type(self.transport).__name__}'s memory is on {self.device}; move the model "
                    f"to {self.device} before wrapping it"
                )

    # ------------------------------------------------------------------ state

    @property
    def states(self) -> list[BucketState]:
        """The state of every bucket, in layout order."""
        return self.buckets.states

    @property
    def phase(self) -> MinibatchPhase:
        """Where the minibatch protocol is."""
        return self.minibatch.phase

    def unit_state(self, unit: str) -> BucketState:
        """The state of a unit's buckets (they move together)."""
        return self.buckets.of_unit(unit)

    def check_open(self) -> None:
        """Raise one line if the engine is closed or its owned shards are offloaded (their storage
        freed: reading them would crash the process)."""
        if self._closed:
            raise RuntimeError(f"DP rank {self.dp_rank}: the ODC engine is closed")
        if self._host_shards is not None:
            raise RuntimeError(
                f"DP rank {self.dp_rank}: the owned shards are offloaded; onload them first"
            )

    # ------------------------------------------------------------------ fetch / release

    def start_fetch(self, unit: str) -> None:
        """Issue the gather of the unit's buckets from every owner on the fetch stream (a prefetch).

        A no-op unless the unit is released. ``finish_fetch`` makes compute wait for it.
        """
        self.check_open()
        if self.unit_state(unit) is not BucketState.SHARDED:
            return
        with self.telemetry.timed("fetch_wait_s"):
            # The freed storage may be reused by the allocator for this fetch: compute's earlier reads of
            # whatever lived there must be done before the fetch stream overwrites it.
            self.storage.allocate_params(unit)
            self.buckets.move_unit(unit, BucketState.FETCHING, "fetch")
            self._fetch_events[unit] = self._after_compute(
                self._fetch_stream,
                f"fetch:{unit}",
                p2p.fetch_groups,
                unit,
                self.telemetry.add_fetch,
            )

    def finish_fetch(self, unit: str) -> None:
        """Make compute wait for the unit's fetch; afterwards its parameters may be used."""
        self.check_open()
        if self.unit_state(unit) is not BucketState.FETCHING:
            return
        with self.telemetry.timed("fetch_wait_s"):
            self._ops.wait(self._compute_stream, self._fetch_events.pop(unit))
            self.buckets.move_unit(unit, BucketState.UNSHARDED, "fetch")
            fp8 = self.storage.fp8_params(unit)
            if fp8:
                self.fp8_codec.after_fetch(fp8)

    def fetch(self, unit: str) -> None:
        """Assemble the unit's parameters from every owner; a no-op if they are already present."""
        self.start_fetch(unit)
        self.finish_fetch(unit)

    def release(self, unit: str) -> None:
        """Free the unit's unsharded parameters; a no-op if already released or kept (a kept unit is
        released by ``finish_minibatch``)."""
        if unit not in self.kept_units:
            self._release(unit)

    def _release(self, unit: str) -> None:
        if self.unit_state(unit) is BucketState.SHARDED:
            return
        # A prefetch nobody used: its writes must end before the memory is reused.
        self.finish_fetch(unit)
        fp8 = self.storage.fp8_params(unit)
        if fp8:
            self.fp8_codec.before_release(fp8)
        self.buckets.move_unit(unit, BucketState.SHARDED, "release")
        self.storage.free_params(unit)
        self._changes += 1

    def release_all(self) -> None:
        """Release every unit, kept ones included (after pushing any partial gradients)."""
        for unit in self.layout.units:
            if self.unit_state(unit) is BucketState.PUSHING:
                self.push(unit)
            self._release(unit)

    # ------------------------------------------------------------------ backward and push

    def begin_backward(self, unit: str) -> None:
        """Start collecting the unit's gradients: bind ``param.main_grad`` into a zeroed grad buffer."""
        self.check_open()
        if not self.gradients:
            raise RuntimeError(
                f"DP rank {self.dp_rank}: a backward reached unit {unit!r} of a frozen ODC model "
                "(built without gradients: a reference model runs forward only)"
            )
        if self.unit_state(unit) is BucketState.PUSHING:
            return
        self.minibatch.check("push")  # refuse before any gradient buffer is bound
        self.buckets.move_unit(unit, BucketState.PUSHING, "begin_backward")
        self._pending[unit] = self.storage.bind_grads(unit, self.grad_dtype)
        self._ready[unit] = set()

    def grad_ready(self, param: torch.nn.Parameter, name: str) -> str | None:
        """Take ``param``'s gradient for this backward; push the unit once all of its gradients are in.

        Returns:
            The unit's name if this gradient completed it and it was pushed, else ``None``.
        """
        entry = self.storage.entry(name)
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
        if self._ready[unit] >= self._pending[unit] and unit not in self.kept_units:
            self.push(unit)
            return unit
        return None

    def push(self, unit: str) -> None:
        """Accumulate each owner's slice of the unit's unsharded gradient into the owner's shard.

        Issued on the push stream after the compute that produced the gradients; the unsharded gradient
        buffers stay alive until compute has waited for their push (see ``max_pushes_in_flight``).
        """
        self.check_open()
        if self.unit_state(unit) is not BucketState.PUSHING:
            self.buckets.move_unit(unit, BucketState.UNSHARDED, "push")  # raises: nothing to push
        self.minibatch.move("push")
        with self.telemetry.timed("push_s"):
            event = self._after_compute(
                self._push_stream, f"push:{unit}", p2p.push_groups, unit, self.telemetry.add_push
            )
            self.buckets.move_unit(unit, BucketState.UNSHARDED, "push")
            self._pushes_in_flight.append((event, self.storage.unbind_grads(unit)))
            while len(self._pushes_in_flight) > self.max_pushes_in_flight:
                self._retire_oldest_push()
        self._pending[unit] = set()
        self._ready[unit] = set()

    def _after_compute(
        self,
        stream: object,
        label: str,
        transfer: Callable[..., p2p.TransferResult],
        unit: str,
        count: Callable[[p2p.TransferResult], None],
    ) -> object:
        """Issue ``transfer`` of the unit's groups on ``stream`` after the compute issued so far.

        Returns:
            The event of the transfer's completion on ``stream``.
        """
        self._ops.wait(stream, self._ops.record(self._compute_stream))
        groups = self.storage.groups(unit)
        self._ops.launch(
            stream,
            label,
            lambda: count(transfer(self.transport, self.layout, groups, self.names)),
            0.0,
        )
        return self._ops.record(stream)

    def _retire_oldest_push(self) -> None:
        """Compute waits for the oldest push; then its gradient buffers may be freed and reused."""
        event, _ = self._pushes_in_flight.popleft()
        self._ops.wait(self._compute_stream, event)

    def _complete_own_operations(self) -> None:
        """Every fetch and push this rank issued is done at its target (not yet a fence)."""
        while self._pushes_in_flight:
            self._retire_oldest_push()
        self.transport.flush()

    def finish_backward(self) -> None:
        """End of one backward pass: push partial units (unused parameters) and release everything;
        kept units keep their parameters and go on accumulating their gradients."""
        for unit in self.layout.units:
            if unit in self.kept_units:
                self._ready[unit] = set()  # the next backward adds to the same gradient buffer
            elif self.unit_state(unit) is BucketState.PUSHING:
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
        self.check_open()
        for unit in self.layout.units:
            if self.unit_state(unit) is BucketState.PUSHING:
                if unit in self.kept_units and not self._ready[unit]:
                    # A kept unit's local sums of an abandoned minibatch (no finish_minibatch):
                    # dropped, as the owners' accumulators are zeroed below.
                    self.storage.unbind_grads(unit)
                    self.buckets.move_unit(unit, BucketState.UNSHARDED, "begin_minibatch")
                    self._pending[unit] = set()
                    self._release(unit)
                    continue
                bucket = self.buckets.unit_buckets(unit)[0]
                raise RuntimeError(
                    f"DP rank {self.dp_rank}: a minibatch began while bucket {bucket} (unit {unit!r}) "
                    "still holds unpushed gradients; a backward pass did not finish"
                )
            self._release(unit)  # kept units too: a step may have changed them
        self.telemetry.begin_minibatch()
        if self.minibatch.move("begin_minibatch") is not MinibatchPhase.READY:
            with self.telemetry.timed("fence_s"):
                self._complete_own_operations()
                self.transport.fence()
                self.owned.zero_grads()
                self.transport.fence()

    def finish_minibatch(self) -> None:
        """Push what is left (kept units: their whole minibatch), release every unit, flush, and
        fence: every owner now holds the full gradient sums."""
        self.check_open()
        self.finish_backward()
        self.release_all()
        with self.telemetry.timed("fence_s"):
            self._complete_own_operations()
            self.transport.fence()
            self._sum_over_replicas()
        self.minibatch.move("finish_minibatch")
        self.telemetry.end_minibatch()

    def _sum_over_replicas(self) -> None:
        """Hybrid sharding: add every replica's fp32 accumulator shards, one all-reduce per bucket."""
        if self.replica_group is None:
            return
        for bucket in self.layout.buckets:
            all_reduce_on_group_device(
                self.owned.grad_shard(bucket.index), group=self.replica_group
            )

    def end_step(self) -> None:
        """After the optimizer step (or a skipped one): zero the accumulators, then fence.

        Every rank calls it once per minibatch. Afterwards the new parameter shards are visible to every
        rank (``full_parameters`` and state dicts read current values) and the next minibatch begins
        without communicating.

        Raises:
            RuntimeError: the minibatch's pushes were not fenced yet (``finish_minibatch``).
        """
        self.check_open()
        self.minibatch.move("end_step")
        self._changes += 1
        self.owned.zero_grads()
        with self.telemetry.timed("fence_s"):
            self.transport.flush()
            self.transport.fence()
        self.telemetry.end_minibatch()

    # ------------------------------------------------------------------ owned shards

    def owned_pieces(self) -> list[OwnedPiece]:
        """Every run of a parameter this rank owns, in layout order (an unsplittable one: at most one)."""
        return self.owned.pieces

    def begin_shard_writes(self) -> None:
        """Collective: before writing owned parameter shards outside the optimizer step (a load).

        Peers may still be reading this rank's current shards (a ``full_parameters`` / ``state_dict``
        just before, a fetch of an abandoned minibatch); a fence after this rank's own operations
        completes waits for them, so the write cannot land under a peer's read.
        """
        self.check_open()
        self._complete_own_operations()
        self.transport.fence()

    def write_owned(self, values: OwnedValues) -> None:
        """Write new values into this rank's owned parameter slices (visible at the next fence).

        Outside the optimizer step, call ``begin_shard_writes`` first. Collective when the model has
        FP8 parameters (see :meth:`OwnedShards.write`).
        """
        self._changes += 1
        self.owned.write(values)

    def param_shard(self, bucket_index: int) -> torch.Tensor:
        """This rank's compute-dtype parameter shard of a bucket (what peers fetch)."""
        return self.owned.param_shard(bucket_index)

    def grad_shard(self, bucket_index: int) -> torch.Tensor:
        """This rank's fp32 gradient accumulator of a bucket (what peers push into)."""
        return self.owned.grad_shard(bucket_index)

    def scale_gradients(self, factor: float) -> None:
        """Multiply every owned accumulator by ``factor``."""
        self.owned.scale_grads(factor)

    def parameters(self) -> Iterable[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` in layout order."""
        return self.storage.parameters()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's current value, gathered one-sidedly from the owners (copies)."""
        return dict(self.iter_full_parameters())

    def iter_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, copy of its current value)`` unit by unit, in layout order: each released unit is
        fetched before its parameters are yielded and released again before the next unit is
        fetched, so at most one unit is unsharded beyond those already held. One-sided: no rank
        waits for another.

        Iterate it to the end (or close it) before anything changes the parameters: resumed after a
        release, a step, a load or an offload, it raises instead of reading freed memory or mixing
        the values of two steps (and leaves the units as the interruption left them).
        """
        changes = self._changes
        for unit in self.layout.units:
            was_sharded = self.unit_state(unit) is BucketState.SHARDED
            self.fetch(unit)
            try:
                for name in self.storage.names(unit):
                    param = self.storage.entry(name).param
                    if name in self.fp8_names:  # the values the FP8 bytes stand for
                        data = self.fp8_codec.raw_data(param).reshape(-1)
                        yield name, self.fp8_codec.dequantize_bytes(param, data).view(param.shape)
                    else:
                        yield name, param.detach().clone()
                    if self._changes != changes:
                        raise RuntimeError(
                            f"DP rank {self.dp_rank}: the full-parameter iterator was resumed after "
                            f"the parameters changed or were released while it was paused at unit "
                            f"{unit!r} (a training step, a load or an offload); iterate it to the end "
                            "between steps, or start a new one"
                        )
            finally:
                if was_sharded and self._changes == changes:
                    self._release(unit)
                    changes = self._changes

    def persistent_nbytes(self) -> int:
        """Bytes of the owned parameter shards and gradient accumulators."""
        return self.owned.persistent_nbytes()

    def unsharded_nbytes(self) -> int:
        """Bytes of unsharded parameter and gradient buffers currently allocated."""
        return self.storage.unsharded_nbytes()

    # ------------------------------------------------------------------ offload between phases

    @property
    def offloaded(self) -> bool:
        """Whether the owned shards are off the device (:meth:`offload_shards`)."""
        return self._host_shards is not None

    def check_offload(self) -> None:
        """Raise one line unless :meth:`offload_shards` may run now (between steps, once).

        Raises:
            RuntimeError: the engine is closed, its shards are already offloaded, or a minibatch is
                under way.
        """
        if self.offloaded:
            raise RuntimeError(f"DP rank {self.dp_rank}: the owned shards are already offloaded")
        self.check_open()
        if self.phase is not MinibatchPhase.READY:
            raise RuntimeError(
                f"DP rank {self.dp_rank}: offload between steps, not in minibatch phase "
                f"{self.phase.value}"
            )

    def offload_shards(self, host: torch.device) -> None:
        """Collective, between steps: copy every owned shard (parameters and gradient accumulators)
        to ``host`` and close the transport, which frees its memory (every unit is released first).

        Until :meth:`onload_shards` nothing may fetch, push or read a shard.

        Raises:
            RuntimeError: see :meth:`check_offload`.
        """
        self.check_offload()
        self.release_all()
        self._complete_own_operations()
        self.transport.fence()  # no peer still reads this rank's shards
        names = self.transport.buffer_names
        self._host_specs = [self.transport.spec(name) for name in names]
        self._host_shards = {name: self.transport.local(name).to(host, copy=True) for name in names}
        self.transport.close()

    def onload_shards(self, transport: Transport) -> None:
        """Collective: register the offloaded shards in ``transport`` (a new endpoint over the same
        group and device), copy them back and fence; the engine then runs on ``transport``."""
        if self._closed:
            raise RuntimeError(f"DP rank {self.dp_rank}: the ODC engine is closed")
        if not self.offloaded:
            raise RuntimeError(f"DP rank {self.dp_rank}: onload without an offload")
        for spec in self._host_specs:
            local = transport.register(
                spec.name, spec.numel, spec.dtype, accumulate=spec.accumulate
            )
            local.copy_(self._host_shards[spec.name])
        self.transport = transport
        self.owned.transport = transport
        self._host_shards = None
        transport.fence()  # every shard written and visible before anyone fetches it

    def close(self) -> None:
        """Release the transport; the parameters become unusable."""
        if self._closed:
            return
        self._closed = True
        self._pushes_in_flight.clear()
        self.transport.close()
