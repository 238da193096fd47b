"""The spawned world: every backend built in each rank, the cells run interleaved, rank 0's results."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.imbalance_lib.fsdp2 import Fsdp2Probe, build_fsdp2, fsdp2_train_step
from benchmarks.imbalance_lib.model import build_model
from benchmarks.imbalance_lib.probes import Probe, make_forward_step
from benchmarks.imbalance_lib.settings import (
    CONFIGS,
    DTYPES,
    FSDP2_BACKENDS,
    MODEL,
    ODC_VARIANTS,
    OPTIMIZER,
    PAPER_CAP_TOKENS,
    PER_TENSOR_OPTIMIZER_BACKENDS,
    PROFILES,
    WORLD_SIZE,
    config_name,
)
from benchmarks.imbalance_lib.workload import (
    build_microbatches,
    draw_minibatches,
    global_loss_tokens,
    loss_func,
    loss_tokens,
    scaled_lengths,
)
from megatron_odc.balance import CostModel, make_plan

logger = logging.getLogger(__name__)


def build_all(
    seq_length: int, dtype: str, backends: Sequence[str] | None = None
) -> dict[str, tuple[torch.nn.Module, Any, Probe]]:
    """Builds each backend's model (same seed), optimizer and probe; by default every backend of
    :data:`CONFIGS`."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.config import ODCConfig

    if backends is None:
        backends = tuple(dict.fromkeys(backend for backend, _ in CONFIGS))
    built = {}
    for backend in backends:
        if backend in FSDP2_BACKENDS:
            model, optimizer = build_fsdp2(seq_length, dtype, FSDP2_BACKENDS[backend], seed=1)
            built[backend] = (model, optimizer, Fsdp2Probe(backend, model, optimizer))
            continue
        model = build_model(seed=1, seq_length=seq_length, dtype=dtype)
        opt_config = OptimizerConfig(
            optimizer="adam",
            **OPTIMIZER,
            bf16=dtype == "bf16",
            params_dtype=DTYPES[dtype],
        )
        variant = ODC_VARIANTS.get(backend)
        is_odc = variant is not None or backend in PER_TENSOR_OPTIMIZER_BACKENDS
        wrapped, optimizer = build_backend(
            "odc" if is_odc else backend,
            model,
            opt_config,
            odc_config=ODCConfig(**variant) if variant else None,
        )
        if backend in PER_TENSOR_OPTIMIZER_BACKENDS:
            _use_per_tensor_loop(optimizer)
        built[backend] = (wrapped, optimizer, Probe(backend, wrapped, optimizer))
    return built


def _use_per_tensor_loop(optimizer: Any) -> None:
    """Switches ODC's torch optimizer, before its first step, to the per-tensor loop."""
    inner = optimizer.optimizer
    assert not inner.state, "switch the kernel before the first step"
    for group in inner.param_groups:
        group["fused"], group["foreach"] = False, False
    optimizer.implementation = f"{type(inner).__name__} per-tensor loop"


def warm_shapes(warmer: torch.nn.Module, microbatches: Sequence[dict[str, Any]]) -> None:
    """Runs ``microbatches`` forward and backward through ``warmer`` (an unwrapped copy of the model)
    and drops its gradients, so the kernels of their shapes are built before any timed step.

    oneDNN builds a kernel for each new GEMM shape (about 3 ms a shape in bf16 on an AMX host,
    measured): without this, the first configuration of each plan in a repeat pays it for all
    (0.1-0.3 s of a 1 s step), and which configuration runs first decides the ratios.
    """
    for mb in microbatches:
        out = warmer(mb["tokens"], mb["position_ids"], mb["attention_mask"], labels=mb["labels"])
        loss_sum, _, _ = loss_func(mb["loss_mask"], out)
        loss_sum.backward()
    warmer.zero_grad(set_to_none=True)


def one_step(
    built, backend: str, microbatches, seq_length: int, global_tokens: int | None = None
) -> dict[str, Any]:
    """One timed training step of ``backend``; ``global_tokens`` (loss tokens of the global minibatch)
    is needed by the FSDP2 backends only."""
    from megatron_odc.mcore.step import train_step

    wrapped, optimizer, probe = built[backend]
    probe.reset()
    dist.barrier()
    cpu_start = time.thread_time()
    start = time.perf_counter()
    if backend in FSDP2_BACKENDS:
        if global_tokens is None:
            raise ValueError(f"{backend} needs the global minibatch's loss-token count")
        out = fsdp2_train_step(
            wrapped,
            optimizer,
            microbatches,
            global_tokens,
            reshard_after_forward=FSDP2_BACKENDS[backend],
            probe=probe,
        )
    else:
        out = train_step(
            wrapped,
            optimizer,
            make_forward_step(probe),
            [{k: v for k, v in mb.items() if k != "num_tokens"} for mb in microbatches],
            seq_length=seq_length,
        )
    end = time.perf_counter()
    grad_norm = out.get("grad_norm")
    record = {
        "wall_s": end - start,
        "cpu_s": time.thread_time() - cpu_start,
        "num_microbatches": len(microbatches),
        "num_tokens": sum(mb["num_tokens"] for mb in microbatches),
        "unsharded_peak_nbytes": probe.unsharded_peak_nbytes,
        "activation_peak_nbytes": probe.activation_peak_nbytes,
        "events": [(name, s - start, e - start) for name, s, e in probe.events],
        "grad_norm": None if grad_norm is None else float(grad_norm),
    }
    if isinstance(probe, Fsdp2Probe):
        record["idle_s"] = probe.idle_s
        if not probe.measurable:
            record["unsharded_peak_nbytes"] = None
    elif probe.engine is not None:
        snap = wrapped.telemetry()
        record["idle_s"] = snap["fetch_wait_s"] + snap["push_s"] + snap["fence_s"]
        record["fetch_wait_s"] = snap["fetch_wait_s"]
        record["push_s"] = snap["push_s"]
        record["fence_s"] = snap["fence_s"]
    else:
        record["idle_s"] = probe.allreduce_s
    return record


def _rank_microbatches(plan: Any, rank: int, vocab: int) -> list[dict[str, Any]]:
    """``rank``'s packed microbatches of ``plan`` (the same tokens on every call)."""
    return build_microbatches(plan.rank_microbatches(rank), dict(plan.lengths), vocab)


def _probe_allgather(odc_model: torch.nn.Module, repeats: int = 20) -> dict:
    """Median seconds of a gloo all-gather of one transformer layer's parameters (fp32), both ranks."""
    engine = odc_model.engine
    layer_numel = max(b.padded_numel for b in engine.layout.buckets if b.unit != "root")
    shard = torch.zeros(layer_numel // WORLD_SIZE)
    full = torch.zeros(shard.numel() * WORLD_SIZE)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_into_tensor(full, shard)
        times.append(time.perf_counter() - start)
    return {"layer_numel": layer_numel, "allgather_layer_s": statistics.median(times)}


def _rank_main(rank: int, world_size: int, settings: dict, result_path: str) -> None:
    """One rank: build every backend, run every cell interleaved, rank 0 pickles the results."""
    from megatron.core import parallel_state

    from megatron_odc.integration.cpu import apply_cpu_patches

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("megatron").setLevel(logging.ERROR)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{settings['store_path']}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )
    patches = apply_cpu_patches()
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        scale = settings["length_scale"]
        cap = PAPER_CAP_TOKENS // scale
        built = build_all(
            seq_length=cap,
            dtype=settings["dtype"],
            # odc always: the communication probe runs on it
            backends=list(dict.fromkeys(["odc", *(backend for backend, _ in settings["configs"])])),
        )
        cost = CostModel(**settings["cost"])
        vocab = MODEL["vocab_size"]
        warm_lengths = {0: cap // 2, 1: cap // 4}
        warm = build_microbatches([[0], [1]], warm_lengths, vocab)
        warm_tokens = world_size * loss_tokens([[0], [1]], warm_lengths, vocab)
        for backend in built:
            one_step(built, backend, warm, cap, warm_tokens)
        state_nbytes = {b: built[b][2].state_nbytes() for b in built}
        warmer = build_model(seed=1, seq_length=cap, dtype=settings["dtype"])
        comm_probe = _probe_allgather(built["odc"][0])
        results = []
        for profile in settings["profiles"]:
            pool = scaled_lengths(profile, scale)
            for minibatch in settings["minibatches"]:
                global_batch = world_size * minibatch
                seed = settings["seed"] + 1000 * PROFILES.index(profile) + minibatch
                batches = draw_minibatches(pool, global_batch, settings["repeats"], seed)
                cell = {config_name(*c): [] for c in settings["configs"]}
                for repeat, lengths in enumerate(batches):
                    ids = list(range(repeat * global_batch, (repeat + 1) * global_batch))
                    plans = {
                        kind: make_plan(
                            kind,
                            ids,
                            lengths,
                            world_size,
                            cap_tokens=cap,
                            cost_model=cost,
                            too_long="truncate",
                        )
                        for kind in dict.fromkeys(kind for _, kind in settings["configs"])
                    }
                    for plan in plans.values():
                        warm_shapes(warmer, _rank_microbatches(plan, rank, vocab))
                    for backend, kind in settings["configs"]:
                        plan = plans[kind]
                        mbs = _rank_microbatches(plan, rank, vocab)
                        tokens = (
                            global_loss_tokens(plan, world_size, vocab)
                            if backend in FSDP2_BACKENDS
                            else None
                        )
                        record = one_step(built, backend, mbs, cap, tokens)
                        record["plan_bubble_odc"] = plan.bubble_odc()
                        record["plan_bubble_lockstep"] = plan.bubble_lockstep()
                        record["plan_time_odc"] = max(plan.rank_costs())
                        record["plan_time_lockstep"] = plan.lockstep_time()
                        record["lengths"] = lengths
                        record["plan"] = [list(map(list, m)) for m in plan.microbatches]
                        gathered: list[Any] = [None] * world_size
                        dist.all_gather_object(gathered, record)
                        cell[config_name(backend, kind)].append(gathered)
                results.append({"profile": profile, "minibatch": minibatch, "steps": cell})
                if rank == 0:
                    logger.info("cell %s minibatch %d done", profile, minibatch)
        gathered_state: list[Any] = [None] * world_size
        dist.all_gather_object(gathered_state, state_nbytes)
        if rank == 0:
            payload = {"results": results, "state_nbytes": gathered_state, "comm_probe": comm_probe}
            with open(result_path, "wb") as f:
                pickle.dump(payload, f)
        for wrapped, _, _ in built.values():
            if hasattr(wrapped, "close"):  # the ODC engine's shared memory and threads
                wrapped.close()
        parallel_state.destroy_model_parallel()
    finally:
        patches.revert()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run_ranks(settings: dict) -> dict:
    """Spawns :data:`WORLD_SIZE` ranks running :func:`_rank_main`; returns rank 0's payload."""
    tmp = Path(tempfile.mkdtemp(prefix="odc-imbalance-"))
    shm_dir = Path("/dev/shm") / f"odc-imbalance-{os.getpid()}"
    shm_dir.mkdir(parents=True, exist_ok=True)
    env_keys = ("OMP_NUM_THREADS", "MEGATRON_ODC_SHM_DIR", "PYTHONWARNINGS")
    env_before = {k: os.environ.get(k) for k in env_keys}
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MEGATRON_ODC_SHM_DIR"] = str(shm_dir)
    os.environ["PYTHONWARNINGS"] = "ignore"
    settings = {**settings, "store_path": str(tmp / "store")}
    result_path = str(tmp / "result.pkl")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(r, WORLD_SIZE, settings, result_path))
        for r in range(WORLD_SIZE)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise RuntimeError(
                f"benchmark ranks {failed} failed (exit codes "
                f"{[procs[r].exitcode for r in failed]})"
            )
        with open(result_path, "rb") as f:
            return pickle.load(f)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
