"""Model presets: one cost model per preset, shared by both tools, and a clear error for a typo."""

from __future__ import annotations

import pytest

from megatron_odc.balance import CostModel
from megatron_odc.tools.presets import MODEL_PRESETS, preset_cost_model
from megatron_odc.tools.simulator import ModelSpec


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_preset_cost_model_is_the_gated_flop_model(name: str) -> None:
    cost = preset_cost_model(name)
    assert cost == CostModel.from_model_config(**MODEL_PRESETS[name], gated_mlp=True)
    assert ModelSpec.from_preset(name).cost == cost
    assert cost.a > 0
    assert cost.b > 0


def test_unknown_preset_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--model '3b'"):
        preset_cost_model("3b")
