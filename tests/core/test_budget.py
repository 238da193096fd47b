"""Tests of megatron_odc.core.budget: the --odc-unsharded-budget values and which units it keeps."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_odc.core.budget import choose_kept_units, parse_budget, unit_kept_nbytes
from megatron_odc.core.layout import ParamSpec, build_layout
from megatron_odc.mcore.config import ODCConfig


@pytest.mark.parametrize(
    ("value", "nbytes"),
    [
        ("none", 0.0),
        ("all", math.inf),
        ("ALL", math.inf),
        ("123456", 123456.0),
        ("1e9", 1e9),
        ("2GiB", 2 * 1024**3),
        ("500MB", 500e6),
        ("1.5 kib", 1536.0),
        (4096, 4096.0),
    ],
)
def test_budget_values(value, nbytes) -> None:
    assert parse_budget(value) == nbytes


@pytest.mark.parametrize("value", ["lots", "-1", "2 parsecs", "", -5, float("nan")])
def test_bad_budgets_name_the_flag(value) -> None:
    with pytest.raises(ValueError, match="--odc-unsharded-budget"):
        parse_budget(value)
    with pytest.raises(ValueError, match="--odc-unsharded-budget"):
        ODCConfig(unsharded_budget=value)


def _layout():
    specs = [ParamSpec("embedding", (50, 8), torch.bfloat16, "root")]
    for i in range(3):
        specs.append(ParamSpec(f"layers.{i}.w", (16, 8 + 8 * i), torch.bfloat16, f"layers.{i}"))
    return build_layout(specs, 2, bucket_numel=256, alignment=4)


def test_kept_units_fit_the_budget_and_are_ranked() -> None:
    layout = _layout()
    sizes = {u: unit_kept_nbytes(layout, u, torch.float32) for u in layout.units}
    # A kept element holds a bf16 parameter and an fp32 gradient.
    assert all(size % 6 == 0 and size > 0 for size in sizes.values())
    assert choose_kept_units(layout, "none") == frozenset()
    assert choose_kept_units(layout, "all") == frozenset(layout.units)
    for budget in range(0, sum(sizes.values()) + 1, 97):
        kept = choose_kept_units(layout, budget, root_unit="root")
        assert sum(sizes[u] for u in kept) <= budget
        # Greedy: nothing left out would still fit.
        left = budget - sum(sizes[u] for u in kept)
        assert all(sizes[u] > left for u in set(layout.units) - kept)
    # With one bucket per unit, the smallest unit has the most per-transfer overhead per byte.
    smallest = min(layout.units, key=lambda u: sizes[u])
    assert choose_kept_units(layout, sizes[smallest], root_unit="root") == {smallest}
