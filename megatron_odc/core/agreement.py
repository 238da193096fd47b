"""Construction-time checks that every DP rank agrees before any one-sided operation touches a peer.

One-sided fetches and pushes trust that every rank built the same bucket layout (otherwise a rank reads
or writes the wrong bytes of a peer's shard, silently) and started from the same weights. Both checks
are collective over the DP group and run once, when an engine is built; each names the first
parameter that differs and the ranks involved. No megatron import.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_odc.core.layout import Layout, check_same_layout
from megatron_odc.transport.devices import collective_device


def _world_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def check_same_layout_on_every_rank(
    layout: Layout, dp_rank: int, group: dist.ProcessGroup | None
) -> None:
    """Compare layout fingerprints over ``group`` (one all-gather; the records only if they differ).

    Raises:
        ValueError: the layouts differ; names the first differing parameter and field.
    """
    world_size = _world_size(group)
    if world_size == 1:
        return
    fingerprints: list[str | None] = [None] * world_size
    dist.all_gather_object(fingerprints, layout.fingerprint(), group=group)
    if len(set(fingerprints)) == 1:
        return
    records: list[list[str] | None] = [None] * world_size
    dist.all_gather_object(records, layout.records(), group=group)
    check_same_layout(layout, records)  # raises, naming the first differing parameter
    raise ValueError(f"DP rank {dp_rank}: bucket layouts differ across DP ranks")


def check_same_values_on_every_rank(
    named: Sequence[tuple[str, torch.Tensor]], dp_rank: int, group: dist.ProcessGroup | None
) -> None:
    """Compare two checksums per tensor (a plain and a position-weighted sum) over ``group``.

    Args:
        named: ``(name, values)`` in the same order on every rank (FP8 parameters: their bytes).
        dp_rank: this rank, for messages.
        group: the DP group.

    Raises:
        ValueError: a tensor differs; names it and the two ranks.
    """
    world_size = _world_size(group)
    if world_size == 1 or not named:
        return
    device = collective_device(group)
    sums = []
    for _, values in named:
        flat = values.reshape(-1).to(device=device, dtype=torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=device).remainder_(
            997.0
        )
        sums.append(torch.stack([flat.sum(), (flat * weights).sum()]))
    mine = torch.stack(sums)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    for other_rank, other in enumerate(gathered):
        differs = (other != mine).any(dim=1) & ~(other.isnan() & mine.isnan()).any(dim=1)
        if bool(differs.any()):
            index = int(differs.nonzero()[0])
            raise ValueError(
                f"DP rank {dp_rank}: parameter {named[index][0]!r} differs between DP rank "
                f"{dp_rank} and DP rank {other_rank}; every DP rank must start from the same "
                "weights (same seed, or call broadcast_params on the plain model first)"
            )
