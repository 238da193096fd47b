"""The release table (``megatron_odc/mcore/releases.py``) against the installed megatron-core, the version
refusal, and each contract member a newer release added, answered by ODC with megatron-core's meaning.

In-process: the installed release's row matches megatron-core (signatures, DDP and optimizer members);
ODC overrides every member of its row; the table is well formed and agrees with ``pyproject.toml`` and
``requirements.txt``; a version outside the range is refused in one line; the skip variable never
ends in an ``AttributeError``. One DP=2 world: ``get_grads_for_grad_norm`` returns exactly the owned,
counted gradients (their norm is ``get_grad_norm`` and megatron-core's DDP optimizer's), a separate norm
group is clipped by its own norm, ``free_overlap_buffers`` between minibatches (where Megatron-LM calls
it, before a save) leaves nothing fetched and changes no result, ``grad_norm_skip_threshold`` skips the update, and the param groups are
``get_megatron_optimizer``'s (no weight decay on biases: megatron-core 0.18+ moved that default).
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import pytest
import torch

from megatron_odc.mcore import releases
from megatron_odc.mcore.releases import (
    RELEASES,
    SKIP_VERSION_CHECK_ENV,
    SUPPORTED_RANGE,
    current_release,
    parse_version,
    release_for,
    signature_differences,
)
from tests._dist import run_ranks

ROOT = Path(__file__).resolve().parents[2]

INHERITED_OPTIMIZER_MEMBERS = {
    "get_parameters": "the inner optimizer's params are the owned pieces",
    "get_grad_stats_parallel_group": "returns grad_stats_parallel_group, which ODC sets",
    "scale_loss": "loss x get_loss_scale(), which ODC overrides",
    "offload_to_cpu": "moves the inner optimizer's per-piece state, which is ODC's whole state",
    "restore_from_cpu": "see offload_to_cpu",
}
"""``MegatronOptimizer`` members ``ODCOptimizer`` inherits on purpose: megatron-core's body already
means the right thing over the owned pieces."""


def _public_methods(cls: type) -> set[str]:
    return {n for n, m in vars(cls).items() if not n.startswith("_") and inspect.isfunction(m)}


# ---------------------------------------------------------------------- the table


def test_installed_release_matches_its_row() -> None:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    release = current_release()
    assert signature_differences(release) == []
    assert _public_methods(DistributedDataParallel) == set(release.ddp_members)
    assert _public_methods(MegatronOptimizer) == set(release.optimizer_members)


def test_odc_answers_every_member_of_the_installed_release() -> None:
    from megatron_odc.mcore.data_parallel import ODCDataParallel
    from megatron_odc.mcore.optimizer import ODCOptimizer

    release = current_release()
    assert [m for m in release.ddp_members if m not in vars(ODCDataParallel)] == []
    inherited = [m for m in release.optimizer_members if m not in vars(ODCOptimizer)]
    assert set(inherited) <= set(INHERITED_OPTIMIZER_MEMBERS), inherited
    # Every member any supported release has is ODC's own, so one class serves all of them.
    for release in RELEASES:
        assert set(release.ddp_members) <= set(vars(ODCDataParallel))
        assert set(release.optimizer_members) - set(vars(ODCOptimizer)) <= set(
            INHERITED_OPTIMIZER_MEMBERS
        )


def test_table_is_well_formed_and_every_shim_exists() -> None:
    from megatron_odc.integration.cpu import CPU_SHIMS

    series = [r.series for r in RELEASES]
    assert series == sorted(series)
    assert len(set(series)) == len(series)
    for release in RELEASES:
        assert release_for(release.tested) is release
        assert set(release.cpu_shims) <= set(CPU_SHIMS), release.name
        assert release.megatron_lm_tag.startswith(f"core_v{release.series[0]}.{release.series[1]}.")
    assert release_for(RELEASES[0].tested) is RELEASES[0]
    assert "current_stream" in RELEASES[-1].cpu_shims  # 0.19's start_grad_sync asks for it


def test_pyproject_and_requirements_state_the_range() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)\]$", pyproject, re.M | re.S).group(1)
    (mcore,) = re.findall(r'"(megatron-core[^"]*)"', dependencies)
    assert mcore.replace(" ", "") == f"megatron-core{SUPPORTED_RANGE}"
    # requirements.txt: the oldest row's tested release on Python 3.11, the newest row's on 3.12.
    text = (ROOT / "requirements.txt").read_text()
    pins = re.findall(r"^megatron-core==(\S+); python_version (\S+) \"(\S+)\"$", text, re.M)
    assert pins == [(RELEASES[0].tested, "<", "3.12"), (RELEASES[-1].tested, ">=", "3.12")]


# ---------------------------------------------------------------------- the version check


def test_parse_version() -> None:
    assert parse_version("0.19.2") == (0, 19, 2)
    assert parse_version("0.17.0rc1") == (0, 17, 0)
    assert parse_version("0.20.0.dev0+abc") == (0, 20, 0)
    assert parse_version("1.0") == (1, 0, 0)
    with pytest.raises(ValueError, match=r"not major\.minor"):
        parse_version("dev")
    assert release_for("0.16.0") is None
    assert release_for("0.16.1").series == (0, 16)
    assert release_for("0.19.9").series == (0, 19)
    assert release_for("0.20.0rc0") is None


@pytest.mark.parametrize("version", ["0.20.0", "0.15.3", "1.0.0", "0.16.0"])
def test_a_release_outside_the_range_is_refused_in_one_line(monkeypatch, version) -> None:
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", version)
    monkeypatch.delenv(SKIP_VERSION_CHECK_ENV, raising=False)
    with pytest.raises(ValueError) as info:
        current_release()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"megatron-core {version} is not supported")
    assert SUPPORTED_RANGE in message
    assert SKIP_VERSION_CHECK_ENV in message
    for release in RELEASES:
        assert release.name in message


@pytest.mark.parametrize(("version", "row"), [("0.20.1", -1), ("0.15.0", 0), ("garbage", -1)])
def test_the_skip_variable_never_ends_in_an_attribute_error(monkeypatch, version, row) -> None:
    """Under the skip variable: the nearest row; a shim whose megatron-core target is gone is skipped
    (named in ``skipped``), and revert leaves the module as it found it."""
    import megatron.core.tensor_parallel.random as mcore_random
    from megatron.core import package_info

    from megatron_odc.integration.cpu import apply_cpu_patches

    monkeypatch.setattr(package_info, "__version__", version)
    monkeypatch.setenv(SKIP_VERSION_CHECK_ENV, "1")
    if version == "garbage":
        with pytest.raises(ValueError, match=r"not major\.minor"):  # one line, not AttributeError
            current_release()
        return
    assert current_release() is RELEASES[row]
    monkeypatch.delattr(mcore_random, "_get_cuda_rng_state")
    with apply_cpu_patches() as handle:
        assert handle.skipped == ["megatron.core.tensor_parallel.random._get_cuda_rng_state"]
        assert torch.cuda.current_device() == "cpu"
        assert set(RELEASES[row].cpu_shims)  # every other shim applied
    assert not hasattr(mcore_random, "_get_cuda_rng_state")


def test_the_training_entry_refuses_before_training(monkeypatch) -> None:
    """``cpu_runtime`` (what ``python -m megatron_odc.train`` trains inside) checks first, also where
    CUDA is present."""
    from megatron.core import package_info

    from megatron_odc.integration.cpu import active_cpu_patches, cpu_runtime

    monkeypatch.setattr(package_info, "__version__", "0.21.0")
    monkeypatch.delenv(SKIP_VERSION_CHECK_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=re.escape(SUPPORTED_RANGE)), cpu_runtime():
        pytest.fail("the block ran")
    assert active_cpu_patches() is None


def test_unknown_shim_names_and_changed_signatures_are_reported() -> None:
    release = current_release()
    fake = releases.Release(
        series=release.series,
        tested=release.tested,
        python="",
        megatron_lm_tag=release.megatron_lm_tag,
        cpu_shims=(),
        ddp_members=(),
        optimizer_members=(),
        signatures={
            "megatron.core.optimizer:_get_param_groups": ("model_chunks",),
            "megatron.core.optimizer:no_such_function": (),
        },
    )
    problems = signature_differences(fake)
    assert len(problems) == 2
    assert "expects ('model_chunks',)" in problems[0]
    assert "no_such_function is missing" in problems[1]


# ---------------------------------------------------------------------- the contract, on DP=2


def _optimizer_config(cfg, **overrides):
    from megatron.core.optimizer import OptimizerConfig

    kw = {
        "optimizer": "adam",
        "lr": 1e-2,
        "weight_decay": 0.1,
        "clip_grad": 0.0,
        "bf16": cfg.bf16,
        "fp16": cfg.fp16,
        "params_dtype": cfg.params_dtype,
    }
    kw.update(overrides)
    return OptimizerConfig(**kw)


def _run_contract(rank: int, world_size: int) -> dict:
    import dataclasses

    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.config import ODCConfig
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from megatron_odc.mcore.step import gpt_forward_step, train_step
    from tests._megatron import SMALL_GPT, init_megatron, make_batch, teardown_megatron

    cfg = GPTConfig(**SMALL_GPT)
    out: dict = {}

    def batches(step: int) -> list:
        return [make_batch(cfg, 1, seed=100 * step + 10 * rank + i) for i in range(1 + rank)]

    def wd_mults(opt) -> list[float]:
        return sorted(g["wd_mult"] for g in opt.param_groups if g["params"])

    def params(model) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}

    init_megatron(1, seed=3)
    try:
        # megatron-core's DDP: the reference grad norm and param groups.
        ddp, ddp_opt = build_backend("ddp", build_gpt_model(cfg, seed=7), _optimizer_config(cfg))
        ddp_report = train_step(ddp, ddp_opt, gpt_forward_step, batches(0), seq_length=12)
        out["ddp_grad_norm"] = float(ddp_report["grad_norm"])
        out["ddp_wd_mults"] = wd_mults(ddp_opt)

        model, opt = build_backend("odc", build_gpt_model(cfg, seed=7), _optimizer_config(cfg))
        out["odc_wd_mults"] = wd_mults(opt)
        report = train_step(model, opt, gpt_forward_step, batches(0), seq_length=12)
        out["odc_grad_norm"] = float(report["grad_norm"])
        # get_grads_for_grad_norm after a minibatch: exactly the owned, counted gradients.
        model.zero_grad_buffer()
        train_step_grads = opt.get_grads_for_grad_norm()
        owned = [p.main.grad for p in opt.pieces if p.counted_in_norm]
        out["grads_are_owned"] = len(train_step_grads) == len(owned) and all(
            a is b for a, b in zip(train_step_grads, owned)
        )
        out["main_grads_alias"] = all(
            a is b for a, b in zip(opt.get_main_grads_for_grad_norm(), train_step_grads)
        )
        out["no_mtp_group"] = (opt.get_grads_for_grad_norm("mtp"), opt.has_grad_norm_group("mtp"))
        opt.prepare_model_params_for_param_sync()
        model.reset_param_sync_dispatch_state()
        model.finish_grad_sync()
        opt.step()

        # free_overlap_buffers between minibatches (Megatron-LM: before each save) is harmless.
        # Fixed-order sums: the two runs are compared bit for bit (arrival order would differ).
        same_sums = ODCConfig(deterministic=True)
        twin, twin_opt = build_backend(
            "odc", build_gpt_model(cfg, seed=7), _optimizer_config(cfg), odc_config=same_sums
        )
        for step in (1, 2):
            train_step(twin, twin_opt, gpt_forward_step, batches(step), seq_length=12)
            twin.free_overlap_buffers()
        fetched_after = sum(
            twin.engine.unit_state(u).name != "SHARDED" for u in twin.engine.layout.units
        )
        out["held_after_free"] = fetched_after
        model2, opt2 = build_backend(
            "odc", build_gpt_model(cfg, seed=7), _optimizer_config(cfg), odc_config=same_sums
        )
        for step in (1, 2):
            train_step(model2, opt2, gpt_forward_step, batches(step), seq_length=12)
        out["free_changes_nothing"] = all(
            torch.equal(a, b) for a, b in zip(params(twin).values(), params(model2).values())
        )
        for m in (twin, model2, model, ddp):
            if hasattr(m, "close"):
                m.close()

        # A separate norm group (as megatron-core 0.19 tags MTP's parameters): clipped by its own
        # norm, left out of the main norm.
        gpt = build_gpt_model(cfg, seed=7)
        tagged = [n for n, p in gpt.named_parameters() if "layers.1." in n]
        for name, param in gpt.named_parameters():
            if name in tagged:
                param.grad_norm_group = "mtp"
        grouped, gopt = build_backend("odc", gpt, _optimizer_config(cfg, clip_grad=1e-3))
        out["has_group"] = gopt.has_grad_norm_group("mtp")
        grouped.zero_grad_buffer()
        for batch in batches(0):
            output, loss_func = gpt_forward_step(iter([batch]), grouped)
            loss_sum, _, _ = loss_func(output)
            loss_sum.backward()
        grouped.finish_grad_sync()

        def norm(grads) -> float:
            total = torch.zeros(1, dtype=torch.float64)
            for g in grads:
                total += g.double().pow(2).sum()
            torch.distributed.all_reduce(total)
            return math.sqrt(float(total))

        main_norm = norm(gopt.get_grads_for_grad_norm())
        group_norm = norm(gopt.get_grads_for_grad_norm("mtp"))
        returned = gopt.clip_grad_norm(1e-3)
        out["group_norms"] = (main_norm, group_norm, returned, gopt.grad_norms_by_group["mtp"])
        out["clipped"] = (
            norm(gopt.get_grads_for_grad_norm()),
            norm(gopt.get_grads_for_grad_norm("mtp")),
        )
        grouped.close()

        # grad_norm_skip_threshold (OptimizerConfig 0.18+): the update is skipped, the fence still
        # ends the minibatch, and the next step trains.
        from megatron.core.optimizer import OptimizerConfig

        if "grad_norm_skip_threshold" in {f.name for f in dataclasses.fields(OptimizerConfig)}:
            skip, skip_opt = build_backend(
                "odc",
                build_gpt_model(cfg, seed=7),
                _optimizer_config(cfg, grad_norm_skip_threshold=1e-9),
            )
            before = params(skip)
            first = train_step(skip, skip_opt, gpt_forward_step, batches(0), seq_length=12)
            out["skipped"] = (
                first["update_successful"],
                all(torch.equal(a, b) for a, b in zip(before.values(), params(skip).values())),
            )
            skip_opt.config.grad_norm_skip_threshold = math.inf
            second = train_step(skip, skip_opt, gpt_forward_step, batches(1), seq_length=12)
            out["skipped_then_trained"] = second["update_successful"]
            skip.close()
    finally:
        teardown_megatron()
    return out


@pytest.fixture(scope="module")
def contract() -> list[dict]:
    return run_ranks(_run_contract, 2, timeout_s=300, pg_timeout_s=60)


def test_get_grads_for_grad_norm_returns_the_owned_counted_grads(contract) -> None:
    for out in contract:
        assert out["grads_are_owned"]
        assert out["main_grads_alias"]
        assert out["no_mtp_group"] == ([], False)
    # The norm over them is megatron-core DDP's grad norm of the same minibatch.
    assert contract[0]["odc_grad_norm"] == pytest.approx(contract[0]["ddp_grad_norm"], rel=1e-5)


def test_param_groups_are_get_megatron_optimizers(contract) -> None:
    """No weight decay on biases and 1-D params (megatron-core 0.18+ applies that default only in
    ``get_megatron_optimizer``; without it ODC decayed the norms)."""
    for out in contract:
        assert out["odc_wd_mults"] == out["ddp_wd_mults"] == [0.0, 1.0]


def test_a_separate_norm_group_is_clipped_by_its_own_norm(contract) -> None:
    for out in contract:
        assert out["has_group"]
        main_norm, group_norm, returned, recorded = out["group_norms"]
        assert main_norm > 0
        assert group_norm > 0
        assert returned == pytest.approx(main_norm, rel=1e-6)
        assert recorded == pytest.approx(group_norm, rel=1e-6)
        # Each group was scaled to the clip value by its own norm.
        assert out["clipped"][0] == pytest.approx(1e-3, rel=1e-3)
        assert out["clipped"][1] == pytest.approx(1e-3, rel=1e-3)


def test_free_overlap_buffers_is_safe(contract) -> None:
    for out in contract:
        assert out["held_after_free"] == 0
        assert out["free_changes_nothing"]


def test_grad_norm_skip_threshold_skips_the_update(contract) -> None:
    from megatron.core.optimizer import OptimizerConfig

    if not hasattr(OptimizerConfig, "grad_norm_skip_threshold"):
        pytest.skip("OptimizerConfig.grad_norm_skip_threshold is megatron-core 0.18+")
    for out in contract:
        assert out["skipped"] == (False, True)
        assert out["skipped_then_trained"]


def test_quiet_notices_drop_only_the_named_notice_inside_the_block(caplog) -> None:
    import logging

    from megatron_odc.mcore.releases import quiet_notices

    newest = RELEASES[-1]
    name, start = newest.quiet_notices[0]
    log = logging.getLogger(name)
    with caplog.at_level(logging.WARNING, logger=name):
        with quiet_notices(newest):
            log.warning("%s. use HybridModel", start)
            log.warning("another warning")
        log.warning("%s. after the block", start)
    messages = [r.getMessage() for r in caplog.records if r.name == name]
    assert messages == ["another warning", f"{start}. after the block"]
    assert log.filters == []
