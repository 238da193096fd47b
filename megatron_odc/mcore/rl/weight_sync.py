"""Rollout weight sync: the trained model's full weights, one unit at a time, to stream to an inference
engine (vLLM / SGLang load ``(name, tensor)`` pairs the way verl pushes them after each step).

:func:`iter_full_weights` yields ``(name, tensor)`` for every parameter of a model under any backend:

- an ODC chunk fetches each unit from its owners, yields copies of its parameters and releases it
  before the next unit is fetched (``ODCEngine.iter_full_parameters``), so beyond the owned shards at
  most one unit is unsharded (plus the tensor being yielded, and with TP its gathered parts);
- megatron-core DDP / a bare model: copies of the parameters in module order.

``gather_tp=True`` merges TP-split parameters into the full tensor (collective over the TP group: every
TP rank iterates together; each DP replica iterates on its own, fetches are one-sided). With
``hf_config`` the names and tensors are Hugging Face's, through the bridge mapping of ``hf_bridge.py``
(QKV and gate/up split, vocabulary padding cut; always TP-merged). Call it between steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

from megatron_odc.mcore import hf_bridge


def _local_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(unwrapped module's name, TP-local copy)`` of every parameter, unit by unit under ODC."""
    engine = getattr(model, "engine", None)
    if engine is not None:
        for name, value in engine.iter_full_parameters():
            yield model.state_key[name], value
        return
    for name, param in unwrap_model(model).named_parameters():
        yield name, param.detach().clone()


def merge_tp(local: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """The full tensor of a TP-split ``param`` from every TP rank's ``local`` value (collective over
    the TP group); ``local`` itself for a parameter that is not split.

    Undoes megatron-core's split: ``partition_stride x TP`` chunks along ``partition_dim``, TP rank
    ``r`` holding chunks ``r, r + TP, ...`` (SwiGLU's fc1 has stride 2: gate and up slices).
    """
    if not getattr(param, "tensor_model_parallel", False):
        return local
    group = parallel_state.get_tensor_model_parallel_group()
    tp_size = dist.get_world_size(group)
    if tp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    dim, stride = param.partition_dim, param.partition_stride
    chunks = [torch.split(p, p.shape[dim] // stride, dim=dim) for p in parts]
    return torch.cat([chunks[r][j] for j in range(stride) for r in range(tp_size)], dim=dim)


def iter_full_weights(
    model: torch.nn.Module, *, gather_tp: bool = False, hf_config: Any = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of ``model``'s full (unsharded over DP) value, unit by unit (see the module
    docstring).

    Args:
        model: a backend wrapper (``ODCDataParallel``, megatron-core DDP) or a bare ``GPTModel``.
        gather_tp: merge TP-split parameters across TP (collective over the TP group).
        hf_config: a Hugging Face config (``hf_bridge.read_hf_config``): yield HF names and tensors.

    Yields:
        ``(name, tensor)``: the unwrapped model's parameter names (TP-local values unless
        ``gather_tp``), or HF names and tensors (on the CPU) with ``hf_config``.
    """
    gpt = unwrap_model(model)
    params = dict(gpt.named_parameters())
    if hf_config is not None:
        bridge = hf_bridge.bridge_for(gpt, hf_config)
        global_names = hf_bridge.hf_global_names(bridge, gpt)
        for name, value in _local_weights(model):
            yield from hf_bridge.hf_tensors_of(
                bridge, global_names[name], name, params[name], value
            )
        return
    for name, value in _local_weights(model):
        yield name, (merge_tp(value, params[name]) if gather_tp else value)
