"""The unsharded-state budget: which units keep their parameters and gradients for a whole minibatch.

Owns :func:`parse_budget` (the values of ``--odc-unsharded-budget``) and :func:`choose_kept_units`.

[Note: kept units]
A *kept* unit is fetched at its first use in a minibatch and stays unsharded until the minibatch's
fence: later forwards and backwards, in this microbatch and the rank's next ones, use the same copy
(parameters do not change inside a minibatch). Its gradients accumulate in one local fp32 buffer over
all of the rank's microbatches and are pushed once, at ``finish_minibatch``, before the fence. A rank
with M microbatches thus moves a kept unit once each way instead of 2M fetches and M pushes; the
fence, the owners' accumulators and the optimizer step are unchanged, so the result is the same sum
(in another order of fp32 additions). The cost is memory: the unit's unsharded parameters and its
fp32 gradient buffer stay allocated from its first use to the fence. ``none`` keeps nothing (ZeRO-3,
the default); ``all`` keeps every unit (ZeRO-2-like traffic; at rest, between minibatches, memory is
still ZeRO-3's).

Which units get a budget of B bytes (the same answer on every rank: it depends on the layout only):
a unit costs ``padded elements x (parameter bytes + gradient bytes)`` while kept, and saves per
minibatch ``(2M - 1)`` fetches and ``(M - 1)`` pushes of those elements. Under a bandwidth model
every kept byte saves the same time; what differs between units is the per-transfer overhead (one
transfer per bucket per owner), so units are ranked by buckets per kept byte, then the root unit
(its fetch opens every forward with no compute before it to overlap), then forward order; they are
taken greedily while they fit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch

from megatron_odc.core.layout import Layout

__all__ = ["BUDGET_ALL", "BUDGET_NONE", "choose_kept_units", "parse_budget", "unit_kept_nbytes"]

BUDGET_NONE = "none"
"""Keep nothing: every unit is fetched and pushed per use (ZeRO-3)."""
BUDGET_ALL = "all"
"""Keep every unit for the whole minibatch."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$")


def parse_budget(value: str | int | float) -> float:
    """The budget in bytes: ``"none"`` -> 0, ``"all"`` -> infinity, else a size such as ``2GiB``,
    ``500MB``, ``1e9`` or ``123456`` (decimal K/M/G/T and binary KiB/MiB/GiB/TiB suffixes).

    Raises:
        ValueError: not one of those (the message names the flag and the accepted forms).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"--odc-unsharded-budget must be >= 0 bytes, got {value!r}")
        return float(value)
    text = str(value).strip().lower()
    if text == BUDGET_NONE:
        return 0.0
    if text == BUDGET_ALL:
        return math.inf
    match = _SIZE.match(text)
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(
            f"--odc-unsharded-budget {value!r} is not '{BUDGET_NONE}', '{BUDGET_ALL}' or a size in "
            "bytes such as 2GiB, 500MB or 1e9"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


def unit_kept_nbytes(layout: Layout, unit: str, grad_dtype: torch.dtype) -> int:
    """Bytes a kept unit holds: its unsharded parameters and its gradient buffer."""
    grad_size = torch.empty((), dtype=grad_dtype).element_size()
    total = 0
    for bucket in layout.buckets:
        if bucket.unit == unit:
            param_size = torch.empty((), dtype=bucket.dtype).element_size()
            total += bucket.padded_numel * (param_size + grad_size)
    return total


def choose_kept_units(
    layout: Layout,
    budget: str | int | float,
    *,
    grad_dtype: torch.dtype = torch.float32,
    root_unit: str | None = None,
    forward_order: Iterable[str] | None = None,
) -> frozenset[str]:
    """The units kept for whole minibatches under ``budget`` (see [Note: kept units]).

    Args:
        layout: the engine's layout (identical on every DP rank).
        budget: a :func:`parse_budget` value.
        grad_dtype: dtype of the unsharded gradient buffers.
        root_unit: the unit of the parameters outside every unit module, if any.
        forward_order: units in forward order (default: layout order).

    Returns:
        The kept units; every unit for ``all``, none for ``none``.
    """
    nbytes = parse_budget(budget)
    units = list(layout.units)
    if nbytes == math.inf:
        return frozenset(units)
    order = list(forward_order) if forward_order is not None else units
    position = {unit: i for i, unit in enumerate(order)}
    sizes = {unit: unit_kept_nbytes(layout, unit, grad_dtype) for unit in units}
    buckets = {unit: sum(1 for b in layout.buckets if b.unit == unit) for unit in units}

    def rank(unit: str) -> tuple:
        per_byte = buckets[unit] / sizes[unit] if sizes[unit] else math.inf
        return (-per_byte, unit != root_unit, position.get(unit, len(order)), unit)

    kept, used = [], 0
    for unit in sorted(units, key=rank):
        if used + sizes[unit] <= nbytes:
            kept.append(unit)
            used += sizes[unit]
    return frozenset(kept)
