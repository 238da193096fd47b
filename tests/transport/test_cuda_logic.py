"""The CUDA transport's logic on CPU: feature probe, backend choice, staging slots, chunking, rotation,
the deterministic owner reduce, kernel choice, and the error paths (no CUDA, no Triton, bad dtype).

Layer 1 of the testing layers (no process group, no GPU). The kernels and the symmetric-memory calls
themselves run only in ``benchmarks/gpu_check.py`` on a GPU (its dry run and CPU rehearsal: ``tests/benchmarks/test_gpu_check.py``).
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_odc.transport import build_transport
from megatron_odc.transport.cuda import (
    CudaSymmTransport,
    SymmMemFeatures,
    choose_backend,
    chunk_ranges,
    peer_rotation,
    probe_symm_mem,
    select_accumulate_kernel,
)
from megatron_odc.transport.staging import (
    owner_reduce,
    owner_reduce_order,
    staging_numel,
    staging_slot_offset,
)

REPO = Path(__file__).resolve().parents[2]
FULL = SymmMemFeatures(importable=True, has_empty=True, has_rendezvous=True)


# ---------------------------------------------------------------------- probe and backend


def test_probe_reads_attributes_not_versions() -> None:
    bare = types.SimpleNamespace(empty=None, rendezvous=None)
    feats = probe_symm_mem(bare)
    assert feats.usable
    assert not feats.has_get
    assert not feats.has_set_backend
    assert not feats.nvshmem_available

    def broken() -> bool:
        raise RuntimeError("no driver")

    rich = types.SimpleNamespace(
        empty=None, rendezvous=None, get=None, set_backend=None, is_nvshmem_available=lambda: True
    )
    assert probe_symm_mem(rich).has_get
    assert probe_symm_mem(rich).nvshmem_available
    rich.is_nvshmem_available = broken  # a raising probe means "not available", never a crash
    assert not probe_symm_mem(rich).nvshmem_available
    assert not probe_symm_mem(types.SimpleNamespace(rendezvous=None)).usable


def test_probe_tells_whether_groups_must_be_enabled() -> None:
    def enable(group_name: str) -> None:
        pass

    older = types.SimpleNamespace(empty=None, rendezvous=None, enable_symm_mem_for_group=enable)
    assert probe_symm_mem(older).needs_group_enable  # present and not deprecated: call it
    enable.__deprecated__ = "no need to call this function anymore"  # what @deprecated sets
    assert not probe_symm_mem(older).needs_group_enable
    assert not probe_symm_mem(types.SimpleNamespace(empty=None, rendezvous=None)).needs_group_enable


def test_probe_of_installed_torch_matches_hasattr() -> None:
    import torch.distributed._symmetric_memory as symm_mem

    feats = probe_symm_mem()
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    assert feats.needs_group_enable == (
        enable is not None and not hasattr(enable, "__deprecated__")
    )
    assert feats.has_get == hasattr(symm_mem, "get")
    assert feats.has_set_backend == hasattr(symm_mem, "set_backend")
    assert feats.has_empty == hasattr(symm_mem, "empty")


def test_choose_backend() -> None:
    assert choose_backend(1, FULL) == "CUDA"
    assert choose_backend(1, FULL, "CUDA") == "CUDA"
    with pytest.raises(
        ValueError, match=r"spans 2 hosts; use odc_transport='nvshmem'.*'collective'"
    ):
        choose_backend(2, FULL)  # several hosts: names the inter-node transports
    with pytest.raises(ValueError, match=r"'NVSHMEM' is not 'CUDA'.*odc_transport='nvshmem'"):
        choose_backend(1, FULL, "NVSHMEM")  # the NVSHMEM backend is the nvshmem transport's
    with pytest.raises(ValueError, match=r"empty\(\) and rendezvous"):
        choose_backend(1, SymmMemFeatures(importable=True))
    with pytest.raises(ValueError, match="'NCCL'"):
        choose_backend(1, FULL, "NCCL")


# ---------------------------------------------------------------------- staging slots, chunks, rotation


@pytest.mark.parametrize(("world_size", "shard_numel"), [(1, 7), (2, 5), (4, 1031), (3, 0)])
def test_staging_slots_tile_the_staging_buffer(world_size: int, shard_numel: int) -> None:
    owner_of = [-1] * staging_numel(world_size, shard_numel)
    for src in range(world_size):
        start = staging_slot_offset(src, world_size, shard_numel)
        for i in range(start, start + shard_numel):
            assert owner_of[i] == -1, f"slot of source {src} overlaps another at element {i}"
            owner_of[i] = src
    assert -1 not in owner_of  # every element belongs to exactly one source
    assert sorted(set(owner_of)) == (list(range(world_size)) if shard_numel else [])


def test_staging_slot_errors() -> None:
    with pytest.raises(ValueError, match="source rank 4"):
        staging_slot_offset(4, 4, 10)
    with pytest.raises(ValueError, match="shard_numel"):
        staging_slot_offset(0, 2, -1)


@pytest.mark.parametrize(
    ("offset", "numel", "chunk"), [(0, 10, 3), (5, 12, 4), (7, 0, 2), (3, 5, 100), (0, 8, 1)]
)
def test_chunk_ranges_cover_exactly(offset: int, numel: int, chunk: int) -> None:
    ranges = chunk_ranges(offset, numel, chunk)
    covered = [i for lo, hi in ranges for i in range(lo, hi)]
    assert covered == list(range(offset, offset + numel))
    assert all(0 < hi - lo <= chunk for lo, hi in ranges)
    assert len(ranges) == -(-numel // chunk)


def test_chunk_range_errors() -> None:
    with pytest.raises(ValueError, match="chunk_numel"):
        chunk_ranges(0, 4, 0)
    with pytest.raises(ValueError, match=">= 0"):
        chunk_ranges(-1, 4, 2)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_peer_rotation_is_a_latin_square(world_size: int) -> None:
    orders = [peer_rotation(r, world_size) for r in range(world_size)]
    for rank, order in enumerate(orders):
        assert sorted(order) == list(range(world_size))
        assert order[0] == rank
    for step in range(world_size):  # at every step each owner is visited by exactly one rank
        assert sorted(order[step] for order in orders) == list(range(world_size))
    with pytest.raises(ValueError, match="rank 3"):
        peer_rotation(3, 3)


# ---------------------------------------------------------------------- deterministic owner reduce


def _simulate_staging(world_size: int, shard_numel: int, arrival: list[tuple[int, int]], seed: int):
    """Sources write (add) their chunks into their own staging slots in ``arrival`` order."""
    gen = torch.Generator().manual_seed(seed)
    # Per source, a fixed list of (offset, values) pushes; the test permutes only their interleaving.
    pushes = {}
    for src in range(world_size):
        items = []
        for _ in range(3):
            lo = int(torch.randint(0, shard_numel, (1,), generator=gen))
            hi = int(torch.randint(lo + 1, shard_numel + 1, (1,), generator=gen))
            items.append((lo, torch.randn(hi - lo, generator=gen) * 10 ** float(src)))
        pushes[src] = items
    staging = torch.zeros(staging_numel(world_size, shard_numel))
    for src, i in arrival:
        lo, values = pushes[src][i]
        base = staging_slot_offset(src, world_size, shard_numel)
        staging[base + lo : base + lo + values.numel()].add_(values)
    return staging, pushes


def _arrival(world_size: int, rng: random.Random) -> list[tuple[int, int]]:
    """A random interleaving that keeps each source's own pushes in its stream order."""
    queues = {src: [(src, i) for i in range(3)] for src in range(world_size)}
    order = []
    while any(queues.values()):
        src = rng.choice([s for s, q in queues.items() if q])
        order.append(queues[src].pop(0))
    return order


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_owner_reduce_is_the_exact_fixed_order_sum_whatever_the_arrival(world_size: int) -> None:
    shard_numel = 257
    rng = random.Random(0)
    results = []
    for trial in range(4):
        staging, pushes = _simulate_staging(world_size, shard_numel, _arrival(world_size, rng), 1)
        acc = torch.full((shard_numel,), 0.5)
        owner_reduce(acc, staging, world_size)
        assert int(staging.count_nonzero()) == 0, "slots must be zeroed for the next minibatch"
        results.append(acc)
        if trial == 0:
            # Oracle 1: the same fixed order written out by hand (exact, bitwise).
            expected = torch.full((shard_numel,), 0.5)
            for src in owner_reduce_order(world_size):
                slot = torch.zeros(shard_numel)
                for lo, values in pushes[src]:
                    slot[lo : lo + values.numel()] += values
                expected += slot
            torch.testing.assert_close(acc, expected, rtol=0, atol=0)
            # Oracle 2: float64 sum of everything (rounding only).
            exact = torch.full((shard_numel,), 0.5, dtype=torch.float64)
            for items in pushes.values():
                for lo, values in items:
                    exact[lo : lo + values.numel()] += values.double()
            torch.testing.assert_close(acc.double(), exact, rtol=1e-6, atol=1e-4)
    for other in results[1:]:  # bitwise reproducible across arrival orders
        assert torch.equal(other, results[0])


def test_owner_reduce_order_is_fixed() -> None:
    assert owner_reduce_order(4) == [0, 1, 2, 3]


def test_owner_reduce_of_the_written_sources_only_is_bitwise_the_full_reduce() -> None:
    # The shm transport skips slots nobody wrote since the last reduce: adding a zero slot is exact.
    world_size, n = 4, 333
    gen = torch.Generator().manual_seed(3)
    staging = torch.zeros(staging_numel(world_size, n))
    for src in (1, 3):
        staging[staging_slot_offset(src, world_size, n) :][:n] = torch.randn(n, generator=gen) * 1e3
    full = torch.randn(n, generator=gen)
    part = full.clone()
    staging_copy = staging.clone()
    owner_reduce(full, staging, world_size)
    owner_reduce(part, staging_copy, world_size, sources=[3, 1])
    assert torch.equal(full, part)
    assert int(staging_copy.count_nonzero()) == 0
    # Only the named slots are touched: a slot left out keeps its contents.
    staging_copy[:n] = 1.0
    owner_reduce(part, staging_copy, world_size, sources=[2])
    assert torch.equal(staging_copy[:n], torch.ones(n))


# ---------------------------------------------------------------------- kernel choice


def test_select_accumulate_kernel_table() -> None:
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    expected = {
        (f32, "atomic"): "atomic_add_f32",
        (bf16, "atomic"): "atomic_add_cast_f32",
        (f16, "atomic"): "atomic_add_cast_f32",
        (f32, "deterministic"): "staging_add",
        (bf16, "deterministic"): "staging_add",
        (f16, "deterministic"): "staging_add",
    }
    for (src, mode), name in expected.items():
        assert select_accumulate_kernel(src, f32, mode) == name


@pytest.mark.parametrize(
    ("src", "dst", "mode", "match"),
    [
        (torch.int64, torch.float32, "atomic", "source dtype torch.int64"),
        (torch.float64, torch.float32, "deterministic", "source dtype torch.float64"),
        (torch.float32, torch.bfloat16, "atomic", "must be float32"),
        (torch.float32, torch.float32, "fast", "accumulate_mode 'fast'"),
    ],
)
def test_select_accumulate_kernel_errors(src, dst, mode, match) -> None:
    with pytest.raises(ValueError, match=match):
        select_accumulate_kernel(src, dst, mode)


# ---------------------------------------------------------------------- construction error paths


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_construct_without_cuda_names_the_cpu_transports() -> None:
    with pytest.raises(ValueError, match=r"needs a CUDA device.*'shm'"):
        CudaSymmTransport()
    with pytest.raises(ValueError, match="needs a CUDA device"):
        build_transport("cuda", None, timeout_s=5.0)


def test_options_are_checked_before_the_device() -> None:
    with pytest.raises(ValueError, match="accumulate_mode 'sloppy'"):
        CudaSymmTransport(accumulate_mode="sloppy")
    with pytest.raises(ValueError, match="fence_via 'hope'"):
        CudaSymmTransport(fence_via="hope")
    with pytest.raises(ValueError, match="power of two"):
        CudaSymmTransport(block_numel=1000)


def test_build_transport_lists_cuda_and_refuses_unknown_options() -> None:
    with pytest.raises(ValueError, match="'cuda'"):
        build_transport("nccl")
    with pytest.raises(ValueError, match="invalid options"):
        build_transport("cuda", None, no_such_option=1)


def test_module_imports_without_triton_or_megatron() -> None:
    code = (
        "import sys\n"
        "for m in ('triton', 'megatron', 'megatron.core', 'transformer_engine'):\n"
        "    sys.modules[m] = None\n"
        "import megatron_odc.transport.cuda as c\n"
        "import megatron_odc.core.streams\n"
        "import megatron_odc.core.fp8\n"
        "assert 'triton' not in [k for k, v in sys.modules.items() if v is not None]\n"
        "print(c.probe_symm_mem().usable)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_itertools_smoke_for_latin_square_oracle() -> None:
    # The Latin-square property above is what makes concurrent whole-bucket operations contention-free:
    # for every pair of ranks, their step-k targets differ.
    for a, b in itertools.combinations(range(5), 2):
        assert all(x != y for x, y in zip(peer_rotation(a, 5), peer_rotation(b, 5)))


# ---------------------------------------------------------------------- the class on CPU, faked devices
#
# ``tests/_fake_cuda.py`` stands in for the GPU: symmetric memory as shared /dev/shm mappings, streams
# as no-ops; the transport's own code then runs unchanged in two real processes.


def _run_fake_device(rank: int, world_size: int) -> dict:
    from tests._fake_cuda import install_fake_cuda

    fake = install_fake_cuda()
    out: dict = {}
    n = 37
    t = CudaSymmTransport(None, accumulate_mode="deterministic")
    out["device"] = str(t.device)
    p = t.register("p", n, torch.float32, accumulate=False)  # read-only for peers: no staging
    g = t.register("g", n, torch.float32)
    b = t.register("b", 5, torch.bfloat16)
    out["staged"] = sorted(t._staging)  # only fp32 accumulate targets get staging slots
    p.copy_(torch.arange(n) + 100.0 * rank)
    b.fill_(rank + 1)
    t.fence()
    gathered = torch.empty(world_size * n)
    t.gather_shards("p", gathered)
    out["gathered"] = gathered
    part = torch.empty(4, dtype=torch.bfloat16)
    t.get("b", (rank + 1) % world_size, 1, part)
    out["part"] = part
    # Deterministic sums: the same pushes twice, with the sources' order of calls changed.
    runs = []
    for trial in range(2):
        g.zero_()
        t.fence()
        gen = torch.Generator().manual_seed(10 + rank)
        full = torch.randn(world_size * n, generator=gen) * 10.0**rank
        peers = peer_rotation(rank, world_size)
        if trial:
            peers = peers[::-1]
        for peer in peers:
            t.accumulate("g", peer, 0, full[peer * n : (peer + 1) * n])
        t.accumulate("g", rank, 3, torch.ones(5, dtype=torch.bfloat16))  # bf16 source, at an offset
        if trial == 0:
            import torch.distributed as dist

            dist.barrier()  # every source has pushed; the owner has not reduced yet
            out["slots"] = t._staging["g"][0].clone().view(world_size, n)
            dist.barrier()
        t.fence()
        runs.append(g.clone())
    out["runs"] = runs
    out["staging_zero"] = all(int(s.count_nonzero()) == 0 for s, _ in t._staging.values())
    # The atomic mode's kernel needs Triton on a real GPU (the fake has none), so here only its refusal
    # runs: without Triton it is refused when built, before any push (Triton is importable beside
    # both the CPU and the CUDA build of torch, so it is hidden).
    import sys

    saved = sys.modules.get("triton")
    sys.modules["triton"] = None  # import triton -> ImportError
    try:
        CudaSymmTransport(None, accumulate_mode="atomic")
        out["atomic_error"] = None
    except ValueError as exc:
        out["atomic_error"] = str(exc)
    finally:
        sys.modules.pop("triton")
        if saved is not None:
            sys.modules["triton"] = saved
    t.close()
    fake.revert()
    out["restored"] = CudaSymmTransport.__init__.__qualname__
    return out


def test_class_on_faked_devices_deterministic_mode() -> None:
    from tests._dist import run_ranks

    world_size, n = 2, 37
    results = run_ranks(_run_fake_device, world_size, timeout_s=90)
    expected_p = torch.cat([torch.arange(n) + 100.0 * r for r in range(world_size)])
    fulls = []
    for r in range(world_size):
        gen = torch.Generator().manual_seed(10 + r)
        fulls.append(torch.randn(world_size * n, generator=gen) * 10.0**r)
    for rank, res in enumerate(results):
        assert res["device"] == "cpu"
        assert res["restored"] == "CudaSymmTransport.__init__"  # revert put the real class back
        assert res["staged"] == ["g"]
        torch.testing.assert_close(res["gathered"], expected_p, rtol=0, atol=0)
        peer = (rank + 1) % world_size
        torch.testing.assert_close(
            res["part"], torch.full((4,), peer + 1.0, dtype=torch.bfloat16), rtol=0, atol=0
        )
        # Oracle: slot s holds source s's pushes; the owner adds slot 0, then slot 1, into zeros.
        expected = torch.zeros(n)
        for src in owner_reduce_order(world_size):
            slot = fulls[src][rank * n : (rank + 1) * n].clone()
            if src == rank:
                slot[3:8] += 1.0
            expected = expected + slot
            # Before the fence, slot ``src`` at this owner holds exactly source ``src``'s pushes.
            torch.testing.assert_close(res["slots"][src], slot, rtol=0, atol=0)
        torch.testing.assert_close(res["runs"][0], expected, rtol=0, atol=0)
        assert torch.equal(res["runs"][0], res["runs"][1]), "call order changed the bits"
        assert res["staging_zero"]
        assert res["atomic_error"] is not None
        assert "Triton" in res["atomic_error"]
        assert "deterministic" in res["atomic_error"]


def _run_group_enable(rank: int, world_size: int, needs_enable: bool) -> dict:
    import dataclasses

    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    import megatron_odc.transport.cuda as cuda_transport
    from tests._fake_cuda import install_fake_cuda

    fake = install_fake_cuda()
    enabled: list[str] = []
    probed = dataclasses.replace(cuda_transport.probe_symm_mem(), needs_group_enable=needs_enable)
    fake.patch(cuda_transport, "probe_symm_mem", lambda: probed)
    fake.patch(symm_mem, "enable_symm_mem_for_group", enabled.append)
    try:
        t = CudaSymmTransport(None, accumulate_mode="deterministic")
        t.register("g", 8, torch.float32)
        t.close()
        return {
            "enabled": enabled,
            "world": dist.group.WORLD.group_name,
            "groups": [type(g).__name__ for g in fake.symm_mem.groups],
            "names": [str(g) for g in fake.symm_mem.groups],
        }
    finally:
        fake.revert()


@pytest.mark.parametrize("needs_enable", [True, False])
def test_group_enabled_only_where_this_pytorch_needs_it(needs_enable: bool) -> None:
    from tests._dist import run_ranks

    for res in run_ranks(_run_group_enable, 2, needs_enable, timeout_s=60):
        assert res["enabled"] == ([res["world"]] if needs_enable else [])
        # Every rendezvous (the buffer and its staging slots) names the group by its name, a str.
        assert res["groups"] == ["str", "str"]
        assert res["names"] == [res["world"]] * 2


# ---------------------------------------------------------------------- the engine over the faked devices


def _run_engine_on_fake_cuda_transport(rank: int, world_size: int, counts: list[int]) -> list:
    """The plain-torch engine test's model, pushed and fetched through CudaSymmTransport (deterministic)."""
    from tests._fake_cuda import install_fake_cuda
    from tests.core.test_engine import _owned_grads, one_minibatch

    fake = install_fake_cuda()
    try:
        runs = []
        for _ in range(2):  # the same minibatch twice: the deterministic mode must repeat bitwise
            transport = CudaSymmTransport(None, accumulate_mode="deterministic")
            engine, hooks = one_minibatch(transport, counts, rank)
            runs.append(
                {
                    "grads": _owned_grads(engine),
                    "staged": sorted(transport._staging),
                    "grad_buffers": sorted(n for n in transport.buffer_names if ".grad." in n),
                }
            )
            hooks.remove()
            engine.close()
        return runs
    finally:
        fake.revert()


def test_engine_over_the_cuda_transport_matches_one_process_and_repeats_bitwise() -> None:
    from tests._dist import run_ranks
    from tests.core.test_engine import _assemble, _oracle, assert_rel_close

    counts = [1, 3]
    results = run_ranks(_run_engine_on_fake_cuda_transport, 2, counts, timeout_s=120)
    oracle_grads, _ = _oracle(counts, 1)
    got = _assemble([(runs, None) for runs in results], 0, oracle_grads[0])
    for name, expected in oracle_grads[0].items():
        assert_rel_close(got[name], expected, 1e-5, name)
    for runs in results:
        first, second = runs
        # Staging slots only for the gradient accumulators, not for the read-only parameter shards.
        assert first["staged"] == first["grad_buffers"]
        for (name, offset, a), (_, _, b) in zip(first["grads"], second["grads"], strict=True):
            assert torch.equal(a, b), f"{name}@{offset}: deterministic mode changed bits"
