"""The nvshmem transport's logic on CPU: refusals, the feature probe, the NVSHMEM path chosen per peer, gets,
staged accumulates (exact sums with uneven push counts, read-add-put on repeated pushes, fixed-order and
bitwise repeatable reduce), the fence naming a late or dead peer, the registry's ``auto`` choice with
pretend hosts, and the ODC engine over it against a one-process oracle.

``tests/_fake_cuda.py`` (``install_fake_cuda(nvshmem=True)``) stands in for a GPU whose PyTorch has NVSHMEM:
symmetric memory as shared host mappings, NVSHMEM get / put as host copies that translate symmetric
addresses (and refuse a local side that is not symmetric memory), ``buffer_ptrs`` 0 for peers on another
pretend host (``MEGATRON_ODC_LOCAL_WORLD_SIZE``). The transport's own code runs unchanged in real
processes; the Triton kernels run only on a GPU (``benchmarks/gpu_check.py``, check ``nvshmem w=2``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_odc.transport import TransportError, build_transport, resolve_transport_name
from megatron_odc.transport.cuda import SymmMemFeatures
from megatron_odc.transport.nvshmem import (
    NvshmemTransport,
    load_device_ops,
    nvshmem_unavailable_reason,
    overlaps,
    remote_peers,
)
from megatron_odc.transport.staging import owner_reduce_order, staging_numel
from tests._dist import RankFailureError, run_ranks
from tests.transport._cases import (
    ARRIVAL_NUMEL,
    check_accumulate,
    check_fence_orders_writes,
    check_get,
    check_late_peer_named,
    sum_in_two_arrival_orders,
)

PRETEND_HOSTS_OF_2 = {"MEGATRON_ODC_LOCAL_WORLD_SIZE": "2"}
ONE_RANK_PER_HOST = {"MEGATRON_ODC_LOCAL_WORLD_SIZE": "1"}


# ---------------------------------------------------------------------- refusals and the probe


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_without_cuda_the_flag_is_refused_naming_what_to_use() -> None:
    for build in (lambda: NvshmemTransport(), lambda: build_transport("nvshmem", None)):
        with pytest.raises(
            ValueError, match=r"--odc-transport nvshmem .* torch.cuda.is_available\(\) is False"
        ) as info:
            build()
        assert "--odc-transport mpi" in str(info.value)
    with pytest.raises(ValueError, match="invalid options"):
        build_transport("nvshmem", None, accumulate_mode="atomic")  # always staged: no such option


def test_options_are_checked_first() -> None:
    with pytest.raises(ValueError, match="remote_peers 'some'"):
        NvshmemTransport(remote_peers="some")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        NvshmemTransport(timeout_s=0)
    with pytest.raises(ValueError, match="bounce_nbytes must be a positive multiple of 16"):
        NvshmemTransport(bounce_nbytes=100)


def test_a_pytorch_without_nvshmem_is_refused_naming_the_flag(monkeypatch) -> None:
    import megatron_odc.transport.nvshmem as nvshmem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = "PyTorch 9.9 has no NVSHMEM, a test"
    monkeypatch.setattr(nvshmem, "nvshmem_unavailable_reason", lambda: reason)
    with pytest.raises(ValueError, match=rf"^--odc-transport nvshmem: {reason}; keep each shard"):
        NvshmemTransport()


def test_unavailable_reason_reads_the_probe(monkeypatch) -> None:
    import megatron_odc.transport.nvshmem as nvshmem

    full = SymmMemFeatures(True, True, True, has_set_backend=True, nvshmem_available=True)
    assert nvshmem_unavailable_reason(full) is None
    no_lib = SymmMemFeatures(True, True, True, has_set_backend=True)
    assert "is_nvshmem_available() is False" in nvshmem_unavailable_reason(no_lib)
    old = SymmMemFeatures(True, True, True, nvshmem_available=True)
    assert "set_backend" in nvshmem_unavailable_reason(old)
    assert "no usable" in nvshmem_unavailable_reason(SymmMemFeatures(importable=False))
    # A CPU build has no NVSHMEM; PyPI's CUDA build has it (nvidia-nvshmem) also where no GPU is seen.
    if torch.version.cuda is None:
        assert "has no NVSHMEM" in nvshmem_unavailable_reason()
    for features, expected in ((no_lib, nvshmem_unavailable_reason(no_lib)), (full, None)):
        monkeypatch.setattr(nvshmem, "probe_symm_mem", lambda features=features: features)
        assert nvshmem_unavailable_reason() == expected  # without an argument: the installed probe


def test_missing_triton_or_device_library_is_refused_naming_the_flag(monkeypatch, tmp_path) -> None:
    refusal = (
        r"--odc-transport nvshmem needs Triton and NVSHMEM's device library .*; keep each shard"
    )
    with monkeypatch.context() as hidden:
        hidden.setitem(sys.modules, "triton", None)  # import triton -> ImportError
        with pytest.raises(ValueError, match=refusal):
            load_device_ops()
    try:
        import triton  # noqa: F401 - torch's _nvshmem_triton imports without it
        from torch.distributed._symmetric_memory import _nvshmem_triton
    except ImportError:  # no Triton here: the case above is this PyTorch's own
        return
    # Triton without the device library: torch looks in NVSHMEM_LIB_DIR (an empty folder here).
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(tmp_path))
    monkeypatch.setattr(_nvshmem_triton.NvshmemLibFinder, "found_device_lib_path", None)
    with pytest.raises(ValueError, match=r"\(NVSHMEM device library not found at .*\); keep each"):
        load_device_ops()


def test_remote_peers_and_overlaps() -> None:
    assert remote_peers([7, 0, 9, 0], 0) == {1, 3}  # no mapping: another node
    assert remote_peers([7, 0, 9, 0], 2, "all") == {0, 1, 3}
    assert remote_peers([7, 8], 1) == frozenset()
    with pytest.raises(ValueError, match="remote_peers 'x'"):
        remote_peers([1], 0, "x")
    with pytest.raises(ValueError, match="rank 2 is outside"):
        remote_peers([1, 1], 2)
    assert overlaps([(0, 4)], 3, 5)
    assert not overlaps([(0, 4), (8, 9)], 4, 8)  # half-open ranges that only touch
    assert not overlaps([], 0, 1)


def test_auto_picks_nvshmem_for_gpus_across_hosts_where_available(monkeypatch) -> None:
    import megatron_odc.transport.nvshmem as nvshmem

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(nvshmem, "nvshmem_unavailable_reason", lambda: None)
    assert resolve_transport_name("auto", gpu, spans_hosts=True) == "nvshmem"
    assert resolve_transport_name("auto", gpu, spans_hosts=False) == "cuda"
    assert resolve_transport_name("auto", torch.device("cpu"), spans_hosts=True) == "mpi"
    monkeypatch.setattr(nvshmem, "nvshmem_unavailable_reason", lambda: "PyTorch 9.9 lacks it")
    with pytest.raises(
        ValueError, match=r"transport between nodes is nvshmem, but PyTorch 9.9 lacks it; leave"
    ):
        resolve_transport_name("auto", gpu, spans_hosts=True)


# ---------------------------------------------------------------------- 4 ranks on 2 pretend hosts

N = 600
BOUNCE = 1024  # bytes: 256 fp32 per bounce, so the transfers of N elements are chunked
PUSHES = (0, 1, 3, 2)  # per source: how many times it pushes into every owner (rank 0 never pushes)
ENGINE_COUNTS = [1, 3, 0, 2]  # microbatches per rank in the engine run (rank 2 has none)


def _pushes(src: int, world_size: int, integer: bool) -> list[tuple[int, int, torch.Tensor]]:
    """Source ``src``'s pushes as ``(owner, offset, values)``: overlapping ranges of every owner's shard."""
    gen = torch.Generator().manual_seed(100 + src)
    out = []
    for k in range(PUSHES[src]):
        for owner in range(world_size):
            lo = (5 * k + owner) % 9
            hi = N - (3 * k) % 7
            values = torch.randn(hi - lo, generator=gen) * 10.0**src
            out.append((owner, lo, values.round() if integer else values))
    return out


def _slot_oracle(owner: int, src: int, world_size: int, integer: bool) -> torch.Tensor:
    slot = torch.zeros(N)
    for to, lo, values in _pushes(src, world_size, integer):
        if to == owner:
            slot[lo : lo + values.numel()] += values
    return slot


def _heap_nbytes(t: NvshmemTransport) -> int:
    """What the transport must have allocated: bounce buffers, shards, one slot per source per fp32
    accumulate buffer."""
    total = 2 * t.bounce_nbytes
    for name in t.buffer_names:
        spec = t.spec(name)
        total += max(spec.numel, 1) * spec.dtype.itemsize
        if spec.accumulate and spec.dtype == torch.float32:
            total += max(staging_numel(t.world_size, spec.numel), 1) * 4
    return total


def _run_four_ranks(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from megatron_odc.core.groups import build_topology
    from tests._fake_cuda import install_fake_cuda

    fake = install_fake_cuda(nvshmem=True)
    calls = fake.nvshmem_ops.calls
    try:
        # The registry: a shard group inside a pretend host stays on cuda; one across hosts is nvshmem.
        gpu = torch.device("cuda", 0)
        for size, expected in ((2, "cuda"), (4, "nvshmem")):
            topo = build_topology(None, size)
            spans = len(set(topo.shard_hosts)) > 1
            assert resolve_transport_name("auto", gpu, spans_hosts=spans) == expected, size

        t = build_transport("nvshmem", None, timeout_s=30.0, bounce_nbytes=BOUNCE)
        assert isinstance(t, NvshmemTransport)
        assert fake.backends == ["NVSHMEM"]
        # Gets of every dtype at random offsets; the peers of the other host through NVSHMEM only.
        check_get(t)
        other_host = {2, 3} if rank < 2 else {0, 1}
        assert t.remote == other_host, t.remote
        assert {pe for _, pe in calls} == other_host, calls
        assert not any(op == "put" for op, _ in calls)

        # Exact sums with uneven push counts (0, 1, 3, 2 pushes per owner), overlapping ranges.
        g = t.register("g", N, torch.float32)
        t.register("p", N, torch.float32, accumulate=False)
        assert "p" not in t._staging  # no staging slots for a buffer peers only read
        assert t.heap_nbytes == _heap_nbytes(t)
        t.fence()
        calls.clear()
        for owner, lo, values in _pushes(rank, world_size, integer=True):
            t.accumulate("g", owner, lo, values)
        # A push into a range written since the fence reads it back first (a get); the first does not.
        repeats = {pe for (op, pe) in calls if op == "get"}
        assert repeats == (other_host if PUSHES[rank] > 1 else set()), calls
        t.accumulate("g", (rank + 2) % world_size, N - 7, torch.ones(5, dtype=torch.bfloat16))
        dist.barrier()  # every source has pushed; no owner has reduced
        slots = t._staging["g"][0].view(world_size, N).clone()
        dist.barrier()
        t.fence()
        exact = torch.zeros(N)
        for src in owner_reduce_order(world_size):
            slot = _slot_oracle(rank, src, world_size, integer=True)
            if (src + 2) % world_size == rank:
                slot[N - 7 : N - 2] += 1.0
            assert torch.equal(slots[src], slot), f"slot of source {src} at owner {rank}"
            exact += slot
        assert torch.equal(g, exact)
        # Random sums: exactly the slots added in source order.
        g.zero_()
        t.fence()
        for owner, lo, values in _pushes(rank, world_size, integer=False):
            t.accumulate("g", owner, lo, values)
        t.fence()
        oracle = torch.zeros(N)
        for src in owner_reduce_order(world_size):
            oracle = oracle + _slot_oracle(rank, src, world_size, integer=False)
        assert torch.equal(g, oracle), float((g - oracle).abs().max())

        # The shared transport cases: exact fp32 / bf16 / fp16 sums, fences order writes, and random
        # sums bitwise equal whatever the arrival order.
        t.register("acc", 300, torch.float32)
        check_accumulate(t, "acc", 300, 3, seed=1)
        check_fence_orders_writes(t)
        grad = t.register("grad", ARRIVAL_NUMEL, torch.float32)

        def drained() -> None:
            assert all(int(s.count_nonzero()) == 0 for s, _ in t._staging.values())

        first, second = sum_in_two_arrival_orders(t, grad, 3, drained)
        assert first == second, f"owner {rank}: the sums differ between arrival orders"

        with pytest.raises(ValueError, match=r"accumulate=False"):
            t.accumulate("p", 0, 0, torch.ones(2))
        with pytest.raises(ValueError, match=r"with a tensor on meta; the NvshmemTransport's"):
            t.get("p", 0, 0, torch.empty(2, device="meta"))
        t.close()
        with pytest.raises(TransportError, match="is closed"):
            t.fence()
        return _engine_run(rank, calls)
    finally:
        fake.revert()


def _engine_run(rank: int, calls) -> dict:
    """The engine test's model, fetched and pushed through NvshmemTransport for one minibatch."""
    from tests.core.test_engine import _owned_grads, one_minibatch

    calls.clear()
    transport = NvshmemTransport(None, bounce_nbytes=BOUNCE)
    engine, hooks = one_minibatch(transport, ENGINE_COUNTS, rank)
    puts = {pe for op, pe in calls if op == "put"}
    run = {"grads": _owned_grads(engine), "puts": puts, "remote": transport.remote}
    hooks.remove()
    engine.close()
    return run


def test_four_ranks_on_two_pretend_hosts() -> None:
    from tests.core.test_engine import _assemble, _oracle, assert_rel_close

    results = run_ranks(_run_four_ranks, 4, timeout_s=240, env=PRETEND_HOSTS_OF_2)
    # The engine over the transport: the one-process oracle's gradients.
    oracle_grads, _ = _oracle(ENGINE_COUNTS, 1)
    got = _assemble([([run], None) for run in results], 0, oracle_grads[0])
    for name, expected in oracle_grads[0].items():
        assert_rel_close(got[name], expected, 1e-5, name)
    for rank, run in enumerate(results):
        # Pushes crossed the pretend host boundary through NVSHMEM, and only it (rank 2 pushes nothing).
        assert run["puts"] == (run["remote"] if ENGINE_COUNTS[rank] else set()), run


# ---------------------------------------------------------------------- a late and a dead peer


def _run_late_then_dead(rank: int, world_size: int, verdict_dir: str) -> None:
    from tests._fake_cuda import install_fake_cuda

    del world_size
    fake = install_fake_cuda(nvshmem=True)
    late = NvshmemTransport(timeout_s=0.5)
    late.register("g", 8, torch.float32)
    check_late_peer_named(
        late, 1, r"^rank 0: fence 1 timed out after 0.5 s waiting for rank\(s\) 1$"
    )

    t = NvshmemTransport(timeout_s=60.0)
    t.register("g", 8, torch.float32)
    t.fence()
    if rank == 1:
        t.accumulate("g", 0, 0, torch.ones(8))
        os._exit(3)
    start = time.monotonic()
    with pytest.raises(TransportError) as info:
        t.fence()
    elapsed_s = time.monotonic() - start
    t.close()
    fake.revert()
    # The verdict goes to a file: after a peer died, gloo can make this process slow to exit.
    Path(verdict_dir, f"rank{rank}").write_text(f"{elapsed_s:.3f} {info.value}")


def test_a_late_peer_and_a_dead_peer_are_named(tmp_path: Path) -> None:
    with pytest.raises(RankFailureError) as info:
        run_ranks(_run_late_then_dead, 2, str(tmp_path), timeout_s=120, env=ONE_RANK_PER_HOST)
    assert "rank 1 died with exit code 3" in str(info.value)
    assert "raised" not in str(info.value), str(info.value)
    elapsed_s, text = Path(tmp_path, "rank0").read_text().split(" ", 1)
    assert float(elapsed_s) < 30.0  # named by its pid, long before the 60 s timeout
    assert text.startswith("rank 0: fence 2: rank 1 (pid "), text
    assert text.endswith("died before reaching it"), text
