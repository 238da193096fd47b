"""Tests of ``megatron_odc.transport.collective.CollectiveTransport`` on spawned CPU ranks (gloo).

The collective transport must give the same whole-bucket results as the shared-memory transport on the
same inputs, and both must equal an oracle computed on one process from every rank's seeded inputs.
"""

from __future__ import annotations

import pytest
import torch

from megatron_odc.transport import build_transport
from megatron_odc.transport.base import TransportError
from megatron_odc.transport.collective import CollectiveTransport
from megatron_odc.transport.shm import ShmTransport
from tests._dist import run_ranks
from tests.transport._cases import mismatched_registrations

PARAM_NUMEL = 1237
GRAD_NUMEL = 3001


def _params(owner: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(31 * owner + 5)
    return torch.randn(PARAM_NUMEL, generator=gen).to(dtype)


def _grads(src: int, world_size: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Integer-valued full-bucket gradients of rank ``src`` (exact in fp32, bf16 and fp16)."""
    gen = torch.Generator().manual_seed(1000 * step + src)
    return torch.randint(-50, 51, (world_size * GRAD_NUMEL,), generator=gen).to(dtype)


def _run_parity(rank: int, world_size: int) -> None:
    coll = build_transport("collective", None, timeout_s=30.0)  # fence = gloo monitored_barrier
    shm = ShmTransport(lock_stripe_nbytes=4096)
    assert isinstance(coll, CollectiveTransport)
    assert (coll.rank, coll.world_size) == (rank, world_size)
    for t in (coll, shm):
        for dtype in (torch.float32, torch.bfloat16):
            t.register(f"param_{dtype}", PARAM_NUMEL, dtype).copy_(_params(rank, dtype))
        t.register("grad", GRAD_NUMEL, torch.float32)
        t.register("empty", 0, torch.float32)
    shm.fence()

    # gather_shards: equal on both transports and to the concatenation of every owner's shard.
    for dtype in (torch.float32, torch.bfloat16):
        expected = torch.cat([_params(owner, dtype) for owner in range(world_size)])
        for t in (coll, shm):
            out = torch.full((world_size * PARAM_NUMEL,), 7, dtype=dtype)
            t.gather_shards(f"param_{dtype}", out)
            assert torch.equal(out, expected), (type(t).__name__, dtype)

    # scatter_accumulate over several steps with fp32, bf16 and fp16 sources.
    expected = torch.zeros(GRAD_NUMEL, dtype=torch.float64)
    for step, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16, torch.float32)):
        src = _grads(rank, world_size, step, dtype)
        src_before = src.clone()
        coll.scatter_accumulate("grad", src)
        shm.scatter_accumulate("grad", src)
        assert torch.equal(src, src_before), "scatter_accumulate must not modify its source"
        for s in range(world_size):
            full = _grads(s, world_size, step, dtype).to(torch.float64)
            expected += full[rank * GRAD_NUMEL : (rank + 1) * GRAD_NUMEL]
    shm.fence()
    coll.fence()
    assert expected.abs().max() > 0
    torch.testing.assert_close(coll.local("grad").to(torch.float64), expected, rtol=0, atol=0)
    assert torch.equal(coll.local("grad"), shm.local("grad"))
    coll.gather_shards("empty", torch.empty(0))
    coll.scatter_accumulate("empty", torch.empty(0))

    # One-sided calls work on the own shard only.
    out = torch.empty(10)
    coll.get("param_torch.float32", rank, 5, out)
    assert torch.equal(out, _params(rank, torch.float32)[5:15])
    before = coll.local("grad")[:10].clone()
    coll.accumulate("grad", rank, 0, torch.ones(10, dtype=torch.bfloat16))
    assert torch.equal(coll.local("grad")[:10], before + 1)
    peer = (rank + 1) % world_size
    with pytest.raises(
        ValueError, match=r"only supports whole-bucket gather_shards/scatter_accumulate"
    ):
        coll.get("param_torch.float32", peer, 0, out)
    with pytest.raises(
        ValueError, match=rf"accumulate on buffer 'grad' from peer {peer}: the collective"
    ):
        coll.accumulate("grad", peer, 0, torch.ones(10))

    # Argument errors.
    with pytest.raises(ValueError, match=r"needs a contiguous tensor of \d+ elements"):
        coll.gather_shards("grad", torch.empty(GRAD_NUMEL))
    with pytest.raises(ValueError, match=r"into an out tensor of dtype torch.bfloat16"):
        coll.gather_shards("grad", torch.empty(world_size * GRAD_NUMEL, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"accumulate targets must be float32"):
        coll.scatter_accumulate(
            "param_torch.bfloat16", torch.empty(world_size * PARAM_NUMEL, dtype=torch.bfloat16)
        )
    with pytest.raises(ValueError, match=r"from dtype torch.int32; sources must be"):
        coll.scatter_accumulate("grad", torch.zeros(world_size * GRAD_NUMEL, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"buffer 'nope' is not registered"):
        coll.gather_shards("nope", out)
    last = world_size - 1
    for field, name, numel, dtype in mismatched_registrations(rank, world_size):
        with pytest.raises(ValueError, match=rf"rank {last} registered buffer .* with {field} "):
            coll.register(name, numel, dtype)

    with pytest.raises(ValueError, match=r"timeout_s must be > 0"):
        CollectiveTransport(timeout_s=0)
    plain = CollectiveTransport()  # fence = dist.barrier
    plain.fence()
    plain.close()
    coll.close()
    shm.close()
    with pytest.raises(TransportError, match=r"CollectiveTransport is closed"):
        coll.fence()
    with pytest.raises(TransportError, match=r"CollectiveTransport is closed"):
        coll.gather_shards("grad", out)


def test_collective_matches_shm() -> None:
    run_ranks(_run_parity, 3, timeout_s=300)
