"""One switch for the data-parallel backend: ``build_backend(name, model, optimizer_config)``.

In a fixed order, as megatron-core's training loop does it:

1. wrap the model: ``odc`` / ``fsdp`` in ``ODCDataParallel`` (``fsdp``: the same engine over the lockstep
   collective transport), ``ddp`` / ``distopt`` in megatron-core's ``DistributedDataParallel``;
2. build the optimizer: ``ODCOptimizer`` over the owned shards, or megatron-core's
   ``get_megatron_optimizer`` (without / with its distributed optimizer; on CPU parameters inside
   ``cpu_optimizers.cuda_type_names``);
3. wire ``config.finalize_model_grads_func`` and ``config.grad_scale_func`` as Megatron-LM does.

The backends and what each refuses are listed once in ``config.py``.
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

from megatron_odc.mcore.config import (
    BACKENDS,
    LOCKSTEP_BACKENDS,
    LOCKSTEP_TRANSPORT,
    ODC_ENGINE_BACKENDS,
    ODCConfig,
)
from megatron_odc.mcore.cpu_optimizers import CudaTypeNamesOptimizer, cuda_type_names, on_cpu
from megatron_odc.mcore.data_parallel import ODCDataParallel
from megatron_odc.mcore.optimizer import ODCOptimizer


def build_backend(
    name: str,
    model: torch.nn.Module,
    optimizer_config: OptimizerConfig,
    *,
    odc_config: ODCConfig | None = None,
    grad_reduce_in_fp32: bool = True,
) -> tuple[torch.nn.Module, Any]:
    """Wrap ``model`` for data parallelism with backend ``name`` and build its optimizer.

    Args:
        name: one of ``BACKENDS``.
        model: a megatron-core model (``GPTModel`` or ``Float16Module``) with ``.config``.
        optimizer_config: megatron-core ``OptimizerConfig``.
        odc_config: ODC's options for ``odc`` / ``fsdp`` (``fsdp`` always uses the collective transport).
        grad_reduce_in_fp32: accumulate and reduce gradients in fp32.

    Returns:
        ``(wrapped_model, optimizer)``.

    Raises:
        ValueError: an unknown backend, ``odc_config`` with ``ddp`` / ``distopt``, or a combination the
            backend refuses.
    """
    if name not in BACKENDS:
        raise ValueError(f"--dp-backend {name!r} is not one of {', '.join(BACKENDS)}")
    config = model.config
    if name in ODC_ENGINE_BACKENDS:
        odc_config = odc_config or ODCConfig()
        if name in LOCKSTEP_BACKENDS:
            odc_config = dataclasses.replace(odc_config, transport=LOCKSTEP_TRANSPORT)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32)
        wrapped = ODCDataParallel(config, ddp_config, model, odc_config=odc_config)
        optimizer = ODCOptimizer(dataclasses.replace(optimizer_config), [wrapped])
    else:
        if odc_config is not None:
            raise ValueError(f"ODC options apply to --dp-backend odc / fsdp, not {name}")
        use_distopt = name == "distopt"
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_reduce_in_fp32, use_distributed_optimizer=use_distopt
        )
        wrapped = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        opt_config = dataclasses.replace(optimizer_config, use_distributed_optimizer=use_distopt)
        if on_cpu(model):
            with cuda_type_names():
                optimizer = CudaTypeNamesOptimizer(get_megatron_optimizer(opt_config, [wrapped]))
        else:
            optimizer = get_megatron_optimizer(opt_config, [wrapped])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return wrapped, optimizer
