"""``mcore/config.py``: ODCConfig's checks, and every refusal of the table, for each backend (no process group)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_odc.mcore.config import (
    BACKENDS,
    ODC_ENGINE_BACKENDS,
    UNSUPPORTED,
    ODCConfig,
    refuse_unsupported,
)
from megatron_odc.transport import TRANSPORT_CHOICES


def test_defaults_are_valid_and_frozen() -> None:
    config = ODCConfig()
    assert config.transport == "auto"
    assert config.transport in TRANSPORT_CHOICES
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bucket_size = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        ODCConfig("shm")  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"transport": "nccl"}, "--odc-transport 'nccl' is not one of auto"),
        ({"cuda_accumulate": "fast"}, "--odc-cuda-accumulate 'fast'"),
        ({"bucket_size": 0}, "--odc-bucket-size must be a number > 0"),
        ({"bucket_size": 2.5}, "--odc-bucket-size must be an integer"),
        ({"alignment": True}, "--odc-alignment must be a number > 0"),
        ({"pushes_in_flight": -1}, "--odc-pushes-in-flight must be a number > 0"),
        ({"timeout_s": 0.0}, "--odc-timeout-s must be a number > 0"),
        ({"prefetch": "no"}, "--odc-prefetch must be True or False"),
        ({"check_params_equal": 1}, "--odc-check-params-equal must be True or False"),
    ],
)
def test_each_bad_value_is_refused_naming_its_flag(kwargs, flag) -> None:
    with pytest.raises(ValueError, match=flag):
        ODCConfig(**kwargs)


def test_from_args_takes_only_what_was_set() -> None:
    args = argparse.Namespace(odc_bucket_size=123, odc_transport=None, odc_prefetch=False, other=1)
    config = ODCConfig.from_args(args)
    assert config == ODCConfig(bucket_size=123, prefetch=False)
    assert ODCConfig.from_args(argparse.Namespace()) == ODCConfig()
    with pytest.raises(ValueError, match="--odc-bucket-size"):
        ODCConfig.from_args(argparse.Namespace(odc_bucket_size=-4))


def test_every_refusal_names_backend_and_flag_and_spares_the_others() -> None:
    for key, rule in UNSUPPORTED.items():
        assert rule.backends, key
        assert set(rule.backends) <= set(BACKENDS), key
        on = 2 if key.endswith("_size") else True
        for backend in BACKENDS:
            if backend in rule.backends:
                with pytest.raises(ValueError) as info:
                    refuse_unsupported(backend, **{key: on})
                assert f"--dp-backend {backend} does not combine with {rule.flag}" in str(
                    info.value
                )
            else:
                refuse_unsupported(backend, **{key: on})
            # Off (including a size of 1 and None) is never refused.
            refuse_unsupported(backend, **{key: 1 if key.endswith("_size") else False})
            refuse_unsupported(backend, **{key: None})


def test_pipeline_stages_are_not_refused_but_virtual_stages_are() -> None:
    """Every entry runs megatron-core's 1F1B with ODC (``test_pipeline.py``, the Megatron-LM launcher's
    ``test_pretrain_gpt_pipeline_odc_equals_ddp``); the interleaved schedule is refused by name."""
    assert "pipeline_model_parallel_size" not in UNSUPPORTED
    for backend in ODC_ENGINE_BACKENDS:
        with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage"):
            refuse_unsupported(backend, virtual_pipeline_model_parallel_size=2)
    refuse_unsupported("ddp", virtual_pipeline_model_parallel_size=2)
    with pytest.raises(KeyError):
        refuse_unsupported("odc", no_such_setting=True)


def test_ddp_with_the_distributed_optimizer_points_to_distopt() -> None:
    # Megatron's own --use-distributed-optimizer under --dp-backend ddp is not ODC's sharding: the
    # refusal says what to use instead (it said "ODC already shards ..." before).
    with pytest.raises(ValueError, match="use --dp-backend distopt instead") as raised:
        refuse_unsupported("ddp", use_distributed_optimizer=True)
    assert "ODC" not in str(raised.value)
    with pytest.raises(ValueError, match="ODC already shards"):
        refuse_unsupported("odc", use_distributed_optimizer=True)
