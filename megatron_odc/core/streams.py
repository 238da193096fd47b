"""Stream / event ordering of ODC's overlap: fetch the next bucket and push the last one while compute runs.

[Note: overlap streams] Three streams per rank::

    fetch   : |F0|F1|      |F2|      |F3|
    compute :    |--C0--|--C1--|--C2--|--C3--|
    push    :           |P0|   |P1|   |P2|   |P3|  fence

- ``F(k)`` (fetch of bucket k) runs on the fetch stream; ``C(k)`` waits for ``F(k)``'s event;
- at most ``max_fetched`` buckets are fetched and not yet computed: ``F(k)`` waits for the event of
  ``C(k - max_fetched)`` (its memory is then released), so prefetching stays bounded;
- ``P(k)`` (push of bucket k's gradients) waits for ``C(k)``; at most ``max_pushing`` pushes run during a
  compute: ``C(k)`` waits for ``P(k - 1 - max_pushing)`` before it writes a new gradient buffer;
- the fence waits for every push event.

The logic is written against ``StreamOps``, a five-call interface (create a stream, launch work on it,
record an event, make a stream wait for an event, make the host wait for an event). ``FakeClockStreams``
implements it with a simulated clock (a CPU test can check the timeline exactly), ``TorchStreams`` with CUDA
streams and events (or runs everything in order on CPU). It imports no megatron module.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

STREAM_NAMES = ("fetch", "compute", "push")


class StreamOps(Protocol):
    """The device-agnostic stream interface the overlap logic needs."""

    def stream(self, name: str) -> Any:
        """Create (or return) the stream called ``name``."""

    def launch(self, stream: Any, label: str, fn: Callable[[], None], cost_s: float) -> None:
        """Enqueue ``fn`` on ``stream``; ``label`` names it and ``cost_s`` is its (simulated) duration."""

    def record(self, stream: Any) -> Any:
        """Record an event after everything enqueued so far on ``stream``; return it."""

    def wait(self, stream: Any, event: Any) -> None:
        """Make later work on ``stream`` wait for ``event``."""

    def host_wait(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""


# ---------------------------------------------------------------------- fake clock


@dataclasses.dataclass(frozen=True)
class Interval:
    """One launched operation on the simulated timeline."""

    stream: str
    label: str
    start_s: float
    end_s: float


@dataclasses.dataclass
class _FakeStream:
    name: str
    cursor_s: float = 0.0  # when the last enqueued op ends
    ready_s: float = 0.0  # earliest start of the next op (raised by waits)


class FakeClockStreams:
    """``StreamOps`` on a simulated clock: streams are FIFO queues, events are completion times.

    An op starts when its stream is free and every event its stream waits on has completed; it lasts
    ``cost_s``. The host is at ``host_s``: ``launch`` cannot start an op before the host issued it, and
    ``host_wait`` advances the host to the event. ``fn`` runs immediately (host order is a valid
    serialization because every dependency is issued before its dependants).
    """

    def __init__(self, launch_overhead_s: float = 0.0) -> None:
        self.host_s = 0.0
        self.launch_overhead_s = launch_overhead_s
        self.timeline: list[Interval] = []
        self._streams: dict[str, _FakeStream] = {}

    def stream(self, name: str) -> _FakeStream:
        """Create or return the simulated stream ``name``."""
        return self._streams.setdefault(name, _FakeStream(name))

    def launch(
        self, stream: _FakeStream, label: str, fn: Callable[[], None], cost_s: float
    ) -> None:
        """Run ``fn`` now and place it on the timeline after its stream's earlier ops and waits."""
        if cost_s < 0:
            raise ValueError(f"cost_s must be >= 0, got {cost_s} for {label!r}")
        self.host_s += self.launch_overhead_s
        start = max(stream.cursor_s, stream.ready_s, self.host_s)
        stream.cursor_s = start + cost_s
        self.timeline.append(Interval(stream.name, label, start, stream.cursor_s))
        fn()

    def record(self, stream: _FakeStream) -> float:
        """The event: the time at which everything enqueued so far on ``stream`` has completed."""
        return max(stream.cursor_s, stream.ready_s)

    def wait(self, stream: _FakeStream, event: float) -> None:
        """Later ops on ``stream`` start no earlier than ``event``."""
        stream.ready_s = max(stream.ready_s, event)

    def host_wait(self, event: float) -> None:
        """Advance the host clock to ``event``."""
        self.host_s = max(self.host_s, event)

    def interval(self, label: str) -> Interval:
        """The timeline entry called ``label`` (labels are unique within one run)."""
        matches = [i for i in self.timeline if i.label == label]
        if len(matches) != 1:
            raise KeyError(f"{len(matches)} timeline entries are labelled {label!r}")
        return matches[0]


# ---------------------------------------------------------------------- torch streams


class TorchStreams:
    """``StreamOps`` on torch: CUDA streams and events on a CUDA device, in-order execution on CPU.

    Args:
        device: the device; on a non-CUDA device every op runs at once on the host and events are
            ``None`` (everything is already complete).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._streams: dict[str, Any] = {}

    def stream(self, name: str) -> Any:
        """A dedicated CUDA stream per name (the compute stream is the current stream)."""
        if name not in self._streams:
            if not self._cuda:
                self._streams[name] = name
            elif name == "compute":
                self._streams[name] = torch.cuda.current_stream(self.device)
            else:
                self._streams[name] = torch.cuda.Stream(self.device)
        return self._streams[name]

    def launch(self, stream: Any, label: str, fn: Callable[[], None], cost_s: float) -> None:
        """Run ``fn`` with ``stream`` current (labelled for the profiler)."""
        del cost_s
        with torch.autograd.profiler.record_function(f"ODC::{label}"):
            if self._cuda:
                with torch.cuda.stream(stream):
                    fn()
            else:
                fn()

    def record(self, stream: Any) -> Any:
        """A CUDA event recorded on ``stream`` (``None`` on CPU)."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        """``stream.wait_event(event)`` (no-op on CPU)."""
        if event is not None:
            stream.wait_event(event)

    def host_wait(self, event: Any) -> None:
        """``event.synchronize()`` (no-op on CPU)."""
        if event is not None:
            event.synchronize()


# ---------------------------------------------------------------------- the overlap schedule


@dataclasses.dataclass(frozen=True)
class BucketWork:
    """What to run for one bucket: the three callables and their simulated costs."""

    fetch: Callable[[], None]
    compute: Callable[[], None]
    push: Callable[[], None] | None = None
    fetch_cost_s: float = 0.0
    compute_cost_s: float = 0.0
    push_cost_s: float = 0.0


class OverlapSchedule:
    """Issue fetch / compute / push of a sequence of buckets on three streams (see [Note: overlap streams]).

    Args:
        ops: the stream implementation.
        max_fetched: buckets fetched but not yet computed, at most (>= 1; 2 = current + one prefetched).
        max_pushing: pushes in flight while a compute runs, at most (>= 1; 1 = double-buffered grads).
    """

    def __init__(self, ops: StreamOps, *, max_fetched: int = 2, max_pushing: int = 1) -> None:
        if max_fetched < 1:
            raise ValueError(f"max_fetched must be >= 1, got {max_fetched}")
        if max_pushing < 1:
            raise ValueError(f"max_pushing must be >= 1, got {max_pushing}")
        self.ops = ops
        self.max_fetched = max_fetched
        self.max_pushing = max_pushing
        self._streams = {name: ops.stream(name) for name in STREAM_NAMES}
        self._push_events: list[Any] = []

    def run(self, buckets: Sequence[BucketWork]) -> None:
        """Issue every bucket's fetch, compute and push in order, prefetching up to ``max_fetched``."""
        fetch_s, compute_s, push_s = (self._streams[n] for n in STREAM_NAMES)
        ops = self.ops
        fetched: list[Any] = []  # fetch event of bucket k
        computed: list[Any] = []  # compute event of bucket k
        pushed: dict[int, Any] = {}  # push event of bucket k, for buckets that push

        for k, work in enumerate(buckets):
            # Fetch j needs the release of bucket j - max_fetched, i.e. its compute event, which exists
            # once computes 0..k-1 are issued: prefetch every j < k + max_fetched.
            while len(fetched) < min(len(buckets), k + self.max_fetched):
                j = len(fetched)
                if j >= self.max_fetched:
                    ops.wait(fetch_s, computed[j - self.max_fetched])
                ops.launch(fetch_s, f"fetch{j}", buckets[j].fetch, buckets[j].fetch_cost_s)
                fetched.append(ops.record(fetch_s))
            ops.wait(compute_s, fetched[k])
            # Bounded pushes: while compute k runs, only pushes k-max_pushing..k-1 may be in flight.
            oldest = k - 1 - self.max_pushing
            if work.push is not None and oldest in pushed:
                ops.wait(compute_s, pushed[oldest])
            ops.launch(compute_s, f"compute{k}", work.compute, work.compute_cost_s)
            computed.append(ops.record(compute_s))
            if work.push is not None:
                ops.wait(push_s, computed[k])
                ops.launch(push_s, f"push{k}", work.push, work.push_cost_s)
                pushed[k] = ops.record(push_s)
        self._push_events.extend(pushed.values())

    def fence(self) -> Any:
        """Make the compute stream and the host wait for every push issued so far; return the event."""
        compute_s = self._streams["compute"]
        for event in self._push_events:
            self.ops.wait(compute_s, event)
        event = self.ops.record(compute_s)
        self.ops.host_wait(event)
        self._push_events.clear()
        return event
