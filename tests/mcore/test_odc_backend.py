"""Acceptance of the ODC backend on a real megatron-core GPTModel (CPU, gloo, shm transport).

Covers what ``test_data_parallel.py`` (fp32 parity with megatron-core's DDP / distopt) does not:

- memory: per-rank persistent bytes measured from the real tensors against ``18 x P / N`` for bf16
  compute params, nothing unsharded between minibatches, and a bound on the buckets in flight;
- bf16 and fp16 (``Float16Module``, as Megatron-LM wraps them) train on a fixed batch; fp16 skips a step
  on an inf injected into one rank's owned gradient, on every rank, and halves the loss scale;
- the ODC promise, recorded on the transport and on ``torch.distributed``: inside a minibatch only gets
  and accumulates run, exactly two fences per minibatch, every push lands in the owner the layout names
  (checked against megatron-core DDP's averaged gradients), also with uneven counts including zero;
- bad input (weights that differ across DP ranks, shared memory that cannot be created) fails at
  construction with a ``ValueError`` naming what is wrong, long before any deadline;
- the ``fsdp`` backend (collective transport) equals ``odc``, ``ddp`` and ``distopt`` under TP=2 x DP=2,
  all four through ``megatron_odc.mcore.step.train_step``;
- the wrapper contract: DDP's public methods are overridden, ``unwrap_model`` unwraps the wrapper, and a
  rank with zero microbatches plus ``state_dict()`` match megatron-core DDP.

Two worlds are spawned once per module (a start costs far more than the checks): 2 ranks (DP=2), and
4 ranks (DP=4 at TP=1, then TP=2 x DP=2 for the backends). Each runs many sub-checks in its rank bodies
and returns figures; the tests assert on them.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from megatron_odc.mcore.config import ODCConfig
from tests._dist import run_ranks
from tests._megatron import SMALL_GPT

# Small fp32 model of test_data_parallel.py (promise, backends, state_dict).
CFG_KW = SMALL_GPT
# A slightly larger model for memory and mixed precision: P = 142,208 elements in 4 layers and the root
# unit, about 20 buckets.
MEM_KW = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "ffn_hidden_size": 128,
    "vocab_size": 128,
    "seq_length": 16,
}
MEM_BUCKET_NUMEL = 8192
PROMISE_BUCKET_NUMEL = 3000
PERSISTENT_BYTES_PER_ELEMENT = 2 + 4 + 4 + 8  # bf16 param, fp32 grad accumulator, fp32 main, Adam
TRAIN_STEPS = 20
FP16_INJECT_STEP = 6
FP16_INITIAL_LOSS_SCALE = 1024.0
BAD_INPUT_DEADLINE_S = 20.0  # every refusal must come well before this (harness deadline: 300 s)
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
BACKEND_STEPS = 3
PROMISE_COUNTS = {
    2: [[1, 3], [2, 0], [0, 2]],
    4: [[1, 0, 3, 2], [2, 2, 0, 1]],
}


# ---------------------------------------------------------------------- helpers (rank side)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over the tensor, in float64."""
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-12))


def _forward_step(data_iterator, model):
    from tests._megatron import _forward_step as megatron_forward_step

    return megatron_forward_step(data_iterator, model)


def _batches(cfg, dp_rank: int, step: int, count: int) -> list[dict[str, torch.Tensor]]:
    from tests._megatron import make_batch

    return [make_batch(cfg, 1, seed=1000 * step + 37 * dp_rank + i) for i in range(count)]


def _loss_report(losses) -> tuple[float, float]:
    """(sum of token losses, number of tokens) over this rank's microbatch reports."""
    if not losses:
        return 0.0, 0.0
    totals = torch.stack([r["lm loss"] for r in losses]).sum(dim=0)
    return float(totals[0]), float(totals[1])


def _optimizer_config(cfg, **overrides):
    from megatron.core.optimizer import OptimizerConfig

    kw = {
        "optimizer": "adam",
        "lr": 3e-3,
        "weight_decay": 0.1,
        "clip_grad": 0.05,
        "bf16": cfg.bf16,
        "fp16": cfg.fp16,
        "params_dtype": cfg.params_dtype,
    }
    kw.update(overrides)
    return OptimizerConfig(**kw)


def _half_model(cfg, seed: int) -> torch.nn.Module:
    """A GPTModel in ``cfg.params_dtype`` inside ``Float16Module``, as Megatron-LM wraps bf16/fp16."""
    from megatron.core.transformer.module import Float16Module

    from megatron_odc.mcore.model import build_gpt_model

    model = build_gpt_model(cfg, seed=seed)
    return Float16Module(model.config, model)


class _StepProbe:
    """Optimizer stand-in for ``train_step``: calls ``before()``, the real ``step()``, then ``after()``."""

    def __init__(self, inner, before=None, after=None) -> None:
        self.inner = inner
        self.before = before
        self.after = after

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self):
        if self.before is not None:
            self.before()
        result = self.inner.step()
        if self.after is not None:
            self.after()
        return result


def _owned_pieces(engine):
    """``(bucket, slot, start, end, lo)`` for every piece of a parameter this DP rank owns.

    ``lo`` is the piece's offset in the rank's shard of the bucket (the layout's arithmetic).
    """
    for bucket in engine.layout.buckets:
        shard_start, _ = bucket.shard_range(engine.dp_rank)
        for slot, start, end in bucket.owned_pieces(engine.dp_rank):
            yield bucket, slot, start, end, slot.bucket_offset + start - shard_start


def _param_storage_nbytes(module: torch.nn.Module) -> int:
    """Bytes currently allocated behind the module's parameters, gradients and ``main_grad`` views."""
    seen, total = set(), 0
    for p in module.parameters():
        for t in (p, p.grad, getattr(p, "main_grad", None)):
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen and storage.nbytes():
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _unique_storage_nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


# ---------------------------------------------------------------------- bad input


def _timed_error(fn) -> tuple[str | None, str, float]:
    """Run ``fn``; return (exception type name or None, message, seconds)."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # the test asserts on the type
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


def _check_bad_input(rank: int, world_size: int, tmp_file: str) -> dict:
    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from megatron_odc.transport.shm import SHM_DIR_ENV

    cfg = GPTConfig(**CFG_KW)
    out = {}

    # Weights that differ across DP ranks: one element of one parameter on the last rank.
    model = build_gpt_model(cfg, seed=11)
    if rank == world_size - 1:
        with torch.no_grad():
            dict(model.named_parameters())["decoder.layers.1.mlp.linear_fc2.weight"][3, 5] += 1e-3
    fds_before = len(os.listdir("/proc/self/fd"))
    out["params_differ"] = _timed_error(lambda: build_backend("odc", model, _optimizer_config(cfg)))
    out["params_differ_fds_leaked"] = len(os.listdir("/proc/self/fd")) - fds_before
    dist.barrier()

    # Shared memory that cannot be created: a missing directory, a regular file, a directory where
    # file creation is refused (sysfs; as root os.access says writable, creating a file fails).
    saved = os.environ.get(SHM_DIR_ENV)
    try:
        for case, path in (
            ("shm_dir_missing", "/nonexistent/megatron-odc-shm"),
            ("shm_dir_is_file", tmp_file),
            ("shm_dir_refuses_files", "/sys"),
        ):
            os.environ[SHM_DIR_ENV] = path
            model = build_gpt_model(cfg, seed=11)
            out[case] = (
                *_timed_error(lambda m=model: build_backend("odc", m, _optimizer_config(cfg))),
                path,
            )
            dist.barrier()
    finally:
        if saved is None:
            os.environ.pop(SHM_DIR_ENV, None)
        else:
            os.environ[SHM_DIR_ENV] = saved
    return out


# ---------------------------------------------------------------------- memory and bf16


def _memory_report(odc_model, opt, cfg) -> dict:
    """Per-rank persistent bytes from the real tensors, with the layout's own counts beside them."""
    engine = odc_model.engine
    transport = engine.transport
    param_shard_nbytes = grad_shard_nbytes = 0
    for name in transport.buffer_names:
        t = transport.local(name)
        if ".param." in name:
            assert t.dtype == cfg.params_dtype, (name, t.dtype)
            param_shard_nbytes += t.nbytes
        else:
            assert t.dtype == torch.float32, (name, t.dtype)
            grad_shard_nbytes += t.nbytes
    opt_params = [p for g in opt.optimizer.param_groups for p in g["params"]]
    # The fp32 main shards themselves (one per bucket; a bucket whose shard is all padding on this rank
    # has no optimizer tensor viewing it, but is allocated all the same), and what the optimizer's
    # tensors reach.
    mains = [m for chunk in opt._main_shards for m in chunk]
    main_nbytes = _unique_storage_nbytes(mains)
    main_reachable_nbytes = _unique_storage_nbytes(opt_params)
    main_dtypes = {p.dtype for p in opt_params} | {m.dtype for m in mains}
    state_nbytes = sum(
        v.nbytes
        for state in opt.optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    owned_numel = sum(end - start for _, _, start, end, _ in _owned_pieces(engine))
    shard_numel = sum(b.shard_numel for b in engine.layout.buckets)
    return {
        "num_params_numel": sum(p.numel() for p in odc_model.module.parameters()),
        "param_shard_nbytes": param_shard_nbytes,
        "grad_shard_nbytes": grad_shard_nbytes,
        "main_nbytes": main_nbytes,
        "main_reachable_nbytes": main_reachable_nbytes,
        "main_dtypes": sorted(str(d) for d in main_dtypes),
        "optimizer_state_nbytes": state_nbytes,
        "num_state_tensors": sum(len(s) for s in opt.optimizer.state.values()),
        "num_opt_params": len(opt_params),
        "owned_numel": owned_numel,
        "shard_numel": shard_numel,
        "engine_persistent_nbytes": engine.persistent_nbytes(),
        "optimizer_persistent_nbytes": opt.persistent_nbytes(),
        "unsharded_nbytes": engine.unsharded_nbytes(),
        "model_storage_nbytes": _param_storage_nbytes(odc_model.module),
        "num_buckets": len(engine.layout.buckets),
    }


def _unit_nbytes(engine, grad_itemsize: int) -> dict[str, int]:
    """Unsharded bytes of each unit: padded params in compute dtype plus their gradient buffer."""
    out: dict[str, int] = collections.defaultdict(int)
    for bucket in engine.layout.buckets:
        out[bucket.unit] += bucket.padded_numel * (bucket.dtype.itemsize + grad_itemsize)
    return dict(out)


def _track_peak_unsharded(engine) -> dict:
    """Wrap the engine's allocating calls to record the peak of ``unsharded_nbytes()``."""
    peak = {"nbytes": 0}

    def wrap(fn):
        def inner(*args, **kwargs):
            result = fn(*args, **kwargs)
            peak["nbytes"] = max(peak["nbytes"], engine.unsharded_nbytes())
            return result

        return inner

    engine.fetch = wrap(engine.fetch)
    engine.begin_backward = wrap(engine.begin_backward)
    return peak


def _check_bf16(rank: int, world_size: int, steps: int) -> dict:
    """bf16 in Float16Module: memory after the first step, then training on a fixed batch."""
    from megatron.core.utils import unwrap_model

    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.model import GPTConfig
    from megatron_odc.mcore.step import train_step

    cfg = GPTConfig(**MEM_KW, params_dtype=torch.bfloat16, bf16=True)
    model = _half_model(cfg, seed=21)
    gpt = model.module
    odc_model, opt = build_backend(
        "odc",
        model,
        _optimizer_config(cfg, lr=1e-2, weight_decay=0.0, clip_grad=1.0),
        odc_config=ODCConfig(bucket_size=MEM_BUCKET_NUMEL),
    )
    out = {"unwrap_is_gpt": unwrap_model(odc_model) is gpt, "losses": [], "success": []}
    peak = _track_peak_unsharded(odc_model.engine)
    batches = _batches(cfg, rank, step=0, count=2)  # fixed batch: the same microbatches every step
    for step in range(steps):
        report = train_step(odc_model, opt, _forward_step, batches, seq_length=cfg.seq_length)
        loss_sum, num_tokens = _loss_report(report["losses"])
        out["losses"].append(loss_sum / num_tokens)
        out["success"].append(bool(report["update_successful"]))
        if step == 0:
            out["memory"] = _memory_report(odc_model, opt, cfg)
    out["peak_unsharded_nbytes"] = peak["nbytes"]
    out["unit_nbytes"] = _unit_nbytes(odc_model.engine, grad_itemsize=4)
    out["root_unit"] = "root"
    odc_model.close()
    return out


# ---------------------------------------------------------------------- fp16 and the inf skip


def _check_fp16(rank: int, world_size: int, steps: int, inject_step: int) -> dict:
    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.model import GPTConfig
    from megatron_odc.mcore.step import train_step

    cfg = GPTConfig(**MEM_KW, params_dtype=torch.float16, fp16=True)
    odc_model, opt = build_backend(
        "odc",
        _half_model(cfg, seed=22),
        _optimizer_config(
            cfg,
            lr=1e-2,
            weight_decay=0.0,
            clip_grad=1.0,
            initial_loss_scale=FP16_INITIAL_LOSS_SCALE,
            hysteresis=1,
            loss_scale_window=1000,
        ),
        odc_config=ODCConfig(bucket_size=MEM_BUCKET_NUMEL),
    )
    engine = odc_model.engine
    opt_params = [p for g in opt.optimizer.param_groups for p in g["params"]]
    snap: dict = {}

    def shards():
        return (
            [engine.param_shard(b.index).clone() for b in engine.layout.buckets],
            [p.detach().clone() for p in opt_params],
            [
                {k: v.clone() for k, v in opt.optimizer.state[p].items()}
                for p in opt_params
                if p in opt.optimizer.state
            ],
        )

    def before_step(step: int):
        def hook():
            snap["scale_before"] = float(opt.get_loss_scale())
            snap["before"] = shards()
            if step == inject_step and rank == world_size - 1:
                bucket, _, _, _, lo = next(_owned_pieces(engine))
                engine.grad_shard(bucket.index)[lo] = float("inf")

        return hook

    def same(a, b) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b))

    out = {"steps": []}
    batches = _batches(cfg, rank, step=0, count=2)
    for step in range(steps):
        probe = _StepProbe(opt, before=before_step(step))
        report = train_step(odc_model, probe, _forward_step, batches, seq_length=cfg.seq_length)
        params_after, mains_after, state_after = shards()
        params_before, mains_before, state_before = snap["before"]
        loss_sum, num_tokens = _loss_report(report["losses"])
        out["steps"].append(
            {
                "loss": loss_sum / num_tokens,
                "success": bool(report["update_successful"]),
                "scale_before": snap["scale_before"],
                "scale_after": float(opt.get_loss_scale()),
                "param_shards_unchanged": same(params_before, params_after),
                "main_shards_unchanged": same(mains_before, mains_after),
                "adam_state_unchanged": len(state_before) == len(state_after)
                and all(
                    same(list(a.values()), list(b.values()))
                    for a, b in zip(state_before, state_after)
                ),
            }
        )
    odc_model.close()
    return out


# ---------------------------------------------------------------------- the ODC promise


@contextlib.contextmanager
def _record_collectives(log: list, model_parallel_ranks: set[int]):
    """Record every ``torch.distributed`` collective / p2p call into ``log`` while active.

    Each entry is ``("collective", name, group ranks, 0, stack)``; ``stack`` is set only for calls whose
    group reaches beyond this rank's model-parallel group (i.e. involves other DP ranks): tensor-parallel
    collectives inside the model (vocab-parallel cross entropy, TP linears) are part of the model, not of
    data parallelism.
    """
    saved = []

    def recorder(fn, name):
        signature = inspect.signature(fn)

        def inner(*args, **kwargs):
            try:
                group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            except TypeError:
                group = None
            ranks = set(
                dist.get_process_group_ranks(group)
                if group is not None
                else range(dist.get_world_size())
            )
            stack = None
            if not ranks <= model_parallel_ranks:
                stack = "".join(traceback.format_stack(limit=10))
            log.append(("collective", name, sorted(ranks), 0, stack))
            return fn(*args, **kwargs)

        return inner

    for module in (dist, dist.distributed_c10d):
        for name in COLLECTIVES:
            fn = getattr(module, name, None)
            if fn is not None:
                saved.append((module, name, fn))
                setattr(module, name, recorder(fn, name))
    try:
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


def _check_promise(rank: int, world_size: int, counts_by_step: list[list[int]]) -> dict:
    """ODC (recorded) against megatron-core DDP on uneven counts: events, gradients, state_dict."""
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model

    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from megatron_odc.mcore.step import train_step
    from tests._recording import RecordingTransport

    cfg = GPTConfig(**CFG_KW)
    dp_rank = parallel_state.get_data_parallel_rank()
    mp_ranks = set(dist.get_process_group_ranks(parallel_state.get_model_parallel_group()))
    opt_cfg = _optimizer_config(cfg)
    gpt = build_gpt_model(cfg, seed=11)
    odc_model, odc_opt = build_backend(
        "odc", gpt, opt_cfg, odc_config=ODCConfig(bucket_size=PROMISE_BUCKET_NUMEL)
    )
    ref_model, ref_opt = build_backend("ddp", build_gpt_model(cfg, seed=11), opt_cfg)
    engine = odc_model.engine
    rec = RecordingTransport(engine.transport)
    engine.transport = rec
    log = rec.calls

    def mark(what: str):
        log.append(("mark", what, None, 0, 0))

    def marked(fn, what: str):
        def inner(*args, **kwargs):
            mark(what)
            return fn(*args, **kwargs)

        return inner

    odc_model.zero_grad_buffer = marked(odc_model.zero_grad_buffer, "zero_grad_buffer")
    odc_model.finish_grad_sync = marked(odc_model.finish_grad_sync, "finish_grad_sync")

    def forward_step(data_iterator, model):
        mark("forward")
        return _forward_step(data_iterator, model)

    ref_params = dict(ref_model.module.named_parameters())
    grads: dict = {}

    def snapshot_odc():
        grads["odc"] = {
            (bucket.index, lo): engine.grad_shard(bucket.index)[lo : lo + end - start].clone()
            for bucket, _, start, end, lo in _owned_pieces(engine)
        }

    def snapshot_ref():
        grads["ref"] = {n: p.main_grad.detach().clone() for n, p in ref_params.items()}

    out = {
        "unwrap_is_gpt": unwrap_model(odc_model) is gpt,
        "layout": [(b.index, b.shard_numel) for b in engine.layout.buckets],
        "steps": [],
    }
    for step, counts in enumerate(counts_by_step):
        batches = _batches(cfg, dp_rank, step, counts[dp_rank])
        start = len(log)
        with _record_collectives(log, mp_ranks):
            odc = train_step(
                odc_model,
                _StepProbe(odc_opt, before=snapshot_odc, after=lambda: mark("step_end")),
                forward_step,
                batches,
                seq_length=cfg.seq_length,
            )
        events = log[start:]
        ref = train_step(
            ref_model,
            _StepProbe(ref_opt, before=snapshot_ref),
            _forward_step,
            batches,
            seq_length=cfg.seq_length,
        )
        odc_g, ref_g = [], []
        for bucket, slot, start_, end, lo in _owned_pieces(engine):
            odc_g.append(grads["odc"][(bucket.index, lo)])
            full = grads["ref"][slot.name].reshape(-1)
            ref_g.append(full[slot.param_offset + start_ : slot.param_offset + end])
        out["steps"].append(
            {
                "events": events,
                "num_microbatches": counts[dp_rank],
                "owned_grad_rel_err": _rel_err(torch.cat(odc_g), torch.cat(ref_g)),
                "owned_grad_numel": sum(t.numel() for t in odc_g),
                "odc_loss": _loss_report(odc["losses"]),
                "ref_loss": _loss_report(ref["losses"]),
            }
        )
    # state_dict of the wrapper (gathered from the owners) right after the step against megatron-core
    # DDP's: the step's closing fence made every owner's new shard visible.
    odc_sd = odc_model.state_dict()
    ref_sd = ref_model.state_dict()
    keys = sorted(k for k in ref_sd if not k.endswith("_extra_state"))
    out["state_dict_keys"] = (sorted(k for k in odc_sd if not k.endswith("_extra_state")), keys)
    out["state_dict_worst"] = max(
        (_rel_err(odc_sd[k], ref_sd[k]) if k in odc_sd else float("inf"), k) for k in keys
    )
    odc_model.close()
    return out


# ---------------------------------------------------------------------- the wrapper contract


def _check_contract() -> dict:
    """Public methods of megatron-core's DDP wrapper contract that ODCDataParallel does not define."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    from megatron_odc.mcore.data_parallel import ODCDataParallel

    public = {
        name
        for cls in (DistributedDataParallel, _BaseDataParallel)
        for name, member in vars(cls).items()
        if not name.startswith("_") and inspect.isfunction(member)
    }
    # The base's forward (call the wrapped module; ODC's hooks do the rest) is inherited on purpose,
    # and megatron-core's DDP does not override it either.
    forward_ok = (
        "forward" not in vars(DistributedDataParallel)
        and ODCDataParallel.forward is _BaseDataParallel.forward
    )
    public.discard("forward")
    missing = sorted(name for name in public if name not in vars(ODCDataParallel))
    # Every override accepts the parameter names megatron-core callers may pass by keyword.
    lacking = {}
    for name in sorted(set(public) - set(missing)):
        ours = inspect.signature(getattr(ODCDataParallel, name)).parameters
        theirs = inspect.signature(getattr(DistributedDataParallel, name)).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values()):
            continue
        named = [
            p
            for p, param in theirs.items()
            if param.kind
            in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            and p not in ours
        ]
        if named:
            lacking[name] = named
    return {
        "public": sorted(public),
        "missing": missing,
        "lacking": lacking,
        "forward_ok": forward_ok,
    }


# ---------------------------------------------------------------------- worlds


def _timed_checks(**checks) -> dict:
    """Run the named sub-checks in order; their results, and their run times under ``seconds``."""
    out: dict = {"seconds": {}}
    for name, check in checks.items():
        start = time.monotonic()
        out[name] = check()
        out["seconds"][name] = round(time.monotonic() - start, 2)
    return out


def _run_dp2(rank: int, world_size: int, tmp_file: str) -> dict:
    from tests._megatron import init_megatron, teardown_megatron

    init_megatron(1, seed=3)
    try:
        return _timed_checks(
            contract=_check_contract,
            bad_input=lambda: _check_bad_input(rank, world_size, tmp_file),
            bf16=lambda: _check_bf16(rank, world_size, TRAIN_STEPS),
            fp16=lambda: _check_fp16(rank, world_size, TRAIN_STEPS, FP16_INJECT_STEP),
            promise=lambda: _check_promise(rank, world_size, PROMISE_COUNTS[world_size]),
        )
    finally:
        teardown_megatron()


def _run_dp4(rank: int, world_size: int) -> dict:
    """DP=4 at TP=1, then the four backends at TP=2 x DP=2 (one spawn: a 4-rank start is the cost)."""
    from tests._megatron import init_megatron, teardown_megatron

    init_megatron(1, seed=3)
    try:
        out = _timed_checks(
            bf16=lambda: _check_bf16(rank, world_size, steps=1),
            promise=lambda: _check_promise(rank, world_size, PROMISE_COUNTS[world_size]),
        )
    finally:
        teardown_megatron()
    init_megatron(2, seed=5)
    try:
        start = time.monotonic()
        out["backends"] = _check_backends(BACKEND_STEPS)
        out["seconds"]["backends"] = round(time.monotonic() - start, 2)
        out["unmarked_tp_weights"] = _check_unmarked_tp_weights()
    finally:
        teardown_megatron()
    return out


def _check_unmarked_tp_weights() -> str:
    """TP=2: a model whose tensor-parallel weights lack ``tensor_model_parallel`` (what megatron-core
    before 0.19 builds with ``perform_initialization=False``) is refused, not averaged over TP."""
    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model

    cfg = GPTConfig(**CFG_KW)
    model = build_gpt_model(cfg, seed=11)
    for param in model.parameters():
        for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(param, attribute):
                delattr(param, attribute)
    try:
        build_backend("odc", model, _optimizer_config(cfg), odc_config=ODCConfig())
    except ValueError as error:
        return str(error)
    return "not refused"


def _check_backends(steps: int) -> dict:
    """odc, fsdp, ddp and distopt from the same weights on the same microbatches, via train_step."""
    from megatron.core import parallel_state

    from megatron_odc.mcore.backends import BACKENDS, build_backend
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from megatron_odc.mcore.step import train_step

    cfg = GPTConfig(**CFG_KW)
    dp_rank = parallel_state.get_data_parallel_rank()
    out: dict = {}
    params: dict = {}
    for name in BACKENDS:
        odc_config = (
            ODCConfig(bucket_size=PROMISE_BUCKET_NUMEL) if name in ("odc", "fsdp") else None
        )
        model, opt = build_backend(
            name, build_gpt_model(cfg, seed=11), _optimizer_config(cfg), odc_config=odc_config
        )
        losses, norms = [], []
        for step in range(steps):
            report = train_step(
                model,
                opt,
                _forward_step,
                _batches(cfg, dp_rank, step, 2),
                seq_length=cfg.seq_length,
            )
            losses.append(_loss_report(report["losses"]))
            norms.append(float(report["grad_norm"]))
        out[name] = {"losses": losses, "norms": norms}
        if name in ("odc", "fsdp"):
            out[name]["transport"] = type(model.engine.transport).__name__
            params[name] = model.engine.full_parameters()
            model.close()
        else:
            params[name] = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    for name in BACKENDS:
        ref = params["ddp"]
        assert set(params[name]) == set(ref), name
        out[name]["param_worst"] = max((_rel_err(params[name][n], ref[n]), n) for n in ref)
    return out


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> list[dict]:
    tmp_file = tmp_path_factory.mktemp("odc") / "not-a-directory"
    tmp_file.write_text("x")
    start = time.monotonic()
    results = run_ranks(_run_dp2, 2, str(tmp_file), timeout_s=300, pg_timeout_s=60)
    logging.getLogger(__name__).info(
        "DP=2 world: %.1f s; rank 0 sub-checks %s", time.monotonic() - start, results[0]["seconds"]
    )
    return results


@pytest.fixture(scope="module")
def dp4() -> list[dict]:
    start = time.monotonic()
    results = run_ranks(_run_dp4, 4, timeout_s=300, pg_timeout_s=60)
    logging.getLogger(__name__).info(
        "DP=4 world: %.1f s; rank 0 sub-checks %s", time.monotonic() - start, results[0]["seconds"]
    )
    return results


# ---------------------------------------------------------------------- tests: memory


def _assert_memory(results: list[dict], world_size: int) -> None:
    total_owned = 0
    for rank, res in enumerate(results):
        mem = res["bf16"]["memory"]
        p_numel, s_numel = mem["num_params_numel"], mem["shard_numel"]
        # Each component from the real tensors, against the layout's shard and owned element counts.
        assert mem["param_shard_nbytes"] == 2 * s_numel, (rank, mem)
        assert mem["grad_shard_nbytes"] == 4 * s_numel, (rank, mem)
        assert mem["main_dtypes"] == ["torch.float32"], (rank, mem)
        assert mem["main_nbytes"] == 4 * s_numel, (rank, mem)
        assert 4 * mem["owned_numel"] <= mem["main_reachable_nbytes"] <= mem["main_nbytes"], mem
        # Adam: exp_avg and exp_avg_sq per owned element, plus one scalar step per optimizer tensor.
        assert mem["num_state_tensors"] == 3 * mem["num_opt_params"], (rank, mem)
        assert mem["optimizer_state_nbytes"] == 8 * mem["owned_numel"] + 4 * mem["num_opt_params"]
        persistent = (
            mem["param_shard_nbytes"]
            + mem["grad_shard_nbytes"]
            + mem["main_nbytes"]
            + mem["optimizer_state_nbytes"]
        )
        # The code's own accounting agrees with the tensors (the scalar Adam steps aside).
        assert (
            mem["engine_persistent_nbytes"] == mem["param_shard_nbytes"] + mem["grad_shard_nbytes"]
        )
        assert abs(
            mem["optimizer_persistent_nbytes"] - (persistent - mem["engine_persistent_nbytes"])
        ) <= (4 * mem["num_opt_params"])
        # Between minibatches nothing is unsharded: no parameter, gradient or main_grad storage.
        assert mem["unsharded_nbytes"] == 0, (rank, mem)
        assert mem["model_storage_nbytes"] == 0, (rank, mem)
        expected = PERSISTENT_BYTES_PER_ELEMENT * p_numel / world_size
        logging.getLogger(__name__).info(
            "DP=%d rank %d: %d persistent bytes = %+.2f%% vs 18 x P / N (P = %d), padding %+.2f%%, "
            "peak unsharded %d bytes (%.1f%% of the bf16 model)",
            world_size,
            rank,
            persistent,
            100 * (persistent / expected - 1),
            p_numel,
            100 * (s_numel * world_size / p_numel - 1),
            res["bf16"]["peak_unsharded_nbytes"],
            100 * res["bf16"]["peak_unsharded_nbytes"] / (2 * p_numel),
        )
        assert abs(persistent - expected) <= 0.10 * expected, (
            f"rank {rank}: {persistent} persistent bytes vs 18 x P / N = {expected:.0f} "
            f"({persistent / expected - 1:+.1%}); {mem}"
        )
        assert mem["num_buckets"] >= 8, "the bucket size must be small relative to the model"
        total_owned += mem["owned_numel"]
        # In flight: never more than the root unit and two layer units (params and grads) at once.
        bf16 = res["bf16"]
        unit_nbytes = dict(bf16["unit_nbytes"])
        root = unit_nbytes.pop(bf16["root_unit"])
        bound = root + 2 * max(unit_nbytes.values())
        assert 0 < bf16["peak_unsharded_nbytes"] <= bound, (
            rank,
            bf16["peak_unsharded_nbytes"],
            bound,
        )
    # Every element is owned by exactly one rank.
    assert total_owned == results[0]["bf16"]["memory"]["num_params_numel"]


def test_memory_bf16_dp2(dp2) -> None:
    _assert_memory(dp2, 2)


def test_memory_bf16_dp4(dp4) -> None:
    _assert_memory(dp4, 4)


# ---------------------------------------------------------------------- tests: mixed precision


def test_bf16_trains_on_a_fixed_batch(dp2) -> None:
    for rank, res in enumerate(dp2):
        bf16 = res["bf16"]
        assert res["bf16"]["unwrap_is_gpt"], (
            "unwrap_model must unwrap ODCDataParallel+Float16Module"
        )
        assert all(bf16["success"]), (rank, bf16["success"])
        losses = bf16["losses"]
        assert len(losses) == TRAIN_STEPS
        assert all(torch.isfinite(torch.tensor(losses))), (rank, losses)
        logging.getLogger(__name__).info(
            "rank %d bf16 loss %.4f -> %.4f", rank, losses[0], losses[-1]
        )
        assert losses[-1] < 0.5 * losses[0], f"rank {rank}: bf16 loss {losses[0]} -> {losses[-1]}"


def test_fp16_trains_and_skips_an_injected_inf_on_every_rank(dp2) -> None:
    for rank, res in enumerate(dp2):
        steps = res["fp16"]["steps"]
        losses = [s["loss"] for s in steps]
        logging.getLogger(__name__).info(
            "rank %d fp16 loss %.4f -> %.4f", rank, losses[0], losses[-1]
        )
        assert losses[-1] < 0.5 * losses[0], f"rank {rank}: fp16 loss {losses[0]} -> {losses[-1]}"
        for i, s in enumerate(steps):
            if i == FP16_INJECT_STEP:
                # Injected on the last rank only: every rank skips, keeps its shards and Adam state,
                # and halves the loss scale (hysteresis 1).
                assert not s["success"], f"rank {rank}: the step with an inf was not skipped"
                assert s["param_shards_unchanged"], (rank, s)
                assert s["main_shards_unchanged"], (rank, s)
                assert s["adam_state_unchanged"], (rank, s)
                assert s["scale_after"] == 0.5 * s["scale_before"], (rank, s)
            else:
                # Every other step succeeds and updates (the scale starts small enough for fp16).
                assert s["success"], f"rank {rank} step {i}: unexpected skip {s}"
                assert not s["param_shards_unchanged"], f"rank {rank} step {i}: no update"
                assert s["scale_after"] == s["scale_before"], (rank, i, s)
        assert steps[0]["scale_before"] == FP16_INITIAL_LOSS_SCALE
        assert steps[FP16_INJECT_STEP + 1]["success"]


# ---------------------------------------------------------------------- tests: the ODC promise


def _assert_promise(results: list[dict], world_size: int) -> None:
    counts_by_step = PROMISE_COUNTS[world_size]
    for rank, res in enumerate(results):
        assert res["promise"]["unwrap_is_gpt"], "unwrap_model(ODCDataParallel) is not the GPTModel"
        shard_numel = dict(res["promise"]["layout"])
        for step, st in enumerate(res["promise"]["steps"]):
            where = f"rank {rank} step {step} ({st['num_microbatches']} microbatches)"
            events = st["events"]
            ops = [e[0] for e in events]
            marks = [(i, e[1]) for i, e in enumerate(events) if e[0] == "mark"]
            fences = [i for i, op in enumerate(ops) if op == "fence"]
            (zero_at,) = [i for i, m in marks if m == "zero_grad_buffer"]
            (finish_at,) = [i for i, m in marks if m == "finish_grad_sync"]
            (end_at,) = [i for i, m in marks if m == "step_end"]
            forwards = [i for i, m in marks if m == "forward"]
            assert len(forwards) == counts_by_step[step][rank], where
            # Exactly the planned fences: one in finish_grad_sync (after the last push), one at the
            # end of the optimizer step (new shards visible); zero_grad_buffer after a step runs none.
            assert len(fences) == 2, f"{where}: {len(fences)} fences"
            assert finish_at < fences[0] < fences[1] < end_at, f"{where}: fences misplaced"
            # Inside the minibatch only one-sided gets and accumulates run.
            # The minibatch: from zero_grad_buffer to the entry of finish_grad_sync.
            minibatch = events[zero_at + 1 : finish_at]
            inside = {(e[0], e[1]) for e in minibatch if e[0] != "mark"}
            # Model-parallel collectives of the model itself (TP group) are not data parallelism.
            dp_collectives = [e for e in minibatch if e[0] == "collective" and e[4]]
            assert not dp_collectives, (
                f"{where}: a DP collective in the minibatch:\n{dp_collectives[0][4]}"
            )
            inside = {(op, name) for op, name in inside if op != "collective"}
            assert {op for op, _ in inside} <= {"get", "accumulate"}, f"{where}: {sorted(inside)}"
            # Every accumulate happens between the two fences, into a gradient buffer, covering
            # exactly the owner's shard: one per (bucket, owner) per microbatch.
            acc = [(i, e) for i, e in enumerate(events) if e[0] == "accumulate"]
            assert all(zero_at < i < fences[0] for i, _ in acc), where
            per_target = collections.Counter()
            for _, (_, name, peer, offset, numel) in acc:
                prefix, kind, bucket = name.split(".")
                assert (prefix, kind) == ("odc", "grad"), f"{where}: accumulate into {name}"
                assert 0 <= peer < world_size, (where, name, peer)
                assert offset == 0, (where, name, offset)
                assert numel == shard_numel[int(bucket)], (where, name, numel)
                per_target[(int(bucket), peer)] += 1
            expected = {
                (b, p): st["num_microbatches"] for b in shard_numel for p in range(world_size)
            }
            if st["num_microbatches"] == 0:
                expected = {}
            assert dict(per_target) == expected, f"{where}: pushes per (bucket, owner) differ"
            assert all(e[1].startswith("odc.param.") for e in events if e[0] == "get"), where
            # The accumulated data landed where the layout says: this rank's owned accumulator
            # pieces equal megatron-core DDP's averaged gradients of those parameter elements.
            assert st["owned_grad_numel"] > 0, where
            assert st["owned_grad_rel_err"] <= 1e-5, f"{where}: {st['owned_grad_rel_err']:.2e}"
            (ol, ot), (rl, rt) = st["odc_loss"], st["ref_loss"]
            assert ot == rt, (where, ot, rt)
            assert abs(ol - rl) <= 1e-5 * max(abs(rl), 1e-12), (where, ol, rl)


def test_odc_promise_dp2(dp2) -> None:
    _assert_promise(dp2, 2)


def test_odc_promise_dp4_uneven_with_zero(dp4) -> None:
    _assert_promise(dp4, 4)


def _assert_state_dict(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        odc_keys, ref_keys = res["promise"]["state_dict_keys"]
        assert odc_keys == ref_keys, f"rank {rank}: state_dict keys differ"
        err, key = res["promise"]["state_dict_worst"]
        assert err <= 1e-5, f"rank {rank}: state_dict[{key!r}] differs by {err:.2e} (relative)"


def test_zero_microbatches_and_state_dict_match_megatron_ddp(dp2, dp4) -> None:
    # Both worlds had a rank with zero microbatches (PROMISE_COUNTS) and trained on after it.
    assert any(0 in counts for counts in PROMISE_COUNTS[2])
    _assert_state_dict(dp2)
    _assert_state_dict(dp4)


# ---------------------------------------------------------------------- tests: bad input


def test_bad_input_fails_at_construction_with_clear_errors(dp2) -> None:
    for rank, res in enumerate(dp2):
        bad = res["bad_input"]
        logging.getLogger(__name__).info("rank %d bad input: %s", rank, bad)
        kind, message, elapsed = bad["params_differ"]
        assert kind == "ValueError", (rank, kind, message)
        assert "decoder.layers.1.mlp.linear_fc2.weight" in message, message
        assert elapsed < BAD_INPUT_DEADLINE_S, (rank, elapsed)
        assert bad["params_differ_fds_leaked"] == 0, "the refused wrapper left its transport open"
        for case in ("shm_dir_missing", "shm_dir_is_file", "shm_dir_refuses_files"):
            kind, message, elapsed, path = bad[case]
            assert kind == "ValueError", (rank, case, kind, message)
            assert path in message, (rank, case, message)
            assert elapsed < BAD_INPUT_DEADLINE_S, (rank, case, elapsed)


# ---------------------------------------------------------------------- tests: backends


def test_tp_weights_without_their_attribute_are_refused(dp4) -> None:
    """A TP-split weight without ``tensor_model_parallel`` would be averaged over TP: refused, naming
    the weight, in one line."""
    for rank, world in enumerate(dp4):
        message = world["unmarked_tp_weights"]
        assert "weight (" in message, (rank, message)
        assert "has no tensor_model_parallel attribute" in message, (rank, message)
        assert "perform_initialization=True" in message
        assert "\n" not in message


def test_fsdp_odc_ddp_distopt_agree_tp2_dp2(dp4) -> None:
    for rank, world in enumerate(dp4):
        res = world["backends"]
        ref = res["ddp"]
        assert len(ref["losses"]) == BACKEND_STEPS
        assert res["odc"]["transport"] == "ShmTransport", res["odc"]["transport"]
        assert res["fsdp"]["transport"] == "CollectiveTransport", res["fsdp"]["transport"]
        for name in ("odc", "fsdp", "distopt"):
            for step in range(BACKEND_STEPS):
                (loss, tokens), (ref_loss, ref_tokens) = (
                    res[name]["losses"][step],
                    ref["losses"][step],
                )
                assert tokens == ref_tokens > 0, (rank, name, step)
                assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (
                    rank,
                    name,
                    step,
                    loss,
                    ref_loss,
                )
                norm, ref_norm = res[name]["norms"][step], ref["norms"][step]
                assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (rank, name, step, norm, ref_norm)
            err, param = res[name]["param_worst"]
            assert err <= 1e-5, f"rank {rank}: {name} parameter {param} differs by {err:.2e}"


# ---------------------------------------------------------------------- tests: contract


def test_odc_overrides_every_public_method_of_megatron_ddp(dp2) -> None:
    contract = dp2[0]["contract"]
    assert contract["forward_ok"], "megatron-core DDP or ODCDataParallel changed forward"
    assert {"finish_grad_sync", "zero_grad_buffer", "state_dict", "no_sync"} <= set(
        contract["public"]
    ), contract["public"]
    assert not contract["missing"], (
        f"ODCDataParallel inherits megatron-core DDP's {contract['missing']}"
    )
    assert not contract["lacking"], f"overrides lack keyword parameters: {contract['lacking']}"
