"""The collective transport: the transport protocol on torch.distributed collectives (the FSDP baseline).

Buffers are plain local tensors. ``gather_shards`` is an all-gather and ``scatter_accumulate`` a
reduce-scatter followed by an ``add_`` into the local fp32 shard, so every rank must call the same
whole-bucket operation at the same time (lockstep). One-sided ``get`` / ``accumulate`` work only on the
rank's own shard; on a peer they raise ``ValueError``. ``fence`` is ``dist.barrier``. Buffers live on the
group's collective device (the current GPU for NCCL, the CPU for gloo), so on GPUs this is the NCCL
all-gather / reduce-scatter baseline.

This module owns the ``CollectiveTransport`` class. It imports no megatron module.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from megatron_odc.transport.base import (
    BufferSpec,
    Transport,
    TransportError,
    check_same_registration,
)
from megatron_odc.transport.devices import collective_device

logger = logging.getLogger(__name__)


def _all_gather_single(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    # torch >= 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_single(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    # gloo implements reduce_scatter_tensor (checked on torch 2.13), so no all_reduce fallback is needed.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


class CollectiveTransport(Transport):
    """One rank's endpoint of the collective (lockstep) transport over a process group.

    Construction and ``register`` are collective over ``group``.

    Args:
        group: the process group; ``None`` means the default (WORLD) group. ``rank`` and ``world_size`` are
            ranks within this group.
        timeout_s: if set and the group is gloo, ``fence`` is a ``dist.monitored_barrier`` with this
            timeout, which raises ``TransportError`` naming the ranks that did not arrive; otherwise
            ``fence`` is ``dist.barrier`` bounded by the process group's own timeout.
        device: where the buffers live; ``None`` means the group's collective device.

    Raises:
        ValueError: torch.distributed is not initialized, or ``timeout_s`` is not positive.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise ValueError(
                "CollectiveTransport needs an initialized torch.distributed process group"
            )
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self._group = group
        self.device = torch.device(device) if device is not None else collective_device(group)
        self.timeout_s = timeout_s
        self._monitored = timeout_s is not None and dist.get_backend(group) == "gloo"
        # Per-buffer fp32 reduce-scatter output, allocated on first use and reused: a fresh large
        # tensor per call costs page faults comparable to the reduction itself.
        self._scratch: dict[str, torch.Tensor] = {}

    def _register(self, spec: BufferSpec) -> torch.Tensor:
        infos: list[object] = [None] * self.world_size
        dist.all_gather_object(infos, (spec.name, spec.numel, str(spec.dtype)), group=self._group)
        check_same_registration(infos)
        return torch.zeros(spec.numel, dtype=spec.dtype, device=self.device)

    def _check_self(self, spec: BufferSpec, peer: int, op: str) -> None:
        if peer != self.rank:
            raise ValueError(
                f"rank {self.rank}: {op} on buffer {spec.name!r} from peer {peer}: the collective "
                "transport only supports whole-bucket gather_shards/scatter_accumulate in lockstep "
                "(one-sided get/accumulate work only on the rank's own shard)"
            )

    def _get(self, spec: BufferSpec, peer: int, offset: int, out: torch.Tensor) -> None:
        self._check_self(spec, peer, "get")
        out.copy_(self._local[spec.name][offset : offset + out.numel()])

    def _accumulate(self, spec: BufferSpec, peer: int, offset: int, src: torch.Tensor) -> None:
        self._check_self(spec, peer, "accumulate")
        self._local[spec.name][offset : offset + src.numel()].add_(src.view(-1))

    def gather_shards(self, name: str, out: torch.Tensor) -> None:
        """All-gather every rank's shard of ``name`` into ``out`` (lockstep: all ranks must call it)."""
        spec = self._spec(name)
        self._check_full(spec, out, "gather_shards")
        if out.dtype != spec.dtype:
            raise ValueError(
                f"rank {self.rank}: gather_shards of buffer {name!r} (dtype {spec.dtype}) into an out "
                f"tensor of dtype {out.dtype}"
            )
        if spec.numel:
            _all_gather_single(out.view(-1), self._local[name], self._group)

    def scatter_accumulate(self, name: str, src: torch.Tensor) -> None:
        """Reduce-scatter ``src`` over the group and add this rank's slice into its fp32 shard (lockstep)."""
        spec = self._spec(name)
        self._check_full(spec, src, "scatter_accumulate")
        self._check_accumulate_target(spec, "scatter_accumulate")
        self._check_accumulate_source(spec, src, "scatter_accumulate")
        if not spec.numel:
            return
        # Sources are reduced in fp32 (a bf16/fp16 reduction would round at every partial sum).
        src_fp32 = src.view(-1).to(torch.float32)
        reduced = self._scratch.get(name)
        if reduced is None:
            reduced = self._scratch[name] = torch.empty(
                spec.numel, dtype=torch.float32, device=self.device
            )
        _reduce_scatter_single(reduced, src_fp32, self._group)
        self._local[name].add_(reduced)

    def flush(self) -> None:
        """Collectives are synchronous: nothing is outstanding."""
        self._check_open()

    def fence(self) -> None:
        """A barrier over the group (monitored, naming missing ranks, when ``timeout_s`` is set on gloo).

        Raises:
            TransportError: a monitored barrier timed out or a peer failed.
        """
        self._check_open()
        if not self._monitored:
            dist.barrier(group=self._group)
            return
        try:
            dist.monitored_barrier(
                group=self._group,
                timeout=datetime.timedelta(seconds=self.timeout_s),
                wait_all_ranks=True,
            )
        except RuntimeError as exc:
            raise TransportError(f"rank {self.rank}: fence failed: {exc}") from exc

    def _close(self) -> None:
        self._scratch.clear()
