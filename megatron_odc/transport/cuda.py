"""The CUDA transport: one-sided get and accumulate between the GPUs of one node (PyTorch symmetric memory).

Every registered buffer is one symmetric allocation (``symm_mem.empty`` + ``symm_mem.rendezvous``), so each
rank holds device pointers to every peer's shard:

- ``get`` copies out of ``hdl.get_buffer(peer, ...)`` on the caller's current stream (stream-ordered:
  work issued later on that stream sees the data; the engine issues fetches on its own fetch stream, see
  [Note: overlap streams] in ``streams.py``);
- ``accumulate`` has two modes (``accumulate_mode``):

  * ``"atomic"`` (default): a Triton kernel adds the source (fp32, bf16 or fp16, cast to fp32) into the
    peer's fp32 shard with ``tl.atomic_add(..., sem="relaxed", scope="sys")`` on the peer pointer taken from
    ``hdl.buffer_ptrs_dev``. No memory overhead; the summation order (and so the last bits) depends on
    timing;
  * ``"deterministic"``: every accumulate target (fp32, registered with ``accumulate=True``) gets, on each
    owner, a symmetric *staging* buffer of
    ``world_size`` slots of one shard each (slot ``s`` belongs to source ``s``; only ``s`` writes it, in its
    own stream order). ``accumulate`` adds into the source's slot at the owner; ``fence`` reduces the slots
    into the owner's shard in the fixed order 0, 1, ..., W-1 and zeroes them. Bitwise reproducible, at a
    memory cost of ``world_size`` shards per fp32 buffer.

- ``flush`` waits for this rank's device (every stream the caller used); ``fence`` is the symmetric-memory
  barrier (``hdl.barrier()``), or a process-group barrier before any buffer exists.

Feature-probed, never assumed: ``probe_symm_mem`` records what the installed PyTorch offers. Nothing CUDA-only
is imported at module level, so this module imports on CPU; constructing the transport without CUDA raises
``ValueError``. Ranks on several hosts need PyTorch's NVSHMEM backend, which is the ``nvshmem`` transport's
(``nvshmem.py``, a subclass of this one): ``choose_backend`` refuses a group spanning hosts, naming it and
the portable ``collective`` fallback.

The pure functions (chunking, peer rotation, kernel choice; the staging slots and the owner reduce, shared
with the ``shm`` transport, live in ``staging.py``) carry the logic and are tested on CPU. It imports no
megatron module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from megatron_odc.transport.base import ACCUMULATE_SOURCE_DTYPES, BufferSpec, Transport
from megatron_odc.transport.hosts import host_id
from megatron_odc.transport.staging import owner_reduce, staging_numel, staging_slot_offset

logger = logging.getLogger(__name__)

ACCUMULATE_MODES = ("atomic", "deterministic")
"""``accumulate_mode`` choices of ``CudaSymmTransport``."""

FENCE_VIA = ("symm_mem", "process_group")
"""``fence_via`` choices of ``CudaSymmTransport``."""

OVERLAPPING_DEVICES_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"
"""Set to ``1`` to let several ranks share one GPU (correctness tests on a single-GPU box)."""

MAX_KERNEL_CHUNK_NUMEL = 1 << 30
"""Largest range one accumulate kernel launch covers: Triton offsets are int32."""

DEFAULT_BLOCK_NUMEL = 1024
"""Elements per Triton program of the accumulate kernel."""

FALLBACK_HINT = (
    "use odc_transport='nvshmem' (one-sided across nodes, PyTorch's NVSHMEM backend) or 'collective' "
    "(lockstep all-gather / reduce-scatter, works across nodes), or run the data-parallel group inside "
    "one node; 'shm' is for CPU ranks on one host only"
)


# ---------------------------------------------------------------------- feature probe


@dataclasses.dataclass(frozen=True)
class SymmMemFeatures:
    """What the installed ``torch.distributed._symmetric_memory`` offers (probed with ``hasattr``).

    Attributes:
        importable: the module imports.
        has_empty: ``symm_mem.empty`` (PyTorch >= 2.6).
        has_rendezvous: ``symm_mem.rendezvous``.
        has_get: the public one-sided ``symm_mem.get`` (PyTorch >= 2.14).
        has_set_backend: ``symm_mem.set_backend`` (choose CUDA / NVSHMEM / NCCL).
        has_get_mem_pool: ``symm_mem.get_mem_pool``.
        nvshmem_available: ``symm_mem.is_nvshmem_available()`` returned True.
        needs_group_enable: ``symm_mem.enable_symm_mem_for_group`` exists and is not marked deprecated
            (no ``__deprecated__``): the PyTorch releases before the group registered itself, where a
            rendezvous on a group that was never enabled fails.
    """

    importable: bool
    has_empty: bool = False
    has_rendezvous: bool = False
    has_get: bool = False
    has_set_backend: bool = False
    has_get_mem_pool: bool = False
    nvshmem_available: bool = False
    needs_group_enable: bool = False

    @property
    def usable(self) -> bool:
        """Whether the CUDA backend's register / peer-buffer path is present."""
        return self.importable and self.has_empty and self.has_rendezvous


def probe_symm_mem(module: Any = None) -> SymmMemFeatures:
    """Probe a symmetric-memory module (default: import ``torch.distributed._symmetric_memory``).

    Args:
        module: the module (or any object with the same attributes) to probe; ``None`` imports it.
    """
    if module is None:
        try:
            import torch.distributed._symmetric_memory as module
        except ImportError:
            return SymmMemFeatures(importable=False)
    nvshmem = False
    probe = getattr(module, "is_nvshmem_available", None)
    if callable(probe):
        try:
            nvshmem = bool(probe())
        except Exception:  # a probe must never fail construction; the reason is logged
            logger.debug("is_nvshmem_available() raised", exc_info=True)
    return SymmMemFeatures(
        importable=True,
        has_empty=hasattr(module, "empty"),
        has_rendezvous=hasattr(module, "rendezvous"),
        has_get=hasattr(module, "get"),
        has_set_backend=hasattr(module, "set_backend"),
        has_get_mem_pool=hasattr(module, "get_mem_pool"),
        nvshmem_available=nvshmem,
        needs_group_enable=callable(enable := getattr(module, "enable_symm_mem_for_group", None))
        and not hasattr(enable, "__deprecated__"),
    )


def choose_backend(num_hosts: int, features: SymmMemFeatures, requested: str | None = None) -> str:
    """Pick the symmetric-memory backend for a group spread over ``num_hosts`` hosts.

    Args:
        num_hosts: distinct hosts in the data-parallel group.
        features: the probe result.
        requested: ``"CUDA"`` or ``None`` (automatic).

    Returns:
        ``"CUDA"`` (one host, peer pointers through CUDA IPC / VMM).

    Raises:
        ValueError: symmetric memory is unusable, the request is not ``"CUDA"`` (the NVSHMEM backend is
            the ``nvshmem`` transport's), or the group spans several hosts (the message names the
            ``nvshmem`` and ``collective`` transports).
    """
    if not features.usable:
        raise ValueError(
            "CudaSymmTransport needs torch.distributed._symmetric_memory with empty() and "
            f"rendezvous() (PyTorch >= 2.6); this PyTorch {torch.__version__} lacks them; "
            + FALLBACK_HINT
        )
    if requested not in (None, "CUDA"):
        raise ValueError(
            f"CudaSymmTransport: symm_mem backend {requested!r} is not 'CUDA'; PyTorch's NVSHMEM "
            "backend is the nvshmem transport's (odc_transport='nvshmem')"
        )
    if num_hosts > 1:
        raise ValueError(
            f"CudaSymmTransport joins the GPUs of one node, but the data-parallel group spans "
            f"{num_hosts} hosts; {FALLBACK_HINT}"
        )
    return "CUDA"


# ---------------------------------------------------------------------- pure layout / order logic


def chunk_ranges(offset: int, numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """Split ``[offset, offset + numel)`` into consecutive ranges of at most ``chunk_numel`` elements.

    Raises:
        ValueError: ``chunk_numel`` < 1 or a negative offset or size.
    """
    if chunk_numel < 1:
        raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
    if offset < 0 or numel < 0:
        raise ValueError(f"offset and numel must be >= 0, got {offset}, {numel}")
    return [
        (lo, min(lo + chunk_numel, offset + numel))
        for lo in range(offset, offset + numel, chunk_numel)
    ]


def peer_rotation(rank: int, world_size: int) -> list[int]:
    """Peers in the order ``rank`` visits them: itself, then rank + 1, rank + 2, ... (mod world_size).

    Concurrent whole-bucket gets and accumulates then start at different owners, so no owner is hit by
    every rank at once.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of size {world_size}")
    return [(rank + step) % world_size for step in range(world_size)]


def select_accumulate_kernel(src_dtype: torch.dtype, dst_dtype: torch.dtype, mode: str) -> str:
    """Name of the device routine that accumulates ``src_dtype`` into ``dst_dtype`` in ``mode``.

    Returns:
        ``"atomic_add_f32"`` (fp32 source, Triton peer atomics), ``"atomic_add_cast_f32"`` (bf16 / fp16
        source cast to fp32 in the kernel, then peer atomics), or ``"staging_add"`` (deterministic mode:
        ``add_`` into the source's own staging slot, no atomics needed).

    Raises:
        ValueError: unknown mode, a non-fp32 destination, or an unsupported source dtype.
    """
    if mode not in ACCUMULATE_MODES:
        raise ValueError(f"accumulate_mode {mode!r} is not one of {', '.join(ACCUMULATE_MODES)}")
    if dst_dtype != torch.float32:
        raise ValueError(f"accumulate destinations must be float32, got {dst_dtype}")
    if src_dtype not in ACCUMULATE_SOURCE_DTYPES:
        raise ValueError(
            f"accumulate source dtype {src_dtype} is not supported; use one of "
            f"{', '.join(str(d) for d in ACCUMULATE_SOURCE_DTYPES)}"
        )
    if mode == "deterministic":
        return "staging_add"
    return "atomic_add_f32" if src_dtype == torch.float32 else "atomic_add_cast_f32"


# ---------------------------------------------------------------------- Triton kernel (lazy)


def _build_atomic_kernel() -> Any:
    """Compile-on-demand Triton kernel: ``peer_shard[offs] += src[offs]`` with relaxed system atomics."""
    import triton
    import triton.language as tl

    @triton.jit
    def _peer_atomic_add(
        ptrs_dev, peer, dst_offset, src_ptr, numel, block: tl.constexpr
    ):  # pragma: no cover - GPU only
        base = tl.load(ptrs_dev.to(tl.pointer_type(tl.uint64)) + peer).to(
            tl.pointer_type(tl.float32)
        )
        offs = tl.program_id(0) * block + tl.arange(0, block)
        mask = offs < numel
        x = tl.load(src_ptr + offs, mask=mask).to(tl.float32)
        tl.atomic_add(base + dst_offset + offs, x, mask=mask, sem="relaxed", scope="sys")

    return triton, _peer_atomic_add


def _load_atomic_kernel() -> Any:
    """``(triton, kernel)`` of the atomic mode (compiled at its first launch, on the GPU).

    Raises:
        ValueError: Triton is not importable (the message names the deterministic mode, which needs none).
    """
    try:
        return _build_atomic_kernel()
    except ImportError as exc:
        raise ValueError(
            "accumulate_mode='atomic' needs Triton, which is not importable "
            f"({exc}); use accumulate_mode='deterministic'"
        ) from exc


# ---------------------------------------------------------------------- the transport


class CudaSymmTransport(Transport):
    """One rank's endpoint of the symmetric-memory transport over a process group on one node.

    Construction is collective over ``group``. The group may be gloo (the rendezvous only needs its
    store), which is how several processes share one GPU in tests (with
    ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``).

    Args:
        group: the process group; ``None`` means WORLD.
        accumulate_mode: ``"atomic"`` (Triton peer atomics) or ``"deterministic"`` (staging slots +
            owner reduce at ``fence``).
        device: CUDA device of this rank; ``None`` means ``torch.cuda.current_device()``.
        backend: symmetric-memory backend request, ``None`` (automatic) or ``"CUDA"`` (subclasses choose
            others in ``_select_backend``).
        timeout_s: accepted for interface compatibility with the other transports (the
            symmetric-memory barrier has its own timeout).
        block_numel: elements per Triton program.
        fence_via: ``"symm_mem"`` (the symmetric-memory barrier kernel on the signal pads) or
            ``"process_group"`` (a host barrier on ``group`` after the host-side flush; also correct,
            since every operation is complete once ``flush`` returns).

    Raises:
        ValueError: no CUDA, no usable symmetric memory, an unknown mode, the atomic mode without Triton,
            or a group spanning several hosts (the message names the fallback transport).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        accumulate_mode: str = "atomic",
        device: torch.device | int | str | None = None,
        backend: str | None = None,
        timeout_s: float = 300.0,
        block_numel: int = DEFAULT_BLOCK_NUMEL,
        fence_via: str = "symm_mem",
    ) -> None:
        if accumulate_mode not in ACCUMULATE_MODES:
            raise ValueError(
                f"accumulate_mode {accumulate_mode!r} is not one of {', '.join(ACCUMULATE_MODES)}"
            )
        if fence_via not in FENCE_VIA:
            raise ValueError(f"fence_via {fence_via!r} is not one of {', '.join(FENCE_VIA)}")
        if block_numel < 1 or block_numel & (block_numel - 1):
            raise ValueError(f"block_numel must be a power of two, got {block_numel}")
        if not torch.cuda.is_available():
            raise ValueError(
                "CudaSymmTransport needs a CUDA device, but torch.cuda.is_available() is False; on "
                "CPU use odc_transport='shm' (one host) or 'collective'"
            )
        # Built here, so that a missing Triton is refused before training, not at the first push.
        self._kernel: Any = _load_atomic_kernel() if accumulate_mode == "atomic" else None
        if not dist.is_initialized():
            raise ValueError(
                "CudaSymmTransport needs an initialized torch.distributed process group"
            )
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self._group = group if group is not None else dist.group.WORLD
        self.accumulate_mode = accumulate_mode
        self.timeout_s = float(timeout_s)
        self.block_numel = int(block_numel)
        self.fence_via = fence_via
        self.features = probe_symm_mem()
        if device is None:
            device = torch.cuda.current_device()
        self.device = (
            torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        )
        if self.device.type != "cuda":
            raise ValueError(f"CudaSymmTransport: device must be a CUDA device, got {self.device}")
        torch.cuda.set_device(self.device)  # before any collective: NCCL object collectives use it
        hosts: list[object] = [None] * self.world_size
        dist.all_gather_object(hosts, host_id(), group=group)
        self.backend = self._select_backend(len(set(hosts)), backend)

        import torch.distributed._symmetric_memory as symm_mem

        self._symm_mem: ModuleType = symm_mem
        # By name, not the group object: older releases' rendezvous takes only the name.
        self._group_name: str = self._group.group_name
        if self.features.needs_group_enable:
            symm_mem.enable_symm_mem_for_group(self._group_name)  # idempotent, once per group
        self._handles: dict[str, Any] = {}
        self._staging: dict[str, tuple[torch.Tensor, Any]] = {}  # name -> (staging buffer, handle)
        self._fence_count = 0
        logger.debug(
            "rank %d: CudaSymmTransport on %s, mode %s, features %s, overlapping devices %s",
            self.rank,
            self.device,
            accumulate_mode,
            self.features,
            os.environ.get(OVERLAPPING_DEVICES_ENV, "unset"),
        )

    def _select_backend(self, num_hosts: int, requested: str | None) -> str:
        """The symmetric-memory backend for a group over ``num_hosts`` hosts (before any allocation)."""
        return choose_backend(num_hosts, self.features, requested)

    # ------------------------------------------------------------------ protocol

    def _symmetric(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        # Sizes must match on every rank; at least one element so that every rank allocates.
        tensor = self._symm_mem.empty(max(numel, 1), dtype=dtype, device=self.device)
        tensor.zero_()
        handle = self._symm_mem.rendezvous(tensor, self._group_name)
        return tensor, handle

    def _register(self, spec: BufferSpec) -> torch.Tensor:
        infos: list[object] = [None] * self.world_size
        dist.all_gather_object(infos, (spec.name, spec.numel, str(spec.dtype)), group=self._group)
        for rank, info in enumerate(infos):
            if info != infos[0]:
                raise ValueError(
                    f"register: rank {rank} registered {info!r} but rank 0 registered {infos[0]!r}; "
                    "every rank must register the same buffers in the same order"
                )
        tensor, handle = self._symmetric(spec.numel, spec.dtype)
        self._handles[spec.name] = handle
        if (
            self.accumulate_mode == "deterministic"
            and spec.accumulate
            and spec.dtype == torch.float32
        ):
            num = staging_numel(self.world_size, spec.numel)
            staging, staging_handle = self._symmetric(num, torch.float32)
            self._staging[spec.name] = (staging[:num], staging_handle)
        torch.cuda.current_stream(self.device).synchronize()
        # Every rank's zero_() is done before anyone accumulates.
        self._barrier(handle, f"register {spec.name!r}")
        return tensor[: spec.numel]

    def _get(self, spec: BufferSpec, peer: int, offset: int, out: torch.Tensor) -> None:
        numel = out.numel()
        if numel == 0:
            return
        # Stream-ordered on the caller's current stream.
        if peer == self.rank:
            src = self._local_shard(spec.name)[offset : offset + numel]
        else:
            src = self._handles[spec.name].get_buffer(peer, (numel,), spec.dtype, offset)
        out.copy_(src.view_as(out))

    def _local_shard(self, name: str) -> torch.Tensor:
        # During _register the base class has not stored the shard yet; afterwards it has.
        return self._local[name]

    def _accumulate(self, spec: BufferSpec, peer: int, offset: int, src: torch.Tensor) -> None:
        numel = src.numel()
        if numel == 0:
            return
        kernel = select_accumulate_kernel(src.dtype, spec.dtype, self.accumulate_mode)
        src_flat = src.view(-1)
        # Stream-ordered on the caller's current stream.
        if kernel == "staging_add":
            staging, handle = self._staging[spec.name]
            base = staging_slot_offset(self.rank, self.world_size, spec.numel) + offset
            if peer == self.rank:
                slot = staging[base : base + numel]
            else:
                slot = handle.get_buffer(peer, (numel,), torch.float32, base)
            slot.add_(src_flat)  # only this rank writes this slot: no atomics needed
        else:
            self._atomic_add(spec.name, peer, offset, src_flat)

    def _atomic_add(self, name: str, peer: int, offset: int, src_flat: torch.Tensor) -> None:
        triton, kernel = self._kernel
        ptrs_dev = self._handles[name].buffer_ptrs_dev
        for lo, hi in chunk_ranges(0, src_flat.numel(), MAX_KERNEL_CHUNK_NUMEL):
            n = hi - lo
            grid = (triton.cdiv(n, self.block_numel),)
            kernel[grid](ptrs_dev, peer, offset + lo, src_flat[lo:hi], n, block=self.block_numel)

    def flush(self) -> None:
        """Wait (host-side) until this rank's gets and accumulates, on any stream, are complete."""
        self._check_open()
        torch.cuda.synchronize(self.device)

    def _extra_local_nbytes(self) -> int:
        """This rank's staging buffers (deterministic mode): one slot per source for each buffer."""
        return sum(staging.nbytes for staging, _ in self._staging.values())

    def fence(self) -> None:
        """DP-wide barrier; in deterministic mode the owner then reduces its staging slots (fixed order)."""
        self.flush()
        self._fence_count += 1
        handle = next(iter(self._handles.values()), None)
        self._barrier(handle, f"fence {self._fence_count}")
        if self._staging:
            for name, (staging, _) in self._staging.items():
                owner_reduce(self._local[name], staging, self.world_size)
            torch.cuda.current_stream(self.device).synchronize()
            # No source may write a slot again before its owner has drained it.
            self._barrier(handle, f"fence {self._fence_count} (after the owner reduce)")

    def _barrier(self, handle: Any, what: str) -> None:
        """Every rank of the group meets (``what`` names the meeting for subclasses' errors)."""
        del what
        if self.fence_via == "symm_mem" and handle is not None and hasattr(handle, "barrier"):
            handle.barrier()
            torch.cuda.current_stream(self.device).synchronize()
        else:
            dist.barrier(group=self._group)

    def _close(self) -> None:
        # Symmetric allocations must not be freed mid-run on some ranks only; drop references together.
        if torch.cuda.is_available():
            try:
                torch.cuda.current_stream(self.device).synchronize()
            except RuntimeError:
                logger.warning("rank %d: CUDA synchronize failed at close", self.rank)
        self._handles.clear()
        self._staging.clear()


def describe_features(features: SymmMemFeatures) -> Sequence[str]:
    """``name=yes/no`` strings for a report line."""
    return [
        f"{f.name}={'yes' if getattr(features, f.name) else 'no'}"
        for f in dataclasses.fields(features)
    ]
