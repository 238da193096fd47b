"""Tests of ``megatron_odc.core.layout``: property checks over seeded random parameter sets, a hand-worked
example, validation errors, fingerprint stability and mismatch messages, and import isolation.

Everything here is pure CPU arithmetic (no process group). The random cases are checked against
independent oracles: interval arithmetic on the slots and shards, and an element-level reconstruction that
writes every parameter element's unique code into real bucket tensors, shards them, and reads every
parameter back from the shards through ``owned_pieces``.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_odc.core.layout import (
    Layout,
    ParamSpec,
    build_layout,
    check_same_layout,
    first_difference,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.float64)
UNITS = ("", "embedding", "layers.0", "layers.1", "layers.2", "head")
DP_SIZES = (1, 2, 3, 4, 5, 7, 8, 16, 24, 31, 32, 64)
ALIGNMENTS = (1, 2, 3, 8, 64, 128)
BUCKET_NUMELS = (1, 7, 100, 1000, 4096, 10_007, 65_536, 1_000_000, 40_000_000)
PRIMES = (2, 3, 5, 7, 13, 101, 997, 7919, 65_537, 999_983)
NUM_RANDOM_CASES = 300
# The element-level oracle runs only on layouts below these sizes (test time).
ELEMENT_CHECK_MAX_NUMEL = 200_000
ELEMENT_CHECK_MAX_SHARDS = 3000  # buckets x dp_size


def _effective_bucket_numel(requested: int, dp_size: int, alignment: int) -> int:
    row = dp_size * alignment
    return (requested + row - 1) // row * row


def _shape_for(numel: int, rng: random.Random) -> tuple[int, ...]:
    if numel == 0:
        return rng.choice([(0,), (3, 0), (0, 5, 2)])
    if numel == 1 and rng.random() < 0.3:
        return ()
    divisors = [d for d in (2, 3, 4, 8, 16, 64) if numel % d == 0]
    if divisors and rng.random() < 0.5:
        d = rng.choice(divisors)
        return (numel // d, d) if rng.random() < 0.5 else (d, 1, numel // d)
    return (numel,)


def _random_numel(rng: random.Random, bucket_numel: int) -> int:
    kind = rng.random()
    if kind < 0.05:
        numel = 0
    elif kind < 0.15:
        numel = 1
    elif kind < 0.35:
        numel = rng.choice(PRIMES)
    elif kind < 0.55:
        numel = rng.randint(1, 5000)
    elif kind < 0.75:  # around the bucket size: exact multiples and just above
        numel = rng.choice([1, 2, 3]) * bucket_numel + rng.choice([-1, 0, 0, 1, 2, 63])
    elif kind < 0.9:
        numel = rng.randint(1, 10**6)
    else:  # huge: gets split into several pieces
        numel = rng.randint(2 * bucket_numel + 1, 6 * bucket_numel + 7)
    numel = max(numel, 0)
    # Keep the number of split pieces (and so the test time) bounded.
    return min(numel, 40 * bucket_numel + 3)


def _random_case(seed: int) -> tuple[list[ParamSpec], int, int, int]:
    rng = random.Random(seed)
    dp_size = rng.choice(DP_SIZES)
    alignment = rng.choice(ALIGNMENTS)
    requested = rng.choice(BUCKET_NUMELS)
    effective = _effective_bucket_numel(requested, dp_size, alignment)
    num_params = rng.choice([0, 1, 2, 5, 10, 20, 40])
    unit, dtype = rng.choice(UNITS), rng.choice(DTYPES)
    specs = []
    for i in range(num_params):
        # Units and dtypes come in runs, as in a real model, with occasional returns to earlier ones.
        if rng.random() < 0.25:
            unit = rng.choice(UNITS)
        if rng.random() < 0.2:
            dtype = rng.choice(DTYPES)
        numel = _random_numel(rng, effective)
        specs.append(ParamSpec(f"p{i}.{unit or 'root'}.w", _shape_for(numel, rng), dtype, unit))
    return specs, dp_size, requested, alignment


def _check_bucket_shards(layout: Layout) -> None:
    row = layout.dp_size * layout.alignment
    for position, bucket in enumerate(layout.buckets):
        assert bucket.index == position
        assert bucket.dp_size == layout.dp_size
        assert bucket.slots, f"bucket {position} is empty"
        assert bucket.padded_numel % row == 0
        assert row <= bucket.padded_numel <= layout.bucket_numel
        assert bucket.numel_unpadded <= bucket.padded_numel
        # Padding is less than one row unless the bucket holds only zero-element slots.
        assert bucket.padded_numel - bucket.numel_unpadded < row or bucket.numel_unpadded == 0
        assert bucket.shard_numel * layout.dp_size == bucket.padded_numel
        assert bucket.shard_numel % layout.alignment == 0
        expected_start = 0
        for dp_rank in range(layout.dp_size):
            start, end = bucket.shard_range(dp_rank)
            assert start == expected_start
            assert end - start == bucket.shard_numel
            assert start % layout.alignment == 0
            assert bucket.owner_of(start) == dp_rank
            assert bucket.owner_of(end - 1) == dp_rank
            expected_start = end
        assert expected_start == bucket.padded_numel
        if position > 0:
            continue
        for bad_offset in (-1, bucket.padded_numel):
            with pytest.raises(ValueError, match=f"bucket {position}"):
                bucket.owner_of(bad_offset)
        for bad_rank in (-1, layout.dp_size):
            with pytest.raises(ValueError, match=f"bucket {position}"):
                bucket.shard_range(bad_rank)


def _check_slots(layout: Layout, specs: list[ParamSpec]) -> None:
    by_name = {spec.name: spec for spec in specs}
    b = layout.bucket_numel
    for bucket in layout.buckets:
        previous_end = 0
        for slot in bucket.slots:
            spec = by_name[slot.name]
            assert (bucket.unit, bucket.dtype) == (spec.unit, spec.dtype), "bucket mixes unit/dtype"
            assert slot.bucket_index == bucket.index
            assert slot.bucket_offset % layout.alignment == 0
            assert slot.bucket_offset >= previous_end, "slots overlap or are out of order"
            previous_end = slot.bucket_offset + slot.numel
        assert bucket.numel_unpadded == previous_end <= b

    # The slots, read bucket by bucket, list the parameters in the given order.
    expected_names = [s.name for s in specs for _ in range(max(1, -(-s.numel // b)))]
    assert [slot.name for bucket in layout.buckets for slot in bucket.slots] == expected_names

    for spec in specs:
        slots = layout.slots_of(spec.name)
        assert sum(slot.numel for slot in slots) == spec.numel
        param_offset = 0
        for slot in slots:
            assert slot.param_offset == param_offset, f"{spec.name}: pieces not contiguous"
            param_offset += slot.numel
        if spec.numel <= b:
            assert len(slots) == 1, f"{spec.name} was split"
            continue
        # Split: consecutive buckets, each piece alone at offset 0, all but the last full and unpadded.
        assert len(slots) == -(-spec.numel // b)
        first = slots[0].bucket_index
        for k, slot in enumerate(slots):
            bucket = layout.buckets[slot.bucket_index]
            assert slot.bucket_index == first + k
            assert bucket.slots == (slot,)
            assert slot.bucket_offset == 0
            if k < len(slots) - 1:
                assert slot.numel == b
                assert bucket.padded_numel == b


def _check_greedy(layout: Layout) -> None:
    """A bucket boundary inside a unit/dtype run is there only because the next param did not fit."""
    split = {
        s.name
        for bucket in layout.buckets
        for s in bucket.slots
        if len(layout.slots_of(s.name)) > 1
    }
    for prev, cur in zip(layout.buckets, layout.buckets[1:], strict=False):
        if (prev.unit, prev.dtype) != (cur.unit, cur.dtype):
            continue
        if prev.slots[-1].name in split or cur.slots[0].name in split:
            continue
        aligned_end = -(-prev.numel_unpadded // layout.alignment) * layout.alignment
        first = cur.slots[0]
        assert aligned_end + first.numel > layout.bucket_numel, (
            f"bucket {cur.index} opened although {first.name} fits in bucket {prev.index}"
        )


def _check_units(layout: Layout, specs: list[ParamSpec]) -> None:
    units = list(dict.fromkeys(spec.unit for spec in specs))
    assert list(layout.units) == units
    for unit in units:
        expected = tuple(b.index for b in layout.buckets if b.unit == unit)
        assert layout.buckets_of_unit(unit) == expected
        assert expected, f"unit {unit!r} has no bucket"
    assert sorted(i for u in units for i in layout.buckets_of_unit(u)) == list(
        range(len(layout.buckets))
    )


def _check_owned_pieces_intervals(layout: Layout, specs: list[ParamSpec]) -> None:
    covered: dict[str, list[tuple[int, int]]] = {spec.name: [] for spec in specs}
    for bucket in layout.buckets:
        for dp_rank in range(layout.dp_size):
            shard_start, shard_end = bucket.shard_range(dp_rank)
            for slot, start, end in bucket.owned_pieces(dp_rank):
                assert 0 <= start < end <= slot.numel
                assert shard_start <= slot.bucket_offset + start
                assert slot.bucket_offset + end <= shard_end
                covered[slot.name].append((slot.param_offset + start, slot.param_offset + end))
    for spec in specs:
        intervals = sorted(covered[spec.name])
        position = 0
        for start, end in intervals:
            assert start == position, f"{spec.name}: gap or overlap at element {position}"
            position = end
        assert position == spec.numel, f"{spec.name}: {position} of {spec.numel} elements owned"


def _check_elements(layout: Layout, specs: list[ParamSpec]) -> None:
    """Element-level oracle: unique codes through real bucket buffers and shards, and back."""
    codes = {
        spec.name: (i + 1) * 2**32 + torch.arange(spec.numel, dtype=torch.int64)
        for i, spec in enumerate(specs)
    }
    shards = []
    for bucket in layout.buckets:
        buffer = torch.full((bucket.padded_numel,), -1, dtype=torch.int64)
        writes = torch.zeros(bucket.padded_numel, dtype=torch.int64)
        for slot in bucket.slots:
            lo, hi = slot.bucket_offset, slot.bucket_offset + slot.numel
            buffer[lo:hi] = codes[slot.name][slot.param_offset : slot.param_offset + slot.numel]
            writes[lo:hi] += 1
        assert int(writes.max()) <= 1, f"bucket {bucket.index}: an element holds two params"
        assert int((writes == 0).sum()) == bucket.padded_numel - sum(s.numel for s in bucket.slots)
        shards.append(list(buffer.view(layout.dp_size, bucket.shard_numel).clone()))
    rebuilt = {spec.name: torch.full((spec.numel,), -1, dtype=torch.int64) for spec in specs}
    reads = {spec.name: torch.zeros(spec.numel, dtype=torch.int64) for spec in specs}
    for bucket in layout.buckets:
        for dp_rank in range(layout.dp_size):
            shard = shards[bucket.index][dp_rank]
            shard_start = bucket.shard_range(dp_rank)[0]
            for slot, start, end in bucket.owned_pieces(dp_rank):
                src = slot.bucket_offset + start - shard_start
                dst = slot.param_offset + start
                rebuilt[slot.name][dst : dst + end - start] = shard[src : src + end - start]
                reads[slot.name][dst : dst + end - start] += 1
    for spec in specs:
        assert torch.equal(reads[spec.name], torch.ones(spec.numel, dtype=torch.int64))
        assert torch.equal(rebuilt[spec.name], codes[spec.name]), spec.name


def _check_layout(layout: Layout, specs: list[ParamSpec], requested: int) -> None:
    row = layout.dp_size * layout.alignment
    b = layout.bucket_numel
    assert b % row == 0
    assert requested <= b < requested + row
    assert layout.params == tuple(specs)
    _check_bucket_shards(layout)
    _check_slots(layout, specs)
    _check_greedy(layout)
    _check_units(layout, specs)
    _check_owned_pieces_intervals(layout, specs)
    assert layout.total_padded_numel == sum(bk.padded_numel for bk in layout.buckets)
    assert layout.shard_numel_per_rank * layout.dp_size == layout.total_padded_numel


def test_random_layouts_satisfy_the_layout_rules():
    num_element_checked = num_split = num_split_element_checked = 0
    for seed in range(NUM_RANDOM_CASES):
        specs, dp_size, requested, alignment = _random_case(seed)
        layout = build_layout(specs, dp_size, requested, alignment)
        try:
            _check_layout(layout, specs, requested)
            has_split = any(len(layout.slots_of(s.name)) > 1 for s in specs)
            if (
                layout.total_padded_numel <= ELEMENT_CHECK_MAX_NUMEL
                and len(layout.buckets) * dp_size <= ELEMENT_CHECK_MAX_SHARDS
            ):
                _check_elements(layout, specs)
                num_element_checked += 1
                num_split_element_checked += has_split
        except AssertionError as e:
            raise AssertionError(
                f"seed {seed} (dp_size={dp_size}, bucket_numel={requested}, alignment={alignment})"
            ) from e
        num_split += has_split
    # The generator must actually exercise the interesting paths.
    assert num_element_checked >= NUM_RANDOM_CASES // 3
    assert num_split >= NUM_RANDOM_CASES // 5
    assert num_split_element_checked >= NUM_RANDOM_CASES // 10


def test_hand_worked_example():
    f32, bf16 = torch.float32, torch.bfloat16
    specs = [
        ParamSpec("a", (3,), f32, "u0"),
        ParamSpec("b", (5,), f32, "u0"),
        ParamSpec("c", (2, 3), f32, "u0"),
        ParamSpec("d", (0, 4), f32, "u0"),
        ParamSpec("e", (2,), bf16, "u0"),
        ParamSpec("f", (5, 8), bf16, "u0"),
        ParamSpec("g", (), bf16, "u1"),
    ]
    # dp 2 x alignment 4: rows of 8 elements; requested 10 -> effective bucket of 16.
    layout = build_layout(specs, dp_size=2, bucket_numel=10, alignment=4)
    assert layout.bucket_numel == 16
    placed = [
        [(s.name, s.bucket_offset, s.param_offset, s.numel) for s in bk.slots]
        for bk in layout.buckets
    ]
    assert placed == [
        [("a", 0, 0, 3), ("b", 4, 0, 5)],  # b starts at the next multiple of 4; c (6) at 12 > 16
        [("c", 0, 0, 6), ("d", 8, 0, 0)],  # zero-element d at the aligned end, costs nothing
        [("e", 0, 0, 2)],  # dtype change
        [("f", 0, 0, 16)],  # 40 > 16: split 16 + 16 + 8
        [("f", 0, 16, 16)],
        [("f", 0, 32, 8)],
        [("g", 0, 0, 1)],  # unit change
    ]
    assert [bk.numel_unpadded for bk in layout.buckets] == [9, 8, 2, 16, 16, 8, 1]
    assert [bk.padded_numel for bk in layout.buckets] == [16, 8, 8, 16, 16, 8, 8]
    assert [bk.shard_numel for bk in layout.buckets] == [8, 4, 4, 8, 8, 4, 4]
    bucket0 = layout.buckets[0]
    assert [(s.name, lo, hi) for s, lo, hi in bucket0.owned_pieces(0)] == [("a", 0, 3), ("b", 0, 4)]
    assert [(s.name, lo, hi) for s, lo, hi in bucket0.owned_pieces(1)] == [("b", 4, 5)]
    # Bucket 1 (padded 8): rank 1 owns [4, 8), i.e. the tail of c; the zero-element d is never listed.
    assert [(s.name, lo, hi) for s, lo, hi in layout.buckets[1].owned_pieces(1)] == [("c", 4, 6)]
    assert layout.units == ("u0", "u1")
    assert layout.buckets_of_unit("u0") == (0, 1, 2, 3, 4, 5)
    assert layout.buckets_of_unit("u1") == (6,)
    assert layout.total_padded_numel == 80
    assert layout.shard_numel_per_rank == 40


def test_unsplittable_param_gets_one_oversized_bucket_of_its_own():
    u8, f32 = torch.uint8, torch.float32
    specs = [
        ParamSpec("small", (3,), u8, "u0", splittable=False),
        ParamSpec("big", (5, 8), u8, "u0", splittable=False),
        ParamSpec("after", (2,), u8, "u0"),
        ParamSpec("split", (40,), f32, "u0"),
    ]
    layout = build_layout(specs, dp_size=2, bucket_numel=10, alignment=4)
    placed = [[(s.name, s.param_offset, s.numel) for s in bk.slots] for bk in layout.buckets]
    assert placed == [
        [("small", 0, 3)],  # fits: an unsplittable parameter packs like any other
        [("big", 0, 40)],  # 40 > 16 and unsplittable: one bucket, padded to 40 (> 16)
        [("after", 0, 2)],  # the oversized bucket is closed
        [("split", 0, 16)],
        [("split", 16, 16)],
        [("split", 32, 8)],
    ]
    big = layout.buckets[1]
    assert (big.padded_numel, big.shard_numel) == (40, 20)
    # Each rank owns one contiguous range of the whole parameter.
    assert [(s.name, lo, hi) for s, lo, hi in big.owned_pieces(0)] == [("big", 0, 20)]
    assert [(s.name, lo, hi) for s, lo, hi in big.owned_pieces(1)] == [("big", 20, 40)]
    with pytest.raises(ValueError, match="splittable must be a bool"):
        ParamSpec("x", (1,), u8, splittable="no")


def test_own_bucket_param_has_the_same_shards_whatever_its_neighbours():
    """The tied embedding's two copies (first and last pipeline stage) get equal owned ranges."""
    f32 = torch.float32
    first = [
        ParamSpec("emb", (13, 5), f32, "root", own_bucket=True),
        ParamSpec("pos", (7,), f32, "root"),
    ]
    last = [
        ParamSpec("norm", (5,), f32, "root"),
        ParamSpec("out", (13, 5), f32, "root", own_bucket=True),
        ParamSpec("norm_bias", (5,), f32, "root"),
    ]
    for bucket_numel in (1000, 24):  # alone in one bucket; split over three
        a = build_layout(first, dp_size=3, bucket_numel=bucket_numel, alignment=4)
        b = build_layout(last, dp_size=3, bucket_numel=bucket_numel, alignment=4)
        for layout, name in ((a, "emb"), (b, "out")):
            for index in {s.bucket_index for s in layout.slots_of(name)}:
                assert [s.name for s in layout.buckets[index].slots] == [name]

        def owned(layout, name, rank):
            return [
                (s.param_offset + lo, s.param_offset + hi)
                for bucket in layout.buckets
                for s, lo, hi in bucket.owned_pieces(rank)
                if s.name == name
            ]

        for rank in range(3):
            assert owned(a, "emb", rank) == owned(b, "out", rank), (bucket_numel, rank)
        assert sorted(x for r in range(3) for x in owned(a, "emb", r))[0][0] == 0
    # Without the flag the neighbours shift the shards.
    plain = build_layout(
        [ParamSpec("norm", (5,), f32, "root"), ParamSpec("out", (13, 5), f32, "root")], 3, 1000, 4
    )
    assert [s.name for s in plain.buckets[0].slots] == ["norm", "out"]
    with pytest.raises(ValueError, match="own_bucket must be a bool"):
        ParamSpec("x", (1,), f32, own_bucket=1)


def test_zero_element_params_alone_still_get_a_nonempty_bucket():
    specs = [
        ParamSpec("w", (10,), torch.float32, "a"),
        ParamSpec("empty1", (0,), torch.float16, "b"),
        ParamSpec("empty2", (4, 0), torch.float16, "b"),
        ParamSpec("v", (3,), torch.float32, "a"),
    ]
    layout = build_layout(specs, dp_size=4, bucket_numel=100, alignment=2)
    _check_layout(layout, specs, 100)
    _check_elements(layout, specs)
    empty_bucket = layout.buckets[layout.slots_of("empty1")[0].bucket_index]
    assert empty_bucket.numel_unpadded == 0
    assert empty_bucket.padded_numel == 8
    assert all(empty_bucket.owned_pieces(r) == [] for r in range(4))
    assert layout.slots_of("empty2")[0].bucket_index == empty_bucket.index


def test_empty_param_list_gives_zero_buckets():
    layout = build_layout([], dp_size=8)
    assert layout.buckets == ()
    assert layout.units == ()
    assert layout.total_padded_numel == 0
    assert len(layout.fingerprint()) == 64


def test_a_param_exactly_bucket_sized_is_not_split_and_one_more_element_is():
    for numel, num_pieces in ((128, 1), (129, 2), (256, 2), (257, 3)):
        layout = build_layout([ParamSpec("w", (numel,), torch.bfloat16)], 4, 128, 32)
        assert layout.bucket_numel == 128
        assert len(layout.slots_of("w")) == num_pieces, numel


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dp_size": 0}, "dp_size"),
        ({"bucket_numel": 0}, "bucket_numel"),
        ({"alignment": 0}, "alignment"),
        ({"dp_size": 2.0}, "dp_size"),
    ],
)
def test_bad_sizes_are_rejected(kwargs, match):
    args = {"dp_size": 2, "bucket_numel": 100, "alignment": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_layout([ParamSpec("w", (3,), torch.float32)], **args)


def test_bad_params_are_rejected_naming_the_param():
    w = ParamSpec("layers.0.w", (3,), torch.float32)
    with pytest.raises(ValueError, match=r"duplicate parameter name 'layers.0.w'"):
        build_layout([w, ParamSpec("x", (1,), torch.float32), w], 2)
    with pytest.raises(ValueError, match=r"'layers.1.w': negative dimension"):
        ParamSpec("layers.1.w", (3, -1), torch.float32)
    with pytest.raises(ValueError, match=r"'layers.2.w': dtype must be a torch.dtype"):
        ParamSpec("layers.2.w", (3,), "float32")
    with pytest.raises(ValueError, match=r"'layers.3.w': shape"):
        ParamSpec("layers.3.w", (3, 1.5), torch.float32)
    with pytest.raises(ValueError, match=r"params\[1\] must be a ParamSpec"):
        build_layout([w, ("x", (1,), torch.float32)], 2)
    layout = build_layout([w], 2)
    with pytest.raises(ValueError, match=r"'nope' is not in the layout"):
        layout.slots_of("nope")
    with pytest.raises(ValueError, match=r"unit 'nope'"):
        layout.buckets_of_unit("nope")
    assert ParamSpec("s", torch.Size([2, 3]), torch.float32).shape == (2, 3)


def _mutations(specs: list[ParamSpec], rng: random.Random):
    """Yield (mutated specs, changed param name, field word expected in the message)."""
    i = rng.randrange(len(specs))
    spec = specs[i]

    def replaced(new: ParamSpec) -> list[ParamSpec]:
        return [*specs[:i], new, *specs[i + 1 :]]

    yield (
        replaced(ParamSpec(spec.name, (*spec.shape, 1), spec.dtype, spec.unit)),
        spec.name,
        "shape",
    )
    other_dtype = next(d for d in DTYPES if d != spec.dtype)
    yield replaced(ParamSpec(spec.name, spec.shape, other_dtype, spec.unit)), spec.name, "dtype"
    yield replaced(ParamSpec(spec.name, spec.shape, spec.dtype, spec.unit + "x")), spec.name, "unit"
    yield (
        replaced(ParamSpec(spec.name, spec.shape, spec.dtype, spec.unit, not spec.splittable)),
        spec.name,
        "splittable",
    )
    yield (
        replaced(
            ParamSpec(spec.name, spec.shape, spec.dtype, spec.unit, own_bucket=not spec.own_bucket)
        ),
        spec.name,
        "own_bucket",
    )
    yield (
        replaced(ParamSpec(spec.name + "_r", spec.shape, spec.dtype, spec.unit)),
        spec.name,
        "missing",
    )
    yield [*specs[:i], *specs[i + 1 :]], spec.name, "missing"
    extra = ParamSpec("extra.param", (2,), spec.dtype, spec.unit)
    yield [*specs[: i + 1], extra, *specs[i + 1 :]], "extra.param", "extra"
    if len(specs) > 1:
        j = (i + 1) % len(specs)
        swapped = list(specs)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        yield swapped, specs[min(i, j)].name, "order"


def test_fingerprint_is_stable_and_changes_with_any_field_of_any_param():
    rng = random.Random(1234)
    num_checked = 0
    for seed in range(60):
        specs, dp_size, requested, alignment = _random_case(seed)
        if not specs:
            continue
        layout = build_layout(specs, dp_size, requested, alignment)
        # Equal inputs (fresh objects) give equal layouts and fingerprints.
        copies = [ParamSpec(s.name, tuple(s.shape), s.dtype, s.unit) for s in specs]
        again = build_layout(copies, dp_size, requested, alignment)
        assert again == layout
        assert again.fingerprint() == layout.fingerprint()
        check_same_layout(layout, [again.records(), layout.records()])
        assert first_difference(layout.records(), again.records(), 1) is None
        for mutated, name, field in _mutations(specs, rng):
            other = build_layout(mutated, dp_size, requested, alignment)
            assert other.fingerprint() != layout.fingerprint(), (seed, name, field)
            with pytest.raises(ValueError) as info:
                check_same_layout(layout, [layout.records(), other.records()])
            message = str(info.value)
            assert "rank 1" in message, message
            assert repr(name) in message, message
            assert field in message, message
            num_checked += 1
        for change in ({"dp_size": dp_size + 1}, {"alignment": alignment + 1}):
            args = {"dp_size": dp_size, "bucket_numel": requested, "alignment": alignment}
            assert build_layout(specs, **{**args, **change}).fingerprint() != layout.fingerprint()
        bigger = build_layout(specs, dp_size, layout.bucket_numel + 1, alignment)
        assert bigger.fingerprint() != layout.fingerprint()
    assert num_checked >= 200


def test_first_difference_names_the_field_and_the_rank():
    f32 = torch.float32
    mine = build_layout([ParamSpec("a", (2,), f32), ParamSpec("b", (3,), f32)], 2).records()
    shape = build_layout([ParamSpec("a", (2,), f32), ParamSpec("b", (4,), f32)], 2).records()
    message = first_difference(mine, shape, 3)
    assert message is not None
    assert "rank 3" in message
    assert "'b'" in message
    assert "shape" in message
    assert "[3]" in message
    assert "[4]" in message
    assert "'b' is missing on rank 5" in first_difference(mine, mine[:1], 5)
    assert "'b' on rank 5 is extra" in first_difference(mine[:1], mine, 5)
    with pytest.raises(ValueError, match="rank 2: malformed layout record"):
        first_difference(mine, ["not json"], 2)


KNOWN_SPECS = (
    ("embedding.word_embeddings.weight", (32, 8), "bfloat16", "embedding"),
    ("decoder.layers.0.self_attention.linear_qkv.weight", (24, 8), "bfloat16", "layers.0"),
    ("decoder.layers.0.self_attention.linear_qkv.bias", (24,), "float32", "layers.0"),
    ("decoder.final_layernorm.weight", (8,), "float32", ""),
)
KNOWN_FINGERPRINT = "c8bdca47f1b8ff71962da2e7bcf39772acfb6ea5ae6cad8866546b57dd153d0f"  # version 3


def _known_layout() -> Layout:
    specs = [ParamSpec(n, s, getattr(torch, d), u) for n, s, d, u in KNOWN_SPECS]
    return build_layout(specs, dp_size=4, bucket_numel=1000, alignment=64)


def test_known_fingerprint_and_import_without_megatron():
    """Same fingerprint in a fresh interpreter with another hash seed, where megatron cannot be imported."""
    layout = _known_layout()
    assert layout.fingerprint() == KNOWN_FINGERPRINT
    script = textwrap.dedent(
        """
        import sys
        sys.modules["megatron"] = None  # any import of megatron now raises ImportError
        import torch
        import megatron_odc.core.layout as layout_mod
        from tests.core.test_layout import _known_layout
        assert not [m for m in sys.modules if m.startswith("megatron.")], "megatron imported"
        sys.stdout.write(_known_layout().fingerprint())
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONHASHSEED": "987654"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == KNOWN_FINGERPRINT
