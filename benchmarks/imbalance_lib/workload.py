"""What the ranks train on: scaled profile lengths, minibatches, packed microbatches, the per-token loss."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from megatron_odc.balance.profiles import load_profile_lengths


def scaled_lengths(profile: str, length_scale: int) -> list[int]:
    """The profile's lengths divided by ``length_scale`` (at least 2 tokens)."""
    return [max(2, round(n / length_scale)) for n in load_profile_lengths(profile)]


def draw_minibatches(
    pool: Sequence[int], global_batch: int, count: int, seed: int
) -> list[list[int]]:
    """``count`` minibatches of ``global_batch`` lengths drawn without replacement (seeded)."""
    rng = random.Random(seed)
    order = rng.sample(range(len(pool)), global_batch * count)
    return [
        [pool[i] for i in order[k * global_batch : (k + 1) * global_batch]] for k in range(count)
    ]


def _sample(sample_id: int, length: int, vocab_size: int):
    """A random-token SFT sample: the first third is prompt (no loss), the rest response."""
    from megatron_odc.data.sft import SFTSample

    gen = torch.Generator().manual_seed(1_000_003 * sample_id + length)
    tokens = torch.randint(0, vocab_size, (length,), generator=gen)
    loss_mask = torch.zeros(length, dtype=torch.bool)
    loss_mask[length // 3 :] = True
    return SFTSample(tokens=tokens, loss_mask=loss_mask)


def build_microbatches(
    plan_microbatches: Sequence[Sequence[int]], lengths: dict[int, int], vocab_size: int
) -> list[dict[str, torch.Tensor]]:
    """Packs one rank's planned microbatches (an empty one becomes a 1-token pad with no loss)."""
    from megatron_odc.data.packing import pack_microbatch

    out = []
    for mb in plan_microbatches:
        samples = [_sample(sid, lengths[sid], vocab_size) for sid in mb]
        packed = pack_microbatch(samples, pad_to=None if samples else 1, pad_id=0)
        out.append(
            {
                "tokens": packed.tokens,
                "labels": packed.labels,
                "loss_mask": packed.loss_mask,
                "position_ids": packed.position_ids,
                "attention_mask": packed.attention_mask(),
                "num_tokens": sum(len(s) for s in samples),
            }
        )
    return out


def loss_tokens(
    plan_microbatches: Sequence[Sequence[int]], lengths: dict[int, int], vocab_size: int
) -> int:
    """Loss tokens of planned microbatches, packed as :func:`build_microbatches` packs them."""
    from megatron_odc.data.packing import pack_microbatch

    total = 0
    for mb in plan_microbatches:
        samples = [_sample(sid, lengths[sid], vocab_size) for sid in mb]
        if samples:
            total += int(pack_microbatch(samples, pad_to=None, pad_id=0).loss_mask.sum())
    return total


def global_loss_tokens(plan: Any, world_size: int, vocab_size: int) -> int:
    """Loss tokens of the whole global minibatch of ``plan`` (every rank computes the same number)."""
    lengths = dict(plan.lengths)
    return sum(
        loss_tokens(plan.rank_microbatches(r), lengths, vocab_size) for r in range(world_size)
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}
