"""Length-balanced microbatches of Megatron-LM's train split, planned per global batch.

With ``--balance`` other than ``none``, the train split gets a :class:`BalancedPretrainingLoader` whose
iterator exposes ``next_num_microbatches()`` (what ``schedule.py`` asks). Megatron-LM's samples are fixed
``[seq_length]`` packs, so every sample costs the same and LB-Mini gives every DP rank the same count;
the plan is still made per global batch by ``data.sampler.LengthBalancedSampler`` (one global batch
ahead, on a lookahead thread) and its count drives the schedule. With pipeline stages the plan is made
over DP replicas (``--pipeline-model-parallel-size`` stages each): the first and last stage of a replica
(where Megatron-LM's GPT builds the dataset) plan the same global batch for the same DP rank, so they
get the same microbatches.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_odc.data.lookahead import Lookahead
from megatron_odc.data.sampler import LengthBalancedSampler
from megatron_odc.mcore.config import ODC_ENGINE_BACKENDS
from megatron_odc.runner.odc_flags import MEGATRON_SAMPLER

logger = logging.getLogger(__name__)


class BalancedPretrainingLoader:
    """This DP rank's microbatches of every global batch of a Megatron-LM dataset, planned per batch.

    Global batch ``i`` is samples ``[i * global_batch_size, (i + 1) * global_batch_size)`` in dataset
    order (like Megatron-LM's ``single`` sampler); its plan is :meth:`LengthBalancedSampler.assignment`
    over the sample lengths (every sample is ``seq_length`` tokens: a Megatron-LM GPT sample is a fixed
    pack). Iterating yields an iterator whose ``next_num_microbatches()`` starts the next global batch
    and returns this rank's count; ``next()`` then returns its collated microbatches one by one.

    Args:
        dataset: a map-style dataset of sample dicts.
        consumed_samples: samples already trained on (a multiple of ``global_batch_size``).
        global_batch_size: samples per step over all DP ranks.
        dp_rank: this DP rank.
        dp_size: number of DP ranks.
        seq_length: tokens per sample.
        plan_kind: one of ``PLAN_KINDS``.
        pipeline_stages: pipeline stages per DP replica; with more than 1 the plan is made over the
            replicas for the 1F1B schedule (``make_plan(pipeline_stages=...)``) and every stage of a
            replica, each with its own loader, gets the same microbatches.
    """

    def __init__(
        self,
        dataset: Any,
        consumed_samples: int,
        *,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seq_length: int,
        plan_kind: str = "lb_mini",
        pipeline_stages: int = 1,
    ) -> None:
        if consumed_samples % global_batch_size:
            raise ValueError(
                f"consumed_samples {consumed_samples} is not a multiple of --global-batch-size "
                f"{global_batch_size}"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seq_length = seq_length
        self.plan_kind = plan_kind
        self.pipeline_stages = pipeline_stages
        self.num_global_batches = len(dataset) // global_batch_size
        self.start_index = consumed_samples // global_batch_size

    def rank_microbatches(self, index: int) -> tuple[tuple[int, ...], ...]:
        """This rank's microbatches (dataset indices) of global batch ``index``.

        The plan covers one global batch at a time, so the cost does not grow with the dataset.
        """
        sampler = LengthBalancedSampler(
            [self.seq_length] * self.global_batch_size,
            global_batch_size=self.global_batch_size,
            dp_size=self.dp_size,
            dp_rank=self.dp_rank,
            plan_kind=self.plan_kind,
            cap_tokens=self.seq_length,
            shuffle=False,
            pipeline_stages=self.pipeline_stages,
        )
        offset = index * self.global_batch_size
        microbatches = sampler.assignment(0, 0).microbatches
        return tuple(tuple(offset + i for i in mb) for mb in microbatches)

    def __iter__(self) -> _BalancedIterator:
        return _BalancedIterator(self, self.start_index)


class _BalancedIterator(Iterator):
    """Global batch after global batch; the plan of the next one is made while this one trains
    (``data/lookahead.py``)."""

    def __init__(self, loader: BalancedPretrainingLoader, index: int) -> None:
        self.loader = loader
        self.index = index
        self.pending: list[tuple[int, ...]] = []
        self.plans: Lookahead[int, tuple[tuple[int, ...], ...]] = Lookahead(
            loader.rank_microbatches, name="megatron_odc-plan"
        )

    def next_num_microbatches(self) -> int:
        if self.pending:
            raise RuntimeError(
                f"{len(self.pending)} microbatches of the last step were not consumed"
            )
        if self.index >= self.loader.num_global_batches:
            raise StopIteration
        following = self.index + 1 if self.index + 1 < self.loader.num_global_batches else None
        self.pending = list(self.plans.get(self.index, following).value)
        self.index += 1
        return len(self.pending)

    def __next__(self) -> Any:
        if not self.pending:
            self.next_num_microbatches()
            if not self.pending:
                raise RuntimeError("this rank has no microbatch in this step; ask the count first")
        sample_ids = self.pending.pop(0)
        return torch.utils.data.default_collate([self.loader.dataset[i] for i in sample_ids])


def wrap_build_pretraining_data_loader(original: Callable) -> Callable:
    """``build_pretraining_data_loader`` that gives the train split a :class:`BalancedPretrainingLoader`."""

    @functools.wraps(original)
    def build_pretraining_data_loader(dataset, consumed_samples):
        from megatron.core import mpu
        from megatron.core.datasets.utils import Split
        from megatron.training import get_args

        args = get_args()
        split = getattr(dataset, "index_split", getattr(dataset, "split", None))
        if (
            dataset is None
            or getattr(args, "dp_backend", None) not in ODC_ENGINE_BACKENDS
            or args.balance == MEGATRON_SAMPLER
            or split != Split.train
        ):
            return original(dataset, consumed_samples)
        logger.info(
            "train split: BalancedPretrainingLoader (--balance %s, %d samples)",
            args.balance,
            len(dataset),
        )
        return BalancedPretrainingLoader(
            dataset,
            consumed_samples,
            global_batch_size=args.global_batch_size,
            dp_rank=mpu.get_data_parallel_rank(),
            dp_size=mpu.get_data_parallel_world_size(),
            seq_length=args.seq_length,
            plan_kind=args.balance,
            pipeline_stages=args.pipeline_model_parallel_size,
        )

    build_pretraining_data_loader.__megatron_odc_original__ = original
    return build_pretraining_data_loader
