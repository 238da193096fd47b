"""The flags both command lines share: sources, explicit cost model, cap and drawing keywords."""

from __future__ import annotations

import argparse
import json

import pytest

from megatron_odc.balance import CostModel
from megatron_odc.tools.cli_args import (
    cap_tokens,
    draw_options,
    explicit_cost_model,
    lengths_from_args,
    non_negative_float,
    positive_float,
    positive_int,
)


def _args(**overrides) -> argparse.Namespace:
    values = {
        "lengths": None,
        "profile": None,
        "profiles_file": None,
        "cost_a": None,
        "cost_b": None,
        "cap": 65536,
        "dp": 8,
        "minibatch": 4,
        "num_minibatches": 32,
        "seed": 0,
    }
    return argparse.Namespace(**{**values, **overrides})


def test_lengths_come_from_the_file_or_the_profile(tmp_path) -> None:
    text = tmp_path / "lengths.txt"
    text.write_text("5\n7\n")
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({"tiny": {"lengths": [1, 2, 3]}}))
    assert lengths_from_args(_args(lengths=str(text))) == [5, 7]
    assert lengths_from_args(_args(profile="tiny", profiles_file=str(profiles))) == [1, 2, 3]
    with pytest.raises(ValueError, match="not found"):
        lengths_from_args(_args(lengths=str(tmp_path / "missing.txt")))


def test_explicit_cost_model_needs_both_coefficients() -> None:
    assert explicit_cost_model(_args()) is None
    assert explicit_cost_model(_args(cost_a=2.0, cost_b=3.0)) == CostModel(a=2.0, b=3.0)
    for half in ({"cost_a": 1.0}, {"cost_b": 1.0}):
        with pytest.raises(ValueError, match="--cost-a and --cost-b go together"):
            explicit_cost_model(_args(**half))


def test_cap_zero_means_no_cap_and_negative_is_refused() -> None:
    assert cap_tokens(_args(cap=4096)) == 4096
    assert cap_tokens(_args(cap=0)) is None
    with pytest.raises(ValueError, match="--cap must be >= 0, got -1"):
        cap_tokens(_args(cap=-1))


def test_draw_options_map_the_flags_to_keywords() -> None:
    assert draw_options(_args(cap=0, dp=2, minibatch=3, num_minibatches=5, seed=9)) == {
        "dp_size": 2,
        "minibatch": 3,
        "cap_tokens": None,
        "num_minibatches": 5,
        "seed": 9,
    }


@pytest.mark.parametrize(
    ("check", "good", "bad"),
    [
        (positive_int, {"1": 1, "28": 28}, ["0", "-3", "1.5", "x"]),
        (positive_float, {"1e9": 1e9, "0.5": 0.5}, ["0", "-10", "nan", "inf", "-inf", "x"]),
        (non_negative_float, {"0": 0.0, "2.5": 2.5}, ["-1", "-1e-9", "nan", "inf", "x"]),
    ],
)
def test_number_checkers_refuse_what_the_flags_cannot_mean(check, good, bad) -> None:
    for text, value in good.items():
        assert check(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=f"got {text!r}"):
            check(text)
