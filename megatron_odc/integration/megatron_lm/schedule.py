"""The forward-backward schedule of ODC chunks: this rank's planned number of microbatches.

Megatron-LM calls the schedule with one ``num_microbatches`` for every rank; under ODC each DP replica
runs its own count from the length-balanced plan (``data.py``), including 0, for which only the
gradients are finalized (the rank joins the DP fence) and a zero loss report is returned. With pipeline
stages a DP replica is one pipeline: its stages agree on one count (:func:`pipeline_count`) and then run
megatron-core's 1F1B schedule with it, or, with 0, all skip it and only finalize.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from megatron.core import parallel_state

from megatron_odc.mcore.data_parallel import ODCDataParallel
from megatron_odc.mcore.step import finalize_without_microbatches
from megatron_odc.transport.devices import all_reduce_on_group_device, collective_device

NO_COUNT = -1
"""The count of a rank without a planned loader (a middle pipeline stage, where Megatron-LM's GPT
builds no dataset, or ``--balance none``)."""

DEFAULT_LOSS_KEYS = ("lm loss",)
"""Keys of the zero report of a rank without microbatches, until a schedule has reported its own."""


def _count_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def pipeline_count(count: int) -> int:
    """The count every stage of this rank's pipeline runs: the one the stages with a planned loader
    were given (:data:`NO_COUNT` when none has one). Collective over the pipeline group with more than
    one stage; ``count`` itself with one.

    Megatron-LM builds a GPT dataset on the first and last stage only, so a middle stage takes their
    count; stages given different counts would deadlock the 1F1B schedule's sends and receives.

    Raises:
        ValueError: stages of one pipeline given different counts, naming the DP replica and each
            stage's count (a planning bug).
    """
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if stages <= 1:
        return count
    group = parallel_state.get_pipeline_model_parallel_group()
    counts = torch.zeros(stages, dtype=torch.int64, device=collective_device(group))
    counts[parallel_state.get_pipeline_model_parallel_rank()] = count
    all_reduce_on_group_device(counts, group=group)
    per_stage = counts.tolist()
    planned = {c for c in per_stage if c != NO_COUNT}
    if len(planned) > 1:
        listed = ", ".join(f"stage {s}: {c}" for s, c in enumerate(per_stage) if c != NO_COUNT)
        raise ValueError(
            f"DP replica {parallel_state.get_data_parallel_rank()}: the stages of its pipeline were "
            f"planned different numbers of microbatches ({listed}); every stage of one pipeline "
            "must run the same microbatches (the plan assigns them per DP replica)"
        )
    return planned.pop() if planned else NO_COUNT


class PlannedCountSchedule:
    """Wraps a megatron-core forward-backward function to run this rank's planned microbatch count.

    Applies to training calls (``forward_only=False``) on ``ODCDataParallel`` chunks; anything else is
    passed through. The count comes from ``data_iterator.iterable.next_num_microbatches()`` (or the
    iterator's own method) when offered, else the caller's ``num_microbatches``; with TP > 1 it is
    broadcast from the TP source rank (the only one with data), with PP > 1 agreed over the pipeline
    (:func:`pipeline_count`). During a rerun replay the last count is reused.

    Args:
        inner: the schedule from megatron-core's ``get_forward_backward_func``.
    """

    def __init__(self, inner: Callable) -> None:
        self.inner = inner
        self.loss_keys: tuple[str, ...] = DEFAULT_LOSS_KEYS
        self.last_num_microbatches: int | None = None

    def planned_count(self, data_iterator: Any, default: int) -> int:
        """This rank's microbatch count for the next step (a collective over TP when TP > 1 and over
        the pipeline when PP > 1)."""
        if getattr(data_iterator, "replaying", False) and self.last_num_microbatches is not None:
            return self.last_num_microbatches
        source = data_iterator
        if source is not None and not hasattr(source, "next_num_microbatches"):
            source = getattr(source, "iterable", None)
        count = NO_COUNT
        if source is not None and hasattr(source, "next_num_microbatches"):
            count = int(source.next_num_microbatches())
        if (
            parallel_state.model_parallel_is_initialized()
            and parallel_state.get_tensor_model_parallel_world_size() > 1
        ):
            buf = torch.tensor([count], dtype=torch.int64, device=_count_device())
            torch.distributed.broadcast(
                buf,
                parallel_state.get_tensor_model_parallel_src_rank(),
                group=parallel_state.get_tensor_model_parallel_group(),
            )
            count = int(buf.item())
        if parallel_state.model_parallel_is_initialized():
            count = pipeline_count(count)
        count = default if count == NO_COUNT else count
        self.last_num_microbatches = count
        return count

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, **kwargs):
        chunks = model if isinstance(model, list) else [model]
        if kwargs.get("forward_only", False) or not all(
            isinstance(c, ODCDataParallel) for c in chunks
        ):
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
            return losses
        finalize_without_microbatches(chunks)
        return [{key: torch.zeros(2, device=_count_device()) for key in self.loss_keys}]


def wrap_get_forward_backward_func(original: Callable) -> Callable:
    """``get_forward_backward_func`` whose schedule is a :class:`PlannedCountSchedule`."""

    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        return PlannedCountSchedule(original(*args, **kwargs))

    get_forward_backward_func.__megatron_odc_original__ = original
    return get_forward_backward_func
