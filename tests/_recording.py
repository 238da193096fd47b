"""Recorders that check ODC's promise (tests only): every transport call, every collective."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_odc.transport.base import BufferSpec, Transport


class RecordingTransport(Transport):
    """Forwards to ``inner`` and appends ``(op, name, peer, offset, numel)`` to ``calls``.

    Whole-bucket helpers are inherited from the base class, so they show up as their one-sided gets and
    accumulates; a collective transport's overrides are therefore not what this checks.

    ``inner`` may already hold registered buffers (e.g. the transport of a constructed
    ``ODCDataParallel``, swapped for a wrapper before training): their specs and local shards are
    mirrored, so ``local()``, ``get`` and ``accumulate`` work on them; their registration is not recorded.
    """

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner.rank, inner.world_size)
        self.inner = inner
        self.calls: list[tuple] = []
        for name in inner.buffer_names:
            self._specs[name] = inner.spec(name)
            self._local[name] = inner.local(name)

    def _register(self, spec: BufferSpec) -> torch.Tensor:
        self.calls.append(("register", spec.name, None, 0, spec.numel))
        return self.inner.register(spec.name, spec.numel, spec.dtype, accumulate=spec.accumulate)

    def _get(self, spec: BufferSpec, peer: int, offset: int, out: torch.Tensor) -> None:
        self.calls.append(("get", spec.name, peer, offset, out.numel()))
        self.inner.get(spec.name, peer, offset, out)

    def _accumulate(self, spec: BufferSpec, peer: int, offset: int, src: torch.Tensor) -> None:
        self.calls.append(("accumulate", spec.name, peer, offset, src.numel()))
        self.inner.accumulate(spec.name, peer, offset, src)

    def flush(self) -> None:
        self.calls.append(("flush", None, None, 0, 0))
        self.inner.flush()

    def fence(self) -> None:
        self.calls.append(("fence", None, None, 0, 0))
        self.inner.fence()

    def _close(self) -> None:
        self.inner.close()

    def ops(self) -> list[str]:
        """The op names, in call order."""
        return [c[0] for c in self.calls]


class RecordingStreams:
    """A ``StreamOps`` that runs everything at once and appends what it was asked to ``log``.

    Entries: ``("launch", stream, label)`` (before the work runs, so the transport calls the work makes
    follow it), ``("record", stream, event)``, ``("wait", stream, event)``, ``("host_wait", event)``.
    Streams are their names, events increasing ints.
    """

    def __init__(self, log: list) -> None:
        self.log = log
        self._next_event = 0

    def stream(self, name: str) -> str:
        return name

    def launch(self, stream: str, label: str, fn, cost_s: float) -> None:
        self.log.append(("launch", stream, label))
        fn()

    def record(self, stream: str) -> int:
        self._next_event += 1
        self.log.append(("record", stream, self._next_event))
        return self._next_event

    def wait(self, stream: str, event: int) -> None:
        self.log.append(("wait", stream, event))

    def host_wait(self, event: int) -> None:
        self.log.append(("host_wait", event))


@contextlib.contextmanager
def record_collectives(log: list) -> Iterator[None]:
    """Append ``("collective", name, group's global ranks, numel of the tensor argument)`` per call of
    ``torch.distributed``'s collectives inside the block (megatron-core's included: they look the
    functions up on the module at call time)."""
    saved = []

    def recorder(fn, name):
        signature = inspect.signature(fn)

        def inner(*args, **kwargs):
            arguments = signature.bind_partial(*args, **kwargs).arguments
            group = arguments.get("group")
            ranks = (
                dist.get_process_group_ranks(group)
                if group is not None
                else list(range(dist.get_world_size()))
            )
            tensor = arguments.get("tensor")
            numel = tensor.numel() if isinstance(tensor, torch.Tensor) else -1
            log.append(("collective", name, tuple(sorted(ranks)), numel))
            return fn(*args, **kwargs)

        return inner

    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier"):
        fn = getattr(dist, name)
        saved.append((name, fn))
        setattr(dist, name, recorder(fn, name))
    try:
        yield
    finally:
        for name, fn in saved:
            setattr(dist, name, fn)
