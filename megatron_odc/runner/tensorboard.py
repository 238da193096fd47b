"""TensorBoard and wandb: the log line's figures as scalars, under Megatron-LM's tag names.

:class:`MetricsWriter` (rank 0 only: it writes the text log, so both show the same numbers; Megatron-LM
writes from the last rank, where its last pipeline stage holds the loss; this entry sends the loss to
every stage, so rank 0, on the first stage, has it too)
takes each :class:`~megatron_odc.runner.log.LogFigures` when its line is logged and records:

- per iteration, every ``--tensorboard-log-interval`` iterations (Megatron-LM's ``training_log``
  names, each also against consumed samples as ``<tag> vs samples``): ``lm loss``, ``learning-rate``,
  ``grad-norm``, ``batch-size``. They are written when the log line is due, after the losses are
  reduced over DP, so a step appears up to ``--log-interval`` iterations late;
- per log line (``--log-interval``): ``skipped-iterations`` (optimizer steps skipped in the interval, fp16
  overflow), ``loss-scale`` (Megatron-LM's tag; with a loss scaler only), ``iteration-time`` (seconds,
  as Megatron-LM's), ``tokens-per-second``
  (Megatron-LM's ``throughput`` is TFLOP/s per GPU, which this entry does not compute), and ODC's
  figures under ``odc/``: the microbatch counts per rank (min, max), the planner's time ahead and the
  loop's wait for it, the compute imbalance and the fetch / push / fence waits (max and mean over DP).

wandb (``--wandb-project``) gets the same tags without the ``vs samples`` twins. Neither package is
imported before it is asked for: :func:`require_packages` refuses missing ones before training.
"""

from __future__ import annotations

import argparse
import logging
import os
from types import ModuleType
from typing import Any

from megatron_odc.runner.log import LogFigures

logger = logging.getLogger(__name__)

ODC_TELEMETRY_TAGS = {
    "odc/compute-imbalance": ("compute_imbalance", 1.0),
    "odc/fetch-wait-ms-max": ("fetch_wait_s_max", 1000.0),
    "odc/fetch-wait-ms-mean": ("fetch_wait_s_mean", 1000.0),
    "odc/push-ms-max": ("push_s_max", 1000.0),
    "odc/push-ms-mean": ("push_s_mean", 1000.0),
    "odc/fence-ms-max": ("fence_s_max", 1000.0),
    "odc/fence-ms-mean": ("fence_s_mean", 1000.0),
}
"""Tag -> (key of the reduced ODC telemetry, factor): the figures of the log line's ODC part."""


def odc_scalars(
    min_microbatches: int | None,
    max_microbatches: int | None,
    plan_ahead_ms_max: float | None,
    plan_wait_ms_max: float | None,
    telemetry: dict[str, float] | None,
) -> dict[str, float]:
    """ODC's scalars under their ``odc/`` tags (those given; None leaves a figure out): also what the
    Megatron-LM launcher writes to Megatron-LM's TensorBoard / wandb writers
    (``integration/megatron_lm/odc_log.py``)."""
    scalars: dict[str, float] = {}
    for tag, value in (
        ("odc/num-microbatches-min", min_microbatches),
        ("odc/num-microbatches-max", max_microbatches),
        ("odc/plan-ahead-ms-max", plan_ahead_ms_max),
        ("odc/plan-wait-ms-max", plan_wait_ms_max),
    ):
        if value is not None:
            scalars[tag] = value
    if telemetry is not None:
        for tag, (key, factor) in ODC_TELEMETRY_TAGS.items():
            scalars[tag] = factor * telemetry[key]
    return scalars


def _missing(package: str, flag: str, error: ImportError) -> ValueError:
    return ValueError(
        f"{flag} needs the {package} package, which is not importable ({error}): "
        f"pip install {package}"
    )


def _summary_writer_class() -> type:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise _missing("tensorboard", "--tensorboard-dir", exc) from exc
    return SummaryWriter


def _wandb() -> ModuleType:
    try:
        import wandb
    except ImportError as exc:
        raise _missing("wandb", "--wandb-project", exc) from exc
    return wandb


def require_packages(args: argparse.Namespace) -> None:
    """Refuse ``--tensorboard-dir`` / ``--wandb-project`` when their package is missing.

    Raises:
        ValueError: naming the flag and the ``pip install`` that fixes it.
    """
    if args.tensorboard_dir is not None:
        _summary_writer_class()
    if args.wandb_project is not None:
        _wandb()


class MetricsWriter:
    """TensorBoard's ``SummaryWriter`` and / or a wandb run; see the module docstring for what they get.

    Args:
        tensorboard: the writer, or None.
        wandb: the imported ``wandb`` module after ``wandb.init``, or None.
        tensorboard_log_interval: write an iteration's scalars when it is divisible by this.
    """

    def __init__(self, tensorboard: Any, wandb: Any, tensorboard_log_interval: int) -> None:
        self.tensorboard = tensorboard
        self.wandb = wandb
        self.tensorboard_log_interval = tensorboard_log_interval

    @classmethod
    def open(cls, args: argparse.Namespace) -> MetricsWriter | None:
        """The writer the flags ask for, or None when they ask for none (validated flags)."""
        if args.tensorboard_dir is None and args.wandb_project is None:
            return None
        tensorboard = None
        if args.tensorboard_dir is not None:
            tensorboard = _summary_writer_class()(log_dir=args.tensorboard_dir)
            logger.info(
                "TensorBoard: writing to %s (view: tensorboard --logdir %s)",
                args.tensorboard_dir,
                args.tensorboard_dir,
            )
        wandb = None
        if args.wandb_project is not None:
            wandb = _wandb()
            save_dir = args.wandb_save_dir or os.path.join(args.save, "wandb")
            os.makedirs(save_dir, exist_ok=True)
            wandb.init(
                dir=save_dir,
                name=args.wandb_exp_name,
                project=args.wandb_project,
                config=vars(args),
            )
        return cls(tensorboard, wandb, args.tensorboard_log_interval)

    def write(self, figures: LogFigures) -> None:
        """Record one log line's figures, and those of its iterations that are due."""
        for step in figures.per_iteration:
            if step.iteration % self.tensorboard_log_interval:
                continue
            samples = step.consumed_samples
            self._scalar("lm loss", step.lm_loss, step.iteration, samples)
            self._scalar("learning-rate", step.learning_rate, step.iteration, samples)
            self._scalar("batch-size", figures.global_batch_size, step.iteration, samples)
            if step.grad_norm is not None:
                self._scalar("grad-norm", step.grad_norm, step.iteration, samples)
        iteration = figures.iteration
        scalars = {
            "iteration-time": figures.ms_per_iteration / 1000.0,
            "tokens-per-second": figures.tokens_per_s,
            **odc_scalars(
                figures.min_microbatches,
                figures.max_microbatches,
                figures.plan_ahead_ms_max,
                figures.plan_wait_ms_max,
                figures.telemetry,
            ),
            "skipped-iterations": figures.num_skipped,
        }
        if figures.loss_scale is not None:
            scalars["loss-scale"] = figures.loss_scale
        for tag, value in scalars.items():
            self._scalar(tag, value, iteration)
        if self.tensorboard is not None:
            self.tensorboard.flush()  # the run is watched while it trains

    def _scalar(self, tag: str, value: float, iteration: int, samples: int | None = None) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(tag, value, iteration)
            if samples is not None:
                self.tensorboard.add_scalar(f"{tag} vs samples", value, samples)
        if self.wandb is not None:
            self.wandb.log({tag: value}, step=iteration)

    def close(self) -> None:
        """Flush and close the event file; finish the wandb run."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
