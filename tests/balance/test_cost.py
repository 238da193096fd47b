"""CostModel: the FLOP formula against an explicit per-token / per-pair count, presets, token model."""

from __future__ import annotations

import pytest

from megatron_odc.balance.cost import CostModel


def _explicit_flops(s, *, layers, hidden, ffn, heads, vocab, groups, gated, causal):
    """Counts fwd+bwd FLOPs of one sample by listing weight shapes and enumerating attention pairs."""
    head_dim = hidden // heads
    weights = [
        (hidden, heads * head_dim),  # q
        (hidden, groups * head_dim),  # k
        (hidden, groups * head_dim),  # v
        (heads * head_dim, hidden),  # out
        (hidden, ffn),  # up
        (ffn, hidden),  # down
    ]
    if gated:
        weights.append((hidden, ffn))  # gate
    per_token_fwd = layers * sum(2 * m * n for m, n in weights) + 2 * hidden * vocab
    pairs = sum((q + 1) if causal else s for q in range(s))
    attention_fwd = layers * pairs * (2 * hidden + 2 * hidden)  # Q K^T and P V
    return 3 * (per_token_fwd * s + attention_fwd)


CONFIGS = [
    {
        "layers": 2,
        "hidden": 64,
        "ffn": 176,
        "heads": 4,
        "vocab": 1000,
        "groups": 2,
        "gated": True,
        "causal": True,
    },
    {
        "layers": 3,
        "hidden": 48,
        "ffn": 100,
        "heads": 6,
        "vocab": 77,
        "groups": 6,
        "gated": False,
        "causal": False,
    },
    {
        "layers": 1,
        "hidden": 32,
        "ffn": 64,
        "heads": 2,
        "vocab": 50,
        "groups": 1,
        "gated": True,
        "causal": False,
    },
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_from_model_config_matches_explicit_count(cfg):
    model = CostModel.from_model_config(
        num_layers=cfg["layers"],
        hidden_size=cfg["hidden"],
        ffn_hidden_size=cfg["ffn"],
        num_attention_heads=cfg["heads"],
        vocab_size=cfg["vocab"],
        num_query_groups=cfg["groups"],
        gated_mlp=cfg["gated"],
        causal=cfg["causal"],
    )
    for s in (1, 7, 100, 333):
        exact = _explicit_flops(s, **cfg)
        # The model counts s**2/2 causal pairs instead of s*(s+1)/2: the documented linear remainder.
        remainder = 3 * cfg["layers"] * 4 * cfg["hidden"] * s / 2 if cfg["causal"] else 0.0
        assert model.sample_cost(s) == pytest.approx(exact - remainder, rel=1e-12)


def test_default_groups_equal_heads_and_causal_halves_attention():
    kw = {
        "num_layers": 4,
        "hidden_size": 128,
        "ffn_hidden_size": 300,
        "num_attention_heads": 8,
        "vocab_size": 500,
    }
    mha = CostModel.from_model_config(**kw)
    assert mha == CostModel.from_model_config(**kw, num_query_groups=8)
    full = CostModel.from_model_config(**kw, causal=False)
    assert full.a == 2 * mha.a
    assert full.b == mha.b
    gated = CostModel.from_model_config(**kw, gated_mlp=True)
    assert gated.b - mha.b == 6 * 4 * 128 * 300


def test_realistic_causal_remainder_is_small():
    # 1.5B-like config: the linear remainder dropped by s**2/2 is < 1e-4 of the matmul term.
    model = CostModel.from_model_config(
        num_layers=28,
        hidden_size=1536,
        ffn_hidden_size=8960,
        num_attention_heads=12,
        num_query_groups=2,
        vocab_size=151936,
        gated_mlp=True,
    )
    assert (12 * 28 * 1536 / 2) / model.b < 1e-4
    # Attention overtakes the matmuls somewhere between 16K and 64K tokens for this size.
    assert model.a * 16384**2 < model.b * 16384
    assert model.a * 65536**2 > model.b * 65536


def test_tokens_and_costs():
    model = CostModel.tokens()
    assert model.costs([0, 5, 17]) == [0.0, 5.0, 17.0]
    quad = CostModel(a=2.0, b=3.0)
    assert quad.costs([1, 10]) == [5.0, 230.0]
    assert quad.sample_cost(0) == 0.0


def test_errors():
    with pytest.raises(ValueError, match="coefficients"):
        CostModel(a=-1.0, b=1.0)
    with pytest.raises(ValueError, match="a > 0 or b > 0"):
        CostModel(a=0.0, b=0.0)
    with pytest.raises(ValueError, match="length"):
        CostModel.tokens().sample_cost(-1)
    with pytest.raises(ValueError, match="num_layers"):
        CostModel.from_model_config(
            num_layers=0, hidden_size=8, ffn_hidden_size=8, num_attention_heads=2, vocab_size=8
        )
    with pytest.raises(ValueError, match="divisible"):
        CostModel.from_model_config(
            num_layers=1, hidden_size=10, ffn_hidden_size=8, num_attention_heads=3, vocab_size=8
        )


def test_fit_recovers_the_coefficients_of_exact_timings() -> None:
    lengths = [32, 64, 128, 256, 512, 1024]
    truth, fixed = CostModel(a=3e-7, b=5e-5), 0.015
    seconds = [truth.sample_cost(s) + fixed for s in lengths]
    model, microbatch_s = CostModel.fit(lengths, seconds)
    assert model.a == pytest.approx(truth.a, rel=1e-9)
    assert model.b == pytest.approx(truth.b, rel=1e-9)
    assert microbatch_s == pytest.approx(fixed, rel=1e-9)


def test_fit_drops_a_negative_term_and_refits_the_rest() -> None:
    # Linear timings with a small dip at the long end: the free fit's quadratic term is negative.
    lengths = [100, 200, 400, 800]
    seconds = [0.01 + 1e-4 * s for s in lengths]
    seconds[-1] *= 0.97
    model, microbatch_s = CostModel.fit(lengths, seconds)
    assert model.a == 0.0
    assert model.b > 0
    assert microbatch_s >= 0
    errors = [(model.sample_cost(s) + microbatch_s) / t - 1 for s, t in zip(lengths, seconds)]
    assert max(abs(e) for e in errors) < 0.05


@pytest.mark.parametrize(
    ("lengths", "seconds", "match"),
    [
        ([10, 10, 20], [1.0, 1.0, 2.0], "3 distinct lengths"),
        ([10, 20, 40], [0.0, 1.0, 2.0], "must be positive"),
        ([10, 20, 40], [3.0, 3.0, 3.0], "do not grow with the length"),
        ([10, 20], [1.0], "2 lengths but 1 timings"),
    ],
)
def test_fit_refuses_timings_it_cannot_use(lengths, seconds, match) -> None:
    with pytest.raises(ValueError, match=match):
        CostModel.fit(lengths, seconds)


def test_describe_fit_gives_the_fit_and_its_timings_in_one_line() -> None:
    from megatron_odc.balance.cost import describe_fit

    lengths, seconds = [32, 128, 512], [0.0102, 0.0138, 0.0302]
    model, fixed = CostModel.fit(lengths, seconds)
    line = describe_fit(model, fixed, lengths, seconds)
    assert line.startswith(f"a={model.a:.3g} s/token^2, b={model.b:.3g} s/token, ")
    assert f"{fixed * 1e3:.1f} ms per microbatch" in line
    assert line.endswith(
        "(forward+backward of one sample of 32: 10.2 ms, 128: 13.8 ms, 512: 30.2 ms)"
    )
    assert "\n" not in line
