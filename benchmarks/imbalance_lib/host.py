"""The host under the benchmark: the cost model fitted to it, and whether it emulates the bf16 GEMM."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.imbalance_lib.model import build_model
from benchmarks.imbalance_lib.settings import DTYPES, MODEL
from benchmarks.imbalance_lib.workload import build_microbatches


def calibrate(lengths: Sequence[int], dtype: str, repeats: int = 5) -> dict:
    """Times fwd+bwd of one sample per length on one core; least-squares fit of a*s^2 + b*s (seconds)."""
    settings = {"lengths": list(lengths), "repeats": repeats, "dtype": dtype}
    tmp = Path(tempfile.mkdtemp(prefix="odc-calib-"))
    try:
        ctx = mp.get_context("spawn")
        os.environ["OMP_NUM_THREADS"] = "1"
        proc = ctx.Process(target=_calibrate_main, args=(settings, str(tmp)))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"calibration process failed with exit code {proc.exitcode}")
        with open(tmp / "calib.pkl", "rb") as f:
            times = pickle.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    s = torch.tensor(lengths, dtype=torch.float64)
    t = torch.tensor(times, dtype=torch.float64)
    design = torch.stack([s * s, s, torch.ones_like(s)], dim=1)
    coef = torch.linalg.lstsq(design, t.unsqueeze(1)).solution.flatten()
    a, b, c = float(coef[0]), float(coef[1]), float(coef[2])
    longest = max(lengths)
    return {
        "a": a,
        "b": b,
        "c_per_microbatch_s": c,
        "lengths": list(lengths),
        "times_s": times,
        "attention_share_at_longest": a * longest / (a * longest + b),
    }


def _calibrate_main(settings: dict, out_dir: str) -> None:
    from megatron.core import parallel_state

    from megatron_odc.integration.cpu import apply_cpu_patches

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=0, world_size=1)
    patches = apply_cpu_patches()
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        model = build_model(seed=1, seq_length=max(settings["lengths"]), dtype=settings["dtype"])
        times = []
        for length in settings["lengths"]:
            (mb,) = build_microbatches([[0]], {0: length}, MODEL["vocab_size"])
            samples = []
            for _ in range(settings["repeats"] + 1):
                start = time.perf_counter()
                out = model(
                    mb["tokens"], mb["position_ids"], mb["attention_mask"], labels=mb["labels"]
                )
                (out.float() * mb["loss_mask"]).sum().backward()
                samples.append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
            times.append(min(samples[1:]))  # least disturbed by other load
        with open(Path(out_dir) / "calib.pkl", "wb") as f:
            pickle.dump(times, f)
        parallel_state.destroy_model_parallel()
    finally:
        patches.revert()
        dist.destroy_process_group()


SLOW_MATMUL_RATIO = 3.0
"""A ``--dtype`` matmul this many times slower than fp32's is emulated by the host: the benchmark warns."""


def matmul_slowdown(dtype: str, repeats: int = 5) -> float:
    """Time of one benchmark-sized GEMM (tokens x hidden x FFN) in ``dtype`` over fp32's, one thread.

    oneDNN runs bf16 GEMMs natively only with AVX-512 BF16 / AMX; on an AVX2 host it converts and
    is measured 36x slower than fp32 (2026-12-05), so compute dominates every configuration and the
    ratios between them shrink towards 1: such runs are not comparable with runs on other hosts.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {}
        for name in {"fp32", dtype}:
            a = torch.randn(1024, MODEL["hidden_size"], dtype=DTYPES[name])
            b = torch.randn(MODEL["hidden_size"], MODEL["ffn_hidden_size"], dtype=DTYPES[name])
            a @ b
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                samples.append(time.perf_counter() - start)
            times[name] = min(samples)
        return times[dtype] / times["fp32"]
    finally:
        torch.set_num_threads(threads)
