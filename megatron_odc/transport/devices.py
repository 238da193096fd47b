"""Which device a process group's collectives need, so small reductions work on every backend.

NCCL reduces CUDA tensors only; gloo reduces CPU tensors everywhere (its CUDA support depends on the
build). ``collective_device(group)`` names the device a collective over ``group`` should run on, and
``all_reduce_on_group_device`` runs a (small) all-reduce there and writes the result back into the
caller's tensor, whatever device that lives on. This module imports no megatron module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEVICE_BACKENDS = {"nccl": "cuda", "xccl": "xpu"}
"""Process-group backends whose collectives need tensors on an accelerator, and that device type."""


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device collectives over ``group`` run on: the current accelerator for NCCL, else the CPU."""
    if not dist.is_initialized():
        return torch.device("cpu")
    kind = DEVICE_BACKENDS.get(str(dist.get_backend(group)).lower())
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if kind is not None:
        return torch.device(kind)
    return torch.device("cpu")


def all_reduce_on_group_device(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group``, moving it to the group's device and back if needed."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tensor
    device = collective_device(group)
    if tensor.device == device:
        dist.all_reduce(tensor, op=op, group=group)
        return tensor
    moved = tensor.to(device)
    dist.all_reduce(moved, op=op, group=group)
    tensor.copy_(moved)
    return tensor


def every_rank_int(value: int, group: dist.ProcessGroup | None = None) -> list[int]:
    """Each rank's ``value``, in group-rank order, on every rank of ``group`` (one small all-reduce
    on the group's device: every rank writes its own slot of a zero vector)."""
    if not dist.is_initialized():
        return [int(value)]
    values = torch.zeros(
        dist.get_world_size(group), dtype=torch.int64, device=collective_device(group)
    )
    values[dist.get_rank(group)] = int(value)
    all_reduce_on_group_device(values, group=group)
    return values.tolist()
