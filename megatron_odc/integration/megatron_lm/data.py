"""Length-balanced microbatches of Megatron-LM's train split, planned per global batch.

With ``--balance`` other than ``none``, the train split gets a :class:`BalancedPretrainingLoader` whose
iterator exposes ``next_num_microbatches()`` (what ``schedule.py`` asks). Global batch ``i`` is always
samples ``[i * global_batch_size, (i + 1) * global_batch_size)``, Megatron-LM's ``single`` sampler's,
so ``consumed_samples`` and resume keep their meaning; the plan is made per global batch by
``balance.plan.make_plan`` (one global batch ahead, on a lookahead thread) and its count
drives the schedule. With pipeline stages the plan is made over DP replicas
(``--pipeline-model-parallel-size`` stages each): the first and last stage of a replica (where
Megatron-LM's GPT builds the dataset) plan the same global batch for the same DP rank, so they get the
same microbatches.

Two kinds of Megatron-LM datasets:

- Fixed packs (``GPTDataset``, ``MockGPTDataset``): every sample is ``[seq_length]`` tokens and costs
  the same, so every plan gives every DP rank the same count; each microbatch is one sample.
- Records with real lengths (``--sft``'s ``SFTDataset``, any dataset whose samples carry
  ``cu_seqlens``): each record is Megatron-LM's ``[seq_length]`` pack of one JSONL line, padded at the
  end with the tokenizer's pad id. [Note: packed records] says how the loader reads each record's real
  length, plans with the model's cost ``a*s^2 + b*s`` (``balance/cost.py``, as the plugin's entry) and
  packs several records into one microbatch.

[Note: packed records]
A record's real length is ``seq_length`` less its trailing run of pad tokens (the pad id is the
dataset's tokenizer's, ``config.tokenizer.pad``); its own ``cu_seqlens`` (one segment per conversation,
the last one stretched over the padding by Megatron-LM) are cut at that length. The plan packs records
into microbatches of at most ``--max-tokens-per-microbatch`` real tokens (default ``seq_length``); a
microbatch is the records' tokens, labels, loss masks and position ids concatenated, with one
``cu_seqlens`` over every conversation, in the record format of the dataset (``[1, n + 1]`` int32; a
tag whose records carry ``seq_length + 1`` boundaries, right-padded with the total, gets the same
width). Records are never padded one by one. The microbatch itself is padded to ``seq_length`` (one
more segment, no loss) only where Megatron-LM needs a fixed shape: tensor parallelism (only TP rank 0
reads data; the others receive ``[micro_batch_size, seq_length]`` tensors) and pipeline parallelism
(stage-to-stage sends of ``[seq_length, micro_batch_size, hidden]``); otherwise it has exactly its real
tokens. A padded microbatch costs what a full one does: with pipeline stages the 1F1B model takes that
cost as every microbatch's least (``microbatch_floor``), so the plan packs rather than splits; with TP
alone the DP plan still balances the records' own costs (the padding is not in it). Every record's labels already end in a pad label (loss mask 0), so no token predicts across
records; with the block-diagonal attention of ``cu_seqlens`` (TransformerEngine's THD, or the CPU
runtime's shim 9) each record's loss is what it is alone, and per-token loss makes the global batch's
loss the same however its records are split.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_odc.balance.cost import CostModel
from megatron_odc.balance.plan import Plan, make_plan
from megatron_odc.data.lookahead import Lookahead
from megatron_odc.integration.megatron_lm.balance_cost import balance_cost
from megatron_odc.runner.odc_flags import MEGATRON_SAMPLER

logger = logging.getLogger(__name__)


class BalancedPretrainingLoader:
    """This DP rank's microbatches of every global batch of a Megatron-LM dataset, planned per batch.

    Global batch ``i`` is samples ``[i * global_batch_size, (i + 1) * global_batch_size)`` in dataset
    order (like Megatron-LM's ``single`` sampler); its plan is ``balance.plan.make_plan``
    over the sample lengths (``seq_length`` each for fixed packs; the real lengths of records, see
    [Note: packed records]). Iterating yields an iterator whose ``next_num_microbatches()`` starts the
    next global batch and returns this rank's count; ``next()`` then returns its microbatches one by
    one.

    Args:
        dataset: a map-style dataset of sample dicts.
        consumed_samples: samples already trained on (any number: a resume may change
            ``--global-batch-size``; the global batches then start there, as Megatron-LM's do).
        global_batch_size: samples per step over all DP ranks.
        dp_rank: this DP rank.
        dp_size: number of DP ranks.
        seq_length: tokens per sample.
        plan_kind: one of ``PLAN_KINDS``.
        pipeline_stages: pipeline stages per DP replica; with more than 1 the plan is made over the
            replicas for the 1F1B schedule (``make_plan(pipeline_stages=...)``) and every stage of a
            replica, each with its own loader, gets the same microbatches.
        cost_model: the per-sample cost of records (default: tokens).
        microbatch_overhead: fixed cost of a microbatch in the cost model's units, which LB-Mini
            weighs against the samples' ([Note: microbatch overhead] in ``balance/plan.py``).
        max_tokens: real tokens per microbatch of records (default ``seq_length``).
        fixed_shape: pad each microbatch of records to ``seq_length`` (tensor / pipeline parallelism).
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
        cost_model: CostModel | None = None,
        microbatch_overhead: float = 0.0,
        max_tokens: int | None = None,
        fixed_shape: bool = False,
    ) -> None:
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seq_length = seq_length
        self.plan_kind = plan_kind
        self.pipeline_stages = pipeline_stages
        self.cost_model = cost_model
        self.microbatch_overhead = microbatch_overhead
        self.max_tokens = seq_length if max_tokens is None else max_tokens
        self.fixed_shape = fixed_shape
        # Megatron-LM's sampler takes global batches from consumed_samples on, which a resume with
        # another --global-batch-size leaves at no multiple of it: batch i starts at
        # first_sample + i * global_batch_size.
        self.first_sample = consumed_samples % global_batch_size
        self.num_global_batches = (len(dataset) - self.first_sample) // global_batch_size
        self.start_index = consumed_samples // global_batch_size
        self.records = len(dataset) > 0 and "cu_seqlens" in read_sample(dataset, 0)
        self.pad_id = _pad_id(dataset) if self.records else None
        if self.records and fixed_shape and self.max_tokens != seq_length:
            raise ValueError(
                f"--max-tokens-per-microbatch {self.max_tokens} with tensor or pipeline parallelism: "
                f"Megatron-LM's microbatches are [1, seq_length] there, so it must be {seq_length}"
            )

    def _plan(self, lengths: list[int]) -> Plan:
        cost = (self.cost_model or CostModel.tokens()) if self.records else CostModel.tokens()
        # [Note: packed records]: a microbatch padded to seq_length costs what a full one does,
        # which the 1F1B model takes as each microbatch's least cost
        floor = (
            cost.sample_cost(self.seq_length)
            if self.records and self.fixed_shape and self.pipeline_stages > 1
            else 0.0
        )
        return make_plan(
            self.plan_kind,
            list(range(len(lengths))),
            lengths,
            self.dp_size,
            cap_tokens=self.max_tokens if self.records else self.seq_length,
            cost_model=cost,
            too_long="error",
            pipeline_stages=self.pipeline_stages,
            microbatch_overhead=self.microbatch_overhead if self.records else 0.0,
            microbatch_floor=floor,
        )

    def rank_microbatches(self, index: int) -> tuple[tuple[int, ...], ...]:
        """This rank's microbatches (dataset indices) of global batch ``index``.

        The plan covers one global batch at a time, so the cost does not grow with the dataset.
        """
        return self.plan_batch(index).microbatches

    def plan_batch(self, index: int) -> PlannedBatch:
        """Global batch ``index``: its plan, and this rank's microbatches (dataset indices), with the
        collated microbatches already built for records."""
        offset = self.first_sample + index * self.global_batch_size
        records: list[dict] = []
        if self.records:
            records = [read_sample(self.dataset, offset + i) for i in range(self.global_batch_size)]
            lengths = [record_length(r, self.pad_id) for r in records]
        else:
            lengths = [self.seq_length] * self.global_batch_size
        plan = self._plan(lengths)
        microbatches = tuple(
            tuple(offset + i for i in mb) for mb in plan.rank_microbatches(self.dp_rank)
        )
        batches = None
        if self.records:
            batches = tuple(
                pack_records(
                    [records[i - offset] for i in mb],
                    pad_id=self.pad_id,
                    pad_to=self.seq_length if self.fixed_shape else None,
                    cu_width=self.seq_length + 1
                    if _fixed_width(records[0], self.seq_length)
                    else None,
                )
                for mb in microbatches
            )
        return PlannedBatch(
            microbatches=microbatches,
            batches=batches,
            plan=plan,
        )

    def __iter__(self) -> _BalancedIterator:
        return _BalancedIterator(self, self.start_index)


@dataclasses.dataclass(frozen=True)
class PlannedBatch:
    """One global batch as this rank sees it.

    Attributes:
        microbatches: this rank's microbatches (dataset indices).
        batches: the collated microbatches of records (None for fixed packs: collated when used).
        plan: every rank's plan (counts, costs: the log line's figures).
    """

    microbatches: tuple[tuple[int, ...], ...]
    batches: tuple[dict[str, torch.Tensor], ...] | None
    plan: Plan


def read_sample(dataset: Any, index: int) -> dict:
    """``dataset[index]``, or one line naming the sample (and its record and file, for an
    ``SFTDataset``) and what Megatron-LM's dataset code raised on it: a record it cannot tokenize or
    truncate is the user's data, not a bug of the run.

    Raises:
        ValueError: the sample could not be built.
    """
    try:
        return dataset[index]
    except Exception as error:  # the user's data through Megatron-LM's code: any error
        where = ""
        indices, path = getattr(dataset, "indices", None), getattr(dataset, "dataset_path", None)
        if indices is not None and len(indices) and path:
            record = int(indices[index % len(indices)])
            where = f" (record {record}: line {record + 1} of {path} if it holds one per line)"
        hint = ""
        if isinstance(error, TypeError):
            from megatron_odc.integration.megatron_lm.version import installed_megatron_lm_release

            release = installed_megatron_lm_release()
            if release.sft_long_records_fail:
                hint = (
                    f"; {release.tag}'s SFTDataset fails so on a record longer than --seq-length: "
                    "raise --seq-length above the longest record, or shorten it"
                )
        raise ValueError(
            f"--balance: Megatron-LM's {type(dataset).__name__} could not build sample {index} of "
            f"the train split{where}: {type(error).__name__}: {error}{hint}"
        ) from error


def _pad_id(dataset: Any) -> int:
    """The pad id of a dataset of records (its tokenizer's)."""
    for candidate in (dataset, *getattr(dataset, "datasets", ())):
        tokenizer = getattr(getattr(candidate, "config", None), "tokenizer", None)
        pad = getattr(tokenizer, "pad", None)
        if isinstance(pad, int):
            return pad
    raise ValueError(
        f"--balance on {type(dataset).__name__}: its samples carry cu_seqlens but no tokenizer pad id "
        "was found (dataset.config.tokenizer.pad) to tell each record's real length; pass --balance "
        "none to keep Megatron-LM's sampler"
    )


def _fixed_width(record: dict, seq_length: int) -> bool:
    return int(record["cu_seqlens"].numel()) == seq_length + 1


def record_length(record: dict, pad_id: int) -> int:
    """Real tokens of a Megatron-LM record: its length less the trailing run of ``pad_id`` tokens
    that carry no loss (at least 1). Cutting only such a trailing run changes nothing: a causal
    model's earlier positions never see it, and it adds nothing to the loss. A pad id that is also
    the end-of-document token (a pretraining sample with ``--dataloader-inter-document-masking``
    ending in one) keeps the tokens whose label counts."""
    tokens = record["tokens"].reshape(-1)
    kept = tokens != pad_id
    if "loss_mask" in record:
        kept |= record["loss_mask"].reshape(-1) != 0
    last = torch.nonzero(kept)
    return max(int(last[-1]) + 1, 1) if last.numel() else 1


def pack_records(
    records: list[dict], *, pad_id: int, pad_to: int | None = None, cu_width: int | None = None
) -> dict[str, torch.Tensor]:
    """One microbatch of Megatron-LM records, each cut to its real length ([Note: packed records]).

    Args:
        records: the dataset's sample dicts (``tokens``, ``labels``, ``loss_mask``, ``position_ids``,
            ``cu_seqlens``), in order.
        pad_id: the tokenizer's pad id.
        pad_to: pad the microbatch to this many tokens with one more segment (no loss).
        cu_width: right-pad ``cu_seqlens`` with the total to this many entries (the record format of
            tags whose records carry a fixed width).

    Returns:
        ``tokens``, ``labels``, ``position_ids`` int64 ``[1, T]``, ``loss_mask`` float32 ``[1, T]``,
        ``cu_seqlens`` int32 ``[1, n + 1]``, ``max_seqlen`` int32 ``[1]``.
    """
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in _TOKEN_KEYS}
    bounds = [0]
    for record in records:
        length = record_length(record, pad_id)
        for key in _TOKEN_KEYS:
            parts[key].append(record[key].reshape(-1)[:length])
        cuts = [int(c) for c in record["cu_seqlens"].reshape(-1)[1:] if 0 < int(c) < length]
        bounds += [bounds[-1] + c for c in cuts] + [bounds[-1] + length]
    total = bounds[-1]
    if pad_to is not None and pad_to > total:
        extra = pad_to - total
        parts["tokens"].append(torch.full((extra,), pad_id, dtype=torch.int64))
        parts["labels"].append(torch.full((extra,), pad_id, dtype=torch.int64))
        parts["loss_mask"].append(torch.zeros(extra, dtype=torch.float32))
        parts["position_ids"].append(torch.arange(extra, dtype=torch.int64))
        bounds.append(pad_to)
    elif pad_to is not None and pad_to < total:
        raise ValueError(f"pad_to={pad_to} is shorter than the packed microbatch ({total} tokens)")
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max().reshape(1)
    if cu_width is not None and cu_width > cu_seqlens.numel():
        fill = torch.full((cu_width - cu_seqlens.numel(),), bounds[-1], dtype=torch.int32)
        cu_seqlens = torch.cat([cu_seqlens, fill])
    batch = {key: torch.cat(parts[key]).unsqueeze(0) for key in _TOKEN_KEYS}
    batch["loss_mask"] = batch["loss_mask"].to(torch.float32)
    batch["cu_seqlens"] = cu_seqlens.unsqueeze(0)
    batch["max_seqlen"] = max_seqlen.to(torch.int32)
    return batch


_TOKEN_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class _BalancedIterator(Iterator):
    """Global batch after global batch; the plan of the next one is made while this one trains
    (``data/lookahead.py``)."""

    def __init__(self, loader: BalancedPretrainingLoader, index: int) -> None:
        self.loader = loader
        self.index = index
        self.pending: list[tuple[int, ...]] = []
        self.pending_batches: list[dict[str, torch.Tensor]] = []
        self.plans: Lookahead[int, PlannedBatch] = Lookahead(
            loader.plan_batch, name="megatron_odc-plan"
        )
        self.last: PlannedBatch | None = None
        """The global batch handed out last (its plan and timing: the ODC log line)."""
        self.last_wait_s = 0.0
        """How long the last ``next_num_microbatches`` waited for the lookahead thread."""
        self.last_plan_s = 0.0
        """How long reading, planning and packing the last global batch took on that thread."""

    def next_num_microbatches(self) -> int:
        if self.pending:
            raise RuntimeError(
                f"{len(self.pending)} microbatches of the last step were not consumed"
            )
        if self.index >= self.loader.num_global_batches:
            raise StopIteration
        following = self.index + 1 if self.index + 1 < self.loader.num_global_batches else None
        prepared = self.plans.get(self.index, following)
        self.last = prepared.value
        self.last_wait_s, self.last_plan_s = prepared.wait_s, prepared.produce_s
        self.pending = list(self.last.microbatches)
        self.pending_batches = list(self.last.batches or ())
        self.index += 1
        return len(self.pending)

    def __next__(self) -> Any:
        if not self.pending:
            self.next_num_microbatches()
            if not self.pending:
                raise RuntimeError("this rank has no microbatch in this step; ask the count first")
        sample_ids = self.pending.pop(0)
        if self.pending_batches:
            return self.pending_batches.pop(0)
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
            or getattr(args, "dp_backend", None) is None
            or args.balance in (None, MEGATRON_SAMPLER)
            or split != Split.train
        ):
            return original(dataset, consumed_samples)
        fixed_shape = args.tensor_model_parallel_size > 1 or args.pipeline_model_parallel_size > 1
        loader = BalancedPretrainingLoader(
            dataset,
            consumed_samples,
            global_batch_size=args.global_batch_size,
            dp_rank=mpu.get_data_parallel_rank(),
            dp_size=mpu.get_data_parallel_world_size(),
            seq_length=args.seq_length,
            plan_kind=args.balance,
            pipeline_stages=args.pipeline_model_parallel_size,
            max_tokens=args.max_tokens_per_microbatch,
            fixed_shape=fixed_shape,
        )
        if loader.records:
            # only records have costs to plan (samples of --seq-length plan by tokens): the probes
            # of --balance-cost measured run here, up to the loader's own microbatch cap
            loader.cost_model, loader.microbatch_overhead = balance_cost(args, loader.max_tokens)
            logger.info(
                "train split: BalancedPretrainingLoader (--balance %s, %d records with real lengths, "
                "packed up to %d tokens per microbatch%s; cost a*s^2+b*s with a=%.3g, b=%.3g)",
                args.balance,
                len(dataset),
                loader.max_tokens,
                ", padded to --seq-length for tensor / pipeline parallelism" if fixed_shape else "",
                loader.cost_model.a,
                loader.cost_model.b,
            )
        else:
            logger.info(
                "train split: BalancedPretrainingLoader (--balance %s, %d samples of --seq-length)",
                args.balance,
                len(dataset),
            )
        return loader

    build_pretraining_data_loader.__megatron_odc_original__ = original
    return build_pretraining_data_loader
