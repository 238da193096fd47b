"""One training step on this rank's own number of microbatches (possibly zero), Megatron-style.

``train_step`` runs megatron-core's forward-backward schedule over the rank's microbatches with the
per-token loss contract (``config.calculate_per_token_loss``): each microbatch's loss is a token *sum*,
``finalize_model_grads`` all-reduces the token count over DP and scales the gradients by its inverse, so
ranks may run different numbers of microbatches and the result equals one process running them all. A rank
with zero microbatches skips the schedule and calls ``finalize_model_grads`` itself with a zero count
(:func:`finalize_without_microbatches`, also what the Megatron-LM integration runs). With pipeline
stages the schedule is megatron-core's 1F1B, every stage of a DP replica runs the replica's microbatches
(checked first: :func:`~megatron_odc.mcore.pipeline.agree_pipeline_count`) and a replica with none
skips the schedule on every stage. Works for every backend: ODC, FSDP, megatron-core DDP / distopt.
:func:`forward_backward` is that schedule call on its own (``train_step`` and external training loops,
``rl/loop.py``, run it in place of megatron-core's ``get_forward_backward_func()``).
:func:`per_token_loss` and :func:`gpt_forward_step` are the loss and forward step of a GPT on packed
batches.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from megatron_odc.mcore.pipeline import agree_pipeline_count
from megatron_odc.transport.devices import collective_device, every_rank_int


def finalize_without_microbatches(model_chunks: Sequence[torch.nn.Module]) -> None:
    """What a rank with zero microbatches runs in place of the schedule (which cannot run zero).

    ``finalize_model_grads`` with a token count of 0: the rank joins the DP fence and the global token
    all-reduce, and contributes no gradient.
    """
    config = get_model_config(model_chunks[0])
    finalize = config.finalize_model_grads_func or finalize_model_grads
    # megatron-core all-reduces the token count over DP (on the group's device: CUDA for NCCL) only
    # under the per-token contract; without it the schedule passes None, and so must this rank.
    num_tokens = (
        torch.zeros([], dtype=torch.int, device=collective_device())
        if config.calculate_per_token_loss
        else None
    )
    finalize(list(model_chunks), num_tokens)


def agree_tensor_parallel_count(count: int) -> None:
    """Check that every TP rank of this rank's group passed the same ``count`` (collective over the TP
    group with more than one rank; nothing with one).

    Raises:
        ValueError: naming the DP replica, the pipeline stage and each TP rank's count.
    """
    group_size = parallel_state.get_tensor_model_parallel_world_size()
    if group_size <= 1:
        return
    counts = every_rank_int(count, parallel_state.get_tensor_model_parallel_group())
    if len(set(counts)) > 1:
        listed = ", ".join(f"TP rank {r}: {c}" for r, c in enumerate(counts))
        raise ValueError(
            f"DP replica {parallel_state.get_data_parallel_rank()}, pipeline stage "
            f"{parallel_state.get_pipeline_model_parallel_rank()}: its tensor-parallel ranks were "
            f"given different numbers of microbatches ({listed}); the TP ranks of one replica split "
            "the same microbatches, so pass every one of them the replica's count"
        )


def forward_backward(
    *, forward_step_func: Callable, data_iterator: Any, model: Any, num_microbatches: int, **kwargs
) -> list:
    """megatron-core's forward-backward schedule on this rank's own ``num_microbatches``, 0 included.

    Takes the keyword arguments of the function ``get_forward_backward_func()`` returns. Every rank
    of one DP replica (its TP ranks and pipeline stages) must pass the same count, checked first for
    training and forward-only calls alike (a small all-reduce over each of those groups with more than
    one rank: :func:`agree_tensor_parallel_count`,
    :func:`~megatron_odc.mcore.pipeline.agree_pipeline_count`): a difference would leave a stage
    waiting for activations, or a TP collective mismatched, without a limit. A training call with 0
    skips the schedule (which cannot run zero) and runs :func:`finalize_without_microbatches`; it
    returns no loss reports. Forward-only calls (log-probs, a reference model) are passed through
    unchanged; with 0 they return no outputs.
    """
    try:
        count = int(num_microbatches)
    except (TypeError, ValueError):  # None, "two"
        count = None
    if isinstance(num_microbatches, bool) or count is None or count != num_microbatches:
        raise ValueError(f"num_microbatches must be an integer >= 0, got {num_microbatches!r}")
    if count < 0:
        raise ValueError(f"num_microbatches must be >= 0, got {num_microbatches}")
    agree_tensor_parallel_count(count)
    agree_pipeline_count(count)
    if not kwargs.get("forward_only", False):
        if count == 0:
            finalize_without_microbatches(model if isinstance(model, list) else [model])
            return []
    elif count == 0:
        return []
    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=count,
        **kwargs,
    )


def per_token_loss(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's 3-tuple loss: (token-loss sum, loss-token count, report ``[sum, count]``)."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def gpt_forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    """Megatron ``forward_step_func``: GPT forward on one batch dict with per-token losses.

    The batch holds ``tokens``, ``position_ids``, ``attention_mask``, ``labels`` and ``loss_mask``.
    """
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, functools.partial(per_token_loss, batch["loss_mask"])


def train_step(
    model: torch.nn.Module,
    optimizer: Any,
    forward_step_func: Callable,
    microbatches: Sequence[Any],
    *,
    seq_length: int,
    micro_batch_size: int = 1,
    phase: Callable[[str], contextlib.AbstractContextManager] = lambda name: (
        contextlib.nullcontext()
    ),
) -> dict[str, Any]:
    """Zero the grad buffers, run this rank's microbatches, finalize, and step the optimizer.

    Args:
        model: the DP-wrapped model chunk.
        optimizer: a Megatron optimizer (``step()`` returns ``(success, grad_norm, num_zeros)``).
        forward_step_func: Megatron's ``forward_step_func(data_iterator, model)``.
        microbatches: this rank's microbatches, consumed in order through an iterator (with pipeline
            stages: its DP replica's, the same on every stage).
        seq_length: sequence length passed to the schedule.
        micro_batch_size: micro batch size passed to the schedule.
        phase: called with ``"forward-backward"`` and ``"optimizer step"``; the block of each runs
            inside the context manager it returns (the runner records the phase for its watchdog).

    Returns:
        ``losses`` (the schedule's per-microbatch reports), ``update_successful``, ``grad_norm`` and
        ``num_zeros_in_grad``.
    """
    config = get_model_config(model)
    if not config.calculate_per_token_loss:
        raise ValueError(
            "uneven microbatch counts need --calculate-per-token-loss "
            "(TransformerConfig.calculate_per_token_loss=True)"
        )
    model.zero_grad_buffer()
    optimizer.zero_grad()
    with phase("forward-backward"):
        losses = forward_backward(
            forward_step_func=forward_step_func,
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=len(microbatches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
    with phase("optimizer step"):
        update_successful, grad_norm, num_zeros = optimizer.step()
    return {
        "losses": losses,
        "update_successful": update_successful,
        "grad_norm": grad_norm,
        "num_zeros_in_grad": num_zeros,
    }
