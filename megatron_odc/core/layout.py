"""Bucket and shard layout of the ODC backend: pure arithmetic, no process group, no megatron.

This module owns the mapping from an ordered list of parameter descriptions (:class:`ParamSpec`) to flat
buckets (:class:`BucketLayout`), the contiguous shard of every bucket that each data-parallel rank owns,
and the canonical per-parameter records and fingerprint that let ranks check that they built the same
layout before any one-sided operation touches a peer's memory.

[Note: layout rules]

``build_layout(params, dp_size, bucket_numel, alignment)`` walks ``params`` in the given order (the caller
chooses it, e.g. reverse registration order as Megatron's DDP does) and packs them greedily:

- A bucket never mixes units or dtypes: a change of ``unit`` or ``dtype`` closes the open bucket.
- Every parameter start is rounded up to a multiple of ``alignment`` elements inside its bucket (the
  64-element rule of Megatron's distributed optimizer).
- The effective bucket size is ``bucket_numel`` rounded UP to a multiple of ``dp_size * alignment``
  (``Layout.bucket_numel`` records it). A parameter that does not fit behind the open bucket's last one
  closes that bucket and opens a new one.
- A parameter never spans two buckets unless it alone is larger than the effective bucket size and is
  ``splittable``. An unsplittable one (FP8 parameters: one scale per tensor, re-quantised from one owned
  range per rank) then gets a bucket of its own, larger than the effective size. A splittable one is
  split into consecutive pieces, each alone in its own bucket; every piece but the last holds exactly
  ``bucket_numel`` elements and has no padding, so the unit's buckets laid back to back hold the
  parameter contiguously. The bucket of the last piece is closed too: the next parameter opens a new one.
- An ``own_bucket`` parameter closes the open bucket and is laid out alone, like a parameter larger than
  the effective size (split if larger and splittable); its bucket(s) are closed behind it. Its shards
  then depend only on its size, ``dp_size``, the bucket size and the alignment, so two layouts that hold
  it (the first and last pipeline stage's copies of a tied embedding) give each DP rank the same range
  of it: megatron-core's DDP puts the shared embedding in a bucket of its own for the same reason.
- ``padded_numel`` is the end of the last slot rounded up to a multiple of ``dp_size * alignment`` and is
  never below ``dp_size * alignment``, so every rank owns a non-empty, aligned shard of every bucket:
  rank ``r`` owns ``[r * shard_numel, (r + 1) * shard_numel)``.
- A zero-element parameter gets a slot with ``numel == 0`` at the (aligned) current end of the open
  bucket; it never closes a bucket for lack of room and adds no padding. Only when a unit/dtype run
  consists of zero-element parameters alone does it cost a bucket of ``dp_size * alignment`` elements.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

_FINGERPRINT_VERSION = 3
_RECORD_FIELDS = ("name", "shape", "dtype", "unit", "splittable", "own_bucket")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one parameter.

    Attributes:
        name: Fully qualified parameter name, unique within a layout.
        shape: Parameter shape; any sequence of non-negative ints is accepted and stored as a tuple.
        dtype: Dtype of the parameter's compute copy (the dtype of its bucket).
        unit: The module group whose hooks fetch this parameter ("" = one unit for everything).
        splittable: Whether a parameter larger than the bucket size may be split over several buckets
            (False: it gets one oversized bucket of its own).
        own_bucket: Lay the parameter out in bucket(s) of its own, so that its shards do not depend on
            its neighbours (see [Note: layout rules]).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    unit: str = ""
    splittable: bool = True
    own_bucket: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"parameter name must be a non-empty string, got {self.name!r}")
        try:
            dims = tuple(self.shape)
        except TypeError:
            raise ValueError(
                f"parameter {self.name!r}: shape must be a sequence of ints, got {self.shape!r}"
            ) from None
        if not all(_is_int(d) for d in dims):
            raise ValueError(
                f"parameter {self.name!r}: shape must be a sequence of ints, got {self.shape!r}"
            )
        if any(d < 0 for d in dims):
            raise ValueError(f"parameter {self.name!r}: negative dimension in shape {dims}")
        object.__setattr__(self, "shape", tuple(int(d) for d in dims))
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(
                f"parameter {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}"
            )
        if not isinstance(self.unit, str):
            raise ValueError(f"parameter {self.name!r}: unit must be a string, got {self.unit!r}")
        for flag in ("splittable", "own_bucket"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(
                    f"parameter {self.name!r}: {flag} must be a bool, got {getattr(self, flag)!r}"
                )

    @property
    def numel(self) -> int:
        """Number of elements (1 for a scalar, 0 if any dimension is 0)."""
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where a parameter, or one piece of a split parameter, lives.

    Attributes:
        name: Parameter name.
        bucket_index: Index of the bucket in ``Layout.buckets``.
        bucket_offset: Element offset of this piece in the bucket's unsharded flat buffer.
        param_offset: Element offset of this piece in the flattened parameter (0 unless split).
        numel: Number of elements in this piece.
    """

    name: str
    bucket_index: int
    bucket_offset: int
    param_offset: int
    numel: int

    @property
    def bucket_end(self) -> int:
        """End (exclusive) of this piece in bucket element space."""
        return self.bucket_offset + self.numel


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """One flat bucket: a single unit and dtype, sharded evenly over the DP ranks.

    Attributes:
        index: Position in ``Layout.buckets``.
        unit: The unit all parameters of this bucket belong to.
        dtype: The dtype of all parameters of this bucket.
        slots: The pieces in this bucket, in increasing ``bucket_offset`` order.
        numel_unpadded: End of the last slot.
        padded_numel: ``numel_unpadded`` rounded up to a multiple of ``dp_size * alignment`` (and at
            least ``dp_size * alignment``).
        dp_size: Number of data-parallel ranks the bucket is sharded over.
    """

    index: int
    unit: str
    dtype: torch.dtype
    slots: tuple[ParamSlot, ...]
    numel_unpadded: int
    padded_numel: int
    dp_size: int

    @property
    def shard_numel(self) -> int:
        """Elements of this bucket owned by each rank (a multiple of the alignment)."""
        return self.padded_numel // self.dp_size

    @property
    def padded_nbytes(self) -> int:
        """Bytes of the unsharded, padded bucket buffer."""
        return self.padded_numel * self.dtype.itemsize

    @property
    def shard_nbytes(self) -> int:
        """Bytes of one rank's shard."""
        return self.shard_numel * self.dtype.itemsize

    def _check_rank(self, dp_rank: int) -> None:
        if not _is_int(dp_rank) or not 0 <= dp_rank < self.dp_size:
            raise ValueError(
                f"bucket {self.index}: dp_rank {dp_rank!r} out of range [0, {self.dp_size})"
            )

    def shard_range(self, dp_rank: int) -> tuple[int, int]:
        """The ``[start, end)`` range of bucket elements owned by ``dp_rank``."""
        self._check_rank(dp_rank)
        return dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel

    def owner_of(self, bucket_offset: int) -> int:
        """The DP rank that owns element ``bucket_offset`` of this bucket."""
        if not _is_int(bucket_offset) or not 0 <= bucket_offset < self.padded_numel:
            raise ValueError(
                f"bucket {self.index}: offset {bucket_offset!r} out of range [0, {self.padded_numel})"
            )
        return bucket_offset // self.shard_numel

    def owned_pieces(self, dp_rank: int) -> list[tuple[ParamSlot, int, int]]:
        """The parts of parameters that fall in ``dp_rank``'s shard.

        Returns:
            ``(slot, start, end)`` for every slot that intersects the shard, in slot order, where
            ``0 <= start < end <= slot.numel`` are offsets relative to the slot. Padding is not included.
        """
        shard_start, shard_end = self.shard_range(dp_rank)
        pieces = []
        for slot in self.slots:
            lo = max(shard_start, slot.bucket_offset)
            hi = min(shard_end, slot.bucket_end)
            if lo < hi:
                pieces.append((slot, lo - slot.bucket_offset, hi - slot.bucket_offset))
        return pieces


def _record(spec: ParamSpec) -> str:
    return json.dumps(
        [spec.name, list(spec.shape), str(spec.dtype), spec.unit, spec.splittable, spec.own_bucket],
        separators=(",", ":"),
        ensure_ascii=True,
    )


@dataclasses.dataclass(frozen=True)
class Layout:
    """The complete bucket layout of one model replica; identical on every DP rank.

    Build it with :func:`build_layout`.

    Attributes:
        dp_size: Number of data-parallel ranks.
        bucket_numel: Effective bucket size (the requested one rounded up to ``dp_size * alignment``).
        alignment: Alignment, in elements, of parameter starts and shard sizes.
        params: The parameters in layout order.
        buckets: The buckets in order.
    """

    dp_size: int
    bucket_numel: int
    alignment: int
    params: tuple[ParamSpec, ...]
    buckets: tuple[BucketLayout, ...]
    _slots_by_name: dict[str, tuple[ParamSlot, ...]] = dataclasses.field(
        init=False, repr=False, compare=False
    )
    _spec_by_name: dict[str, ParamSpec] = dataclasses.field(init=False, repr=False, compare=False)
    _buckets_by_unit: dict[str, tuple[int, ...]] = dataclasses.field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        slots: dict[str, list[ParamSlot]] = {spec.name: [] for spec in self.params}
        by_unit: dict[str, list[int]] = {spec.unit: [] for spec in self.params}
        for bucket in self.buckets:
            by_unit.setdefault(bucket.unit, []).append(bucket.index)
            for slot in bucket.slots:
                slots[slot.name].append(slot)
        object.__setattr__(self, "_slots_by_name", {k: tuple(v) for k, v in slots.items()})
        object.__setattr__(self, "_spec_by_name", {spec.name: spec for spec in self.params})
        object.__setattr__(self, "_buckets_by_unit", {k: tuple(v) for k, v in by_unit.items()})

    def slots_of(self, name: str) -> tuple[ParamSlot, ...]:
        """The slots holding parameter ``name``, in ``param_offset`` order (one unless split)."""
        try:
            return self._slots_by_name[name]
        except KeyError:
            raise ValueError(f"parameter {name!r} is not in the layout") from None

    def spec_of(self, name: str) -> ParamSpec:
        """The :class:`ParamSpec` of parameter ``name``."""
        try:
            return self._spec_by_name[name]
        except KeyError:
            raise ValueError(f"parameter {name!r} is not in the layout") from None

    def buckets_of_unit(self, unit: str) -> tuple[int, ...]:
        """Indices of the buckets of ``unit``, in order."""
        try:
            return self._buckets_by_unit[unit]
        except KeyError:
            raise ValueError(
                f"unit {unit!r} is not in the layout (units: {list(self.units)})"
            ) from None

    @property
    def units(self) -> tuple[str, ...]:
        """The units, in order of first appearance among the parameters."""
        return tuple(self._buckets_by_unit)

    @property
    def total_padded_numel(self) -> int:
        """Sum of ``padded_numel`` over all buckets."""
        return sum(b.padded_numel for b in self.buckets)

    @property
    def shard_numel_per_rank(self) -> int:
        """Elements each rank owns, over all buckets (the same on every rank)."""
        return sum(b.shard_numel for b in self.buckets)

    def records(self) -> list[str]:
        """One canonical line per parameter (name, shape, dtype, unit, splittable, own_bucket), in
        layout order."""
        return [_record(spec) for spec in self.params]

    def fingerprint(self) -> str:
        """Hex sha256 of the layout's inputs; the same on every machine and Python run."""
        header = json.dumps(
            {
                "version": _FINGERPRINT_VERSION,
                "dp_size": self.dp_size,
                "bucket_numel": self.bucket_numel,
                "alignment": self.alignment,
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        text = "\n".join([header, *self.records()])
        return hashlib.sha256(text.encode("ascii")).hexdigest()


def _check_positive(name: str, value: object) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def build_layout(
    params: Sequence[ParamSpec],
    dp_size: int,
    bucket_numel: int = 40_000_000,
    alignment: int = 64,
) -> Layout:
    """Pack ``params``, in order, into buckets sharded over ``dp_size`` ranks.

    See [Note: layout rules] in the module docstring.

    Args:
        params: The parameters, in layout order. May be empty (zero buckets).
        dp_size: Number of data-parallel ranks.
        bucket_numel: Requested bucket size in elements; rounded up to ``dp_size * alignment``.
        alignment: Alignment, in elements, of parameter starts and shard sizes.

    Returns:
        The layout; identical inputs give identical layouts and fingerprints.

    Raises:
        ValueError: on a bad ``dp_size``, ``bucket_numel`` or ``alignment``, a duplicate parameter name,
            or an entry that is not a :class:`ParamSpec`.
    """
    _check_positive("dp_size", dp_size)
    _check_positive("bucket_numel", bucket_numel)
    _check_positive("alignment", alignment)
    specs = tuple(params)
    seen: set[str] = set()
    for position, spec in enumerate(specs):
        if not isinstance(spec, ParamSpec):
            raise ValueError(
                f"params[{position}] must be a ParamSpec, got {type(spec).__name__}: {spec!r}"
            )
        if spec.name in seen:
            raise ValueError(f"duplicate parameter name {spec.name!r} (at position {position})")
        seen.add(spec.name)

    row_numel = dp_size * alignment
    effective_numel = _round_up(bucket_numel, row_numel)

    # Each entry: (unit, dtype, slots); the open bucket is `open_slots` (None when closed).
    raw: list[tuple[str, torch.dtype, list[ParamSlot]]] = []
    open_key: tuple[str, torch.dtype] | None = None
    open_slots: list[ParamSlot] | None = None
    cursor = 0
    for spec in specs:
        key = (spec.unit, spec.dtype)
        numel = spec.numel
        if open_slots is not None and open_key != key:
            open_slots = None
        split = numel > effective_numel and spec.splittable
        if (spec.own_bucket or numel > effective_numel) and not split:
            open_slots = None
            raw.append((spec.unit, spec.dtype, [ParamSlot(spec.name, len(raw), 0, 0, numel)]))
            continue
        if split:
            open_slots = None
            for param_offset in range(0, numel, effective_numel):
                piece_numel = min(effective_numel, numel - param_offset)
                slot = ParamSlot(spec.name, len(raw), 0, param_offset, piece_numel)
                raw.append((spec.unit, spec.dtype, [slot]))
            continue
        start = 0 if open_slots is None else _round_up(cursor, alignment)
        if open_slots is not None and start + numel > effective_numel:
            open_slots = None
            start = 0
        if open_slots is None:
            open_slots, open_key = [], key
            raw.append((spec.unit, spec.dtype, open_slots))
        open_slots.append(ParamSlot(spec.name, len(raw) - 1, start, 0, numel))
        cursor = start + numel

    buckets = []
    for index, (unit, dtype, slots) in enumerate(raw):
        numel_unpadded = slots[-1].bucket_end
        padded_numel = max(_round_up(numel_unpadded, row_numel), row_numel)
        oversized = len(slots) == 1 and slots[0].numel > effective_numel
        assert numel_unpadded <= padded_numel, (index, padded_numel)
        assert oversized or padded_numel <= effective_numel, (index, padded_numel)
        buckets.append(
            BucketLayout(index, unit, dtype, tuple(slots), numel_unpadded, padded_numel, dp_size)
        )
    layout = Layout(dp_size, effective_numel, alignment, specs, tuple(buckets))
    logger.debug(
        "layout: %d params in %d buckets, %d padded elements, %d per rank (dp_size=%d)",
        len(specs),
        len(buckets),
        layout.total_padded_numel,
        layout.shard_numel_per_rank,
        dp_size,
    )
    return layout


def _parse_record(line: str, where: str) -> dict[str, object]:
    try:
        fields = json.loads(line)
    except (TypeError, ValueError):
        fields = None
    if not isinstance(fields, list) or len(fields) != len(_RECORD_FIELDS):
        raise ValueError(f"{where}: malformed layout record {line!r}")
    return dict(zip(_RECORD_FIELDS, fields, strict=True))


def first_difference(mine: Sequence[str], other: Sequence[str], other_rank: int) -> str | None:
    """Compare this rank's ``Layout.records()`` with another rank's.

    Args:
        mine: This rank's records.
        other: The records of rank ``other_rank``.
        other_rank: The rank ``other`` came from, used in the message.

    Returns:
        None if the records are equal, otherwise a message naming the first parameter that differs and
        how: its shape, dtype, unit, splittability or own bucket, its position (order), or that it is missing on / extra on the other
        rank.

    Raises:
        ValueError: if a record cannot be parsed.
    """
    if list(mine) == list(other):
        return None
    my_fields = [_parse_record(line, "this rank") for line in mine]
    their_fields = [_parse_record(line, f"rank {other_rank}") for line in other]
    my_names = {f["name"] for f in my_fields}
    their_names = {f["name"] for f in their_fields}
    prefix = f"layout differs from rank {other_rank}"
    for position in range(max(len(my_fields), len(their_fields))):
        a = my_fields[position] if position < len(my_fields) else None
        b = their_fields[position] if position < len(their_fields) else None
        if a is not None and b is not None and a["name"] == b["name"]:
            for field in _RECORD_FIELDS[1:]:
                if a[field] != b[field]:
                    return (
                        f"{prefix}: parameter {a['name']!r} has a different {field}: "
                        f"{a[field]} on this rank, {b[field]} on rank {other_rank}"
                    )
            continue
        if a is not None and a["name"] not in their_names:
            return f"{prefix}: parameter {a['name']!r} is missing on rank {other_rank}"
        if b is not None and b["name"] not in my_names:
            return (
                f"{prefix}: parameter {b['name']!r} on rank {other_rank} is extra "
                "(not on this rank)"
            )
        assert a is not None, (position, b)
        assert b is not None, (position, a)
        return (
            f"{prefix}: parameter order differs at position {position}: parameter "
            f"{a['name']!r} on this rank, {b['name']!r} on rank {other_rank}"
        )
    # Only reachable if the lines differ in formatting but parse to the same fields.
    return f"{prefix}: records differ in formatting but not in content"


def check_same_layout(mine: Layout, records_by_rank: Sequence[Sequence[str]]) -> None:
    """Raise unless every rank's records equal ``mine.records()``.

    Args:
        mine: This rank's layout.
        records_by_rank: ``records()`` of every rank (e.g. from ``all_gather_object``), indexed by rank.

    Raises:
        ValueError: with :func:`first_difference`'s message for the first rank that differs.
    """
    my_records = mine.records()
    for rank, records in enumerate(records_by_rank):
        message = first_difference(my_records, records, rank)
        if message is not None:
            raise ValueError(message)
