"""One switch for the data-parallel backend: ``odc``, ``fsdp``, ``ddp`` or ``distopt``.

``build_backend(name, model, optimizer_config, ...)`` wraps a megatron-core model and builds its optimizer:

- ``odc``: ``OdcDataParallel`` over the shared-memory (or another one-sided) transport + ``OdcOptimizer``:
  sharded params, grads and optimizer state; ranks may run different numbers of microbatches;
- ``fsdp``: the same engine over the collective transport (per-bucket all-gather / reduce-scatter, in
  lockstep): the ZeRO-3 baseline, which needs equal microbatch counts on every rank;
- ``ddp`` / ``distopt``: megatron-core's own ``DistributedDataParallel`` + ``get_megatron_optimizer``,
  without / with its distributed optimizer (replicated params: the memory-hungry upper bound).

It also wires ``config.finalize_model_grads_func`` and ``config.grad_scale_func`` the way Megatron-LM's
training loop does. On CPU (the patches of ``megatron_odc.patches.cpu`` active), megatron-core's own
optimizers are wrapped so that their CUDA tensor-type checks see CUDA names during construction and steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from megatron_odc.integration.cpu import active_cpu_patches, cuda_type_names
from megatron_odc.mcore.data_parallel import OdcConfig, OdcDataParallel
from megatron_odc.mcore.optimizer import OdcOptimizer

BACKENDS = ("odc", "fsdp", "ddp", "distopt")
LOCKSTEP_BACKENDS = ("fsdp",)
"""Backends whose ranks must run the same number of microbatches (every bucket op is a collective)."""


class _CudaTypeNamesOptimizer:
    """Runs a megatron-core optimizer's ``step`` with CUDA tensor-type names (CPU runs only)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def step(self, *args: Any, **kwargs: Any) -> Any:
        with cuda_type_names():
            return self._inner.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def build_backend(
    name: str,
    model: torch.nn.Module,
    optimizer_config: OptimizerConfig,
    *,
    odc_options: dict[str, Any] | None = None,
    grad_reduce_in_fp32: bool = True,
) -> tuple[torch.nn.Module, Any]:
    """Wrap ``model`` for data parallelism with backend ``name`` and build its optimizer.

    Args:
        name: one of ``BACKENDS``.
        model: a megatron-core model (``GPTModel`` or ``Float16Module``) with ``.config``.
        optimizer_config: megatron-core ``OptimizerConfig``.
        odc_options: ``OdcConfig`` fields for ``odc`` / ``fsdp`` (e.g. ``odc_bucket_size``).
        grad_reduce_in_fp32: accumulate and reduce gradients in fp32.

    Returns:
        ``(wrapped_model, optimizer)``.
    """
    if name not in BACKENDS:
        raise ValueError(f"--dp-backend {name!r} is not one of {', '.join(BACKENDS)}")
    config = model.config
    if name in ("odc", "fsdp"):
        options = dict(odc_options or {})
        if name == "fsdp":
            options["odc_transport"] = "collective"
        known = {f.name for f in dataclasses.fields(OdcConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown ODC options {unknown}; known: {sorted(known)}")
        ddp_config = OdcConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, **options)
        wrapped = OdcDataParallel(config, ddp_config, model)
        optimizer = OdcOptimizer(dataclasses.replace(optimizer_config), [wrapped])
    else:
        use_distopt = name == "distopt"
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_reduce_in_fp32, use_distributed_optimizer=use_distopt
        )
        wrapped = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        opt_config = dataclasses.replace(optimizer_config, use_distributed_optimizer=use_distopt)
        if active_cpu_patches() is not None:
            with cuda_type_names():
                optimizer = _CudaTypeNamesOptimizer(get_megatron_optimizer(opt_config, [wrapped]))
        else:
            optimizer = get_megatron_optimizer(opt_config, [wrapped])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return wrapped, optimizer
