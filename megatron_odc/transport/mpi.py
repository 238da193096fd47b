"""The MPI transport: one-sided get and accumulate over MPI-3 RMA (mpi4py), within one host or across hosts.

Registered buffers live in MPI windows (``MPI.Win.Allocate``: MPICH maps them into shared memory for the
ranks of one host and registers them with the network for the others), placed first-fit into windows of
at least :data:`ARENA_MIN_BYTES` (each allocation is a collective); this rank's shard is a view of its
window's local memory. Every window stays in one passive-target access epoch to every peer for its
whole life (``Lock_all`` at allocation, ``Unlock_all`` at close), so that:

- ``get`` is ``Win.Get`` from the peer's window, completed by ``Win.Flush_local`` (the bytes have arrived
  when it returns; the owner takes no part);
- ``accumulate`` has two modes (``accumulate_mode``, one of :data:`MPI_ACCUMULATE_MODES`):

  * ``"atomic"`` (default): ``Win.Accumulate(op=SUM)`` of fp32 elements into the peer's fp32 shard (bf16
    and fp16 sources are cast to fp32 first). MPI makes accumulates to one location element-atomic with
    each other, whatever their origin, so concurrent sources need no lock; the sum order, and so the last
    bits, depend on timing. ``Win.Flush_local`` lets the caller reuse the source at once;
  * ``"deterministic"``: every accumulate target (fp32, ``accumulate=True``) gets a second buffer per
    owner, its *staging* buffer of ``world_size`` slots of one shard (``staging.py``); ``accumulate`` adds
    into the source's own slot at the owner (MPI keeps one origin's accumulates to one location in
    order), and ``fence`` has each owner add the slots written since its last reduce in source order 0,
    1, ..., W-1. Bitwise reproducible; memory: one shard per source per accumulate buffer at each owner.

- ``flush`` is ``Win.Flush_all`` on every window (this rank's operations complete at their targets);
- ``fence`` flushes, then all ranks meet in one non-blocking ``Iallgather`` that also carries each rank's
  staging-slot dirty flags; it is polled (``Request.Test``) so that a peer that does not arrive within
  ``timeout_s`` is named (its fence count is read from a small control window with ``Rget``) instead of
  hanging the job. A peer that *dies* is handled by the launcher: MPICH's ``mpiexec`` (hydra) kills every
  rank of the job as soon as one exits without ``MPI_Finalize`` (measured: about a second), so no rank
  waits on a dead one; the fence timeout covers a peer that lives but stops.

[Note: MPI progress]
Passive-target RMA between ranks of one host needs no help from the target: MPICH's shared-memory path
does the get or the element-atomic add from the origin (measured, a target busy for 3 s in pure Python
without MPI calls: get 0.01 s, accumulate 0.006 s). Through the network module (ranks on different hosts,
emulated here with ``MPIR_CVAR_NOLOCAL=1``) a get still completes without the target (0.003 s), but an
accumulate waits until the target next enters MPI (2.8 s of the 3 s), so a peer deep in a forward pass
would stall every push into it. ``MPIR_CVAR_ASYNC_PROGRESS=1`` (an MPICH progress thread per rank) cuts
that to 0.07 s. :func:`import_mpi` therefore sets it, before ``MPI_Init``, when the launcher's environment
says the job spans hosts (local ranks < world size) and the user has not set it: on one host the thread
would only take a core from compute.

Construction needs ``torch.distributed`` up (the gloo / NCCL group of the data-parallel ranks) *and* an
MPI launch whose ``COMM_WORLD`` ranks equal the torch ranks (``runner/launch_env.py`` sets the torch
environment from MPI's under ``mpiexec``); the MPI communicator is the torch group's ranks. mpi4py is
imported on first use; without it construction raises ``ValueError`` saying what to install. Collective:
construction, ``register``, ``fence`` and ``close`` (``Win.Free``). It imports no megatron module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Mapping
from types import ModuleType

import numpy as np
import torch
import torch.distributed as dist

from megatron_odc.transport.base import (
    BufferSpec,
    Transport,
    TransportError,
    check_same_registration,
)
from megatron_odc.transport.staging import owner_reduce, staging_numel, staging_slot_offset

logger = logging.getLogger(__name__)

MPI_ACCUMULATE_MODES = ("atomic", "deterministic")
"""``accumulate_mode`` choices of ``MpiTransport``."""

ASYNC_PROGRESS_ENV = "MPIR_CVAR_ASYNC_PROGRESS"
"""MPICH's switch for its asynchronous progress thread (see [Note: MPI progress])."""

INSTALL_HINT = "--odc-transport mpi needs mpi4py and an MPI library: pip install mpi4py mpich"

LAUNCH_HINT = (
    "launch with the MPI launcher, e.g. mpiexec -n N python -m megatron_odc.train --odc-transport mpi "
    "..., so that MPI's ranks are the torch.distributed ranks"
)

_LAUNCHER_SIZES = (
    ("PMI_SIZE", "MPI_LOCALNRANKS"),  # MPICH's hydra
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI
)
"""(world size, ranks on this host) environment variables of the MPI launchers."""

ARENA_MIN_BYTES = 4 << 20
"""Smallest window: buffers are placed first-fit into windows ("arenas") of at least this size, as
every ``Win.Allocate`` is a collective (one per buffer made a test model's set-up dominate its run)."""

ARENA_ALIGN_BYTES = 64
"""Alignment of every buffer placed in an arena."""

MAX_OP_BYTES = 1 << 30
"""Largest single RMA operation: MPI counts are C ints."""

_FENCE_SLEEP_START_S = 50e-6
_FENCE_SLEEP_CAP_S = 2e-3
_NAMING_WAIT_S = 2.0
"""How long a timed-out fence waits for the peers' fence counts it reads to name the late ones."""


@dataclasses.dataclass
class _Arena:
    """One MPI window (``disp_unit`` 1: displacements in bytes) and this rank's memory of it."""

    win: object
    memory: torch.Tensor  # uint8, the window's local bytes
    capacity: int
    used: int

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at byte ``offset`` (a view of the window's memory)."""
        return self.memory[offset : offset + numel * dtype.itemsize].view(dtype)


def spans_hosts(environ: Mapping[str, str]) -> bool | None:
    """Whether the MPI launcher's environment says the job has ranks on more than one host.

    ``None`` when no known launcher variables are set (not launched by ``mpiexec``, or an unknown one).
    """
    for size_var, local_var in _LAUNCHER_SIZES:
        size, local = environ.get(size_var), environ.get(local_var)
        if size is not None and local is not None:
            return int(local) < int(size)
    return None


def import_mpi() -> ModuleType:
    """``mpi4py.MPI`` (initialising MPI on first import), with asynchronous progress across hosts.

    Before the first import, sets ``MPIR_CVAR_ASYNC_PROGRESS=1`` when the job spans hosts and the variable
    is unset (see [Note: MPI progress]).

    Raises:
        ValueError: mpi4py (or the MPI library it loads) is not installed.
    """
    if spans_hosts(os.environ) and ASYNC_PROGRESS_ENV not in os.environ:
        os.environ[ASYNC_PROGRESS_ENV] = "1"
    try:
        from mpi4py import MPI
    except ImportError as exc:  # mpi4py missing, or its libmpi not found
        raise ValueError(f"{INSTALL_HINT} ({exc})") from exc
    return MPI


class MpiTransport(Transport):
    """One rank's endpoint of the MPI RMA transport over a torch process group.

    Construction is collective over ``group`` and over the matching MPI ranks.

    Args:
        group: the torch process group of the data-parallel ranks; ``None`` means WORLD. Its ranks must be
            MPI ``COMM_WORLD`` ranks with the same numbers (an ``mpiexec`` launch through
            ``runner/launch_env.py``).
        accumulate_mode: ``"atomic"`` (``MPI_Accumulate`` with ``MPI_SUM`` into the owner's shard) or
            ``"deterministic"`` (staging slots reduced in source order at the fence); the same on every
            rank.
        timeout_s: how long ``fence`` (and ``close``) wait for the peers before raising
            ``TransportError`` naming the ranks that did not arrive.

    Raises:
        ValueError: mpi4py is missing, the job was not launched by an MPI launcher matching the torch
            ranks, the ranks use different accumulate modes, or an argument is out of range.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        accumulate_mode: str = "atomic",
        timeout_s: float = 60.0,
    ) -> None:
        if accumulate_mode not in MPI_ACCUMULATE_MODES:
            raise ValueError(
                f"accumulate_mode {accumulate_mode!r} is not one of "
                f"{', '.join(repr(m) for m in MPI_ACCUMULATE_MODES)}"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not dist.is_initialized():
            raise ValueError("MpiTransport needs an initialized torch.distributed process group")
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self._group = group
        self.accumulate_mode = accumulate_mode
        self.timeout_s = float(timeout_s)
        self._mpi = import_mpi()
        self._arenas: list[_Arena] = []
        self._placement: dict[str, tuple[_Arena, int]] = {}  # buffer -> (arena, byte offset)
        self._staging_placement: dict[str, tuple[_Arena, int]] = {}  # of its staging slots
        self._staging: dict[str, torch.Tensor] = {}  # buffer -> this owner's staging slots
        self._dirty = np.zeros(self.world_size, dtype=np.int64)  # owners whose slot I wrote
        self._fence_count = 0
        self._epoch = 0
        self._failed = False  # a fence timed out: collectives may no longer match
        self._comm = None
        self._ctrl_win = None
        self._comm = self._join_ranks()
        self._ctrl_win = self._mpi.Win.Allocate(8, 8, comm=self._comm)
        self._ctrl = np.frombuffer(self._ctrl_win.tomemory(), dtype=np.int64)
        self._ctrl[:] = 0
        self._ctrl_win.Lock_all()
        self._ctrl_win.Sync()
        if not self._wait(self._comm.Ibarrier(), self.timeout_s):
            raise TransportError(f"rank {self.rank}: the peers did not set up the mpi transport")

    def _join_ranks(self):
        """Check that MPI's ranks are torch's, and make the MPI communicator of the group's ranks."""
        world = self._mpi.COMM_WORLD
        infos: list[object] = [None] * self.world_size
        dist.all_gather_object(
            infos,
            (
                world.Get_rank(),
                world.Get_size(),
                dist.get_rank(),
                dist.get_world_size(),
                self.accumulate_mode,
                socket.gethostname(),
            ),
            group=self._group,
        )
        for rank, (mpi_rank, mpi_size, torch_rank, torch_size, mode, host) in enumerate(infos):
            if (mpi_rank, mpi_size) != (torch_rank, torch_size):
                raise ValueError(
                    f"the mpi transport needs MPI's ranks to be torch.distributed's, but rank "
                    f"{rank} of the group (on {host}) is torch rank {torch_rank} of {torch_size} and "
                    f"MPI rank {mpi_rank} of {mpi_size}; {LAUNCH_HINT}"
                )
            if mode != infos[0][4]:
                raise ValueError(
                    f"MpiTransport needs one accumulate_mode on every rank: rank 0 uses "
                    f"{infos[0][4]!r}, rank {rank} {mode!r}"
                )
        ranks = dist.get_process_group_ranks(self._group or dist.group.WORLD)
        world_group = world.Get_group()
        try:
            members = world_group.Incl(ranks)
            try:
                comm = world.Create_group(members)
            finally:
                members.Free()
        finally:
            world_group.Free()
        assert (comm.Get_rank(), comm.Get_size()) == (self.rank, self.world_size), ranks
        return comm

    # ------------------------------------------------------------------ buffers

    def _stages(self, spec: BufferSpec) -> bool:
        """Whether ``spec`` gets staging slots: deterministic mode, a non-empty fp32 accumulate target."""
        return (
            self.accumulate_mode == "deterministic"
            and spec.accumulate
            and spec.dtype == torch.float32
            and spec.numel > 0
        )

    def _allocate(self, numel: int, dtype: torch.dtype) -> tuple[_Arena, int, torch.Tensor, bool]:
        """Place ``numel`` elements in the first arena with room, or a new one (collective then).

        Returns the arena, the byte offset, this rank's (zero) tensor there, and whether an arena was
        allocated. Every rank decides alike: the registrations are the same everywhere (checked).
        """
        nbytes = numel * dtype.itemsize
        for arena in self._arenas:
            offset = -(-arena.used // ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES
            if offset + nbytes <= arena.capacity:
                arena.used = offset + nbytes
                return arena, offset, arena.tensor(offset, numel, dtype), False
        capacity = max(nbytes, ARENA_MIN_BYTES)
        win = self._mpi.Win.Allocate(capacity, 1, comm=self._comm)
        memory = torch.frombuffer(win.tomemory(), dtype=torch.uint8, count=capacity)
        memory.zero_()
        win.Lock_all()
        arena = _Arena(win, memory, capacity, nbytes)
        self._arenas.append(arena)
        return arena, 0, arena.tensor(0, numel, dtype), True

    def _register(self, spec: BufferSpec) -> torch.Tensor:
        infos: list[object] = [None] * self.world_size
        dist.all_gather_object(infos, (spec.name, spec.numel, str(spec.dtype)), group=self._group)
        check_same_registration(infos)
        arena, offset, local, new = self._allocate(spec.numel, spec.dtype)
        self._placement[spec.name] = (arena, offset)
        if self._stages(spec):
            numel = staging_numel(self.world_size, spec.numel)
            staging_arena, staging_offset, staging, new_staging = self._allocate(
                numel, torch.float32
            )
            self._staging_placement[spec.name] = (staging_arena, staging_offset)
            self._staging[spec.name] = staging
            new = new or new_staging
        # A new arena: every rank zeroed it before any peer touches it (polled: a blocked MPI call
        # spins a core). A place in an older arena has been zero and untouched since then.
        if new:
            self._sync_windows()
            if not self._wait(self._comm.Ibarrier(), self.timeout_s):
                raise TransportError(
                    f"rank {self.rank}: register {spec.name!r}: the peers did not finish "
                    f"allocating within {self.timeout_s:g} s"
                )
        return local

    def _sync_windows(self) -> None:
        """Order this rank's local loads and stores of window memory with the RMA operations."""
        for arena in self._arenas:
            arena.win.Sync()

    # ------------------------------------------------------------------ one-sided operations

    def _get(self, spec: BufferSpec, peer: int, offset: int, out: torch.Tensor) -> None:
        numel = out.numel()
        if numel == 0:
            return
        if peer == self.rank:  # shards change only between fences: a local copy is the same read
            out.copy_(self._local[spec.name][offset : offset + numel].view(out.shape))
            return
        arena, base = self._placement[spec.name]
        mpi = self._mpi
        itemsize = spec.dtype.itemsize
        step = MAX_OP_BYTES // itemsize
        for lo in range(0, numel, step):
            hi = min(numel, lo + step)
            nbytes = (hi - lo) * itemsize
            target = (base + (offset + lo) * itemsize, nbytes, mpi.BYTE)
            arena.win.Get([self._memory(out, lo, hi), nbytes, mpi.BYTE], peer, target)
        arena.win.Flush_local(peer)

    def _accumulate(self, spec: BufferSpec, peer: int, offset: int, src: torch.Tensor) -> None:
        numel = src.numel()
        if numel == 0:
            return
        values = src.detach().reshape(-1).to(torch.float32)
        if self.accumulate_mode == "deterministic":
            arena, base = self._staging_placement[spec.name]
            offset += staging_slot_offset(self.rank, self.world_size, spec.numel)
            self._dirty[peer] = 1
        else:
            arena, base = self._placement[spec.name]
        mpi, win = self._mpi, arena.win
        step = MAX_OP_BYTES // 4
        for lo in range(0, numel, step):
            hi = min(numel, lo + step)
            win.Accumulate(
                [self._memory(values, lo, hi), hi - lo, mpi.FLOAT],
                peer,
                (base + (offset + lo) * 4, hi - lo, mpi.FLOAT),
                op=mpi.SUM,
            )
        win.Flush_local(peer)  # the source may be reused (or freed) once this returns

    def _memory(self, tensor: torch.Tensor, lo: int, hi: int):
        """Elements ``[lo, hi)`` of contiguous ``tensor`` as an MPI buffer, by address: ``.numpy()`` would
        mark the tensor's storage non-resizable, and the engine frees unsharded buffers by resizing."""
        itemsize = tensor.element_size()
        return self._mpi.buffer.fromaddress(tensor.data_ptr() + lo * itemsize, (hi - lo) * itemsize)

    def flush(self) -> None:
        """Wait until this rank's earlier gets and accumulates are complete at their targets."""
        self._check_open()
        for arena in self._arenas:
            arena.win.Flush_all()

    # ------------------------------------------------------------------ fence

    def fence(self) -> None:
        """Flush, then wait until every rank of the group has reached the same number of fences.

        In deterministic mode every owner then adds the staging slots written since its last reduce into
        its shard in source order 0, 1, ..., W-1 and zeroes them, and a second meeting keeps every source
        from writing a slot again before its owner has drained it.

        Raises:
            TransportError: some ranks did not arrive within ``timeout_s`` (named), or the transport is
                closed.
        """
        self.flush()
        self._sync_windows()
        self._fence_count += 1
        flags = self._meet("")
        self._sync_windows()
        if self.accumulate_mode != "deterministic":
            return
        sources = [src for src in range(self.world_size) if flags[src, 1 + self.rank]]
        if sources:
            for name, staging in self._staging.items():
                owner_reduce(self._local[name], staging, self.world_size, sources)
            self._sync_windows()
        self._meet(" (after the owner reduce)")

    def _meet(self, what: str) -> np.ndarray:
        """One barrier of the group (a polled ``Iallgather``); returns every rank's row
        ``[epoch, dirty flag per owner]`` and clears this rank's dirty flags."""
        self._epoch += 1
        self._ctrl[0] = self._epoch
        self._ctrl_win.Sync()
        send = np.concatenate([np.array([self._epoch], dtype=np.int64), self._dirty])
        self._dirty[:] = 0
        recv = np.empty((self.world_size, self.world_size + 1), dtype=np.int64)
        if not self._wait(self._comm.Iallgather(send, recv), self.timeout_s):
            self._failed = True
            raise TransportError(
                f"rank {self.rank}: fence {self._fence_count}{what} timed out after "
                f"{self.timeout_s:g} s waiting for {self._late_ranks()}"
            )
        assert (recv[:, 0] == self._epoch).all(), recv[:, 0]
        return recv

    def _late_ranks(self) -> str:
        """The ranks whose fence count (read from their control windows) is behind this rank's."""
        mpi = self._mpi
        counts = np.full(self.world_size, -1, dtype=np.int64)
        requests = {
            peer: self._ctrl_win.Rget(
                [counts[peer : peer + 1], 1, mpi.INT64_T], peer, (0, 1, mpi.INT64_T)
            )
            for peer in range(self.world_size)
            if peer != self.rank
        }
        deadline = time.monotonic() + _NAMING_WAIT_S
        while requests and time.monotonic() < deadline:
            requests = {p: r for p, r in requests.items() if not r.Test()}
            time.sleep(1e-3)
        late = [
            f"rank {peer}" + (" (not answering)" if peer in requests else "")
            for peer in range(self.world_size)
            if peer != self.rank and (peer in requests or counts[peer] < self._epoch)
        ]
        return ", ".join(late) or "a rank that arrived only now"

    # ------------------------------------------------------------------ close

    def _close(self) -> None:
        """Free every window and the communicator, once every rank is closing too.

        ``Win.Free`` is collective: ranks first meet, waiting ``timeout_s`` at most. After a fence timed
        out (its abandoned meeting can no longer complete: the ranks that left it make no progress on
        it), or when the peers do not come, the windows are left to the process's exit rather than
        hang.
        """
        self._staging.clear()
        self._placement.clear()
        self._staging_placement.clear()
        windows = [arena.win for arena in self._arenas] + [self._ctrl_win]
        self._arenas.clear()
        if self._comm is None:
            return
        if self._failed or not self._closing_together():
            logger.warning(
                "rank %d: not every rank closed the mpi transport; its windows are released at exit",
                self.rank,
            )
            return
        for win in windows:
            if win is not None:
                win.Unlock_all()
                win.Free()
        self._ctrl = None
        self._ctrl_win = None
        self._comm.Free()
        self._comm = None

    def _closing_together(self) -> bool:
        """Whether every rank came to close within ``timeout_s``."""
        return self._wait(self._comm.Ibarrier(), self.timeout_s)

    @staticmethod
    def _wait(request, timeout_s: float) -> bool:
        """Poll ``request`` until it completes (True) or ``timeout_s`` passes (False).

        Sleeps between tests (50 us doubling to 2 ms) rather than block in MPI, whose waits spin a core
        that a rank sharing the host could compute on.
        """
        deadline = time.monotonic() + timeout_s
        sleep_s = _FENCE_SLEEP_START_S
        while not request.Test():
            if time.monotonic() > deadline:
                return False
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, _FENCE_SLEEP_CAP_S)
        return True
