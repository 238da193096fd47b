"""Pipeline parallelism under ODC against megatron-core DDP with the same pipeline layout: 4 CPU ranks.

One spawned world runs every case (a 4-rank start costs more than the cases):

- PP=2 x DP=2: ODC against megatron-core DDP from the same weights on the same samples, megatron-core's
  1F1B schedule, uneven microbatch counts per DP replica (3 and 1, 2 and 0, ...), fp32, per-token loss,
  5 steps of Adam with weight decay and clipping; a tied word embedding (first stage) and output weight
  (last stage): per-step loss and grad norm, and every parameter after the last step, to 1e-5
  relative; the two copies of the tied embedding stay bitwise equal;
- the promise, recorded on each stage's transport and on ``torch.distributed``: inside a minibatch only
  one-sided gets and accumulates, all inside the stage's DP group, and no collective over a DP group;
  two fences per minibatch per stage; after the push fence one all-reduce of the tied embedding's owned
  slices over the embedding group (first and last stage);
- PP=2 x TP=2 (DP=1, so ODC's shard group is one rank) against megatron-core DDP, 5 steps;
- bad input before anything hangs: stages of one pipeline given different counts (the message names the
  DP replica and every stage's count), the interleaved schedule (virtual pipeline stages), a number of
  layers that does not split into the stages.

In a second world (slow): checkpoints across layouts. PP=2 x DP=2 saves after 2 steps; PP=1 x DP=4
loads it (weights bit-exact under the global layer names) and its next step on the same samples equals
the uninterrupted PP=2 run's (loss, grad norm, parameters to 1e-5: the optimizer state moved too);
megatron-core DDP at PP=2 loads the ODC checkpoint bit-exact; PP=2 loads PP=1's checkpoint bit-exact
(the last stage's copy of the tied embedding from the embedding's key).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_ranks
from tests._megatron import SMALL_GPT
from tests._recording import record_collectives

WORLD = 4
BUCKET_NUMEL = 3000
CFG_KW = {**SMALL_GPT, "num_layers": 4, "position_embedding_type": "learned_absolute"}
COUNTS = [[3, 1], [2, 0], [0, 2], [1, 3], [2, 2]]  # microbatches per DP replica, per step
TP2_COUNTS = [[2], [1], [3], [2], [1]]
HP = {"lr": 3e-3, "weight_decay": 0.1, "clip_grad": 0.05}  # clipping active at these norms
REL_TOL = 1e-5
REFUSAL_DEADLINE_S = 20.0  # a refusal comes before the schedule, long before any timeout


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-12))


def _forward_step(data_iterator, model):
    from tests._megatron import _forward_step as megatron_forward_step

    return megatron_forward_step(data_iterator, model)


def _batches(cfg, dp_rank: int, step: int, count: int):
    from tests._megatron import make_batch

    return [make_batch(cfg, 1, seed=1000 * step + 37 * dp_rank + i) for i in range(count)]


def _build(backend: str, cfg, seed: int):
    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.config import ODCConfig
    from megatron_odc.mcore.model import build_gpt_model
    from tests._megatron import adam_config

    odc_config = ODCConfig(bucket_size=BUCKET_NUMEL) if backend == "odc" else None
    model = build_gpt_model(cfg, seed=seed)
    return build_backend(backend, model, adam_config(model.config, **HP), odc_config=odc_config)


def _step(model, opt, cfg, step: int, counts: list[int]) -> tuple[float | None, float]:
    """One step on this DP replica's ``counts[dp_rank]`` microbatches (every stage the same).

    Returns:
        (global per-token mean loss on the last stage, else None; grad norm).
    """
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
    if not parallel_state.is_pipeline_last_stage():
        assert out["losses"] == [], out["losses"]  # only the last stage computes the loss
        return None, float(out["grad_norm"])
    totals = torch.zeros(2, dtype=torch.float64)
    for report in out["losses"]:
        totals += report["lm loss"].double()
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    return float(totals[0] / totals[1]), float(out["grad_norm"])


def _params(model) -> dict[str, torch.Tensor]:
    """This stage's (and TP rank's) full parameters (ODC: gathered from the owners)."""
    from megatron_odc.mcore.data_parallel import ODCDataParallel

    if isinstance(model, ODCDataParallel):
        return model.engine.full_parameters()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((_rel_err(a[n], b[n]), n) for n in b)


def _tied_copies_equal(model) -> bool | None:
    """Whether the first stage's word embedding equals the last stage's output weight bitwise
    (collective over the embedding group); ``None`` on a stage without a copy."""
    from megatron.core import parallel_state

    if model.tied_embedding is None:
        return None
    value = model.engine.full_parameters()[model.tied_embedding.name]
    copies = [torch.empty_like(value) for _ in range(2)]
    dist.all_gather(copies, value, group=parallel_state.get_embedding_group())
    return torch.equal(copies[0], copies[1])


# ---------------------------------------------------------------------- rank-side cases


def _check_parity(cfg) -> dict:
    """PP=2 x DP=2, uneven counts per replica, ODC recorded; then megatron-core DDP."""
    from megatron.core import parallel_state

    from tests._recording import RecordingTransport

    odc_model, odc_opt = _build("odc", cfg, seed=11)
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
    tied = odc_model.tied_embedding
    out = {
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_ranks": dist.get_process_group_ranks(parallel_state.get_data_parallel_group()),
        "embedding_ranks": (dist.get_process_group_ranks(tied.group) if tied is not None else None),
        "tied_name": tied.name if tied is not None else None,
        "tied_owned": sum(p.numel for p in engine.owned_pieces() if tied and p.name == tied.name),
        "units": list(engine.layout.units),
        "odc": [],
        "events": [],
    }
    for step, counts in enumerate(COUNTS):
        start = len(log)
        with record_collectives(log):
            out["odc"].append(_step(odc_model, odc_opt, cfg, step, counts))
        out["events"].append(log[start:])
    out["tied_equal"] = _tied_copies_equal(odc_model)
    odc_params = _params(odc_model)
    odc_model.close()

    ddp_model, ddp_opt = _build("ddp", cfg, seed=11)
    out["ddp"] = [_step(ddp_model, ddp_opt, cfg, s, counts) for s, counts in enumerate(COUNTS)]
    out["params"] = _worst(odc_params, _params(ddp_model))
    return out


def _check_tp2(cfg) -> dict:
    """PP=2 x TP=2, DP=1: ODC's shard group is this rank alone."""
    out: dict = {}
    params = {}
    for backend in ("odc", "ddp"):
        model, opt = _build(backend, cfg, seed=13)
        if backend == "odc":
            out["transport_world"] = model.engine.transport.world_size
        out[backend] = [_step(model, opt, cfg, s, counts) for s, counts in enumerate(TP2_COUNTS)]
        params[backend] = _params(model)
        if backend == "odc":
            model.close()
    out["params"] = _worst(params["odc"], params["ddp"])
    return out


def _refused(fn) -> tuple[str | None, str, float]:
    start = time.monotonic()
    try:
        fn()
    except ValueError as exc:
        return "ValueError", str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


def _check_count_refusal(cfg) -> dict:
    """Replica 0: stage 0 gets 2, stage 1 gets 1; replica 1: stage 0 gets 0, stage 1 gets 1."""
    from megatron.core import parallel_state

    model, opt = _build("odc", cfg, seed=17)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    counts = [[2, 0], [1, 1]][stage]
    refusal = _refused(lambda: _step(model, opt, cfg, 0, counts))
    # Nothing began: the same model then trains a consistent step.
    after = _step(model, opt, cfg, 0, [1, 1])
    model.close()
    return {"refusal": refusal, "after": after}


def _check_layer_refusal() -> tuple[str | None, str, float]:
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model

    return _refused(lambda: build_gpt_model(GPTConfig(**{**CFG_KW, "num_layers": 3}), seed=1))


def _check_virtual_refusal() -> tuple[str | None, str, float]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_odc.mcore.data_parallel import ODCDataParallel
    from megatron_odc.mcore.model import GPTConfig, transformer_config

    config = transformer_config(GPTConfig(**CFG_KW))
    parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
    try:
        return _refused(
            lambda: ODCDataParallel(config, DistributedDataParallelConfig(), torch.nn.Linear(2, 2))
        )
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def _run(rank: int, world_size: int) -> dict:
    from megatron_odc.mcore.model import GPTConfig
    from tests._megatron import init_megatron, teardown_megatron

    cfg = GPTConfig(**CFG_KW)
    seconds = {}
    out: dict = {"seconds": seconds}

    def timed(name, fn):
        start = time.monotonic()
        out[name] = fn()
        seconds[name] = round(time.monotonic() - start, 2)

    init_megatron(1, seed=3, pp=2)
    try:
        timed("parity", lambda: _check_parity(cfg))
        timed("counts", lambda: _check_count_refusal(cfg))
        timed("layers", _check_layer_refusal)
        timed("virtual", _check_virtual_refusal)
    finally:
        teardown_megatron()
    init_megatron(2, seed=5, pp=2)
    try:
        timed("tp2", lambda: _check_tp2(cfg))
    finally:
        teardown_megatron()
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_ranks(_run, WORLD, timeout_s=300)


def _global_params(model, cfg) -> dict[str, torch.Tensor]:
    """Every stage's parameters under the PP=1 names (its layers renumbered globally), on every rank.

    The last stage's copy of a tied embedding is left out (PP=1 has one weight). Collective.
    """
    from megatron.core import parallel_state

    stage = parallel_state.get_pipeline_model_parallel_rank()
    per_stage = cfg.num_layers // parallel_state.get_pipeline_model_parallel_world_size()
    mine = {}
    for name, value in _params(model).items():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(int(parts[2]) + stage * per_stage)
        if _is_tied_copy(name, cfg):
            continue
        mine[".".join(parts)] = value
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in everyone:
        merged.update(part)
    return merged


def _is_tied_copy(name: str, cfg) -> bool:
    """Whether ``name`` is the last stage's copy of the tied embedding."""
    from megatron.core import parallel_state

    return (
        name == "output_layer.weight"
        and cfg.share_embeddings_and_output_weights
        and parallel_state.get_pipeline_model_parallel_world_size() > 1
    )


def _bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (empty: bit-exact)."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return [n for n in sorted(b) if not torch.equal(a[n], b[n])]


SAVE_COUNTS = [[3, 1], [2, 0]]  # PP=2 replicas, before the save
NEXT_COUNTS = [1, 2]  # PP=2 replicas, the step after it
NEXT_AT_DP4 = [[0], [], [0, 1], []]  # the same samples at PP=1 x DP=4: replica r's seeds 37*r + i


def _pp1_step(model, opt, cfg, step: int) -> tuple[float, float]:
    """The step after the save at PP=1 x DP=4 on the samples the PP=2 replicas ran."""
    from megatron.core import parallel_state

    from megatron_odc.mcore.step import train_step
    from tests._megatron import make_batch

    dp_rank = parallel_state.get_data_parallel_rank()
    replica = {0: 0, 2: 1}.get(dp_rank, 0)
    batches = [
        make_batch(cfg, 1, seed=1000 * step + 37 * replica + i) for i in NEXT_AT_DP4[dp_rank]
    ]
    out = train_step(model, opt, _forward_step, batches, seq_length=cfg.seq_length)
    totals = torch.zeros(2, dtype=torch.float64)
    for report in out["losses"]:
        totals += report["lm loss"].double()
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    return float(totals[0] / totals[1]), float(out["grad_norm"])


def _run_checkpoints(rank: int, world_size: int, root: str) -> dict:
    from megatron_odc.mcore.model import GPTConfig
    from megatron_odc.runner.checkpoint import load_checkpoint, save_checkpoint
    from tests._megatron import init_megatron, teardown_megatron
    from tests.runner.test_checkpoint import _allow_writer_processes

    _allow_writer_processes()
    cfg = GPTConfig(**CFG_KW)
    out: dict = {}
    init_megatron(1, seed=3, pp=2)
    try:
        model, opt = _build("odc", cfg, seed=21)
        for step, counts in enumerate(SAVE_COUNTS):
            _step(model, opt, cfg, step, counts)
        save_checkpoint(f"{root}/pp2", 2, model, opt, extra_state={})
        saved_pp2 = _global_params(model, cfg)
        oracle = _step(model, opt, cfg, 2, NEXT_COUNTS)
        oracle_params = _global_params(model, cfg)
        model.close()
        # megatron-core DDP with the same pipeline layout: the weights, bit-exact.
        ddp, ddp_opt = _build("ddp", cfg, seed=22)
        load_checkpoint(f"{root}/pp2", ddp, ddp_opt, finetune=True)
        out["pp2_to_ddp"] = _bit_exact(_global_params(ddp, cfg), saved_pp2)
    finally:
        teardown_megatron()
    init_megatron(1, seed=3)
    try:
        model, opt = _build("odc", cfg, seed=23)
        load_checkpoint(f"{root}/pp2", model, opt)
        out["pp2_to_pp1"] = _bit_exact(_global_params(model, cfg), saved_pp2)
        out["pp1_step"] = (_pp1_step(model, opt, cfg, 2), oracle)
        out["pp1_params"] = _worst(_global_params(model, cfg), oracle_params)
        save_checkpoint(f"{root}/pp1", 3, model, opt, extra_state={})
        saved_pp1 = _global_params(model, cfg)
        model.close()
    finally:
        teardown_megatron()
    init_megatron(1, seed=3, pp=2)
    try:
        model, opt = _build("odc", cfg, seed=24)
        load_checkpoint(f"{root}/pp1", model, opt)
        out["pp1_to_pp2"] = _bit_exact(_global_params(model, cfg), saved_pp1)
        out["tied_equal"] = _tied_copies_equal(model)
        model.close()
    finally:
        teardown_megatron()
    return out


@pytest.mark.slow
def test_checkpoints_move_between_pipeline_layouts(tmp_path) -> None:
    results = run_ranks(_run_checkpoints, WORLD, str(tmp_path), timeout_s=400)
    for rank, ck in enumerate(results):
        for case in ("pp2_to_ddp", "pp2_to_pp1", "pp1_to_pp2"):
            assert ck[case] == [], f"rank {rank}: {case}: {ck[case][:3]} not bit-exact"
        (loss, norm), (ref_loss, ref_norm) = ck["pp1_step"]
        if ref_loss is not None:  # the PP=2 oracle's loss lives on its last stage
            assert abs(loss - ref_loss) <= REL_TOL * abs(ref_loss), (rank, loss, ref_loss)
        assert abs(norm - ref_norm) <= REL_TOL * ref_norm, (rank, norm, ref_norm)
        _assert_same_params(f"rank {rank} after the PP=1 step", ck["pp1_params"])
        assert ck["tied_equal"] in (True, None), rank


# ---------------------------------------------------------------------- tests


def _assert_same_step(where: str, got: tuple, want: tuple) -> None:
    """(loss, grad norm) of one step equal the reference's to ``REL_TOL`` relative."""
    (loss, norm), (ref_loss, ref_norm) = got, want
    assert (loss is None) == (ref_loss is None), (where, loss, ref_loss)
    if loss is not None:
        assert abs(loss - ref_loss) <= REL_TOL * abs(ref_loss), (where, loss, ref_loss)
    assert abs(norm - ref_norm) <= REL_TOL * ref_norm, (where, norm, ref_norm)


def _assert_same_params(where: str, worst: tuple[float, str]) -> None:
    err, name = worst
    assert err <= REL_TOL, f"{where}: parameter {name} differs by {err:.2e}"


def test_pp2_dp2_uneven_counts_match_megatron_ddp(world) -> None:
    for rank, res in enumerate(world):
        parity = res["parity"]
        assert parity["stage"] == rank // 2, parity["stage"]
        for step, (got, want) in enumerate(zip(parity["odc"], parity["ddp"], strict=True)):
            _assert_same_step(f"rank {rank} step {step}", got, want)
        _assert_same_params(f"rank {rank}", parity["params"])
        # Each stage holds its own layers (units) and its end of the tied embedding.
        assert len(parity["units"]) == 3, parity["units"]  # root + 2 layers
        assert (
            parity["tied_name"]
            == [
                "embedding.word_embeddings.weight",
                "output_layer.weight",
            ][parity["stage"]]
        )
        assert parity["embedding_ranks"] == [rank % 2, 2 + rank % 2]
        assert parity["tied_equal"] is True, rank
    # The grad norm is global: every rank reports the same.
    norms = {tuple(n for _, n in res["parity"]["odc"]) for res in world}
    assert len(norms) == 1, norms


def test_promise_per_stage_one_sided_two_fences(world) -> None:
    for rank, res in enumerate(world):
        parity = res["parity"]
        dp_ranks, embedding_ranks = parity["dp_ranks"], parity["embedding_ranks"]
        assert dp_ranks == [2 * (rank // 2), 2 * (rank // 2) + 1], dp_ranks
        for step, events in enumerate(parity["events"]):
            where = f"rank {rank} step {step}"
            marks = {e[1]: i for i, e in enumerate(events) if e[0] == "mark"}
            zero_at, finish_at = marks["zero_grad_buffer"], marks["finish_grad_sync"]
            step_at = marks["optimizer_step"]
            # Inside the minibatch: one-sided gets and accumulates to the stage's DP peers only,
            # and no collective over the DP group (the schedule's sends are not collectives).
            minibatch = events[zero_at + 1 : finish_at]
            ops = {e[0] for e in minibatch}
            assert ops <= {"get", "accumulate", "collective"}, (where, ops)
            assert all(0 <= e[2] < 2 for e in minibatch if e[0] in ("get", "accumulate")), where
            on_dp = [e for e in minibatch if e[0] == "collective" and list(e[2]) == dp_ranks]
            assert not on_dp, (where, on_dp)
            mine = COUNTS[step][rank % 2]
            if mine:
                assert {"get", "accumulate"} <= ops, (where, ops)
            # Two fences per minibatch on this stage: the push fence, the step's.
            fences = [i for i, e in enumerate(events) if e[0] == "fence"]
            assert len(fences) == 2, (where, fences)
            assert zero_at < fences[0] < step_at < fences[1], (where, fences, marks)
            # After the push fence, once: the tied embedding's owned slices summed over the
            # embedding group (the first and last stage; with PP=2 also the pipeline group, which
            # carries the count check before the minibatch and the token count after the fence).
            tied = ("collective", "all_reduce", tuple(embedding_ranks), parity["tied_owned"])
            assert parity["tied_owned"] > 0, where
            assert [i for i, e in enumerate(events) if e == tied] == [
                i for i, e in enumerate(events[:step_at]) if e == tied and i > fences[0]
            ], (where, events)
            assert events.count(tied) == 1, (where, events)


def test_pp2_tp2_matches_megatron_ddp(world) -> None:
    for rank, res in enumerate(world):
        tp2 = res["tp2"]
        assert tp2["transport_world"] == 1
        for step, (got, want) in enumerate(zip(tp2["odc"], tp2["ddp"], strict=True)):
            _assert_same_step(f"rank {rank} step {step}", got, want)
        _assert_same_params(f"rank {rank}", tp2["params"])


def test_counts_that_differ_inside_a_pipeline_are_refused_before_the_schedule(world) -> None:
    for rank, res in enumerate(world):
        kind, message, elapsed = res["counts"]["refusal"]
        assert kind == "ValueError", (rank, message)
        assert elapsed < REFUSAL_DEADLINE_S, (rank, elapsed)
        replica = rank % 2
        expected = ["stage 0: 2, stage 1: 1", "stage 0: 0, stage 1: 1"][replica]
        assert f"DP replica {replica}:" in message, message
        assert expected in message, message
        loss, norm = res["counts"]["after"]
        assert norm > 0, (rank, norm)
        assert (loss is None) == (rank < 2), (rank, loss)


def test_bad_layouts_are_refused_by_name(world) -> None:
    for rank, res in enumerate(world):
        kind, message, _ = res["layers"]
        assert kind == "ValueError", (rank, message)
        assert "--num-layers 3" in message, message
        assert "--pipeline-model-parallel-size 2" in message, message
        kind, message, _ = res["virtual"]
        assert kind == "ValueError", (rank, message)
        assert "--num-layers-per-virtual-pipeline-stage" in message, message
