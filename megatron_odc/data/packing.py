"""Packing one microbatch of SFT samples into a single sequence, and exact global loss weights.

Owns :class:`PackedMicrobatch` / :func:`pack_microbatch` (tokens, next-token labels, label-aligned loss
mask, per-sample position ids, ``cu_seqlens`` for THD attention and the equivalent block-diagonal
causal mask), :func:`load_microbatch` (samples of a plan, truncated to the planned lengths),
:func:`loss_weights` and :func:`global_loss_token_count`. It builds no ``PackedSeqParams``: the
Megatron-facing code does that from ``cu_seqlens`` and ``max_seqlen``. Nothing here imports megatron.

[Note: global per-token loss]
The loss of a minibatch is the mean over every loss-carrying token of every sample of the minibatch,
on all DP ranks. With LB-Mini ranks hold different numbers of samples, tokens and microbatches, so
normalising per microbatch or per rank (as verl and AReaL once did) changes the gradient with the
split. Instead every token's loss is weighted by ``1 / G``, where ``G`` is the minibatch's global
count of loss tokens; ``G`` is computed by every rank from the plan and the dataset's cached
per-sample counts (:func:`global_loss_token_count`), with no communication. Summing
``weight * token_loss`` over the microbatches of a rank and then over ranks (the gradient sum of the
DP reduction, *not* a mean) gives exactly the global per-token mean, whatever the split. With
Megatron's ``calculate_per_token_loss`` the same contract holds with weight 1 and ``G`` passed to
``finalize_model_grads``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from megatron_odc.data.sft import SFTSample, SFTSamples

if TYPE_CHECKING:
    from megatron_odc.data.sampler import MinibatchAssignment


@dataclasses.dataclass(frozen=True)
class PackedMicrobatch:
    """One microbatch packed into a single row of ``T`` tokens (THD layout with batch 1).

    Attributes:
        tokens: int64 ``[1, T]``.
        labels: int64 ``[1, T]``; ``labels[0, t]`` is the next token of the same sample, or
            ``pad_id`` at the last token of a sample and in the padding (their loss weight is 0).
        loss_mask: float32 ``[1, T]``, aligned with ``labels``: 1 where predicting ``labels[0, t]``
            carries loss.
        position_ids: int64 ``[1, T]``, restarting at 0 for every segment.
        cu_seqlens: int32 ``[num_segments + 1]`` segment boundaries (``cu_seqlens[-1] == T``).
        max_seqlen: longest segment, in tokens.
        num_samples: samples packed; the padding, when present, is one more segment at the end.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_samples: int

    @property
    def num_tokens(self) -> int:
        """Packed length ``T`` (with padding)."""
        return int(self.tokens.shape[1])

    @property
    def num_segments(self) -> int:
        """Segments in ``cu_seqlens``: the samples plus the padding segment if any."""
        return int(self.cu_seqlens.numel()) - 1

    def segment_ids(self) -> torch.Tensor:
        """Returns int64 ``[T]``: the segment index of every token."""
        seqlens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int64)
        return torch.repeat_interleave(torch.arange(self.num_segments), seqlens)

    def attention_mask(self) -> torch.Tensor:
        """Returns the block-diagonal causal mask, bool ``[1, 1, T, T]``, True = masked out.

        This is Megatron's convention for ``attention_mask``: query ``i`` may attend to key ``j``
        only when both lie in the same segment and ``j <= i``. It costs ``T**2`` bytes; prefer
        ``cu_seqlens`` where the attention backend supports THD.
        """
        return block_causal_mask(self.cu_seqlens)


def block_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask of the segments ``cu_seqlens`` bounds, bool ``[1, 1, T, T]``
    (``T = cu_seqlens[-1]``), True = masked out: query ``i`` sees key ``j`` only when both lie in the
    same segment and ``j <= i``. Empty segments (repeated boundaries) are allowed."""
    bounds = cu_seqlens.reshape(-1).to(torch.int64)
    seqlens = bounds[1:] - bounds[:-1]
    seg = torch.repeat_interleave(torch.arange(seqlens.numel(), device=bounds.device), seqlens)
    num_tokens = seg.numel()
    same_segment = seg[:, None] == seg[None, :]
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=bounds.device).tril()
    return (~(same_segment & causal)).view(1, 1, num_tokens, num_tokens)


def pack_microbatch(
    samples: Sequence[SFTSample], *, pad_to: int | None = None, pad_id: int
) -> PackedMicrobatch:
    """Concatenates samples into one sequence with per-sample boundaries.

    Args:
        samples: the microbatch, in order; each at least one token.
        pad_to: when set, pad to exactly this many tokens with one extra segment of ``pad_id`` that
            carries no loss.
        pad_id: id of padding tokens and of the labels that carry no loss.

    Returns:
        The :class:`PackedMicrobatch`.

    Raises:
        ValueError: no samples and no ``pad_to``, an empty sample, or ``pad_to`` below the packed
            length.
    """
    if not samples and pad_to is None:
        raise ValueError("cannot pack an empty microbatch without pad_to")
    tokens, labels, loss_mask, positions, seqlens = [], [], [], [], []
    for i, sample in enumerate(samples):
        num = len(sample)
        if num < 1:
            raise ValueError(f"sample {i} of the microbatch is empty")
        tok = sample.tokens.to(torch.int64)
        lab = torch.full((num,), pad_id, dtype=torch.int64)
        lab[:-1] = tok[1:]
        mask = torch.zeros(num, dtype=torch.float32)
        mask[:-1] = sample.loss_mask[1:].to(torch.float32)
        tokens.append(tok)
        labels.append(lab)
        loss_mask.append(mask)
        positions.append(torch.arange(num, dtype=torch.int64))
        seqlens.append(num)
    total = sum(seqlens)
    if pad_to is not None:
        if pad_to < total:
            raise ValueError(
                f"pad_to={pad_to} is shorter than the packed microbatch ({total} tokens)"
            )
        if pad_to > total:
            num_pad = pad_to - total
            tokens.append(torch.full((num_pad,), pad_id, dtype=torch.int64))
            labels.append(torch.full((num_pad,), pad_id, dtype=torch.int64))
            loss_mask.append(torch.zeros(num_pad, dtype=torch.float32))
            positions.append(torch.arange(num_pad, dtype=torch.int64))
            seqlens.append(num_pad)
    cu_seqlens = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int64), 0).to(torch.int32)
    return PackedMicrobatch(
        tokens=torch.cat(tokens).unsqueeze(0),
        labels=torch.cat(labels).unsqueeze(0),
        loss_mask=torch.cat(loss_mask).unsqueeze(0),
        position_ids=torch.cat(positions).unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(seqlens),
        num_samples=len(samples),
    )


def load_microbatch(
    dataset: SFTSamples,
    sample_ids: Sequence[int],
    planned_lengths: Mapping[int, int] | None = None,
) -> list[SFTSample]:
    """Returns the samples of one microbatch, each cut to its planned length.

    Args:
        dataset: the dataset the plan indexes.
        sample_ids: dataset indices of the microbatch.
        planned_lengths: ``Plan.lengths`` (sample id -> planned tokens), or None for full samples.
    """
    samples = [dataset[i] for i in sample_ids]
    if planned_lengths is None:
        return samples
    return [s.truncate(planned_lengths[i]) for s, i in zip(samples, sample_ids, strict=True)]


def loss_weights(loss_mask: torch.Tensor, global_num_loss_tokens: int) -> torch.Tensor:
    """Per-token weights that turn summed token losses into the global per-token mean.

    See [Note: global per-token loss]. The weights are ``loss_mask / global_num_loss_tokens``
    (float32; all zero when the minibatch has no loss token).

    Args:
        loss_mask: label-aligned mask of a packed microbatch (any shape).
        global_num_loss_tokens: loss tokens of the whole minibatch over all ranks.
    """
    if global_num_loss_tokens < 0:
        raise ValueError(f"global_num_loss_tokens must be >= 0, got {global_num_loss_tokens}")
    mask = loss_mask.to(torch.float32)
    if global_num_loss_tokens == 0:
        return torch.zeros_like(mask)
    return mask / float(global_num_loss_tokens)


def global_loss_token_count(assignment: MinibatchAssignment, dataset: SFTSamples) -> int:
    """Counts the loss tokens of a whole minibatch, from the plan alone (no communication).

    Args:
        assignment: a :class:`megatron_odc.data.sampler.MinibatchAssignment`; every sample of
            ``assignment.global_sample_ids`` is counted at its planned (possibly truncated) length.
        dataset: the dataset the sampler indexes (its per-sample counts are cached).

    Returns:
        The global number ``G`` of loss-carrying positions (see [Note: global per-token loss]).
    """
    planned = assignment.plan.lengths
    return sum(dataset.loss_token_count(i, planned.get(i)) for i in assignment.global_sample_ids)


def samples_without_loss(dataset: SFTSamples, cap_tokens: int) -> list[int]:
    """The samples that carry no loss token once cut to their first ``cap_tokens`` tokens.

    A sample keeps its loss when at least one response token (or end-of-turn token) falls inside its
    first ``cap_tokens`` tokens. Only samples that reach the cap or already have no loss token are
    looked at (the others keep their cached count), so a memory-mapped dataset is read only in the
    first ``cap_tokens`` tokens of its longest samples' loss masks.

    Args:
        dataset: the dataset the sampler indexes (its ``lengths`` already cut to its ``max_length``).
        cap_tokens: the sampler's cut (``--max-tokens-per-microbatch``, at most ``--seq-length``).

    Returns:
        Their indices, ascending.
    """
    lengths = np.asarray(dataset.lengths)
    counts = np.asarray(dataset.num_loss_tokens)
    candidates = np.flatnonzero((lengths >= cap_tokens) | (counts == 0))
    return [
        int(i)
        for i in candidates
        if dataset.loss_token_count(int(i), min(int(lengths[i]), cap_tokens)) == 0
    ]
