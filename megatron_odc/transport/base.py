"""The one-sided transport protocol every ODC backend speaks.

A ``Transport`` belongs to one rank and one data-parallel process group. Buffers are registered
collectively, in the same order on every rank, and each rank holds one *shard* of every buffer (the same
number of elements on every rank). After registration a rank may, without any participation of the owner:

- ``get(name, peer, offset, out)``: copy ``peer``'s shard ``[offset, offset + out.numel())`` into ``out``;
- ``accumulate(name, peer, offset, src)``: add ``src`` into ``peer``'s shard at ``offset`` (fp32
  destination registered with ``accumulate=True``; sources fp32, bf16 or fp16), safe against any number
  of concurrent accumulators;
- ``flush()``: this rank's earlier operations are complete at their targets;
- ``fence()``: DP-wide; every rank's earlier operations are complete and visible to every rank.

Every transport keeps its shards on one ``device`` (CPU for ``shm``; the rank's GPU for ``cuda``), and the
tensors handed to ``get`` / ``accumulate`` must live there. On a GPU the operations are *stream-ordered*:
they are enqueued on the caller's current CUDA stream, so work issued later on that stream sees their
effect, and ``flush`` waits for the device.

Whole-bucket helpers (``gather_shards``, ``scatter_accumulate``) are expressed on top of the one-sided calls
here; the collective transport overrides them with all-gather / reduce-scatter, which is why it can only run
in lockstep.

This module owns the protocol, argument checking and the error type. It imports no megatron module.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

ACCUMULATE_SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TransportError(RuntimeError):
    """A transport failed at run time: a peer died or timed out, or the transport is closed."""


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """What a registered buffer is: its name, the elements of each rank's shard, dtype, and whether
    peers may accumulate into it (``accumulate=False``: read-only for peers, e.g. parameter shards, so
    a backend spends no accumulate machinery such as staging slots on it)."""

    name: str
    numel: int
    dtype: torch.dtype
    accumulate: bool = True


def check_same_registration(infos: list) -> None:
    """Raise ``ValueError`` unless every rank's ``(name, numel, dtype, ...)`` registration matches rank 0's.

    ``infos[r]`` is what rank ``r`` registered (gathered by the backend, e.g. ``all_gather_object``).
    """
    first = infos[0]
    for rank, info in enumerate(infos):
        for field, pos in (("name", 0), ("numel", 1), ("dtype", 2)):
            if info[pos] != first[pos]:
                raise ValueError(
                    f"register: rank {rank} registered buffer {info[0]!r} with {field} "
                    f"{info[pos]!r} but rank 0 registered {first[0]!r} with {field} {first[pos]!r}; "
                    "every rank must register the same buffers in the same order"
                )


class Transport(abc.ABC):
    """One rank's endpoint of a one-sided transport over one data-parallel group.

    Subclasses implement ``_register``, ``_get``, ``_accumulate``, ``flush``, ``fence`` and ``_close``;
    this class validates every argument first, so every backend refuses bad input the same way.
    """

    device: torch.device = torch.device("cpu")
    """Where this transport's shards live; ``get`` / ``accumulate`` tensors must be there too."""

    def __init__(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self._specs: dict[str, BufferSpec] = {}
        self._local: dict[str, torch.Tensor] = {}
        self._closed = False

    # ------------------------------------------------------------------ public protocol

    def register(
        self, name: str, numel: int, dtype: torch.dtype, *, accumulate: bool = True
    ) -> torch.Tensor:
        """Collectively register a buffer; returns this rank's zero-filled shard (shared memory).

        Every rank must register the same names, sizes and dtypes in the same order; a mismatch raises
        ``ValueError`` naming the rank that differs. ``accumulate=False`` declares the buffer read-only
        for peers: ``accumulate`` into it raises ``ValueError``.
        """
        self._check_open()
        if not isinstance(name, str) or not name:
            raise ValueError(f"buffer name must be a non-empty string, got {name!r}")
        if name in self._specs:
            raise ValueError(f"rank {self.rank}: buffer {name!r} is already registered")
        if int(numel) != numel or numel < 0:
            raise ValueError(f"rank {self.rank}: buffer {name!r}: numel must be >= 0, got {numel}")
        spec = BufferSpec(name, int(numel), dtype, bool(accumulate))
        local = self._register(spec)
        assert local.numel() == spec.numel, (local.numel(), spec)
        assert local.dtype == dtype, (local.dtype, spec)
        self._specs[name] = spec
        self._local[name] = local
        return local

    def local(self, name: str) -> torch.Tensor:
        """This rank's own shard of buffer ``name`` (a tensor on shared memory)."""
        self._check_open()
        self._spec(name)
        return self._local[name]

    def local_nbytes(self) -> int:
        """Bytes of transport memory this rank holds: its shards, plus what a backend adds per buffer
        (the deterministic mode's staging slots)."""
        self._check_open()
        return sum(self._local[name].nbytes for name in self._specs) + self._extra_local_nbytes()

    def _extra_local_nbytes(self) -> int:
        """Backend memory beside the shards (none by default)."""
        return 0

    def spec(self, name: str) -> BufferSpec:
        """The registered spec of buffer ``name``."""
        return self._spec(name)

    @property
    def buffer_names(self) -> list[str]:
        """Registered buffer names, in registration order."""
        return list(self._specs)

    def get(self, name: str, peer: int, offset: int, out: torch.Tensor) -> None:
        """Copy ``peer``'s shard of ``name`` at ``[offset, offset + out.numel())`` into ``out``."""
        spec = self._check_access(name, peer, offset, out, "get")
        if out.dtype != spec.dtype:
            raise ValueError(
                f"rank {self.rank}: get from buffer {name!r} (dtype {spec.dtype}) into an out tensor of "
                f"dtype {out.dtype}"
            )
        self._get(spec, peer, offset, out)

    def accumulate(self, name: str, peer: int, offset: int, src: torch.Tensor) -> None:
        """Add ``src`` into ``peer``'s fp32 shard of ``name`` at ``[offset, offset + src.numel())``."""
        spec = self._check_access(name, peer, offset, src, "accumulate")
        self._check_accumulate_target(spec, "accumulate")
        self._check_accumulate_source(spec, src, "accumulate")
        self._accumulate(spec, peer, offset, src)

    def _check_accumulate_target(self, spec: BufferSpec, op: str) -> None:
        if not spec.accumulate:
            raise ValueError(
                f"rank {self.rank}: {op} into buffer {spec.name!r}, which was registered with "
                "accumulate=False (read-only for peers)"
            )
        if spec.dtype != torch.float32:
            raise ValueError(
                f"rank {self.rank}: {op} into buffer {spec.name!r} of dtype {spec.dtype}; accumulate "
                "targets must be float32"
            )

    def _check_accumulate_source(self, spec: BufferSpec, src: torch.Tensor, op: str) -> None:
        if src.dtype not in ACCUMULATE_SOURCE_DTYPES:
            raise ValueError(
                f"rank {self.rank}: {op} into buffer {spec.name!r} from dtype {src.dtype}; sources "
                f"must be one of {', '.join(str(d) for d in ACCUMULATE_SOURCE_DTYPES)}"
            )

    def gather_shards(self, name: str, out: torch.Tensor) -> None:
        """Fill ``out`` (``world_size * numel`` elements) with every rank's shard, in rank order.

        The own shard is copied locally; peers are visited in rotated order (rank + 1, rank + 2, ...) so
        that concurrent gathers do not all hit the same owner first.
        """
        for peer, part in self._rotated_slices(name, out, "gather_shards"):
            self.get(name, peer, 0, part)

    def scatter_accumulate(self, name: str, src: torch.Tensor) -> None:
        """Add slice ``r`` of ``src`` (``world_size * numel`` elements) into rank ``r``'s shard, for every r."""
        for peer, part in self._rotated_slices(name, src, "scatter_accumulate"):
            self.accumulate(name, peer, 0, part)

    @abc.abstractmethod
    def flush(self) -> None:
        """Wait until this rank's earlier gets and accumulates are complete at their targets."""

    @abc.abstractmethod
    def fence(self) -> None:
        """DP-wide: return once every rank's earlier operations are complete and visible to all ranks."""

    def close(self) -> None:
        """Release every buffer and file; idempotent. Later calls raise ``TransportError``."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close()
        finally:
            self._local.clear()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run."""
        return self._closed

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ backend hooks

    @abc.abstractmethod
    def _register(self, spec: BufferSpec) -> torch.Tensor:
        """Create (collectively) the buffer and return this rank's shard, zero-filled."""

    @abc.abstractmethod
    def _get(self, spec: BufferSpec, peer: int, offset: int, out: torch.Tensor) -> None:
        """Backend get; arguments are already validated."""

    @abc.abstractmethod
    def _accumulate(self, spec: BufferSpec, peer: int, offset: int, src: torch.Tensor) -> None:
        """Backend accumulate; arguments are already validated."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Backend close; called once."""

    # ------------------------------------------------------------------ checks

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"rank {self.rank}: {type(self).__name__} is closed")

    def _spec(self, name: str) -> BufferSpec:
        self._check_open()
        try:
            return self._specs[name]
        except KeyError:
            known = ", ".join(repr(n) for n in self._specs) or "none"
            raise ValueError(
                f"rank {self.rank}: buffer {name!r} is not registered (registered: {known})"
            ) from None

    def _check_access(
        self, name: str, peer: int, offset: int, tensor: torch.Tensor, op: str
    ) -> BufferSpec:
        spec = self._spec(name)
        if not 0 <= peer < self.world_size:
            raise ValueError(
                f"rank {self.rank}: {op} on buffer {name!r}: peer {peer} is outside a group of size "
                f"{self.world_size}"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"rank {self.rank}: {op} on buffer {name!r}: tensor must be contiguous"
            )
        if tensor.device != self.device:
            raise ValueError(
                f"rank {self.rank}: {op} on buffer {name!r} with a tensor on {tensor.device}; the "
                f"{type(self).__name__}'s memory is on {self.device}, and so must the tensor be"
            )
        if offset < 0 or offset + tensor.numel() > spec.numel:
            raise ValueError(
                f"rank {self.rank}: {op} on buffer {name!r} of {spec.numel} elements per rank: range "
                f"[{offset}, {offset + tensor.numel()}) is out of bounds (peer {peer})"
            )
        return spec

    def _rotated_slices(
        self, name: str, tensor: torch.Tensor, op: str
    ) -> list[tuple[int, torch.Tensor]]:
        """``(peer, peer's slice of tensor)`` for every rank, starting with this one (whole-bucket ops)."""
        spec = self._spec(name)
        self._check_full(spec, tensor, op)
        flat, n = tensor.view(-1), spec.numel
        peers = [(self.rank + step) % self.world_size for step in range(self.world_size)]
        return [(peer, flat[peer * n : (peer + 1) * n]) for peer in peers]

    def _check_full(self, spec: BufferSpec, tensor: torch.Tensor, op: str) -> None:
        expected = spec.numel * self.world_size
        if tensor.numel() != expected or not tensor.is_contiguous():
            raise ValueError(
                f"rank {self.rank}: {op} on buffer {spec.name!r} needs a contiguous tensor of "
                f"{expected} elements (world_size {self.world_size} x {spec.numel}), got "
                f"{tensor.numel()}"
            )
