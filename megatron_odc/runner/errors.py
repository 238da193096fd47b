"""User errors found once the process group is up: one message per job, exit status 2 on every rank.

A user error is a ``ValueError`` (bad data, tokenizer, checkpoint, flags, a diverged loss); anything
else is a bug and keeps its traceback. ``python -m megatron_odc.train`` prints a user error as one line
``python -m megatron_odc.train: error: <message>`` on stderr and exits with status 2; :func:`settle`,
called by ``trainer.train`` while the process group is still up, decides which rank prints it:

- every rank publishes its message in the process group's store (``megatron_odc/user_error/<rank>``);
- rank 0 prints its own;
- another rank waits up to :data:`PEER_WAIT_S` for rank 0's message: when rank 0 found the same error
  (a collective check: every rank reads the same data), it prints nothing; otherwise it alone found it,
  and prints it itself, prefixed with ``rank <r>: ``, and exits, which ends the job;
- a rank that fails otherwise (typically a collective broken because a peer left) while a peer has
  published a user error exits with status 2 and prints nothing more: the peer's message is the one.
"""

from __future__ import annotations

import contextlib
import datetime
import logging

import torch.distributed as dist

from megatron_odc.runner.health import default_store

logger = logging.getLogger(__name__)

PEER_WAIT_S = 5.0
"""How long a rank other than 0 waits to learn whether rank 0 found the same error."""
_KEY = "megatron_odc/user_error/{}"
REPORT_ATTRIBUTE = "megatron_odc_report"
"""Set on a settled ``ValueError``: the line this rank prints (after ``error: ``), or None."""


class PeerFailedError(ValueError):
    """This rank stopped because another rank found a user error (and printed it)."""


def settle(exc: BaseException) -> None:
    """Decides what this rank prints for ``exc``, raised while the process group is up.

    A ``ValueError`` gets :data:`REPORT_ATTRIBUTE`. Another exception is left alone unless a peer has
    published a user error; :class:`PeerFailedError` is raised then (from ``exc``).
    """
    if not dist.is_initialized():
        return
    store = _store()
    rank = dist.get_rank()
    if isinstance(exc, ValueError):
        message = str(exc)
        report: str | None = message
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(_KEY.format(rank), message)
            if rank != 0:
                first = _peer_message(store, 0, wait_s=PEER_WAIT_S)
                report = None if first == message else f"rank {rank}: {message}"
        setattr(exc, REPORT_ATTRIBUTE, report)
        return
    if store is None:
        return
    for peer in range(dist.get_world_size()):
        if peer != rank and _peer_message(store, peer, wait_s=0.0) is not None:
            error = PeerFailedError(f"rank {peer} found an error; this rank stopped with it")
            setattr(error, REPORT_ATTRIBUTE, None)
            logger.debug("rank %d stops after rank %d's error: %r", rank, peer, exc)
            raise error from exc


def _store():
    with contextlib.suppress(Exception):
        return default_store()
    return None


def _peer_message(store, peer: int, *, wait_s: float) -> str | None:
    """``peer``'s published message, waiting up to ``wait_s`` for it; None when there is none."""
    key = _KEY.format(peer)
    try:
        if wait_s > 0:
            store.wait([key], datetime.timedelta(seconds=wait_s))
        elif not store.check([key]):
            return None
        return store.get(key).decode("utf-8", errors="replace")
    except Exception:  # timed out, or the store went away with its host
        return None
