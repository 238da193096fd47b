"""The interface between the engine and one kind of FP8 parameter tensor, and its shared behaviour.

With FP8 parameters (TransformerEngine ``Float8Tensor`` under ``--fp8-param-gather``, per-tensor scaling)
the bytes peers fetch are the FP8 data: half the bytes of bf16. The engine keeps each FP8 parameter's raw
bytes (uint8) in its own unsplittable range of a uint8 bucket, and a :class:`Float8ParamCodec` tells it
how to read and rebind those bytes, what to do after a fetch (TE: build the transpose) and before a
release, and, after every optimizer step, how to re-quantise each rank's *owned* slice from the fp32 main
shard: ``quantize_shards`` reduces the per-parameter amax (MAX) over the DP group in one collective, so
every rank derives the same scale, and writes the owned FP8 bytes plus the shared ``scale_inv``. A fetched
parameter then equals what one process quantising the whole fp32 master would hold.

Codecs: ``EmulatedFloat8Codec`` (``emulated.py``, pure torch) and ``TEFloat8Codec`` (``mcore/fp8_te.py``,
megatron-core's ``fp8_utils``). No megatron import.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist


@dataclasses.dataclass
class FP8ShardSlices:
    """What one re-quantisation writes, per FP8 parameter of the model (the same parameters in the same
    order on every DP rank).

    Attributes:
        params: the FP8 parameters.
        mains: this rank's fp32 master of the elements it owns of each parameter, ``None`` where it owns
            none.
        offsets: the flat offset of each master slice in its parameter (``None`` with ``mains``).
        shards: the owned FP8 bytes to write, one per master slice (``None`` with ``mains``).
    """

    params: list[torch.Tensor]
    mains: list[torch.Tensor | None]
    offsets: list[int | None]
    shards: list[torch.Tensor | None]

    def check(self) -> None:
        """Raise ``ValueError`` unless the lists line up and every master slice has its bytes."""
        lengths = (len(self.params), len(self.mains), len(self.offsets), len(self.shards))
        if len(set(lengths)) != 1:
            raise ValueError(
                f"quantize_shards: {lengths[0]} params, {lengths[1]} main slices, {lengths[2]} "
                f"offsets and {lengths[3]} shards"
            )
        for i, (main, shard) in enumerate(zip(self.mains, self.shards)):
            if main is not None and (shard is None or shard.numel() != main.numel()):
                raise ValueError(
                    f"quantize_shards: parameter {i} has {main.numel()} owned master elements but "
                    f"{None if shard is None else shard.numel()} shard bytes"
                )


class Float8ParamCodec(abc.ABC):
    """How the engine stores, fetches and re-quantises one kind of FP8 parameter tensor.

    Every method gets the parameter objects themselves (the model's ``nn.Parameter``); ``data`` tensors
    are raw FP8 bytes (``torch.uint8``), one byte per element. The defaults suit a tensor from which
    nothing is derived and that keeps no high-precision copy.
    """

    name: str
    """Short name for messages, e.g. ``"TransformerEngine Float8Tensor"``."""

    @abc.abstractmethod
    def is_fp8(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is an FP8 parameter of this kind."""

    @abc.abstractmethod
    def check(self, param: torch.Tensor, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` if ODC cannot shard this FP8 parameter."""

    @abc.abstractmethod
    def raw_data(self, param: torch.Tensor) -> torch.Tensor:
        """The parameter's FP8 bytes (``param.numel()`` uint8 elements, the parameter's shape)."""

    @abc.abstractmethod
    def bind(self, param: torch.Tensor, data: torch.Tensor) -> None:
        """Copy the current bytes into ``data`` (flat uint8) and make ``param`` read them from there."""

    @abc.abstractmethod
    def dequantize_bytes(self, param: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        """fp32 values of some of ``param``'s bytes ``data`` (with the parameter's current scale)."""

    def after_fetch(self, params: Sequence[torch.Tensor]) -> None:
        """The bytes of ``params`` were just fetched (e.g. rebuild derived transposes)."""
        del params  # by default nothing is derived from the bytes

    def before_release(self, params: Sequence[torch.Tensor]) -> None:
        """The bytes of ``params`` are about to be freed (drop caches derived from them)."""
        del params  # by default nothing is derived from the bytes

    def master_values(self, param: torch.Tensor, start: int, data: torch.Tensor) -> torch.Tensor:
        """fp32 initial master values of elements ``[start, start + data.numel())``.

        The high-precision initial values where the format kept them, else the dequantised ``data``.
        """
        return self.dequantize_bytes(param, data)

    def quantize_shards(self, slices: FP8ShardSlices, group: dist.ProcessGroup | None) -> None:
        """Re-quantise every rank's owned slices (collective over ``group``).

        The amax of each parameter is reduced (MAX) over ``group``, so every rank sets the same
        ``scale_inv`` on every parameter.

        Raises:
            ValueError: ``slices`` do not line up (see :meth:`FP8ShardSlices.check`).
        """
        slices.check()
        if slices.params:
            self._quantize_shards(slices, group)

    @abc.abstractmethod
    def _quantize_shards(self, slices: FP8ShardSlices, group: dist.ProcessGroup | None) -> None:
        """``quantize_shards`` on checked, non-empty slices."""
