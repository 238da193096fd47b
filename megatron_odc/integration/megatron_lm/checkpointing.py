"""Megatron-LM's own torch_dist ``save_checkpoint`` / ``load_checkpoint`` for ODC chunks, and what its
``load_checkpoint`` does for every backend.

Megatron-LM saves ``unwrap_model(model).sharded_state_dict(metadata=...)`` and
``optimizer.sharded_state_dict(...)``; it loads into the same and then calls
``model.load_state_dict(loaded["model"])`` and ``optimizer.load_state_dict(loaded["optimizer"])``.
:func:`install_megatron_lm_checkpointing` sets two instance attributes so that these calls reach
ODC's builders (``mcore/dist_ckpt/model_state.py``): the unwrapped module's ``sharded_state_dict``
(owned-slice boxes) and the chunk's ``load_state_dict``. ``ODCOptimizer`` has its own
``sharded_state_dict`` / ``load_state_dict``. The on-disk layout is Megatron-LM's.

:func:`wrap_load_checkpoint` (the patch point ``training.load_checkpoint``, every ``--dp-backend``)
records the health phase ``load`` (``health.py``) and makes ``--override-opt_param-scheduler`` mean what
Megatron-LM says: the flags' schedule. Megatron-LM's optimizer load restores the checkpoint's param
groups, whose ``max_lr`` / ``min_lr`` megatron-core's scheduler reads before its own, so a resume with a
new ``--lr`` and that flag kept the old peak on every backend (seen on ``core_v0.16.1``, DDP and ODC alike:
``--lr 5e-4`` gave iteration 4 the old schedule's 4.109e-4); the groups now keep this run's bounds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.utils import unwrap_model

from megatron_odc.integration.megatron_lm.health import phase
from megatron_odc.mcore import optimizer_setup
from megatron_odc.mcore.config import ODC_ENGINE_BACKENDS
from megatron_odc.mcore.data_parallel import ODCDataParallel
from megatron_odc.mcore.dist_ckpt.model_state import (
    load_odc_model_state_dict,
    odc_model_sharded_state_dict,
)
from megatron_odc.mcore.dist_ckpt.optimizer_state import OPTIMIZER_SHARDING_TYPE
from megatron_odc.mcore.optimizer import ODCOptimizer


class _ODCModuleShardedStateDict:
    """The unwrapped module's ``sharded_state_dict`` under ODC: the chunk's owned-slice boxes."""

    def __init__(self, model: ODCDataParallel) -> None:
        self.model = model

    def __call__(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        if prefix or sharded_offsets:
            raise ValueError(
                f"the ODC module's sharded_state_dict takes no prefix ({prefix!r}) or sharded "
                f"offsets ({sharded_offsets!r}): pipeline and virtual pipeline stages are unsupported"
            )
        return odc_model_sharded_state_dict(self.model, for_load=False, metadata=metadata).sharded


class _ODCLoadStateDict:
    """The ``ODCDataParallel`` chunk's ``load_state_dict`` for dist-checkpoint state dicts.

    The optimizer is told that the model's shards were loaded (``ODCOptimizer.model_params_loaded``):
    its main shards follow the loaded weights before they are next read, unless Megatron-LM's optimizer
    load (which comes after this call, over main shards it already loaded in place) sets them first.
    """

    def __init__(self, model: ODCDataParallel, optimizer: ODCOptimizer | None) -> None:
        self.model = model
        self.optimizer = optimizer

    def __call__(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        load_odc_model_state_dict(self.model, state_dict)
        if self.optimizer is not None:
            self.optimizer.model_params_loaded()
        return torch.nn.modules.module._IncompatibleKeys([], [])


def install_megatron_lm_checkpointing(
    model: ODCDataParallel, optimizer: ODCOptimizer | None = None
) -> None:
    """Route Megatron-LM's checkpoint calls on ``model`` through ODC's (see the module docstring).

    Calling it again (e.g. once the optimizer exists) replaces both attributes.
    """
    if not isinstance(model, ODCDataParallel):
        raise ValueError(f"expected an ODCDataParallel chunk, got {type(model).__name__}")
    unwrap_model(model).sharded_state_dict = _ODCModuleShardedStateDict(model)
    model.load_state_dict = _ODCLoadStateDict(model, optimizer)


def wrap_build_sharded_state_dict_metadata(original: Callable[..., dict]) -> Callable[..., dict]:
    """Megatron-LM's ``checkpointing._build_sharded_state_dict_metadata``, naming ODC's optimizer format.

    The metadata is saved with a torch_dist checkpoint, and a run that loads it reads the optimizer's
    ``distrib_optim_sharding_type`` from there. Megatron-LM records it only with
    ``--use-distributed-optimizer``; an ``odc`` / ``fsdp`` run saves DistOpt's fully-reshardable
    format (``mcore/dist_ckpt/optimizer_state.py``), so it is recorded as such, and a
    ``--dp-backend distopt`` run resumes it instead of reading it as its default (``dp_reshardable``).
    """

    @functools.wraps(original)
    def build(args: Any, *rest: Any, **kwargs: Any) -> dict:
        metadata = original(args, *rest, **kwargs)
        if getattr(args, "dp_backend", None) in ODC_ENGINE_BACKENDS:
            metadata["distrib_optim_sharding_type"] = OPTIMIZER_SHARDING_TYPE
        return metadata

    build.__megatron_odc_original__ = original
    return build


def wrap_load_checkpoint(original: Callable) -> Callable:
    """``load_checkpoint(ddp_model, optimizer, opt_param_scheduler, ...)`` in the health phase ``load``;
    with ``--override-opt_param-scheduler`` the optimizer's param groups keep this run's ``max_lr`` /
    ``min_lr`` (see the module docstring)."""

    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        from megatron.training.global_vars import get_args

        optimizer = args[1] if len(args) > 1 else kwargs.get("optimizer")
        built = optimizer_setup.group_lr_bounds(optimizer) if optimizer is not None else None
        with phase("load"):
            result = original(*args, **kwargs)
        if built is not None and getattr(get_args(), "override_opt_param_scheduler", False):
            optimizer_setup.set_group_lr_bounds(optimizer, built)
        return result

    load_checkpoint.__megatron_odc_original__ = original
    return load_checkpoint
