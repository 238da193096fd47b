"""Per-rank, per-minibatch counters of where ODC spends time and bytes.

``Telemetry`` is filled by the engine (fetch, push and fence timings and bytes) and by the DP wrapper
(microbatches and tokens); ``snapshot()`` returns this rank's figures for the current minibatch as a dict,
and ``reduce_across(group)`` turns every rank's snapshot into max/mean figures (one small collective, to
be called after the step, never inside a minibatch). ``format_line`` renders the one log line rank 0
prints per minibatch. Times are host wall-clock: on a GPU the fetch and push figures are the time to issue
work that then runs on the side streams, and waiting for it shows up in the fence figure (the fence
synchronises the device). No megatron import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_odc.transport.devices import collective_device

if TYPE_CHECKING:
    from megatron_odc.core.p2p import TransferResult

#: Counters summed within a minibatch, in the order they are reduced across ranks.
COUNTER_KEYS = (
    "wall_s",
    "compute_s",
    "fetch_wait_s",
    "push_s",
    "fence_s",
    "fetch_bytes",
    "push_bytes",
    "num_fetches",
    "num_pushes",
    "num_microbatches",
    "num_tokens",
)


@dataclasses.dataclass
class Telemetry:
    """One rank's counters for the current minibatch; ``begin_minibatch`` resets them."""

    fetch_wait_s: float = 0.0
    push_s: float = 0.0
    fence_s: float = 0.0
    fetch_bytes: int = 0
    push_bytes: int = 0
    num_fetches: int = 0
    num_pushes: int = 0
    num_microbatches: int = 0
    num_tokens: int = 0
    minibatch_index: int = -1
    _start: float | None = None
    _end: float | None = None

    def begin_minibatch(self) -> None:
        """Reset every counter and start the minibatch clock."""
        index = self.minibatch_index + 1
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)
        self.minibatch_index = index
        self._start = time.perf_counter()

    def end_minibatch(self) -> None:
        """Stop the minibatch clock (the wall time then covers fetch, compute, push and fence)."""
        self._end = time.perf_counter()

    def add_fetch(self, result: TransferResult) -> None:
        """Count one fetch of a unit."""
        self.fetch_bytes += result.peer_nbytes
        self.num_fetches += result.num_buckets

    def add_push(self, result: TransferResult) -> None:
        """Count one push of a unit."""
        self.push_bytes += result.peer_nbytes
        self.num_pushes += result.num_buckets

    @contextlib.contextmanager
    def timed(self, counter: str) -> Iterator[None]:
        """Add the time spent inside the block to ``counter`` (a ``*_s`` field)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, counter, getattr(self, counter) + time.perf_counter() - start)

    def snapshot(self) -> dict[str, float]:
        """This rank's figures for the current (or just finished) minibatch."""
        if self._start is None:
            wall = 0.0
        else:
            wall = (self._end if self._end is not None else time.perf_counter()) - self._start
        waits = self.fetch_wait_s + self.push_s + self.fence_s
        return {
            "minibatch": self.minibatch_index,
            "wall_s": wall,
            "compute_s": max(wall - waits, 0.0),
            "fetch_wait_s": self.fetch_wait_s,
            "push_s": self.push_s,
            "fence_s": self.fence_s,
            "fetch_bytes": self.fetch_bytes,
            "push_bytes": self.push_bytes,
            "num_fetches": self.num_fetches,
            "num_pushes": self.num_pushes,
            "num_microbatches": self.num_microbatches,
            "num_tokens": self.num_tokens,
        }


def reduce_across(snapshot: dict[str, float], group: dist.ProcessGroup | None) -> dict[str, float]:
    """Max and mean of every counter over the ranks of ``group`` (one all-gather; call after the step)."""
    values = torch.tensor(
        [float(snapshot[k]) for k in COUNTER_KEYS],
        dtype=torch.float64,
        device=collective_device(group),
    )
    world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    if world_size > 1:
        gathered = [torch.empty_like(values) for _ in range(world_size)]
        dist.all_gather(gathered, values, group=group)
        table = torch.stack(gathered).cpu()
    else:
        table = values.unsqueeze(0)
    out: dict[str, float] = {"minibatch": snapshot["minibatch"], "num_ranks": world_size}
    for i, key in enumerate(COUNTER_KEYS):
        out[f"{key}_max"] = float(table[:, i].max())
        out[f"{key}_mean"] = float(table[:, i].mean())
        out[f"{key}_min"] = float(table[:, i].min())
    # Imbalance: how much longer the busiest rank computed than the average one.
    mean_compute = out["compute_s_mean"]
    out["compute_imbalance"] = out["compute_s_max"] / mean_compute if mean_compute > 0 else 1.0
    return out


def format_line(reduced: dict[str, float]) -> str:
    """One log line for a reduced minibatch record."""
    mib = 1024.0 * 1024.0
    return (
        f"odc minibatch {int(reduced['minibatch'])} | ranks {int(reduced['num_ranks'])} | "
        f"wall {reduced['wall_s_max']:.3f}s | compute max/mean {reduced['compute_s_max']:.3f}/"
        f"{reduced['compute_s_mean']:.3f}s (imbalance {reduced['compute_imbalance']:.2f}x) | "
        f"fetch wait max/mean {reduced['fetch_wait_s_max']:.3f}/{reduced['fetch_wait_s_mean']:.3f}s | "
        f"push max/mean {reduced['push_s_max']:.3f}/{reduced['push_s_mean']:.3f}s | "
        f"fence max/mean {reduced['fence_s_max']:.3f}/{reduced['fence_s_mean']:.3f}s | "
        f"fetched {reduced['fetch_bytes_mean'] / mib:.1f} MiB/rank | "
        f"pushed {reduced['push_bytes_mean'] / mib:.1f} MiB/rank | "
        f"microbatches min/max {int(reduced['num_microbatches_min'])}/"
        f"{int(reduced['num_microbatches_max'])} | "
        f"tokens min/max {int(reduced['num_tokens_min'])}/{int(reduced['num_tokens_max'])}"
    )
