"""An FP8 weight that runs anywhere: ``EmulatedFloat8Tensor`` and its codec, in pure torch.

``EmulatedFloat8Tensor`` is a real per-tensor-scaled FP8 weight (raw bytes plus ``scale_inv``) whose every
torch op sees the dequantised values; ``EmulatedFloat8Codec`` is its :class:`Float8ParamCodec`. CPU tests
and machines without TransformerEngine run the whole FP8 parameter path (sharded bytes, fetch, DP-wide
re-quantisation) with them. No megatron import.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from megatron_odc.core.fp8.codec import Float8ParamCodec, FP8ShardSlices
from megatron_odc.core.fp8.scaling import check_format, compute_scale, dequantize, quantize
from megatron_odc.transport.devices import all_reduce_on_group_device


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
        check_format(fmt)
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


class EmulatedFloat8Codec(Float8ParamCodec):
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

    def dequantize_bytes(self, param: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        """``data`` times the parameter's ``scale_inv``."""
        return dequantize(data, param._scale_inv, param.fmt)

    def _quantize_shards(self, slices: FP8ShardSlices, group: dist.ProcessGroup | None) -> None:
        device = slices.params[0]._data.device
        amax = torch.zeros(len(slices.params), dtype=torch.float32, device=device)
        cast = []
        for i, (param, main) in enumerate(zip(slices.params, slices.mains)):
            x = main.to(device=device, dtype=param.dtype) if main is not None else None
            cast.append(x)
            if x is not None and x.numel():
                amax[i] = x.abs().max().float()
        all_reduce_on_group_device(amax, dist.ReduceOp.MAX, group)
        for i, (param, x, shard) in enumerate(zip(slices.params, cast, slices.shards)):
            scale = compute_scale(amax[i : i + 1], param.fmt)
            param._scale_inv.copy_(1.0 / scale)
            if x is not None:
                shard.copy_(quantize(x, scale, param.fmt).view(-1))
