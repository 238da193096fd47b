"""Model presets of the offline tools: the ODC paper's DeepSeek-R1-Distill-Qwen sizes.

Owns :data:`MODEL_PRESETS` (the architecture numbers behind ``--model``) and
:func:`preset_cost_model`, the FLOP cost model every tool plans with for a preset. The simulator
derives a preset's bytes per layer from the same numbers (``ModelSpec.from_preset`` in
:mod:`megatron_odc.tools.simulator`).
"""

from __future__ import annotations

from megatron_odc.balance.cost import CostModel

__all__ = ["MODEL_PRESETS", "preset_cost_model"]

#: DeepSeek-R1-Distill-Qwen sizes (Qwen2 architecture: gated MLP, GQA), as used in the ODC paper.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "1.5b": {
        "num_layers": 28,
        "hidden_size": 1536,
        "ffn_hidden_size": 8960,
        "num_attention_heads": 12,
        "num_query_groups": 2,
        "vocab_size": 151936,
    },
    "7b": {
        "num_layers": 28,
        "hidden_size": 3584,
        "ffn_hidden_size": 18944,
        "num_attention_heads": 28,
        "num_query_groups": 4,
        "vocab_size": 152064,
    },
    "14b": {
        "num_layers": 48,
        "hidden_size": 5120,
        "ffn_hidden_size": 13824,
        "num_attention_heads": 40,
        "num_query_groups": 8,
        "vocab_size": 152064,
    },
    "32b": {
        "num_layers": 64,
        "hidden_size": 5120,
        "ffn_hidden_size": 27648,
        "num_attention_heads": 40,
        "num_query_groups": 8,
        "vocab_size": 152064,
    },
}


def preset_cost_model(name: str) -> CostModel:
    """The per-sample FLOP cost model of preset ``name`` (gated MLP).

    Args:
        name: a key of :data:`MODEL_PRESETS`.

    Returns:
        ``CostModel.from_model_config`` of the preset.

    Raises:
        ValueError: ``name`` is not a preset.
    """
    if name not in MODEL_PRESETS:
        raise ValueError(f"--model {name!r} is not one of {sorted(MODEL_PRESETS)}")
    return CostModel.from_model_config(**MODEL_PRESETS[name], gated_mlp=True)
