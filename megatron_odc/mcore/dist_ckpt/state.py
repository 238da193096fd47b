"""The torch_dist state of a whole model and optimizer, for every backend: build it, write it, load it.

``{"model": ..., "optimizer": ...}`` through ``megatron.core.dist_checkpointing``:

- an ``ODCDataParallel`` model: owned-slice boxes (``model_state.py``); its ``ODCOptimizer``: main
  shards and moments under DistOpt's fully-reshardable keys (``optimizer_state.py``);
- megatron-core's ``DistributedDataParallel``: the unwrapped module's own sharded state dict, and the
  optimizer's own ``sharded_state_dict`` with ``distrib_optim_sharding_type='fully_reshardable'`` (inside
  ``cpu_optimizers.cuda_type_names`` when the model is on CPU).

Model keys are the unwrapped ``GPTModel``'s, so a checkpoint of one backend, DP size or TP size loads
into another. Optimizer state too: ODC and distopt write DistOpt's fully-reshardable format, stock
DDP megatron-core's non-distributed one (same moment keys, other common state and main-value keys);
each side translates the other's on load (``optimizer_state.megatron_common_as_distopt`` /
``distopt_common_as_megatron``), so a full resume works across all three. Where the state lands on disk (iteration directories, the tracker, atomic renames) is
the caller's business (``runner/checkpoint.py``; Megatron-LM's own ``save_checkpoint``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: F401 (callers catch it)
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.utils import unwrap_model

from megatron_odc.mcore.cpu_optimizers import (
    init_unfused_distopt_state,
    load_megatron_optimizer_state,
    megatron_optimizer_scope,
)
from megatron_odc.mcore.data_parallel import ODCDataParallel
from megatron_odc.mcore.dist_ckpt import layout, optimizer_state, writer_processes
from megatron_odc.mcore.dist_ckpt.model_state import odc_model_sharded_state_dict, write_back
from megatron_odc.mcore.optimizer import ODCOptimizer


def _check_odc_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, ODCOptimizer):
        raise ValueError(f"an ODC model needs an ODCOptimizer, got {type(optimizer).__name__}")


def _megatron_optimizer_sharded(
    model: torch.nn.Module, optimizer: Any, model_sd: dict, *, is_loading: bool
) -> dict:
    if is_loading:
        # The CPU path (torch's Adam, no TE / Apex): distopt's state_dict asserts one step value.
        init_unfused_distopt_state(optimizer)
    with megatron_optimizer_scope(model):
        return optimizer.sharded_state_dict(
            model_sd,
            is_loading,
            metadata={"distrib_optim_sharding_type": optimizer_state.OPTIMIZER_SHARDING_TYPE},
        )


def build_save_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` to save (no ``"optimizer"`` when ``optimizer`` is None).

    Collective for ODC models (a fence, and gathers for fallback parameters).
    """
    state: dict[str, Any] = {}
    if isinstance(model, ODCDataParallel):
        model_state = odc_model_sharded_state_dict(model, for_load=False)
        state["model"] = model_state.sharded
        if optimizer is not None:
            _check_odc_optimizer(optimizer)
            common = optimizer_state.common_state(optimizer)
            step = common["optimizer"]["param_groups"][0]["step"]
            param_state, _ = optimizer_state.param_state_dict(
                optimizer, model, model_state, for_load=False, with_moments=step > 0
            )
            state["optimizer"] = {**common, "param_state": param_state}
    else:
        model_sd = unwrap_model(model).sharded_state_dict()
        state["model"] = model_sd
        if optimizer is not None:
            state["optimizer"] = _megatron_optimizer_sharded(
                model, optimizer, model_sd, is_loading=False
            )
    return state


def write(state: dict[str, Any], checkpoint_dir: Path, model: torch.nn.Module) -> None:
    """``dist_checkpointing.save`` of ``state`` into ``checkpoint_dir`` (collective); the writer's
    processes die with this rank (``writer_processes``)."""
    writer_processes.install()
    with megatron_optimizer_scope(model):
        dist_checkpointing.save(state, str(checkpoint_dir))


def load(
    checkpoint_dir: Path, model: torch.nn.Module, optimizer: Any, *, load_optimizer: bool
) -> None:
    """Load the model (and, with ``load_optimizer``, the optimizer) saved in ``checkpoint_dir``.

    Collective. Without ``load_optimizer`` a given optimizer refreshes its main parameters from the
    loaded weights (``reload_model_params``).

    Raises:
        ValueError: the checkpoint does not fit (a tensor is missing or has another shape, named), holds
            no optimizer state, or holds one the optimizer cannot read.
    """
    layout.check(checkpoint_dir)  # a missing or foreign file named before megatron-core reads
    gpt = unwrap_model(model)
    is_odc = isinstance(model, ODCDataParallel)
    state: dict[str, Any] = {}
    odc_state = None
    if is_odc:
        model.engine.release_all()  # no stale unsharded copies survive the load
        odc_state = odc_model_sharded_state_dict(model, for_load=True)
        state["model"] = odc_state.sharded
    else:
        state["model"] = gpt.sharded_state_dict()
    _check_fits(state["model"], checkpoint_dir, "model")

    common = dist_checkpointing.load_common_state_dict(str(checkpoint_dir))
    from_distopt_format = False  # a stock DDP optimizer reading ODC's / distopt's state
    if load_optimizer:
        if "optimizer" not in common:
            raise ValueError(
                f"checkpoint {checkpoint_dir} holds no optimizer state; load it with finetune=True"
            )
        if is_odc:
            _check_odc_optimizer(optimizer)
            saved_common, main_key = optimizer_state.megatron_common_as_distopt(common["optimizer"])
            optimizer_state.check_sharding_type(saved_common, f"checkpoint {checkpoint_dir}")
            param_state, to_write_back = optimizer_state.param_state_dict(
                optimizer,
                model,
                odc_state,
                for_load=True,
                with_moments=optimizer_state.saved_step(saved_common) > 0,
                main_key=main_key,
            )
            state["optimizer"] = {"param_state": param_state}
        else:
            state["optimizer"] = _megatron_optimizer_sharded(
                model, optimizer, state["model"], is_loading=True
            )
            from_distopt_format = _reads_distopt_format(optimizer, common["optimizer"])
            if from_distopt_format:
                # Float16OptimizerWithFloat16Params names its mains fp32_param, DistOpt param.
                state["optimizer"] = _renamed_keys(
                    state["optimizer"], "optimizer.state.fp32_param.", "optimizer.state.param."
                )
        _check_fits(state["optimizer"], checkpoint_dir, "optimizer")

    with megatron_optimizer_scope(model):
        loaded = dist_checkpointing.load(state, str(checkpoint_dir))

    if is_odc:
        write_back(model, odc_state, loaded["model"])
        if load_optimizer:
            optimizer_state.write_back(
                state["optimizer"]["param_state"], to_write_back, loaded["optimizer"]["param_state"]
            )
            # Model shards hold the saved compute-dtype values, main shards the fp32 ones.
            optimizer_state.load_common_state(optimizer, saved_common)
            if main_key is None:  # stock DDP's fp32 mains are its weights, loaded above
                optimizer.reload_model_params()
        model.engine.transport.fence()
        if optimizer is not None and not load_optimizer:
            optimizer.reload_model_params()
        return
    missing_unexpected = gpt.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing_unexpected.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"checkpoint {checkpoint_dir}: model keys {missing[:5]} were not loaded")
    with megatron_optimizer_scope(model):
        if load_optimizer:
            if from_distopt_format:
                optimizer_state.distopt_common_as_megatron(loaded["optimizer"], common["optimizer"])
            load_megatron_optimizer_state(optimizer, loaded["optimizer"])
        elif optimizer is not None:
            optimizer.reload_model_params()


def _reads_distopt_format(optimizer: Any, saved_common: dict[str, Any]) -> bool:
    """Whether a megatron-core non-distributed optimizer (stock DDP's) loads a DistOpt-format
    (fully-reshardable: ODC's or distopt's) optimizer state."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    distributed = any(isinstance(opt, DistributedOptimizer) for opt in chained)
    return not distributed and "param_state_sharding_type" in saved_common


def _renamed_keys(x: Any, old_prefix: str, new_prefix: str) -> Any:
    """``x`` (a nested sharded state dict) with every sharded entry's key prefix ``old_prefix``
    replaced by ``new_prefix``."""
    if isinstance(x, dict):
        return {k: _renamed_keys(v, old_prefix, new_prefix) for k, v in x.items()}
    if isinstance(x, list):
        return [_renamed_keys(v, old_prefix, new_prefix) for v in x]
    key = getattr(x, "key", None)
    if isinstance(x, ShardedBase) and isinstance(key, str) and key.startswith(old_prefix):
        return dataclasses.replace(x, key=new_prefix + key[len(old_prefix) :])
    return x


def _check_fits(sharded: dict[str, Any], checkpoint_dir: Path, what: str) -> None:
    """Raise ValueError naming the first tensor, by key over every rank, missing from the checkpoint
    or of another shape (collective where a process group is up: ranks hold different tensors, and
    each naming its own first misfit printed one line per rank)."""
    saved = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir))
    entries: dict[str, ShardedTensor] = {}
    for entry in _nested_values(sharded):
        if isinstance(entry, ShardedTensor):
            entries.setdefault(entry.key, entry)
    misfit: tuple[str, str] | None = None
    for key in sorted(entries):
        entry, ref = entries[key], saved.get(key)
        if ref is None:
            misfit = (key, f"tensor {key!r} is missing from the checkpoint")
        elif (
            tuple(ref.global_shape) != tuple(entry.global_shape) and not entry.allow_shape_mismatch
        ):
            misfit = (
                key,
                f"tensor {key!r} has shape {tuple(ref.global_shape)} in the checkpoint, "
                f"{tuple(entry.global_shape)} in the model",
            )
        if misfit is not None:
            break
    if dist.is_initialized() and dist.get_world_size() > 1:
        misfits: list[tuple[str, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(misfits, misfit)
        misfit = min((m for m in misfits if m is not None), default=None)
    if misfit is not None:
        raise ValueError(f"checkpoint {checkpoint_dir} does not fit the {what}: {misfit[1]}")


def _nested_values(x: Any) -> Iterator[Any]:
    if isinstance(x, dict):
        for v in x.values():
            yield from _nested_values(v)
    elif isinstance(x, list):
        for v in x:
            yield from _nested_values(v)
    else:
        yield x
