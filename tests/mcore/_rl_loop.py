"""Shared pieces of the external-loop tests (``test_rl_loop.py``, ``test_rl_loop_failure.py``): the
optimizer settings, the per-rank samples of a step and Megatron's per-microbatch mean loss."""

from __future__ import annotations

import functools

import torch


def optimizer_config(cfg):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=3e-3,
        weight_decay=0.1,
        clip_grad=0.05,
        params_dtype=cfg.params_dtype,
    )


def samples(cfg, step: int, dp_rank: int, count: int) -> list[dict[str, torch.Tensor]]:
    from tests._megatron import make_batch

    return [make_batch(cfg, 1, seed=1000 * step + 37 * dp_rank + i) for i in range(count)]


def mean_loss_forward_step(data_iterator, model):
    """Megatron's 3-tuple loss: without calculate_per_token_loss, a per-microbatch token mean."""
    from megatron_odc.mcore.step import per_token_loss

    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, functools.partial(per_token_loss, batch["loss_mask"])
