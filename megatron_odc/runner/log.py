"""The training log: rank 0's handler, and Megatron-style lines with ODC's figures.

:class:`LogInterval` collects the iterations since the last line (their ``[loss_sum, num_tokens]``
pairs, grad norms, microbatch counts and times); :meth:`LogInterval.reduce` all-reduces the pairs over
DP when the line is due, so the logged ``lm loss`` is the exact global per-token mean, and
:meth:`LogInterval.figures` gathers Megatron's figures (iteration, consumed samples, ms per iteration,
learning rate, lm loss, grad norm) plus ODC's (microbatches per rank, the planner's time on the
lookahead thread and the loop's wait for it, compute imbalance, fetch/push/fence waits) into one
:class:`LogFigures`, which renders the text line (:meth:`LogFigures.line`) and which ``tensorboard.py``
records, so both show the same numbers.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import sys

import torch
import torch.distributed as dist

HANDLER_NAME = "megatron_odc.train"
"""The name of the stdout handler this module installs on the ``megatron_odc`` logger."""


RANK_LOCAL_LOGGERS = (
    "megatron_odc.transport",
    "megatron_odc.mcore.dist_ckpt.writer_processes",
    "megatron_odc.runner.health",
)
"""Loggers whose warnings are about the rank that logs them (its shared memory, its CUDA device, its
writer processes, its watchdog): every rank prints those. Every other warning of ``megatron_odc`` is
about the job (its data, flags, checkpoint, loss), which every rank finds alike: rank 0 alone prints it."""


@functools.cache
def info_once(logger: logging.Logger, message: str, *args: object) -> None:
    """``logger.info(message, *args)`` once per process, for start-up code that runs more than once
    (Megatron-LM parses its arguments twice)."""
    logger.info(message, *args)


@functools.cache
def warning_once(logger: logging.Logger, message: str, *args: object) -> None:
    """``logger.warning(message, *args)`` once per process (as :func:`info_once`)."""
    logger.warning(message, *args)


def _rank_local_or_error(record: logging.LogRecord) -> bool:
    """The filter of ranks other than 0: errors, and warnings of :data:`RANK_LOCAL_LOGGERS`."""
    return record.levelno >= logging.ERROR or any(
        record.name == name or record.name.startswith(name + ".") for name in RANK_LOCAL_LOGGERS
    )


def setup_logging(rank: int) -> None:
    """Rank 0 logs INFO from ``megatron_odc`` to stdout; other ranks only errors and the warnings
    about themselves (:data:`RANK_LOCAL_LOGGERS`), so a warning about the job is printed once."""
    package = logging.getLogger("megatron_odc")
    handler = next((h for h in package.handlers if h.name == HANDLER_NAME), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stdout)
        handler.name = HANDLER_NAME
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
        package.addHandler(handler)
        package.propagate = False
    handler.removeFilter(_rank_local_or_error)
    if rank != 0:
        handler.addFilter(_rank_local_or_error)
    package.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # The training log line carries the ODC telemetry; the wrapper's own line would repeat it.
    logging.getLogger("megatron_odc.mcore.data_parallel").setLevel(logging.WARNING)


def job_info_on_rank_zero(rank: int) -> None:
    """Under a host program's logging (Megatron-LM's, which prints every rank's INFO records): the
    ``megatron_odc`` INFO lines are about the job and alike on every rank, so ranks other than 0
    drop them; their warnings and errors still print."""
    if rank != 0:
        logging.getLogger("megatron_odc").setLevel(logging.WARNING)


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
    learning_rates: list[float] = dataclasses.field(default_factory=list)
    """Per iteration, the learning rate its update used."""
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
        learning_rate: float,
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
        self.learning_rates.append(learning_rate)
        self.plan_wait_s.append(plan_wait_s)
        self.plan_s.append(plan_s)

    def reduce(self, device: torch.device, dp_group: dist.ProcessGroup) -> torch.Tensor:
        """Every iteration's ``[loss_sum, num_tokens]`` summed over DP (collective), on the CPU."""
        pairs = torch.stack(self.pairs).to(device)
        dist.all_reduce(pairs, group=dp_group)
        return pairs.cpu()

    def figures(
        self,
        *,
        pairs: torch.Tensor,
        global_batch_size: int,
        telemetry: dict[str, float] | None,
        eta_s: float,
        loss_scale: float | None = None,
    ) -> LogFigures:
        """The figures of this interval; ``pairs`` is what :meth:`reduce` returned; ``loss_scale``
        the optimizer's after the interval (None without a loss scaler)."""
        loss_sums, token_counts = pairs.double().unbind(dim=1)
        per_iteration = tuple(
            IterationFigures(
                iteration=it,
                consumed_samples=it * global_batch_size,
                lm_loss=_mean(float(s), float(n)),
                grad_norm=norm,
                learning_rate=lr,
            )
            for it, s, n, norm, lr in zip(
                self.iterations,
                loss_sums,
                token_counts,
                self.grad_norms,
                self.learning_rates,
                strict=True,
            )
        )
        last = per_iteration[-1]
        return LogFigures(
            iteration=last.iteration,
            consumed_samples=last.consumed_samples,
            ms_per_iteration=1000.0 * self.elapsed_s / self.num_iters,
            learning_rate=last.learning_rate,
            global_batch_size=global_batch_size,
            lm_loss=_mean(float(loss_sums.sum()), float(token_counts.sum())),
            grad_norm=last.grad_norm,
            tokens_per_s=self.num_tokens / self.elapsed_s if self.elapsed_s else 0.0,
            min_microbatches=self.min_microbatches,
            max_microbatches=self.max_microbatches,
            num_skipped=self.num_skipped,
            num_iterations=self.num_iters,
            loss_scale=loss_scale,
            plan_ahead_ms_max=1000 * max(self.plan_s),
            plan_wait_ms_max=1000 * max(self.plan_wait_s),
            telemetry=telemetry,
            eta_s=eta_s,
            per_iteration=per_iteration,
        )


def _mean(loss_sum: float, num_tokens: float) -> float:
    return loss_sum / num_tokens if num_tokens > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class IterationFigures:
    """One iteration's figures (TensorBoard records them every ``--tensorboard-log-interval``)."""

    iteration: int
    consumed_samples: int
    lm_loss: float
    """The iteration's global per-token mean loss (NaN when its minibatch had no loss token)."""
    grad_norm: float | None
    learning_rate: float


@dataclasses.dataclass(frozen=True)
class LogFigures:
    """The figures of one log line, as the text line shows them and TensorBoard records them.

    Attributes:
        lm_loss: the global per-token mean over every iteration of the interval.
        grad_norm, learning_rate: the last iteration's.
        ms_per_iteration, tokens_per_s: this rank's, over the interval.
        min_microbatches, max_microbatches: over the ranks and iterations of the interval.
        num_skipped, num_iterations: the interval's iterations whose optimizer step was skipped
            (fp16 overflow), of how many.
        loss_scale: the loss scale after the interval (None without a loss scaler).
        plan_ahead_ms_max, plan_wait_ms_max: the longest planning on the lookahead thread, and the
            longest wait for it.
        telemetry: ODC's figures of the last minibatch, reduced over DP (``core/telemetry.py``;
            None for backends without them).
        per_iteration: each iteration of the interval.
    """

    iteration: int
    consumed_samples: int
    ms_per_iteration: float
    learning_rate: float
    global_batch_size: int
    lm_loss: float
    grad_norm: float | None
    tokens_per_s: float
    min_microbatches: int | None
    max_microbatches: int | None
    num_skipped: int
    num_iterations: int
    loss_scale: float | None
    plan_ahead_ms_max: float
    plan_wait_ms_max: float
    telemetry: dict[str, float] | None
    eta_s: float
    per_iteration: tuple[IterationFigures, ...]

    def line(self, train_iters: int) -> str:
        """The Megatron-style log line."""
        grad_norm = self.grad_norm
        parts = [
            f"iteration {self.iteration:8d}/{train_iters:8d}",
            f"consumed samples: {self.consumed_samples:12d}",
            f"elapsed time per iteration (ms): {self.ms_per_iteration:.1f}",
            f"learning rate: {self.learning_rate:.6E}",
            f"global batch size: {self.global_batch_size:5d}",
            f"lm loss: {self.lm_loss:.6E}",
            f"grad norm: {grad_norm:.3f}" if grad_norm is not None else "grad norm: n/a",
            f"tokens/s: {self.tokens_per_s:.0f}",
            microbatches_part(self.min_microbatches, self.max_microbatches),
            f"number of skipped iterations: {self.num_skipped:3d}"
            + (" (every step of the interval)" if self.num_skipped == self.num_iterations else ""),
        ]
        if self.loss_scale is not None:
            parts.append(f"loss scale: {self.loss_scale:.1f}")
        parts += odc_parts(self.plan_ahead_ms_max, self.plan_wait_ms_max, self.telemetry)
        parts.append(f"ETA {datetime.timedelta(seconds=round(max(self.eta_s, 0.0)))}")
        return " | ".join(parts)


def microbatches_part(low: int | None, high: int | None) -> str:
    """The log line's microbatch counts (min / max over the ranks and iterations of the interval)."""
    return f"num microbatches min/max: {low}/{high}"


def odc_parts(
    plan_ahead_ms_max: float, plan_wait_ms_max: float, telemetry: dict[str, float] | None
) -> list[str]:
    """The log line's planner and ODC figures (the telemetry reduced over DP, or None): also what
    the Megatron-LM launcher's ODC line shows (``integration/megatron_lm/odc_log.py``)."""
    parts = [f"plan ahead/wait max (ms): {plan_ahead_ms_max:.1f}/{plan_wait_ms_max:.1f}"]
    if telemetry is not None:
        parts.append(f"odc compute imbalance: {telemetry['compute_imbalance']:.2f}x")
        parts.append(
            "fetch/push/fence wait max/mean (ms): "
            f"{1000 * telemetry['fetch_wait_s_max']:.1f}/"
            f"{1000 * telemetry['fetch_wait_s_mean']:.1f}, "
            f"{1000 * telemetry['push_s_max']:.1f}/{1000 * telemetry['push_s_mean']:.1f}, "
            f"{1000 * telemetry['fence_s_max']:.1f}/{1000 * telemetry['fence_s_mean']:.1f}"
        )
    return parts
