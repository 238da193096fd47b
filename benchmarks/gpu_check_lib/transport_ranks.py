"""The transport checks' rank bodies: the correctness round (gathers, gets, concurrent accumulates, the
overlap schedule) over ``CudaSymmTransport`` and ``NvshmemTransport``, and the bandwidth timings."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.gpu_check_lib.world import accumulate_modes, rank_device


def _rank_pattern(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers: exact in bf16 (< 256) and exact when summed in fp32.
    return ((torch.arange(numel, device=rank_device()) % 16) + 16 * rank).to(dtype)


def run_correctness(rank: int, world_size: int, modes: list[str], fence_via: str) -> dict:
    from megatron_odc.transport.cuda import CudaSymmTransport

    report: dict[str, Any] = {}
    for mode in modes:
        t = CudaSymmTransport(None, accumulate_mode=mode, fence_via=fence_via)
        report["features"] = str(t.features)
        failures, err = _transport_round(t, rank, world_size, mode, mode == "deterministic")
        report[mode] = {"failures": failures, "max_abs_err": err}
        t.close()
    return report


def run_nvshmem(rank: int, world_size: int, modes: list[str]) -> dict:
    """``_transport_round`` over ``NvshmemTransport``, for each ``remote_peers`` mode in ``modes``."""
    from megatron_odc.transport.nvshmem import NvshmemTransport

    report: dict[str, Any] = {}
    for mode in modes:
        t = NvshmemTransport(None, remote_peers=mode)
        failures, err = _transport_round(t, rank, world_size, f"nvshmem {mode}", True)
        others = set(range(world_size)) - {rank}
        if mode == "all" and t.remote != others:
            failures.append(
                f"nvshmem all: peers {sorted(t.remote)} through NVSHMEM, not {sorted(others)}"
            )
        report[mode] = {
            "failures": failures,
            "max_abs_err": err,
            "remote": sorted(t.remote),
            "heap_nbytes": t.heap_nbytes,
        }
        t.close()
    return report


def _transport_round(t, rank: int, world_size: int, mode: str, deterministic: bool) -> tuple:
    """Gathers, gets, exact and random concurrent accumulates and the overlap schedule on transport
    ``t``; returns ``(failures, max abs error of the random sums)``."""
    failures = []
    n = 10007  # odd: not a multiple of any block size
    p_bf16 = t.register("p_bf16", n, torch.bfloat16, accumulate=False)
    p_f32 = t.register("p_f32", n, torch.float32, accumulate=False)  # no staging slots for it
    g = t.register("g", n, torch.float32)
    p_bf16.copy_(_rank_pattern(rank, n, torch.bfloat16))
    p_f32.copy_(_rank_pattern(rank, n, torch.float32))
    t.fence()
    for name, dtype in (("p_bf16", torch.bfloat16), ("p_f32", torch.float32)):
        out = torch.empty(world_size * n, dtype=dtype, device=rank_device())
        t.gather_shards(name, out)
        expected = torch.cat([_rank_pattern(r, n, dtype) for r in range(world_size)])
        if not torch.equal(out, expected):
            failures.append(f"{mode}: gather_shards({name}) differs from the shards")
    try:
        t.accumulate("p_f32", 0, 0, torch.ones(4, device=rank_device()))
        failures.append(f"{mode}: an accumulate into a read-only buffer was accepted")
    except ValueError:
        pass
    if deterministic and sorted(t._staging) != ["g"]:
        failures.append(f"{mode}: staging slots for {sorted(t._staging)}, expected ['g']")
    peer = (rank + 1) % world_size
    part = torch.empty(100, dtype=torch.float32, device=rank_device())
    t.get("p_f32", peer, 5, part)
    if not torch.equal(part, _rank_pattern(peer, n, torch.float32)[5:105]):
        failures.append(f"{mode}: get at offset 5 from rank {peer} differs")

    # Everyone accumulates into every owner at once, 3 times, plus a bf16 source: exact integer sums.
    idx = torch.arange(world_size * n, device=rank_device())
    for _ in range(3):
        t.scatter_accumulate("g", ((rank + 1) * (1 + idx % 7)).float())
    t.scatter_accumulate("g", ((idx % 5) + rank).to(torch.bfloat16))
    t.fence()
    mine = idx[rank * n : (rank + 1) * n]
    total_ranks = sum(r + 1 for r in range(world_size))
    expected = 3 * total_ranks * (1 + mine % 7) + world_size * (mine % 5) + sum(range(world_size))
    if not torch.equal(g, expected.float()):
        bad = int((g != expected.float()).sum())
        failures.append(f"{mode}: concurrent accumulate lost or duplicated {bad} element(s)")

    # Random fp32 sums: float64 oracle; deterministic mode must repeat bitwise.
    repeats = []
    for _ in range(2):
        g.zero_()
        t.fence()
        gen = torch.Generator(device=rank_device()).manual_seed(1234 + rank)
        t.scatter_accumulate(
            "g", torch.randn(world_size * n, device=rank_device(), generator=gen) * (rank + 1)
        )
        t.fence()
        repeats.append(g.clone())
    oracle = torch.zeros(n, dtype=torch.float64, device=rank_device())
    for r in range(world_size):
        gen = torch.Generator(device=rank_device()).manual_seed(1234 + r)
        full = torch.randn(world_size * n, device=rank_device(), generator=gen) * (r + 1)
        oracle += full[rank * n : (rank + 1) * n].double()
    err = float((repeats[0].double() - oracle).abs().max())
    if err > 1e-4:
        failures.append(f"{mode}: random sums off by {err:.3g} against float64")
    if deterministic and not torch.equal(repeats[0], repeats[1]):
        failures.append(f"{mode}: two identical runs differ bitwise")
    failures += _overlap_round(t, rank, world_size, n, mode)
    return failures, err


def _overlap_round(t, rank: int, world_size: int, n: int, mode: str) -> list[str]:
    """Fetch / compute / push of 4 buckets through ``OverlapSchedule`` on CUDA streams."""
    from megatron_odc.core.streams import BucketWork, OverlapSchedule, TorchStreams

    g = t.local("g")
    g.zero_()
    t.fence()
    num_buckets, chunk = 4, n // 4
    peer = (rank + 1) % world_size  # fetch from and push to the next rank
    working = [torch.empty(chunk, device=rank_device()) for _ in range(num_buckets)]
    grads = [torch.empty(chunk, device=rank_device()) for _ in range(num_buckets)]

    def work(k: int) -> BucketWork:
        return BucketWork(
            fetch=lambda: t.get("p_f32", peer, k * chunk, working[k]),
            compute=lambda: torch.mul(working[k], 2.0, out=grads[k]),
            push=lambda: t.accumulate("g", peer, k * chunk, grads[k]),
        )

    schedule = OverlapSchedule(TorchStreams(rank_device()), max_fetched=2, max_pushing=1)
    schedule.run([work(k) for k in range(num_buckets)])
    schedule.fence()
    t.fence()
    # Owner r received exactly one push: from rank r - 1, which fetched r's own shard.
    expected = 2.0 * _rank_pattern(rank, n, torch.float32)[: num_buckets * chunk]
    if not torch.equal(g[: num_buckets * chunk], expected):
        return [f"{mode}: overlap schedule (fetch/compute/push on streams) gave wrong sums"]
    return []


def _time_op(fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``fn`` (which must leave its work complete), after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_bandwidth(rank: int, world_size: int, size_mib: int, repeats: int, fence_via: str) -> dict:
    from megatron_odc.transport.cuda import CudaSymmTransport

    numel = size_mib * (1 << 20) // 4
    nbytes = numel * 4
    transports = {
        mode: CudaSymmTransport(None, accumulate_mode=mode, fence_via=fence_via)
        for mode in accumulate_modes()
    }
    reader = next(iter(transports.values()))
    shard = reader.register("b", numel, torch.float32, accumulate=False)
    for t in transports.values():
        t.register("g", numel, torch.float32)
    shard.fill_(float(rank + 1))
    src = torch.full((numel,), 0.5, device=rank_device())
    dst = torch.empty(numel, device=rank_device())
    for t in transports.values():
        t.fence()
    result: dict[str, float] = {}
    # Rank 1 waits on the host (gloo), not in a barrier kernel that would share the GPU with the timing.
    if rank == 0:
        secs = {
            "copy": _time_op(lambda: dst.copy_(src), repeats),
            "get": _time_op(lambda: reader.get("b", 1, 0, dst), repeats),
            "add": _time_op(lambda: dst.add_(src), repeats),
        }
        for mode, t in transports.items():
            key = {"atomic": "acc_atomic", "deterministic": "acc_det"}[mode]
            secs[key] = _time_op(functools.partial(_accumulate_and_flush, t, src), repeats)
        result = {f"{k}_gbps": nbytes / v / 1e9 for k, v in secs.items()}
        result["get_vs_copy"] = result["get_gbps"] / result["copy_gbps"]
        if "acc_atomic_gbps" in result:
            result["acc_vs_add"] = result["acc_atomic_gbps"] / result["add_gbps"]
        result["acc_det_vs_add"] = result["acc_det_gbps"] / result["add_gbps"]
    dist.barrier()
    for t in transports.values():
        t.fence()  # rank 1 reduces the deterministic staging here
        t.close()
    return result


def _accumulate_and_flush(t, src: torch.Tensor) -> None:
    t.accumulate("g", 1, 0, src)
    t.flush()
