"""Per-tensor FP8 maths: scales, quantise to raw bytes, dequantise, and the rounding error bound.

Pure torch (torch's FP8 dtypes where this build has them, else an int8 grid of the same range); no
megatron, no TransformerEngine. The codecs (``codec.py``, ``emulated.py``, ``mcore/fp8_te.py``) build on it.
"""

from __future__ import annotations

import torch

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
"""Largest finite magnitude of each FP8 format (OCP FP8: E4M3FN and E5M2)."""

FP8_MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}
FP8_MIN_SUBNORMAL = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}


def _torch_fp8_dtype(fmt: str) -> torch.dtype | None:
    name = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}[fmt]
    return getattr(torch, name, None)


def check_format(fmt: str) -> None:
    """Raise ``ValueError`` unless ``fmt`` is an FP8 format this module knows."""
    if fmt not in FP8_MAX:
        raise ValueError(f"FP8 format {fmt!r} is not one of {', '.join(FP8_MAX)}")


def compute_scale(amax: torch.Tensor, fmt: str = "e4m3", margin: int = 0) -> torch.Tensor:
    """Per-tensor scale ``fp8_max / amax / 2**margin``; 1 where amax is 0 or not finite (TE's rule).

    Args:
        amax: absolute maxima (any shape, fp32).
        fmt: ``"e4m3"`` or ``"e5m2"``.
        margin: extra power-of-two headroom.
    """
    check_format(fmt)
    amax = amax.float()
    scale = FP8_MAX[fmt] / amax / (2.0**margin)
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, scale, torch.ones_like(scale))


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str = "e4m3") -> torch.Tensor:
    """Quantise ``x * scale`` to FP8, saturating at the format's max; returns the raw bytes (uint8).

    Uses torch's FP8 dtypes (round to nearest even); if this torch has none, an int8 grid of the same
    range (coarser, still a real quantiser).
    """
    check_format(fmt)
    fp8_max = FP8_MAX[fmt]
    scaled = (x.float() * scale).clamp(-fp8_max, fp8_max)
    dtype = _torch_fp8_dtype(fmt)
    if dtype is not None:
        return scaled.to(dtype).view(torch.uint8)
    return torch.round(scaled * (127.0 / fp8_max)).to(torch.int8).view(torch.uint8)


def dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor | float, fmt: str = "e4m3"
) -> torch.Tensor:
    """Inverse of ``quantize``: raw FP8 bytes times ``scale_inv`` (= 1 / scale), in fp32."""
    check_format(fmt)
    if data.dtype != torch.uint8:
        raise ValueError(f"FP8 data must be raw bytes (torch.uint8), got {data.dtype}")
    dtype = _torch_fp8_dtype(fmt)
    if dtype is not None:
        values = data.view(dtype).float()
    else:
        values = data.view(torch.int8).float() * (FP8_MAX[fmt] / 127.0)
    return values * scale_inv


def quantization_error_bound(
    x: torch.Tensor, scale: torch.Tensor | float, fmt: str = "e4m3"
) -> torch.Tensor:
    """Per-element bound on ``|dequantize(quantize(x)) - x|`` for values inside the scaled range.

    Round to nearest: half a unit in the last place, ``|x| * 2**-(m+1)`` for normals, plus half the
    smallest subnormal (divided by the scale) for tiny values.
    """
    check_format(fmt)
    if _torch_fp8_dtype(fmt) is None:
        return torch.full_like(x.float(), FP8_MAX[fmt] / 127.0 / 2) / scale
    rel = 2.0 ** -(FP8_MANTISSA_BITS[fmt] + 1)
    return x.float().abs() * rel + FP8_MIN_SUBNORMAL[fmt] / 2 / scale
