"""Rank health, the watchdog, the checkpoint-writer guard and one job per ``--save`` in Megatron-LM's loop.

The plugin's entry runs these around its own loop (``runner/trainer.py``). Megatron-LM's loop is its own,
so the launcher and a patched source reach them through four names of ``megatron.training.training``
(patch points of every tag's row, ``patching.py``):

- ``initialize_megatron``: once it has set up the process group, :func:`start_job` starts this rank's
  :class:`~megatron_odc.runner.health.HealthMonitor` (heartbeat and phase records in the job's store, the
  watchdog, the end of the rank when its launcher dies; [Note: rank health]) and holds ``--save`` for
  the job ([Note: save directory lock]);
- ``train_step``: the phase ``iteration``, numbered as Megatron-LM logs it;
- ``save_checkpoint``: the phase ``save``, after making megatron-core's checkpoint-writer processes die
  with this rank (``mcore/dist_ckpt/writer_processes.py``: before, every save under Megatron-LM left a
  results-queue manager that printed a stack dump at exit);
- ``load_checkpoint``: the phase ``load`` (its wrapper is ``checkpointing.wrap_load_checkpoint``, which
  also keeps ``--override-opt_param-scheduler``'s schedule).

When the script ends, the launcher calls :func:`end_job` (the last record says whether the rank
finished; the lock is released; a finished rank's process groups are destroyed, [Note: process groups
at exit]); a patched source, without a launcher, ends its job at the interpreter's exit
(:func:`_end_at_exit`). For a failure :func:`failure_report` decides what the rank prints:
a refusal of megatron_odc's own once per job (``runner/errors.py``), a failure caused by a peer that died
or stopped as one line naming it, anything else (a bug) with its traceback.

Everything here is per process and a no-op before :func:`start_job`, except that a finished
:func:`end_job` destroys whatever process groups it finds.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from megatron_odc.mcore.dist_ckpt import writer_processes
from megatron_odc.runner import errors, save_lock
from megatron_odc.runner.health import (
    EXIT_PEER_FAILURE,
    HealthMonitor,
    PeerFailureError,
    default_store,
)
from megatron_odc.runner.launch_env import launch_local_rank

logger = logging.getLogger(__name__)

EXIT_REFUSAL = 2
"""The exit status of a rank that stops on a refusal of megatron_odc's own (or on a peer's)."""


@dataclasses.dataclass
class _Job:
    monitor: HealthMonitor
    held: contextlib.ExitStack


_job: _Job | None = None


def start_job(args: Any) -> None:
    """Start this rank's health monitor and hold ``args.save`` (collective); once per process.

    Raises:
        save_lock.SaveDirBusyError: another live job holds ``--save`` (on every rank).
    """
    global _job
    if _job is not None or not dist.is_initialized():
        return
    timeout_s = 60.0 * float(getattr(args, "distributed_timeout_minutes", 10) or 10)
    monitor = HealthMonitor(
        default_store(), dist.get_rank(), dist.get_world_size(), timeout_s
    ).start()
    held = contextlib.ExitStack()
    try:
        held.enter_context(save_lock.hold(getattr(args, "save", None)))
    except BaseException:
        held.close()
        monitor.stop(finished=False)
        raise
    _job = _Job(monitor, held)
    atexit.register(_end_at_exit)  # a patched source has no launcher to call end_job first


# [Note: process groups at exit]
# Megatron-LM's ``pretrain`` never destroys its process groups. Left to the interpreter's exit, a
# gloo group's worker threads can be torn down unjoined, and a rank that had finished aborts
# (SIGABRT, ``terminate called without an active exception``; seen now and then in CI's CPU runs of
# Megatron-LM's own ``--dp-backend ddp`` through the launcher; PyTorch's own tests destroy their
# groups for the same reason). So a finished rank destroys them with its last record. Only a finished
# one: there every collective has completed, while after a failure one may still wait on a peer.


def end_job(*, finished: bool) -> None:
    """Write this rank's last record (``finished`` or not) and release ``--save``; idempotent. A
    finished rank's process groups are destroyed as well ([Note: process groups at exit])."""
    global _job
    job, _job = _job, None
    try:
        if job is not None:
            try:
                job.held.close()
            finally:
                job.monitor.stop(finished=finished)
    finally:
        if finished and dist.is_initialized():
            dist.destroy_process_group()


def _end_at_exit() -> None:
    """A patched source's end of the job (a launcher has ended it before): finished unless an
    uncaught exception ends the interpreter (Python sets ``sys.last_value`` before the exit
    handlers run)."""
    if _job is not None:
        end_job(finished=not hasattr(sys, "last_value"))


@contextlib.contextmanager
def phase(name: str, iteration: int | None = None) -> Iterator[None]:
    """Record that this rank does ``name`` (at ``iteration``) for the block (nothing before the job)."""
    if _job is None:
        yield
        return
    with _job.monitor.phase(name, iteration):
        yield


def failure_report(error: BaseException, *, refusal: bool) -> tuple[int, str | None] | None:
    """What a rank whose script failed with ``error`` prints, and its exit status.

    Args:
        error: what ended the script.
        refusal: whether ``error`` is a refusal of megatron_odc's own (a ``ValueError`` it raised).

    Returns:
        ``(exit status, line or None)``: a refusal (status 2; the line on one rank of the job, or on the
        first rank of each host before the process group is up), a peer's refusal (2, nothing more), a
        peer that died or stopped (``EXIT_PEER_FAILURE``, a line naming it); None for anything else
        (this rank's own failure: its traceback stays). A rank whose launcher is gone ends here.
    """
    if _job is not None:
        _job.monitor.end_if_launcher_gone()  # a peer ended with its launcher: so does this rank
    if refusal:
        if not dist.is_initialized():
            first_of_host = launch_local_rank(os.environ) in (None, 0)
            return EXIT_REFUSAL, str(error) if first_of_host else None
        errors.settle(error)
        return EXIT_REFUSAL, getattr(error, errors.REPORT_ATTRIBUTE, str(error))
    try:
        errors.settle(error)  # a peer's refusal: it printed it; this rank stops quietly
    except errors.PeerFailedError:
        return EXIT_REFUSAL, None
    if _job is None:
        return None
    failure = _job.monitor.failure(error)
    if isinstance(failure, PeerFailureError):
        return EXIT_PEER_FAILURE, str(failure)
    return None


def _megatron_args() -> Any:
    from megatron.training.global_vars import get_args

    return get_args()


def wrap_initialize_megatron(original: Callable) -> Callable:
    """``initialize_megatron``, then :func:`start_job` with Megatron-LM's parsed args."""

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        start_job(_megatron_args())
        return result

    initialize_megatron.__megatron_odc_original__ = original  # type: ignore[attr-defined]
    return initialize_megatron


def wrap_train_step(original: Callable) -> Callable:
    """``train_step`` in the phase ``iteration`` (the iteration it trains, as Megatron-LM logs it)."""

    def train_step(*args: Any, **kwargs: Any) -> Any:
        with phase("iteration", int(getattr(_megatron_args(), "curr_iteration", 0) or 0) + 1):
            return original(*args, **kwargs)

    train_step.__megatron_odc_original__ = original  # type: ignore[attr-defined]
    return train_step


def wrap_save_checkpoint(original: Callable) -> Callable:
    """``save_checkpoint(iteration, ...)`` in the phase ``save``, its writer processes guarded."""

    def save_checkpoint(iteration: int, *args: Any, **kwargs: Any) -> Any:
        writer_processes.install()
        with phase("save", int(iteration)):
            return original(iteration, *args, **kwargs)

    save_checkpoint.__megatron_odc_original__ = original  # type: ignore[attr-defined]
    return save_checkpoint
