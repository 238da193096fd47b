"""The forward-backward schedule of ODC chunks: this rank's planned number of microbatches.

Megatron-LM calls the schedule with one ``num_microbatches`` for every rank; under ODC each DP replica
runs its own count from the length-balanced plan (``data.py``), including 0, for which only the
gradients are finalized (the rank joins the DP fence) and a zero loss report is returned. With pipeline
stages a DP replica is one pipeline: its stages agree on one count (:func:`~megatron_odc.mcore.pipeline.agree_pipeline_count`) and then run
megatron-core's 1F1B schedule with it, or, with 0, all skip it and only finalize.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from megatron.core import parallel_state

from megatron_odc.integration.megatron_lm.flags import balanced_loader_in_use
from megatron_odc.integration.megatron_lm.odc_log import OdcLogLine
from megatron_odc.mcore.data_parallel import ODCDataParallel
from megatron_odc.mcore.pipeline import agree_pipeline_count
from megatron_odc.mcore.step import finalize_without_microbatches
from megatron_odc.transport.devices import collective_device

NO_COUNT = -1
"""The count of a rank without a planned loader (a middle pipeline stage, where Megatron-LM's GPT
builds no dataset, or ``--balance none``)."""

DEFAULT_LOSS_KEYS = ("lm loss",)
"""Keys of the zero report of a rank without microbatches, until a schedule has reported its own."""


class PlannedCountSchedule:
    """Wraps a megatron-core forward-backward function to run this rank's planned microbatch count.

    Applies to training calls (``forward_only=False``) on ``ODCDataParallel`` chunks, and on Megatron-LM's
    own DDP chunks fed by the balanced loader (``--balance lb_micro``: equal counts, the packing
    baseline); anything else is passed through. The count comes from ``data_iterator.iterable.next_num_microbatches()`` (or the
    iterator's own method) when offered, else the caller's ``num_microbatches``; with TP > 1 it is
    broadcast from the TP source rank (the only one with data), with PP > 1 agreed over the pipeline
    (:func:`~megatron_odc.mcore.pipeline.agree_pipeline_count`). Whether a job plans its counts is one
    fact for all its ranks (:func:`~megatron_odc.integration.megatron_lm.flags.balanced_loader_in_use`),
    so TP ranks and middle stages without a loader join those collectives too. When Megatron-LM's rerun
    state machine re-runs a step in place (``--rerun-mode validate_results`` after a suspicious loss,
    every step under ``report_stats``), every rank reuses the step's count without a collective: its
    decision to re-run was itself collective, and the data iterators replay the same microbatches.

    Args:
        inner: the schedule from megatron-core's ``get_forward_backward_func``.
    """

    def __init__(self, inner: Callable) -> None:
        self.inner = inner
        self.loss_keys: tuple[str, ...] = DEFAULT_LOSS_KEYS
        self.last_num_microbatches: int | None = None
        self.log = OdcLogLine()

    def planned_count(self, data_iterator: Any, default: int) -> int:
        """This rank's microbatch count for the next step (a collective over TP when TP > 1 and over
        the pipeline when PP > 1)."""
        if _rerunning_in_place() and self.last_num_microbatches is not None:
            return self.last_num_microbatches
        source = _count_source(data_iterator)
        count = NO_COUNT
        if source is not None and hasattr(source, "next_num_microbatches"):
            count = int(source.next_num_microbatches())
        if (
            parallel_state.model_parallel_is_initialized()
            and parallel_state.get_tensor_model_parallel_world_size() > 1
        ):
            group = parallel_state.get_tensor_model_parallel_group()
            buf = torch.tensor([count], dtype=torch.int64, device=collective_device(group))
            torch.distributed.broadcast(
                buf, parallel_state.get_tensor_model_parallel_src_rank(), group=group
            )
            count = int(buf.item())
        if parallel_state.model_parallel_is_initialized():
            count = agree_pipeline_count(count, unplanned=NO_COUNT)
        count = default if count == NO_COUNT else count
        self.last_num_microbatches = count
        return count

    def _after_step(self, count: int, data_iterator: Any, chunks: list) -> None:
        """ODC's figures of the step (``odc_log.py``); a collective over DP at log iterations."""
        if _rerunning_in_place():
            return
        self.log.after_step(
            count,
            _count_source(data_iterator),
            chunks,
            parallel_state.get_data_parallel_group(),
        )

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, **kwargs):
        chunks = model if isinstance(model, list) else [model]
        odc = all(isinstance(c, ODCDataParallel) for c in chunks)
        if kwargs.get("forward_only", False) or not (odc or _planned()):
            return self.inner(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=num_microbatches,
                **kwargs,
            )
        count = self.planned_count(data_iterator, num_microbatches)
        if count > 0:
            losses = self.inner(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=count,
                **kwargs,
            )
            if losses and isinstance(losses[0], dict):
                self.loss_keys = tuple(losses[0])
            self._after_step(count, data_iterator, chunks)
            return losses
        if not odc:
            raise ValueError(
                "this DP rank's plan has no microbatch in this step, which Megatron-LM's own DDP "
                "cannot run; use --dp-backend odc or --balance lb_micro with --global-batch-size at "
                "least the DP size"
            )
        finalize_without_microbatches(chunks)
        self._after_step(0, data_iterator, chunks)
        return [{key: torch.zeros(2, device=collective_device()) for key in self.loss_keys}]


def _count_source(data_iterator: Any) -> Any:
    """The object offering ``next_num_microbatches``: the iterator, the one a ``RerunDataIterator``
    wraps, or None."""
    if data_iterator is None or hasattr(data_iterator, "next_num_microbatches"):
        return data_iterator
    return getattr(data_iterator, "iterable", None)


def _planned() -> bool:
    """Whether this job's train split is the balanced loader (under Megatron-LM's own DDP:
    ``--dp-backend ddp|distopt --balance lb_micro``), on every rank alike."""
    from megatron.training import get_args

    return balanced_loader_in_use(get_args())


def _rerunning_in_place() -> bool:
    """Whether Megatron-LM's rerun state machine is re-running this step in place (on every rank)."""
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    return get_rerun_state_machine().state == RerunState.RERUNNING_IN_PLACE


def wrap_get_forward_backward_func(original: Callable) -> Callable:
    """``get_forward_backward_func`` whose schedule is a :class:`PlannedCountSchedule`."""

    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        return PlannedCountSchedule(original(*args, **kwargs))

    get_forward_backward_func.__megatron_odc_original__ = original
    return get_forward_backward_func
