"""The NVSHMEM transport: one-sided get and accumulate between GPUs on several nodes (PyTorch symmetric
memory with its NVSHMEM backend).

It is the ``cuda`` transport (``cuda.py``: every buffer one symmetric allocation, the caller's stream
orders every operation) with PyTorch's NVSHMEM backend (``symm_mem.set_backend("NVSHMEM")``) and two
paths per peer:

- a peer whose memory this GPU can load and store (``hdl.buffer_ptrs[peer]`` non-zero: ``nvshmem_ptr``
  found a P2P mapping, i.e. a GPU of this node) goes through the ``cuda`` transport's code unchanged:
  ``get_buffer(peer).copy_()``, and an ``add_`` into this rank's staging slot at the peer;
- any other peer (another node) through NVSHMEM's one-sided get and put, launched as Triton kernels over
  torch's NVSHMEM device bindings (``torch.distributed._symmetric_memory._nvshmem_triton``,
  ``@requires_nvshmem``). NVSHMEM addresses a peer's memory by this rank's *symmetric* address of the same
  allocation, and its network transports move data only from and into registered memory, which torch does
  not let us register; so both go through a symmetric *bounce* buffer of this rank (one for gets, one for
  accumulates, ``bounce_nbytes`` each): a get is NVSHMEM get into the bounce buffer, then a device copy
  into ``out``; a put is a device copy into the bounce buffer, then NVSHMEM put.

[Note: nvshmem accumulate]
NVSHMEM has no remote float add (its atomics add integers only), so ``accumulate`` always uses the
staging slots of ``staging.py``, as the deterministic modes of the other transports do: at each owner,
every fp32 accumulate buffer has a staging buffer of one shard-sized slot per source; source ``s`` alone
writes slot ``s``, and at the fence each owner adds the slots into its shard in source order 0, 1, ...,
W-1 and zeroes them, so sums are bitwise reproducible whatever the timing. From another node a source
cannot add into its slot, it can only overwrite it: the first push into a range of the slot since the
last fence is a put (the slot is zero there), and a later push overlapping it (another microbatch's
gradients for the same owner) reads the range back, adds and puts it again (this rank remembers, per
owner and buffer, the ranges it wrote since the fence). Each put kernel ends with ``nvshmem_quiet``, so a
push is delivered at the owner once its kernel has completed: ``flush`` is a device synchronize, and the
fence is then a barrier, the owner reduce, and a second barrier (no source writes a slot again before
its owner drained it).

Memory: the staging costs one fp32 shard per source per accumulate buffer at every owner, i.e. 4 bytes
per element of the whole (unsharded) gradient buffer on every rank, plus ``2 * bounce_nbytes`` (32 MiB by
default); on full sharding over N ranks that is 4 P bytes per rank against 18 P / N of sharded state
(P parameters; e.g. 7B parameters over 16 GPUs: 28 GB of staging next to 7.9 GB of state). The
alternative, a bounded ring of slots with flow control, needs each owner to drain its slots *during*
the minibatch (a progress thread or a persistent kernel waiting on signals: the reduction watcher of
the ODC paper), which takes the owner out of its passive role, holds an SM or a core, and sums in
arrival order unless each owner again keeps one accumulator per source. We keep the owner passive and
the sums deterministic and pay the memory: use this transport where 4 P bytes fit beside the model, and
hybrid sharding (one shard group per node, ``core/groups.py``) elsewhere.

The fence meets on the job's rendezvous store (``torch.distributed``'s default store): each rank adds
itself to a counter, the last one sets a key the others wait on, so the fence is bounded by
``timeout_s`` and names the ranks that did not arrive; a peer on the same machine that died is named at
once (its pid). (The NVSHMEM backend's own ``hdl.barrier()`` does nothing in torch 2.13.)

Limits: PyTorch allocates NVSHMEM memory collectively over every process of the job (``nvshmem_malloc``
on the world team), so the transport's group must be the whole world (full sharding, TP = PP = CP = 1),
and every allocation must fit the NVSHMEM heap (``NVSHMEM_SYMMETRIC_SIZE``). Feature-probed, never
assumed (:func:`nvshmem_unavailable_reason`): without CUDA, without an NVSHMEM build of PyTorch, or
without Triton and NVSHMEM's device library, construction raises ``ValueError`` naming
``--odc-transport nvshmem`` and what to do instead. The logic is tested on CPU with
``tests/_fake_cuda.py``; on GPUs it is not yet run (``benchmarks/gpu_check.py`` has its check), and never
across real nodes. It imports no megatron module.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_odc.transport.base import BufferSpec, TransportError
from megatron_odc.transport.cuda import (
    CudaSymmTransport,
    SymmMemFeatures,
    chunk_ranges,
    probe_symm_mem,
)
from megatron_odc.transport.hosts import pid_alive
from megatron_odc.transport.staging import staging_slot_offset

logger = logging.getLogger(__name__)

FLAG = "--odc-transport nvshmem"
"""How users ask for this transport; every refusal names it."""

ALTERNATIVES = (
    "keep each shard group inside a node (leave --odc-shard-group-size unset: hybrid sharding, the cuda "
    "transport inside the node) or use --odc-transport collective"
)
"""What to do instead when the transport cannot run."""

REMOTE_PEERS = ("auto", "all")
"""``remote_peers`` choices: peers without a load/store pointer go through NVSHMEM (``auto``), or every
other rank does (``all``: the NVSHMEM path checked on one node)."""

BOUNCE_NBYTES = 16 << 20
"""Default bytes of each bounce buffer (one for gets, one for accumulates)."""

PROGRAM_NBYTES = 1 << 20
"""Bytes one Triton program moves with one block-scoped NVSHMEM get or put."""

_LIVENESS_PERIOD_S = 0.5
"""How often a waiting fence checks whether its late peers on this machine are alive."""


# ---------------------------------------------------------------------- feature probe


def nvshmem_unavailable_reason(features: SymmMemFeatures | None = None) -> str | None:
    """Why this PyTorch cannot run the nvshmem transport, or ``None`` when its symmetric memory has an
    NVSHMEM backend (checked without touching a GPU; Triton and the device library are checked when the
    transport is built).

    Args:
        features: a probe result (default: :func:`probe_symm_mem` of the installed PyTorch).
    """
    features = features if features is not None else probe_symm_mem()
    version = f"PyTorch {torch.__version__}"
    if not features.usable:
        return f"{version} has no usable torch.distributed._symmetric_memory (empty / rendezvous)"
    if not features.has_set_backend:
        return f"{version} cannot choose a symmetric-memory backend (set_backend: PyTorch >= 2.8)"
    if not features.nvshmem_available:
        return (
            f"{version} has no NVSHMEM (torch.distributed._symmetric_memory.is_nvshmem_available() is "
            "False: a CPU build, or a CUDA build without the nvidia-nvshmem package)"
        )
    return None


# ---------------------------------------------------------------------- pure logic


def remote_peers(buffer_ptrs: Sequence[int], rank: int, mode: str = "auto") -> frozenset[int]:
    """The peers reached through NVSHMEM get / put rather than through load / store.

    Args:
        buffer_ptrs: every rank's address of one symmetric allocation as this rank sees it (``0``: no
            P2P mapping, a peer on another node).
        rank: this rank.
        mode: ``"auto"`` (the peers without a mapping) or ``"all"`` (every other rank).

    Raises:
        ValueError: an unknown mode, or a rank outside ``buffer_ptrs``.
    """
    if mode not in REMOTE_PEERS:
        raise ValueError(
            f"remote_peers {mode!r} is not one of {', '.join(map(repr, REMOTE_PEERS))}"
        )
    if not 0 <= rank < len(buffer_ptrs):
        raise ValueError(f"rank {rank} is outside a group of size {len(buffer_ptrs)}")
    return frozenset(
        peer
        for peer, ptr in enumerate(buffer_ptrs)
        if peer != rank and (mode == "all" or not int(ptr))
    )


def overlaps(ranges: Sequence[tuple[int, int]], lo: int, hi: int) -> bool:
    """Whether ``[lo, hi)`` shares an element with one of ``ranges`` (half-open ``(lo, hi)`` pairs)."""
    return any(a < hi and lo < b for a, b in ranges)


# ---------------------------------------------------------------------- device operations (GPU)


class NvshmemDeviceOps:
    """NVSHMEM get and put between this rank's symmetric memory and a peer's, on the current stream.

    Triton kernels over torch's NVSHMEM device bindings; each program moves :data:`PROGRAM_NBYTES` with
    one block-scoped call. Both the local and the remote side must be symmetric memory: the remote one is
    named by this rank's address of the same allocation.
    """

    def __init__(self) -> None:  # pragma: no cover - needs a GPU with NVSHMEM
        import triton
        import triton.language as tl
        from torch.distributed._symmetric_memory import _nvshmem_triton as nvshmem

        @nvshmem.requires_nvshmem
        @triton.jit
        def _megatron_odc_nvshmem_get(dest, source, nbytes, chunk, pe):
            lo = tl.program_id(0).to(tl.int64) * chunk
            nvshmem.get(dest + lo, source + lo, tl.minimum(chunk, nbytes - lo), pe)

        @nvshmem.requires_nvshmem
        @triton.jit
        def _megatron_odc_nvshmem_put(dest, source, nbytes, chunk, pe):
            lo = tl.program_id(0).to(tl.int64) * chunk
            nvshmem.put(dest + lo, source + lo, tl.minimum(chunk, nbytes - lo), pe)
            nvshmem.quiet()  # delivered at the peer when the kernel completes

        self._cdiv = triton.cdiv
        self._get = _megatron_odc_nvshmem_get
        self._put = _megatron_odc_nvshmem_put

    def get(self, dest: torch.Tensor, source: torch.Tensor, pe: int) -> None:
        """``dest`` (local) <- PE ``pe``'s memory at ``source``'s symmetric address; complete when the
        kernel is."""
        self._launch(self._get, dest, source, pe)  # pragma: no cover - GPU only

    def put(self, dest: torch.Tensor, source: torch.Tensor, pe: int) -> None:
        """PE ``pe``'s memory at ``dest``'s symmetric address <- ``source`` (local); delivered when the
        kernel completes."""
        self._launch(self._put, dest, source, pe)  # pragma: no cover - GPU only

    def _launch(self, kernel: Any, dest: torch.Tensor, source: torch.Tensor, pe: int) -> None:
        nbytes = dest.numel() * dest.element_size()  # pragma: no cover - GPU only
        assert nbytes == source.numel() * source.element_size(), (dest.shape, source.shape)
        grid = (self._cdiv(nbytes, PROGRAM_NBYTES),)
        kernel[grid](dest.view(torch.uint8), source.view(torch.uint8), nbytes, PROGRAM_NBYTES, pe)


def load_device_ops() -> NvshmemDeviceOps:
    """The NVSHMEM get / put kernels (Triton; torch's NVSHMEM device library).

    Raises:
        ValueError: Triton or the NVSHMEM device library (``libnvshmem_device.bc``) is missing.
    """
    try:
        return NvshmemDeviceOps()
    except (ImportError, RuntimeError, AttributeError) as exc:
        raise ValueError(
            f"{FLAG} needs Triton and NVSHMEM's device library (libnvshmem_device.bc, from the "
            f"nvidia-nvshmem package or NVSHMEM_LIB_DIR) for its gets and puts between nodes, and "
            f"they are not usable here ({exc}); {ALTERNATIVES}"
        ) from exc


# ---------------------------------------------------------------------- the transport


class NvshmemTransport(CudaSymmTransport):
    """One rank's endpoint of the NVSHMEM transport over the whole world (collective construction).

    Args:
        group: the process group; ``None`` means WORLD, and it must have every rank of the job.
        timeout_s: how long a fence (and a registration) waits for the peers before raising
            ``TransportError`` naming the ranks that did not arrive.
        device: CUDA device of this rank; ``None`` means ``torch.cuda.current_device()``.
        remote_peers: ``"auto"`` (NVSHMEM get / put for the peers on other nodes, load / store for this
            node's) or ``"all"`` (NVSHMEM for every other rank: how one node checks the inter-node path).
        bounce_nbytes: bytes of each of the two bounce buffers (gets, accumulates); a multiple of 16.

    Attributes:
        heap_nbytes: bytes of NVSHMEM symmetric memory this rank allocated (shards, staging slots, bounce
            buffers).
        remote: the peers reached through NVSHMEM get / put (known after the first ``register``).

    Raises:
        ValueError: an option is out of range, there is no CUDA, this PyTorch has no NVSHMEM backend, Triton
            or the NVSHMEM device library is missing, or the group is not the whole world (each message
            names ``--odc-transport nvshmem`` and what to do instead).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float = 60.0,
        device: torch.device | int | str | None = None,
        remote_peers: str = "auto",
        bounce_nbytes: int = BOUNCE_NBYTES,
    ) -> None:
        if remote_peers not in REMOTE_PEERS:
            raise ValueError(
                f"remote_peers {remote_peers!r} is not one of {', '.join(map(repr, REMOTE_PEERS))}"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if bounce_nbytes < 16 or bounce_nbytes % 16:
            raise ValueError(
                f"bounce_nbytes must be a positive multiple of 16, got {bounce_nbytes}"
            )
        if not torch.cuda.is_available():
            raise ValueError(
                f"{FLAG} moves GPU memory between nodes, but torch.cuda.is_available() is False "
                f"(PyTorch {torch.__version__}); for CPU ranks across hosts use --odc-transport mpi "
                "(launched with mpiexec), or leave --odc-shard-group-size unset (hybrid sharding)"
            )
        reason = nvshmem_unavailable_reason()
        if reason is not None:
            raise ValueError(f"{FLAG}: {reason}; {ALTERNATIVES}")
        if not dist.is_initialized():
            raise ValueError(f"{FLAG} needs an initialized torch.distributed process group")
        group_size, world_size = dist.get_world_size(group), dist.get_world_size()
        if group_size != world_size:
            raise ValueError(
                f"{FLAG}: PyTorch allocates NVSHMEM memory collectively over every process of the job, "
                f"so the transport's group must be the whole world, but it has {group_size} of "
                f"{world_size} ranks (tensor, pipeline or context parallelism, or shard groups smaller "
                "than the world); shard over every rank with TP = PP = CP = 1, or keep each shard group "
                "inside a node (hybrid sharding, the cuda transport)"
            )
        self._ops: Any = load_device_ops()
        self.remote_peers = remote_peers
        self.bounce_nbytes = int(bounce_nbytes)
        self.heap_nbytes = 0
        self.remote: frozenset[int] = frozenset()
        self._bounce_views: dict[str, torch.Tensor] = {}
        self._bounce_streams: dict[str, Any] = {}
        self._written: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._meetings = 0
        super().__init__(
            group,
            accumulate_mode="deterministic",
            device=device,
            timeout_s=timeout_s,
            fence_via="process_group",
        )
        self._pes = dist.get_process_group_ranks(self._group)  # NVSHMEM numbers PEs by global rank
        infos: list[object] = [None] * self.world_size
        dist.all_gather_object(
            infos, (socket.gethostname(), os.getpid(), uuid.uuid4().hex), group=self._group
        )
        here = socket.gethostname()
        self._local_pids = {r: pid for r, (host, pid, _) in enumerate(infos) if host == here}
        store = dist.distributed_c10d._get_default_store()
        self._store = dist.PrefixStore(f"megatron_odc/nvshmem/{infos[0][2]}/", store)

    def _select_backend(self, num_hosts: int, requested: str | None) -> str:
        """PyTorch's NVSHMEM backend, switched on before this process's first symmetric allocation."""
        del num_hosts, requested
        symm_mem = self._symm_mem_module()
        get_backend = getattr(symm_mem, "get_backend", None)
        if get_backend is None or get_backend(self.device) != "NVSHMEM":
            try:
                symm_mem.set_backend("NVSHMEM")
            except RuntimeError as exc:
                raise ValueError(
                    f"{FLAG}: PyTorch's symmetric memory could not switch to its NVSHMEM backend "
                    f"({exc}); the backend is chosen once per process, before the first symmetric "
                    "allocation, so build this transport before anything else allocates symmetric "
                    "memory (another cuda transport, TORCH_SYMMMEM set to another backend)"
                ) from exc
        return "NVSHMEM"

    @staticmethod
    def _symm_mem_module() -> Any:
        import torch.distributed._symmetric_memory as symm_mem

        return symm_mem

    # ------------------------------------------------------------------ buffers

    def _symmetric(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        nbytes = max(numel, 1) * dtype.itemsize
        try:
            result = super()._symmetric(numel, dtype)
        except RuntimeError as exc:
            raise ValueError(
                f"{FLAG}: rank {self.rank} could not allocate {nbytes} bytes of NVSHMEM symmetric "
                f"memory after {self.heap_nbytes} ({exc}); the NVSHMEM heap holds every shard, "
                "staging slot and bounce buffer of the transport: set NVSHMEM_SYMMETRIC_SIZE (bytes, "
                "e.g. 64G) above what they need"
            ) from exc
        self.heap_nbytes += nbytes
        return result

    def _register(self, spec: BufferSpec) -> torch.Tensor:
        if not self._bounce_views:  # the first registration: every rank allocates alike
            bounce, handle = self._symmetric(2 * self.bounce_nbytes, torch.uint8)
            self.remote = remote_peers(handle.buffer_ptrs, self.rank, self.remote_peers)
            n = self.bounce_nbytes
            self._bounce_views = {"get": bounce[:n], "put": bounce[n : 2 * n]}
            logger.info(
                "rank %d: nvshmem transport on %s, peers through NVSHMEM get / put: %s",
                self.rank,
                self.device,
                sorted(self.remote) or "none",
            )
        return super()._register(spec)

    def _bounce(self, kind: str) -> torch.Tensor:
        """The bounce buffer for ``kind`` (``get`` / ``put``), after its last user's work on another
        stream."""
        stream = torch.cuda.current_stream(self.device)
        last = self._bounce_streams.get(kind)
        if last is not None and last != stream:
            stream.wait_stream(last)
        self._bounce_streams[kind] = stream
        return self._bounce_views[kind]

    # ------------------------------------------------------------------ one-sided operations

    def _get(self, spec: BufferSpec, peer: int, offset: int, out: torch.Tensor) -> None:
        if peer not in self.remote or not out.numel():
            super()._get(spec, peer, offset, out)  # this node: through the peer pointer
            return
        bounce = self._bounce("get")
        itemsize = spec.dtype.itemsize
        mine = self._local[spec.name]  # the same symmetric addresses as the peer's shard
        out_flat = out.view(-1)
        for lo, hi in chunk_ranges(0, out.numel(), bounce.numel() // itemsize):
            stage = bounce[: (hi - lo) * itemsize].view(spec.dtype)
            self._ops.get(stage, mine[offset + lo : offset + hi], self._pes[peer])
            out_flat[lo:hi].copy_(stage)

    def _accumulate(self, spec: BufferSpec, peer: int, offset: int, src: torch.Tensor) -> None:
        if peer not in self.remote or not src.numel():
            super()._accumulate(
                spec, peer, offset, src
            )  # this node: add_ into the slot at the peer
            return
        # [Note: nvshmem accumulate]: put into this rank's slot at the owner, or read, add and put back.
        staging, _ = self._staging[spec.name]
        bounce = self._bounce("put")
        base = staging_slot_offset(self.rank, self.world_size, spec.numel) + offset
        written = self._written.setdefault((spec.name, peer), [])
        src_flat = src.view(-1)
        for lo, hi in chunk_ranges(0, src.numel(), bounce.numel() // 4):
            stage = bounce[: (hi - lo) * 4].view(torch.float32)
            slot = staging[base + lo : base + hi]  # by its symmetric address: the owner's slot
            if overlaps(written, base + lo, base + hi):
                self._ops.get(stage, slot, self._pes[peer])
                stage.add_(src_flat[lo:hi])
            else:
                stage.copy_(src_flat[lo:hi])  # the slot is still zero there
            self._ops.put(slot, stage, self._pes[peer])
            written.append((base + lo, base + hi))

    def fence(self) -> None:
        """Flush, meet, reduce the staging slots in source order, meet again (all bounded by
        ``timeout_s``).

        Raises:
            TransportError: a rank did not arrive within ``timeout_s`` or died (named), or the transport
                is closed.
        """
        self._check_open()
        self._written.clear()  # every slot is zero again once this fence returns
        super().fence()

    def _barrier(self, handle: Any, what: str) -> None:
        """Every rank meets on the rendezvous store, within ``timeout_s``; late or dead ranks are named."""
        del handle
        self._meetings += 1
        key = f"m{self._meetings}"
        store = self._store
        store.set(f"{key}/r{self.rank}", "1")
        if store.add(f"{key}/n", 1) == self.world_size:
            store.set(f"{key}/done", "1")
        deadline = time.monotonic() + self.timeout_s
        while True:
            slice_s = max(min(deadline - time.monotonic(), _LIVENESS_PERIOD_S), 1e-3)
            try:
                store.wait([f"{key}/done"], datetime.timedelta(seconds=slice_s))
                break
            except RuntimeError:  # this slice timed out (or the store failed: checked below)
                pass
            late = self._late_ranks(key, what)
            dead = [r for r in late if r in self._local_pids and not pid_alive(self._local_pids[r])]
            if dead:
                names = ", ".join(f"rank {r} (pid {self._local_pids[r]})" for r in dead)
                raise TransportError(f"rank {self.rank}: {what}: {names} died before reaching it")
            if time.monotonic() >= deadline:
                raise TransportError(
                    f"rank {self.rank}: {what} timed out after {self.timeout_s:g} s waiting for "
                    f"rank(s) {', '.join(str(r) for r in late) or 'that arrived only now'}"
                )
        # Every rank has left the previous meeting (all arrived at this one): forget its keys.
        previous = f"m{self._meetings - 1}"
        store.delete_key(f"{previous}/r{self.rank}")
        if self.rank == 0:
            store.delete_key(f"{previous}/n")
            store.delete_key(f"{previous}/done")

    def _late_ranks(self, key: str, what: str) -> list[int]:
        try:
            return [r for r in range(self.world_size) if not self._store.check([f"{key}/r{r}"])]
        except RuntimeError as exc:
            raise TransportError(
                f"rank {self.rank}: {what}: the rendezvous store failed ({exc})"
            ) from exc

    def _close(self) -> None:
        super()._close()
        self._bounce_views.clear()
        self._bounce_streams.clear()
        self._written.clear()
