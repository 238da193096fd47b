"""Stateless fetch and push of storage groups over a transport.

:func:`fetch_groups` gathers every bucket of some storage groups from the owners' parameter shards into
the unsharded flat buffers; :func:`push_groups` adds every bucket's gradient slices into the owners'
fp32 accumulators. They take the transport, layout, groups and buffer names explicitly, touch no state
of their own, and return a small result for telemetry (the shape of FSDP2's ``foreach_all_gather``).
Run them on whatever stream the caller chose; the one-sided transports enqueue on the current one.
No megatron import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from megatron_odc.core.layout import Layout
from megatron_odc.core.storage import BufferNames, StorageGroup
from megatron_odc.transport.base import Transport


class TransferResult(NamedTuple):
    """What one fetch or push moved."""

    num_buckets: int
    """Buckets transferred."""
    peer_nbytes: int
    """Bytes moved to or from other ranks (this rank's own shard excluded)."""


def fetch_groups(
    transport: Transport, layout: Layout, groups: Sequence[StorageGroup], names: BufferNames
) -> TransferResult:
    """Assemble every bucket of ``groups`` from every owner's parameter shard (own shard locally)."""
    num_buckets = nbytes = 0
    for group in groups:
        for bucket_index, view in group.buckets(group.params_flat):
            transport.gather_shards(names.param(bucket_index), view)
            num_buckets += 1
            nbytes += layout.buckets[bucket_index].shard_nbytes * (transport.world_size - 1)
    return TransferResult(num_buckets, nbytes)


def push_groups(
    transport: Transport, layout: Layout, groups: Sequence[StorageGroup], names: BufferNames
) -> TransferResult:
    """Add each owner's slice of every bucket's unsharded gradient into the owner's accumulator."""
    num_buckets = nbytes = 0
    for group in groups:
        assert group.grad_flat is not None, group.unit
        for bucket_index, view in group.buckets(group.grad_flat):
            transport.scatter_accumulate(names.grad(bucket_index), view)
            num_buckets += 1
            shard_numel = layout.buckets[bucket_index].shard_numel
            nbytes += shard_numel * view.element_size() * (transport.world_size - 1)
    return TransferResult(num_buckets, nbytes)
