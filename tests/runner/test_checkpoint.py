"""Checkpoints through megatron.core.dist_checkpointing: exact resume, resharding, backend interop, atomicity.

Oracles: the uninterrupted run (losses, the optimizer state at the save, the next step's weights), the
saving run's own gathered full parameters (every load), and megatron-core's own DDP / distopt as the
other side of each interop direction. Four spawned worlds:

- ``pretrained`` (2 ranks, module fixture): distopt TP=1 x DP=2 pretrains and saves; ODC DP=2 trains
  and saves, and a fresh ODC model (other seed) resumes from it: weights and optimizer state equal
  bit for bit, next losses equal; finetune loads weights only; a model of another hidden size fails
  with a ValueError naming the tensor. The same world makes Megatron-LM's own torch_dist calls on the
  ODC overrides (``install_megatron_lm_checkpointing``, ``ODCOptimizer.sharded_state_dict`` /
  ``load_state_dict``): exact resume, a resume from distopt's checkpoint, a weights-only load.
- ``killed`` (2 ranks, module fixture): rank 1 dies inside the save of iteration 2.
- ``test_interop_and_resharding`` (4 ranks): distopt -> ODC TP=2 x DP=2 (finetune, and a resume with
  distopt's fully-reshardable optimizer state), ODC TP=2 -> megatron DDP TP=1 x DP=4 (finetune),
  ODC DP=2 -> ODC DP=4 (weights and optimizer state), and the killed root's iteration 1.
- ``test_full_resume_across_backends`` (2 ranks, the plugin entry's ``run``): odc -> ddp, odc ->
  distopt, ddp -> odc, distopt -> odc and distopt -> distopt full resumes (optimizer state included,
  weight decay on) end where backend B's uninterrupted run ends: losses, weights, Adam moments, step.

Ranks are daemonic processes under ``tests/_dist.py``; megatron's torch_dist writer needs child
processes, so each rank body clears its daemon flag first (``_allow_writer_processes``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatron_odc.mcore.config import ODCConfig
from tests._dist import RankFailureError, run_ranks
from tests._megatron import SMALL_GPT

CFG_KW = {
    **SMALL_GPT,
    # SwiGLU's fc1 is a ShardedTensorFactory in the module's sharded state dict: it exercises the
    # gathered full-tensor fallback next to the uneven boxes of every other parameter.
    "swiglu": True,
}
HP = {"lr": 3e-3, "weight_decay": 0.1, "clip_grad": 1.0}
ODC_OPTIONS = ODCConfig(bucket_size=3000)  # several buckets; owned slices cut rows mid-way
PRETRAIN_STEPS = 20  # distopt pretraining steps before the save (issue 5's acceptance)
FINETUNE_STEPS = 10  # ODC TP=2 x DP=2 steps after the finetune load
RESUME_STEPS = 2
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name (not imported: keeps megatron
# out of the pytest process)


def _cfg(**overrides):
    from megatron_odc.mcore.model import GPTConfig

    return GPTConfig(**{**CFG_KW, **overrides})


def _forward_step(data_iterator, model):
    from tests._megatron import _forward_step

    return _forward_step(data_iterator, model)


def _batches(cfg, dp_rank: int, step: int, count: int = 2):
    from tests._megatron import make_batch

    return [make_batch(cfg, 1, seed=1000 * step + 37 * dp_rank + i) for i in range(count)]


def _build(backend: str, cfg, seed: int, options: ODCConfig = ODC_OPTIONS):
    from megatron.core.optimizer import OptimizerConfig

    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.model import build_gpt_model, with_mixed_precision

    model = with_mixed_precision(build_gpt_model(cfg, seed=seed))
    opt_config = OptimizerConfig(
        optimizer="adam", params_dtype=cfg.params_dtype, bf16=cfg.bf16, **HP
    )
    options = options if backend in ("odc", "fsdp") else None
    return build_backend(backend, model, opt_config, odc_config=options)


def _step(model, optimizer, cfg, step: int) -> float:
    """One training step on this DP rank's microbatches; returns the global mean token loss."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_odc.mcore.step import train_step

    dp_rank = parallel_state.get_data_parallel_rank()
    out = train_step(
        model, optimizer, _forward_step, _batches(cfg, dp_rank, step), seq_length=cfg.seq_length
    )
    totals = torch.stack([r["lm loss"] for r in out["losses"]]).sum(dim=0).double()
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    return float(totals[0] / totals[1])


def _full_params(model) -> dict[str, torch.Tensor]:
    """The model's full (TP=1) parameters, by unwrapped-module name; collective over DP and TP."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model

    from megatron_odc.mcore.data_parallel import ODCDataParallel
    from tests._megatron import gather_tp_tensor

    gpt = unwrap_model(model)
    params = dict(gpt.named_parameters())
    if isinstance(model, ODCDataParallel):
        model.engine.transport.fence()  # the last step's shards are visible
        local = model.engine.full_parameters()
    else:
        local = {n: p.detach().clone() for n, p in params.items()}
    out = {}
    for name in sorted(params):
        value = gather_tp_tensor(local[name], params[name]).contiguous()
        if not getattr(params[name], "tensor_model_parallel", False):
            # TP-replicated: checkpoints hold TP rank 0's copy (the main replica). ODC's replicas
            # may differ in the last bit (peers' pushes are summed in arrival order).
            src = dist.get_global_rank(parallel_state.get_tensor_model_parallel_group(), 0)
            dist.broadcast(value, src=src, group=parallel_state.get_tensor_model_parallel_group())
        out[name] = value
    return out


def _allow_writer_processes() -> None:
    """Let this rank start child processes, as a torchrun worker may.

    ``tests/_dist.py`` spawns ranks as daemonic processes, and a daemonic process may not have
    children; megatron's torch_dist writer starts a ``multiprocessing`` Manager and forks writer
    processes. Clearing the flag is confined to the test rank; real launchers are not daemonic.
    """
    import multiprocessing

    multiprocessing.current_process()._config["daemon"] = False


def _stop_writer_manager() -> None:
    """Shut down the Manager megatron's writer started (before a deliberate ``os._exit``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    if queue is not None:
        queue._manager.shutdown()


def _odc_optimizer_state(opt) -> list[tuple]:
    """(name, step, main, exp_avg, exp_avg_sq) per owned piece of an ODCOptimizer (copies)."""
    out = []
    for piece in opt.pieces:
        state = opt.optimizer.state[piece.main]
        out.append(
            (
                piece.owned.name,
                float(state["step"]),
                piece.main.detach().clone(),
                state["exp_avg"].clone(),
                state["exp_avg_sq"].clone(),
            )
        )
    return out


def _optimizer_checksums(model, opt) -> dict[str, torch.Tensor]:
    """Per parameter: position-weighted sums of main / exp_avg / exp_avg_sq over DP (fp64, TP=1).

    Placement-sensitive (element i weighs i + 1), so state loaded into the wrong slice shows.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    engine = model.engine
    flat_start = {}
    for bucket in engine.layout.buckets:
        shard_start, _ = bucket.shard_range(engine.dp_rank)
        for slot, start, _end in bucket.owned_pieces(engine.dp_rank):
            flat_start[(bucket.index, slot.bucket_offset + start - shard_start)] = (
                slot.param_offset + start
            )
    names = sorted(n for n, _ in engine.parameters())
    sums = torch.zeros(len(names), 3, dtype=torch.float64)
    for piece in opt.pieces:
        owned = piece.owned
        start = flat_start[(owned.bucket_index, owned.shard_lo)]
        weights = torch.arange(start + 1, start + 1 + owned.numel, dtype=torch.float64)
        state = opt.optimizer.state[piece.main]
        row = names.index(owned.name)
        main = piece.main.detach()
        for col, tensor in enumerate((main, state["exp_avg"], state["exp_avg_sq"])):
            sums[row, col] += (tensor.double() * weights).sum()
    dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
    return {n: sums[i] for i, n in enumerate(names)}


def _same_optimizer_state(a: list[tuple], b: list[tuple]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x[:2] != y[:2] or not all(torch.equal(u, v) for u, v in zip(x[2:], y[2:])):
            return False
    return True


def _check_flat_range_boxes() -> list[str]:
    """Boxes from ``flat_range_boxes`` tile exactly the flat range (an element-marking oracle)."""
    from megatron_odc.mcore.dist_ckpt.boxes import flat_range_boxes

    gen = torch.Generator().manual_seed(3)
    problems = []
    for shape in [(7,), (5, 8), (1, 9), (6, 1), (3, 4, 5), (2, 3, 4, 2)]:
        numel = int(torch.tensor(shape).prod())
        for _ in range(40):
            start, end = sorted(torch.randint(0, numel + 1, (2,), generator=gen).tolist())
            marks = torch.zeros(shape, dtype=torch.int64)
            boxes = flat_range_boxes(shape, start, end)
            for offset, box, flat_offset in boxes:
                region = marks[tuple(slice(o, o + b) for o, b in zip(offset, box))]
                region += 1
                first = int(torch.arange(numel).reshape(shape)[tuple(offset)])
                if first != flat_offset:
                    problems.append(f"{shape} [{start},{end}): box {offset} flat {flat_offset}")
            want = torch.zeros(numel, dtype=torch.int64)
            want[start:end] = 1
            if not torch.equal(marks.reshape(-1), want):
                problems.append(f"{shape} [{start},{end}): boxes {boxes} do not tile the range")
            if len(shape) == 2 and len(boxes) > 3:
                problems.append(f"{shape} [{start},{end}): {len(boxes)} boxes for a 2-D range")
    return problems


def _mlm_metadata() -> dict:
    """The content metadata Megatron-LM passes to both ``sharded_state_dict`` calls (no distopt)."""
    from megatron.core import parallel_state

    return {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }


def _mlm_save(model, opt, directory: Path, iteration: int) -> None:
    """What Megatron-LM's ``save_checkpoint`` does with torch_dist (``generate_state_dict``)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    from megatron_odc.integration.megatron_lm.builders import ODCChainedOptimizer

    if dist.get_rank() == 0:
        directory.mkdir(parents=True)
    dist.barrier()
    metadata = _mlm_metadata()
    state = {
        "iteration": iteration,
        "model": unwrap_model(model).sharded_state_dict(metadata=metadata),
    }
    state["optimizer"] = ODCChainedOptimizer([opt]).sharded_state_dict(state, metadata=metadata)
    dist_checkpointing.save(state, str(directory))


def _mlm_load(model, opt, directory: Path, *, load_optim: bool) -> int:
    """What Megatron-LM's ``load_checkpoint`` does with torch_dist, in its order: one load of model and
    optimizer state (the optimizer's fp32 main shards are filled in place), the model's
    ``load_state_dict``, then the optimizer's, or for a weights-only load in bf16 / fp16
    ``reload_model_params``."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    from megatron_odc.integration.megatron_lm.builders import ODCChainedOptimizer

    metadata = _mlm_metadata()
    chained = ODCChainedOptimizer([opt])
    state = {"model": unwrap_model(model).sharded_state_dict(metadata=metadata)}
    if load_optim:
        state["optimizer"] = chained.sharded_state_dict(state, is_loading=True, metadata=metadata)
    loaded = dist_checkpointing.load(state, str(directory))
    model.load_state_dict(loaded["model"], strict=True)
    if load_optim:
        chained.load_state_dict(loaded["optimizer"])
    elif opt.config.bf16 or opt.config.fp16:
        chained.reload_model_params()
    return int(loaded["iteration"])


def _mains_equal_model_shards(model, opt) -> bool:
    """Whether the main shards the optimizer would step (and save) are the model's shards."""
    engine = model.engine
    return all(
        torch.equal(main, engine.param_shard(bucket.index).float())
        for bucket, main in zip(engine.layout.buckets, opt.state_dict()["main_shards"][0])
    )


def _fenced_full_parameters(model) -> dict[str, torch.Tensor]:
    """An ODC model's full parameters by the engine's names, after the last step's fence."""
    model.engine.transport.fence()
    return model.engine.full_parameters()


def _half_precision_resumes(root: Path) -> dict:
    """bf16 ODC (deterministic sums): 2 steps, a save by the plugin and one by Megatron-LM's calls,
    2 more steps (the uninterrupted run); then a model of other weights loads each checkpoint and
    takes the same 2 steps. Issue 37, item 1: Megatron-LM's order (optimizer loaded in place, then
    the model's ``load_state_dict``, then the optimizer's) lost the fp32 masters to the bf16 weights."""
    from megatron_odc.integration.megatron_lm.checkpointing import (
        install_megatron_lm_checkpointing,
    )
    from megatron_odc.runner.checkpoint import load_checkpoint, save_checkpoint

    cfg = _cfg(params_dtype=torch.bfloat16, bf16=True)
    options = ODCConfig(bucket_size=3000, deterministic=True)
    model, opt = _build("odc", cfg, seed=61, options=options)
    for step in range(2):
        _step(model, opt, cfg, step)
    save_checkpoint(root / "odc_bf16", 2, model, opt, extra_state={})
    install_megatron_lm_checkpointing(model, opt)
    _mlm_save(model, opt, root / "mlm_odc_bf16", 2)
    saved_opt = _odc_optimizer_state(opt)
    ref_losses = [_step(model, opt, cfg, step) for step in range(2, 2 + RESUME_STEPS)]
    ref_final = _fenced_full_parameters(model)
    ref_opt = _odc_optimizer_state(opt)
    model.close()
    out = {}
    for path in ("entry", "mlm"):
        model, opt = _build("odc", cfg, seed=67, options=options)
        if path == "entry":
            load_checkpoint(root / "odc_bf16", model, opt)
        else:
            install_megatron_lm_checkpointing(model, opt)
            _mlm_load(model, opt, root / "mlm_odc_bf16", load_optim=True)
        loaded_opt = _odc_optimizer_state(opt)
        losses = [_step(model, opt, cfg, step) for step in range(2, 2 + RESUME_STEPS)]
        out[path] = {
            "masters_equal": _same_optimizer_state(loaded_opt, saved_opt),
            "masters_not_weights": any(
                not torch.equal(x[2], x[2].bfloat16().float()) for x in loaded_opt
            ),
            "losses_equal": losses == ref_losses,
            "final_equal": _max_abs_diff(_fenced_full_parameters(model), ref_final)[0] == 0.0,
            "final_optimizer_equal": _same_optimizer_state(_odc_optimizer_state(opt), ref_opt),
        }
        model.close()
    return out


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((float((a[n] - b[n]).abs().max()), n) for n in a)


# ---------------------------------------------------------------------------------------- world A


def _run_pretrain_and_resume(rank, world_size, root: str):
    import torch.distributed as dist

    from megatron_odc.integration.megatron_lm.checkpointing import (
        install_megatron_lm_checkpointing,
    )
    from megatron_odc.runner.checkpoint import (
        latest_iteration,
        load_checkpoint,
        save_checkpoint,
    )
    from tests._megatron import init_megatron, teardown_megatron

    _allow_writer_processes()
    root_path = Path(root)
    out: dict = {}
    init_megatron(1, seed=5)
    try:
        cfg = _cfg()
        # distopt pretrain, save.
        model, opt = _build("distopt", cfg, seed=11)
        for step in range(PRETRAIN_STEPS):
            _step(model, opt, cfg, step)
        save_checkpoint(root_path / "distopt", PRETRAIN_STEPS, model, opt, extra_state={"r": rank})
        full = _full_params(model)
        # The uninterrupted continuation, for the distopt -> ODC resume in world B.
        distopt_loss = _step(model, opt, cfg, PRETRAIN_STEPS)
        if rank == 0:
            torch.save(full, root_path / "distopt_params.pt")
            torch.save(
                {"loss": distopt_loss, "params": _full_params(model)},
                root_path / "distopt_next.pt",
            )
        else:
            _full_params(model)

        # ODC: 2 steps, save, 2 more steps (the uninterrupted reference).
        model, opt = _build("odc", cfg, seed=11)
        for step in range(2):
            _step(model, opt, cfg, step)
        extra = {"rank": rank, "note": f"rank {rank}", "rng": torch.get_rng_state()}
        save_checkpoint(root_path / "odc_dp2", 2, model, opt, extra_state=extra)
        # The same state through Megatron-LM's own path (the instance overrides).
        install_megatron_lm_checkpointing(model, opt)
        _mlm_save(model, opt, root_path / "mlm_odc_dp2", 2)
        saved = _full_params(model)
        saved_opt = _odc_optimizer_state(opt)
        checksums = _optimizer_checksums(model, opt)
        if rank == 0:
            torch.save(saved, root_path / "odc_dp2_params.pt")
            torch.save(checksums, root_path / "odc_dp2_optimizer.pt")
        ref_losses = [_step(model, opt, cfg, step) for step in range(2, 2 + RESUME_STEPS)]
        ref_final = _full_params(model)
        model.close()

        # Fresh ODC model with other weights: load, compare, resume.
        model, opt = _build("odc", cfg, seed=23)
        before = _full_params(model)
        iteration, loaded_extra = load_checkpoint(root_path / "odc_dp2", model, opt)
        loaded = _full_params(model)
        loaded_opt = _odc_optimizer_state(opt)
        losses = [_step(model, opt, cfg, step) for step in range(2, 2 + RESUME_STEPS)]
        out["odc"] = {
            "iteration": iteration,
            "latest": latest_iteration(root_path / "odc_dp2"),
            "extra_rank": loaded_extra["rank"],
            "extra_rng_equal": torch.equal(loaded_extra["rng"], extra["rng"]),
            "before_diff": _max_abs_diff(before, saved),
            "loaded_diff": _max_abs_diff(loaded, saved),
            "optimizer_equal": _same_optimizer_state(loaded_opt, saved_opt),
            "optimizer_nonzero": all(float(x[3].abs().sum()) > 0 for x in saved_opt),
            "ref_losses": ref_losses,
            "losses": losses,
            "final_diff": _max_abs_diff(_full_params(model), ref_final),
        }

        # Finetune-load of the same checkpoint: weights only.
        model2, opt2 = _build("odc", cfg, seed=29)
        ft = load_checkpoint(root_path / "odc_dp2", model2, opt2, finetune=True)
        out["finetune"] = {"ret": ft, "diff": _max_abs_diff(_full_params(model2), saved)}
        model2.close()
        model.close()

        # Megatron-LM's path: resume the ODC checkpoint it wrote (a model of other weights)...
        model, opt = _build("odc", cfg, seed=47)
        install_megatron_lm_checkpointing(model, opt)
        mlm: dict = {"iteration": _mlm_load(model, opt, root_path / "mlm_odc_dp2", load_optim=True)}
        mlm["loaded_diff"] = _max_abs_diff(_full_params(model), saved)
        mlm["optimizer_equal"] = _same_optimizer_state(_odc_optimizer_state(opt), saved_opt)
        mlm["losses"] = [_step(model, opt, cfg, step) for step in range(2, 2 + RESUME_STEPS)]
        mlm["final_diff"] = _max_abs_diff(_full_params(model), ref_final)
        model.close()
        # ...resume distopt's fully-reshardable checkpoint (stock megatron-core sharded state)...
        model, opt = _build("odc", cfg, seed=53)
        install_megatron_lm_checkpointing(model, opt)
        distopt_dir = root_path / "distopt" / f"iter_{PRETRAIN_STEPS:07d}"
        mlm["distopt_iteration"] = _mlm_load(model, opt, distopt_dir, load_optim=True)
        mlm["distopt_diff"] = _max_abs_diff(_full_params(model), full)
        mlm["distopt_loss"] = (_step(model, opt, cfg, PRETRAIN_STEPS), distopt_loss)
        model.close()
        # ...and load its weights only: the main shards follow the loaded weights.
        model, opt = _build("odc", cfg, seed=59)
        install_megatron_lm_checkpointing(model, opt)
        _mlm_load(model, opt, distopt_dir, load_optim=False)
        mlm["weights_only_diff"] = _max_abs_diff(_full_params(model), full)
        mlm["weights_only_mains"] = _mains_equal_model_shards(model, opt)
        out["mlm"] = mlm
        model.close()
        out["half_precision"] = _half_precision_resumes(root_path)

        # A model of another hidden size must be refused, naming the tensor.
        bad, bad_opt = _build("odc", _cfg(hidden_size=48), seed=11)
        try:
            load_checkpoint(root_path / "odc_dp2", bad, bad_opt)
            out["bad"] = None
        except ValueError as exc:
            out["bad"] = str(exc)
        bad.close()
        out["latest_missing"] = latest_iteration(root_path / "nowhere")
        out["box_problems"] = _check_flat_range_boxes() if rank == 0 else []
        dist.barrier()
        return out
    finally:
        teardown_megatron()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    results = run_ranks(_run_pretrain_and_resume, 2, str(root), timeout_s=300, pg_timeout_s=120)
    return root, results


def test_odc_resume_is_exact(pretrained) -> None:
    _, results = pretrained
    for rank, res in enumerate(results):
        odc = res["odc"]
        assert odc["iteration"] == 2
        assert odc["latest"] == 2
        assert odc["extra_rank"] == rank
        assert odc["extra_rng_equal"]
        assert odc["before_diff"][0] > 0, "the fresh model must start from other weights"
        assert odc["loaded_diff"][0] == 0.0, (
            f"rank {rank}: loaded weights differ: {odc['loaded_diff']}"
        )
        for step, (got, want) in enumerate(zip(odc["losses"], odc["ref_losses"])):
            assert abs(got - want) <= 1e-6 * abs(want), f"rank {rank} step {step}: {got} vs {want}"
        # fp32 main shards, Adam moments and step counts come back bit for bit...
        assert odc["optimizer_nonzero"], f"rank {rank}: no Adam state to compare"
        assert odc["optimizer_equal"], f"rank {rank}: loaded optimizer state differs"
        # ...so the trajectories coincide (up to the order in which peers' pushes are summed).
        assert odc["final_diff"][0] <= 1e-6, f"rank {rank}: final params differ {odc['final_diff']}"
        ft = res["finetune"]
        assert ft["ret"] == (0, {})
        assert ft["diff"][0] == 0.0


def test_megatron_lm_checkpointing_path(pretrained) -> None:
    """Megatron-LM's own save / load calls on the ODC overrides: exact resume and interop."""
    _, results = pretrained
    for rank, res in enumerate(results):
        odc, mlm = res["odc"], res["mlm"]
        assert mlm["iteration"] == 2
        assert mlm["loaded_diff"][0] == 0.0, (
            f"rank {rank}: loaded weights differ {mlm['loaded_diff']}"
        )
        assert mlm["optimizer_equal"], f"rank {rank}: loaded optimizer state differs"
        for step, (got, want) in enumerate(zip(mlm["losses"], odc["ref_losses"])):
            assert abs(got - want) <= 1e-6 * abs(want), f"rank {rank} step {step}: {got} vs {want}"
        assert mlm["final_diff"][0] <= 1e-6, f"rank {rank}: final params differ {mlm['final_diff']}"
        assert mlm["distopt_iteration"] == PRETRAIN_STEPS
        assert mlm["distopt_diff"][0] == 0.0, f"rank {rank}: {mlm['distopt_diff']}"
        got, want = mlm["distopt_loss"]
        assert abs(got - want) <= 1e-6 * abs(want), f"rank {rank}: {got} vs distopt's {want}"
        assert mlm["weights_only_diff"][0] == 0.0, f"rank {rank}: {mlm['weights_only_diff']}"
        assert mlm["weights_only_mains"], f"rank {rank}: main shards not refreshed from the weights"


@pytest.mark.parametrize("path", ["entry", "mlm"])
def test_bf16_resume_keeps_the_fp32_masters(pretrained, path) -> None:
    """Issue 37, item 1: through the plugin's load and Megatron-LM's load order, a bf16 resume
    continues bit for bit: fp32 masters (not the bf16 weights upcast), Adam moments, losses, weights."""
    _, results = pretrained
    for rank, res in enumerate(results):
        got = res["half_precision"][path]
        assert got["masters_not_weights"], f"rank {rank}: the masters are bf16 values (no oracle)"
        assert got["masters_equal"], f"rank {rank}: loaded fp32 masters or moments differ"
        assert got["losses_equal"], f"rank {rank}: the next losses differ"
        assert got["final_equal"], f"rank {rank}: weights differ after the resumed steps"
        assert got["final_optimizer_equal"], f"rank {rank}: optimizer state differs at the end"


def test_incompatible_checkpoint_names_the_tensor(pretrained) -> None:
    _, results = pretrained
    for res in results:
        assert res["bad"] is not None, "loading a hidden-size-48 model from a 40 checkpoint passed"
        assert "embedding.word_embeddings.weight" in res["bad"] or "decoder." in res["bad"]
        assert "(96, 40)" in res["bad"] or "40" in res["bad"]
    # Ranks hold different shards; every rank names the same tensor, so the job prints one line.
    assert len({res["bad"] for res in results}) == 1, [res["bad"] for res in results]


def test_tracker_and_layout(pretrained) -> None:
    root, results = pretrained
    assert (root / "distopt" / TRACKER).read_text().strip() == str(PRETRAIN_STEPS)
    assert sorted(p.name for p in (root / "odc_dp2").iterdir()) == ["iter_0000002", TRACKER]
    assert sorted(p.name for p in (root / "odc_dp2" / "iter_0000002").glob("extra_state_*")) == [
        "extra_state_rank0.pt",
        "extra_state_rank1.pt",
    ]
    assert results[0]["latest_missing"] is None


def test_flat_range_boxes_tile_the_range(pretrained) -> None:
    _, results = pretrained
    assert results[0]["box_problems"] == []


# ---------------------------------------------------------------------------------------- world B


def _run_interop(rank, world_size, root: str, killed_root: str):
    import torch.distributed as dist

    from megatron_odc.runner.checkpoint import latest_iteration, load_checkpoint, save_checkpoint
    from tests._megatron import init_megatron, teardown_megatron

    _allow_writer_processes()
    root_path = Path(root)
    out: dict = {}
    cfg = _cfg()
    init_megatron(2, seed=5)
    try:
        # distopt TP=1 x DP=2 -> ODC TP=2 x DP=2, finetune; train; save.
        model, opt = _build("odc", cfg, seed=31)
        ret = load_checkpoint(root_path / "distopt", model, opt, finetune=True)
        want = torch.load(root_path / "distopt_params.pt")
        out["distopt_to_odc"] = {"ret": ret, "diff": _max_abs_diff(_full_params(model), want)}
        out["odc_tp2_losses"] = [_step(model, opt, cfg, step) for step in range(FINETUNE_STEPS)]
        save_checkpoint(root_path / "odc_tp2", FINETUNE_STEPS, model, opt, extra_state={"r": rank})
        odc_tp2_params = _full_params(model)
        model.close()

        # distopt -> ODC TP=2 with its fully-reshardable optimizer state: continue where it stopped.
        model, opt = _build("odc", cfg, seed=43)
        iteration, _ = load_checkpoint(root_path / "distopt", model, opt)
        ref = torch.load(root_path / "distopt_next.pt")
        out["distopt_resume"] = {
            "iteration": iteration,
            "diff": _max_abs_diff(_full_params(model), want),
            "loss": _step(model, opt, cfg, PRETRAIN_STEPS),
            "ref_loss": ref["loss"],
        }
        out["distopt_resume"]["next_diff"] = _max_abs_diff(_full_params(model), ref["params"])
        model.close()
    finally:
        teardown_megatron()

    init_megatron(1, seed=5)
    try:
        # ODC TP=2 x DP=2 -> megatron DDP TP=1 x DP=4, finetune.
        model, opt = _build("ddp", cfg, seed=37)
        load_checkpoint(root_path / "odc_tp2", model, opt, finetune=True)
        out["odc_to_ddp"] = _max_abs_diff(_full_params(model), odc_tp2_params)
        out["ddp_loss"] = _step(model, opt, cfg, 7)

        # ODC DP=2 -> ODC DP=4: weights and optimizer state land in the new owners' slices.
        model, opt = _build("odc", cfg, seed=41)
        iteration, extra = load_checkpoint(root_path / "odc_dp2", model, opt)
        out["dp2_to_dp4"] = {
            "iteration": iteration,
            "extra": extra["rank"],
            "diff": _max_abs_diff(_full_params(model), torch.load(root_path / "odc_dp2_params.pt")),
            "checksums": _optimizer_checksums(model, opt),
        }
        out["dp4_loss"] = _step(model, opt, cfg, 2)

        # The checkpoint a killed save left behind loads in this fresh world (into the same model).
        iteration, extra = load_checkpoint(killed_root, model, opt)
        out["after_kill"] = {
            "latest": latest_iteration(killed_root),
            "iteration": iteration,
            "extra": extra,
            "diff": _max_abs_diff(
                _full_params(model), torch.load(Path(killed_root) / "params_1.pt")
            ),
        }
        model.close()
        dist.barrier()
        return out
    finally:
        teardown_megatron()


def test_interop_and_resharding(pretrained, killed) -> None:
    root, _ = pretrained
    results = run_ranks(_run_interop, 4, str(root), str(killed), timeout_s=300, pg_timeout_s=120)
    want_checksums = torch.load(root / "odc_dp2_optimizer.pt")
    for rank, res in enumerate(results):
        d2o = res["distopt_to_odc"]
        assert d2o["ret"] == (0, {})
        assert d2o["diff"][0] == 0.0, (
            f"rank {rank}: distopt -> ODC TP=2 weights differ {d2o['diff']}"
        )
        assert all(torch.isfinite(torch.tensor(res["odc_tp2_losses"])))
        resume = res["distopt_resume"]
        assert resume["iteration"] == PRETRAIN_STEPS
        assert resume["diff"][0] == 0.0
        got, want = resume["loss"], resume["ref_loss"]
        assert abs(got - want) <= 1e-5 * abs(want), f"rank {rank}: {got} vs {want}"
        # One Adam step from the loaded moments lands where distopt's own next step did (TP=2 vs
        # TP=1 rounding only); zero or misplaced moments would move the weights by ~lr.
        assert resume["next_diff"][0] <= 1e-5, f"rank {rank}: {resume['next_diff']}"
        assert res["odc_to_ddp"][0] == 0.0, (
            f"rank {rank}: ODC -> DDP weights differ {res['odc_to_ddp']}"
        )
        assert torch.isfinite(torch.tensor(res["ddp_loss"]))
        d24 = res["dp2_to_dp4"]
        assert d24["iteration"] == 2
        assert d24["extra"] == 0, "another world size gets rank 0's extra state"
        assert d24["diff"][0] == 0.0, f"rank {rank}: DP=2 -> DP=4 weights differ {d24['diff']}"
        assert sorted(d24["checksums"]) == sorted(want_checksums)
        for name, got in d24["checksums"].items():
            want = want_checksums[name]
            assert torch.allclose(got, want, rtol=1e-9, atol=0.0), f"{name}: {got} vs {want}"
        assert torch.isfinite(torch.tensor(res["dp4_loss"]))
        kill = res["after_kill"]
        assert kill["latest"] == 1
        assert kill["iteration"] == 1
        assert kill["extra"] == {"r": 0}, "4 ranks load a 2-rank checkpoint: rank 0's extra state"
        assert kill["diff"][0] == 0.0, f"rank {rank}: weights of iteration 1 differ {kill['diff']}"


# ---------------------------------------------------------------------------------------- kill


def _run_kill(rank, world_size, root: str):
    import megatron_odc.runner.checkpoint as ckpt
    from tests._megatron import init_megatron, teardown_megatron

    _allow_writer_processes()
    init_megatron(1, seed=5)
    try:
        cfg = _cfg()
        model, opt = _build("odc", cfg, seed=11)
        _step(model, opt, cfg, 0)
        ckpt.save_checkpoint(root, 1, model, opt, extra_state={"r": rank})
        if rank == 0:
            torch.save(_full_params(model), Path(root) / "params_1.pt")
        else:
            _full_params(model)
        _step(model, opt, cfg, 1)
        original = ckpt._save_sharded

        def dying_save(state, checkpoint_dir, model):
            original(state, checkpoint_dir, model)  # every rank has written its shards...
            if rank == 1:
                _stop_writer_manager()
                os._exit(17)  # ...but rank 1 dies before the barrier and the rename

        ckpt._save_sharded = dying_save
        ckpt.save_checkpoint(root, 2, model, opt, extra_state={"r": rank})
        return "survived"
    finally:
        teardown_megatron()


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A checkpoint root where iteration 1 completed and a rank died inside the save of iteration 2."""
    root = tmp_path_factory.mktemp("killed") / "ckpt"
    with pytest.raises(RankFailureError, match=r"rank 1 died with exit code 17"):
        run_ranks(_run_kill, 2, str(root), timeout_s=200, pg_timeout_s=20)
    return root


def test_kill_during_save_keeps_previous_checkpoint(killed) -> None:
    assert (killed / TRACKER).read_text().strip() == "1"
    assert (killed / "iter_0000001" / "metadata.json").is_file()
    assert not (killed / "iter_0000002").exists()
    leftovers = [p.name for p in killed.iterdir() if p.name.startswith("iter_0000002.tmp-")]
    assert len(leftovers) == 1, "the interrupted save wrote into its temporary directory"
    # Loading it in a fresh world is checked by test_interop_and_resharding (4 ranks).


# ------------------------------------------------------------------------- full resume across backends

FULL_RESUME_PAIRS = [
    ("odc", "ddp"),
    ("odc", "distopt"),
    ("ddp", "odc"),
    ("distopt", "odc"),
    ("distopt", "distopt"),
]
SAVE_AT, RESUMED_TO = 3, 5  # backend A trains and saves SAVE_AT steps; B resumes to RESUMED_TO
ENTRY_FLAGS = [
    *("--log-interval", "1", "--global-batch-size", "8", "--synthetic-num-samples", "64"),
    *("--train-iters", str(RESUMED_TO), "--lr-warmup-iters", "1", "--weight-decay", "0.1"),
]
"""Plugin-entry flags of every run: weight decay on (two param groups, ``wd_mult`` 0 and 1) and every
step moving the weights (one warmup step)."""


def _entry(argv: list[str]):
    from megatron_odc.runner.arguments import build_parser, validate_args
    from megatron_odc.train import run

    return run(validate_args(build_parser().parse_args([*ENTRY_FLAGS, *argv]), world_size=2))


def _checkpoint_tensors(
    checkpoint_dir: Path, *, mains: bool
) -> tuple[dict[str, torch.Tensor], int]:
    """The model weights (or, with ``mains``, the fp32 main parameters instead) and Adam moments of a
    torch_dist checkpoint as full fp32 tensors, and its step.

    Mains are DistOpt's / ODC's ``optimizer.state.param`` and megatron-core's Float16 optimizer's
    ``optimizer.state.fp32_param`` (returned as ``param``); with bf16 weights they are what to compare,
    the weights being their rounding.
    """
    from megatron.core import dist_checkpointing

    from megatron_odc.mcore.dist_ckpt.optimizer_state import megatron_common_as_distopt

    tensors = {}
    for key, value in dist_checkpointing.load_plain_tensors(str(checkpoint_dir)).items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        kind = key.split(".")[2] if key.startswith("optimizer.") else "weights"
        if kind == "fp32_param":
            key, kind = key.replace(".fp32_param.", ".param.", 1), "param"
        if kind in ("exp_avg", "exp_avg_sq") or kind == ("param" if mains else "weights"):
            tensors[key] = value.float()
    common = dist_checkpointing.load_common_state_dict(str(checkpoint_dir))
    distopt_common, _ = megatron_common_as_distopt(common["optimizer"])
    return tensors, int(distopt_common["optimizer"]["param_groups"][0]["step"])


def _max_diffs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per kind, the largest difference over its tensors: weights and mains (``param``) absolute
    (max|got - want|), Adam moments relative to each tensor's largest value (max|got - want| / max|want|).

    Weights are compared absolutely: a bias that started at zero holds only a few Adam updates, and
    Adam's normalised update amplifies the backends' fp32 rounding of tiny gradients (the uninterrupted
    runs of two backends differ by up to ~1e-4 of such a bias, ~2e-6 absolute).
    """
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    out: dict[str, float] = {}
    for key, value in want.items():
        kind = key.split(".")[2] if key.startswith("optimizer.") else "weights"
        diff = float((got[key] - value).abs().max())
        if kind not in ("weights", "param"):
            diff /= float(value.abs().max()) or 1.0
        out[kind] = max(out.get(kind, 0.0), diff)
    return out


def _run_full_resume(
    rank,
    world_size,
    workdir: str,
    pairs: list[tuple[str, str]],
    flags: list[str],
    stop_at: int,
    oracle: int,
):
    """For each pair (A, B): backend A saves after SAVE_AT steps, backend B resumes it (optimizer
    included), trains to ``stop_at`` and saves; each backend's uninterrupted run to ``stop_at`` saves
    too. The resumed run is compared with the uninterrupted run of ``pair[oracle]``."""
    del rank, world_size
    _allow_writer_processes()
    os.chdir(workdir)  # the generated SFT set goes under ./runs
    root = Path(workdir)
    final = f"iter_{stop_at:07d}"
    mains = "--bf16" in flags
    losses: dict[str, dict[int, float]] = {}

    def until(iteration: int, save_dir: Path) -> list[str]:
        interval = ("--save-interval", str(iteration), "--exit-interval", str(iteration))
        return [*flags, "--save", str(save_dir), *interval]

    for backend in sorted({b for pair in pairs for b in pair}):
        _entry(["--dp-backend", backend, *until(SAVE_AT, root / f"part_{backend}")])
        ref = _entry(["--dp-backend", backend, *until(stop_at, root / f"ref_{backend}")])
        losses[backend] = ref.losses
    out: dict = {"pairs": {}}
    for a, b in pairs:
        res_dir = root / f"resumed_{a}_{b}"
        load = ["--load", str(root / f"part_{a}")]
        result = _entry(["--dp-backend", b, *load, *until(stop_at, res_dir)])
        got, got_step = _checkpoint_tensors(res_dir / final, mains=mains)
        want, want_step = _checkpoint_tensors(root / f"ref_{(a, b)[oracle]}" / final, mains=mains)
        out["pairs"][(a, b)] = {
            "start": result.start_iteration,
            "losses": result.losses,
            "ref_losses": losses[(a, b)[oracle]],
            "steps": (got_step, want_step),
            "diffs": _max_diffs(got, want),
        }
    return out


@pytest.mark.parametrize(
    ("flags", "pairs", "stop_at", "oracle", "kinds"),
    [
        ([], FULL_RESUME_PAIRS, RESUMED_TO, 1, ["exp_avg", "exp_avg_sq", "weights"]),
        # bf16: two backends' runs drift apart by ~3e-3 in a few steps (bf16 weights one rounding
        # step apart feed Adam's normalised updates), so the oracle is A's own run one step after the
        # save: B's step from the loaded state differs from it by the gradient sums' order only.
        # megatron-core's Float16 optimizer keeps its mains as fp32_param; ODC and DistOpt as param.
        (
            ["--bf16"],
            [("odc", "ddp"), ("ddp", "odc")],
            SAVE_AT + 1,
            0,
            ["exp_avg", "exp_avg_sq", "param"],
        ),
    ],
    ids=["fp32", "bf16"],
)
def test_full_resume_across_backends(tmp_path, flags, pairs, stop_at, oracle, kinds) -> None:
    """An ODC checkpoint resumes under megatron-core's DDP and distributed optimizer with its Adam
    state, and theirs under ODC (issue 19), through ``python -m megatron_odc.train``'s run.

    Oracle: an uninterrupted run (fp32: backend B's, 2 steps after the resume; bf16: backend A's, 1
    step). The resumed run's losses, weights (bf16: fp32 mains) and moments equal it to fp32 rounding
    (backends sum in other orders); a resume that restarted Adam from zero moments and step 0 misses
    the weights by ~4e-3, the moments by ~100% and the step count (measured by zeroing them after
    the load).
    """
    results = run_ranks(
        _run_full_resume,
        2,
        str(tmp_path),
        pairs,
        flags,
        stop_at,
        oracle,
        timeout_s=400,
        pg_timeout_s=120,
    )
    for (a, b), res in results[0]["pairs"].items():
        assert res["start"] == SAVE_AT, (a, b)
        assert sorted(res["losses"]) == list(range(SAVE_AT + 1, stop_at + 1)), (a, b)
        for it, loss in res["losses"].items():
            assert loss == pytest.approx(res["ref_losses"][it], rel=1e-5, abs=0.0), (a, b, it)
        assert res["steps"] == (stop_at, stop_at), (a, b, res["steps"])
        assert sorted(res["diffs"]) == kinds, (a, b)
        for kind, diff in res["diffs"].items():
            assert diff <= 1e-5, f"{a} -> {b}: {kind} differ by {diff:.2e} ({res['diffs']})"


def test_a_damaged_checkpoint_is_one_error_naming_load_and_each_rank(tmp_path, monkeypatch) -> None:
    """A file that cannot be read (torch's CheckpointException, gathered over the ranks) or a
    metadata.json that does not parse becomes a ValueError naming --load, the iteration and each
    rank's error (measured before: six tracebacks, or a bare JSON message)."""
    import json

    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_odc.runner import checkpoint

    load = tmp_path / "ck"
    (load / "iter_0000002").mkdir(parents=True)
    (load / checkpoint.TRACKER_FILENAME).write_text("2")
    failures = {
        1: (RuntimeError("PytorchStreamReader failed reading zip archive\nmore text"), None),
        0: (EOFError(), None),
    }
    errors = {
        "read": CheckpointException("load", failures),
        "json": json.JSONDecodeError("Expecting value", "", 0),
    }
    for kind, error in errors.items():

        def damaged(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(checkpoint.dist_ckpt, "load", damaged)
        with pytest.raises(ValueError) as refused:
            checkpoint.load_checkpoint(load, torch.nn.Linear(2, 2), None)
        message = str(refused.value)
        assert message.startswith(f"--load {load}: "), message
        if kind == "read":
            assert "iteration 2 cannot be read (rank 0: EOFError; rank 1: RuntimeError: " in message
            assert "PytorchStreamReader failed reading zip archive)" in message
            assert "more text" not in message
        else:
            assert "metadata.json) does not parse (Expecting value" in message
