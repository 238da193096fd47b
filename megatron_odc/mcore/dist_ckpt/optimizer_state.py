"""The ODC optimizer's state in a torch_dist checkpoint, under DistOpt's fully-reshardable keys.

``ODCOptimizer`` saves the fp32 main shard and the Adam moments of every owned piece as boxes
(``boxes.py``) keyed ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, the names megatron-core's
distributed optimizer uses with ``distrib_optim_sharding_type='fully_reshardable'``, so a different DP or
TP size (or megatron-core's distopt) loads them; the step count, param-group hyper-parameters and the
grad scaler go into the common state. Parameters whose model entry fell back to full tensors get their
state gathered over the shard group and saved through the module's own entry, as DistOpt does.

The optimizer is read through its attributes (``optimizer``, ``pieces``, ``grad_scaler``,
``model_chunks``); this module does not import it, so the optimizer can call these functions.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.utils import unwrap_model

from megatron_odc.mcore.data_parallel import ODCDataParallel
from megatron_odc.mcore.dist_ckpt.boxes import box_tensors, dp_replica
from megatron_odc.mcore.dist_ckpt.model_state import (
    ODCModelState,
    module_names,
    odc_model_sharded_state_dict,
)
from megatron_odc.transport.devices import all_reduce_on_group_device

logger = logging.getLogger(__name__)

OPTIMIZER_SHARDING_TYPE = "fully_reshardable"
"""The DistOpt checkpoint format whose key names ODC's optimizer state uses."""

_OPT_PREFIX = "optimizer.state"


def param_state_dict(
    optimizer: Any,
    model: ODCDataParallel,
    model_state: ODCModelState,
    *,
    for_load: bool,
    with_moments: bool,
    main_key: str | None = "param",
) -> tuple[dict[str, Any], list[tuple[str, str, list[tuple[torch.Tensor, int]]]]]:
    """DistOpt ``fully_reshardable``-style state of the ODC optimizer over the owned pieces.

    ``param`` (the fp32 main values) and, with ``with_moments``, the Adam moments, as boxes keyed
    ``optimizer.state.<state key>.<model key>``. For a load, missing moments are created (zeros) so
    that the checkpoint is read straight into them.

    Parameters whose model entry fell back to full tensors (``ShardedTensorFactory``, e.g. SwiGLU's
    fc1 under TP) get their optimizer state gathered over DP (one all-reduce per state) and saved
    through the module's own entry, like DistOpt does.

    ``main_key`` names the main values in the checkpoint: ``"param"`` (DistOpt), ``"fp32_param"``
    (megatron-core's ``Float16OptimizerWithFloat16Params``), or None to leave them out (its
    ``FP32Optimizer``, whose main parameters are the model's weights). The returned entries keep the
    state key ``"param"`` either way.

    Returns:
        ``{module parameter name: {state key: [boxes] or a full-tensor entry}}`` and, for the
        full-tensor entries, ``(name, state key, [(owned piece tensor, flat start)])`` to write the
        loaded values back.
    """
    templates = model_state.templates
    names = module_names(model)
    inner = optimizer.optimizer
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        state_keys = ["exp_avg", "exp_avg_sq"]
    else:
        state_keys = []
        if with_moments and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.warning(
                "ODC checkpoint: %s state other than the main parameters is not saved; a resume is "
                "not exact",
                type(inner).__name__,
            )
    names_in_ckpt = {"param": main_key}
    param_state: dict[str, dict[str, Any]] = {}
    gathered: dict[str, dict[str, list[tuple[torch.Tensor, int]]]] = {}
    for piece in optimizer.pieces:
        if piece.engine is not model.engine:
            continue
        key = names[piece.owned.name]
        flat_start = piece.owned.param_start
        main = piece.main
        tensors: dict[str, torch.Tensor] = {"param": main.data} if main_key else {}
        if with_moments:
            state = inner.state[main]
            for sk in state_keys:
                if sk in state:
                    tensors[sk] = state[sk]
                elif for_load:
                    state[sk] = torch.zeros_like(main.data, memory_format=torch.preserve_format)
                    tensors[sk] = state[sk]
                else:  # no step taken yet: Adam's moments are zero
                    tensors[sk] = torch.zeros_like(main.data)
        template = templates.get(key)
        if template is None:
            assert key in model_state.fallback_entries, key
            for sk, tensor in tensors.items():
                gathered.setdefault(key, {}).setdefault(sk, []).append((tensor, flat_start))
            continue
        replica_id = dp_replica(template.replica_id, model.engine.replica_rank)
        entry = param_state.setdefault(key, {})
        for sk, tensor in tensors.items():
            entry.setdefault(sk, []).extend(
                box_tensors(
                    template,
                    f"{_OPT_PREFIX}.{names_in_ckpt.get(sk, sk)}.{template.key}",
                    tensor,
                    flat_start,
                    replica_id,
                )
            )

    to_write_back = []
    params = dict(unwrap_model(model).named_parameters())
    state_names = (["param"] if main_key else []) + (state_keys if with_moments else [])
    for key in sorted(model_state.fallback_entries):  # the same order on every rank: collectives
        module_entry = model_state.fallback_entries[key]
        shape = params[key].shape
        for sk in state_names:
            runs = gathered.get(key, {}).get(sk, [])
            full = torch.zeros(math.prod(shape), dtype=torch.float32)
            if not for_load:
                for tensor, flat_start in runs:
                    full[flat_start : flat_start + tensor.numel()] = tensor
                all_reduce_on_group_device(full, group=model.shard_group)  # each element once
            changes: dict[str, Any] = {
                "key": f"{_OPT_PREFIX}.{names_in_ckpt.get(sk, sk)}.{module_entry.key}",
                "data": full.view(shape),
            }
            if isinstance(module_entry, ShardedTensor):
                changes["dtype"] = full.dtype
            param_state.setdefault(key, {})[sk] = dataclasses.replace(module_entry, **changes)
            to_write_back.append((key, sk, runs))
    return param_state, to_write_back


def write_back(
    param_state: dict[str, dict[str, Any]],
    write_back: list[tuple[str, str, list[tuple[torch.Tensor, int]]]],
    loaded_state: dict[str, dict[str, Any]],
) -> None:
    """Copy loaded optimizer values into the main shards and moments (boxes usually load in place)."""
    for key, entry in param_state.items():
        for sk, boxes in entry.items():
            if not isinstance(boxes, list):
                continue  # a full-tensor entry: written back below
            for box, value in zip(boxes, loaded_state[key][sk]):
                if value.data_ptr() != box.data.data_ptr():
                    box.data.copy_(value)
    for key, sk, runs in write_back:
        full = loaded_state[key][sk].reshape(-1)
        for tensor, flat_start in runs:
            tensor.copy_(full[flat_start : flat_start + tensor.numel()])


def common_state(optimizer: Any) -> dict[str, Any]:
    inner = optimizer.optimizer
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"ODC optimizer: pieces disagree on the step count ({sorted(steps)})")
    step_max = torch.tensor([steps.pop() if steps else 0.0], dtype=torch.float64)
    # A rank that owns no piece has no state; every rank records the same step.
    all_reduce_on_group_device(step_max, dist.ReduceOp.MAX)
    step = int(step_max.item())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    for g in groups:
        g["step"] = step
    return {
        "optimizer": {"param_groups": groups},
        "grad_scaler": (
            optimizer.grad_scaler.state_dict() if optimizer.grad_scaler is not None else None
        ),
        "param_state_sharding_type": OPTIMIZER_SHARDING_TYPE,
    }


def _group_key(group: dict[str, Any]) -> tuple:
    """What identifies a megatron param group (``_get_param_groups``), independent of its order."""
    return tuple(
        repr(group.get(k)) for k in ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
    )


def saved_step(common: dict[str, Any]) -> int:
    """The step of a DistOpt-form common optimizer state (its first param group's; 0 when none)."""
    groups = common.get("optimizer", {}).get("param_groups", [])
    return int(groups[0].get("step", 0) or 0) if groups else 0


def load_common_state(optimizer: Any, common: dict[str, Any]) -> int:
    """Restore steps, param-group hyper-parameters and the grad scaler; return the step."""
    inner = optimizer.optimizer
    groups = common.get("optimizer", {}).get("param_groups", [])
    step = saved_step(common)
    saved_by_key = {_group_key(g): g for g in groups}
    current_keys = [_group_key(g) for g in inner.param_groups]
    if len(saved_by_key) == len(groups) and sorted(saved_by_key) == sorted(current_keys):
        for group, key in zip(inner.param_groups, current_keys):
            for k, v in saved_by_key[key].items():
                if k not in ("params", "step"):
                    group[k] = v
    else:
        logger.warning(
            "ODC optimizer: the checkpoint's %d param groups do not match the optimizer's %d; "
            "hyper-parameters are not restored (the scheduler sets lr / weight decay each step)",
            len(groups),
            len(inner.param_groups),
        )
    for piece in optimizer.pieces:
        state = inner.state[piece.main]
        if step > 0 and "exp_avg" in state:
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
    scaler = common.get("grad_scaler")
    if optimizer.grad_scaler is not None and scaler is not None:
        optimizer.grad_scaler.load_state_dict(scaler)
    return step


def megatron_common_as_distopt(common: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A checkpoint's common optimizer state in DistOpt's form, and the name of its main values.

    ODC and distopt checkpoints are returned as they are (mains under ``"param"``). The state of
    megatron-core's non-distributed optimizers (stock DDP) is translated: ``FP32Optimizer`` keeps
    ``param_groups`` and ``state.common_step`` at the top and no main values (they are the model's
    weights: None); ``Float16OptimizerWithFloat16Params`` keeps them under ``optimizer`` and its mains
    under ``"fp32_param"``. The step goes into every param group, as DistOpt saves it. Anything else is
    returned unchanged for :func:`check_sharding_type` to refuse.
    """
    if "param_state_sharding_type" in common:
        return common, "param"
    nested = common.get("optimizer")
    if isinstance(nested, dict) and "param_groups" in nested and "state" in nested:
        # Float16OptimizerWithFloat16Params (its fp32_from_fp16_params are all sharded tensors)
        inner, main_key = nested, "fp32_param"
    elif "param_groups" in common and "state" in common:
        inner, main_key = common, None
    else:
        return common, "param"
    step = inner["state"].get("common_step", 0)
    step = int(step.item() if isinstance(step, torch.Tensor) else step or 0)
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "step": step}
        for g in inner["param_groups"]
    ]
    translated = {
        "optimizer": {"param_groups": groups},
        "grad_scaler": common.get("grad_scaler"),
        "param_state_sharding_type": OPTIMIZER_SHARDING_TYPE,
    }
    return translated, main_key


def distopt_common_as_megatron(loaded: dict[str, Any], common: dict[str, Any]) -> None:
    """Make what ``dist_checkpointing.load`` returned for a megatron-core non-distributed optimizer
    (stock DDP) from an ODC or distopt checkpoint readable by its ``load_state_dict`` (in place).

    That optimizer keeps ``param_groups`` and ``state.common_step`` next to its moments (at the top for
    ``FP32Optimizer``, under ``optimizer`` for ``Float16OptimizerWithFloat16Params``); the checkpoint's
    common state (``common``) holds DistOpt's ``optimizer.param_groups`` with the step in each group.
    Without this the loaded groups hold only their ``params`` and megatron-core fails matching them
    (``KeyError: 'pre_wd_mult'``, ``_filter_and_reorder_param_groups``) and the step is lost.

    Raises:
        ValueError: the checkpoint has another number of param groups than the optimizer.
    """
    saved_groups = common["optimizer"]["param_groups"]
    inner = loaded["optimizer"] if "state" in loaded.get("optimizer", {}) else loaded
    if len(saved_groups) != len(inner["param_groups"]):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups, this optimizer "
            f"{len(inner['param_groups'])}"
        )
    step = saved_step(common)
    # megatron-core matches groups by their (wd_mult, lr_mult, ...) key, not by position.
    inner["param_groups"] = [
        {**{k: v for k, v in saved.items() if k != "step"}, "params": group["params"]}
        for saved, group in zip(saved_groups, inner["param_groups"])
    ]
    if step > 0:
        inner["state"]["common_step"] = torch.tensor(float(step), dtype=torch.float32)


def check_sharding_type(common: dict[str, Any], where: str) -> None:
    """Refuse an optimizer state the ODC optimizer cannot load.

    Raises:
        ValueError: ``common`` (a checkpoint's common optimizer state) is not fully reshardable.
    """
    sharding_type = common.get("param_state_sharding_type")
    if sharding_type != OPTIMIZER_SHARDING_TYPE:
        raise ValueError(
            f"{where}: optimizer state format {sharding_type!r} cannot be loaded by the ODC "
            f"optimizer; save it as {OPTIMIZER_SHARDING_TYPE!r} (--use-distributed-optimizer "
            "--dist-ckpt-optim-fully-reshardable) or load weights only (--finetune or --no-load-optim)"
        )


def _single_chunk(optimizer: Any) -> ODCDataParallel:
    chunks = optimizer.model_chunks
    if len(chunks) != 1:
        raise ValueError(
            f"ODC distributed checkpoints support one model chunk; the optimizer has {len(chunks)}"
        )
    return chunks[0]


def odc_optimizer_sharded_state_dict(optimizer: Any, *, is_loading: bool) -> dict[str, Any]:
    """The optimizer part of a torch_dist checkpoint (``ODCOptimizer.sharded_state_dict``).

    The common state (steps, param-group hyper-parameters, grad scaler, ``param_state_sharding_type``)
    and ``param_state`` boxes under DistOpt's fully-reshardable keys. Adam's moments are always present
    (zeros before the first step): Megatron-LM builds the loading state dict without reading the
    checkpoint first. Collective when saving (step count, fallback gathers).

    Args:
        optimizer: the ``ODCOptimizer`` (one model chunk).
        is_loading: build the state to load into (moments are created where missing) instead of the
            state to save.
    """
    model = _single_chunk(optimizer)
    model_state = odc_model_sharded_state_dict(model, for_load=True)  # keys and templates
    param_state, _ = param_state_dict(
        optimizer, model, model_state, for_load=is_loading, with_moments=True
    )
    if is_loading:
        return {"param_state": param_state}
    return {**common_state(optimizer), "param_state": param_state}


def load_odc_optimizer_state(optimizer: Any, state_dict: dict[str, Any]) -> None:
    """Restore the fp32 main shards, moments, step, hyper-parameters and grad scaler of ``optimizer``
    from what ``dist_checkpointing.load`` returned for :func:`odc_optimizer_sharded_state_dict`.

    The model's shards are not touched: the optimizer writes its main shards into them afterwards.

    Raises:
        ValueError: the checkpoint's optimizer state is not in the fully-reshardable format.
    """
    check_sharding_type(state_dict, "checkpoint")
    model = _single_chunk(optimizer)
    model_state = odc_model_sharded_state_dict(model, for_load=True)
    param_state, to_write_back = param_state_dict(
        optimizer, model, model_state, for_load=True, with_moments=True
    )
    write_back(param_state, to_write_back, state_dict["param_state"])
    if load_common_state(optimizer, state_dict) == 0:
        # Saved before the first step: Adam starts from empty state, as it did there.
        for piece in optimizer.pieces:
            optimizer.optimizer.state.pop(piece.main, None)
