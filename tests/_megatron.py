"""megatron-core test helpers for rank bodies: setup/teardown, batches, TP weight copies, a DDP train step.

Use inside ``tests/_dist.py::run_ranks`` bodies (a gloo process group is already up):

    init_megatron(tp=2, seed=1)
    model = build_gpt_model(cfg, seed=1)
    ddp_model, optimizer = build_megatron_ddp(model, use_distributed_optimizer=True)
    report = train_step(ddp_model, optimizer, batches)   # this rank's microbatches, per-token loss
    teardown_megatron()

Parity checks against a TP=1 reference: build the TP=1 model in the same rank body (``init_megatron(1,
...)``, keep its ``state_dict()``, ``teardown_megatron()``, then ``init_megatron(tp, ...)``) and copy its
weights with :func:`full_state_dict_to_tp`; :func:`gather_tp_tensor` is the inverse split for comparing
gradients or parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_odc.integration.cpu import (
    CpuPatches,
    active_cpu_patches,
    apply_cpu_patches,
)
from megatron_odc.mcore.cpu_optimizers import cuda_type_names
from megatron_odc.mcore.model import GPTConfig
from megatron_odc.mcore.step import per_token_loss

SMALL_GPT = {
    "num_layers": 2,
    "hidden_size": 40,
    "num_attention_heads": 4,
    "ffn_hidden_size": 72,
    "vocab_size": 96,
    "seq_length": 12,
}
"""``GPTConfig`` fields of the small fp32 GPT the backend tests share: uneven widths, several buckets."""


def init_megatron(tp: int, seed: int, *, pp: int = 1) -> CpuPatches:
    """Apply the CPU patches, initialise model parallel with TP=``tp`` (and PP=``pp``) and seed the
    RNG trackers."""
    patches = apply_cpu_patches()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    model_parallel_cuda_manual_seed(seed)
    return patches


def teardown_megatron() -> None:
    """Destroy megatron's model-parallel state and revert the CPU patches."""
    parallel_state.destroy_model_parallel()
    patches = active_cpu_patches()
    if patches is not None:
        patches.revert()


def adam_config(
    config, lr: float, weight_decay: float, clip_grad: float, **extra
) -> OptimizerConfig:
    """megatron-core's Adam configuration for a model of ``config`` (its precision flags and dtype)."""
    return OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        **extra,
    )


def make_batch(cfg: GPTConfig, num_samples: int, seed: int) -> dict[str, torch.Tensor]:
    """A deterministic random batch of ``num_samples`` full-length sequences.

    Returns:
        ``tokens`` / ``labels`` (int64 ``[b, s]``, labels are the next tokens), ``loss_mask`` (float,
        about 80% ones so the token count is not trivially ``b*s``), ``position_ids`` and a causal
        boolean ``attention_mask`` ``[1, 1, s, s]`` (True = masked out, Megatron's convention).
    """
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab_size, (num_samples, cfg.seq_length + 1), generator=gen)
    loss_mask = (torch.rand(num_samples, cfg.seq_length, generator=gen) > 0.2).float()
    loss_mask[:, 0] = 1.0  # at least one token per sample
    s = cfg.seq_length
    return {
        "tokens": seq[:, :-1].contiguous(),
        "labels": seq[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(s).unsqueeze(0).expand(num_samples, s).contiguous(),
        "attention_mask": torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1),
    }


def _tp_split_chunks(full: torch.Tensor, dim: int, stride: int, tp_size: int) -> list[torch.Tensor]:
    """Split like megatron's ``_initialize_affine_weight_cpu``: ``stride*tp`` chunks, rank r gets r::tp."""
    if full.shape[dim] % (stride * tp_size):
        raise ValueError(
            f"dim {dim} of size {full.shape[dim]} does not split into {stride}x{tp_size} chunks"
        )
    return list(torch.split(full, full.shape[dim] // (stride * tp_size), dim=dim))


def tp_partition(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This TP rank's partition of the full (TP=1) tensor ``full`` for the TP-split ``param``."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    chunks = _tp_split_chunks(full, param.partition_dim, param.partition_stride, tp_size)
    return torch.cat(chunks[tp_rank::tp_size], dim=param.partition_dim)


def gather_tp_tensor(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Rebuild the full (TP=1) tensor from every TP rank's ``local`` partition of ``param``'s layout.

    Collective over the TP group. Tensors of non-TP-split params come back unchanged.
    """
    if not getattr(param, "tensor_model_parallel", False):
        return local
    group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    dim, stride = param.partition_dim, param.partition_stride
    per_rank = [torch.split(p, p.shape[dim] // stride, dim=dim) for p in parts]
    return torch.cat([per_rank[r][j] for j in range(stride) for r in range(tp_size)], dim=dim)


def full_state_dict_to_tp(full_sd: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Copy a TP=1 model's state dict into this rank's TP partition of ``model``.

    TP-split params (``tensor_model_parallel=True``) are cut along ``partition_dim`` into ``stride*tp``
    chunks of which this rank keeps ``rank::tp``, the rule megatron's CPU initialisation uses: for the
    fused QKV (grouped per query group) that is a contiguous split, for SwiGLU fc1 (stride 2) it keeps the
    rank's gate and up slices. Other params and buffers are copied whole.

    Raises:
        ValueError: a key of ``model`` missing from ``full_sd``, or a shape that does not match.
    """
    params = dict(model.named_parameters())
    target = model.state_dict()
    with torch.no_grad():
        for key, tensor in target.items():
            if not isinstance(tensor, torch.Tensor) or key.endswith("_extra_state"):
                continue
            if key not in full_sd:
                raise ValueError(f"state dict key {key!r} of the TP model is missing from full_sd")
            src = full_sd[key]
            if key in params:
                src = tp_partition(src, params[key])
            if src.shape != tensor.shape:
                raise ValueError(
                    f"{key!r}: TP partition has shape {tuple(src.shape)}, model has "
                    f"{tuple(tensor.shape)}"
                )
            tensor.copy_(src)


def allreduce_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """Sum ``.grad`` of params marked ``sequence_parallel`` over TP (what finalize_model_grads does)."""
    group = parallel_state.get_tensor_model_parallel_group()
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=group)


def _lm_outputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )


def gpt_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Forward ``batch``; return (sum of the masked token losses, number of loss tokens)."""
    loss_sum, num_tokens, _ = per_token_loss(batch["loss_mask"], _lm_outputs(model, batch))
    return loss_sum, int(num_tokens)


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    batch = next(data_iterator)
    return _lm_outputs(model, batch), functools.partial(per_token_loss, batch["loss_mask"])


def build_megatron_ddp(
    model: torch.nn.Module,
    use_distributed_optimizer: bool,
    *,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    clip_grad: float = 1.0,
    overlap_grad_reduce: bool = False,
    bucket_size: int | None = None,
    **optimizer_options,
) -> tuple[DistributedDataParallel, torch.nn.Module]:
    """Wrap ``model`` in megatron-core's DDP and build its Adam optimizer with ``get_megatron_optimizer``.

    Wires ``model.config`` like Megatron-LM's training loop: ``finalize_model_grads_func``,
    ``grad_scale_func`` and (with ``overlap_grad_reduce``) ``no_sync_func``.

    Returns:
        (ddp_model, optimizer); the optimizer is megatron's ``ChainedOptimizer``; ``optimizer_options``
        (e.g. ``adam_eps``) go to its ``OptimizerConfig``.
    """
    config = model.config
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=overlap_grad_reduce,
        bucket_size=bucket_size,
        grad_reduce_in_fp32=True,
    )
    ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = adam_config(
        config,
        lr,
        weight_decay,
        clip_grad,
        use_distributed_optimizer=use_distributed_optimizer,
        **optimizer_options,
    )
    with cuda_type_names():
        optimizer = get_megatron_optimizer(opt_config, [ddp_model])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if overlap_grad_reduce:
        config.no_sync_func = ddp_model.no_sync
        config.grad_sync_func = ddp_model.start_grad_sync
    return ddp_model, optimizer


def train_step(
    ddp_model: DistributedDataParallel,
    optimizer: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
) -> dict[str, float]:
    """One optimizer step over this rank's microbatches ``batches`` with per-token loss.

    Runs ``forward_backward_no_pipelining`` (which calls ``finalize_model_grads`` with the rank's token
    count; finalize all-reduces it over DP and divides the gradients by the global count), then
    ``optimizer.step()``.

    Returns:
        ``loss_sum`` and ``num_tokens`` of this rank's microbatches, ``grad_norm`` and
        ``update_successful`` from the optimizer.
    """
    if not batches:
        raise ValueError("train_step needs at least one microbatch on this rank")
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    reports = forward_backward_no_pipelining(
        forward_step_func=_forward_step,
        data_iterator=iter(batches),
        model=[ddp_model],
        num_microbatches=len(batches),
        seq_length=batches[0]["tokens"].shape[1],
        micro_batch_size=batches[0]["tokens"].shape[0],
    )
    with cuda_type_names():
        update_successful, grad_norm, _ = optimizer.step()
    totals = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
    return {
        "loss_sum": float(totals[0]),
        "num_tokens": float(totals[1]),
        "grad_norm": float(grad_norm),
        "update_successful": bool(update_successful),
    }
