"""``postprocess_odc_args`` on Megatron-LM's parsed flags: what the ODC engine refuses stops the job at
parse time, naming the flag, before process groups or models are built (pure, no ranks)."""

from __future__ import annotations

import argparse
import re

import pytest

from megatron_odc.integration.megatron_lm.flags import add_odc_args, postprocess_odc_args


def _megatron_lm_args(backend: str, **given) -> argparse.Namespace:
    parser = add_odc_args(argparse.ArgumentParser())
    args = parser.parse_args(["--dp-backend", backend])
    megatron_defaults = {
        "micro_batch_size": 1,
        "dataloader_type": None,
        "seq_length": 64,
        "context_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "delay_wgrad_compute": False,
        "use_precision_aware_optimizer": False,
        "transformer_impl": "local",
    }
    for name, value in {**megatron_defaults, **given}.items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize(
    ("given", "flag"),
    [
        ({"context_parallel_size": 2}, "--context-parallel-size > 1"),
        ({"expert_model_parallel_size": 2}, "--expert-model-parallel-size > 1"),
        ({"delay_wgrad_compute": True}, "--delay-wgrad-compute"),
        ({"use_precision_aware_optimizer": True}, "--use-precision-aware-optimizer"),
    ],
)
@pytest.mark.parametrize("backend", ["odc", "fsdp"])
def test_the_odc_engine_refuses_at_parse_time(backend, given, flag) -> None:
    with pytest.raises(ValueError, match=f"--dp-backend {backend} does not combine with {flag}"):
        postprocess_odc_args(_megatron_lm_args(backend, **given))


@pytest.mark.parametrize("backend", ["ddp", "distopt"])
def test_megatron_backends_keep_those_features(backend) -> None:
    args = _megatron_lm_args(
        backend, context_parallel_size=2, expert_model_parallel_size=2, delay_wgrad_compute=True
    )
    assert postprocess_odc_args(args).use_distributed_optimizer == (backend == "distopt")


def test_defaults_pass_and_set_per_token_loss() -> None:
    args = postprocess_odc_args(_megatron_lm_args("odc"))
    assert args.calculate_per_token_loss
    assert args.balance == "lb_mini"
    args = postprocess_odc_args(_megatron_lm_args("odc", dataloader_type="cyclic"))
    assert args.balance == "none"  # Megatron-LM's sampler where its loader is not `single`


@pytest.mark.parametrize(
    ("given", "flag"),
    [
        ({"cuda_graph_impl": "full_iteration"}, "--cuda-graph-impl full_iteration"),
        ({"cuda_graph_impl": "local"}, "--cuda-graph-impl local"),
        ({"enable_cuda_graph": True}, "--enable-cuda-graph"),
        ({"external_cuda_graph": True}, "--external-cuda-graph"),
        ({"optimizer_cuda_graph": True}, "--optimizer-cuda-graph"),
        ({"optimizer": "muon"}, "--optimizer muon"),
        ({"optimizer": "dist_muon"}, "--optimizer dist_muon"),
        ({"use_layer_wise_distributed_optimizer": True}, "the layer-wise distributed optimizer"),
        ({"hybrid_context_parallel": True}, "--hybrid-context-parallel"),
        ({"save_wgrads_interval": 5}, "--save-wgrads-interval"),
        ({"optimizer_cpu_offload": True}, "--optimizer-cpu-offload"),
    ],
)
@pytest.mark.parametrize("backend", ["odc", "fsdp"])
def test_megatron_lm_contract_members_refused_by_name(backend, given, flag) -> None:
    """What megatron.training (core_v0.17.1-core_v0.19.0) would run with a static schedule, whole-matrix
    owners or main_grad on the wrapper is refused at parse time, in one line naming the flag."""
    from megatron_odc.integration.megatron_lm.flags import _refuse_after_validation

    with pytest.raises(
        ValueError, match=f"--dp-backend {backend} does not combine with {flag}"
    ) as e:
        postprocess_odc_args(_megatron_lm_args(backend, **given))
    assert "\n" not in str(e.value)
    # and again after validate_args, which derives some of them (deprecated flags, dist_muon)
    args = _megatron_lm_args(backend)
    args.virtual_pipeline_model_parallel_size = None
    for name, value in given.items():
        setattr(args, name, value)
    with pytest.raises(ValueError, match=f"does not combine with {flag}"):
        _refuse_after_validation(args)


@pytest.mark.parametrize("backend", ["ddp", "distopt"])
def test_megatron_lm_backends_keep_their_contract_members(backend) -> None:
    args = _megatron_lm_args(
        backend,
        cuda_graph_impl="full_iteration",
        optimizer="muon",
        optimizer_cuda_graph=True,
        save_wgrads_interval=5,
    )
    postprocess_odc_args(args)  # Megatron-LM's own backends decide for themselves


def test_defaults_of_every_tag_are_not_refused() -> None:
    args = _megatron_lm_args(
        "odc",
        cuda_graph_impl="none",
        enable_cuda_graph=False,
        optimizer="adam",
        optimizer_cuda_graph=False,
        use_layer_wise_distributed_optimizer=False,
        hybrid_context_parallel=False,
        save_wgrads_interval=None,
        optimizer_cpu_offload=False,
    )
    assert postprocess_odc_args(args).calculate_per_token_loss


def test_torch_fsdp2_refused_where_its_wrapper_fails_at_the_first_step(monkeypatch) -> None:
    """Megatron-LM's own ``--use-torch-fsdp2`` (no ``--dp-backend``) stops at parse time, in one line,
    where megatron-core's wrapper cannot take ``finalize_model_grads``' call, with or without per-token
    loss (whose missing gradient scaling the launcher supplies); a wrapper that takes it passes
    (classes patched to each case)."""
    import sys

    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel as Wrapper,
    )

    from megatron_odc.integration.megatron_lm.flags import wrap_parse_args

    def args(per_token: bool, fsdp2: bool = True) -> argparse.Namespace:
        return argparse.Namespace(use_torch_fsdp2=fsdp2, calculate_per_token_loss=per_token)

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    given: list[argparse.Namespace] = []
    parse_args = wrap_parse_args(lambda provider, ignore_unknown: given.pop())

    def parsed(namespace: argparse.Namespace) -> argparse.Namespace:
        given.append(namespace)
        return parse_args()

    monkeypatch.setattr(Wrapper, "finish_grad_sync", lambda self: None)  # megatron-core <= 0.18
    for per_token in (False, True):
        with pytest.raises(
            ValueError, match=r"--use-torch-fsdp2: .*takes no force_all_reduce"
        ) as fails:
            parsed(args(per_token=per_token))
        assert str(fails.value).endswith("or run core_v0.19.0 with megatron-core 0.19")
        assert "\n" not in str(fails.value)
        assert "Drop --use-torch-fsdp2 and use --dp-backend odc" in str(fails.value)
    assert parsed(args(per_token=True, fsdp2=False)).calculate_per_token_loss  # not asked for

    monkeypatch.setattr(Wrapper, "finish_grad_sync", lambda self, force_all_reduce=False: None)
    for per_token in (False, True):
        namespace = args(per_token=per_token)
        assert parsed(namespace) is namespace


@pytest.mark.parametrize(
    ("backend", "balance"), [("odc", "lb_mini"), ("ddp", "lb_micro"), ("distopt", "lb_micro")]
)
@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"dataloader_type": "cyclic"}, "needs --dataloader-type single (got cyclic)"),
        ({"micro_batch_size": 2}, "needs --micro-batch-size 1 (got 2)"),
        ({"rampup_batch_size": [2, 2, 100]}, "--rampup-batch-size 2 2 100 with --balance"),
    ],
)
def test_what_the_balanced_loader_cannot_serve_is_refused_for_every_backend(
    backend, balance, given, says
) -> None:
    """Megatron-LM's own DDP on the balanced loader (the packing baseline) gets the loader's refusals
    too: a cyclic loader type used to be dropped silently (sequential order instead of its shuffle),
    and ramp-up batches were planned as full ones."""
    args = _megatron_lm_args(backend, **given)
    args.balance = balance
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        postprocess_odc_args(args)
    assert "\n" not in str(e.value)
    args = _megatron_lm_args(backend, **given)
    args.balance = "none"  # Megatron-LM's sampler serves them all
    postprocess_odc_args(args)


@pytest.mark.parametrize(("backend", "balance"), [("odc", "lb_mini"), ("ddp", "lb_micro")])
def test_skipped_iterations_are_refused_under_the_balanced_loader(backend, balance) -> None:
    """validate_args adds the rerun tracker file's iterations to --iterations-to-skip; Megatron-LM's
    skip step reads global-batch-size / DP microbatches per rank, which per-rank plans cannot give."""
    from megatron_odc.integration.megatron_lm.flags import _refuse_after_validation

    args = _megatron_lm_args(backend)
    args.balance = balance
    postprocess_odc_args(args)
    args.virtual_pipeline_model_parallel_size = None
    args.iterations_to_skip = []
    _refuse_after_validation(args)
    args.iterations_to_skip = [3, 7]
    with pytest.raises(ValueError, match="--iterations-to-skip 3 7 .* and --balance " + balance):
        _refuse_after_validation(args)
    args.balance = "none"
    _refuse_after_validation(args)


@pytest.mark.parametrize("stages", [2, 3])
def test_sft_packing_beyond_two_stages_needs_a_tag_that_gives_middle_stages_cu_seqlens(
    stages,
) -> None:
    """core_v0.16.1's pretrain_gpt.py gives middle pipeline stages no packed-sequence parameters:
    records packed together would attend to each other there. Refused on that tag only."""
    from megatron_odc.integration.megatron_lm.version import installed_megatron_lm_release

    release = installed_megatron_lm_release()
    args = _megatron_lm_args("odc", sft=True, pipeline_model_parallel_size=stages)
    args.max_tokens_per_microbatch = None
    if stages > 2 and not release.sft_middle_stages_packed:
        with pytest.raises(ValueError, match=f"--pipeline-model-parallel-size 3 on {release.tag}"):
            postprocess_odc_args(args)
    else:
        postprocess_odc_args(args)
    args = _megatron_lm_args("odc", sft=True, pipeline_model_parallel_size=stages)
    args.balance = "none"
    postprocess_odc_args(args)


def test_moe_auxiliary_losses_under_the_balanced_loader_are_named_once(caplog) -> None:
    """MoE auxiliary losses are per microbatch: packing changes them, which one warning says."""
    args = _megatron_lm_args("odc", num_experts=4, moe_aux_loss_coeff=[0.01], moe_z_loss_coeff=None)
    with caplog.at_level("WARNING", logger="megatron_odc"):
        postprocess_odc_args(args)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    (message,) = warned
    assert "MoE auxiliary losses" in message
    assert "--balance lb_mini" in message
    caplog.clear()
    args = _megatron_lm_args("odc", num_experts=4, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    with caplog.at_level("WARNING", logger="megatron_odc"):
        postprocess_odc_args(args)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_megatron_lms_argument_assertions_become_one_line() -> None:
    """``validate_args`` refuses arguments with ``assert`` (a bare traceback through the launcher):
    the patched one names the message and where it was raised, as a ``ValueError`` the launcher
    prints in one line; with an empty message, the asserting line."""
    from megatron_odc.integration.megatron_lm.flags import wrap_validate_args

    def original(args, defaults={}):  # noqa: B006 - Megatron-LM's signature
        assert args.global_batch_size % 2 == 0, (
            f"global batch size ({args.global_batch_size}) is not divisible by micro batch size (1) "
            "times data parallel size (2)"
        )
        # a bare assert has no message (and pytest rewrites this file's asserts): the line counts
        if args.global_batch_size <= 0:
            raise AssertionError
        return args

    validate = wrap_validate_args(original)
    with pytest.raises(ValueError, match=r"refused the arguments: global batch size \(15\)") as e:
        validate(argparse.Namespace(global_batch_size=15))
    assert "(test_megatron_lm_flags.py line " in str(e.value)
    with pytest.raises(
        ValueError,
        match=r"arguments: raise AssertionError \(test_megatron_lm_flags\.py line \d+\)$",
    ):
        validate(argparse.Namespace(global_batch_size=-2))
    good = argparse.Namespace(global_batch_size=16)
    assert validate(good) is good
