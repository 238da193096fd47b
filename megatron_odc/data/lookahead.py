"""Planning ahead: the next minibatch's work is done on a background thread while this one trains.

Owns :class:`Lookahead`, one worker thread that runs ``produce(key)`` for the key the caller says it
will ask for next. The training loop asks for minibatch ``k`` and names ``k + 1``; the plan and the
packed microbatches of ``k + 1`` are then made while ``k``'s forward and backward run (torch's kernels
release the GIL, so the planner's Python runs beside them). A request for a key that was not
prepared (the first one, or after a resume moved the position) runs on the worker too and is waited
for, so ``produce`` is only ever called from one thread and its results do not depend on timing: the
values are the ones a caller computing them inline would get.

[Note: lookahead waits]
:meth:`Lookahead.get` returns how long the caller waited for the value. With a planner faster than a
training step the wait after the first step is ~0; a growing wait says the planner (or the data
reads) is slower than training. The training log line reports it per interval.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["Lookahead", "Prepared"]

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclasses.dataclass(frozen=True)
class Prepared(Generic[V]):
    """A value made by the worker, with its timings.

    Attributes:
        value: what ``produce(key)`` returned.
        wait_s: seconds :meth:`Lookahead.get` blocked for it (~0 when it was made ahead).
        produce_s: seconds ``produce`` itself ran, on the worker.
        ahead: whether it had been started before it was asked for.
    """

    value: V
    wait_s: float
    produce_s: float
    ahead: bool


class Lookahead(Generic[K, V]):
    """Runs ``produce`` one key ahead of the caller, on one worker thread (see the module docstring).

    Args:
        produce: makes the value of a key; exceptions it raises reach the caller of :meth:`get`.
        name: the worker thread's name prefix (shows in stack dumps).
    """

    def __init__(self, produce: Callable[[K], V], *, name: str) -> None:
        self._produce = produce
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name
        )
        self._pending: tuple[K, concurrent.futures.Future] | None = None

    def _timed(self, key: K) -> tuple[V, float]:
        start = time.perf_counter()
        value = self._produce(key)
        return value, time.perf_counter() - start

    def get(self, key: K, next_key: K | None) -> Prepared[V]:
        """The value of ``key``; then starts making ``next_key``'s (``None``: nothing follows).

        Raises:
            Whatever ``produce(key)`` raised.
        """
        if self._executor is None:
            raise RuntimeError("Lookahead.get after close()")
        start = time.perf_counter()
        ahead = self._pending is not None and self._pending[0] == key
        if ahead:
            future = self._pending[1]
        else:
            if self._pending is not None:
                # The caller moved (a resume): what was made ahead is not what it asks for.
                logger.debug("lookahead: discarding %r, asked for %r", self._pending[0], key)
                self._pending[1].cancel()
            future = self._executor.submit(self._timed, key)
        self._pending = None
        value, produce_s = future.result()
        wait_s = time.perf_counter() - start
        if next_key is not None:
            self._pending = (next_key, self._executor.submit(self._timed, next_key))
        return Prepared(value=value, wait_s=wait_s, produce_s=produce_s, ahead=ahead)

    def close(self) -> None:
        """Stops the worker; a value being made is finished and dropped, a queued one cancelled."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
            self._pending = None
