"""ODC's per-step figures in a Megatron-LM run: one log line at every ``--log-interval`` and the same
scalars in Megatron-LM's TensorBoard / wandb writers.

Megatron-LM's own ``training_log`` line knows nothing of the plan or of ODC. :class:`OdcLogLine` is
called by the planned-count schedule (``schedule.py``) after every training step on every rank, with
this rank's microbatch count and the balanced loader's planning time and wait; when Megatron-LM's
next log line is due (iteration ``args.curr_iteration + 1`` divisible by ``--log-interval``) it reduces
the interval's figures over DP (one all-reduce, plus ODC's telemetry all-gather for ODC chunks) and
rank 0 logs, in the words of the plugin's entry (``runner/log.py``'s ``microbatches_part`` /
``odc_parts``)::

    odc iteration        4/      20 | num microbatches min/max: 1/3 | plan ahead/wait max (ms): 2.1/0.0 | odc compute imbalance: 1.04x | fetch/push/fence wait max/mean (ms): ...

The ranks that hold Megatron-LM's writers (``get_tensorboard_writer`` / ``get_wandb_writer``: its last
rank) record the same figures under the entry's ``odc/`` tags (``runner/tensorboard.py``'s
``odc_scalars``) at that iteration. With Megatron-LM's own DDP fed by the balanced loader (the packing
baseline) the line has the counts and planning figures only.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from megatron_odc.core.telemetry import reduce_across
from megatron_odc.runner.log import microbatches_part, odc_parts
from megatron_odc.runner.tensorboard import odc_scalars
from megatron_odc.transport.devices import collective_device

logger = logging.getLogger(__name__)


class OdcLogLine:
    """The figures of the iterations since the last line, on this rank."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.low: int | None = None
        self.high: int | None = None
        self.plan_s = 0.0
        self.wait_s = 0.0

    def after_step(self, count: int, source: Any, chunks: list, dp_group: Any) -> None:
        """Record one training step; at Megatron-LM's log iterations reduce (a collective over
        ``dp_group``: every DP rank calls this every step) and log / write the figures.

        Args:
            count: this rank's microbatches in the step.
            source: the balanced loader's iterator (``last_plan_s`` / ``last_wait_s``), or None.
            chunks: the model chunks (ODC telemetry where they are ``ODCDataParallel``).
            dp_group: the DP group.
        """
        self.low = count if self.low is None else min(self.low, count)
        self.high = count if self.high is None else max(self.high, count)
        self.plan_s = max(self.plan_s, float(getattr(source, "last_plan_s", 0.0)))
        self.wait_s = max(self.wait_s, float(getattr(source, "last_wait_s", 0.0)))
        from megatron.training import get_args

        args = get_args()
        iteration = int(getattr(args, "curr_iteration", 0)) + 1
        if iteration % args.log_interval:
            return
        values = torch.tensor(
            [-float(self.low), float(self.high), self.plan_s, self.wait_s],
            dtype=torch.float64,
            device=collective_device(dp_group),
        )
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=dp_group)
        low, high, plan_s, wait_s = (-values[0].item(), *values[1:].tolist())
        odc_chunk = next((c for c in chunks if hasattr(c, "telemetry")), None)
        telemetry = (
            reduce_across(odc_chunk.telemetry(), odc_chunk.dp_group)
            if odc_chunk is not None
            else None
        )
        self._reset()
        if dist.get_rank() == 0:
            parts = [
                f"odc iteration {iteration:8d}/{args.train_iters:8d}",
                microbatches_part(int(low), int(high)),
                *odc_parts(1000 * plan_s, 1000 * wait_s, telemetry),
            ]
            logger.info(" | ".join(parts))
        scalars = odc_scalars(int(low), int(high), 1000 * plan_s, 1000 * wait_s, telemetry)
        _write(scalars, iteration)


def _write(scalars: dict[str, float], iteration: int) -> None:
    """``scalars`` to Megatron-LM's TensorBoard and wandb writers, where this rank holds them."""
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    tensorboard, wandb = get_tensorboard_writer(), get_wandb_writer()
    for tag, value in scalars.items():
        if tensorboard is not None:
            tensorboard.add_scalar(tag, value, iteration)
        if wandb is not None:
            wandb.log({tag: value}, iteration)
