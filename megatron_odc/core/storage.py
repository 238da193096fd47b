"""Unsharded storage: the flat buffers every parameter is a view of, and its gradient buffers.

Owns :class:`UnshardedStorage`. Consecutive buckets of one unit and dtype share one flat buffer (a
:class:`StorageGroup`); every parameter's ``.data`` (an FP8 parameter's bytes, through its codec) is
rebound to a view into it. The buffer's storage is freed (resized to 0) while the unit is released and
reallocated before a fetch writes it: the trick FSDP2 uses, so tensors autograd saved in forward see the
refetched data in backward. For a backward, each group gets an unsharded gradient buffer and every
parameter a ``main_grad`` view into it (Megatron's contract: TE's fused wgrad writes there directly).

Also owns the naming of a layout's transport buffers (:class:`BufferNames`) and the one shape of a run of
parameter elements that a DP rank owns (:class:`OwnedPiece`). No communication; no megatron import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from megatron_odc.core.fp8 import Float8ParamCodec
from megatron_odc.core.layout import BucketLayout, Layout


@dataclasses.dataclass(frozen=True)
class BufferNames:
    """Names of a layout's transport buffers; several engines may share a transport by prefix."""

    prefix: str = "odc"

    def param(self, bucket_index: int) -> str:
        """The compute-dtype parameter shard of a bucket (read-only for peers: they fetch it)."""
        return f"{self.prefix}.param.{bucket_index}"

    def grad(self, bucket_index: int) -> str:
        """The fp32 gradient accumulator of a bucket (peers push into it)."""
        return f"{self.prefix}.grad.{bucket_index}"


@dataclasses.dataclass(frozen=True)
class OwnedPiece:
    """A run of one parameter that a DP rank owns: ``param[param_start : param_start + numel]`` (flat)
    lives at ``[shard_lo, shard_hi)`` of bucket ``bucket_index``'s param shard and grad accumulator."""

    name: str
    bucket_index: int
    shard_lo: int
    shard_hi: int
    param_start: int

    @property
    def numel(self) -> int:
        """Elements in the run."""
        return self.shard_hi - self.shard_lo


def owned_pieces(layout: Layout, dp_rank: int) -> list[OwnedPiece]:
    """Every run of a parameter ``dp_rank`` owns, in layout order (an unsplittable one: at most one)."""
    pieces = []
    for bucket in layout.buckets:
        shard_start, _ = bucket.shard_range(dp_rank)
        for slot, start, end in bucket.owned_pieces(dp_rank):
            lo = slot.bucket_offset + start - shard_start
            pieces.append(
                OwnedPiece(slot.name, bucket.index, lo, lo + end - start, slot.param_offset + start)
            )
    return pieces


@dataclasses.dataclass
class StorageGroup:
    """Consecutive buckets of one unit and dtype that share one unsharded flat buffer."""

    unit: str
    dtype: torch.dtype
    bucket_indices: list[int]
    bucket_starts: list[int]  # element offset of each bucket inside the flat buffer
    bucket_numels: list[int]  # padded elements of each bucket
    numel: int
    params_flat: torch.Tensor  # 1D; storage resized to 0 while released
    grad_flat: torch.Tensor | None = None  # 1D, allocated for a backward

    def buckets(self, flat: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """``(bucket index, its slice of flat)`` for each bucket; ``flat`` is one of this group's buffers."""
        for index, start, numel in zip(self.bucket_indices, self.bucket_starts, self.bucket_numels):
            yield index, flat[start : start + numel]


@dataclasses.dataclass
class ParamEntry:
    """Where one parameter's unsharded data lives."""

    name: str
    param: torch.nn.Parameter
    unit: str
    group: StorageGroup
    flat_start: int  # element offset of the parameter in the group's flat buffer
    bucket_indices: tuple[int, ...]


class UnshardedStorage:
    """The unsharded parameter and gradient buffers of one layout on one rank.

    Rebinds every parameter into the flat buffers at construction and frees them: afterwards every unit
    is released (its parameters hold no data until :meth:`allocate_params`).

    Args:
        layout: the bucket layout of ``params``.
        params: name -> parameter, for every parameter of the layout.
        device: where the buffers live (the transport's device).
        fp8_codec: binds the bytes of FP8 parameters (``None``: no FP8 parameter).
        fp8_names: the FP8 parameters.
    """

    def __init__(
        self,
        layout: Layout,
        params: dict[str, torch.nn.Parameter],
        device: torch.device,
        fp8_codec: Float8ParamCodec | None,
        fp8_names: frozenset[str],
    ) -> None:
        self.layout = layout
        self.fp8_codec = fp8_codec
        self.fp8_names = fp8_names
        self._groups: dict[str, list[StorageGroup]] = {unit: [] for unit in layout.units}
        self._entries: dict[str, ParamEntry] = {}
        for run in _runs(layout.buckets):
            self._bind_run(run, params, device)
        self._unit_names: dict[str, list[str]] = {unit: [] for unit in layout.units}
        for name, entry in self._entries.items():
            self._unit_names[entry.unit].append(name)
        # Per unit, its FP8 parameters (what the codec processes after a fetch and before a release).
        self._unit_fp8: dict[str, list[torch.Tensor]] = {
            unit: [self._entries[n].param for n in names if n in fp8_names]
            for unit, names in self._unit_names.items()
        }

    def _bind_run(
        self, run: list[BucketLayout], params: dict[str, torch.nn.Parameter], device: torch.device
    ) -> None:
        starts, total = [], 0
        for bucket in run:
            starts.append(total)
            total += bucket.padded_numel
        flat = torch.zeros(total, dtype=run[0].dtype, device=device)
        group = StorageGroup(
            unit=run[0].unit,
            dtype=run[0].dtype,
            bucket_indices=[b.index for b in run],
            bucket_starts=starts,
            bucket_numels=[b.padded_numel for b in run],
            numel=total,
            params_flat=flat,
        )
        self._groups[group.unit].append(group)
        for bucket, bucket_start in zip(run, starts):
            for slot in bucket.slots:
                if slot.name in self._entries:
                    continue  # a later piece of a split parameter: bound through its first piece
                assert slot.param_offset == 0, slot
                p = params[slot.name]
                flat_start = bucket_start + slot.bucket_offset
                self._entries[slot.name] = ParamEntry(
                    name=slot.name,
                    param=p,
                    unit=group.unit,
                    group=group,
                    flat_start=flat_start,
                    bucket_indices=tuple(s.bucket_index for s in self.layout.slots_of(slot.name)),
                )
                view = flat[flat_start : flat_start + p.numel()]
                if slot.name in self.fp8_names:
                    self.fp8_codec.bind(p, view)
                else:
                    p.data = view.view(p.shape)
        flat.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ lookups

    def groups(self, unit: str) -> list[StorageGroup]:
        """The storage groups of ``unit``."""
        return self._groups[unit]

    def entry(self, name: str) -> ParamEntry:
        """Where parameter ``name`` lives."""
        return self._entries[name]

    def names(self, unit: str) -> list[str]:
        """The parameter names of ``unit``, in layout order."""
        return self._unit_names[unit]

    def fp8_params(self, unit: str) -> list[torch.Tensor]:
        """The FP8 parameters of ``unit``."""
        return self._unit_fp8[unit]

    def parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` in layout order."""
        return ((name, e.param) for name, e in self._entries.items())

    # ------------------------------------------------------------------ parameters

    def allocate_params(self, unit: str) -> None:
        """Give the unit's flat buffers their storage back (contents undefined until fetched)."""
        for group in self._groups[unit]:
            group.params_flat.untyped_storage().resize_(
                group.numel * group.params_flat.element_size()
            )

    def free_params(self, unit: str) -> None:
        """Free the storage of the unit's flat buffers (the parameters keep their shapes)."""
        for group in self._groups[unit]:
            group.params_flat.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ gradients

    def bind_grads(self, unit: str, grad_dtype: torch.dtype) -> set[str]:
        """Allocate zeroed gradient buffers and bind every parameter's ``main_grad`` into them.

        Returns:
            The names of the unit's parameters that will receive a gradient.
        """
        for group in self._groups[unit]:
            group.grad_flat = torch.zeros(
                group.numel, dtype=grad_dtype, device=group.params_flat.device
            )
        pending = set()
        for name in self._unit_names[unit]:
            entry = self._entries[name]
            p = entry.param
            p.main_grad = entry.group.grad_flat[
                entry.flat_start : entry.flat_start + p.numel()
            ].view(p.shape)
            p.grad_added_to_main_grad = False
            if p.requires_grad:
                pending.add(name)
        return pending

    def unbind_grads(self, unit: str) -> list[torch.Tensor]:
        """Drop the unit's ``main_grad`` views and gradient buffers; returns the buffers dropped."""
        grads = []
        for group in self._groups[unit]:
            if group.grad_flat is not None:
                grads.append(group.grad_flat)
            group.grad_flat = None
        for name in self._unit_names[unit]:
            self._entries[name].param.main_grad = None
        return grads

    def unsharded_nbytes(self) -> int:
        """Bytes of unsharded parameter and gradient buffers currently allocated."""
        total = 0
        for groups in self._groups.values():
            for g in groups:
                total += g.params_flat.untyped_storage().nbytes()
                if g.grad_flat is not None:
                    total += g.grad_flat.nbytes
        return total


def _runs(buckets: tuple[BucketLayout, ...] | list[BucketLayout]) -> list[list[BucketLayout]]:
    """Maximal runs of consecutive buckets with the same unit and dtype (one storage group each)."""
    runs: list[list[BucketLayout]] = []
    for bucket in buckets:
        if runs and runs[-1][-1].unit == bucket.unit and runs[-1][-1].dtype == bucket.dtype:
            runs[-1].append(bucket)
        else:
            runs.append([bucket])
    return runs
