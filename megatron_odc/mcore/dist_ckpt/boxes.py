"""Boxes: this DP rank's owned flat range of a tensor as rectangular ``ShardedTensor`` pieces.

ODC owns flat, row-major ranges of each parameter, which rarely are rectangles. megatron-core's
``dist_checkpointing`` saves rectangular boxes with ``axis_fragmentations=None`` (its "uneven" path), so
:func:`flat_range_boxes` cuts a flat range into at most three boxes per level and :func:`box_tensors`
wraps a flat tensor's pieces as ``ShardedTensor``s placed by a template (the module's own entry: key,
global shape, TP offsets). Every rank of a shard group saves distinct elements, so the DP component of
the replica id is the index of the rank's copy of its shard: 0 under full sharding, the shard group's
index under hybrid sharding (:func:`dp_replica`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor


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


def dp_replica(replica_id: Any, replica_rank: int) -> Any:
    """The replica id with its DP component (the last one) set to ``replica_rank``: the index of this
    rank's copy of its shard (0 under full sharding; with hybrid sharding the shard group's index, so
    ``dist_checkpointing`` writes each shard once, from replica 0)."""
    if isinstance(replica_id, tuple):
        return (*replica_id[:-1], replica_rank) if replica_id else replica_id
    return replica_rank


def box_tensors(
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
