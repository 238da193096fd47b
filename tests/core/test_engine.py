"""The ODC engine and hooks on a plain torch model: gradients equal a single-process oracle.

Every rank runs its own (uneven, possibly zero) number of microbatches; after ``finish_minibatch`` the
owners' accumulators, put together, must equal the summed gradients of one process that ran all the
microbatches. A recording transport checks the ODC promise: inside a minibatch only gets and accumulates
run, each accumulate lands in the owner the layout names, and exactly two fences run per minibatch.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from megatron_odc.core.engine import ODCEngine
from megatron_odc.core.fp8 import (
    EmulatedFloat8Codec,
    EmulatedFloat8Tensor,
    quantization_error_bound,
)
from megatron_odc.core.hooks import ODCHooks
from megatron_odc.core.state import BucketState
from megatron_odc.transport.shm import ShmTransport
from tests._dist import run_ranks
from tests._recording import RecordingStreams, RecordingTransport

VOCAB, HIDDEN, FFN, LAYERS = 37, 24, 41, 3


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(functional.gelu(self.fc1(self.norm(x))))


class TinyLM(torch.nn.Module):
    """Tied input/output embedding: its weight is used at both ends of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.final_norm = torch.nn.LayerNorm(HIDDEN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.final_norm(x) @ self.embedding.weight.t()
        return functional.cross_entropy(logits[:-1], tokens[1:], reduction="sum")


def _model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def _samples(seed: int, num: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB, (int(torch.randint(5, 30, (1,), generator=g)),), generator=g)
        for _ in range(num)
    ]


def _named_params(model: TinyLM) -> list[tuple[str, torch.nn.Parameter, str]]:
    out = []
    for name, p in model.named_parameters():
        unit = (
            name.split(".")[0] + "." + name.split(".")[1] if name.startswith("layers.") else "root"
        )
        out.append((name, p, unit))
    # Root first (fetched at the start of forward), then layers in forward order.
    return sorted(out, key=lambda t: (t[2] != "root", t[2]))


def _wrap(
    model: TinyLM, transport, bucket_numel: int, budget: str = "none"
) -> tuple[ODCEngine, ODCHooks]:
    engine = ODCEngine(
        _named_params(model),
        transport,
        bucket_numel=bucket_numel,
        alignment=4,
        unsharded_budget=budget,
        root_unit="root",
    )
    units = [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    return engine, ODCHooks(engine, model, units, "root")


def one_minibatch(transport, counts: list[int], rank: int) -> tuple[ODCEngine, ODCHooks]:
    """This rank's ``counts[rank]`` samples of one minibatch (``_samples(1, sum(counts))``) through a
    fresh ``_model(0)`` wrapped on ``transport`` (buckets of 700); returns the engine after its fence, and
    its hooks. The gradients then equal ``_oracle(counts, 1)``'s first step."""
    model = _model(0)
    engine, hooks = _wrap(model, transport, 700)
    samples = _samples(1, sum(counts))
    start = sum(counts[:rank])
    engine.begin_minibatch()
    for tokens in samples[start : start + counts[rank]]:
        model(tokens).backward()
    engine.finish_minibatch()
    return engine, hooks


def _owned_grads(engine: ODCEngine) -> list[tuple[str, int, torch.Tensor]]:
    out = []
    for bucket in engine.layout.buckets:
        shard = engine.grad_shard(bucket.index)
        shard_start, _ = bucket.shard_range(engine.dp_rank)
        for slot, start, end in bucket.owned_pieces(engine.dp_rank):
            s = slot.bucket_offset + start - shard_start
            out.append((slot.name, slot.param_offset + start, shard[s : s + end - start].clone()))
    return out


def _run_uneven(
    rank: int, world_size: int, counts: list[int], bucket_numel: int, steps: int, budget: str
):
    model = _model(0)
    samples = _samples(1, sum(counts) * steps)
    transport = RecordingTransport(ShmTransport())
    engine, _ = _wrap(model, transport, bucket_numel, budget)
    results = []
    cursor = 0
    for _ in range(steps):
        engine.begin_minibatch()
        transport.calls.clear()
        mine = []
        for r, n in enumerate(counts):
            if r == rank:
                mine = samples[cursor : cursor + n]
            cursor += n
        for tokens in mine:
            model(tokens).backward()  # the hooks fetch, push and release
        inside = transport.ops()
        engine.finish_minibatch()
        after = transport.ops()[len(inside) :]
        # Every accumulate lands in the owner the layout names.
        for op, name, peer, offset, numel in transport.calls:
            if op == "accumulate":
                bucket = engine.layout.buckets[int(name.rsplit(".", 1)[1])]
                start = peer * bucket.shard_numel + offset
                assert bucket.owner_of(start) == peer
                assert bucket.owner_of(start + numel - 1) == peer
        states = [s.value for s in engine.states]
        results.append(
            {
                "grads": _owned_grads(engine),
                "inside_ops": sorted(set(inside)),
                "after_ops": after,
                "states": states,
                "telemetry": engine.telemetry.snapshot(),
                "kept": sorted(engine.kept_units),
                "units": list(engine.layout.units),
                "num_buckets": len(engine.layout.buckets),
            }
        )
        # A plain SGD step on the owned shard so that the next minibatch sees new weights.
        for bucket in engine.layout.buckets:
            engine.param_shard(bucket.index).sub_(0.01 * engine.grad_shard(bucket.index))
    transport.fence()  # the last step's shards are visible before anyone reads them
    full = engine.full_parameters()
    engine.close()
    return results, full


def _oracle(
    counts: list[int], steps: int, *, make_model=_model, sample_seed: int = 1, lr: float = 0.01
):
    """One process on every rank's samples: SGD on fp32 masters, copied into the parameters after each
    step (an FP8 weight re-quantises as a whole tensor). Returns the gradients of every step and the
    final parameter values."""
    model = make_model(0)
    samples = _samples(sample_seed, sum(counts) * steps)
    params = dict(model.named_parameters())
    masters = {n: p.detach().clone().float() for n, p in params.items()}  # FP8: its values
    grads_per_step = []
    cursor = 0
    for _ in range(steps):
        model.zero_grad()
        for tokens in samples[cursor : cursor + sum(counts)]:
            model(tokens).backward()
        cursor += sum(counts)
        grads_per_step.append({n: p.grad.clone() for n, p in params.items()})
        with torch.no_grad():
            for name, p in params.items():
                masters[name].sub_(lr * p.grad)
                p.copy_(masters[name])
    return grads_per_step, {n: p.detach().clone() for n, p in params.items()}


def assert_rel_close(got: torch.Tensor, expected: torch.Tensor, rel: float, msg: str) -> None:
    """max |got - expected| <= rel * max |expected| (fp32 sums in a different order differ by rounding)."""
    scale = float(expected.abs().max()) or 1.0
    err = float((got - expected).abs().max())
    assert err <= rel * scale, (
        f"{msg}: max abs error {err:.3e} > {rel:g} x max |expected| {scale:.3e}"
    )


def _assemble(
    rank_results: list, step: int, like: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    full = {n: torch.full((t.numel(),), float("nan")) for n, t in like.items()}
    for res, _ in rank_results:
        for name, offset, values in res[step]["grads"]:
            full[name][offset : offset + values.numel()] = values
    return {n: t.view(like[n].shape) for n, t in full.items()}


@pytest.mark.parametrize(
    ("counts", "bucket_numel", "budget"),
    [
        ([1, 3], 10_000, "none"),
        ([2, 0, 1, 3], 700, "none"),
        ([0, 2], 64, "none"),
        ([1, 3], 10_000, "all"),
        ([2, 0, 1, 3], 700, "all"),
        ([3, 1], 700, "40000"),
    ],
    ids=[
        "dp2-1vs3",
        "dp4-with-zero",
        "dp2-tiny-buckets-split",
        "dp2-1vs3-keep-all",
        "dp4-with-zero-keep-all",
        "dp2-3vs1-keep-some",
    ],
)
def test_uneven_microbatches_match_single_process(
    counts: list[int], bucket_numel: int, budget: str
) -> None:
    steps = 2
    results = run_ranks(
        _run_uneven, len(counts), counts, bucket_numel, steps, budget, timeout_s=120
    )
    oracle_grads, oracle_params = _oracle(counts, steps)
    for step in range(steps):
        got = _assemble(results, step, oracle_grads[step])
        for name, expected in oracle_grads[step].items():
            assert_rel_close(got[name], expected, 1e-5, name)
        for rank, (res, _) in enumerate(results):
            rec = res[step]
            kept, units = rec["kept"], rec["units"]
            if budget == "none":
                assert kept == []
                assert rec["inside_ops"] in (["accumulate", "get"], ["get"], ["accumulate"], [])
                assert rec["after_ops"] == ["flush", "fence"]
            elif budget == "all":
                # Kept units: fetched once in the minibatch, pushed once at its end.
                assert kept == sorted(units)
                assert rec["inside_ops"] in (["get"], [])
                assert set(rec["after_ops"][:-2]) <= {"accumulate"}
                assert rec["after_ops"][-2:] == ["flush", "fence"]
                moved = rec["num_buckets"] if counts[rank] else 0
                assert rec["telemetry"]["num_fetches"] == moved
                assert rec["telemetry"]["num_pushes"] == moved
            else:
                assert 0 < len(kept) < len(units), kept
            assert set(rec["states"]) == {"sharded"}
    for _, full in results:
        for name, expected in oracle_params.items():
            assert_rel_close(full[name], expected, 1e-5, name)
    # Telemetry counted this rank's microbatches.
    for rank, (res, _) in enumerate(results):
        assert res[-1]["telemetry"]["num_microbatches"] == counts[rank]


def _run_state_errors(rank: int, world_size: int):
    model = _model(0)
    engine, hooks = _wrap(model, ShmTransport(), 10_000)
    errors = []
    engine.begin_minibatch()
    engine.fetch("layers.0")
    engine.begin_backward("layers.0")
    try:
        engine.release("layers.0")
    except RuntimeError as exc:
        errors.append(str(exc))
    engine.push("layers.0")
    engine.release("layers.0")
    assert engine.unit_state("layers.0") is BucketState.SHARDED
    try:
        engine.begin_backward("layers.1")
    except RuntimeError as exc:
        errors.append(str(exc))
    try:
        engine.push("layers.2")
    except RuntimeError as exc:
        errors.append(str(exc))
    engine.finish_minibatch()
    hooks.remove()
    engine.close()
    return errors


def _run_phase_errors(rank: int, world_size: int):
    """The minibatch phase refuses a step before the push fence and a backward after it."""
    model = _model(0)
    engine, hooks = _wrap(model, ShmTransport(), 10_000)
    sample = _samples(rank, 1)[0]
    errors, phases = [], []
    engine.begin_minibatch()
    phases.append(engine.phase.value)
    model(sample).backward()
    phases.append(engine.phase.value)
    try:
        engine.end_step()  # the optimizer would read partial sums
    except RuntimeError as exc:
        errors.append(str(exc))
    engine.finish_minibatch()
    phases.append(engine.phase.value)
    try:
        model(sample).backward()  # pushes after the fence would be lost to this step
    except RuntimeError as exc:
        errors.append(str(exc))
    engine.release_all()
    engine.end_step()
    phases.append(engine.phase.value)
    # The next minibatch starts without a fence and trains as usual.
    engine.begin_minibatch()
    model(sample).backward()
    engine.finish_minibatch()
    engine.end_step()
    phases.append(engine.phase.value)
    hooks.remove()
    engine.close()
    return errors, phases


def test_minibatch_phase_refuses_a_step_before_the_fence_and_a_push_after_it() -> None:
    for rank, (errors, phases) in enumerate(run_ranks(_run_phase_errors, 2, timeout_s=60)):
        assert phases == ["accumulating", "accumulating", "reduced", "ready", "ready"]
        assert len(errors) == 2, errors
        assert f"DP rank {rank}: end_step while the minibatch is accumulating" in errors[0]
        assert "finish_grad_sync" in errors[0]
        assert f"DP rank {rank}: push while the minibatch is reduced" in errors[1]
        assert "zero_grad_buffer" in errors[1]


def test_illegal_transitions_name_rank_bucket_and_parameter() -> None:
    errors = run_ranks(_run_state_errors, 2, timeout_s=60)[1]
    assert len(errors) == 3
    assert "DP rank 1: illegal release of bucket" in errors[0]
    assert "'layers.0." in errors[0]
    assert "pushing -> sharded" in errors[0]
    assert "illegal begin_backward" in errors[1]
    assert "sharded -> pushing" in errors[1]
    assert "illegal push" in errors[2]


def _run_params_differ(rank: int, world_size: int):
    model = _model(rank)  # different weights on each rank
    _wrap(model, ShmTransport(), 10_000)


def test_parameters_differing_across_ranks_fail_at_construction() -> None:
    from tests._dist import RankFailureError

    with pytest.raises(
        RankFailureError, match=r"parameter 'embedding.weight' differs between DP rank"
    ):
        run_ranks(_run_params_differ, 2, timeout_s=60)


# ---------------------------------------------------------------------- overlap streams


def _run_overlap(rank: int, world_size: int, max_pushes: int) -> list:
    model = _model(0)
    transport = RecordingTransport(ShmTransport())
    streams = RecordingStreams(transport.calls)
    engine = ODCEngine(
        _named_params(model),
        transport,
        bucket_numel=10_000,
        alignment=4,
        streams=streams,
        max_pushes_in_flight=max_pushes,
    )
    units = [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    hooks = ODCHooks(engine, model, units, "root")
    for unit, layer in units:  # registered after the engine's hooks: marks the start of the compute
        layer.register_forward_pre_hook(
            lambda m, a, unit=unit: transport.calls.append(("compute", unit))
        )
    engine.begin_minibatch()
    transport.calls.clear()
    for tokens in _samples(3, 2):
        model(tokens).backward()
    transport.calls.append(("finish",))
    engine.finish_minibatch()
    hooks.remove()
    engine.close()
    return transport.calls


def _side_stream_work(log: list) -> list[dict]:
    """Every fetch / push launch: its unit, log position, the transport calls it made, and its event."""
    work = []
    for i, entry in enumerate(log):
        if entry[0] != "launch":
            continue
        j = i + 1
        while log[j][0] in ("get", "accumulate"):
            j += 1
        assert log[j][:2] == ("record", entry[1]), (i, log[j])  # the event right after the work
        op, unit = entry[2].split(":")
        work.append(
            {
                "stream": entry[1],
                "op": op,
                "unit": unit,
                "at": i,
                "calls": log[i + 1 : j],
                "event": log[j][2],
            }
        )
    return work


def _check_overlap_log(log: list, max_pushes: int) -> None:
    recorded_on = {e[2]: e[1] for e in log if e[0] == "record"}
    compute_waits = {}
    for i, e in enumerate(log):
        if e[:2] == ("wait", "compute"):
            assert e[2] not in compute_waits, f"compute waited twice for event {e[2]}"
            compute_waits[e[2]] = i
    work = _side_stream_work(log)
    for w in work:
        assert w["op"] == w["stream"], w  # fetches on the fetch stream, pushes on the push stream
        # The side stream first waits for an event recorded on the compute stream.
        before = log[w["at"] - 1]
        assert before[:2] == ("wait", w["stream"]), w
        assert recorded_on[before[2]] == "compute", w
        kinds = {c[0] for c in w["calls"]}
        assert kinds <= {"fetch": {"get"}, "push": {"accumulate"}}[w["op"]], w
    in_work = {i for w in work for i in range(w["at"], w["at"] + len(w["calls"]) + 1)}
    strays = [e for i, e in enumerate(log) if e[0] in ("get", "accumulate") and i not in in_work]
    assert not strays, f"transport calls outside a side-stream launch: {strays[:3]}"

    fetches = [w for w in work if w["op"] == "fetch"]
    for i, entry in enumerate(log):
        if entry[0] != "compute":
            continue
        unit = entry[1]
        mine = [w for w in fetches if w["unit"] == unit and w["at"] < i][-1]
        assert mine["at"] < compute_waits[mine["event"]] < i, f"{unit} ran before its fetch"
        k = int(unit.split(".")[1])
        if k + 1 < LAYERS:  # the next unit's fetch was issued before this compute and overlaps it
            nxt = [w for w in fetches if w["unit"] == f"layers.{k + 1}" and w["at"] < i][-1]
            assert nxt["at"] > mine["at"], unit
            assert compute_waits.get(nxt["event"], len(log)) > i, f"{unit} waited for the prefetch"

    pushes = [w for w in work if w["op"] == "push"]
    assert len(pushes) == 2 * (LAYERS + 1)  # every unit of both microbatches
    finish = log.index(("finish",))
    fence = next(i for i, e in enumerate(log) if i > finish and e[0] in ("flush", "fence"))
    for j, w in enumerate(pushes):
        waited = compute_waits[w["event"]]  # every push is waited for, once
        assert waited < fence, "the fence ran before compute waited for every push"
        if j + max_pushes + 1 < len(pushes):  # bounded: retired before the next push past the limit
            assert waited < pushes[j + max_pushes + 1]["at"], (j, "push retired too late")
        if j + max_pushes < len(pushes):  # and kept in flight as long as the limit allows
            assert waited > pushes[j + max_pushes]["at"], (j, "push retired too early")


@pytest.mark.parametrize("max_pushes", [1, 2])
def test_fetches_and_pushes_run_on_side_streams_and_overlap_compute(max_pushes: int) -> None:
    for log in run_ranks(_run_overlap, 2, max_pushes, timeout_s=60):
        _check_overlap_log(log, max_pushes)


# ---------------------------------------------------------------------- FP8 parameters


def _fp8_model(seed: int) -> TinyLM:
    """TinyLM whose MLP weights are emulated FP8 parameters (per-tensor scale)."""
    model = _model(seed)
    for block in model.layers:
        for linear in (block.fc1, block.fc2):
            fp8 = EmulatedFloat8Tensor.from_float(linear.weight.detach())
            linear.weight = torch.nn.Parameter(fp8, requires_grad=True)
    return model


FP8_LR = 0.01


def _run_fp8(rank: int, world_size: int, counts: list[int], steps: int) -> dict:
    model = _fp8_model(0)
    samples = _samples(5, sum(counts) * steps)
    codec = EmulatedFloat8Codec()
    engine = ODCEngine(
        _named_params(model), ShmTransport(), bucket_numel=300, alignment=4, fp8_codec=codec
    )
    units = [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    hooks = ODCHooks(engine, model, units, "root")
    params = dict(engine.parameters())
    masters = {}
    for p in engine.owned_pieces():
        shard = engine.param_shard(p.bucket_index)[p.shard_lo : p.shard_hi]
        if p.name in engine.fp8_names:
            masters[p] = codec.master_values(params[p.name], p.param_start, shard)
        else:
            masters[p] = shard.clone()
    cursor = 0
    for _ in range(steps):
        engine.begin_minibatch()
        start = cursor + sum(counts[:rank])
        for tokens in samples[start : start + counts[rank]]:
            model(tokens).backward()
        cursor += sum(counts)
        engine.finish_minibatch()
        for p, master in masters.items():  # SGD on the owned fp32 masters
            master.sub_(FP8_LR * engine.grad_shard(p.bucket_index)[p.shard_lo : p.shard_hi])
        engine.write_owned(lambda p: masters[p])  # FP8 pieces: re-quantised with the DP amax
        engine.end_step()
    full = engine.full_parameters()
    buckets = {
        name: [
            (engine.layout.buckets[s.bucket_index].dtype, s.numel)
            for s in engine.layout.slots_of(name)
        ]
        for name in engine.fp8_names
    }
    scale_inv = {name: float(params[name]._scale_inv) for name in engine.fp8_names}
    fetch_bytes = engine.telemetry.fetch_bytes
    hooks.remove()
    engine.close()
    return {"full": full, "buckets": buckets, "scale_inv": scale_inv, "fetch_bytes": fetch_bytes}


@pytest.mark.parametrize("counts", [[1, 3], [2, 0, 1, 1]], ids=["dp2-1vs3", "dp4-with-zero"])
def test_fp8_parameters_train_like_one_process_quantising_whole_tensors(counts: list[int]) -> None:
    steps = 3
    results = run_ranks(_run_fp8, len(counts), counts, steps, timeout_s=120)
    _, expected = _oracle(counts, steps, make_model=_fp8_model, sample_seed=5, lr=FP8_LR)
    fp8_names = {
        n for n, p in _fp8_model(0).named_parameters() if isinstance(p, EmulatedFloat8Tensor)
    }
    assert fp8_names
    assert fp8_names == set(results[0]["buckets"])
    for res in results:
        # Each FP8 weight (984 or 1000 bytes > the 300-element buckets) is one unsplit uint8 run.
        for name, slots in res["buckets"].items():
            assert slots == [(torch.uint8, expected[name].numel())], (name, slots)
        assert res["scale_inv"] == results[0]["scale_inv"], "ranks disagree on an FP8 scale"
        for name, value in expected.items():
            got = res["full"][name]
            if name not in fp8_names:
                assert_rel_close(got, value, 1e-5, name)
                continue
            # The masters differ from the oracle's only by fp32 summation order (so may the amax,
            # by an ulp); a byte may round the other way, by one FP8 step, where a master sits on a
            # rounding boundary.
            scale = 1 / results[0]["scale_inv"][name]
            bound = quantization_error_bound(value, scale) * 2.000001
            assert bool(((got - value).abs() <= bound).all()), name
            same = float(((got - value).abs() <= 1e-5 * value.abs()).float().mean())
            assert same >= 0.995, f"{name}: only {same:.4f} of the FP8 values match the oracle"
