"""``postprocess_odc_args`` on Megatron-LM's parsed flags: what the ODC engine refuses stops the job at
parse time, naming the flag, before process groups or models are built (pure, no ranks)."""

from __future__ import annotations

import argparse

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
