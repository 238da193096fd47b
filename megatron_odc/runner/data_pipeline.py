"""The plugin's data path: each rank's packed microbatches of every minibatch, from flags to tensors.

:class:`DataPipeline` owns the tokenizer, the dataset (an SFT JSONL file, the built-in synthetic SFT set,
or Megatron indexed data through megatron-core's ``GPTDataset``), the length-balanced sampler and the
turning of this rank's planned microbatches into batch tensors on the training device.

[Note: one training iteration]
Every DP rank computes the same plan for the minibatch (no communication) and takes its own
microbatches; DP rank and size come from megatron's parallel state, so the TP ranks and pipeline stages
of one DP replica get the same microbatches (with pipeline stages the plan is made over the replicas
and chooses microbatches for the 1F1B schedule: [Note: pipelines] in ``balance/plan.py``). Each SFT microbatch is packed into one sequence (samples separated by a
block-diagonal causal mask, position ids restarting per sample, padded to a multiple of 8 and never
beyond ``--seq-length``). The loss function returns token *sums*; ``finalize_model_grads`` all-reduces
the token count over DP and divides the gradients by it, so the update is the exact global per-token
mean whatever the split.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_odc.balance import CostModel
from megatron_odc.data import (
    LengthBalancedSampler,
    Lookahead,
    MinibatchAssignment,
    PackedMicrobatch,
    SFTDataset,
    SFTSamples,
    load_microbatch,
    load_tokenizer,
    make_synthetic_sft,
    pack_microbatch,
    samples_without_loss,
)
from megatron_odc.data.indexed_sft import IndexedSFTDataset, is_indexed_sft
from megatron_odc.mcore.datasets import gpt_pretraining_dataset

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = os.path.join("runs", "cpu-default")
"""Where the built-in synthetic SFT set is written when neither --data-path nor --save is given."""
PAD_MULTIPLE = 8
"""Packed microbatches are padded to a multiple of this (times the TP size under sequence parallel)."""

Batch = dict[str, torch.Tensor]
"""One microbatch for the GPT forward: ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` and a
boolean ``attention_mask`` (``[1, 1, T, T]``, True = masked out)."""


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


class DataPipeline:
    """This rank's microbatches of every minibatch, built from the validated flags.

    Args:
        args: validated flags (``runner/arguments.py``).
        dp_rank: this rank in the DP group.
        dp_size: ranks in the DP group.
        device: where batches go.

    Attributes:
        tokenizer: the tokenizer (byte-level, or a local Hugging Face one).
        vocab_size: the model's vocabulary: the tokenizer's, padded.
        lengths: tokens of every sample of the dataset.
        sampler: the length-balanced sampler (its state is checkpointed).
    """

    def __init__(
        self, args: argparse.Namespace, *, dp_rank: int, dp_size: int, device: torch.device
    ) -> None:
        self.tokenizer = tokenizer_from_flags(args)
        self.vocab_size = padded_vocab_size(args, self.tokenizer.vocab_size)
        pad_multiple = PAD_MULTIPLE
        if args.sequence_parallel:
            pad_multiple = math.lcm(PAD_MULTIPLE, args.tensor_model_parallel_size)
        if args.sft:
            self.data_path = args.data_path[0] if args.data_path else synthetic_data_path(args)
            if is_indexed_sft(self.data_path):
                dataset = IndexedSFTDataset(
                    self.data_path, self.tokenizer, max_length=args.seq_length
                )
            else:
                dataset = SFTDataset(
                    self.data_path,
                    self.tokenizer,
                    max_length=args.seq_length,
                    skip_bad_lines=args.skip_bad_lines,
                )
            self.lengths: Sequence[int] = dataset.lengths
            check_truncated_responses(args, dataset, self.data_path)
            self._prepare_batches = functools.partial(
                pack_assignment,
                dataset=dataset,
                pad_id=self.tokenizer.pad_id,
                seq_length=args.seq_length,
                pad_multiple=pad_multiple,
            )
            self._finish_batch = functools.partial(packed_batch, device=device)
        else:
            self.data_path = " ".join(args.data_path)
            dataset = gpt_pretraining_dataset(args, self.tokenizer)
            self.lengths = [args.seq_length] * len(dataset)
            self._prepare_batches = functools.partial(pretraining_batches, dataset=dataset)
            self._finish_batch = functools.partial(batch_on_device, device=device)
        if len(self.lengths) < args.global_batch_size:
            raise ValueError(
                f"--global-batch-size {args.global_batch_size} is larger than the dataset "
                f"({len(self.lengths)} samples in {self.data_path})"
            )
        self.sampler = LengthBalancedSampler(
            self.lengths,
            global_batch_size=args.global_batch_size,
            dp_size=dp_size,
            dp_rank=dp_rank,
            seed=args.seed,
            plan_kind=args.balance,
            cap_tokens=args.max_tokens_per_microbatch,
            cost_model=CostModel.from_model_config(
                num_layers=args.num_layers,
                hidden_size=args.hidden_size,
                ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
                num_attention_heads=args.num_attention_heads,
                vocab_size=self.vocab_size,
                gated_mlp=args.swiglu,
            ),
            too_long="truncate",
            shuffle=args.sft,  # GPTDataset shuffles its samples itself
            drop_last=True,
            pipeline_stages=args.pipeline_model_parallel_size,
        )
        logger.info(
            "data (%s): %s, %d samples, %d tokens (longest %d), vocab %d (tokenizer %d)",
            "sft" if args.sft else "pretraining",
            self.data_path,
            len(self.lengths),
            sum(self.lengths),
            max(self.lengths),
            self.vocab_size,
            self.tokenizer.vocab_size,
        )

        self._lookahead: Lookahead[tuple[int, int], tuple[MinibatchAssignment, list]] = Lookahead(
            self._prepare, name="megatron_odc-plan"
        )

    def _prepare(self, position: tuple[int, int]) -> tuple[MinibatchAssignment, list]:
        """Plans minibatch ``position`` (epoch, index) and packs this rank's share, on the host."""
        assignment = self.sampler.assignment(*position)
        return assignment, self._prepare_batches(assignment)

    def next_minibatch(self) -> Minibatch:
        """This rank's next minibatch, planned ahead (the next epoch begins when one is used up).

        The plan and the packed microbatches were made on the lookahead thread while the previous
        minibatch trained (``data/lookahead.py``); the batches go to the device here.
        """
        position = self.sampler.current()
        prepared = self._lookahead.get(position, self.sampler.following(*position))
        self.sampler.advance_past(*position)
        assignment, host_batches = prepared.value
        return Minibatch(
            assignment=assignment,
            batches=[self._finish_batch(batch) for batch in host_batches],
            plan_wait_s=prepared.wait_s,
            plan_s=prepared.produce_s,
        )

    def close(self) -> None:
        """Stops the lookahead thread."""
        self._lookahead.close()


@dataclasses.dataclass(frozen=True)
class Minibatch:
    """This rank's share of one minibatch, ready to train on.

    Attributes:
        assignment: the plan and this rank's microbatches.
        batches: one :data:`Batch` per microbatch, on the training device.
        plan_wait_s: seconds the training loop waited for the plan and packing (~0 when they were
            made ahead; see [Note: lookahead waits] in ``data/lookahead.py``).
        plan_s: seconds planning and packing took on the lookahead thread.
    """

    assignment: MinibatchAssignment
    batches: list[Batch]
    plan_wait_s: float
    plan_s: float


def tokenizer_from_flags(args: argparse.Namespace) -> Any:
    """The tokenizer of ``--tokenizer-type`` / ``--tokenizer-model``.

    Raises:
        ValueError: ``--tokenizer-model`` is not a directory or holds no loadable tokenizer (the
            message names the flag).
    """
    if args.tokenizer_type == "ByteTokenizer":
        return load_tokenizer("byte")
    path = args.tokenizer_model
    if not os.path.isdir(path):
        raise ValueError(
            f"--tokenizer-model {path!r} is not a directory: pass a local Hugging Face tokenizer "
            "directory (nothing is downloaded), or omit it for the byte-level tokenizer"
        )
    try:
        return load_tokenizer(path)
    except ValueError as exc:
        raise ValueError(f"--tokenizer-model {path!r}: {exc}") from None


def check_truncated_responses(args: argparse.Namespace, dataset: SFTSamples, path: str) -> None:
    """Refuses SFT data whose every sample loses all its response tokens to truncation; warns (rank 0)
    when some do.

    Every rank computes the same answer from the dataset's cached lengths and loss-token counts (only
    samples cut to the cap are re-read, in their first tokens), so every rank raises the same error.

    Raises:
        ValueError: every sample carries no loss token once cut to ``--max-tokens-per-microbatch``
            (``--seq-length`` unless set lower); the message names the file and what to change.
    """
    cap = args.max_tokens_per_microbatch
    lost = samples_without_loss(dataset, cap)
    if not lost:
        return
    cut = f"--seq-length {args.seq_length}"
    change = "raise --seq-length"
    if cap < args.seq_length:
        cut = f"--max-tokens-per-microbatch {cap} (--seq-length {args.seq_length})"
        change = "raise --max-tokens-per-microbatch (and --seq-length if needed)"
    line_numbers = getattr(dataset, "line_numbers", None)
    first = f"line {line_numbers[lost[0]]}" if line_numbers else f"sample {lost[0]}"
    if len(lost) == len(dataset):
        raise ValueError(
            f"--data-path {path}: all {len(lost)} samples lose every response token to truncation "
            f"at {cut}: each keeps only its first {cap} tokens, all of them prompt (the first: "
            f"{first}), so no iteration would have a loss; {change} or shorten the prompts"
        )
    if dist.get_rank() == 0:
        logger.warning(
            "--data-path %s: %d of %d samples lose every response token to truncation at %s "
            "(the first: %s); they are trained on with no loss. %s or shorten their prompts to "
            "learn from them",
            path,
            len(lost),
            len(dataset),
            cut,
            first,
            change[0].upper() + change[1:],
        )


def padded_vocab_size(args: argparse.Namespace, tokenizer_vocab_size: int) -> int:
    if args.vocab_size is not None:
        if args.vocab_size < tokenizer_vocab_size:
            raise ValueError(
                f"--vocab-size {args.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({tokenizer_vocab_size} ids)"
            )
        return args.vocab_size
    # Megatron-LM pads to a multiple of divisible_by * TP, so the padded size (and the checkpoint's
    # embedding shape) changes with TP; lcm keeps it the same for every TP size dividing divisible_by.
    multiple = math.lcm(args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    return round_up(tokenizer_vocab_size, multiple)


def synthetic_data_path(args: argparse.Namespace) -> str:
    """Writes the built-in synthetic SFT set once (local rank 0 of each node) and returns its path."""
    cache_dir = os.path.join(args.save, "data") if args.save else DEFAULT_CACHE_DIR
    name = f"synthetic_sft_n{args.synthetic_num_samples}_seed{args.seed}_len{args.seq_length}.jsonl"
    path = os.path.join(cache_dir, name)
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if local_rank == 0 and not os.path.isfile(path):
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        make_synthetic_sft(
            tmp,
            args.synthetic_num_samples,
            seed=args.seed,
            max_tokens=args.seq_length,
            min_tokens=min(8, args.seq_length),
        )
        os.replace(tmp, path)
        logger.info("wrote the synthetic SFT set %s", path)
    dist.barrier()
    return path


def pack_assignment(
    assignment: MinibatchAssignment,
    dataset: SFTSamples,
    *,
    pad_id: int,
    seq_length: int,
    pad_multiple: int,
) -> list[PackedMicrobatch]:
    """Packs each of this rank's microbatches into one ``[1, T]`` host sequence.

    ``T`` is the packed length rounded up to ``pad_multiple`` and never beyond ``seq_length``; an empty
    microbatch (``lb_micro`` may plan one so that lockstep counts match) becomes ``pad_multiple`` padding
    tokens with no loss. :func:`packed_batch` turns each into the GPT forward's batch.
    """
    packed = []
    for sample_ids in assignment.microbatches:
        samples = load_microbatch(dataset, sample_ids, assignment.plan.lengths)
        num_tokens = sum(len(s) for s in samples)
        if num_tokens > seq_length:
            raise ValueError(
                f"microbatch {sample_ids} holds {num_tokens} tokens, more than --seq-length "
                f"{seq_length}; lower --max-tokens-per-microbatch"
            )
        pad_to = min(round_up(max(num_tokens, 1), pad_multiple), seq_length)
        packed.append(pack_microbatch(samples, pad_to=pad_to, pad_id=pad_id))
    return packed


def packed_batch(packed: PackedMicrobatch, *, device: torch.device) -> Batch:
    """The GPT forward's batch of one packed microbatch on ``device``, with its block-diagonal causal
    ``attention_mask`` (bool ``[1, 1, T, T]``, True = masked out; built here, not ahead, because it is
    ``T**2`` bytes)."""
    return {
        "tokens": packed.tokens.to(device),
        "labels": packed.labels.to(device),
        "loss_mask": packed.loss_mask.to(device),
        "position_ids": packed.position_ids.to(device),
        "attention_mask": packed.attention_mask().to(device),
    }


def pretraining_batches(assignment: MinibatchAssignment, *, dataset: Any) -> list[Batch]:
    """One GPTDataset sample (``--seq-length`` tokens, causal mask) per microbatch, on the host.

    An empty microbatch (``lb_micro`` plans one when a minibatch has fewer samples than lockstep
    slots) runs the minibatch's first sample with no loss.
    """
    batches = []
    for sample_ids in assignment.microbatches:
        if len(sample_ids) > 1:
            raise ValueError(
                f"pretraining microbatch {sample_ids} holds {len(sample_ids)} samples; each "
                "microbatch must be exactly one --seq-length sample"
            )
        sample = dict(dataset[sample_ids[0] if sample_ids else assignment.global_sample_ids[0]])
        if not sample_ids:
            sample["loss_mask"] = torch.zeros_like(sample["loss_mask"])
        batches.append(
            {
                "tokens": sample["tokens"].unsqueeze(0),
                "labels": sample["labels"].unsqueeze(0),
                "loss_mask": sample["loss_mask"].unsqueeze(0),
                "position_ids": sample["position_ids"].unsqueeze(0),
                "attention_mask": sample["attention_mask"].view(
                    1, 1, *sample["attention_mask"].shape[-2:]
                ),
            }
        )
    return batches


def batch_on_device(batch: Batch, *, device: torch.device) -> Batch:
    """``batch`` with every tensor on ``device``."""
    return {name: tensor.to(device) for name, tensor in batch.items()}
