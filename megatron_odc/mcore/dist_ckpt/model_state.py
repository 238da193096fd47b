"""The sharded state dict of an ODC-wrapped model: this DP rank's owned slices, under the model's keys.

Model weights use the *unwrapped* ``GPTModel``'s ``sharded_state_dict()`` keys, what Megatron-LM writes,
so checkpoints move between backends and between TP and DP sizes. ODC frees the module's parameter
storage between fetches, so the module's own sharded state dict only supplies keys, global shapes, TP
offsets and replica ids: each parameter's ``ShardedTensor`` is replaced by boxes (``boxes.py``) over this
DP rank's owned flat slice, whose data are views of the owned compute-dtype shard (FP8 parameters: a
dequantised copy, so checkpoints hold values and load into bf16 runs and other backends). A parameter
whose entry is not a plain ``ShardedTensor`` of the parameter's shape (e.g. a ``ShardedTensorFactory``:
SwiGLU's fc1 under TP) falls back to the gathered full (TP-local) tensor with the module's replica ids.

Entry points: :func:`odc_model_sharded_state_dict` (save or load), :func:`write_back` (after
``dist_checkpointing.load``) and :func:`load_odc_model_state_dict` (both, for a dict that
``dist_checkpointing.load`` returned).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.utils import unwrap_model

from megatron_odc.core.storage import OwnedPiece
from megatron_odc.mcore.data_parallel import ODCDataParallel
from megatron_odc.mcore.dist_ckpt.boxes import box_tensors, dp_replica

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class OwnedRun:
    """An owned run of a parameter and the tensor that stands for it in the checkpoint."""

    piece: OwnedPiece
    values: torch.Tensor
    """1-D: a view of the owned compute-dtype shard, or (FP8) a dequantised copy in the parameter's dtype."""


@dataclasses.dataclass
class ODCModelState:
    """The ODC model's sharded state dict plus what a load needs to write back.

    Attributes:
        sharded: the state dict handed to ``dist_checkpointing``.
        templates: module key -> the module's own ShardedTensor (keys, shapes, TP offsets).
        boxed: module keys saved as boxes over owned shards.
        fallback: module key -> full local tensor (gathered for a save, empty to load into).
        fallback_entries: module key -> the module's own entry (e.g. a factory).
        owned: module key -> this rank's owned runs (what the boxes hold).
    """

    sharded: dict[str, Any]
    templates: dict[str, ShardedTensor]
    boxed: set[str]
    fallback: dict[str, torch.Tensor]
    fallback_entries: dict[str, Any]
    owned: dict[str, list[OwnedRun]]


def module_names(model: ODCDataParallel) -> dict[str, str]:
    """Engine parameter name -> unwrapped-module parameter name (they differ under Float16Module)."""
    gpt_name_of = {id(p): n for n, p in unwrap_model(model).named_parameters()}
    out = {}
    for name, param in model.engine.parameters():
        if id(param) not in gpt_name_of:
            raise ValueError(f"ODC parameter {name!r} is not a parameter of the unwrapped model")
        out[name] = gpt_name_of[id(param)]
    return out


def _owned_runs(model: ODCDataParallel) -> dict[str, list[OwnedRun]]:
    """Unwrapped-module parameter name -> the runs of it this DP rank owns."""
    owned = model.engine.owned
    names = module_names(model)
    runs: dict[str, list[OwnedRun]] = {}
    for piece in owned.pieces:
        values = owned.piece_values(piece)
        if piece.name in owned.fp8_names:
            values = values.to(owned.params[piece.name].dtype)
        runs.setdefault(names[piece.name], []).append(OwnedRun(piece, values))
    return runs


def odc_model_sharded_state_dict(
    model: ODCDataParallel, *, for_load: bool, metadata: dict | None = None
) -> ODCModelState:
    """The sharded state dict of an ODC-wrapped model (see the module docstring).

    Keys, global shapes, TP offsets and replica ids come from the unwrapped module's class
    ``sharded_state_dict`` (an instance override, as the Megatron-LM integration installs, is
    bypassed). Collective: it starts with a fence (``begin_shard_writes``), because a load writes
    straight into the owned shards the boxes view and peers may still be reading them; for a save it
    also gathers full tensors for fallback parameters.

    Args:
        model: the ``ODCDataParallel`` chunk.
        for_load: fallback entries get empty tensors to load into instead of gathered values.
        metadata: passed on to the module's ``sharded_state_dict`` (Megatron-LM's content metadata).
    """
    model.engine.begin_shard_writes()
    gpt = unwrap_model(model)
    module_sd = type(gpt).sharded_state_dict(gpt, metadata=metadata)
    params = dict(gpt.named_parameters())
    owned = _owned_runs(model)
    sharded: dict[str, Any] = {}
    templates: dict[str, ShardedTensor] = {}
    boxed: set[str] = set()
    fallback_keys = []
    for key, entry in module_sd.items():
        param = params.get(key)
        if param is None:
            sharded[key] = entry  # buffers, _extra_state objects
            continue
        if isinstance(entry, ShardedTensor) and tuple(entry.local_shape) == tuple(param.shape):
            templates[key] = entry
            boxes = []
            for run in owned.get(key, []):
                boxes += box_tensors(
                    entry,
                    entry.key,
                    run.values,
                    run.piece.param_start,
                    dp_replica(entry.replica_id, model.engine.replica_rank),
                )
            if boxes:
                sharded[key] = boxes
            boxed.add(key)
        else:
            fallback_keys.append(key)
            sharded[key] = entry
    fallback: dict[str, torch.Tensor] = {}
    if fallback_keys:
        # Collective (fetches every unit): every rank has the same keys, so all take this branch.
        logger.info(
            "ODC checkpoint: %d parameter(s) (first %r) saved from gathered full tensors",
            len(fallback_keys),
            fallback_keys[0],
        )
        engine_names = {v: k for k, v in module_names(model).items()}
        full = model.engine.full_parameters() if not for_load else {}
        for key in fallback_keys:
            value = full[engine_names[key]] if not for_load else torch.empty_like(params[key])
            fallback[key] = value
            sharded[key] = _replace_data(sharded[key], value)
    entries = {key: module_sd[key] for key in fallback_keys}
    return ODCModelState(sharded, templates, boxed, fallback, entries, owned)


def _replace_data(entry: Any, data: torch.Tensor) -> Any:
    if isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
        return dataclasses.replace(entry, data=data)
    raise ValueError(
        f"cannot checkpoint {type(entry).__name__} entry {getattr(entry, 'key', '?')!r}"
    )


def write_back(model: ODCDataParallel, state: ODCModelState, loaded: dict) -> None:
    """Copy loaded values into the owned shards (boxes are usually loaded in place already).

    FP8 runs were loaded into copies and are re-quantised (collective over DP).
    """
    for key in state.boxed:
        targets = state.sharded.get(key, [])
        values = loaded.get(key, [])
        assert len(targets) == len(values), key
        for target, value in zip(targets, values):
            if value.data_ptr() != target.data.data_ptr():
                target.data.copy_(value)
    for key in state.fallback:
        full = loaded[key].reshape(-1)
        for run in state.owned.get(key, []):
            start = run.piece.param_start
            run.values.copy_(full[start : start + run.values.numel()])
    engine = model.engine
    if engine.fp8_names:
        by_piece = {run.piece: run.values for runs in state.owned.values() for run in runs}
        engine.write_owned(lambda p: by_piece[p] if p.name in engine.fp8_names else None)
    extra = {
        k: v for k, v in loaded.items() if k.endswith("_extra_state") and not isinstance(v, list)
    }
    if any(v is not None for v in extra.values()):
        unwrap_model(model).load_state_dict(extra, strict=False)


def load_odc_model_state_dict(model: ODCDataParallel, loaded: dict[str, Any]) -> None:
    """Load what ``dist_checkpointing.load`` returned for the ODC module's sharded state dict.

    Boxes usually arrive in place; fallback tensors and ``_extra_state`` are written back; then a
    fence (collective).

    Raises:
        ValueError: a parameter of the model is missing from ``loaded``.
    """
    model.engine.release_all()  # no stale unsharded copies survive the load
    state = odc_model_sharded_state_dict(model, for_load=True)
    missing = [k for k in sorted(state.boxed | set(state.fallback)) if k in state.sharded]
    missing = [k for k in missing if k not in loaded]
    if missing:
        raise ValueError(
            f"ODC model load: parameters {missing[:5]} are missing from the state dict"
        )
    write_back(model, state, loaded)
    model.engine.transport.fence()
