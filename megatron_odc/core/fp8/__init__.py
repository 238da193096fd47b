"""FP8 parameters for ODC: the maths, the codec interface, an emulated FP8 weight, and the recipe rules.

- ``scaling``: per-tensor scales, quantise / dequantise, the rounding error bound;
- ``codec``: :class:`Float8ParamCodec`, what the engine asks of an FP8 parameter kind, and
  :class:`FP8ShardSlices`, one re-quantisation's inputs;
- ``emulated``: :class:`EmulatedFloat8Tensor` and its codec (pure torch, runs anywhere);
- ``recipes``: which FP8 recipes ODC can run ([Note: FP8 amax reductions]) and TransformerEngine on
  request.

The TransformerEngine codec needs megatron-core and lives in ``megatron_odc/mcore/fp8_te.py``.
"""

from megatron_odc.core.fp8.codec import Float8ParamCodec, FP8ShardSlices
from megatron_odc.core.fp8.emulated import EmulatedFloat8Codec, EmulatedFloat8Tensor
from megatron_odc.core.fp8.recipes import (
    FP8_FORMATS,
    FP8_PARAM_RECIPES,
    FP8_RECIPES,
    TE_INSTALL_HINT,
    check_fp8_flags,
    check_fp8_recipe,
    check_te_request,
    require_transformer_engine,
    transformer_engine_available,
)
from megatron_odc.core.fp8.scaling import (
    FP8_MANTISSA_BITS,
    FP8_MAX,
    FP8_MIN_SUBNORMAL,
    compute_scale,
    dequantize,
    quantization_error_bound,
    quantize,
)

__all__ = [
    "FP8_FORMATS",
    "FP8_MANTISSA_BITS",
    "FP8_MAX",
    "FP8_MIN_SUBNORMAL",
    "FP8_PARAM_RECIPES",
    "FP8_RECIPES",
    "TE_INSTALL_HINT",
    "EmulatedFloat8Codec",
    "EmulatedFloat8Tensor",
    "FP8ShardSlices",
    "Float8ParamCodec",
    "check_fp8_flags",
    "check_fp8_recipe",
    "check_te_request",
    "compute_scale",
    "dequantize",
    "quantization_error_bound",
    "quantize",
    "require_transformer_engine",
    "transformer_engine_available",
]
