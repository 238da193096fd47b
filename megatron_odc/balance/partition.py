"""Number partitioning for length balancing: Karmarkar-Karp, local-search refinement, greedy LPT, FFD.

Owns the pure-Python partitioners that split item costs into ``k`` parts of balanced total cost, and the
token-capped helpers the plans use to pack microbatches. Every function is deterministic: items are ordered
by (cost descending, index ascending) and ties are broken by index, so every rank computes the same result
from the same input with no communication. Entry points: :func:`balanced_partition` (KK + refine),
:func:`karmarkar_karp`, :func:`refine`, :func:`greedy_lpt`, :func:`first_fit_decreasing`,
:func:`first_fit`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Container, Iterable, Sequence

__all__ = [
    "balanced_partition",
    "first_fit_decreasing",
    "greedy_lpt",
    "karmarkar_karp",
    "part_costs",
    "refine",
    "repair_cap",
]

# Relative slack below which a change of a part cost does not count as an improvement (float noise).
_REL_EPS = 1e-12


def _check_inputs(costs: Sequence[float], k: int) -> None:
    if k < 1:
        raise ValueError(f"number of parts k must be >= 1, got {k}")
    for index, cost in enumerate(costs):
        if not math.isfinite(cost) or cost < 0:
            raise ValueError(f"cost of item {index} must be finite and >= 0, got {cost}")


def part_costs(costs: Sequence[float], parts: Sequence[Sequence[int]]) -> list[float]:
    """Returns the total cost of each part."""
    return [math.fsum(costs[i] for i in part) for part in parts]


def _ordered(costs: Sequence[float], parts: list[list[int]]) -> list[list[int]]:
    """Sorts items inside each part ascending and parts by (cost descending, first index); empty last."""
    sorted_parts = [sorted(part) for part in parts]
    loads = part_costs(costs, sorted_parts)
    order = sorted(
        range(len(sorted_parts)),
        key=lambda j: (-loads[j], sorted_parts[j][0] if sorted_parts[j] else math.inf, j),
    )
    return [sorted_parts[j] for j in order]


def karmarkar_karp(costs: Sequence[float], k: int, *, equal_count: bool = False) -> list[list[int]]:
    """Splits items into ``k`` parts with the k-way largest differencing method.

    Every item starts as a k-set state (the item in one set, the others empty). With ``equal_count``, items are
    sorted and grouped ``k`` at a time (zero-cost padding completes the last group), one item per set, so part
    sizes differ by at most one. The two states of largest spread (max set cost - min set cost) are merged,
    the heaviest set of one with the lightest set of the other, until one state remains.

    Args:
        costs: non-negative item costs.
        k: number of parts.
        equal_count: keep part sizes within one of each other.

    Returns:
        ``k`` lists of item indices, each sorted ascending, parts ordered by cost descending then by first
        index; parts may be empty when there are fewer than ``k`` items.
    """
    _check_inputs(costs, k)
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    # A state is a list of k (cost, items) sets sorted by cost descending; the heap pops the largest spread,
    # ties by creation order (which follows the item order above).
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    if equal_count:
        padded: list[int | None] = [*order, *([None] * (-len(order) % k))]
        groups = [padded[start : start + k] for start in range(0, len(padded), k)]
        for group in groups:
            sets = [(0.0, []) if i is None else (float(costs[i]), [i]) for i in group]
            heap.append((-(sets[0][0] - sets[-1][0]), len(heap), sets))
    else:
        for i in order:
            sets = [(float(costs[i]), [i])] + [(0.0, []) for _ in range(k - 1)]
            heap.append((-float(costs[i]), len(heap), sets))
    if not heap:
        return [[] for _ in range(k)]
    heapq.heapify(heap)
    next_id = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = [
            (first[j][0] + second[k - 1 - j][0], first[j][1] + second[k - 1 - j][1])
            for j in range(k)
        ]
        merged.sort(key=lambda s: -s[0])  # stable: equal costs keep their position
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next_id, merged))
        next_id += 1
    return _ordered(costs, [items for _, items in heap[0][2]])


def greedy_lpt(costs: Sequence[float], k: int) -> list[list[int]]:
    """Longest-processing-time greedy: each item, heaviest first, goes to the lightest part (lowest index).

    Returns:
        ``k`` parts as in :func:`karmarkar_karp`.
    """
    _check_inputs(costs, k)
    loads = [(0.0, j) for j in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, j = heapq.heappop(loads)
        parts[j].append(i)
        heapq.heappush(loads, (load + costs[i], j))
    return _ordered(costs, parts)


def first_fit_decreasing(tokens: Sequence[int], cap_tokens: int) -> list[list[int]]:
    """Packs items into the fewest bins it finds: largest first, each into the first bin with room.

    Args:
        tokens: item sizes in tokens; each must be ``<= cap_tokens``.
        cap_tokens: bin capacity.

    Returns:
        Bins of item indices in creation order (each sorted ascending).

    Raises:
        ValueError: an item is larger than the capacity.
    """
    order = sorted(range(len(tokens)), key=lambda i: (-tokens[i], i))
    for i in order:
        if tokens[i] > cap_tokens:
            raise ValueError(f"item {i} has {tokens[i]} tokens, more than cap_tokens={cap_tokens}")
    return [sorted(b) for b in first_fit(order, tokens, cap_tokens)]


def first_fit(
    order: Iterable[int],
    tokens: Sequence[int],
    cap_tokens: int | None,
    *,
    alone: Container[int] = (),
) -> list[list[int]]:
    """Packs items in the given order, each into the first bin with room for it.

    Args:
        order: item indices, in the order they are placed.
        tokens: item sizes in tokens.
        cap_tokens: bin capacity; ``None``: no cap (every item joins the first open bin).
        alone: items that get a bin of their own, which nothing else joins.

    Returns:
        Bins of item indices in creation order, each in placement order.
    """
    bins: list[list[int]] = []
    used: list[int | None] = []  # None: a closed bin
    for i in order:
        if i in alone:
            bins.append([i])
            used.append(None)
            continue
        for j, used_tokens in enumerate(used):
            if used_tokens is not None and (
                cap_tokens is None or used_tokens + tokens[i] <= cap_tokens
            ):
                bins[j].append(i)
                used[j] = used_tokens + tokens[i]
                break
        else:
            bins.append([i])
            used.append(tokens[i])
    return bins


def repair_cap(
    costs: Sequence[float], tokens: Sequence[int], parts: Sequence[Sequence[int]], cap_tokens: int
) -> list[list[int]] | None:
    """Moves and swaps items until no part holds more than ``cap_tokens`` tokens.

    Each step takes the part with the largest excess and applies the move (or swap) that leaves it the smallest
    excess without pushing another part over the cap, preferring the lower resulting cost. The total excess
    strictly decreases, so it terminates.

    Returns:
        The repaired parts (positions kept, items sorted), or ``None`` if it got stuck.
    """
    work = [list(p) for p in parts]
    toks = [sum(tokens[i] for i in p) for p in work]
    loads = part_costs(costs, work)
    while True:
        over = [j for j in range(len(work)) if toks[j] > cap_tokens]
        if not over:
            return [sorted(p) for p in work]
        h = max(over, key=lambda j: (toks[j] - cap_tokens, -j))
        best: tuple | None = None
        for p in range(len(work)):
            if p == h:
                continue
            for x in work[h]:
                if tokens[x] > 0 and toks[p] + tokens[x] <= cap_tokens:
                    key = (max(0, toks[h] - tokens[x] - cap_tokens), loads[p] + costs[x])
                    if best is None or key < best[0]:
                        best = (key, p, x, None)
                for y in work[p]:
                    delta = tokens[x] - tokens[y]
                    if delta > 0 and toks[p] + delta <= cap_tokens:
                        key = (max(0, toks[h] - delta - cap_tokens), loads[p] + costs[x] - costs[y])
                        if best is None or key < best[0]:
                            best = (key, p, x, y)
        if best is None:
            return None
        _, p, x, y = best
        _exchange(costs, tokens, work, loads, toks, h, p, (x,), () if y is None else (y,))


# Pair exchanges (2-for-1, 1-for-2) are tried only while len(heavy)**2 * len(light) stays under this many
# candidates, so refinement of large minibatches stays fast (single moves and 1-for-1 swaps always run).
_MAX_PAIR_EXCHANGES = 20_000


def _exchanges(
    costs, tokens, heavy: list[int], light: list[int], *, equal_count: bool, pairs: bool
):
    """Yields (cost moved, tokens moved, items out of heavy, items out of light) from heavy to light.

    Candidates: single moves and 1-for-1 swaps, or, with ``pairs`` (and while small enough), 2-for-1 and
    1-for-2 swaps. With ``equal_count`` only exchanges that keep the two part sizes within one of each other
    are yielded.
    """
    num_h, num_l = len(heavy), len(light)
    singles_h = [(costs[x], tokens[x], (x,)) for x in heavy]
    singles_l = [(costs[y], tokens[y], (y,)) for y in light]
    options_h = [singles_h]
    options_l = [[(0.0, 0, ())], singles_l]
    if pairs:
        if max(num_h, num_l) ** 2 * min(num_h, num_l) > _MAX_PAIR_EXCHANGES:
            return
        options_h.append(
            [
                (costs[x] + costs[x2], tokens[x] + tokens[x2], (x, x2))
                for a, x in enumerate(heavy)
                for x2 in heavy[a + 1 :]
            ]
        )
        options_l.append(
            [
                (costs[y] + costs[y2], tokens[y] + tokens[y2], (y, y2))
                for b, y in enumerate(light)
                for y2 in light[b + 1 :]
            ]
        )
    for num_out, outs in enumerate(options_h, start=1):
        for num_in, ins in enumerate(options_l):
            if num_out + num_in > 3 or (num_out + num_in == 3) != pairs:
                continue
            if equal_count and abs((num_h - num_out + num_in) - (num_l + num_out - num_in)) > max(
                1, abs(num_h - num_l)
            ):
                continue
            for cost_x, tok_x, xs in outs:
                for cost_y, tok_y, ys in ins:
                    yield cost_x - cost_y, tok_x - tok_y, xs, ys


def _exchange(costs, tokens, work, loads, toks, h, p, xs, ys) -> None:
    """Moves items xs from part h to part p and items ys from p to h."""
    for items, src, dst in ((xs, h, p), (ys, p, h)):
        for item in items:
            work[src].remove(item)
            work[dst].append(item)
            loads[src] -= costs[item]
            loads[dst] += costs[item]
            toks[src] -= tokens[item]
            toks[dst] += tokens[item]


def _best_exchange(costs, tok, work, loads, toks, h, eps, equal_count, cap_tokens, *, pairs):
    """Returns (score, p, xs, ys) of the best exchange out of heavy part h, or None.

    The new max of parts h and p after the exchange is ``loads[h] - score``; only scores above ``eps`` count.
    """
    best = None
    for p in range(len(work)):
        gap = loads[h] - loads[p]
        if p == h or gap <= eps:
            continue
        room = None if cap_tokens is None else cap_tokens - toks[p]
        h_limit = None if cap_tokens is None else max(cap_tokens, toks[h]) - toks[h]
        for delta, moved_tokens, xs, ys in _exchanges(
            costs, tok, work[h], work[p], equal_count=equal_count, pairs=pairs
        ):
            score = delta if delta < gap - delta else gap - delta
            if score <= eps or (best is not None and score <= best[0]):
                continue
            if room is not None and (moved_tokens > room or -moved_tokens > h_limit):
                continue
            best = (score, p, xs, ys)
    return best


def refine(
    costs: Sequence[float],
    parts: Sequence[Sequence[int]],
    *,
    equal_count: bool = False,
    max_rounds: int | None = None,
    tokens: Sequence[int] | None = None,
    cap_tokens: int | None = None,
    rel_tol: float = 1e-6,
) -> list[list[int]]:
    """Local search that lowers the cost of the heaviest part by single moves and pairwise swaps.

    Each round takes the heaviest part (lowest index on ties) and applies the move of one item to another part,
    or the swap of two items, that gives the smallest new max of the two parts, provided that max is below the
    heaviest part's cost. The sorted vector of part costs strictly decreases, so the search terminates; it also
    stops after ``max_rounds`` rounds. Moves are only allowed from a larger to a smaller part when
    ``equal_count`` is set, so part sizes stay within one of each other; with ``cap_tokens``, no change may
    push a part over the cap (parts already over it are not made worse by a move out).

    Args:
        costs: item costs.
        parts: a partition of the item indices.
        equal_count: keep part sizes within one (the input must already satisfy it).
        max_rounds: round limit; default ``4 * len(costs) + 16``.
        tokens: item sizes in tokens, required with ``cap_tokens``.
        cap_tokens: token cap per part.
        rel_tol: stop once the heaviest part is within this relative distance of the lower bound
            max(mean part cost, largest item cost).

    Returns:
        The refined parts in the same positions, items sorted ascending in each part.
    """
    if cap_tokens is not None and tokens is None:
        raise ValueError("refine: cap_tokens needs tokens")
    work = [list(p) for p in parts]
    if not work:
        return work
    loads = part_costs(costs, work)
    toks = [sum(tokens[i] for i in p) for p in work] if tokens is not None else [0] * len(work)
    tok = tokens if tokens is not None else [0] * len(costs)
    rounds = 4 * len(costs) + 16 if max_rounds is None else max_rounds
    # Stop once the heaviest part is within rel_tol of a lower bound on any partition's heaviest part.
    lower_bound = max(math.fsum(costs[i] for p in work for i in p) / len(work), 0.0)
    lower_bound = max([lower_bound, *(costs[i] for p in work for i in p)])
    for _ in range(rounds):
        h = max(range(len(work)), key=lambda j: (loads[j], -j))
        if loads[h] <= lower_bound * (1.0 + rel_tol):
            break
        eps = _REL_EPS * max(abs(loads[h]), 1.0)
        best = None
        for pairs in (False, True):  # pair exchanges only when no single exchange improves
            best = _best_exchange(
                costs, tok, work, loads, toks, h, eps, equal_count, cap_tokens, pairs=pairs
            )
            if best is not None:
                break
        if best is None:
            break
        _, p, xs, ys = best
        _exchange(costs, tok, work, loads, toks, h, p, xs, ys)
    return [sorted(p) for p in work]


def balanced_partition(
    costs: Sequence[float], k: int, *, equal_count: bool = False
) -> list[list[int]]:
    """Karmarkar-Karp followed by :func:`refine`: the default balanced k-way split.

    Without ``equal_count`` the refined greedy LPT split is computed too and kept if its heaviest part is
    strictly lighter, so the result is never worse than LPT.

    Returns:
        ``k`` parts as in :func:`karmarkar_karp` (ordered by cost descending, then first index).
    """
    best = refine(costs, karmarkar_karp(costs, k, equal_count=equal_count), equal_count=equal_count)
    if not equal_count:
        lpt = refine(costs, greedy_lpt(costs, k))
        if max(part_costs(costs, lpt), default=0.0) < max(part_costs(costs, best), default=0.0):
            best = lpt
    return _ordered(costs, best)
