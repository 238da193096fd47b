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

from megatron_odc.engine import BucketState, ODCEngine
from megatron_odc.hooks import ODCHooks
from megatron_odc.transport.shm import ShmTransport
from tests._dist import run_ranks
from tests._recording import RecordingTransport

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


def _wrap(model: TinyLM, transport, bucket_numel: int) -> tuple[ODCEngine, ODCHooks]:
    engine = ODCEngine(_named_params(model), transport, bucket_numel=bucket_numel, alignment=4)
    units = [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    return engine, ODCHooks(engine, model, units, "root")


def _owned_grads(engine: ODCEngine) -> list[tuple[str, int, torch.Tensor]]:
    out = []
    for bucket in engine.layout.buckets:
        shard = engine.grad_shard(bucket.index)
        shard_start, _ = bucket.shard_range(engine.dp_rank)
        for slot, start, end in bucket.owned_pieces(engine.dp_rank):
            s = slot.bucket_offset + start - shard_start
            out.append((slot.name, slot.param_offset + start, shard[s : s + end - start].clone()))
    return out


def _run_uneven(rank: int, world_size: int, counts: list[int], bucket_numel: int, steps: int):
    model = _model(0)
    samples = _samples(1, sum(counts) * steps)
    transport = RecordingTransport(ShmTransport())
    engine, _ = _wrap(model, transport, bucket_numel)
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
            }
        )
        # A plain SGD step on the owned shard so that the next minibatch sees new weights.
        for bucket in engine.layout.buckets:
            engine.param_shard(bucket.index).sub_(0.01 * engine.grad_shard(bucket.index))
    transport.fence()  # the last step's shards are visible before anyone reads them
    full = engine.full_parameters()
    engine.close()
    return results, full


def _oracle(counts: list[int], steps: int):
    model = _model(0)
    samples = _samples(1, sum(counts) * steps)
    grads_per_step = []
    cursor = 0
    for _ in range(steps):
        model.zero_grad()
        for tokens in samples[cursor : cursor + sum(counts)]:
            model(tokens).backward()
        cursor += sum(counts)
        grads_per_step.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.01 * p.grad)
    return grads_per_step, {n: p.detach().clone() for n, p in model.named_parameters()}


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
    ("counts", "bucket_numel"),
    [([1, 3], 10_000), ([2, 0, 1, 3], 700), ([0, 2], 64)],
    ids=["dp2-1vs3", "dp4-with-zero", "dp2-tiny-buckets-split"],
)
def test_uneven_microbatches_match_single_process(counts: list[int], bucket_numel: int) -> None:
    steps = 2
    results = run_ranks(_run_uneven, len(counts), counts, bucket_numel, steps, timeout_s=120)
    oracle_grads, oracle_params = _oracle(counts, steps)
    for step in range(steps):
        got = _assemble(results, step, oracle_grads[step])
        for name, expected in oracle_grads[step].items():
            assert_rel_close(got[name], expected, 1e-5, name)
        for res, _ in results:
            rec = res[step]
            assert rec["inside_ops"] in (["accumulate", "get"], ["get"], ["accumulate"], [])
            assert rec["after_ops"] == ["flush", "fence"]
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
