"""This rank's owned shards: the parameter shards peers fetch and the accumulators peers push into.

Owns :class:`OwnedShards`: per bucket, this DP rank's compute-dtype parameter shard and fp32 gradient
accumulator (both in transport memory), the owned runs of every parameter (:class:`OwnedPiece`), and
every write into the parameter shards: the initial values, and new values after an optimizer step or a
load. FP8 parameters are written by re-quantising through their codec with the amax reduced over the DP
group ([Note: FP8 amax reductions] in ``core/fp8/recipes.py``), so such a write is collective. No
megatron import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_odc.core.fp8 import Float8ParamCodec, FP8ShardSlices
from megatron_odc.core.layout import Layout
from megatron_odc.core.storage import BufferNames, OwnedPiece, owned_pieces
from megatron_odc.transport.base import Transport

OwnedValues = Callable[[OwnedPiece], "torch.Tensor | None"]
"""New values of an owned piece (``piece.numel`` elements, any float dtype), or ``None`` to keep it."""


class OwnedShards:
    """This DP rank's parameter shards and gradient accumulators of one layout.

    Args:
        transport: where the shards live (already holding the registered buffers).
        layout: the bucket layout.
        names: the transport buffer names of the layout.
        params: name -> parameter, in layout order (the same order on every DP rank).
        group: the DP group (FP8 amax reductions).
        fp8_codec: the codec of the FP8 parameters, ``None`` if there are none.
        fp8_names: the FP8 parameters.
        gradients: whether gradient accumulators were registered (``False``: a frozen model).
    """

    def __init__(
        self,
        transport: Transport,
        layout: Layout,
        names: BufferNames,
        params: dict[str, torch.nn.Parameter],
        group: dist.ProcessGroup | None,
        fp8_codec: Float8ParamCodec | None,
        fp8_names: frozenset[str],
        gradients: bool = True,
    ) -> None:
        self.transport = transport
        self.gradients = gradients
        """Whether the layout has gradient accumulators (a frozen model has none)."""
        self.layout = layout
        self.names = names
        self.params = params
        self.group = group
        self.fp8_codec = fp8_codec
        self.fp8_names = fp8_names
        self.pieces: list[OwnedPiece] = owned_pieces(layout, transport.rank)
        """Every run of a parameter this rank owns, in layout order."""

    def param_shard(self, bucket_index: int) -> torch.Tensor:
        """This rank's compute-dtype parameter shard of a bucket (what peers fetch)."""
        return self.transport.local(self.names.param(bucket_index))

    def grad_shard(self, bucket_index: int) -> torch.Tensor:
        """This rank's fp32 gradient accumulator of a bucket (what peers push into)."""
        if not self.gradients:
            raise RuntimeError("a frozen ODC model has no gradient accumulators")
        return self.transport.local(self.names.grad(bucket_index))

    def piece_param(self, piece: OwnedPiece) -> torch.Tensor:
        """The owned slice of the parameter shard that holds ``piece`` (FP8 bytes for FP8 parameters)."""
        return self.param_shard(piece.bucket_index)[piece.shard_lo : piece.shard_hi]

    def piece_grad(self, piece: OwnedPiece) -> torch.Tensor:
        """The owned slice of the gradient accumulator that holds ``piece``'s gradient sums."""
        return self.grad_shard(piece.bucket_index)[piece.shard_lo : piece.shard_hi]

    def piece_values(self, piece: OwnedPiece) -> torch.Tensor:
        """The values ``piece`` holds: a view of the shard, or the dequantised FP8 bytes (a copy)."""
        shard = self.piece_param(piece)
        if piece.name in self.fp8_names:
            return self.fp8_codec.dequantize_bytes(self.params[piece.name], shard)
        return shard

    def write_initial(self) -> None:
        """Copy each owned piece from the parameters' current data (FP8: their bytes, as they are)."""
        for piece in self.pieces:
            param = self.params[piece.name]
            if piece.name in self.fp8_names:
                src = self.fp8_codec.raw_data(param)
            else:
                src = param.detach()
            src = src.reshape(-1)[piece.param_start : piece.param_start + piece.numel]
            self.piece_param(piece).copy_(src)

    def write(self, values: OwnedValues) -> None:
        """Write new values into the owned parameter slices (visible to peers after the next fence).

        Collective when the layout has FP8 parameters: their owned bytes are re-quantised with the amax
        reduced over the DP group (a kept FP8 piece is re-quantised from its current values with the new
        shared scale), so every DP rank calls it.
        """
        fp8_values: dict[str, tuple[OwnedPiece, torch.Tensor]] = {}
        for piece in self.pieces:
            value = values(piece)
            if piece.name in self.fp8_names:
                fp8_values[piece.name] = (
                    piece,
                    self.piece_values(piece) if value is None else value,
                )
            elif value is not None:
                self.piece_param(piece).copy_(value.reshape(-1))
        if self.fp8_names:
            self._quantize(fp8_values)

    def _quantize(self, fp8_values: dict[str, tuple[OwnedPiece, torch.Tensor]]) -> None:
        slices = FP8ShardSlices([], [], [], [])
        for name, param in self.params.items():  # layout order: the same on every DP rank
            if name not in self.fp8_names:
                continue
            piece, value = fp8_values.get(name, (None, None))
            slices.params.append(param)
            slices.mains.append(
                None
                if value is None
                else value.reshape(-1).to(self.transport.device, torch.float32)
            )
            slices.offsets.append(None if piece is None else piece.param_start)
            slices.shards.append(None if piece is None else self.piece_param(piece))
        self.fp8_codec.quantize_shards(slices, self.group)

    def zero_grads(self) -> None:
        """Zero every owned gradient accumulator."""
        if not self.gradients:
            return
        for bucket in self.layout.buckets:
            self.grad_shard(bucket.index).zero_()

    def scale_grads(self, factor: float) -> None:
        """Multiply every owned gradient accumulator by ``factor``."""
        if not self.gradients:
            return
        for bucket in self.layout.buckets:
            self.grad_shard(bucket.index).mul_(factor)

    def grads_of(self, names: Sequence[str] | set[str]) -> list[torch.Tensor]:
        """The owned gradient slices of the parameters ``names``, in layout order."""
        return [self.piece_grad(p) for p in self.pieces if p.name in names]

    def persistent_nbytes(self) -> int:
        """Bytes of the owned parameter shards and gradient accumulators."""
        return sum(
            self.param_shard(b.index).nbytes
            + (self.grad_shard(b.index).nbytes if self.gradients else 0)
            for b in self.layout.buckets
        )
