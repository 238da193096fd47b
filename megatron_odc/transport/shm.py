"""The shared-memory transport: one-sided get and accumulate between the ranks of one host.

Every rank's shard of every buffer is a file in ``shm_dir`` (``/dev/shm`` by default) that every rank of the
group maps (``mmap``, shared). ``get`` is a ``copy_`` out of the peer's mapping; the owner does nothing.
``accumulate`` has two modes (``accumulate_mode``, one of :data:`SHM_ACCUMULATE_MODES`):

- ``"locked"`` (default): an ``add_`` into the owner's shard. Concurrent accumulates are made safe by
  striped Linux OFD byte-range locks (one lock byte per stripe of ``lock_stripe_nbytes`` of each owner's
  shard), which the kernel releases if the holder dies. No memory overhead; the adds land in arrival
  order, so two identical runs may differ in the last bits.
- ``"deterministic"``: every accumulate target (fp32, registered with ``accumulate=True``) gets a second
  file per owner, its *staging* buffer of ``world_size`` slots of one shard each (see ``staging.py``).
  ``accumulate`` adds into the source's own slot at the owner, without a lock (only that source writes
  it), and raises the source's dirty flag for that owner in the control block. ``fence`` then, after its
  barrier, has every owner add the dirty slots into its shard in source order 0, 1, ..., W-1 and zero
  them, then a second barrier keeps sources from writing a slot before it is drained. Bitwise
  reproducible whatever the arrival order; clean slots are skipped (adding zero is exact), so a fence
  with no accumulate before it reduces nothing. Memory price: one fp32 shard per source per accumulate
  buffer at each owner (``world_size`` times the buffer's shared memory), plus the reduce's pass over
  the written slots at every fence.

``fence`` is a barrier on a small shared control block (one epoch and one pid slot per rank, and one
dirty flag per owner and source) rather than on gloo, so that it can name a dead or missing peer.

Every file is unlinked as soon as all ranks have mapped it, so a crashed run leaves nothing behind after
its set-up. See [Note: shared-memory files] for what makes a file trustworthy and how stale ones go.

[Note: shared-memory files]
- A file is created exclusively (``O_EXCL``) and starts with a one-page header: magic, the job's run id, the
  file's role and its payload size. A mapper opens it without ``O_CREAT`` (a missing file is an error, never
  silently created as ``torch.from_file`` would) and checks the header and the size before mapping the
  payload, so a deleted, truncated or foreign file fails the set-up on every rank, naming the file.
- The creator holds an OFD read lock on one byte far beyond any stripe lock (:data:`_LIVENESS_BYTE`) for as
  long as the file exists. :func:`remove_stale_files` (rank 0, at start-up) removes a file only when nobody
  holds that lock and it is older than :data:`_STALE_GRACE_S`: liveness is decided by the kernel's lock,
  valid across pid namespaces, not by the pid in the name. A set-up killed half-way thus leaves files that
  the next job on the host, in any namespace, removes safely.

This module owns the ``ShmTransport`` class and its file naming. It imports no megatron module.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import logging
import mmap
import os
import re
import struct
import threading
import time
import uuid
import weakref
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_odc.transport.base import (
    BufferSpec,
    Transport,
    TransportError,
    check_same_registration,
)
from megatron_odc.transport.hosts import host_id, host_namespace, pid_alive
from megatron_odc.transport.staging import owner_reduce, staging_numel, staging_slot_offset

logger = logging.getLogger(__name__)

SHM_ACCUMULATE_MODES = ("locked", "deterministic")
"""``accumulate_mode`` choices of ``ShmTransport``."""

SHM_DIR_ENV = "MEGATRON_ODC_SHM_DIR"
"""Environment variable that overrides the default shared-memory directory."""

DEFAULT_SHM_DIR = "/dev/shm"
FILE_PREFIX = "megatron_odc-"
"""Every file this transport creates is named ``megatron_odc-p<creator pid>-<host namespace><run id>-<what>``
(the namespace is empty except on the pretend hosts of tests: ``hosts.host_namespace``)."""

_STALE_NAME = re.compile(r"^megatron_odc-p(\d+)-")
_FLOCK_FORMAT = "hhqqi4x"  # struct flock on Linux/x86-64 and aarch64: type, whence, start, len, pid
_LIVENESS_BYTE = 1 << 62
"""The byte its creator keeps read-locked while a file exists (stripe locks use bytes from 0 up)."""
_STALE_GRACE_S = 2.0
"""An unlocked file younger than this is left alone (its creator may be between create and lock)."""
_MAGIC = b"MEGATRON_ODC_SHM"
_HEADER_NBYTES = 4096
_HEADER_FORMAT = "<16s32s64sq"  # magic, run id, role, payload bytes
_FENCE_SLEEP_START_S = 50e-6
_FENCE_SLEEP_CAP_S = 2e-3
_LIVENESS_PERIOD_S = 0.1


def _lock_liveness(fd: int) -> None:
    """Marks the file of ``fd`` as held by a live creator (see [Note: shared-memory files])."""
    fcntl.fcntl(
        fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK_FORMAT, fcntl.F_RDLCK, 0, _LIVENESS_BYTE, 1, 0)
    )


def _liveness_held(path: str) -> bool:
    """Whether some process holds the liveness lock of ``path`` (False if the file is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        probe = struct.pack(_FLOCK_FORMAT, fcntl.F_WRLCK, 0, _LIVENESS_BYTE, 1, 0)
        found = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe)
        return struct.unpack(_FLOCK_FORMAT, found)[0] != fcntl.F_UNLCK
    finally:
        os.close(fd)


def remove_stale_files(shm_dir: str | os.PathLike[str]) -> list[str]:
    """Remove ``megatron_odc-*`` files in ``shm_dir`` that no live creator holds.

    A file is stale when nobody holds its liveness lock and it is older than ``_STALE_GRACE_S`` (see
    [Note: shared-memory files]); the pid in its name is not consulted, so a job in another pid namespace
    never loses its files.

    Args:
        shm_dir: the shared-memory directory to clean.

    Returns:
        The names of the files removed.
    """
    removed = []
    now = time.time()
    with os.scandir(shm_dir) as entries:
        for entry in entries:
            if _STALE_NAME.match(entry.name) is None:
                continue
            try:
                if now - entry.stat().st_mtime < _STALE_GRACE_S or _liveness_held(entry.path):
                    continue
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            removed.append(entry.name)
    if removed:
        logger.info("removed %d stale shared-memory file(s) in %s", len(removed), shm_dir)
    return removed


def _atexit_close(ref: weakref.ReferenceType[ShmTransport]) -> None:
    transport = ref()
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.close()


class ShmTransport(Transport):
    """One rank's endpoint of the shared-memory transport over a process group on one host.

    Construction is collective over ``group`` (every rank must construct it, in the same order as any other
    collective). A transport instance may be used by several threads of its rank: each thread takes the
    stripe locks through its own open file description.

    Args:
        group: the process group (gloo); ``None`` means the default (WORLD) group. All its ranks must run
            on one host. ``rank`` and ``world_size`` are ranks within this group, and peers are addressed
            by group rank.
        accumulate_mode: ``"locked"`` (add into the owner's shard under stripe locks, in arrival order)
            or ``"deterministic"`` (add into the source's staging slot at the owner; ``fence`` reduces
            the slots in source order); every rank must use the same.
        shm_dir: directory for the shared files; defaults to ``$MEGATRON_ODC_SHM_DIR`` or ``/dev/shm``.
        timeout_s: how long ``fence`` waits for a peer before raising ``TransportError``.
        lock_stripe_nbytes: bytes of an owner's shard covered by one accumulate lock (locked mode).

    Raises:
        ValueError: ``shm_dir`` does not exist or is not writable, the ranks are on different hosts or
            use different accumulate modes, or an argument is out of range.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        accumulate_mode: str = "locked",
        shm_dir: str | os.PathLike[str] | None = None,
        timeout_s: float = 60.0,
        lock_stripe_nbytes: int = 1 << 20,
    ) -> None:
        if accumulate_mode not in SHM_ACCUMULATE_MODES:
            raise ValueError(
                f"accumulate_mode {accumulate_mode!r} is not one of "
                f"{', '.join(repr(m) for m in SHM_ACCUMULATE_MODES)}"
            )
        if not dist.is_initialized():
            raise ValueError("ShmTransport needs an initialized torch.distributed process group")
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if int(lock_stripe_nbytes) != lock_stripe_nbytes or lock_stripe_nbytes < 4:
            raise ValueError(
                f"lock_stripe_nbytes must be an integer >= 4, got {lock_stripe_nbytes}"
            )
        self._group = group
        self.accumulate_mode = accumulate_mode
        self.shm_dir = Path(shm_dir or os.environ.get(SHM_DIR_ENV) or DEFAULT_SHM_DIR)
        self.timeout_s = float(timeout_s)
        self.lock_stripe_nbytes = int(lock_stripe_nbytes)
        self._pid = os.getpid()
        self._created: dict[Path, int] = {}  # files this rank created that may still exist -> fd
        self._peer_views: dict[str, list[torch.Tensor]] = {}
        self._peer_arrays: dict[str, list[np.ndarray]] = {}  # numpy views of the fp32 ones
        # Deterministic mode: buffer -> every owner's staging buffer (world_size slots of one shard).
        self._staging_views: dict[str, list[torch.Tensor]] = {}
        self._slot_locks: list[threading.Lock] = []  # per owner: this rank's threads take turns
        self._lock_base: dict[str, int] = {}  # first lock byte of each buffer
        self._next_lock_byte = 0
        self._num_buffers = 0
        self._fence_epoch = 0  # barriers passed (two per fence in deterministic mode)
        self._fence_count = 0  # fences called, for messages
        self._fds_lock = threading.Lock()
        self._fds: list[int] = []  # every lock-file descriptor this rank opened
        self._thread_fd = threading.local()
        self._lock_fd = -1
        self._owner_thread = threading.get_ident()  # the thread that uses ``_lock_fd`` itself
        self._ctrl: torch.Tensor | None = None
        self._ctrl_epochs: torch.Tensor | None = None
        self._ctrl_pids: torch.Tensor | None = None
        self._ctrl_dirty: torch.Tensor | None = None
        self._atexit_hook = functools.partial(_atexit_close, weakref.ref(self))
        atexit.register(self._atexit_hook)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        """Agree on a run id, create the control block and lock file, and check all ranks share a host."""
        payload: list[object] = [None]
        if self.rank == 0:
            payload[0] = self._create_run_files()
        dist.broadcast_object_list(payload, group=self._group, group_src=0)
        result = payload[0]
        if isinstance(result, str):  # rank 0 could not create its files: every rank raises the same
            raise ValueError(result)
        self.run_id, host0, ctrl_path, lock_path = result

        error = None
        try:
            if host_id() != host0:
                raise OSError(f"rank 0 is on host {host0!r}, this rank on {host_id()!r}")
            # Neither open creates a file: both fail if rank 0's files are absent.
            self._lock_fd = os.open(lock_path, os.O_RDWR)
            self._fds.append(self._lock_fd)
            self._ctrl = self._map(ctrl_path, "ctrl", self._ctrl_numel(), torch.int64)
            self._ctrl[self.world_size + self.rank] = self._pid
        except (OSError, RuntimeError, TransportError) as exc:
            error = (
                f"rank {self.rank} could not open the shared control files in {self.shm_dir}: {exc}"
            )
        # Doubles as the barrier after which rank 0 may unlink the control block and the lock file.
        infos: list[object] = [None] * self.world_size
        dist.all_gather_object(infos, (host_id(), error, self.accumulate_mode), group=self._group)
        if self.rank == 0:
            self._unlink_created()
        for rank, (host, rank_error, mode) in enumerate(infos):
            if host != infos[0][0]:
                raise ValueError(
                    f"ShmTransport needs every rank on one host: rank 0 is on {infos[0][0]!r}, rank "
                    f"{rank} on {host!r}"
                )
            if mode != infos[0][2]:
                raise ValueError(
                    f"ShmTransport needs one accumulate_mode on every rank: rank 0 uses "
                    f"{infos[0][2]!r}, rank {rank} {mode!r}"
                )
            if rank_error is not None:
                raise TransportError(rank_error)
        assert self._ctrl is not None
        w = self.world_size
        self._ctrl_epochs = self._ctrl[:w]
        self._ctrl_pids = self._ctrl[w : 2 * w]
        # dirty[owner, source] != 0: source wrote its staging slots at owner since owner's last reduce.
        self._ctrl_dirty = self._ctrl[2 * w :].view(w, w)
        self._slot_locks = [threading.Lock() for _ in range(w)]

    def _ctrl_numel(self) -> int:
        """int64 words of the control block: epoch and pid per rank, dirty flag per (owner, source)."""
        return 2 * self.world_size + self.world_size * self.world_size

    def _create_run_files(self) -> tuple[str, str, Path, Path] | str:
        """On rank 0: remove stale files, then create the control block and lock file."""
        if not self.shm_dir.is_dir():
            return f"shm_dir {str(self.shm_dir)!r} does not exist or is not a directory"
        if not os.access(self.shm_dir, os.W_OK | os.X_OK):
            return f"shm_dir {str(self.shm_dir)!r} is not writable"
        try:
            remove_stale_files(self.shm_dir)
        except OSError as exc:
            logger.warning("could not clean stale files in %s: %s", self.shm_dir, exc)
        run_id = uuid.uuid4().hex
        ctrl_path = self._path(run_id, "ctrl")
        lock_path = self._path(run_id, "lock")
        try:
            self._create_file(ctrl_path, "ctrl", self._ctrl_numel() * 8, run_id)
            self._create_file(lock_path, None, 0, run_id)
        except OSError as exc:
            self._unlink_created()
            return f"could not create {str(exc.filename or ctrl_path)!r} in shm_dir: {exc.strerror}"
        return run_id, host_id(), ctrl_path, lock_path

    def _path(self, run_id: str, what: str) -> Path:
        return self.shm_dir / f"{FILE_PREFIX}p{self._pid}-{host_namespace()}{run_id}-{what}"

    def _create_file(self, path: Path, role: str | None, nbytes: int, run_id: str) -> None:
        """Create ``path`` exclusively, lock its liveness byte, reserve its tmpfs pages (ENOSPC here, not
        SIGBUS) and, when it has a ``role``, write the header of a ``nbytes`` zero payload."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._created[path] = fd
        _lock_liveness(fd)
        if role is None:
            return
        os.posix_fallocate(fd, 0, _HEADER_NBYTES + nbytes)
        header = struct.pack(_HEADER_FORMAT, _MAGIC, run_id.encode(), role.encode(), nbytes)
        os.pwrite(fd, header, 0)

    def _map(self, path: Path | str, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Map the payload of an existing file of this job, after checking its header and size.

        Raises:
            TransportError: the file is missing, or is not this job's ``role`` file of this size.
        """
        nbytes = numel * dtype.itemsize
        try:
            fd = os.open(path, os.O_RDWR)  # no O_CREAT: a missing file is an error
        except FileNotFoundError:
            raise TransportError(f"shared-memory file {str(path)!r} is missing") from None
        try:
            size = os.fstat(fd).st_size
            header = os.pread(fd, struct.calcsize(_HEADER_FORMAT), 0)
            expected = struct.pack(
                _HEADER_FORMAT, _MAGIC, self.run_id.encode(), role.encode(), nbytes
            )
            if size != _HEADER_NBYTES + nbytes or header != expected:
                raise TransportError(
                    f"shared-memory file {str(path)!r} is not this job's {role!r} file of {nbytes} "
                    f"bytes (size {size}, header {header[:16]!r}...)"
                )
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=_HEADER_NBYTES)

    def _unlink_created(self) -> None:
        for path, fd in list(self._created.items()):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                os.close(fd)  # after the unlink: the file never exists without its lock
            del self._created[path]

    # ------------------------------------------------------------------ protocol

    def _stages(self, spec: BufferSpec) -> bool:
        """Whether ``spec`` gets staging slots: deterministic mode, a non-empty fp32 accumulate target."""
        return (
            self.accumulate_mode == "deterministic"
            and spec.accumulate
            and spec.dtype == torch.float32
            and spec.numel > 0
        )

    def _register(self, spec: BufferSpec) -> torch.Tensor:
        index = self._num_buffers
        # (role prefix, dtype, numel) of each file every owner creates for this buffer: its shard and, in
        # deterministic mode, its staging slots (one shard per source).
        files = [("b", spec.dtype, spec.numel)] if spec.numel else []
        if self._stages(spec):
            files.append(("s", torch.float32, staging_numel(self.world_size, spec.numel)))
        own: list[torch.Tensor] = []
        paths: list[str] = []
        error = None
        for kind, dtype, numel in files:
            role = f"{kind}{index}-r{self.rank}"
            path = self._path(self.run_id, role)
            paths.append(str(path))
            try:
                # posix_fallocate leaves the new file zero-filled, so the mapping needs no zero_().
                self._create_file(path, role, numel * dtype.itemsize, self.run_id)
                own.append(self._map(path, role, numel, dtype))
            except (OSError, RuntimeError, TransportError) as exc:
                error = f"rank {self.rank} could not create and map {str(path)!r}: {exc}"
                break
        try:
            infos: list[object] = [None] * self.world_size
            dist.all_gather_object(
                infos, (spec.name, spec.numel, str(spec.dtype), paths, error), group=self._group
            )
            self._check_same_spec(spec, infos)
            # views[f][peer]: peer's tensor of file f (the shard, then the staging slots).
            views: list[list[torch.Tensor]] = [[] for _ in files]
            error = None
            for peer, info in enumerate(infos):
                for f, (kind, dtype, numel) in enumerate(files):
                    if peer == self.rank:
                        views[f].append(own[f])
                        continue
                    peer_path = info[3][f]
                    try:
                        views[f].append(
                            self._map(peer_path, f"{kind}{index}-r{peer}", numel, dtype)
                        )
                    except (OSError, RuntimeError, TransportError) as exc:
                        error = f"rank {self.rank} could not map rank {peer}'s {peer_path!r}: {exc}"
                        break
                if error is not None:
                    break
            # Barrier: once every rank has mapped every file, the owners unlink theirs.
            errors: list[object] = [None] * self.world_size
            dist.all_gather_object(errors, error, group=self._group)
            for rank_error in errors:
                if rank_error is not None:
                    raise TransportError(f"buffer {spec.name!r}: {rank_error}")
        finally:
            self._unlink_created()
        if not spec.numel:
            views = [[torch.empty(0, dtype=spec.dtype) for _ in range(self.world_size)]]
        stripe_numel = self._stripe_numel(spec)
        num_stripes = -(-spec.numel // stripe_numel)
        self._lock_base[spec.name] = self._next_lock_byte
        self._next_lock_byte += self.world_size * num_stripes
        self._peer_views[spec.name] = views[0]
        if spec.dtype == torch.float32:
            self._peer_arrays[spec.name] = [view.numpy() for view in views[0]]
        if len(files) > 1:
            self._staging_views[spec.name] = views[1]
        self._num_buffers += 1
        return views[0][self.rank]

    def _extra_local_nbytes(self) -> int:
        """This rank's staging buffers (deterministic mode): one slot per source for each buffer."""
        return sum(views[self.rank].nbytes for views in self._staging_views.values())

    def _check_same_spec(self, spec: BufferSpec, infos: list) -> None:
        for info in infos:
            if info[4] is not None:
                raise TransportError(f"register buffer {spec.name!r}: {info[4]}")
        check_same_registration(infos)

    def _stripe_numel(self, spec: BufferSpec) -> int:
        return max(1, self.lock_stripe_nbytes // spec.dtype.itemsize)

    def _get(self, spec: BufferSpec, peer: int, offset: int, out: torch.Tensor) -> None:
        out.copy_(self._peer_views[spec.name][peer][offset : offset + out.numel()])

    def _accumulate(self, spec: BufferSpec, peer: int, offset: int, src: torch.Tensor) -> None:
        numel = src.numel()
        if numel == 0:
            return
        src_flat = src.view(-1)
        if self.accumulate_mode == "deterministic":
            self._accumulate_into_slot(spec, peer, offset, src_flat)
            return
        dst = self._peer_views[spec.name][peer]
        # fp32 sources go through numpy: its per-call overhead is far lower than torch's, which costs
        # ~10% of a 1 MiB stripe's add_ (measured). Other dtypes are cast by torch's add_.
        dst_array = src_array = None
        if src.dtype == torch.float32:
            dst_array = self._peer_arrays[spec.name][peer]
            src_array = src_flat.detach().numpy()
        stripe_numel = self._stripe_numel(spec)
        first = offset // stripe_numel
        num_stripes = (offset + numel - 1) // stripe_numel - first + 1
        lock_base = self._lock_base[spec.name] + peer * -(-spec.numel // stripe_numel)
        fd = self._thread_lock_fd()
        # Different sources start at different stripes so that concurrent writers do not convoy.
        rotation = self.rank % num_stripes
        for step in range(num_stripes):
            stripe = first + (rotation + step) % num_stripes
            lo = max(offset, stripe * stripe_numel)
            hi = min(offset + numel, (stripe + 1) * stripe_numel)
            lock_byte = lock_base + stripe
            fcntl.fcntl(
                fd,
                fcntl.F_OFD_SETLKW,
                struct.pack(_FLOCK_FORMAT, fcntl.F_WRLCK, 0, lock_byte, 1, 0),
            )
            try:
                if dst_array is not None:
                    part = dst_array[lo:hi]
                    np.add(part, src_array[lo - offset : hi - offset], out=part)
                else:
                    dst[lo:hi].add_(src_flat[lo - offset : hi - offset])
            finally:
                fcntl.fcntl(
                    fd,
                    fcntl.F_OFD_SETLK,
                    struct.pack(_FLOCK_FORMAT, fcntl.F_UNLCK, 0, lock_byte, 1, 0),
                )

    def _accumulate_into_slot(
        self, spec: BufferSpec, peer: int, offset: int, src_flat: torch.Tensor
    ) -> None:
        """Deterministic mode: add into this rank's own staging slot at ``peer``, without a file lock.

        Only this rank writes this slot, so no other process can race it; this rank's threads take turns
        (their interleaving would decide the order of the adds otherwise). ``fence`` reduces the slot.
        """
        base = staging_slot_offset(self.rank, self.world_size, spec.numel) + offset
        slot = self._staging_views[spec.name][peer][base : base + src_flat.numel()]
        with self._slot_locks[peer]:
            self._ctrl_dirty[peer, self.rank] = 1
            slot.add_(src_flat)  # bf16 / fp16 sources are cast to fp32 by add_, as in locked mode

    def _thread_lock_fd(self) -> int:
        """This thread's descriptor on the lock file (OFD locks exclude per open file description)."""
        fd = getattr(self._thread_fd, "fd", None)
        if fd is None:
            if threading.get_ident() == self._owner_thread:
                fd = self._lock_fd
            else:
                # The file is unlinked; reopening through procfs makes a new open file description.
                fd = os.open(f"/proc/self/fd/{self._lock_fd}", os.O_RDWR)
                with self._fds_lock:
                    self._fds.append(fd)
            self._thread_fd.fd = fd
        return fd

    def flush(self) -> None:
        """Nothing is asynchronous yet: every get and accumulate is complete when it returns."""
        self._check_open()

    def fence(self) -> None:
        """Wait until every rank of the group has reached the same number of fences.

        In deterministic mode every owner then adds its staging slots into its shard in source order
        0, 1, ..., W-1 (only the slots written since its last reduce) and zeroes them, and a second
        barrier keeps every source from writing a slot again before its owner has drained it.

        Raises:
            TransportError: a peer died (named with its pid), or some ranks did not arrive within
                ``timeout_s`` (named), or the transport is closed.
        """
        self._check_open()
        self._fence_count += 1
        self._barrier("")
        if self._staging_views:
            self._reduce_staging()
            self._barrier(" (after the owner reduce)")

    def _reduce_staging(self) -> None:
        """Owner side of the deterministic mode: reduce the dirty slots of every staging buffer."""
        dirty = self._ctrl_dirty[self.rank]
        sources = [src for src in range(self.world_size) if int(dirty[src])]
        if not sources:
            return  # nothing was accumulated into this owner since its last reduce: nothing to add
        for name, staging in self._staging_views.items():
            owner_reduce(
                self._peer_views[name][self.rank], staging[self.rank], self.world_size, sources
            )
        dirty.zero_()  # no source writes a flag until the second barrier has passed

    def _barrier(self, what: str) -> None:
        """One epoch barrier on the control block, naming dead or late peers as fence ``what``."""
        self._fence_epoch += 1
        epoch = self._fence_epoch
        fence = f"fence {self._fence_count}{what}"
        self._ctrl_epochs[self.rank] = epoch
        start = time.monotonic()
        next_check = start + _LIVENESS_PERIOD_S
        sleep_s = _FENCE_SLEEP_START_S
        while True:
            if int(self._ctrl_epochs.min()) >= epoch:
                return
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, _FENCE_SLEEP_CAP_S)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _LIVENESS_PERIOD_S
                missing = [r for r in range(self.world_size) if int(self._ctrl_epochs[r]) < epoch]
                dead = [r for r in missing if not pid_alive(int(self._ctrl_pids[r]))]
                if dead:
                    names = ", ".join(f"rank {r} (pid {int(self._ctrl_pids[r])})" for r in dead)
                    raise TransportError(
                        f"rank {self.rank}: {fence}: {names} died before reaching the fence"
                    )
            if now - start > self.timeout_s:  # at every wake-up: a timeout under the period holds
                missing = [r for r in range(self.world_size) if int(self._ctrl_epochs[r]) < epoch]
                raise TransportError(
                    f"rank {self.rank}: {fence} timed out after {self.timeout_s:g} s waiting "
                    f"for rank(s) {', '.join(str(r) for r in missing)}"
                )

    def _close(self) -> None:
        with contextlib.suppress(Exception):
            atexit.unregister(self._atexit_hook)
        self._peer_views.clear()
        self._peer_arrays.clear()
        self._staging_views.clear()
        self._ctrl = None
        self._ctrl_epochs = self._ctrl_pids = self._ctrl_dirty = None
        with self._fds_lock:
            fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._lock_fd = -1
        try:
            self._unlink_created()
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                logger.warning("could not remove shared-memory files: %s", exc)
