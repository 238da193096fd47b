"""Checkpoints for every backend through ``megatron.core.dist_checkpointing`` (torch_dist format).

This module owns the on-disk checkpoint layout and the save / load entry points that the training entry
calls for ``odc``, ``fsdp``, ``ddp`` and ``distopt`` alike:

- ``save_dir/iter_{iteration:07d}/``: a torch_dist checkpoint of ``{"model": ..., "optimizer": ...,
  "iteration": ...}``, plus ``extra_state_rank{r}.pt`` per rank (sampler, RNG, scheduler: whatever the
  caller hands in);
- ``save_dir/latest_checkpointed_iteration.txt``: the tracker, Megatron-LM's name and format.

Model weights use the *unwrapped* ``GPTModel``'s ``sharded_state_dict()`` keys, what Megatron-LM writes,
so checkpoints move between backends and between TP and DP sizes. megatron-core's DDP / distopt save the
module's own sharded state dict. ODC frees the module's parameter storage between fetches, so for an
``OdcDataParallel`` model the module's sharded state dict only supplies keys, global shapes, TP offsets and
replica ids: each parameter's ShardedTensor is replaced by "uneven boxes" over this DP rank's owned flat
slice (see :func:`flat_range_boxes`), whose data are views of the owned compute-dtype shard, with
``axis_fragmentations=None`` and the DP component of ``replica_id`` set to 0 (every DP rank saves a
distinct slice). A parameter whose entry is not a plain ShardedTensor of the parameter's shape (e.g. a
``ShardedTensorFactory``) falls back to the gathered full (TP-local) tensor with the module's replica ids.

Optimizer state: megatron-core optimizers save through their own ``sharded_state_dict`` with
``distrib_optim_sharding_type='fully_reshardable'``. ``OdcOptimizer`` saves the fp32 main shard and the
Adam moments of every owned piece as boxes too, under DistOpt's fully-reshardable keys
``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, so a different DP or TP size loads them; the
step count, param-group hyper-parameters and the grad scaler go into the common state.

Megatron-LM's own ``save_checkpoint`` / ``load_checkpoint`` (``--dp-backend odc`` in
``pretrain_gpt.py``) use the same builders: :func:`install_megatron_lm_checkpointing` sets the
unwrapped module's ``sharded_state_dict`` (:func:`odc_model_sharded_state_dict`) and the chunk's
``load_state_dict`` (:func:`load_odc_model_state_dict`) as instance attributes, and ``OdcOptimizer``'s
``sharded_state_dict`` / ``load_state_dict`` call :func:`odc_optimizer_sharded_state_dict` /
:func:`load_odc_optimizer_state_dict`. The on-disk layout is the one :func:`save_checkpoint` writes.

Atomicity: every rank writes into ``iter_x.tmp-<uuid>/``; after a barrier rank 0 renames it to
``iter_x/`` and then replaces the tracker file (write a temporary file, ``os.replace``). A crash at any
point before the rename leaves the previous checkpoint and tracker untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.utils import unwrap_model

from megatron_odc.integration.cpu import active_cpu_patches, cuda_type_names
from megatron_odc.mcore.data_parallel import OdcDataParallel
from megatron_odc.mcore.optimizer import OdcOptimizer
from megatron_odc.transport.devices import all_reduce_on_group_device

logger = logging.getLogger(__name__)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
"""Megatron-LM's tracker file: the latest complete iteration, as a decimal integer."""

OPTIMIZER_SHARDING_TYPE = "fully_reshardable"
"""The DistOpt checkpoint format whose key names ODC's optimizer state uses."""

_OPT_PREFIX = "optimizer.state"
_CHECKPOINT_VERSION = 1


# ---------------------------------------------------------------------------------------- paths


def iteration_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    """``save_dir/iter_{iteration:07d}``, Megatron-LM's directory name."""
    return Path(save_dir) / f"iter_{iteration:07d}"


def latest_iteration(load_dir: str | os.PathLike) -> int | None:
    """The iteration named by the tracker file of ``load_dir``, or None when there is none.

    Raises:
        ValueError: the tracker file exists but does not hold an integer.
    """
    tracker = Path(load_dir) / TRACKER_FILENAME
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"checkpoint tracker {tracker} holds {text!r}, not an iteration") from None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_object(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value if _rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _megatron_optimizer_context() -> Iterator[None]:
    """CUDA tensor-type names for megatron-core optimizer calls on CPU (no-op on GPU)."""
    if active_cpu_patches() is not None:
        with cuda_type_names():
            yield
    else:
        yield


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------- boxes


def flat_range_boxes(
    shape: tuple[int, ...], start: int, end: int
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Cover the row-major flat range ``[start, end)`` of a tensor of ``shape`` by rectangular boxes.

    A 2-D range becomes at most three boxes (a partial first row, full middle rows, a partial last row);
    a 1-D range is one box; higher ranks recurse the same way. Each box is contiguous in the flat order.

    Returns:
        ``(offset, box_shape, flat_offset)`` per box, in flat order: the box's index offset in the
        tensor, its shape, and the flat index of its first element.
    """
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {end}) outside a tensor of shape {shape}")
    if start == end:
        return []
    if len(shape) == 0:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((start,), (end - start,), start)]
    inner_shape = tuple(shape[1:])
    inner = math.prod(inner_shape)
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []

    def _sub(row: int, lo: int, hi: int) -> None:
        for off, box, flat in flat_range_boxes(inner_shape, lo, hi):
            boxes.append(((row, *off), (1, *box), row * inner + flat))

    first_row, last_row = start // inner, (end - 1) // inner
    if first_row == last_row:
        if start % inner == 0 and end - start == inner:
            return [((first_row,) + (0,) * len(inner_shape), (1, *inner_shape), start)]
        _sub(first_row, start % inner, end - first_row * inner)
        return boxes
    full_lo = first_row if start % inner == 0 else first_row + 1
    if full_lo != first_row:
        _sub(first_row, start % inner, inner)
    full_hi = last_row + 1 if end % inner == 0 else last_row
    if full_hi > full_lo:
        boxes.append(
            (
                (full_lo,) + (0,) * len(inner_shape),
                (full_hi - full_lo, *inner_shape),
                full_lo * inner,
            )
        )
    if full_hi == last_row:
        _sub(last_row, 0, end - last_row * inner)
    return boxes


def _dp_replica_zero(replica_id: Any) -> Any:
    """The replica id with its DP component (the last one) set to 0."""
    if isinstance(replica_id, tuple):
        return (*replica_id[:-1], 0) if replica_id else replica_id
    return 0


def _box_tensors(
    template: ShardedTensor, key: str, flat: torch.Tensor, flat_start: int, replica_id: Any
) -> list[ShardedTensor]:
    """ShardedTensors over ``flat`` (this rank's piece of ``template``'s local tensor, flat order).

    ``flat`` holds flat elements ``[flat_start, flat_start + flat.numel())`` of the local tensor.
    """
    prepend = template.prepend_axis_num
    out = []
    for offset, box_shape, flat_offset in flat_range_boxes(
        tuple(template.local_shape), flat_start, flat_start + flat.numel()
    ):
        lo = flat_offset - flat_start
        # Prepended axes (stacked layers) become explicit size-1 axes: megatron-core 0.16.1's uneven
        # (non-grid) path sizes chunks by local_shape but offsets them by the global rank, so a
        # prepended axis there breaks torch's plan validation. The stored tensor is the same.
        local_shape = (1,) * prepend + tuple(box_shape)
        data = flat[lo : lo + math.prod(box_shape)].view(local_shape)
        global_offset = tuple(template.global_offset[:prepend]) + tuple(
            g + o for g, o in zip(template.global_offset[prepend:], offset)
        )
        out.append(
            ShardedTensor(
                key=key,
                data=data,
                dtype=data.dtype,
                local_shape=local_shape,
                global_shape=tuple(template.global_shape),
                global_offset=global_offset,
                axis_fragmentations=None,
                replica_id=replica_id,
                prepend_axis_num=0,
                allow_shape_mismatch=template.allow_shape_mismatch,
            )
        )
    return out


# ---------------------------------------------------------------------------------------- ODC model


@dataclasses.dataclass
class _OwnedPiece:
    """A contiguous run of one parameter's elements that this DP rank owns."""

    shard: (
        torch.Tensor
    )  # the owned compute-dtype shard slice (1-D view; a dequantised copy for FP8)
    param_flat_start: int  # flat offset of shard[0] in the (TP-local) parameter
    bucket_index: int
    shard_lo: int  # offset of the run inside the bucket's shard
    fp8: bool = False  # ``shard`` stands for FP8 bytes: written back by re-quantising


def _odc_name_map(model: OdcDataParallel, gpt: torch.nn.Module) -> dict[str, str]:
    """Engine parameter name -> unwrapped-module parameter name (they differ under Float16Module)."""
    gpt_name_of = {id(p): n for n, p in gpt.named_parameters()}
    out = {}
    for name, param in model.engine.parameters():
        if id(param) not in gpt_name_of:
            raise ValueError(f"ODC parameter {name!r} is not a parameter of the unwrapped model")
        out[name] = gpt_name_of[id(param)]
    return out


def _odc_owned_pieces(model: OdcDataParallel, gpt: torch.nn.Module) -> dict[str, list[_OwnedPiece]]:
    """Unwrapped-module parameter name -> the runs of it this DP rank owns.

    FP8 parameters are saved as their values in the parameter's dtype (a dequantised copy of the owned
    bytes), so checkpoints stay loadable by bf16 runs and other backends.
    """
    engine = model.engine
    names = _odc_name_map(model, gpt)
    params = dict(engine.parameters())
    pieces: dict[str, list[_OwnedPiece]] = {}
    for owned in engine.owned_pieces():
        shard = engine.param_shard(owned.bucket_index)[owned.shard_lo : owned.shard_hi]
        fp8 = owned.name in engine.fp8_names
        if fp8:
            param = params[owned.name]
            shard = engine.fp8_codec.dequantize_bytes(param, shard).to(param.dtype)
        pieces.setdefault(names[owned.name], []).append(
            _OwnedPiece(shard, owned.param_start, owned.bucket_index, owned.shard_lo, fp8)
        )
    return pieces


@dataclasses.dataclass
class OdcModelState:
    """The ODC model's sharded state dict plus what load needs to write back."""

    sharded: dict[str, Any]
    templates: dict[str, ShardedTensor]  # module key -> the module's own ShardedTensor
    boxed: set[str]  # module keys saved as boxes over owned shards
    fallback: dict[str, torch.Tensor]  # module key -> full local tensor (gathered or to load into)
    fallback_entries: dict[str, Any]  # module key -> the module's own entry (e.g. a factory)
    owned: dict[
        str, list[_OwnedPiece]
    ]  # module key -> this rank's owned runs (what the boxes hold)


def odc_model_sharded_state_dict(
    model: OdcDataParallel,
    gpt: torch.nn.Module,
    *,
    for_load: bool,
    metadata: dict | None = None,
) -> OdcModelState:
    """The sharded state dict of an ODC-wrapped model: owned-slice boxes (see the module docstring).

    Keys, global shapes, TP offsets and replica ids come from the module's own class
    ``sharded_state_dict`` (an instance override, :func:`install_megatron_lm_checkpointing`, is
    bypassed). Collective: it starts with a fence (``begin_shard_writes``), because a load writes
    straight into the owned shards the boxes view, and peers may still be reading them; it also
    gathers full tensors for fallback parameters when ``for_load`` is false.

    Args:
        model: the ``OdcDataParallel`` chunk.
        gpt: its unwrapped module (``unwrap_model(model)``).
        for_load: fallback entries get empty tensors to load into instead of gathered values.
        metadata: passed on to the module's ``sharded_state_dict`` (Megatron-LM's content metadata).
    """
    model.engine.begin_shard_writes()
    module_sd = type(gpt).sharded_state_dict(gpt, metadata=metadata)
    params = dict(gpt.named_parameters())
    owned = _odc_owned_pieces(model, gpt)
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
            for piece in owned.get(key, []):
                boxes += _box_tensors(
                    entry,
                    entry.key,
                    piece.shard,
                    piece.param_flat_start,
                    _dp_replica_zero(entry.replica_id),
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
        engine_names = {v: k for k, v in _odc_name_map(model, gpt).items()}
        full = model.engine.full_parameters() if not for_load else {}
        for key in fallback_keys:
            value = full[engine_names[key]] if not for_load else torch.empty_like(params[key])
            fallback[key] = value
            sharded[key] = _replace_data(sharded[key], value)
    entries = {key: module_sd[key] for key in fallback_keys}
    return OdcModelState(sharded, templates, boxed, fallback, entries, owned)


def _replace_data(entry: Any, data: torch.Tensor) -> Any:
    if isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
        return dataclasses.replace(entry, data=data)
    raise ValueError(
        f"cannot checkpoint {type(entry).__name__} entry {getattr(entry, 'key', '?')!r}"
    )


def _odc_write_back(
    model: OdcDataParallel, gpt: torch.nn.Module, state: OdcModelState, loaded: dict
) -> None:
    """Copy loaded values into the owned shards (boxes are usually loaded in place already)."""
    for key in state.boxed:
        targets = state.sharded.get(key, [])
        values = loaded.get(key, [])
        assert len(targets) == len(values), key
        for target, value in zip(targets, values):
            if value.data_ptr() != target.data.data_ptr():
                target.data.copy_(value)
    for key in state.fallback:
        full = loaded[key].reshape(-1)
        for piece in state.owned.get(key, []):
            piece.shard.copy_(
                full[piece.param_flat_start : piece.param_flat_start + piece.shard.numel()]
            )
    engine = model.engine
    if engine.fp8_names:  # FP8 pieces were loaded into copies: re-quantise them (collective)
        by_run = {
            (p.bucket_index, p.shard_lo): p.shard for pieces in state.owned.values() for p in pieces
        }
        engine.write_owned(
            lambda p: by_run[(p.bucket_index, p.shard_lo)] if p.name in engine.fp8_names else None
        )
    extra = {
        k: v for k, v in loaded.items() if k.endswith("_extra_state") and not isinstance(v, list)
    }
    if any(v is not None for v in extra.values()):
        gpt.load_state_dict(extra, strict=False)


# ---------------------------------------------------------------------------------------- ODC optimizer


def _odc_optimizer_sharded_state_dict(
    optimizer: OdcOptimizer,
    model: OdcDataParallel,
    gpt: torch.nn.Module,
    model_state: OdcModelState,
    *,
    for_load: bool,
    with_moments: bool,
) -> tuple[dict[str, Any], list[tuple[str, str, list[tuple[torch.Tensor, int]]]]]:
    """DistOpt ``fully_reshardable``-style state of the ODC optimizer over the owned pieces.

    ``param`` (the fp32 main values) and, with ``with_moments``, the Adam moments, as boxes keyed
    ``optimizer.state.<state key>.<model key>``. For a load, missing moments are created (zeros) so
    that the checkpoint is read straight into them.

    Parameters whose model entry fell back to full tensors (``ShardedTensorFactory``, e.g. SwiGLU's
    fc1 under TP) get their optimizer state gathered over DP (one all-reduce per state) and saved
    through the module's own entry, like DistOpt does.

    Returns:
        ``{module parameter name: {state key: [boxes] or a full-tensor entry}}`` and, for the
        full-tensor entries, ``(name, state key, [(owned piece tensor, flat start)])`` to write the
        loaded values back.
    """
    templates = model_state.templates
    names = _odc_name_map(model, gpt)
    engine = model.engine
    # (bucket_index, shard_lo) -> parameter flat start, for the pieces of this model's engine.
    flat_start_of = {(p.bucket_index, p.shard_lo): p.param_start for p in engine.owned_pieces()}
    inner = optimizer.optimizer
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        state_keys = ["exp_avg", "exp_avg_sq"]
    else:
        state_keys = []
        if with_moments and _rank() == 0:
            logger.warning(
                "ODC checkpoint: %s state other than the main parameters is not saved; a resume is "
                "not exact",
                type(inner).__name__,
            )
    param_state: dict[str, dict[str, Any]] = {}
    gathered: dict[str, dict[str, list[tuple[torch.Tensor, int]]]] = {}
    for piece, piece_engine, bucket_index, lo, _hi in optimizer.owned_pieces:
        if piece_engine is not engine:
            continue
        key = names[piece.odc_name]
        flat_start = flat_start_of[(bucket_index, lo)]
        tensors: dict[str, torch.Tensor] = {"param": piece.data}
        if with_moments:
            state = inner.state[piece]
            for sk in state_keys:
                if sk in state:
                    tensors[sk] = state[sk]
                elif for_load:
                    state[sk] = torch.zeros_like(piece.data, memory_format=torch.preserve_format)
                    tensors[sk] = state[sk]
                else:  # no step taken yet: Adam's moments are zero
                    tensors[sk] = torch.zeros_like(piece.data)
        template = templates.get(key)
        if template is None:
            assert key in model_state.fallback_entries, key
            for sk, tensor in tensors.items():
                gathered.setdefault(key, {}).setdefault(sk, []).append((tensor, flat_start))
            continue
        replica_id = _dp_replica_zero(template.replica_id)
        entry = param_state.setdefault(key, {})
        for sk, tensor in tensors.items():
            entry.setdefault(sk, []).extend(
                _box_tensors(
                    template, f"{_OPT_PREFIX}.{sk}.{template.key}", tensor, flat_start, replica_id
                )
            )

    write_back = []
    params = dict(gpt.named_parameters())
    state_names = ["param"] + (state_keys if with_moments else [])
    for key in sorted(model_state.fallback_entries):  # the same order on every rank: collectives
        module_entry = model_state.fallback_entries[key]
        shape = params[key].shape
        for sk in state_names:
            runs = gathered.get(key, {}).get(sk, [])
            full = torch.zeros(math.prod(shape), dtype=torch.float32)
            if not for_load:
                for tensor, flat_start in runs:
                    full[flat_start : flat_start + tensor.numel()] = tensor
                all_reduce_on_group_device(full, group=model.dp_group)
            changes: dict[str, Any] = {
                "key": f"{_OPT_PREFIX}.{sk}.{module_entry.key}",
                "data": full.view(shape),
            }
            if isinstance(module_entry, ShardedTensor):
                changes["dtype"] = full.dtype
            param_state.setdefault(key, {})[sk] = dataclasses.replace(module_entry, **changes)
            write_back.append((key, sk, runs))
    return param_state, write_back


def _odc_optimizer_write_back(
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


def _odc_optimizer_common(optimizer: OdcOptimizer) -> dict[str, Any]:
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


def _odc_optimizer_load_common(optimizer: OdcOptimizer, common: dict[str, Any]) -> int:
    """Restore steps, param-group hyper-parameters and the grad scaler; return the step."""
    inner = optimizer.optimizer
    groups = common.get("optimizer", {}).get("param_groups", [])
    step = int(groups[0].get("step", 0)) if groups else 0
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
    for piece, *_ in optimizer.owned_pieces:
        state = inner.state[piece]
        if step > 0 and "exp_avg" in state:
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
    scaler = common.get("grad_scaler")
    if optimizer.grad_scaler is not None and scaler is not None:
        optimizer.grad_scaler.load_state_dict(scaler)
    return step


# ---------------------------------------------------------------------------------------- Megatron-LM


def _single_chunk(optimizer: OdcOptimizer) -> OdcDataParallel:
    chunks = optimizer.model_chunks
    if len(chunks) != 1:
        raise ValueError(
            f"ODC distributed checkpoints support one model chunk; the optimizer has {len(chunks)}"
        )
    return chunks[0]


def odc_optimizer_sharded_state_dict(
    optimizer: OdcOptimizer, *, is_loading: bool
) -> dict[str, Any]:
    """The optimizer part of a torch_dist checkpoint (``OdcOptimizer.sharded_state_dict``).

    The layout :func:`save_checkpoint` writes under ``"optimizer"``: the common state (steps,
    param-group hyper-parameters, grad scaler, ``param_state_sharding_type``) and ``param_state``
    boxes under DistOpt's fully-reshardable keys. Unlike :func:`save_checkpoint`, Adam's moments are
    always present (zeros before the first step), because Megatron-LM builds the loading state dict
    without reading the checkpoint first. Collective when saving (step count, fallback gathers).

    Args:
        optimizer: the ``OdcOptimizer`` (one model chunk).
        is_loading: build the state to load into (moments are created where missing) instead of the
            state to save.
    """
    model = _single_chunk(optimizer)
    gpt = unwrap_model(model)
    model_state = odc_model_sharded_state_dict(model, gpt, for_load=True)  # keys and templates
    param_state, _ = _odc_optimizer_sharded_state_dict(
        optimizer, model, gpt, model_state, for_load=is_loading, with_moments=True
    )
    if is_loading:
        return {"param_state": param_state}
    return {**_odc_optimizer_common(optimizer), "param_state": param_state}


def load_odc_optimizer_state_dict(optimizer: OdcOptimizer, state_dict: dict[str, Any]) -> None:
    """Load what ``dist_checkpointing.load`` returned for :func:`odc_optimizer_sharded_state_dict`.

    The main shards and moments are usually loaded in place already; the rest is copied, the step
    count, hyper-parameters and grad scaler are restored, and the model shards are rewritten from the
    fp32 main shards, then fenced (collective).

    Raises:
        ValueError: the checkpoint's optimizer state is not in the fully-reshardable format.
    """
    sharding_type = state_dict.get("param_state_sharding_type")
    if sharding_type != OPTIMIZER_SHARDING_TYPE:
        raise ValueError(
            f"optimizer state format {sharding_type!r} cannot be loaded by the ODC optimizer; save it "
            f"as {OPTIMIZER_SHARDING_TYPE!r} (--use-distributed-optimizer "
            "--dist-ckpt-optim-fully-reshardable) or load weights only (--finetune or --no-load-optim)"
        )
    model = _single_chunk(optimizer)
    gpt = unwrap_model(model)
    model_state = odc_model_sharded_state_dict(model, gpt, for_load=True)
    param_state, write_back = _odc_optimizer_sharded_state_dict(
        optimizer, model, gpt, model_state, for_load=True, with_moments=True
    )
    _odc_optimizer_write_back(param_state, write_back, state_dict["param_state"])
    step = _odc_optimizer_load_common(optimizer, state_dict)
    if step == 0:  # saved before the first step: Adam starts from empty state, as it did there
        for piece, *_ in optimizer.owned_pieces:
            optimizer.optimizer.state.pop(piece, None)
    model.engine.release_all()  # no stale unsharded copies survive the load
    model.engine.begin_shard_writes()  # peers may still be reading the current shards
    optimizer._copy_main_params_to_model_params()
    optimizer._end_step()  # collective: the loaded shards are visible to every rank


def load_odc_model_state_dict(
    model: OdcDataParallel, loaded: dict[str, Any], *, optimizer: OdcOptimizer | None = None
) -> None:
    """Load what ``dist_checkpointing.load`` returned for the ODC module's sharded state dict.

    Boxes usually arrive in place; fallback tensors and ``_extra_state`` are written back. Then a
    fence (collective), and ``optimizer``'s main shards are refreshed from the loaded weights (a
    weights-only load; a later optimizer load overwrites them).

    Raises:
        ValueError: a parameter of the model is missing from ``loaded``.
    """
    gpt = unwrap_model(model)
    model.engine.release_all()  # no stale unsharded copies survive the load
    state = odc_model_sharded_state_dict(model, gpt, for_load=True)
    missing = [k for k in sorted(state.boxed | set(state.fallback)) if k in state.sharded]
    missing = [k for k in missing if k not in loaded]
    if missing:
        raise ValueError(
            f"ODC model load: parameters {missing[:5]} are missing from the state dict"
        )
    _odc_write_back(model, gpt, state, loaded)
    model.engine.transport.fence()
    if optimizer is not None:
        optimizer.reload_model_params()


class _OdcModuleShardedStateDict:
    """The unwrapped module's ``sharded_state_dict`` under ODC: :func:`odc_model_sharded_state_dict`."""

    def __init__(self, model: OdcDataParallel) -> None:
        self.model = model

    def __call__(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        if prefix or sharded_offsets:
            raise ValueError(
                f"the ODC module's sharded_state_dict takes no prefix ({prefix!r}) or sharded "
                f"offsets ({sharded_offsets!r}): pipeline and virtual pipeline stages are unsupported"
            )
        gpt = unwrap_model(self.model)
        return odc_model_sharded_state_dict(
            self.model, gpt, for_load=False, metadata=metadata
        ).sharded


class _OdcLoadStateDict:
    """The ``OdcDataParallel`` chunk's ``load_state_dict`` for dist-checkpoint state dicts."""

    def __init__(self, model: OdcDataParallel, optimizer: OdcOptimizer | None) -> None:
        self.model = model
        self.optimizer = optimizer

    def __call__(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        load_odc_model_state_dict(self.model, state_dict, optimizer=self.optimizer)
        return torch.nn.modules.module._IncompatibleKeys([], [])


def install_megatron_lm_checkpointing(
    model: OdcDataParallel, optimizer: OdcOptimizer | None = None
) -> None:
    """Route Megatron-LM's own torch_dist ``save_checkpoint`` / ``load_checkpoint`` through this module.

    Megatron-LM saves ``unwrap_model(model).sharded_state_dict(metadata=...)`` and
    ``optimizer.sharded_state_dict(...)``; it loads into the same and then calls
    ``model.load_state_dict(loaded["model"])`` and ``optimizer.load_state_dict(loaded["optimizer"])``.
    This sets two instance attributes: the unwrapped module's ``sharded_state_dict`` (owned-slice
    boxes, :func:`odc_model_sharded_state_dict`) and the chunk's ``load_state_dict``
    (:func:`load_odc_model_state_dict`, which also refreshes ``optimizer``'s main shards). Calling it
    again (e.g. once the optimizer exists) replaces both.
    """
    if not isinstance(model, OdcDataParallel):
        raise ValueError(f"expected an OdcDataParallel chunk, got {type(model).__name__}")
    unwrap_model(model).sharded_state_dict = _OdcModuleShardedStateDict(model)
    model.load_state_dict = _OdcLoadStateDict(model, optimizer)


# ---------------------------------------------------------------------------------------- checks


def _check_fits_checkpoint(sharded: dict[str, Any], checkpoint_dir: Path, what: str) -> None:
    """Raise ValueError naming the first tensor missing from the checkpoint or of another shape."""
    saved = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir))
    seen = set()
    for entry in _nested_values(sharded):
        if not isinstance(entry, ShardedTensor) or entry.key in seen:
            continue
        seen.add(entry.key)
        ref = saved.get(entry.key)
        if ref is None:
            raise ValueError(
                f"checkpoint {checkpoint_dir} does not fit the {what}: tensor {entry.key!r} is missing "
                "from the checkpoint"
            )
        if tuple(ref.global_shape) != tuple(entry.global_shape) and not entry.allow_shape_mismatch:
            raise ValueError(
                f"checkpoint {checkpoint_dir} does not fit the {what}: tensor {entry.key!r} has "
                f"shape {tuple(ref.global_shape)} in the checkpoint, {tuple(entry.global_shape)} in "
                "the model"
            )


def _nested_values(x: Any) -> Iterator[Any]:
    if isinstance(x, dict):
        for v in x.values():
            yield from _nested_values(v)
    elif isinstance(x, list):
        for v in x:
            yield from _nested_values(v)
    else:
        yield x


# ---------------------------------------------------------------------------------------- build


def _megatron_optimizer_sharded(optimizer: Any, model_sd: dict, *, is_loading: bool) -> dict:
    with _megatron_optimizer_context():
        return optimizer.sharded_state_dict(
            model_sd,
            is_loading,
            metadata={"distrib_optim_sharding_type": OPTIMIZER_SHARDING_TYPE},
        )


# ---------------------------------------------------------------------------------------- save


def save_checkpoint(
    save_dir: str | os.PathLike,
    iteration: int,
    model: torch.nn.Module,
    optimizer: Any,
    *,
    extra_state: dict,
) -> None:
    """Save model, optimizer and per-rank ``extra_state`` as ``save_dir/iter_{iteration:07d}``.

    Collective over every rank. The tracker ``latest_checkpointed_iteration.txt`` is replaced only after
    every rank has finished writing and the directory has been renamed into place, so a crash mid-save
    leaves the previous checkpoint loadable.

    Args:
        save_dir: checkpoint root (created if missing).
        iteration: the iteration number to record.
        model: the DP-wrapped model chunk (``OdcDataParallel`` or megatron-core
            ``DistributedDataParallel``).
        optimizer: ``OdcOptimizer`` or a megatron-core optimizer; None saves weights only.
        extra_state: picklable per-rank state (sampler, RNG, scheduler), returned by load on the same
            rank.
    """
    _check_writer_dependencies()
    save_dir = Path(save_dir)
    rank = _rank()
    token = _broadcast_object(uuid.uuid4().hex[:12])
    final_dir = iteration_dir(save_dir, iteration)
    tmp_dir = final_dir.with_name(f"{final_dir.name}.tmp-{token}")
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        for stale in save_dir.glob("iter_*.tmp-*"):
            logger.warning("removing an incomplete checkpoint directory %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp_dir.mkdir()
    _barrier()

    gpt = unwrap_model(model)
    state: dict[str, Any] = {"iteration": int(iteration), "checkpoint_version": _CHECKPOINT_VERSION}
    if isinstance(model, OdcDataParallel):
        model_state = odc_model_sharded_state_dict(model, gpt, for_load=False)
        state["model"] = model_state.sharded
        if optimizer is not None:
            if not isinstance(optimizer, OdcOptimizer):
                raise ValueError(
                    f"an ODC model needs an OdcOptimizer, got {type(optimizer).__name__}"
                )
            common = _odc_optimizer_common(optimizer)
            step = common["optimizer"]["param_groups"][0]["step"]
            param_state, _ = _odc_optimizer_sharded_state_dict(
                optimizer,
                model,
                gpt,
                model_state,
                for_load=False,
                with_moments=step > 0,
            )
            state["optimizer"] = {**common, "param_state": param_state}
    else:
        model_sd = gpt.sharded_state_dict()
        state["model"] = model_sd
        if optimizer is not None:
            state["optimizer"] = _megatron_optimizer_sharded(optimizer, model_sd, is_loading=False)

    _save_sharded(state, tmp_dir)
    torch.save(extra_state, tmp_dir / f"extra_state_rank{rank}.pt")
    _barrier()
    if rank == 0:
        (tmp_dir / "odc_world_size.txt").write_text(f"{_world_size()}\n")
        _fsync_dir(tmp_dir)
        if final_dir.exists():
            old = final_dir.with_name(f"{final_dir.name}.tmp-old-{token}")
            os.replace(final_dir, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp_dir, final_dir)
        _fsync_dir(save_dir)
        tracker_tmp = save_dir / f"{TRACKER_FILENAME}.tmp-{token}"
        with open(tracker_tmp, "w") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, save_dir / TRACKER_FILENAME)
        _fsync_dir(save_dir)
        logger.info("saved checkpoint iteration %d to %s", iteration, final_dir)
    _barrier()


def _check_writer_dependencies() -> None:
    """megatron's torch_dist writer processes need psutil; without it a save hangs, so fail first."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "saving a torch_dist checkpoint needs the psutil package (megatron-core's writer "
            "processes import it and a save would hang without it): pip install psutil"
        ) from None


def _save_sharded(state: dict[str, Any], checkpoint_dir: Path) -> None:
    """``dist_checkpointing.save`` (a separate function so tests can interrupt a save here)."""
    with _megatron_optimizer_context():
        dist_checkpointing.save(state, str(checkpoint_dir))


# ---------------------------------------------------------------------------------------- load


def load_checkpoint(
    load_dir: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any,
    *,
    finetune: bool = False,
) -> tuple[int, dict]:
    """Load the latest checkpoint of ``load_dir`` into ``model`` (and ``optimizer``).

    Collective over every rank. With ``finetune=True`` only the weights are loaded, the optimizer's main
    parameters are refreshed from them (``reload_model_params``), and ``(0, {})`` is returned.

    Returns:
        ``(iteration, extra_state)``: the saved iteration and this rank's ``extra_state``. When the
        world size differs from the saving run's, rank 0's extra state is returned on every rank (the
        sampler and scheduler state are global; per-rank RNG states then come from rank 0).

    Raises:
        ValueError: no checkpoint in ``load_dir``, or the checkpoint does not fit the model (a tensor is
            missing or has another shape; the message names it).
    """
    iteration = latest_iteration(load_dir)
    if iteration is None:
        raise ValueError(f"no checkpoint in {load_dir}: {TRACKER_FILENAME} is missing")
    checkpoint_dir = iteration_dir(load_dir, iteration)
    if not checkpoint_dir.is_dir():
        raise ValueError(
            f"{TRACKER_FILENAME} in {load_dir} names iteration {iteration}, but {checkpoint_dir} "
            "does not exist"
        )
    load_optimizer = optimizer is not None and not finetune
    gpt = unwrap_model(model)
    is_odc = isinstance(model, OdcDataParallel)

    state: dict[str, Any] = {}
    odc_state = None
    if is_odc:
        model.engine.release_all()  # no stale unsharded copies survive the load
        odc_state = odc_model_sharded_state_dict(model, gpt, for_load=True)
        state["model"] = odc_state.sharded
    else:
        state["model"] = gpt.sharded_state_dict()
    _check_fits_checkpoint(state["model"], checkpoint_dir, "model")

    common = dist_checkpointing.load_common_state_dict(str(checkpoint_dir))
    if load_optimizer:
        if "optimizer" not in common:
            raise ValueError(
                f"checkpoint {checkpoint_dir} holds no optimizer state; load it with finetune=True"
            )
        if is_odc:
            if not isinstance(optimizer, OdcOptimizer):
                raise ValueError(
                    f"an ODC model needs an OdcOptimizer, got {type(optimizer).__name__}"
                )
            saved_common = common["optimizer"]
            sharding_type = saved_common.get("param_state_sharding_type")
            if sharding_type != OPTIMIZER_SHARDING_TYPE:
                raise ValueError(
                    f"checkpoint {checkpoint_dir}: optimizer state format {sharding_type!r} cannot be "
                    f"loaded by the ODC optimizer; re-save it as {OPTIMIZER_SHARDING_TYPE!r} "
                    "(--dist-ckpt-optim-fully-reshardable) or load weights only (finetune=True)"
                )
            groups = saved_common.get("optimizer", {}).get("param_groups", [])
            saved_step = int(groups[0].get("step", 0) or 0) if groups else 0
            param_state, write_back = _odc_optimizer_sharded_state_dict(
                optimizer,
                model,
                gpt,
                odc_state,
                for_load=True,
                with_moments=saved_step > 0,
            )
            state["optimizer"] = {"param_state": param_state}
        else:
            state["optimizer"] = _megatron_optimizer_sharded(
                optimizer, state["model"], is_loading=True
            )
        _check_fits_checkpoint(state["optimizer"], checkpoint_dir, "optimizer")

    with _megatron_optimizer_context():
        loaded = dist_checkpointing.load(state, str(checkpoint_dir))

    if is_odc:
        _odc_write_back(model, gpt, odc_state, loaded["model"])
        if load_optimizer:
            _odc_optimizer_write_back(
                state["optimizer"]["param_state"], write_back, loaded["optimizer"]["param_state"]
            )
            # Model shards hold the saved compute-dtype values, main shards the fp32 ones.
            _odc_optimizer_load_common(optimizer, common["optimizer"])
        model.engine.transport.fence()
        if optimizer is not None and not load_optimizer:
            optimizer.reload_model_params()
    else:
        missing_unexpected = gpt.load_state_dict(loaded["model"], strict=False)
        missing = [k for k in missing_unexpected.missing_keys if not k.endswith("_extra_state")]
        if missing:
            raise ValueError(
                f"checkpoint {checkpoint_dir}: model keys {missing[:5]} were not loaded"
            )
        if load_optimizer:
            with _megatron_optimizer_context():
                optimizer.load_state_dict(loaded["optimizer"])
        elif optimizer is not None:
            with _megatron_optimizer_context():
                optimizer.reload_model_params()

    if finetune:
        return 0, {}
    return iteration, _load_extra_state(checkpoint_dir)


def _load_extra_state(checkpoint_dir: Path) -> dict:
    saved_world = checkpoint_dir / "odc_world_size.txt"
    world_size = int(saved_world.read_text().strip()) if saved_world.is_file() else None
    rank = _rank()
    same_world = world_size == _world_size()
    path = checkpoint_dir / f"extra_state_rank{rank if same_world else 0}.pt"
    if not path.is_file():
        return {}
    if not same_world and rank == 0:
        logger.warning(
            "checkpoint %s was saved by %s ranks, loading on %d: every rank gets rank 0's extra state",
            checkpoint_dir,
            world_size,
            _world_size(),
        )
    return torch.load(path, weights_only=False)
