"""Inputs and rank-side checks shared by the transport tests (any ``Transport`` backend)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from megatron_odc.transport import Transport, TransportError


def mismatched_registrations(rank: int, world_size: int) -> list[tuple[str, str, int, torch.dtype]]:
    """``(field, name, numel, dtype)`` per case: the last rank registers something else in ``field``."""
    last = world_size - 1
    return [
        ("name", "mm_other" if rank == last else "mm", 64, torch.float32),
        ("numel", "mm", 65 if rank == last else 64, torch.float32),
        ("dtype", "mm", 64, torch.float16 if rank == last else torch.float32),
    ]


def acc_ops(src_rank: int, world_size: int, numel: int, num_ops: int, seed: int):
    """The accumulates of ``src_rank``: (peer, offset, integer-valued source tensor), reproducibly.

    Sources are fp32, bf16 or fp16 slices of one random integer pool per dtype (all exact in fp32).
    """
    rng = random.Random(seed * 1000 + src_rank)
    gen = torch.Generator().manual_seed(seed * 1000 + src_rank)
    pool = torch.randint(-8, 9, (numel,), generator=gen, dtype=torch.float32)
    pools = [pool, pool.to(torch.bfloat16), pool.flip(0).to(torch.float16)]
    ops = []
    for _ in range(num_ops):
        for peer in range(world_size):
            size = rng.randint(1, numel // 3)
            offset = rng.randint(0, numel - size)
            start = rng.randint(0, numel - size)
            ops.append((peer, offset, rng.choice(pools)[start : start + size]))
    return ops


def check_accumulate(t: Transport, name: str, numel: int, num_ops: int, seed: int) -> None:
    rank, world_size = t.rank, t.world_size
    all_ops = [acc_ops(src, world_size, numel, num_ops, seed) for src in range(world_size)]
    for peer, offset, values in all_ops[rank]:
        t.accumulate(name, peer, offset, values)
    t.fence()
    # Oracle: every source's operations replayed in float64 on this one process, for every owner.
    expected = torch.zeros(world_size, numel, dtype=torch.float64)
    for ops in all_ops:
        for peer, offset, values in ops:
            expected[peer, offset : offset + values.numel()] += values.to(torch.float64)
    assert expected.abs().max() > 0
    torch.testing.assert_close(t.local(name).to(torch.float64), expected[rank], rtol=0, atol=0)
    # Every rank also reads every peer's result.
    out = torch.empty(numel, dtype=torch.float32)
    for peer in range(world_size):
        t.get(name, peer, 0, out)
        torch.testing.assert_close(out.to(torch.float64), expected[peer], rtol=0, atol=0)
    t.fence()  # nobody reuses the buffer before every rank has read it


def owner_data(owner: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * owner + 17)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen).to(dtype)
    return torch.randint(-(2**30), 2**30, (numel,), generator=gen).to(dtype)


def check_get(t: Transport) -> None:
    rank, world_size = t.rank, t.world_size
    numel = 1000
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
    for dtype in dtypes:
        t.register(f"get_{dtype}", numel, dtype).copy_(owner_data(rank, numel, dtype))
    t.fence()
    gen = torch.Generator().manual_seed(rank)
    for dtype in dtypes:
        for peer in range(world_size):
            owner = owner_data(peer, numel, dtype)
            for _ in range(5):
                size = int(torch.randint(0, numel + 1, (1,), generator=gen))
                offset = int(torch.randint(0, numel - size + 1, (1,), generator=gen))
                out = torch.full((size,), 3, dtype=dtype)
                t.get(f"get_{dtype}", peer, offset, out)
                assert torch.equal(
                    out.view(torch.uint8), owner[offset : offset + size].view(torch.uint8)
                )


def check_fence_orders_writes(t: Transport) -> None:
    shard = t.register("fence", 4096, torch.float32)
    out = torch.empty(4096)
    for round_ in range(6):
        writer = round_ % t.world_size
        value = float(100 * round_ + writer + 1)
        if t.rank == writer:
            shard.fill_(value)
        t.fence()
        t.get("fence", writer, 0, out)
        assert torch.equal(out, torch.full_like(out, value)), (round_, out[:4])
        t.fence()  # nobody overwrites before every rank has read


ARRIVAL_NUMEL = 20_000
ARRIVAL_PUSHES = 3  # per source and owner, overlapping random ranges
ARRIVAL_STEP_S = 0.03  # delay between consecutive ranks of one repetition's arrival order


def arrival_pushes(src: int, world_size: int, seed: int) -> list[tuple[int, int, torch.Tensor]]:
    """``(owner, offset, values)`` of source ``src``: random fp32 of mixed magnitudes, reproducibly."""
    gen = torch.Generator().manual_seed(seed * 1000 + src)
    pushes = []
    for owner in range(world_size):
        for _ in range(ARRIVAL_PUSHES):
            lo = int(torch.randint(0, ARRIVAL_NUMEL // 2, (1,), generator=gen))
            hi = int(torch.randint(ARRIVAL_NUMEL // 2, ARRIVAL_NUMEL + 1, (1,), generator=gen))
            scale = 10 ** (torch.rand(hi - lo, generator=gen) * 2 - 2)  # 0.01 .. 1
            values = torch.randn(hi - lo, generator=gen) * scale
            pushes.append((owner, lo, values.to(torch.bfloat16 if src == 1 else torch.float32)))
    return pushes


def arrival_order(world_size: int, repetition: int, seed: int) -> list[int]:
    """The ranks in the order they push in ``repetition``: a random order, reversed for the second."""
    order = random.Random(seed).sample(range(world_size), world_size)
    return order if repetition % 2 == 0 else order[::-1]


def sum_in_two_arrival_orders(
    t: Transport, shard: torch.Tensor, seed: int, drained: Callable[[], None]
) -> list[bytes]:
    """Accumulate the same random sums into buffer ``grad`` (``shard``: this rank's) twice, the ranks
    arriving in different orders; returns this owner's shard after each repetition, as bytes.

    Each repetition must be within 1e-5 of the float64 sum; ``drained()`` then checks the backend's
    deterministic-mode state, and one more fence must change nothing.
    """
    rank, world_size = t.rank, t.world_size
    pushes = arrival_pushes(rank, world_size, seed)
    expected = torch.zeros(ARRIVAL_NUMEL, dtype=torch.float64)
    for src in range(world_size):
        for owner, lo, values in arrival_pushes(src, world_size, seed):
            if owner == rank:
                expected[lo : lo + values.numel()] += values.double()
    results = []
    for repetition in range(2):
        shard.fill_(0.25)
        t.fence()  # every owner has reset its shard before anyone accumulates
        position = arrival_order(world_size, repetition, seed).index(rank)
        jitter = random.Random(seed * 7 + 10 * repetition + rank)
        time.sleep(position * ARRIVAL_STEP_S + jitter.uniform(0, ARRIVAL_STEP_S / 4))
        for k in range(world_size):  # start at a different owner on every rank
            owner = (rank + k) % world_size
            for peer, lo, values in pushes:
                if peer == owner:
                    t.accumulate("grad", owner, lo, values)
        t.fence()
        torch.testing.assert_close(shard.double(), expected + 0.25, rtol=0, atol=1e-5)
        results.append(shard.numpy().tobytes())
        drained()
        t.fence()
        torch.testing.assert_close(shard.double(), expected + 0.25, rtol=0, atol=1e-5)
    return results


def check_late_peer_named(late: Transport, victim: int, match: str, slack_s: float = 4.5) -> None:
    """``victim`` stays away from ``late``'s fence for its ``timeout_s`` plus a second: every other rank's
    fence raises ``TransportError`` matching ``match`` after the timeout (within ``slack_s`` more);
    then every rank meets on the process group and closes ``late``."""
    timeout_s = late.timeout_s
    if late.rank == victim:
        time.sleep(timeout_s + 1.0)
    else:
        start = time.monotonic()
        with pytest.raises(TransportError, match=match):
            late.fence()
        assert timeout_s <= time.monotonic() - start < timeout_s + slack_s
    dist.barrier()
    late.close()
