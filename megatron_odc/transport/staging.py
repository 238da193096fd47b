"""Staging slots and the fixed-order owner reduce: the deterministic accumulate shared by the transports.

In a deterministic accumulate mode every owner keeps, per accumulate buffer, a *staging* buffer of
``world_size`` slots of one shard each: slot ``s`` belongs to source ``s`` and only ``s`` writes it, so no
lock or atomic is needed. At the fence the owner adds the slots into its shard in the fixed order
0, 1, ..., W-1 (never arrival order) and zeroes them, so the result is bitwise reproducible.

Pure torch, any device; used by ``shm`` (CPU shared memory), ``cuda`` and ``nvshmem`` (symmetric memory)
and ``mpi`` (RMA windows). It imports no megatron module.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def staging_slot_offset(src_rank: int, world_size: int, shard_numel: int) -> int:
    """Element offset of source ``src_rank``'s slot in an owner's staging buffer.

    The staging buffer of a buffer with ``shard_numel`` elements per rank holds ``world_size`` slots of
    ``shard_numel`` elements, slot ``s`` at ``s * shard_numel``; only source ``s`` writes slot ``s``.

    Raises:
        ValueError: ``src_rank`` is outside the group or ``shard_numel`` is negative.
    """
    if not 0 <= src_rank < world_size:
        raise ValueError(f"source rank {src_rank} is outside a group of size {world_size}")
    if shard_numel < 0:
        raise ValueError(f"shard_numel must be >= 0, got {shard_numel}")
    return src_rank * shard_numel


def staging_numel(world_size: int, shard_numel: int) -> int:
    """Elements of one owner's staging buffer: one shard-sized slot per source."""
    return world_size * shard_numel


def owner_reduce_order(world_size: int) -> list[int]:
    """The order in which an owner adds the staging slots: source 0, 1, ..., W-1, whatever the arrival.

    A fixed order (not arrival order) is what makes the deterministic mode bitwise reproducible.
    """
    return list(range(world_size))


def owner_reduce(
    accumulator: torch.Tensor,
    staging: torch.Tensor,
    world_size: int,
    sources: Iterable[int] | None = None,
) -> None:
    """Deterministic owner-side reduce: add every source's slot into ``accumulator``, then zero the slots.

    Adds slot by slot in ``owner_reduce_order`` so the result depends only on the slot contents, never
    on which source finished first. Works on any device (pure torch).

    Args:
        accumulator: the owner's fp32 shard (``n`` elements).
        staging: the owner's staging buffer (``world_size * n`` elements).
        world_size: number of sources.
        sources: only these sources' slots are added and zeroed (the others must be zero: adding a zero
            slot changes no bit, so skipping it is exact); ``None`` means all of them.
    """
    n = accumulator.numel()
    assert staging.numel() == staging_numel(world_size, n), (staging.numel(), world_size, n)
    slots = staging.view(world_size, n)
    if sources is None:
        for src in owner_reduce_order(world_size):
            accumulator.add_(slots[src])
        staging.zero_()
        return
    wanted = set(sources)
    for src in owner_reduce_order(world_size):
        if src in wanted:
            accumulator.add_(slots[src])
            slots[src].zero_()
