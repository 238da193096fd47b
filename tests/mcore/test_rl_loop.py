"""ODC under an external, verl-style training loop (``mcore/rl/``) on a real megatron-core GPT.

One 4-rank world (CPU, gloo, shm transport), three layouts:

- TP=1 x DP=4: the weight-sync iterator's tensors equal, bit for bit, the unwrapped model built from the
  same seed;
- TP=2 x DP=2: the same at TP=2 (TP-gathered); then the external loop (``build_rl_backend``, its own
  ``get_forward_backward_func`` schedule with a rank-local count, verl's loss contract: token-loss sum x
  local n x DP / global tokens, ``calculate_per_token_loss=False``) under ODC with uneven counts
  including 0, different at every step, 5 AdamW steps with clipping, equals megatron-core DDP padded to
  equal counts with empty microbatches on the same samples to 1e-5: per-step loss, grad norm, final
  parameters; the same with Megatron's per-token loss (``calculate_per_token_loss=True``). After
  training the iterator equals the parameters assembled from the owners' shards, and
  holds at most one unit unsharded at a time. With Hugging Face names (a tiny Llama loaded through
  mbridge, vocabulary padded 61 -> 62) the tensors equal the HF checkpoint's bit for bit. A 3-tuple
  (per-microbatch mean) loss is refused, and so are TP ranks of one replica given different
  counts;
- PP=2 x DP=2: stages of one pipeline given different counts are refused in one line (training and
  forward-only calls, as for TP); so are DP ranks given different counts on the lockstep ``fsdp``
  backend (its collectives would hang).

Without ``rl/`` this fails (no module); without the DP average of ``ODCDataParallel.finish_grad_sync``
under ``calculate_per_token_loss=False`` the gradients are twice DDP's; without the zero-count path
passing ``None`` tokens under that contract, a rank with 0 microbatches deadlocks its DP peers.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import types
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._megatron import SMALL_GPT
from tests.mcore._rl_loop import mean_loss_forward_step, optimizer_config, samples

COUNTS = [[2, 0], [1, 3], [0, 2], [3, 1], [1, 2]]
"""Microbatches of DP rank 0 and 1 at each step: uneven, 0 included, different at every step."""
BUCKET_NUMEL = 3000
TOLERANCE = 1e-5


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-12))


def _empty(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A padding microbatch: the same shapes, no loss token (what the stacks pad equal counts with)."""
    return {**sample, "loss_mask": torch.zeros_like(sample["loss_mask"])}


def _verl_loss(loss_mask, scale, output_tensor):
    """verl's contract: the token-loss sum times local n x DP / global tokens; report the plain sum."""
    loss_sum = (output_tensor.float().reshape(-1) * loss_mask.reshape(-1).float()).sum()
    report = torch.stack([loss_sum.detach(), loss_mask.sum().float()])
    return loss_sum * scale, {"lm loss": report}


def _verl_forward_step(scale, data_iterator, model):
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, functools.partial(_verl_loss, batch["loss_mask"], scale)


def _external_loop(backend: str, cfg, steps: int, contract: str = "global_tokens") -> dict:
    """verl's loop: all-reduce the global tokens, run the schedule on the local count, step (with
    ``contract="per_token"``: Megatron's per-token loss, no global count needed)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_schedule

    from megatron_odc.mcore.config import ODCConfig
    from megatron_odc.mcore.model import build_gpt_model
    from megatron_odc.mcore.rl.loop import (
        build_rl_backend,
        get_forward_backward_func,
        global_tokens_scale,
    )
    from tests._megatron import _forward_step as per_token_forward_step

    dp_group = parallel_state.get_data_parallel_group()
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    odc = backend == "odc"
    model, optimizer = build_rl_backend(
        backend,
        build_gpt_model(cfg, seed=11),
        optimizer_config(cfg),
        loss_contract=contract,
        odc_config=ODCConfig(bucket_size=BUCKET_NUMEL) if odc else None,
    )
    schedule = get_forward_backward_func() if odc else megatron_schedule()
    out: dict = {"losses": [], "norms": [], "counts": []}
    for step in range(steps):
        mine = samples(cfg, step, dp_rank, COUNTS[step][dp_rank])
        if not odc:  # pad to the largest count with empty microbatches, as the stacks do
            pad = samples(cfg, step, dp_rank, 1)[0]
            mine += [_empty(pad)] * (max(COUNTS[step]) - len(mine))
        tokens = torch.tensor([sum(float(b["loss_mask"].sum()) for b in mine)], dtype=torch.float32)
        dist.all_reduce(tokens, group=dp_group)
        scale = global_tokens_scale(len(mine), int(tokens), dp_size)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_step = (
            per_token_forward_step
            if contract == "per_token"
            else functools.partial(_verl_forward_step, scale)
        )
        reports = schedule(
            forward_step_func=forward_step,
            data_iterator=iter(mine),
            model=[model],
            num_microbatches=len(mine),
            seq_length=cfg.seq_length,
            micro_batch_size=1,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        loss = torch.zeros(2)
        for report in reports:
            loss += report["lm loss"]
        dist.all_reduce(loss, group=dp_group)
        out["losses"].append(float(loss[0] / loss[1]))
        out["norms"].append(float(grad_norm))
        out["counts"].append(len(mine))
    return {"metrics": out, "model": model}


def _check_weight_sync_untrained(reference: dict[str, torch.Tensor], tp: int) -> dict:
    """An ODC-wrapped model's iterator (TP-gathered) against the unwrapped TP=1 model of the seed."""
    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.config import ODCConfig
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from megatron_odc.mcore.rl.weight_sync import iter_full_weights

    cfg = GPTConfig(**SMALL_GPT)
    model, _ = build_backend(
        "odc",
        build_gpt_model(cfg, seed=11),
        optimizer_config(cfg),
        odc_config=ODCConfig(bucket_size=BUCKET_NUMEL),
    )
    got = dict(iter_full_weights(model, gather_tp=tp > 1))
    model.close()
    return {
        "names": (sorted(got), sorted(reference)),
        "unequal": sorted(n for n in reference if not torch.equal(got.get(n), reference[n])),
    }


def _check_weight_sync_trained(model) -> dict:
    """After training: the iterator against each parameter assembled from the owners' shards (every
    element owned by one DP rank: a sum over DP of zero-filled owned pieces is exact), TP-merged by
    the test helper; and the unsharded bytes held while it runs."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_odc.mcore.rl.weight_sync import iter_full_weights
    from tests._megatron import gather_tp_tensor

    engine = model.engine
    params = dict(engine.parameters())
    assembled = {n: torch.zeros(p.numel()) for n, p in params.items()}
    for piece in engine.owned_pieces():
        span = slice(piece.param_start, piece.param_start + piece.numel)
        assembled[piece.name][span] = engine.owned.piece_values(piece)
    reference = {}
    for name, flat in assembled.items():
        dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
        full = gather_tp_tensor(flat.view(params[name].shape), params[name])
        reference[model.state_key[name]] = full
    unit_nbytes = {
        unit: sum(g.numel * g.params_flat.element_size() for g in engine.storage.groups(unit))
        for unit in engine.layout.units
    }
    held, got = [], {}
    for name, value in iter_full_weights(model, gather_tp=True):
        held.append(engine.unsharded_nbytes())
        got[name] = value
    return {
        "names": (sorted(got), sorted(reference)),
        "unequal": sorted(n for n in reference if not torch.equal(got[n], reference[n])),
        "peak_unsharded": max(held),
        "largest_unit": max(unit_nbytes.values()),
        "model_nbytes": sum(unit_nbytes.values()),
        "after": engine.unsharded_nbytes(),
    }


def _check_weight_sync_ddp(model) -> dict:
    """megatron-core DDP (replicated parameters): the iterator against the module's own parameters,
    TP-merged by the test helper."""
    from megatron_odc.mcore.rl.weight_sync import iter_full_weights
    from tests._megatron import gather_tp_tensor

    reference = {n: gather_tp_tensor(p.detach(), p) for n, p in model.module.named_parameters()}
    got = dict(iter_full_weights(model, gather_tp=True))
    return {
        "names": (sorted(got), sorted(reference)),
        "unequal": sorted(n for n in reference if not torch.equal(got[n], reference[n])),
    }


def _check_weight_sync_hf_names(hf_dir: str) -> dict:
    """At TP=2 under ODC, the iterator with HF names against the HF safetensors the model was loaded
    from (mbridge's split on load, the iterator's merge and conversion on the way out: copies only)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.config import ODCConfig
    from megatron_odc.mcore.hf_bridge import load_hf_weights, read_hf_config
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from megatron_odc.mcore.rl.weight_sync import iter_full_weights
    from megatron_odc.runner.arguments import build_parser, validate_args

    args = validate_args(
        build_parser().parse_args(["--load-hf", hf_dir, "--tensor-model-parallel-size", "2"]),
        world_size=dist.get_world_size(),
    )
    cfg = GPTConfig.from_args(args, vocab_size=args.vocab_size)
    gpt = build_gpt_model(cfg, seed=7)
    load_hf_weights(gpt, hf_dir)
    model, _ = build_backend(
        "odc", gpt, optimizer_config(cfg), odc_config=ODCConfig(bucket_size=BUCKET_NUMEL)
    )
    got = dict(iter_full_weights(model, hf_config=read_hf_config(hf_dir)))
    model.close()
    reference = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        reference.update(load_file(str(path)))
    return {
        "names": (sorted(got), sorted(reference)),
        "unequal": sorted(n for n in reference if not torch.equal(got.get(n), reference[n])),
    }


def _check_three_tuple_refused(model, cfg) -> str:
    from megatron_odc.mcore.rl.loop import get_forward_backward_func

    try:
        get_forward_backward_func()(
            forward_step_func=mean_loss_forward_step,
            data_iterator=iter(samples(cfg, 99, 0, 1)),
            model=[model],
            num_microbatches=1,
            seq_length=cfg.seq_length,
            micro_batch_size=1,
            forward_only=False,
        )
    except ValueError as error:
        return str(error)
    return "not refused"


def _check_replica_counts_refused(rank_in_group: int) -> dict[str, str]:
    """Different counts on the ranks of one DP replica (``rank_in_group``: this rank's TP rank or
    pipeline stage), for a training and a forward-only call (log-probs: a stage waited for
    activations without a limit, a TP rank aborted in a mismatched collective)."""
    from megatron_odc.mcore.rl.loop import get_forward_backward_func

    chunk = types.SimpleNamespace(config=types.SimpleNamespace(calculate_per_token_loss=True))
    out = {}
    for forward_only in (False, True):
        try:
            get_forward_backward_func()(
                forward_step_func=None,
                data_iterator=None,
                model=[chunk],
                num_microbatches=1 + rank_in_group,
                seq_length=8,
                micro_batch_size=1,
                forward_only=forward_only,
            )
            out[forward_only] = "not refused"
        except ValueError as error:
            out[forward_only] = str(error)
    return out


def _check_fsdp_uneven_counts_refused() -> str:
    """The lockstep backend's wrapper (its config and DP group) given different counts per DP rank."""
    from megatron.core import parallel_state

    from megatron_odc.mcore.config import LOCKSTEP_TRANSPORT, ODCConfig
    from megatron_odc.mcore.rl.loop import get_forward_backward_func

    chunk = types.SimpleNamespace(
        config=types.SimpleNamespace(calculate_per_token_loss=True),
        odc_config=ODCConfig(transport=LOCKSTEP_TRANSPORT),
        dp_group=parallel_state.get_data_parallel_group(),
    )
    try:
        get_forward_backward_func()(
            forward_step_func=None,
            data_iterator=None,
            model=[chunk],
            num_microbatches=2 * parallel_state.get_data_parallel_rank(),
            seq_length=8,
            micro_batch_size=1,
        )
    except ValueError as error:
        return str(error)
    return "not refused"


def _run(rank: int, world_size: int, hf_dir: str | None) -> dict:
    from megatron.core import parallel_state

    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from tests._megatron import init_megatron, teardown_megatron

    out: dict = {}
    init_megatron(1, seed=5)
    try:
        reference = {
            n: p.detach().clone()
            for n, p in build_gpt_model(GPTConfig(**SMALL_GPT), seed=11).named_parameters()
        }
        out["sync_tp1"] = _check_weight_sync_untrained(reference, tp=1)
    finally:
        teardown_megatron()
    init_megatron(2, seed=5)
    try:
        out["sync_tp2"] = _check_weight_sync_untrained(reference, tp=2)
        if hf_dir is not None:
            out["sync_hf"] = _check_weight_sync_hf_names(hf_dir)
        cfg = GPTConfig(**SMALL_GPT, calculate_per_token_loss=False)
        ddp = _external_loop("ddp", cfg, len(COUNTS))
        odc = _external_loop("odc", cfg, len(COUNTS))
        out["ddp"], out["odc"] = ddp["metrics"], odc["metrics"]
        ddp_params = {n: p.detach() for n, p in ddp["model"].module.named_parameters()}
        odc_params = odc["model"].engine.full_parameters()
        out["param_worst"] = max((_rel_err(odc_params[n], ddp_params[n]), n) for n in ddp_params)
        out["sync_trained"] = _check_weight_sync_trained(odc["model"])
        out["sync_ddp"] = _check_weight_sync_ddp(ddp["model"])
        out["three_tuple"] = _check_three_tuple_refused(odc["model"], cfg)
        out["fsdp_uneven"] = _check_fsdp_uneven_counts_refused()
        out["tp"] = _check_replica_counts_refused(parallel_state.get_tensor_model_parallel_rank())
        odc["model"].close()
        cfg = GPTConfig(**SMALL_GPT)  # Megatron's per-token loss through the same loop
        ddp = _external_loop("ddp", cfg, len(COUNTS), "per_token")
        odc = _external_loop("odc", cfg, len(COUNTS), "per_token")
        odc_params = odc["model"].engine.full_parameters()
        out["per_token"] = {
            "ddp": ddp["metrics"],
            "odc": odc["metrics"],
            "param_worst": max(
                (_rel_err(odc_params[n], p.detach()), n)
                for n, p in ddp["model"].module.named_parameters()
            ),
        }
        odc["model"].close()
    finally:
        teardown_megatron()
    init_megatron(1, seed=5, pp=2)
    try:
        out["pipeline"] = _check_replica_counts_refused(
            parallel_state.get_pipeline_model_parallel_rank()
        )
    finally:
        teardown_megatron()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    hf_dir = None
    if importlib.util.find_spec("mbridge") and importlib.util.find_spec("transformers"):
        from tests.mcore._hf_models import write_tiny_model

        hf_dir = str(write_tiny_model(tmp_path_factory.mktemp("hf") / "llama", "llama"))
    return run_ranks(_run, 4, hf_dir, timeout_s=300, pg_timeout_s=60)


@pytest.mark.parametrize("contract", ["global_tokens", "per_token"])
def test_external_verl_loop_under_odc_equals_padded_ddp(world, contract) -> None:
    for rank, res in enumerate(world):
        if contract == "per_token":
            res = res["per_token"]
        odc, ddp = res["odc"], res["ddp"]
        assert 0 in odc["counts"], odc["counts"]
        assert len(set(odc["counts"])) > 1, odc["counts"]
        for step, (a, b) in enumerate(zip(odc["losses"], ddp["losses"], strict=True)):
            assert abs(a - b) <= TOLERANCE * abs(b), (rank, step, a, b)
        for step, (a, b) in enumerate(zip(odc["norms"], ddp["norms"], strict=True)):
            assert abs(a - b) <= TOLERANCE * abs(b), (rank, step, a, b)
        # Clipping acted (clip_grad 0.05 is below every norm), and the model trained.
        assert min(ddp["norms"]) > 0.05, ddp["norms"]
        assert res["param_worst"][0] <= TOLERANCE, (rank, res["param_worst"])
    logging.getLogger(__name__).info(
        "external loop: ODC counts %s, losses %s; padded DDP counts %s; worst parameter %s",
        world[0]["odc"]["counts"],
        world[0]["odc"]["losses"],
        world[0]["ddp"]["counts"],
        world[0]["param_worst"],
    )


def test_weight_sync_is_bitwise_the_unsharded_model_at_tp1_and_tp2(world) -> None:
    for rank, res in enumerate(world):
        for key in ("sync_tp1", "sync_tp2", "sync_trained", "sync_ddp"):
            names, reference = res[key]["names"]
            assert names == reference, (rank, key)
            assert res[key]["unequal"] == [], (rank, key, res[key]["unequal"])


def test_weight_sync_in_hf_names_is_bitwise_the_hf_checkpoint_at_tp2(world) -> None:
    if "sync_hf" not in world[0]:
        pytest.skip("needs mbridge and transformers")
    for rank, res in enumerate(world):
        names, reference = res["sync_hf"]["names"]
        assert names == reference, rank
        assert res["sync_hf"]["unequal"] == [], (rank, res["sync_hf"]["unequal"])


def test_weight_sync_holds_at_most_one_unit_unsharded(world) -> None:
    for rank, res in enumerate(world):
        sync = res["sync_trained"]
        assert 0 < sync["peak_unsharded"] <= sync["largest_unit"], (rank, sync)
        assert sync["after"] == 0, (rank, sync)
    sync = world[0]["sync_trained"]
    logging.getLogger(__name__).info(
        "weight sync at TP=2 x DP=2: peak unsharded %d bytes = largest unit %d bytes, %.0f%% of the "
        "TP-local model's %d bytes",
        sync["peak_unsharded"],
        sync["largest_unit"],
        100 * sync["peak_unsharded"] / sync["model_nbytes"],
        sync["model_nbytes"],
    )


def test_a_per_microbatch_mean_loss_uneven_replica_ranks_and_uneven_fsdp_ranks_are_refused(
    world,
) -> None:
    for res in world:
        assert "each microbatch's token mean" in res["three_tuple"], res["three_tuple"]
        for forward_only in (False, True):
            pipeline, tp = res["pipeline"][forward_only], res["tp"][forward_only]
            assert "the stages of its pipeline were given different numbers of" in pipeline, (
                pipeline
            )
            assert "(stage 0: 1, stage 1: 2)" in pipeline, pipeline
            assert "its tensor-parallel ranks were given different numbers of" in tp, tp
            assert "(TP rank 0: 1, TP rank 1: 2)" in tp, tp
        assert res["fsdp_uneven"].startswith("the fsdp backend runs every bucket as a collective")
        assert "DP rank 0: 0, DP rank 1: 2" in res["fsdp_uneven"], res["fsdp_uneven"]
