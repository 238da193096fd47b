"""The checkpoint writer's processes die with the rank that started them: none outlives a killed rank.

megatron-core's ``torch_dist`` checkpoint writer starts, once per process, a ``multiprocessing`` manager
(``spawn``; about 270 MB, with its resource tracker) for its results queue, and forks one writer per bucket
at every save. When a rank is killed (SIGKILL, the OOM killer, a node agent), none of them notices: the
manager and its tracker run on forever, and a writer forked during the save keeps the deleted
shared-memory shards it maps (seen before this module: issue 19).

:func:`install` (called by ``state.write`` before every save, from the saving thread; idempotent; Linux)
makes every child die with the rank through the kernel's parent-death signal (``PR_SET_PDEATHSIG``):

- forked children (the writers) set it right after ``fork`` (``os.register_at_fork``);
- the manager, started by ``spawn`` (fork + exec, which runs no fork hook), is started here instead of by
  megatron-core, with an initializer that sets it, and handed to megatron-core as its results queue.

Both kinds of child also ignore SIGINT: Ctrl-C in a terminal reaches the whole process group, and the
rank handles it (one ``interrupted`` line); the children printed a ``KeyboardInterrupt`` traceback each
and die with the rank anyway. The manager listens on a Linux abstract socket (no file): on its default
address, a file in a ``pymp-*`` directory of ``$TMPDIR``, every killed rank left that directory behind.

Elsewhere than Linux it does nothing. The parent-death signal fires when the *thread* that started the
child ends: both are started by the thread that saves (the training loop's).
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import multiprocessing
import os
import signal
import sys
import uuid
from multiprocessing.managers import SyncManager

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_installed_in: int | None = None
_manager: SyncManager | None = None


def die_with_parent(parent_pid: int) -> None:
    """In a child: ask the kernel for SIGKILL when the parent dies; exit now if it already has.

    Ctrl-C is left to the parent (SIGINT ignored here). The SIGTERM with which the parent ends the
    manager dumps no stack: importing ``megatron.core.inference`` (Megatron-LM's scripts do, and a spawned
    child re-imports the script) registers ``faulthandler`` for SIGTERM, and every save under
    Megatron-LM printed ``Stack (most recent call first)`` at exit.
    """
    if not sys.platform.startswith("linux"):
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.unregister(signal.SIGTERM)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning("PR_SET_PDEATHSIG failed (errno %d)", ctypes.get_errno())
        return
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def _after_fork_in_child() -> None:
    if _installed_in is not None:
        die_with_parent(_installed_in)


def install() -> None:
    """Make this process's children die with it (idempotent; a no-op off Linux)."""
    global _installed_in, _manager
    if not sys.platform.startswith("linux") or _installed_in == os.getpid():
        return
    first_time = _installed_in is None
    _installed_in = os.getpid()
    if first_time:
        os.register_at_fork(after_in_child=_after_fork_in_child)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:  # not started yet
        address = f"\0megatron_odc-checkpoint-writer-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        _manager = SyncManager(address=address, ctx=multiprocessing.get_context("spawn"))
        _manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
        filesystem_async._results_queue = _manager.Queue()
