"""The training log: rank 0's handler, and Megatron-style lines with ODC's figures.

:class:`LogInterval` collects the iterations since the last line (their ``[loss_sum, num_tokens]``
pairs, grad norms, microbatch counts and times); :meth:`LogInterval.reduce` all-reduces the pairs over
DP when the line is due, so the logged ``lm loss`` is the exact global per-token mean, and
:meth:`LogInterval.line` renders Megatron's figures (iteration, consumed samples, ms per iteration,
learning rate, lm loss, grad norm) plus ODC's (microbatches per rank, the planner's time on the
lookahead thread and the loop's wait for it, compute imbalance, fetch/push/fence waits).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import sys

import torch
import torch.distributed as dist

HANDLER_NAME = "megatron_odc.train"
"""The name of the stdout handler this module installs on the ``megatron_odc`` logger."""


def setup_logging(rank: int) -> None:
    """Rank 0 logs INFO from ``megatron_odc`` to stdout; other ranks only warnings."""
    package = logging.getLogger("megatron_odc")
    if not any(h.name == HANDLER_NAME for h in package.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.name = HANDLER_NAME
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
        package.addHandler(handler)
        package.propagate = False
    package.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # The training log line carries the ODC telemetry; the wrapper's own line would repeat it.
    logging.getLogger("megatron_odc.mcore.data_parallel").setLevel(logging.WARNING)


@dataclasses.dataclass
class LogInterval:
    """The iterations since the last log line, on this rank."""

    num_iters: int = 0
    elapsed_s: float = 0.0
    num_tokens: int = 0
    min_microbatches: int | None = None
    max_microbatches: int | None = None
    num_skipped: int = 0
    iterations: list[int] = dataclasses.field(default_factory=list)
    pairs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Per iteration, this rank's ``[loss_sum, num_tokens]`` (float64)."""
    grad_norms: list[float | None] = dataclasses.field(default_factory=list)
    plan_wait_s: list[float] = dataclasses.field(default_factory=list)
    """Per iteration, what this rank waited for its plan and packed microbatches."""
    plan_s: list[float] = dataclasses.field(default_factory=list)
    """Per iteration, what planning and packing took on the lookahead thread."""

    def add(
        self,
        *,
        iteration: int,
        elapsed_s: float,
        num_tokens: int,
        microbatch_counts: list[int],
        pair: torch.Tensor,
        grad_norm: float | None,
        update_successful: bool,
        plan_wait_s: float = 0.0,
        plan_s: float = 0.0,
    ) -> None:
        """Record one iteration."""
        self.num_iters += 1
        self.elapsed_s += elapsed_s
        self.num_tokens += num_tokens
        low, high = min(microbatch_counts), max(microbatch_counts)
        self.min_microbatches = (
            low if self.min_microbatches is None else min(self.min_microbatches, low)
        )
        self.max_microbatches = (
            high if self.max_microbatches is None else max(self.max_microbatches, high)
        )
        self.num_skipped += 0 if update_successful else 1
        self.iterations.append(iteration)
        self.pairs.append(pair)
        self.grad_norms.append(grad_norm)
        self.plan_wait_s.append(plan_wait_s)
        self.plan_s.append(plan_s)

    def reduce(self, device: torch.device, dp_group: dist.ProcessGroup) -> torch.Tensor:
        """Every iteration's ``[loss_sum, num_tokens]`` summed over DP (collective), on the CPU."""
        pairs = torch.stack(self.pairs).to(device)
        dist.all_reduce(pairs, group=dp_group)
        return pairs.cpu()

    def line(
        self,
        *,
        pairs: torch.Tensor,
        train_iters: int,
        global_batch_size: int,
        lr: float,
        telemetry: dict[str, float] | None,
        eta_s: float,
    ) -> str:
        """The log line of this interval; ``pairs`` is what :meth:`reduce` returned."""
        iteration = self.iterations[-1]
        grad_norm = self.grad_norms[-1]
        loss_sum, num_tokens = (float(x) for x in pairs.sum(dim=0))
        loss = loss_sum / num_tokens if num_tokens > 0 else float("nan")
        elapsed_ms = 1000.0 * self.elapsed_s / self.num_iters
        tokens_per_s = self.num_tokens / self.elapsed_s if self.elapsed_s else 0.0
        parts = [
            f"iteration {iteration:8d}/{train_iters:8d}",
            f"consumed samples: {iteration * global_batch_size:12d}",
            f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
            f"learning rate: {lr:.6E}",
            f"global batch size: {global_batch_size:5d}",
            f"lm loss: {loss:.6E}",
            f"grad norm: {grad_norm:.3f}" if grad_norm is not None else "grad norm: n/a",
            f"tokens/s: {tokens_per_s:.0f}",
            f"num microbatches min/max: {self.min_microbatches}/{self.max_microbatches}",
            f"number of skipped iterations: {self.num_skipped:3d}",
            "plan ahead/wait max (ms): "
            f"{1000 * max(self.plan_s):.1f}/{1000 * max(self.plan_wait_s):.1f}",
        ]
        if telemetry is not None:
            parts.append(f"odc compute imbalance: {telemetry['compute_imbalance']:.2f}x")
            parts.append(
                "fetch/push/fence wait max/mean (ms): "
                f"{1000 * telemetry['fetch_wait_s_max']:.1f}/"
                f"{1000 * telemetry['fetch_wait_s_mean']:.1f}, "
                f"{1000 * telemetry['push_s_max']:.1f}/{1000 * telemetry['push_s_mean']:.1f}, "
                f"{1000 * telemetry['fence_s_max']:.1f}/{1000 * telemetry['fence_s_mean']:.1f}"
            )
        parts.append(f"ETA {datetime.timedelta(seconds=round(max(eta_s, 0.0)))}")
        return " | ".join(parts)
