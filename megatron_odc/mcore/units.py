"""Which parameters of a megatron-core model ODC fetches together, and which are replicated over TP.

Owns the unit policy: every ``TransformerLayer`` is a unit, fetched and released on its own; every other
parameter (embeddings, final norm, output layer, a tied embedding used at both ends) belongs to the root
unit, fetched for the whole forward and backward of a microbatch. :func:`model_units` returns the units
in forward order and each parameter's unit, root first. Also owns the TP-replicated sets
(:func:`tp_replicated`): parameters whose owned gradient slices are summed or averaged over TP after the
fence, told from megatron-core's ``tensor_model_parallel`` attribute, which
:func:`refuse_unmarked_tp_weights` checks is there. With pipeline stages each stage's chunk is cut on its own ([Note: ODC with pipeline stages] in
``pipeline.py``).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

ROOT_UNIT = "root"
"""The unit of every parameter outside a transformer layer."""


@dataclasses.dataclass(frozen=True)
class ModelUnits:
    """A model cut into units.

    Attributes:
        modules: ``(unit, module)`` of every transformer layer, in forward order.
        named_params: ``(name, parameter, unit)`` of every parameter: root unit first, then the layers
            in forward order (stable within a unit).
        has_root: whether any parameter belongs to the root unit.
    """

    modules: list[tuple[str, torch.nn.Module]]
    named_params: list[tuple[str, torch.nn.Parameter, str]]
    has_root: bool


def model_units(module: torch.nn.Module) -> ModelUnits:
    """Cut ``module`` into units (see the module docstring)."""
    modules: list[tuple[str, torch.nn.Module]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, TransformerLayer) and not any(
            name.startswith(u + ".") for u, _ in modules
        ):
            modules.append((name, sub))
    unit_of = {}
    for unit, sub in modules:
        for pname, _ in sub.named_parameters(prefix=unit):
            unit_of[pname] = unit
    named = [(n, p, unit_of.get(n, ROOT_UNIT)) for n, p in module.named_parameters()]
    order = {ROOT_UNIT: -1, **{u: i for i, (u, _) in enumerate(modules)}}
    named.sort(key=lambda t: order[t[2]])
    return ModelUnits(modules, named, any(u == ROOT_UNIT for _, _, u in named))


@dataclasses.dataclass(frozen=True)
class TPReplicated:
    """Parameters held whole on every TP rank, by how their gradients are made equal over TP.

    Attributes:
        summed: partial gradients, summed over TP (sequence-parallel norms, q/k layernorm).
        averaged: the same gradient on every TP rank up to the order in which peers' pushes were
            added; averaged to keep the replicas bitwise identical.
    """

    summed: frozenset[str]
    averaged: frozenset[str]


def refuse_unmarked_tp_weights(module: torch.nn.Module, tp_size: int) -> None:
    """With TP > 1, every weight of megatron-core's own tensor-parallel layers must carry
    ``tensor_model_parallel``: :func:`tp_replicated` would otherwise take it for a replicated weight
    and average its shards' gradients over TP, and the weight export would not gather it. megatron-core
    before 0.19 sets the attribute only when ``config.perform_initialization`` is True (a model built
    on the meta device or for loading weights later has none).

    Raises:
        ValueError: one line naming the first such weight and what to change.
    """
    if tp_size <= 1:
        return
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    for name, sub in module.named_modules():
        if not isinstance(sub, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding):
            continue
        weight = getattr(sub, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            raise ValueError(
                f"{name}.weight ({type(sub).__name__}, split over {tp_size} TP ranks) has no "
                "tensor_model_parallel attribute, which megatron-core before 0.19 sets only with "
                "config.perform_initialization=True: ODC would take it for a replicated weight; "
                "build the model with perform_initialization=True or set the attributes "
                "(megatron.core.tensor_parallel.set_tensor_model_parallel_attributes) before wrapping"
            )


def tp_replicated(
    named_params: list[tuple[str, torch.nn.Parameter, str]], config: TransformerConfig
) -> TPReplicated:
    """The TP-replicated parameters of ``named_params`` under ``config``."""
    summed = frozenset(
        n
        for n, p, _ in named_params
        if (config.sequence_parallel and getattr(p, "sequence_parallel", False))
        or (config.qk_layernorm and ("q_layernorm" in n or "k_layernorm" in n))
    )
    averaged = frozenset(
        n
        for n, p, _ in named_params
        if n not in summed and not getattr(p, "tensor_model_parallel", False)
    )
    return TPReplicated(summed, averaged)
