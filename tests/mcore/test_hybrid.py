"""Hybrid sharding (shard groups x replica groups) on pretend hosts: 4 CPU ranks, 2 pretend hosts of 2.

``MEGATRON_ODC_LOCAL_WORLD_SIZE=2`` (``transport/hosts.py``, test-only) puts ranks 0-1 and 2-3 on
different pretend hosts, so the default shard group is the two ranks of a host and the replica group the
two ranks holding the same shard on the two hosts. One spawned world runs every case (a 4-rank start
costs more than the cases):

- parity: hybrid ODC against megatron-core DDP from the same weights on the same samples, with uneven
  microbatch counts (a rank with 0), fp32, Adam with weight decay and clipping: per-step loss, grad norm
  and the parameters after the last step to 1e-5 relative;
- the promise, recorded on the transport and on ``torch.distributed``: inside a minibatch only one-sided
  gets and accumulates, all inside the shard group, which lies on one pretend host; no collective
  crosses the pretend host boundary in the minibatch; after the push fence exactly one round of
  gradient all-reduces over the replica group (one per bucket, back to back);
- memory from the tensors: bf16 persistent ODC state 18 P / G within 2%;
- TP=2 inside a host x shard 1 x replica 2 against megatron-core DDP;
- the checkpoint chain hybrid G=2 -> full shard N=4 (one host: the override lifted) -> megatron-core
  DDP: full resumes continue the uninterrupted run, ``finetune`` loads are bit-exact;
- the refusals: a shard group size that does not divide the DP size, ``shm`` over a shard group that
  spans hosts, each a ValueError naming the flag before any transport is built.

Under ``mpiexec`` (skipped without mpi4py / mpiexec), a job of its own: the shard groups over the ``mpi``
transport (one MPI sub-communicator per pretend host) against megatron-core DDP, the same counts.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_odc.core.groups import SHARD_GROUP_SIZE_FLAG
from megatron_odc.mcore.config import ODCConfig
from megatron_odc.transport.hosts import LOCAL_WORLD_SIZE_ENV
from tests._dist import run_ranks
from tests._megatron import SMALL_GPT
from tests._mpi import requires_mpi, run_mpi
from tests._recording import record_collectives

RANKS_PER_HOST = 2
WORLD = 4
BUCKET_NUMEL = 3000
COUNTS = [[1, 0, 3, 2], [2, 2, 0, 1], [3, 1, 1, 0]]  # microbatches per DP rank, per step
TP2_COUNTS = [[2, 1], [0, 2], [1, 1]]
HP = {"lr": 3e-3, "weight_decay": 0.1, "clip_grad": 0.05}  # clipping active at these norms
MEM_KW = {**SMALL_GPT, "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128}
MEM_BUCKET_NUMEL = 4096
PERSISTENT_BYTES_PER_ELEMENT = 2 + 4 + 4 + 8  # bf16 param, fp32 grad accumulator, fp32 main, Adam
REL_TOL = 1e-5
REFUSAL_DEADLINE_S = 20.0  # a refusal comes at construction, long before any timeout


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-12))


def _forward_step(data_iterator, model):
    from tests._megatron import _forward_step as megatron_forward_step

    return megatron_forward_step(data_iterator, model)


def _batches(cfg, dp_rank: int, step: int, count: int):
    from tests._megatron import make_batch

    return [make_batch(cfg, 1, seed=1000 * step + 37 * dp_rank + i) for i in range(count)]


def _build(backend: str, cfg, seed: int, **odc_options):
    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.model import build_gpt_model
    from tests._megatron import adam_config

    odc_config = None
    if backend == "odc":
        odc_config = ODCConfig(
            bucket_size=odc_options.pop("bucket_size", BUCKET_NUMEL), **odc_options
        )
    model = build_gpt_model(cfg, seed=seed)
    return build_backend(backend, model, adam_config(model.config, **HP), odc_config=odc_config)


def _step(model, opt, cfg, step: int, counts: list[int]) -> tuple[float, float]:
    """One step on this DP rank's ``counts[dp_rank]`` microbatches: (global mean loss, grad norm)."""
    from megatron.core import parallel_state

    from megatron_odc.mcore.step import train_step

    dp_rank = parallel_state.get_data_parallel_rank()
    out = train_step(
        model,
        opt,
        _forward_step,
        _batches(cfg, dp_rank, step, counts[dp_rank]),
        seq_length=cfg.seq_length,
    )
    totals = torch.zeros(2, dtype=torch.float64)
    for report in out["losses"]:
        totals += report["lm loss"].double()
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    return float(totals[0] / totals[1]), float(out["grad_norm"])


def _params(model) -> dict[str, torch.Tensor]:
    """This TP rank's full parameters (ODC: gathered from the owners)."""
    from megatron_odc.mcore.data_parallel import ODCDataParallel

    if isinstance(model, ODCDataParallel):
        return model.engine.full_parameters()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((_rel_err(a[n], b[n]), n) for n in b)


def _bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (empty: bit-exact)."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return [n for n in sorted(b) if not torch.equal(a[n], b[n])]


@contextlib.contextmanager
def _pretend_hosts(ranks_per_host: int | None):
    """Set (or, with None, lift) the pretend-host override for the block."""
    saved = os.environ.get(LOCAL_WORLD_SIZE_ENV)
    if ranks_per_host is None:
        os.environ.pop(LOCAL_WORLD_SIZE_ENV, None)
    else:
        os.environ[LOCAL_WORLD_SIZE_ENV] = str(ranks_per_host)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(LOCAL_WORLD_SIZE_ENV, None)
        else:
            os.environ[LOCAL_WORLD_SIZE_ENV] = saved


# ---------------------------------------------------------------------- rank-side cases


def _check_refusals(cfg) -> dict:
    out = {}
    for case, options in (
        ("not_a_divisor", {"shard_group_size": 3}),
        ("shm_spans_hosts", {"shard_group_size": 4, "transport": "shm"}),
    ):
        start = time.monotonic()
        try:
            _build("odc", cfg, seed=11, **options)
            out[case] = (None, "", 0.0)
        except ValueError as exc:
            out[case] = ("ValueError", str(exc), time.monotonic() - start)
        dist.barrier()
    return out


def _check_parity(cfg) -> dict:
    """Hybrid (default shard group: one pretend host) against megatron-core DDP, recorded."""
    from tests._recording import RecordingTransport

    odc_model, odc_opt = _build("odc", cfg, seed=11)
    ddp_model, ddp_opt = _build("ddp", cfg, seed=11)
    topology = odc_model.topology
    engine = odc_model.engine
    rec = RecordingTransport(engine.transport)
    engine.transport = rec
    log = rec.calls

    def marked(fn, what: str):
        def inner(*args, **kwargs):
            log.append(("mark", what))
            return fn(*args, **kwargs)

        return inner

    odc_model.zero_grad_buffer = marked(odc_model.zero_grad_buffer, "zero_grad_buffer")
    odc_model.finish_grad_sync = marked(odc_model.finish_grad_sync, "finish_grad_sync")
    odc_opt.step = marked(odc_opt.step, "optimizer_step")
    out = {
        "shard_ranks": dist.get_process_group_ranks(topology.shard_group),
        "replica_ranks": dist.get_process_group_ranks(topology.replica_group),
        "transport_world": engine.transport.world_size,
        "num_buckets": len(engine.layout.buckets),
        "steps": [],
    }
    for step, counts in enumerate(COUNTS):
        start = len(log)
        with record_collectives(log):
            odc = _step(odc_model, odc_opt, cfg, step, counts)
        events = log[start:]
        ddp = _step(ddp_model, ddp_opt, cfg, step, counts)
        out["steps"].append({"odc": odc, "ddp": ddp, "events": events})
    out["params"] = _worst(_params(odc_model), _params(ddp_model))
    odc_model.close()
    return out


def _check_memory() -> dict:
    """bf16 (Float16Module) hybrid G=2 after one step: persistent bytes from the tensors."""
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module

    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from megatron_odc.mcore.step import train_step
    from tests._megatron import adam_config

    cfg = GPTConfig(**MEM_KW, bf16=True)
    model = build_gpt_model(cfg, seed=5)
    num_params = sum(p.numel() for p in model.parameters())
    odc_model, opt = build_backend(
        "odc",
        Float16Module(model.config, model),
        adam_config(model.config, **HP),
        odc_config=ODCConfig(bucket_size=MEM_BUCKET_NUMEL),
    )
    train_step(
        odc_model,
        opt,
        _forward_step,
        _batches(cfg, parallel_state.get_data_parallel_rank(), 0, 1),
        seq_length=cfg.seq_length,
    )
    transport = odc_model.engine.transport
    shards = sum(transport.local(n).nbytes for n in transport.buffer_names)
    mains = sum(m.nbytes for chunk in opt._main_shards for m in chunk)
    adam = sum(
        v.nbytes
        for state in opt.optimizer.state.values()
        for k, v in state.items()
        if k != "step" and isinstance(v, torch.Tensor)
    )
    out = {
        "num_params": num_params,
        "shard_size": odc_model.topology.shard_size,
        "persistent": shards + mains + adam,
        "unsharded": odc_model.engine.unsharded_nbytes(),
    }
    odc_model.close()
    return out


def _check_tp2(cfg) -> dict:
    """TP=2 inside each pretend host: every DP group has one rank per host (shard 1 x replica 2)."""
    out: dict = {}
    params = {}
    for backend in ("odc", "ddp"):
        model, opt = _build(backend, cfg, seed=13)
        if backend == "odc":
            out["shard_size"] = model.topology.shard_size
            out["replica_size"] = model.topology.replica_size
        out[backend] = [_step(model, opt, cfg, s, counts) for s, counts in enumerate(TP2_COUNTS)]
        params[backend] = _params(model)
        if backend == "odc":
            model.close()
    out["params"] = _worst(params["odc"], params["ddp"])
    return out


def _elements_not_written_once(model, opt) -> list[tuple[str, int, int]]:
    """Checkpoint keys whose main-replica boxes, over every rank, do not hold each element once.

    ``dist_checkpointing`` writes the boxes whose replica id is all zeros; the replicas of a shard must
    carry other ids, or the shard is written once per replica. Returns ``(key, elements written,
    elements in the tensor)`` for every key that is off (collective).
    """
    import math

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    from megatron_odc.mcore.dist_ckpt.state import build_save_state

    written: dict[str, list[int]] = {}
    for value in nested_values(build_save_state(model, opt)):
        if isinstance(value, ShardedTensor):
            entry = written.setdefault(value.key, [0, math.prod(value.global_shape)])
            if is_main_replica(value.replica_id):
                entry[0] += value.data.numel()
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, written)
    totals: dict[str, list[int]] = {}
    for per_rank in gathered:
        for key, (count, numel) in per_rank.items():
            totals.setdefault(key, [0, numel])[0] += count
    return sorted((key, count, numel) for key, (count, numel) in totals.items() if count != numel)


def _check_checkpoints(cfg, root: Path) -> dict:
    """hybrid G=2 -> full shard N=4 -> megatron-core DDP, each against the uninterrupted run."""
    from megatron_odc.runner.checkpoint import load_checkpoint, save_checkpoint
    from tests.runner.test_checkpoint import _allow_writer_processes

    _allow_writer_processes()
    out: dict = {}
    counts = COUNTS[0]
    # Hybrid: two steps, save; the uninterrupted run goes on for two more steps (the oracle).
    model, opt = _build("odc", cfg, seed=21)
    for step in range(2):
        _step(model, opt, cfg, step, counts)
    out["written_once"] = _elements_not_written_once(model, opt)
    save_checkpoint(root / "hybrid", 2, model, opt, extra_state={})
    saved_hybrid = _params(model)
    oracle = [_step(model, opt, cfg, step, counts) for step in (2, 3)]
    oracle_params = _params(model)
    model.close()

    # Full shard over the 4 ranks of one host (the pretend-host override lifted).
    with _pretend_hosts(None):
        model, opt = _build("odc", cfg, seed=22)
        out["full_shard_size"] = model.topology.shard_size
        load_checkpoint(root / "hybrid", model, opt, finetune=True)
        out["finetune_hybrid_to_full"] = _bit_exact(_params(model), saved_hybrid)
        load_checkpoint(root / "hybrid", model, opt)
        out["resume_hybrid_to_full"] = _bit_exact(_params(model), saved_hybrid)
        out["full_step"] = (_step(model, opt, cfg, 2, counts), oracle[0])
        save_checkpoint(root / "full", 3, model, opt, extra_state={})
        saved_full = _params(model)
        model.close()

    # megatron-core DDP: weights only (bit-exact), then a full resume continues the run.
    model, opt = _build("ddp", cfg, seed=23)
    load_checkpoint(root / "full", model, opt, finetune=True)
    out["finetune_full_to_ddp"] = _bit_exact(_params(model), saved_full)
    load_checkpoint(root / "full", model, opt)
    out["ddp_step"] = (_step(model, opt, cfg, 3, counts), oracle[1])
    out["ddp_params"] = _worst(_params(model), oracle_params)

    # And back: DDP's checkpoint resumes into hybrid ODC.
    save_checkpoint(root / "ddp", 4, model, opt, extra_state={})
    saved_ddp = _params(model)
    model, opt = _build("odc", cfg, seed=24)
    load_checkpoint(root / "ddp", model, opt, finetune=True)
    out["finetune_ddp_to_hybrid"] = _bit_exact(_params(model), saved_ddp)
    model.close()
    return out


def _run(rank: int, world_size: int, root: str) -> dict:
    from megatron_odc.mcore.model import GPTConfig
    from tests._megatron import init_megatron, teardown_megatron

    cfg = GPTConfig(**SMALL_GPT)
    seconds = {}
    out: dict = {"seconds": seconds}

    def timed(name, fn):
        start = time.monotonic()
        out[name] = fn()
        seconds[name] = round(time.monotonic() - start, 2)

    init_megatron(1, seed=3)
    try:
        timed("refusals", lambda: _check_refusals(cfg))
        timed("parity", lambda: _check_parity(cfg))
        timed("memory", _check_memory)
        # SwiGLU: fc1 is a ShardedTensorFactory, saved from gathered tensors beside the boxes.
        swiglu = GPTConfig(**SMALL_GPT, swiglu=True)
        timed("checkpoints", lambda: _check_checkpoints(swiglu, Path(root)))
    finally:
        teardown_megatron()
    init_megatron(2, seed=5)
    try:
        timed("tp2", lambda: _check_tp2(cfg))
    finally:
        teardown_megatron()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("hybrid")
    return run_ranks(
        _run,
        WORLD,
        str(root),
        timeout_s=300,
        env={LOCAL_WORLD_SIZE_ENV: str(RANKS_PER_HOST)},
    )


# ---------------------------------------------------------------------- tests


def _host(rank: int) -> int:
    return rank // RANKS_PER_HOST


def _assert_same_step(where: str, got: tuple[float, float], want: tuple[float, float]) -> None:
    """(loss, grad norm) of one step equal the reference's to ``REL_TOL`` relative."""
    (loss, norm), (ref_loss, ref_norm) = got, want
    assert abs(loss - ref_loss) <= REL_TOL * abs(ref_loss), (where, loss, ref_loss)
    assert abs(norm - ref_norm) <= REL_TOL * ref_norm, (where, norm, ref_norm)


def _assert_same_params(where: str, worst: tuple[float, str]) -> None:
    err, name = worst
    assert err <= REL_TOL, f"{where}: parameter {name} differs by {err:.2e}"


def test_hybrid_matches_megatron_ddp_with_uneven_counts(world) -> None:
    for rank, res in enumerate(world):
        parity = res["parity"]
        assert parity["transport_world"] == RANKS_PER_HOST, parity["transport_world"]
        for step, st in enumerate(parity["steps"]):
            _assert_same_step(f"rank {rank} step {step}", st["odc"], st["ddp"])
        _assert_same_params(f"rank {rank}", parity["params"])


def test_hybrid_promise_per_scope(world) -> None:
    for rank, res in enumerate(world):
        parity = res["parity"]
        shard, replica = parity["shard_ranks"], parity["replica_ranks"]
        # The shard group is this rank's pretend host; the replica group crosses hosts.
        assert {_host(r) for r in shard} == {_host(rank)}, (rank, shard)
        assert len({_host(r) for r in replica}) == len(replica) == WORLD // RANKS_PER_HOST
        for step, st in enumerate(parity["steps"]):
            where = f"rank {rank} step {step}"
            events = st["events"]
            marks = {e[1]: i for i, e in enumerate(events) if e[0] == "mark"}
            zero_at, finish_at = marks["zero_grad_buffer"], marks["finish_grad_sync"]
            step_at = marks["optimizer_step"]
            # Inside the minibatch: one-sided gets and accumulates inside the shard group (transport
            # peers are shard ranks), and no collective beyond this pretend host.
            minibatch = events[zero_at + 1 : finish_at]
            ops = {e[0] for e in minibatch}
            assert ops <= {"get", "accumulate", "collective"}, (where, ops)
            assert all(0 <= e[2] < len(shard) for e in minibatch if e[0] in ("get", "accumulate"))
            crossing = [
                e for e in minibatch if e[0] == "collective" and len({_host(r) for r in e[2]}) > 1
            ]
            assert not crossing, (where, crossing)
            # After the push fence: exactly one round of gradient all-reduces over the replica
            # group, one per bucket, back to back; no other collective over the replica group.
            sync = events[finish_at:step_at]
            fence_at = next(i for i, e in enumerate(sync) if e[0] == "fence")
            on_replicas = [
                i for i, e in enumerate(sync) if e[0] == "collective" and list(e[2]) == replica
            ]
            assert len(on_replicas) == parity["num_buckets"], (where, on_replicas)
            assert on_replicas == list(range(on_replicas[0], on_replicas[0] + len(on_replicas)))
            assert on_replicas[0] > fence_at, where
            assert all(sync[i][1] == "all_reduce" for i in on_replicas), where
            everywhere = [e for e in events if e[0] == "collective" and list(e[2]) == replica]
            assert len(everywhere) == parity["num_buckets"], (where, len(everywhere))


def test_hybrid_memory_is_18p_over_g(world) -> None:
    for rank, res in enumerate(world):
        mem = res["memory"]
        assert mem["shard_size"] == RANKS_PER_HOST
        expected = PERSISTENT_BYTES_PER_ELEMENT * mem["num_params"] / mem["shard_size"]
        assert abs(mem["persistent"] - expected) <= 0.02 * expected, (rank, mem, expected)
        assert mem["unsharded"] == 0, (rank, mem)


def test_tp2_shard1_replica2_matches_megatron_ddp(world) -> None:
    for rank, res in enumerate(world):
        tp2 = res["tp2"]
        assert (tp2["shard_size"], tp2["replica_size"]) == (1, 2), tp2
        for step, (got, want) in enumerate(zip(tp2["odc"], tp2["ddp"], strict=True)):
            _assert_same_step(f"rank {rank} step {step}", got, want)
        _assert_same_params(f"rank {rank}", tp2["params"])


def test_checkpoint_chain_hybrid_full_shard_ddp(world) -> None:
    for rank, res in enumerate(world):
        ck = res["checkpoints"]
        assert ck["full_shard_size"] == WORLD
        # Every element of every saved tensor is written by exactly one rank (replica ids).
        assert ck["written_once"] == [], f"rank {rank}: {ck['written_once'][:3]}"
        for case in (
            "finetune_hybrid_to_full",
            "resume_hybrid_to_full",
            "finetune_full_to_ddp",
            "finetune_ddp_to_hybrid",
        ):
            assert ck[case] == [], f"rank {rank}: {case}: {ck[case][:3]} not bit-exact"
        for case in ("full_step", "ddp_step"):
            _assert_same_step(f"rank {rank} {case}", *ck[case])
        _assert_same_params(f"rank {rank} after the chain", ck["ddp_params"])


def test_refusals_name_the_flag(world) -> None:
    for rank, res in enumerate(world):
        for case in ("not_a_divisor", "shm_spans_hosts"):
            kind, message, elapsed = res["refusals"][case]
            assert kind == "ValueError", (rank, case, message)
            assert elapsed < REFUSAL_DEADLINE_S, (rank, case, elapsed)
        _, message, _ = res["refusals"]["not_a_divisor"]
        assert f"{SHARD_GROUP_SIZE_FLAG} 3 does not divide" in message, message
        _, message, _ = res["refusals"]["shm_spans_hosts"]
        assert "--odc-transport shm" in message, message
        assert "spans 2 hosts" in message, message


def _run_over_mpi(rank: int, world_size: int) -> dict:
    """Hybrid ODC whose shard groups use the mpi transport, against megatron-core DDP (3 steps)."""
    from megatron_odc.mcore.model import GPTConfig
    from tests._megatron import init_megatron, teardown_megatron

    cfg = GPTConfig(**SMALL_GPT)
    init_megatron(1, seed=3)
    try:
        odc_model, odc_opt = _build("odc", cfg, seed=11, transport="mpi")
        ddp_model, ddp_opt = _build("ddp", cfg, seed=11)
        out = {
            "transport": type(odc_model.engine.transport).__name__,
            "transport_world": odc_model.engine.transport.world_size,
            "shard_ranks": dist.get_process_group_ranks(odc_model.topology.shard_group),
            "steps": [],
        }
        for step, counts in enumerate(COUNTS):
            odc = _step(odc_model, odc_opt, cfg, step, counts)
            ddp = _step(ddp_model, ddp_opt, cfg, step, counts)
            out["steps"].append({"odc": odc, "ddp": ddp})
        out["params"] = _worst(_params(odc_model), _params(ddp_model))
        odc_model.close()
        return out
    finally:
        teardown_megatron()


@requires_mpi
def test_hybrid_over_mpi_matches_megatron_ddp() -> None:
    # The mpi transport inside each pretend host's shard group (an MPI sub-communicator), the replica
    # all-reduce over torch.distributed across the hosts; uneven counts with a rank at 0, fp32.
    results = run_mpi(
        _run_over_mpi, WORLD, timeout_s=300, env={LOCAL_WORLD_SIZE_ENV: str(RANKS_PER_HOST)}
    )
    for rank, res in enumerate(results):
        assert res["transport"] == "MpiTransport", res["transport"]
        assert res["transport_world"] == RANKS_PER_HOST, res["transport_world"]
        assert {_host(r) for r in res["shard_ranks"]} == {_host(rank)}, res["shard_ranks"]
        for step, st in enumerate(res["steps"]):
            _assert_same_step(f"rank {rank} step {step}", st["odc"], st["ddp"])
        _assert_same_params(f"rank {rank}", res["params"])
