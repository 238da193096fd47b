"""One job at a time per ``--save`` directory: a lock file with liveness.

[Note: save directory lock]
Two jobs saving into one directory destroy each other's work: each save removes the incomplete
``iter_*.tmp-*`` directories it finds, so the first save of one job deleted the other's save in progress
(issue 37). The directory is therefore held by one job, through :data:`LOCK_FILENAME` in it:

- the job's global rank 0 opens the file and takes an exclusive ``flock`` on it for as long as the job
  runs (:func:`acquire`); the kernel drops that lock when the process ends however it ends (exit, an
  error, SIGTERM, SIGKILL), so a dead holder's lock is free at once and the next job takes it over;
- the file holds the holder's record (host, pid, the pid's start time, when it took the lock), which a
  refused job names; while the job runs, a thread touches the file every :data:`HEARTBEAT_S` seconds;
- where ``flock`` is unsupported (``ENOLCK``, ``EOPNOTSUPP``, ``ENOSYS``, ``EINVAL``: NFS without a
  lock manager, Lustre mounted ``noflock``), and where the lock may not be visible across hosts (the
  record names another host), liveness is judged from the record: a holder on this host is alive while
  its pid runs with the recorded start time; a holder on another host while its heartbeat is younger
  than :data:`STALE_AFTER_S`.

What holds where (the same in docs/reliability.md): a local file system: the lock is exact. NFS: the
Linux client sends ``flock`` to the server as a whole-file POSIX lock (NLM for v3, in-protocol for v4),
so two hosts exclude each other where the server grants locks; mounted ``nolock`` / ``local_lock=all``
the lock is per host and the heartbeat decides across hosts. Lustre: ``-o flock`` is coherent across
clients; ``-o localflock`` is per client (the heartbeat decides across hosts); mounted ``noflock``,
``flock`` fails and the record alone decides. The heartbeat compares the file's modification time with this
host's clock: clocks apart by more than :data:`STALE_AFTER_S` break that judgement.

Only the holder removes stale ``iter_*.tmp-*`` directories (``checkpoint.save_checkpoint``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

LOCK_FILENAME = "megatron_odc_save.lock"
"""The lock file in the ``--save`` directory."""
HEARTBEAT_S = 10.0
"""How often the holder touches the lock file."""
STALE_AFTER_S = 120.0
"""A holder on another host whose lock file is older than this is taken for dead (used only where
``flock`` cannot tell: see [Note: save directory lock])."""
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class SaveDirBusyError(ValueError):
    """Another live job holds the ``--save`` directory."""


def _pid_start_time(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None
    where there is no such process or no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _this_holder() -> dict[str, Any]:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "pid_start": _pid_start_time(pid),
        "since": time.time(),
    }


def _read_record(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0)
        record = json.loads(raw.decode("utf-8")) if raw.strip() else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _alive_on_this_host(record: dict[str, Any]) -> bool:
    pid = record.get("pid")
    if not isinstance(pid, int):
        return False
    start = _pid_start_time(pid)
    return start is not None and (record.get("pid_start") in (None, start))


def _describe(record: dict[str, Any] | None, path: Path) -> str:
    if record is None:
        return f"a job whose lock file {path} holds no record"
    since = record.get("since")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
        if isinstance(since, (int, float))
        else "an unknown time"
    )
    return f"pid {record.get('pid')} on host {record.get('host')}, holding it since {when}"


def _refusal(save_dir: Path, path: Path, record: dict[str, Any] | None) -> SaveDirBusyError:
    return SaveDirBusyError(
        f"--save {save_dir} is in use by another job ({_describe(record, path)}; lock file "
        f"{path}): wait for that job to end or stop it, or point --save at another directory"
    )


class SaveDirLock:
    """This process's hold on a ``--save`` directory (see [Note: save directory lock]).

    Released by :meth:`release`, when the object is collected, and by the kernel when the process ends.
    """

    path: Path  # the lock file
    locked: bool  # whether the hold is an flock (False: the record alone, flock unsupported)

    def __init__(self, path: Path, fd: int, *, locked: bool) -> None:
        self.path = path
        self.locked = locked
        self._fd = fd
        self._stop = threading.Event()
        heartbeat = threading.Thread(
            target=_heartbeat, args=(fd, self._stop), name="megatron_odc-save-lock", daemon=True
        )
        heartbeat.start()
        self._finalizer = weakref.finalize(self, _close, fd, self._stop)

    def release(self) -> None:
        """Remove the lock file and give the lock up (idempotent). The file goes while the lock is
        still held; a job that opened it just before takes the lock of a removed file, which
        :func:`acquire` notices and retries."""
        if self._finalizer.alive:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self._finalizer()


def _heartbeat(fd: int, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        with contextlib.suppress(OSError):
            os.utime(fd)


def _close(fd: int, stop: threading.Event) -> None:
    stop.set()
    with contextlib.suppress(OSError):
        os.close(fd)  # the flock goes with the last descriptor of its open file


def acquire(save_dir: str | os.PathLike) -> SaveDirLock:
    """Take ``save_dir`` for this process (creating it), or refuse (this rank only, no collective).

    Raises:
        SaveDirBusyError: another live job holds it (the message names the holder and what to do).
        OSError: the directory or the lock file cannot be created or written.
    """
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    path = save_dir / LOCK_FILENAME
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            locked = _flock(fd, save_dir, path)
            opened, named = os.fstat(fd), os.stat(path)
            if (opened.st_dev, opened.st_ino) == (named.st_dev, named.st_ino):
                break  # the lock of the file at ``path``, not of one its holder just removed
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    else:
        raise OSError(errno.EAGAIN, f"{path} keeps being replaced")
    try:
        record = _read_record(fd)
        if record is not None and _alive_elsewhere(record, path, fd, locked=locked):
            raise _refusal(save_dir, path, record)
        if record is not None:
            logger.warning(
                "--save %s: taking over the lock of %s, which is gone",
                save_dir,
                _describe(record, path),
            )
        data = json.dumps(_this_holder()).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return SaveDirLock(path, fd, locked=locked)


def _flock(fd: int, save_dir: Path, path: Path) -> bool:
    """Take the flock of ``fd``: True when taken, False where flock is unsupported.

    Raises:
        SaveDirBusyError: another process holds it.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise _refusal(save_dir, path, _read_record(fd)) from None
        if exc.errno not in _UNSUPPORTED:
            raise
        return False
    return True


def _alive_elsewhere(record: dict[str, Any], path: Path, fd: int, *, locked: bool) -> bool:
    """Whether the holder ``record`` names still runs, though this process could open the lock
    (``locked``: holds the flock; otherwise flock is unsupported)."""
    if record.get("host") == socket.gethostname():
        # This kernel's flock is exact for its own processes; without flock the pid decides.
        return not locked and _alive_on_this_host(record)
    age_s = time.time() - os.fstat(fd).st_mtime
    return age_s < STALE_AFTER_S  # flock may not reach across hosts: the heartbeat decides


def held_by_this_process(save_dir: str | os.PathLike) -> bool:
    """Whether this very process holds ``save_dir``'s lock (its record names this host, pid and pid
    start time): true inside a job that took it with :func:`hold`."""
    path = Path(save_dir) / LOCK_FILENAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        record = _read_record(fd)
    finally:
        os.close(fd)
    me = _this_holder()
    return record is not None and all(record.get(k) == me[k] for k in ("host", "pid", "pid_start"))


def _agreed(error: BaseException | None) -> None:
    """Raise on every rank what rank 0 found (collective where a process group is up)."""
    message = None if error is None else (type(error).__name__, str(error))
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message is not None:
        kind, text = message
        raise SaveDirBusyError(text) if kind == SaveDirBusyError.__name__ else ValueError(text)


@contextlib.contextmanager
def hold(save_dir: str | os.PathLike | None) -> Iterator[SaveDirLock | None]:
    """Hold ``save_dir`` for the block: rank 0 takes the lock (collective: every rank raises the same
    error when it cannot); released on leaving the block. ``save_dir`` None holds nothing.

    Raises:
        SaveDirBusyError: another live job holds it.
        ValueError: the directory or its lock file cannot be created or written (the OS error named).
    """
    if save_dir is None:
        yield None
        return
    lock, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            lock = acquire(save_dir)
        except SaveDirBusyError as exc:
            error = exc
        except OSError as exc:
            error = ValueError(
                f"--save {save_dir}: cannot take its lock file {LOCK_FILENAME} "
                f"({exc.strerror or exc}); --save must be a directory this job can write"
            )
    try:
        _agreed(error)
        yield lock
    finally:
        if lock is not None:
            lock.release()
