"""The refusals of ``mcore/rl/loop.py`` that need no process group: loss contracts and optimizers.

A contract not exact under uneven microbatch counts (a per-rank mean, a per-microbatch mean), a contract
the model's ``calculate_per_token_loss`` contradicts, and an optimizer ODC cannot shard are each refused
in one line naming what to do, before anything is wrapped (the model here is a stand-in: a refusal that
reached the wrapper would fail on it).
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("megatron.core")


def _model(per_token: bool) -> object:
    return types.SimpleNamespace(config=types.SimpleNamespace(calculate_per_token_loss=per_token))


def _optimizer(name: str = "adam", **extra):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer=name, lr=1e-3, **extra)


@pytest.mark.parametrize(
    ("contract", "per_token", "named"),
    [
        ("per_rank_mean", True, "'per_rank_mean' is not exact"),
        ("microbatch_mean", False, "'microbatch_mean' is not exact"),
        ("mean", True, "unknown loss contract 'mean'"),
        ("global_tokens", True, "needs TransformerConfig.calculate_per_token_loss=False"),
        ("per_token", False, "needs TransformerConfig.calculate_per_token_loss=True"),
    ],
)
def test_inexact_or_contradicted_loss_contracts_are_refused(contract, per_token, named) -> None:
    from megatron_odc.mcore.rl.loop import build_rl_backend

    with pytest.raises(ValueError, match=named) as error:
        build_rl_backend("odc", _model(per_token), _optimizer(), loss_contract=contract)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"num_moe_experts": 4, "moe_aux_loss_coeff": 0.01}, "MoE auxiliary losses"),
        ({"num_moe_experts": 4, "moe_z_loss_coeff": [0.001]}, "MoE auxiliary losses"),
        ({"mtp_num_layers": 1}, "multi-token prediction"),
    ],
)
def test_global_tokens_with_count_scaled_auxiliary_losses_is_refused(extra, named) -> None:
    """megatron-core scales MoE / MTP auxiliary losses by 1 / the local count without per-token loss:
    with verl's contract a rank with fewer microbatches would weigh them more."""
    from megatron_odc.mcore.rl.loop import check_loss_contract

    config = types.SimpleNamespace(calculate_per_token_loss=False, **extra)
    with pytest.raises(ValueError, match=f"'global_tokens' with {named}") as error:
        check_loss_contract("global_tokens", config)
    assert "declare 'per_token'" in str(error.value)
    assert "\n" not in str(error.value)
    check_loss_contract("per_token", types.SimpleNamespace(calculate_per_token_loss=True, **extra))
    check_loss_contract(
        "global_tokens",
        types.SimpleNamespace(
            calculate_per_token_loss=False, num_moe_experts=4, moe_aux_loss_coeff=0.0
        ),
    )


@pytest.mark.parametrize(
    ("optimizer", "named"),
    [
        (("muon",), "--optimizer 'muon' is not supported by the ODC optimizer"),
        (("adam",), "distributed"),
    ],
)
def test_an_optimizer_odc_cannot_shard_is_refused_before_wrapping(optimizer, named) -> None:
    from megatron_odc.mcore.rl.loop import build_rl_backend

    extra = {"use_distributed_optimizer": True} if named == "distributed" else {}
    with pytest.raises(ValueError, match=named):
        build_rl_backend(
            "odc", _model(True), _optimizer(*optimizer, **extra), loss_contract="per_token"
        )


def test_global_tokens_scale_is_local_count_times_dp_over_global_tokens() -> None:
    from megatron_odc.mcore.rl.loop import global_tokens_scale

    assert global_tokens_scale(3, 120, 4) == 3 * 4 / 120
    assert global_tokens_scale(0, 0, 2) == 0.0


@pytest.mark.parametrize("value", [None, "2", 1.5, True, -1])
def test_a_num_microbatches_that_is_not_a_count_is_refused_in_one_line(value) -> None:
    """The schedule call's ``num_microbatches`` (``None``, a string, a fraction, a bool, a negative
    number) is refused before anything runs: no raw ``TypeError`` from ``int(None)``."""
    from megatron_odc.mcore.rl.loop import get_forward_backward_func

    with pytest.raises(ValueError, match="num_microbatches must be") as error:
        get_forward_backward_func()(
            forward_step_func=None,
            data_iterator=None,
            model=[_model(True)],
            num_microbatches=value,
            seq_length=8,
            micro_batch_size=1,
        )
    assert "\n" not in str(error.value)
