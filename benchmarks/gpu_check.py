"""GPU check of the CUDA path, in one call on one GPU (H200: 76 s measured; installs nothing itself).

Runs, each in its own spawned world of processes that share ``cuda:0`` (gloo process group through a file
store, ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``), with a deadline per check:

==================  ======================================================================================
check               what it runs and what passes
==================  ======================================================================================
correctness w=2/4   ``CudaSymmTransport`` in both accumulate modes (atomic, deterministic): whole-bucket
                    gather (bf16 and fp32) equals every rank's shard; a partial get at an offset; every rank
                    accumulating integer-valued fp32 and bf16 sources into every owner at once, 3 times
                    (exact sums: a lost update shows); random fp32 sums against a float64 oracle, and in
                    deterministic mode bitwise equal across two repeats; read-only buffers refuse
                    accumulates; 4 buckets through ``OverlapSchedule`` on CUDA streams
nvshmem w=2         ``NvshmemTransport`` (PyTorch symmetric memory, NVSHMEM backend) through the same round
                    as the correctness check, with ``remote_peers="all"`` (every peer through the NVSHMEM
                    get / put Triton kernels and the bounce buffers, as across nodes) and ``"auto"`` (the
                    peer by load / store); exact and bitwise repeatable staged sums. SKIP, with the reason,
                    where PyTorch has no NVSHMEM or Triton / NVSHMEM's device library is missing
bandwidth w=2       rank 0 alone (rank 1 idle): get from the peer vs a device-to-device ``copy_``, and
                    accumulate (atomic, and deterministic) into the peer vs a local ``add_``; payload GB/s,
                    median of ``--repeats``; targets: get >= 0.8x copy, atomic accumulate >= 0.5x add_
parity w=2          a bf16 megatron-core GPT (local spec) trained 3 steps with microbatch counts 1 and 3:
                    ODC over the CUDA transport (fetch / push on side streams, prefetch on) in atomic and
                    deterministic mode against megatron-core DDP, with DDP's optimizer kernel: losses and
                    every parameter within bf16 tolerance; deterministic mode bitwise equal across two
                    runs; ODC's own fused Adam: losses and the whole model within bf16 tolerance
fp8 emulated w=2    ``EmulatedFloat8Tensor`` MLP weights (FP8 bytes sharded, fetched, re-quantised with a
                    DP-wide amax) trained by ODC on the GPU against ``tests/mcore/test_fp8_params.py``'s
                    one-process oracle, run on the GPU too
te fp8 w=2          if TransformerEngine imports: TE-spec GPT with ``fp8=hybrid`` (tensorwise), 3 steps:
                    DDP with bf16 parameters, ODC with bf16 parameters, ODC with FP8 parameters
                    (``fp8_param``, TE's ``Float8Tensor``); finite losses within 5% of DDP's. Otherwise SKIP
==================  ======================================================================================

megatron-core is not on the GPU image: ``benchmarks/gpu_check.sh`` installs it from wheels carried in
``.whl/`` (``docs/benchmarks.md`` says how to fetch them) and runs this script. The report ends with one
short table (check, result, numbers). ``--json PATH`` also writes every number. ``--dry-run`` (CPU) checks
imports, argument parsing and that the rank functions pickle, lists the checks and exits 0.

``--cpu-rehearsal`` runs the same checks, rank bodies and judgements on CPU, so the harness is known to
work before a GPU's minutes are spent on it: megatron-core's CPU patches, ``tests/_fake_cuda.py``'s host
memory as symmetric memory (the transport's own code runs unchanged), the deterministic accumulate mode
only (the atomic one's Triton kernel needs a GPU; the parity check puts the shm transport in its place),
a small bandwidth shard whose numbers are reported but not judged. Its table says "CPU rehearsal (not a
GPU result)". Usage: ``python benchmarks/gpu_check.py [--cpu-rehearsal] [--size-mib 256] [--repeats 5]
[--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

logger = logging.getLogger("gpu_check")

OVERLAP_ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "OMP_NUM_THREADS": "1"}
GET_TARGET = 0.8
ACCUMULATE_TARGET = 0.5
BF16_LOSS_RTOL = 2e-2
BF16_PARAM_RTOL = 2e-2
FP8_LOSS_RTOL = 5e-2
REHEARSAL_SIZE_MIB = 8

_REHEARSAL = False
"""Set in each rank process: True under ``--cpu-rehearsal`` (host memory, faked GPU; see ``_child``)."""


def _device() -> str:
    """Where the rank bodies allocate: ``cpu`` in a rehearsal, else the one GPU."""
    return "cpu" if _REHEARSAL else "cuda"


def _accumulate_modes() -> list[str]:
    """The CUDA transport's accumulate modes that can run here (atomic needs Triton on a real GPU)."""
    return ["deterministic"] if _REHEARSAL else ["atomic", "deterministic"]


# ---------------------------------------------------------------------- launcher


def _on_device(rank: int, world_size: int, fn: Callable, rehearsal: bool, *args: Any) -> Any:
    """One rank of a check: on ``cuda:0``, or in a rehearsal on CPU with the fakes."""
    global _REHEARSAL
    _REHEARSAL = rehearsal
    with contextlib.ExitStack() as undo:
        if rehearsal:  # megatron-core's CPU runtime, and host memory as the "GPU"
            from megatron_odc.integration.cpu import apply_cpu_patches
            from tests._fake_cuda import install_fake_cuda

            undo.callback(apply_cpu_patches().revert)
            undo.callback(install_fake_cuda(nvshmem=True).revert)
        else:
            torch.cuda.set_device(0)
        return fn(rank, world_size, *args)


def run_world(fn: Callable, world_size: int, *args: Any, timeout_s: float) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes sharing cuda:0.

    The spawning, deadline and per-rank reports are the test harness's (``tests/_dist.py``), which
    gives every run a private ``MEGATRON_ODC_SHM_DIR`` and removes it. In a rehearsal the processes run
    on CPU instead: megatron-core's CPU patches, and ``tests/_fake_cuda.py``'s host-memory symmetric
    memory under that directory.
    """
    from tests._dist import run_ranks

    return run_ranks(
        _on_device,
        world_size,
        fn,
        _REHEARSAL,
        *args,
        timeout_s=timeout_s,
        pg_timeout_s=120,
        env=OVERLAP_ENV,
    )


# ---------------------------------------------------------------------- rank bodies


def _rank_pattern(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers: exact in bf16 (< 256) and exact when summed in fp32.
    return ((torch.arange(numel, device=_device()) % 16) + 16 * rank).to(dtype)


def _run_correctness(rank: int, world_size: int, modes: list[str], fence_via: str) -> dict:
    from megatron_odc.transport.cuda import CudaSymmTransport

    report: dict[str, Any] = {}
    for mode in modes:
        t = CudaSymmTransport(None, accumulate_mode=mode, fence_via=fence_via)
        report["features"] = str(t.features)
        failures, err = _transport_round(t, rank, world_size, mode, mode == "deterministic")
        report[mode] = {"failures": failures, "max_abs_err": err}
        t.close()
    return report


def _run_nvshmem(rank: int, world_size: int, modes: list[str]) -> dict:
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
        out = torch.empty(world_size * n, dtype=dtype, device=_device())
        t.gather_shards(name, out)
        expected = torch.cat([_rank_pattern(r, n, dtype) for r in range(world_size)])
        if not torch.equal(out, expected):
            failures.append(f"{mode}: gather_shards({name}) differs from the shards")
    try:
        t.accumulate("p_f32", 0, 0, torch.ones(4, device=_device()))
        failures.append(f"{mode}: an accumulate into a read-only buffer was accepted")
    except ValueError:
        pass
    if deterministic and sorted(t._staging) != ["g"]:
        failures.append(f"{mode}: staging slots for {sorted(t._staging)}, expected ['g']")
    peer = (rank + 1) % world_size
    part = torch.empty(100, dtype=torch.float32, device=_device())
    t.get("p_f32", peer, 5, part)
    if not torch.equal(part, _rank_pattern(peer, n, torch.float32)[5:105]):
        failures.append(f"{mode}: get at offset 5 from rank {peer} differs")

    # Everyone accumulates into every owner at once, 3 times, plus a bf16 source: exact integer sums.
    idx = torch.arange(world_size * n, device=_device())
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
        gen = torch.Generator(device=_device()).manual_seed(1234 + rank)
        t.scatter_accumulate(
            "g", torch.randn(world_size * n, device=_device(), generator=gen) * (rank + 1)
        )
        t.fence()
        repeats.append(g.clone())
    oracle = torch.zeros(n, dtype=torch.float64, device=_device())
    for r in range(world_size):
        gen = torch.Generator(device=_device()).manual_seed(1234 + r)
        full = torch.randn(world_size * n, device=_device(), generator=gen) * (r + 1)
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
    working = [torch.empty(chunk, device=_device()) for _ in range(num_buckets)]
    grads = [torch.empty(chunk, device=_device()) for _ in range(num_buckets)]

    def work(k: int) -> BucketWork:
        return BucketWork(
            fetch=lambda: t.get("p_f32", peer, k * chunk, working[k]),
            compute=lambda: torch.mul(working[k], 2.0, out=grads[k]),
            push=lambda: t.accumulate("g", peer, k * chunk, grads[k]),
        )

    schedule = OverlapSchedule(TorchStreams(_device()), max_fetched=2, max_pushing=1)
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


def _run_bandwidth(rank: int, world_size: int, size_mib: int, repeats: int, fence_via: str) -> dict:
    from megatron_odc.transport.cuda import CudaSymmTransport

    numel = size_mib * (1 << 20) // 4
    nbytes = numel * 4
    transports = {
        mode: CudaSymmTransport(None, accumulate_mode=mode, fence_via=fence_via)
        for mode in _accumulate_modes()
    }
    reader = next(iter(transports.values()))
    shard = reader.register("b", numel, torch.float32, accumulate=False)
    for t in transports.values():
        t.register("g", numel, torch.float32)
    shard.fill_(float(rank + 1))
    src = torch.full((numel,), 0.5, device=_device())
    dst = torch.empty(numel, device=_device())
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


PARITY_COUNTS = (1, 3)
"""Microbatches per DP rank in the training checks: uneven, as ODC allows and its users run."""


def _to_cuda(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.contiguous().to(_device()) for k, v in batch.items()}


def _gpt_batches(cfg, step: int, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's microbatches of ``step`` (``PARITY_COUNTS[dp_rank]`` of them), on the GPU."""
    from tests._megatron import make_batch

    first = 1000 * step + sum(PARITY_COUNTS[:dp_rank])
    return [_to_cuda(make_batch(cfg, 1, seed=first + i)) for i in range(PARITY_COUNTS[dp_rank])]


def _train(
    backend: str,
    build_model: Callable,
    cfg,
    steps: int,
    opt_config,
    options=None,
    batches: Callable | None = None,
) -> dict:
    """Train ``steps`` steps with ``backend`` on this rank's uneven microbatches; losses and weights.

    ``batches(step, dp_rank)`` gives a rank's microbatches (default: ``_gpt_batches``).
    """
    batches = batches or functools.partial(_gpt_batches, cfg)
    from megatron.core.transformer.module import Float16Module

    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.step import train_step
    from tests._megatron import _forward_step

    model = build_model()
    if cfg.bf16:
        model = Float16Module(model.config, model)
    wrapped, optimizer = build_backend(
        backend, model, opt_config, odc_config=options if backend == "odc" else None
    )
    dp_rank = dist.get_rank()
    losses = []
    for step in range(steps):
        with _one_by_one_collectives():
            out = train_step(
                wrapped,
                optimizer,
                _forward_step,
                batches(step, dp_rank),
                seq_length=cfg.seq_length,
            )
        total = torch.stack([r["lm loss"] for r in out["losses"]]).sum(dim=0)
        report = total.detach().double().cpu()  # gloo: reduce on the host
        dist.all_reduce(report)
        losses.append(float(report[0] / report[1]))
    if backend == "odc":
        state = wrapped.engine.full_parameters()
        scale_inv = {
            n: float(p._scale_inv)
            for n, p in wrapped.engine.parameters()
            if n in wrapped.engine.fp8_names
        }
        wrapped.close()
    else:
        state = {n: p.detach() for n, p in wrapped.module.named_parameters()}
        scale_inv = {}
    state = {k.removeprefix("module."): v.float().cpu() for k, v in state.items()}
    return {"losses": losses, "state": state, "scale_inv": scale_inv}


class _DoneWork:
    """The handle ``_one_by_one_collectives`` yields: its collectives already ran synchronously."""

    def wait(self) -> None:
        return None


@contextlib.contextmanager
def _one_by_one_collectives():
    """Megatron DDP's gradient all-reduce without ``torch.distributed._coalescing_manager``.

    The check's ranks share one GPU, which NCCL refuses, so their process group is gloo; gloo's
    coalesced all-reduce takes no CUDA tensors ("ProcessGroupGloo::allreduce_coalesced: unsupported
    device type cuda", seen on the H200), its plain all-reduce does. Inside this block megatron-core's
    ``param_and_grad_buffer`` issues each bucket's all-reduce on its own; the sums are the same. Only
    the synchronous path is allowed (the check's DDP config has ``overlap_grad_reduce`` off). Used in
    the rehearsal too, so the CPU runs the same DDP path as the GPU.
    """
    from megatron.core.distributed import param_and_grad_buffer

    @contextlib.contextmanager
    def uncoalesced(group=None, device=None, async_ops=False):
        assert not async_ops, "the check's DDP oracle reduces gradients synchronously"
        yield _DoneWork()

    original = param_and_grad_buffer._coalescing_manager
    param_and_grad_buffer._coalescing_manager = uncoalesced
    try:
        yield
    finally:
        param_and_grad_buffer._coalescing_manager = original


def _gpt_config(**overrides):
    from megatron_odc.mcore.model import GPTConfig

    kw = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "ffn_hidden_size": 176,
        "vocab_size": 256,
        "seq_length": 48,
        "params_dtype": torch.bfloat16,
        "bf16": True,
        **overrides,
    }
    return GPTConfig(**kw)


def _adam(cfg):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.01,
        clip_grad=1.0,
        bf16=cfg.bf16,
        params_dtype=cfg.params_dtype,
    )


def _local_gpt(cfg, seed: int) -> Callable:
    from megatron_odc.mcore.model import build_gpt_model

    return lambda: build_gpt_model(cfg, seed).to(_device())


def _odc_options(bucket_size: int, mode: str | None = None):
    """ODC over the CUDA transport; ``mode`` None: the first accumulate mode that runs here."""
    from megatron_odc.mcore.config import ODCConfig

    return ODCConfig(
        transport="cuda", cuda_accumulate=mode or _accumulate_modes()[0], bucket_size=bucket_size
    )


def _shm_options(bucket_size: int):
    from megatron_odc.mcore.config import ODCConfig

    return ODCConfig(transport="shm", bucket_size=bucket_size)


def _max_param_rel_err(got: dict, ref: dict) -> float:
    worst = 0.0
    for name, want in ref.items():
        have = got[name].view(want.shape)
        worst = max(worst, float((have - want).norm() / want.norm().clamp_min(1e-12)))
    return worst


def _worst_params(got: dict, ref: dict, count: int = 6) -> list[dict]:
    """The ``count`` parameters furthest from ``ref`` (relative norm), with what explains the figure."""
    rows = []
    for name, want in ref.items():
        have = got[name].view(want.shape)
        diff = have - want
        rows.append(
            {
                "name": name,
                "rel_err": float(diff.norm() / want.norm().clamp_min(1e-12)),
                "ref_norm": float(want.norm()),
                "max_abs_diff": float(diff.abs().max()),
                "frac_differing": float((diff != 0).float().mean()),
            }
        )
    return sorted(rows, key=lambda row: -row["rel_err"])[:count]


@contextlib.contextmanager
def _torch_default_optimizer_kernel():
    """ODC's optimizer with torch's default Adam kernel choice (what megatron-core DDP gets without
    TransformerEngine or apex) instead of ``fused=True``: separates the optimizer kernel's rounding
    from the data-parallel path's."""
    from megatron_odc.mcore import optimizer as odc_optimizer

    def default_kernel(optimizer_cls, param_groups, **options):
        return optimizer_cls(param_groups, **options), f"{optimizer_cls.__name__} torch default"

    original = odc_optimizer.fused_multi_tensor
    odc_optimizer.fused_multi_tensor = default_kernel
    try:
        yield
    finally:
        odc_optimizer.fused_multi_tensor = original


def _model_rel_err(got: dict, ref: dict) -> float:
    """The parameters' distance from ``ref`` as a whole: the norm of all differences over ``ref``'s."""
    diff = sum(
        float((got[n].view(want.shape) - want).double().pow(2).sum()) for n, want in ref.items()
    )
    norm = sum(float(want.double().pow(2).sum()) for want in ref.values())
    return math.sqrt(diff / max(norm, 1e-300))


def _fraction_differing(got: dict, ref: dict) -> float:
    """The fraction of parameter elements whose values differ at all."""
    differing = sum(int((got[n].view(want.shape) != want).sum()) for n, want in ref.items())
    return differing / max(sum(want.numel() for want in ref.values()), 1)


def _run_parity(rank: int, world_size: int, steps: int) -> dict:
    """bf16 GPT: ODC over the CUDA transport (atomic; deterministic twice) against megatron-core DDP.

    The ODC runs that are compared parameter by parameter use DDP's optimizer kernel (torch's default
    Adam, what megatron-core picks without TransformerEngine or apex), so the comparison isolates the
    data-parallel path. One more run keeps ODC's own ``fused=True`` kernel and is judged on the losses
    and the parameters as a whole: the attention key bias has a mathematically zero gradient (softmax
    is shift-invariant), so Adam's first steps move it by about ``lr`` in the direction of rounding
    noise, and any change of rounding (such as another optimizer kernel) moves its elements by up to
    ``lr`` per step (seen on the H200: 33% of ``linear_qkv.bias``, the key third, at 0.05 relative).
    """
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        cfg = _gpt_config()
        opt = _adam(cfg)
        ddp = _train("ddp", _local_gpt(cfg, 7), cfg, steps, opt)
        # A rehearsal has no Triton: the shm transport stands in for the atomic mode there.
        first = _odc_options(20_000, "atomic") if not _REHEARSAL else _shm_options(20_000)
        det_options = _odc_options(20_000, "deterministic")
        with _torch_default_optimizer_kernel():
            atomic = _train("odc", _local_gpt(cfg, 7), cfg, steps, opt, first)
            det = [
                _train("odc", _local_gpt(cfg, 7), cfg, steps, opt, det_options) for _ in range(2)
            ]
        fused = _train("odc", _local_gpt(cfg, 7), cfg, steps, opt, det_options)
    finally:
        parallel_state.destroy_model_parallel()
    return {
        "ddp_losses": ddp["losses"],
        "odc_losses": atomic["losses"],
        "det_losses": det[0]["losses"],
        "param_rel_err": _max_param_rel_err(atomic["state"], ddp["state"]),
        "det_param_rel_err": _max_param_rel_err(det[0]["state"], ddp["state"]),
        "param_frac_differing": _fraction_differing(atomic["state"], ddp["state"]),
        "det_param_frac_differing": _fraction_differing(det[0]["state"], ddp["state"]),
        "worst_params": _worst_params(atomic["state"], ddp["state"]),
        "det_bitwise_repeat": det[0]["losses"] == det[1]["losses"]
        and all(torch.equal(det[0]["state"][k], det[1]["state"][k]) for k in det[0]["state"]),
        "fused_losses": fused["losses"],
        "fused_model_rel_err": _model_rel_err(fused["state"], ddp["state"]),
        "fused_worst_params": _worst_params(fused["state"], ddp["state"]),
    }


def _run_fp8_emulated(rank: int, world_size: int) -> dict:
    """Emulated FP8 MLP weights, ODC over the CUDA transport, against the CPU test's one-process oracle."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig

    from tests.mcore import test_fp8_params as cpu_test

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        cfg = cpu_test._cfg()

        def build():
            return cpu_test._fp8_model(cfg, seed=3, device=_device())

        opt = OptimizerConfig(
            optimizer="sgd", lr=cpu_test.LR, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0
        )
        options = _odc_options(1500)
        odc = _train(
            "odc",
            build,
            cfg,
            cpu_test.STEPS,
            opt,
            options,
            batches=lambda step, dp_rank: [
                _to_cuda(b) for b in cpu_test._batches(cfg, step)[dp_rank]
            ],
        )
        oracle = cpu_test._oracle(cfg, seed=3, device=_device()) if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()
    return {"odc": odc, "oracle": oracle}


def _run_te_fp8(rank: int, world_size: int, steps: int) -> dict:
    """TE-spec GPT, FP8 compute (hybrid, tensorwise): bf16 parameters under DDP and ODC, FP8 parameters
    under ODC (re-quantised owned shards, FP8 bytes fetched)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        cfg = _gpt_config(hidden_size=128, ffn_hidden_size=256, seq_length=64)
        opt = _adam(cfg)
        options = _odc_options(50_000)
        runs = {
            "ddp_bf16_params": _train("ddp", _te_gpt(cfg, 7, False), cfg, steps, opt),
            "odc_bf16_params": _train("odc", _te_gpt(cfg, 7, False), cfg, steps, opt, options),
            "odc_fp8_params": _train("odc", _te_gpt(cfg, 7, True), cfg, steps, opt, options),
        }
    finally:
        parallel_state.destroy_model_parallel()
    return {
        name: {"losses": r["losses"], "num_fp8": len(r["scale_inv"])} for name, r in runs.items()
    }


def _te_gpt(cfg, seed: int, fp8_params: bool) -> Callable:
    def build():
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from megatron_odc.core.fp8 import check_fp8_recipe, check_te_request
        from megatron_odc.mcore.model import transformer_config

        check_te_request(transformer_impl="transformer_engine", fp8="hybrid", fp8_param=fp8_params)
        model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        config = transformer_config(cfg)
        config.fp8 = "hybrid"
        config.fp8_recipe = "tensorwise"
        config.fp8_param = fp8_params
        config.use_cpu_initialization = False
        check_fp8_recipe(config)
        return GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length,
        ).cuda()

    return build


# ---------------------------------------------------------------------- checks


def _check_correctness(args, world_size: int) -> tuple[bool, str, dict]:
    modes = _accumulate_modes()
    results = run_world(
        _run_correctness, world_size, modes, args.fence_via, timeout_s=args.timeout_s
    )
    failures = [
        f"rank {r}: {f}" for r, res in enumerate(results) for m in modes for f in res[m]["failures"]
    ]
    err = max(res[m]["max_abs_err"] for res in results for m in modes)
    detail = f"{'+'.join(modes)}, max|err| {err:.2g}" if not failures else "; ".join(failures[:3])
    return not failures, detail, {"results": results}


NVSHMEM_MODES = ("all", "auto")
"""``remote_peers`` of the nvshmem check: every peer through NVSHMEM get / put, then by load / store."""


def _check_nvshmem(args) -> tuple[bool, str, dict]:
    if not _REHEARSAL:  # in a rehearsal the fakes give the ranks an NVSHMEM PyTorch
        from megatron_odc.transport.nvshmem import load_device_ops, nvshmem_unavailable_reason

        reason = nvshmem_unavailable_reason()
        if reason is None:
            try:
                load_device_ops()
            except ValueError as exc:
                reason = str(exc)
        if reason is not None:
            return True, f"NVSHMEM unavailable: {reason}", {"skipped": True}
    modes = list(NVSHMEM_MODES)
    results = run_world(_run_nvshmem, 2, modes, timeout_s=args.timeout_s)
    failures = [
        f"rank {r}: {f}" for r, res in enumerate(results) for m in modes for f in res[m]["failures"]
    ]
    err = max(res[m]["max_abs_err"] for res in results for m in modes)
    auto_remote = [res["auto"]["remote"] for res in results]
    detail = (
        f"get/put through NVSHMEM (all) and load/store (auto: NVSHMEM peers {auto_remote}), "
        f"max|err| {err:.2g}"
        if not failures
        else "; ".join(failures[:3])
    )
    return not failures, detail, {"results": results}


def _check_bandwidth(args) -> tuple[bool, str, dict]:
    res = run_world(
        _run_bandwidth, 2, args.size_mib, args.repeats, args.fence_via, timeout_s=args.timeout_s
    )[0]
    get = f"get {res['get_gbps']:.0f} vs copy {res['copy_gbps']:.0f} GB/s"
    detail = f"{get} ({res['get_vs_copy']:.2f}x); "
    if _REHEARSAL:  # host memory: the numbers say the code ran, not how fast a GPU is
        ok = all(math.isfinite(v) and v > 0 for v in res.values())
        detail += (
            f"det acc {res['acc_det_gbps']:.1f} vs add_ {res['add_gbps']:.1f} GB/s; "
            "targets not judged on CPU"
        )
        return ok, detail, res
    ok = res["get_vs_copy"] >= GET_TARGET and res["acc_vs_add"] >= ACCUMULATE_TARGET
    detail += (
        f"acc {res['acc_atomic_gbps']:.0f} vs add_ {res['add_gbps']:.0f} ({res['acc_vs_add']:.2f}x); "
        f"det acc {res['acc_det_gbps']:.0f} ({res['acc_det_vs_add']:.2f}x)"
    )
    return ok, detail, res


def _check_parity(args) -> tuple[bool, str, dict]:
    res = run_world(_run_parity, 2, 3, timeout_s=args.timeout_s)[0]
    loss_err = max(
        abs(a - b) / abs(b)
        for losses in (res["odc_losses"], res["det_losses"])
        for a, b in zip(losses, res["ddp_losses"])
    )
    worst_param = max(res["param_rel_err"], res["det_param_rel_err"])
    fused_loss_err = max(
        abs(a - b) / abs(b) for a, b in zip(res["fused_losses"], res["ddp_losses"])
    )
    ok = (
        loss_err <= BF16_LOSS_RTOL
        and worst_param <= BF16_PARAM_RTOL
        and res["det_bitwise_repeat"]
        and fused_loss_err <= BF16_LOSS_RTOL
        and res["fused_model_rel_err"] <= BF16_PARAM_RTOL
    )
    detail = (
        f"counts {PARITY_COUNTS}: loss rel err {loss_err:.2g}, param rel err {worst_param:.2g} "
        f"(bf16 tol 2e-2); deterministic repeat bitwise {'yes' if res['det_bitwise_repeat'] else 'NO'}; "
        f"fused Adam: loss {fused_loss_err:.2g}, model {res['fused_model_rel_err']:.2g}"
        + ("; shm in place of atomic" if _REHEARSAL else "")
    )
    return ok, detail, res


def _check_fp8_emulated(args) -> tuple[bool, str, dict]:
    from megatron_odc.core.fp8 import quantization_error_bound

    results = run_world(_run_fp8_emulated, 2, timeout_s=args.timeout_s)
    oracle_losses, oracle_values = results[0]["oracle"]
    odc = [r["odc"] for r in results]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(odc[0]["losses"], oracle_losses))
    same_scales = odc[0]["scale_inv"] == odc[1]["scale_inv"] and bool(odc[0]["scale_inv"])
    worst, matched = 0.0, 1.0
    for name, want in oracle_values.items():
        got = odc[0]["state"][name].view(want.shape)
        if name in odc[0]["scale_inv"]:
            bound = quantization_error_bound(want, 1 / odc[0]["scale_inv"][name]) * 2.000001
            if not bool(((got - want).abs() <= bound).all()):
                worst = float("inf")
            matched = min(matched, float(((got - want).abs() <= 1e-4 * want.abs()).float().mean()))
        else:
            worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-12)))
    ok = loss_err <= 1e-4 and same_scales and worst <= 1e-4 and matched >= 0.99
    detail = (
        f"vs one-process oracle: loss rel err {loss_err:.2g}, other params {worst:.2g}, FP8 values "
        f"matching {matched:.3f}, DP scales equal {'yes' if same_scales else 'NO'}"
    )
    return ok, detail, {"losses": odc[0]["losses"], "oracle_losses": oracle_losses}


def _check_te_fp8(args) -> tuple[bool, str, dict]:
    from megatron_odc.core.fp8 import transformer_engine_available

    if not transformer_engine_available():
        return True, "TransformerEngine not importable here", {"skipped": True}
    res = run_world(_run_te_fp8, 2, 3, timeout_s=args.timeout_s)[0]
    ref = res["ddp_bf16_params"]["losses"]
    errs = {
        name: max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        for name, r in res.items()
        if name != "ddp_bf16_params"
    }
    finite = all(math.isfinite(x) for r in res.values() for x in r["losses"])
    ok = (
        finite
        and all(e <= FP8_LOSS_RTOL for e in errs.values())
        and res["odc_fp8_params"]["num_fp8"] > 0
    )
    detail = (
        f"vs DDP (FP8 compute, bf16 params): ODC bf16 params {errs['odc_bf16_params']:.2g}, ODC FP8 "
        f"params {errs['odc_fp8_params']:.2g} ({res['odc_fp8_params']['num_fp8']} FP8 tensors; tol 5e-2)"
    )
    return ok, detail, res


CHECKS: dict[str, Callable[[argparse.Namespace], tuple[bool, str, dict]]] = {
    "correctness w=2": lambda a: _check_correctness(a, 2),
    "correctness w=4": lambda a: _check_correctness(a, 4),
    "nvshmem w=2": _check_nvshmem,
    "bandwidth w=2": _check_bandwidth,
    "parity w=2 odc vs ddp": _check_parity,
    "fp8 emulated w=2": _check_fp8_emulated,
    "te fp8 w=2": _check_te_fp8,
}
RANK_FUNCTIONS = (
    _run_correctness,
    _run_nvshmem,
    _run_bandwidth,
    _run_parity,
    _run_fp8_emulated,
    _run_te_fp8,
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="check imports and arguments; run nothing"
    )
    parser.add_argument(
        "--cpu-rehearsal",
        action="store_true",
        help="run the checks on CPU (host memory as symmetric memory, no Triton): the harness itself",
    )
    parser.add_argument(
        "--size-mib",
        type=int,
        default=None,
        help=f"shard size of the bandwidth check (default 256; {REHEARSAL_SIZE_MIB} in a rehearsal)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per operation")
    parser.add_argument("--timeout-s", type=float, default=150.0, help="deadline of one check")
    parser.add_argument(
        "--budget-s", type=float, default=450.0, help="skip checks that start later"
    )
    parser.add_argument(
        "--only", nargs="+", choices=sorted(CHECKS), metavar="CHECK", help="run only these checks"
    )
    parser.add_argument(
        "--fence-via",
        choices=("symm_mem", "process_group"),
        default="symm_mem",
        help="fence of the transport checks: symm-mem barrier kernel or a host barrier",
    )
    parser.add_argument("--json", type=Path, help="also write every number to this file")
    args = parser.parse_args(argv)
    if args.size_mib is None:
        args.size_mib = REHEARSAL_SIZE_MIB if args.cpu_rehearsal else 256
    if args.size_mib < 1 or args.repeats < 1 or args.timeout_s <= 0:
        parser.error("--size-mib, --repeats and --timeout-s must be positive")
    return args


def _table(rows: list[tuple[str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in [("check", "result"), *rows]) for i in range(2)]
    lines = [f"{'check':<{widths[0]}}  {'result':<{widths[1]}}  numbers"]
    lines += [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]
    return "\n".join(lines) + "\n"


def _dry_run(args: argparse.Namespace) -> int:
    import megatron_odc.core.fp8
    import megatron_odc.core.streams
    import megatron_odc.transport.cuda as cuda_transport
    from megatron_odc.transport.nvshmem import nvshmem_unavailable_reason

    for fn in RANK_FUNCTIONS:
        pickle.dumps(fn)
    feats = cuda_transport.probe_symm_mem()
    try:  # exactly the names the parity and FP8 rank bodies import
        from megatron.core.models.gpt import GPTModel  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: F401
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.optimizer import OptimizerConfig  # noqa: F401
        from megatron.core.tensor_parallel.random import (  # noqa: F401
            model_parallel_cuda_manual_seed,
        )
        from megatron.core.transformer.module import Float16Module  # noqa: F401

        from megatron_odc.core.fp8 import check_fp8_recipe, quantization_error_bound  # noqa: F401
        from megatron_odc.mcore.backends import build_backend  # noqa: F401
        from megatron_odc.mcore.model import GPTConfig, build_gpt_model, transformer_config  # noqa: F401
        from megatron_odc.mcore.step import train_step  # noqa: F401
        from tests._megatron import _forward_step, make_batch  # noqa: F401
        from tests.mcore import test_fp8_params  # noqa: F401

        megatron_state = "importable"
    except ImportError as exc:
        megatron_state = f"missing ({exc}): the parity check would fail"
    triton_state = "importable"
    try:
        import triton  # noqa: F401
    except ImportError:
        triton_state = "not importable (atomic mode needs it on the GPU box)"
    names = args.only or list(CHECKS)
    sys.stdout.write(
        f"dry run: torch {torch.__version__}, cuda available {torch.cuda.is_available()}\n"
        f"symm_mem: {', '.join(cuda_transport.describe_features(feats))}\n"
        f"nvshmem: {nvshmem_unavailable_reason(feats) or 'available'}\n"
        f"triton: {triton_state}; megatron-core: {megatron_state}; TransformerEngine: "
        f"{'importable' if megatron_odc.core.fp8.transformer_engine_available() else 'not importable'}\n"
        + "".join(f"would run: {name}\n" for name in names)
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the checks; print the table last; exit 0 only if every check passed."""
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.dry_run:
        return _dry_run(args)
    global _REHEARSAL
    _REHEARSAL = args.cpu_rehearsal
    if not _REHEARSAL and not torch.cuda.is_available():
        sys.stdout.write(
            "no CUDA device: nothing to check (use --dry-run or --cpu-rehearsal on CPU)\n"
        )
        return 2
    start = time.monotonic()
    rows, numbers = [], {}
    for name in args.only or list(CHECKS):
        if time.monotonic() - start > args.budget_s:
            rows.append((name, "NOT RUN", f"time budget {args.budget_s:.0f} s spent"))
            continue
        logger.info("running %s", name)
        t0 = time.monotonic()
        try:
            ok, detail, extra = CHECKS[name](args)
        except Exception as exc:  # report and go on with the next check
            ok, detail, extra = False, f"{type(exc).__name__}: {str(exc)[:300]}", {}
            logger.error("%s failed:\n%s", name, exc)
        numbers[name] = {"ok": ok, "detail": detail, "seconds": time.monotonic() - t0}
        with contextlib.suppress(TypeError, ValueError):
            json.dumps(extra)
            numbers[name]["extra"] = extra
        result = ("SKIP" if extra.get("skipped") else "PASS") if ok else "FAIL"
        rows.append((name, result, f"{detail} [{time.monotonic() - t0:.0f} s]"))
    if args.json:
        args.json.write_text(json.dumps(numbers, indent=2, default=str))
    where = "CPU rehearsal (not a GPU result)" if _REHEARSAL else torch.cuda.get_device_name(0)
    header = f"gpu_check: torch {torch.__version__}, {where}, {time.monotonic() - start:.0f} s\n"
    sys.stdout.write(header + _table(rows))
    return 0 if all(r[1] in ("PASS", "SKIP") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
