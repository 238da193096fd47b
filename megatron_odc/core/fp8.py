"""FP8 parameters for ODC: the per-tensor FP8 maths, the codec interface the engine uses, and an emulated FP8
weight type that runs anywhere.

With FP8 parameters (TransformerEngine ``Float8Tensor`` under ``--fp8-param-gather``, per-tensor scaling) the
bytes peers fetch are the FP8 data: half the bytes of bf16. The engine keeps each FP8 parameter's raw
bytes (uint8) in its own unsplittable range of a uint8 bucket, and a ``Float8ParamCodec`` tells it how to
read and rebind those bytes, what to do after a fetch (TE: build the transpose) and before a release, and,
after every optimizer step, how to re-quantise each rank's *owned* slice from the fp32 main shard:
``quantize_shards`` reduces the per-parameter amax (MAX) over the DP group in one collective, so every rank
derives the same scale, and writes the owned FP8 bytes plus the shared ``scale_inv``. A fetched parameter
then equals what one process quantising the whole fp32 master would hold.

Two codecs: ``EmulatedFloat8Codec`` here, for ``EmulatedFloat8Tensor`` (a real per-tensor FP8 weight in
pure torch: CPU tests and machines without TE run the whole FP8 parameter path with it), and the
TransformerEngine codec in ``megatron_odc.fp8_params`` (megatron-core's ``fp8_utils`` underneath).

[Note: FP8 amax reductions] Delayed scaling all-reduces amax over TP x DP at every ``fp8_autocast`` exit,
i.e. per microbatch; ODC ranks run different numbers of microbatches, so that reduction deadlocks. ODC
requires ``tp_only_amax_red=True`` with the delayed recipe, or a recipe without that per-step DP reduction
(``tensorwise``, ``mxfp8``, ``blockwise``); ``check_fp8_recipe`` enforces it. FP8 *parameters* need a
per-tensor recipe (``delayed`` or ``tensorwise``): the others keep no flat byte array to fetch.

This module imports no megatron module; TransformerEngine is only looked up (``transformer_engine_available``)
or imported on request (``require_transformer_engine``), with a ``ValueError`` naming what to do.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from megatron_odc.transport.devices import all_reduce_on_group_device

logger = logging.getLogger(__name__)
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
"""Largest finite magnitude of each FP8 format (OCP FP8: E4M3FN and E5M2)."""

FP8_MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}
FP8_MIN_SUBNORMAL = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}

FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
"""Megatron ``--fp8-recipe`` values ODC knows; only ``delayed`` reduces amax over DP every microbatch."""

FP8_PARAM_RECIPES = ("delayed", "tensorwise")
"""Recipes whose FP8 parameters are per-tensor scaled flat bytes, which ODC can shard and fetch."""

TE_INSTALL_HINT = (
    "install TransformerEngine (pip install --no-build-isolation transformer_engine[pytorch]) or run "
    "without it: --transformer-impl local and no --fp8-format / --fp8-param-gather"
)


# ---------------------------------------------------------------------- per-tensor FP8 maths


def _torch_fp8_dtype(fmt: str) -> torch.dtype | None:
    name = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}[fmt]
    return getattr(torch, name, None)


def _check_format(fmt: str) -> None:
    if fmt not in FP8_MAX:
        raise ValueError(f"FP8 format {fmt!r} is not one of {', '.join(FP8_MAX)}")


def compute_scale(amax: torch.Tensor, fmt: str = "e4m3", margin: int = 0) -> torch.Tensor:
    """Per-tensor scale ``fp8_max / amax / 2**margin``; 1 where amax is 0 or not finite (TE's rule).

    Args:
        amax: absolute maxima (any shape, fp32).
        fmt: ``"e4m3"`` or ``"e5m2"``.
        margin: extra power-of-two headroom.
    """
    _check_format(fmt)
    amax = amax.float()
    scale = FP8_MAX[fmt] / amax / (2.0**margin)
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, scale, torch.ones_like(scale))


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str = "e4m3") -> torch.Tensor:
    """Quantise ``x * scale`` to FP8, saturating at the format's max; returns the raw bytes (uint8).

    Uses torch's FP8 dtypes (round to nearest even); if this torch has none, an int8 grid of the same
    range (coarser, still a real quantiser).
    """
    _check_format(fmt)
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
    _check_format(fmt)
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
    _check_format(fmt)
    if _torch_fp8_dtype(fmt) is None:
        return torch.full_like(x.float(), FP8_MAX[fmt] / 127.0 / 2) / scale
    rel = 2.0 ** -(FP8_MANTISSA_BITS[fmt] + 1)
    return x.float().abs() * rel + FP8_MIN_SUBNORMAL[fmt] / 2 / scale


# ---------------------------------------------------------------------- the codec interface


class Float8ParamCodec(Protocol):
    """How the engine stores, fetches and re-quantises one kind of FP8 parameter tensor.

    Every method gets the parameter objects themselves (the model's ``nn.Parameter``); ``data`` tensors are
    raw FP8 bytes (``torch.uint8``), one byte per element.
    """

    name: str
    """Short name for messages, e.g. ``"TransformerEngine Float8Tensor"``."""

    def is_fp8(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is an FP8 parameter of this kind."""

    def check(self, param: torch.Tensor, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` if ODC cannot shard this FP8 parameter."""

    def raw_data(self, param: torch.Tensor) -> torch.Tensor:
        """The parameter's FP8 bytes (``param.numel()`` uint8 elements, the parameter's shape)."""

    def bind(self, param: torch.Tensor, data: torch.Tensor) -> None:
        """Copy the current bytes into ``data`` (flat uint8) and make ``param`` read them from there."""

    def after_fetch(self, params: Sequence[torch.Tensor]) -> None:
        """The bytes of ``params`` were just fetched (e.g. rebuild derived transposes)."""

    def before_release(self, params: Sequence[torch.Tensor]) -> None:
        """The bytes of ``params`` are about to be freed (drop caches derived from them)."""

    def dequantize_bytes(self, param: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        """fp32 values of some of ``param``'s bytes ``data`` (with the parameter's current scale)."""

    def master_values(self, param: torch.Tensor, start: int, data: torch.Tensor) -> torch.Tensor:
        """fp32 initial master values of elements ``[start, start + data.numel())``.

        The high-precision initial values where the format kept them, else the dequantised ``data``.
        """

    def quantize_shards(
        self,
        params: Sequence[torch.Tensor],
        mains: Sequence[torch.Tensor | None],
        offsets: Sequence[int | None],
        shards: Sequence[torch.Tensor | None],
        group: dist.ProcessGroup | None,
    ) -> None:
        """Re-quantise every rank's owned slices (collective over ``group``; every DP rank passes the
        same ``params`` in the same order).

        ``mains[i]`` is this rank's fp32 master of elements ``[offsets[i], offsets[i] + n)`` of
        ``params[i]`` and ``shards[i]`` the n owned bytes to write (all ``None`` where this rank owns
        none of it). The amax of each parameter is reduced (MAX) over ``group``, so every rank sets the
        same ``scale_inv`` on every parameter.
        """


# ---------------------------------------------------------------------- emulated FP8 weights


class EmulatedFloat8Tensor(torch.Tensor):
    """A per-tensor-scaled FP8 weight in pure torch: raw bytes ``_data`` (uint8) and ``_scale_inv``.

    Any torch op sees the dequantised values in the logical ``dtype``, so it drops into any module as a
    parameter (``torch.nn.Parameter(EmulatedFloat8Tensor.from_float(w), requires_grad=True)``) and its
    gradient is an ordinary tensor. ``detach`` shares the bytes; ``copy_`` re-quantises (``quantize_``);
    a move to another device (``Module.to(device)``, ``.cuda()``) moves the bytes and the scale; other
    in-place ops are refused (they would silently work on a plain copy). It stands in for TransformerEngine's
    ``Float8Tensor`` where TE is missing: the engine's FP8 path (sharded bytes, fetch, re-quantise with a
    DP-wide amax) is the same for both.
    """

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    fmt: str

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        dtype: torch.dtype,
        fmt: str = "e4m3",
        requires_grad: bool = False,
    ) -> EmulatedFloat8Tensor:
        _check_format(fmt)
        if data.dtype != torch.uint8:
            raise ValueError(f"FP8 data must be raw bytes (torch.uint8), got {data.dtype}")
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=requires_grad
        )
        tensor._data = data
        tensor._scale_inv = scale_inv
        tensor.fmt = fmt
        return tensor

    @classmethod
    def from_float(
        cls, values: torch.Tensor, fmt: str = "e4m3", dtype: torch.dtype | None = None
    ) -> EmulatedFloat8Tensor:
        """Quantise ``values`` with the scale of its own amax; the logical dtype defaults to its dtype."""
        data = torch.empty(values.shape, dtype=torch.uint8, device=values.device)
        scale_inv = torch.ones(1, dtype=torch.float32, device=values.device)
        return cls(data, scale_inv, dtype or values.dtype, fmt).quantize_(values)

    def quantize_(self, values: torch.Tensor) -> EmulatedFloat8Tensor:
        """Re-quantise this weight in place from ``values``, with the scale of their own amax.

        What ``copy_`` into this weight does (so ``Module.load_state_dict`` works); returns ``self``.
        """
        if isinstance(values, EmulatedFloat8Tensor):
            values = values.dequantize()
        if tuple(values.shape) != tuple(self.shape):
            raise ValueError(
                f"quantize_: values of shape {tuple(values.shape)} into {tuple(self.shape)}"
            )
        x = values.detach().to(device=self._data.device, dtype=self.dtype)
        scale = compute_scale(x.abs().max().reshape(1), self.fmt).to(x.device)
        self._data.copy_(quantize(x, scale, self.fmt).view(self._data.shape))
        self._scale_inv.copy_(1.0 / scale)
        return self

    def dequantize(self) -> torch.Tensor:
        """The values this weight stands for, in its logical dtype."""
        return dequantize(self._data, self._scale_inv, self.fmt).to(self.dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (
            f"EmulatedFloat8Tensor(fmt={self.fmt}, shape={tuple(self.shape)}, dtype={self.dtype})"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            (src,) = args
            return cls(src._data, src._scale_inv, src.dtype, src.fmt)
        if func is torch.ops.aten.copy_.default and isinstance(args[0], EmulatedFloat8Tensor):
            return args[0].quantize_(args[1])
        if func._schema.is_mutable and args and isinstance(args[0], EmulatedFloat8Tensor):
            # It would write a dequantised temporary and leave the FP8 bytes unchanged.
            raise ValueError(
                f"{func} would modify an EmulatedFloat8Tensor in place; assign new values with "
                "copy_ / quantize_ (re-quantised), or work on dequantize()"
            )
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], EmulatedFloat8Tensor):
            moved = _moved(args[0], kwargs or {})
            if moved is not None:
                return moved

        def unwrap(x: Any) -> Any:
            return x.dequantize() if isinstance(x, EmulatedFloat8Tensor) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def _moved(src: EmulatedFloat8Tensor, kwargs: dict[str, Any]) -> EmulatedFloat8Tensor | None:
    """``src`` on ``kwargs["device"]`` (bytes and scale moved, still FP8); None if it stays put.

    ``Module.to(device)`` / ``.cuda()`` keep the weight FP8. A move that also changes the logical dtype
    is refused: it would swap the FP8 weight for a plain copy (``.to(dtype)`` alone reads the values).
    """
    device = kwargs.get("device")
    if device is None or torch.device(device) == src.device:
        return None
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != src.dtype:
        raise ValueError(
            f"an EmulatedFloat8Tensor moves between devices in its own dtype ({src.dtype}); "
            f"moving it to {device} as {dtype} would replace the FP8 weight with a plain copy: "
            "move the model first, then convert dtypes"
        )
    non_blocking = bool(kwargs.get("non_blocking", False))
    return EmulatedFloat8Tensor(
        src._data.to(device, non_blocking=non_blocking),
        src._scale_inv.to(device, non_blocking=non_blocking),
        src.dtype,
        src.fmt,
    )


class EmulatedFloat8Codec:
    """``Float8ParamCodec`` of ``EmulatedFloat8Tensor``: TE's current-scaling rule in pure torch.

    ``quantize_shards`` casts each master slice to the parameter's logical dtype first (as TE does), takes
    the per-parameter amax, MAX-reduces it over the DP group in one all-reduce, and quantises the owned
    slices with ``scale = fp8_max / amax``.
    """

    name = "EmulatedFloat8Tensor"

    def is_fp8(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is an ``EmulatedFloat8Tensor``."""
        return isinstance(param, EmulatedFloat8Tensor)

    def check(self, param: torch.Tensor, name: str) -> None:
        """Every emulated FP8 tensor is per-tensor scaled flat bytes: nothing to refuse."""
        if param._data.numel() != param.numel():
            raise ValueError(f"FP8 parameter {name!r}: its bytes do not cover its elements")

    def raw_data(self, param: torch.Tensor) -> torch.Tensor:
        """The ``_data`` bytes."""
        return param._data

    def bind(self, param: torch.Tensor, data: torch.Tensor) -> None:
        """Copy the bytes into ``data`` and read them from there."""
        data.copy_(param._data.reshape(-1))
        param._data = data.view(param.shape)

    def after_fetch(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing is derived from the bytes."""

    def before_release(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing is derived from the bytes."""

    def dequantize_bytes(self, param: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        """``data`` times the parameter's ``scale_inv``."""
        return dequantize(data, param._scale_inv, param.fmt)

    def master_values(self, param: torch.Tensor, start: int, data: torch.Tensor) -> torch.Tensor:
        """The dequantised bytes (no high-precision copy is kept)."""
        return self.dequantize_bytes(param, data)

    def quantize_shards(
        self,
        params: Sequence[torch.Tensor],
        mains: Sequence[torch.Tensor | None],
        offsets: Sequence[int | None],
        shards: Sequence[torch.Tensor | None],
        group: dist.ProcessGroup | None,
    ) -> None:
        """See ``Float8ParamCodec.quantize_shards``."""
        if not len(params) == len(mains) == len(offsets) == len(shards):
            raise ValueError(
                f"quantize_shards: {len(params)} params, {len(mains)} main slices, {len(offsets)} "
                f"offsets and {len(shards)} shards"
            )
        if not params:
            return
        device = params[0]._data.device
        amax = torch.zeros(len(params), dtype=torch.float32, device=device)
        cast = []
        for i, (param, main) in enumerate(zip(params, mains)):
            x = main.to(device=device, dtype=param.dtype) if main is not None else None
            cast.append(x)
            if x is not None and x.numel():
                amax[i] = x.abs().max().float()
        all_reduce_on_group_device(amax, dist.ReduceOp.MAX, group)
        for i, (param, x, shard) in enumerate(zip(params, cast, shards)):
            scale = compute_scale(amax[i : i + 1], param.fmt)
            param._scale_inv.copy_(1.0 / scale)
            if x is not None:
                if shard is None or shard.numel() != x.numel():
                    raise ValueError(
                        f"quantize_shards: parameter {i} has {x.numel()} owned master elements but "
                        f"{None if shard is None else shard.numel()} shard bytes"
                    )
                shard.copy_(quantize(x, scale, param.fmt).view(-1))


# ---------------------------------------------------------------------- config checks


def check_fp8_recipe(config: Any) -> None:
    """Refuse FP8 settings whose amax reduction would deadlock ranks with uneven microbatch counts.

    Reads ``fp8``, ``fp8_recipe`` and ``tp_only_amax_red`` from ``config`` (a ``TransformerConfig`` or any
    object with those attributes). See [Note: FP8 amax reductions].

    Raises:
        ValueError: the delayed recipe without ``tp_only_amax_red``, a recipe ODC does not know, or FP8
            parameters (``fp8_param``) with a recipe that is not per-tensor scaled.
    """
    if not getattr(config, "fp8", None):
        if getattr(config, "fp8_param", False):
            raise ValueError("--fp8-param-gather needs --fp8-format (e4m3 or hybrid)")
        return
    recipe = getattr(config, "fp8_recipe", "delayed")
    recipe = getattr(recipe, "value", recipe)  # Megatron's Fp8Recipe enum or a plain string
    if recipe not in FP8_RECIPES:
        raise ValueError(
            f"--fp8-recipe {recipe!r} is not supported with --dp-backend odc (its amax reduction "
            f"cannot be checked); use one of {', '.join(FP8_RECIPES)}"
        )
    if recipe == "delayed" and not getattr(config, "tp_only_amax_red", False):
        raise ValueError(
            "--fp8-recipe delayed all-reduces amax over TP x DP at every microbatch, which deadlocks "
            "--dp-backend odc ranks that run different numbers of microbatches; add --tp-only-amax-red "
            "(ODC reduces amax over DP once per step) or use --fp8-recipe tensorwise"
        )
    if getattr(config, "fp8_param", False) and recipe not in FP8_PARAM_RECIPES:
        raise ValueError(
            f"--fp8-param-gather with --fp8-recipe {recipe}: --dp-backend odc shards and fetches FP8 "
            f"parameters of a per-tensor recipe ({', '.join(FP8_PARAM_RECIPES)}) only; drop "
            "--fp8-param-gather (bf16 parameters, FP8 compute) or use --fp8-recipe tensorwise"
        )


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine.pytorch`` can be found (without importing it)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def require_transformer_engine(feature: str) -> ModuleType:
    """Import ``transformer_engine.pytorch`` for ``feature`` or raise a ``ValueError`` that says what to do."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError as exc:
        raise ValueError(
            f"{feature} needs TransformerEngine, which is not importable ({exc}); {TE_INSTALL_HINT}"
        ) from exc


def check_te_request(
    *, transformer_impl: str | None = None, fp8: str | None = None, fp8_param: bool = False
) -> None:
    """Fail early and clearly when the TE layer spec or FP8 is requested without TransformerEngine.

    Args:
        transformer_impl: Megatron's ``--transformer-impl`` (``"transformer_engine"`` or ``"local"``).
        fp8: ``--fp8-format`` (``"e4m3"``, ``"hybrid"``) or ``None``.
        fp8_param: ``--fp8-param-gather``.

    Raises:
        ValueError: a TE feature is requested and TE is not importable, or FP8 params without FP8.
    """
    if fp8_param and not fp8:
        raise ValueError("--fp8-param-gather needs --fp8-format (e4m3 or hybrid)")
    wanted = []
    if transformer_impl == "transformer_engine":
        wanted.append("--transformer-impl transformer_engine")
    if fp8:
        wanted.append(f"--fp8-format {fp8}")
    if fp8_param:
        wanted.append("--fp8-param-gather")
    if wanted:
        require_transformer_engine(" and ".join(wanted))
