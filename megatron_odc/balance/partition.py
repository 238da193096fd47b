"""Number partitioning for length balancing: Karmarkar-Karp, local-search refinement, greedy LPT, FFD.

Owns the partitioners that split item costs into ``k`` parts of balanced total cost, and the token-capped
helpers the plans use to pack microbatches. Every function is deterministic: items are ordered by (cost
descending, index ascending) and ties are broken by index, so every rank computes the same result from the
same input with no communication (no set or dict iteration order, no hashing of floats, no threads, no
time-based limits: every work bound counts candidates). Entry points: :func:`balanced_partition` (KK +
refine), :func:`karmarkar_karp`, :func:`refine`, :func:`greedy_lpt`, :func:`first_fit_decreasing`,
:func:`first_fit`, :func:`repair_cap`.

[Note: planner speed]
The search is vectorised with numpy but keeps the exact choice rules (scores, tie-breaks by part index and
by the enumeration order of the candidates) of the plain loops it replaced, so on small inputs the results
are identical to them. What bounds the work on large inputs (thousands of samples, hundreds of ranks):
- Karmarkar-Karp keeps only the non-empty sets of a state (the others cost 0) and links merged sets in a
  union-find forest instead of copying item lists; a merge costs O(changed sets) plus a list insert.
- :func:`refine` looks for the best exchange of the heaviest part in the lightest parts first and skips
  every part whose gap to the heaviest part cannot beat the best exchange found (a score is at most half the
  gap), so the result is that of the full search; only when more than ``_MAX_PARTNERS`` parts are still
  eligible does it look at the ``_MAX_PARTNERS`` lightest of them. Its rounds are capped by ``max_rounds``.
- :func:`repair_cap` looks at every part while there are at most ``_MAX_PARTNERS`` of them; beyond that at
  the ``_REPAIR_PARTNERS`` lightest and the ``_REPAIR_PARTNERS`` emptiest (in tokens) parts first, and at all
  parts only when those offer no move.
- :func:`first_fit` finds the first bin with room in a segment tree (O(log bins) per item).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Container, Iterable, Sequence

import numpy as np

__all__ = [
    "balanced_partition",
    "first_fit",
    "first_fit_decreasing",
    "greedy_lpt",
    "heaviest_lower_bound",
    "karmarkar_karp",
    "part_costs",
    "refine",
    "repair_cap",
]

# Relative slack below which a change of a part cost does not count as an improvement (float noise).
_REL_EPS = 1e-12

# Pair exchanges (2-for-1, 1-for-2) between two parts are tried only while len(larger)**2 * len(smaller)
# stays under this many candidates (single moves and 1-for-1 swaps always run).
_MAX_PAIR_EXCHANGES = 20_000

# refine / repair_cap: the most partner parts examined in one round beyond the first, lightest ones (see
# [Note: planner speed]); with at most this many parts the search is exhaustive.
_MAX_PARTNERS = 64

# repair_cap on more than _MAX_PARTNERS parts: partners tried first, by load and by free tokens.
_REPAIR_PARTNERS = 32

# karmarkar_karp: a merge re-sorts the whole state instead of inserting set by set beyond this many sets.
_INSERT_LIMIT = 16

# refine: rounds whose heavy part times (items + parts) is at most this search by plain loops (cheaper than
# numpy's per-call cost on small inputs; same result).
_LOOP_LIMIT = 400

# Slack of the pruning bound of refine: a part whose half gap is below best * (1 - this) cannot win.
_PRUNE_SLACK = 1e-9


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


def _root(parent: list[int], i: int) -> int:
    """Union-find root of ``i``, compressing the path."""
    root = i
    while parent[root] != root:
        root = parent[root]
    while parent[i] != root:
        parent[i], i = root, parent[i]
    return root


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
    n = len(costs)
    if n == 0:
        return [[] for _ in range(k)]
    order = sorted(range(n), key=lambda i: (-costs[i], i))
    # A state keeps its non-empty sets only (the other k - len sets are empty, cost 0), sorted by cost
    # descending as two parallel lists: keys (= -cost, ascending) and ids (an item of the set, the root of
    # the set in the union-find forest `parent`). Equal costs keep the order the dense k-set list had.
    # The heap pops the largest spread, ties by creation order (which follows the item order above).
    parent = list(range(n))
    heap: list[tuple[float, int, list[float], list[int]]] = []
    if equal_count:
        for start in range(0, n, k):
            group = order[start : start + k]
            last = float(costs[group[-1]]) if len(group) == k else 0.0
            keys = [-float(costs[i]) for i in group]
            heap.append((-(float(costs[group[0]]) - last), len(heap), keys, group))
    else:
        for i in order:
            heap.append((-float(costs[i]), len(heap), [-float(costs[i])], [i]))
    heapq.heapify(heap)
    next_id = len(heap)
    while len(heap) > 1:
        _, _, first_keys, first_ids = heapq.heappop(heap)
        _, _, second_keys, second_ids = heapq.heappop(heap)
        keys, ids = _merge_states(first_keys, first_ids, second_keys, second_ids, k, parent)
        last = -keys[-1] if len(keys) == k else 0.0
        heapq.heappush(heap, (-(-keys[0] - last), next_id, keys, ids))
        next_id += 1
    final_ids = heap[0][3]
    index_of = {root: j for j, root in enumerate(final_ids)}
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in range(n):
        parts[index_of[_root(parent, i)]].append(i)
    return _ordered(costs, parts)


def _merge_states(
    first_keys: list[float],
    first_ids: list[int],
    second_keys: list[float],
    second_ids: list[int],
    k: int,
    parent: list[int],
) -> tuple[list[float], list[int]]:
    """Merges two KK states: set j of the first (by cost descending) with set k-1-j of the second.

    In the dense k-set view the first state's non-empty sets sit at positions [0, a) and the second's (reversed)
    at [k-b, k); ``o`` sets overlap. The untouched sets [0, a-o) stay sorted; the overlapping sums and the
    second state's other sets are sorted (stably, in dense order) and merged after equal keys of the untouched
    ones, which is the dense list's stable sort by cost.
    """
    a, b = len(first_keys), len(second_keys)
    overlap = max(0, a + b - k)
    new_keys: list[float] = []
    new_ids: list[int] = []
    for t in range(overlap):
        j, s = a - overlap + t, b - 1 - t
        new_keys.append(first_keys[j] + second_keys[s])
        new_ids.append(first_ids[j])
        parent[second_ids[s]] = first_ids[j]
    new_keys += second_keys[: b - overlap][::-1]
    new_ids += second_ids[: b - overlap][::-1]
    if len(new_keys) > 1:
        perm = sorted(range(len(new_keys)), key=new_keys.__getitem__)
        new_keys = [new_keys[p] for p in perm]
        new_ids = [new_ids[p] for p in perm]
    keys = first_keys[: a - overlap]
    ids = first_ids[: a - overlap]
    if len(new_keys) <= _INSERT_LIMIT:
        for key, item in zip(new_keys, new_ids):
            pos = bisect_right(keys, key)
            keys.insert(pos, key)
            ids.insert(pos, item)
        return keys, ids
    all_keys = keys + new_keys
    all_ids = ids + new_ids
    perm = sorted(range(len(all_keys)), key=all_keys.__getitem__)  # stable: untouched first on ties
    return [all_keys[p] for p in perm], [all_ids[p] for p in perm]


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
    order = list(order)
    bins: list[list[int]] = []
    if not order:
        return bins
    # Segment tree over bin slots of the room left in each bin (-1: closed or not opened yet); a node holds
    # the max of its leaves, so the first bin with room is found by descending from the root.
    size = 1
    while size < len(order):
        size *= 2
    tree = [-1.0] * (2 * size)
    capacity = math.inf if cap_tokens is None else cap_tokens
    for i in order:
        need = tokens[i]
        if i not in alone and tree[1] >= need:
            node = 1
            while node < size:
                node = 2 * node if tree[2 * node] >= need else 2 * node + 1
            slot = node - size
            bins[slot].append(i)
            room = tree[node] - need
        else:
            slot = len(bins)
            bins.append([i])
            room = -1.0 if i in alone else capacity - need
        node = slot + size
        tree[node] = room
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def _smallest(values: np.ndarray, count: int) -> np.ndarray:
    """Positions of the ``count`` smallest values (ties: lowest position), in ascending position order.

    Independent of the selection algorithm: the threshold value is unique, and ties at it are taken by position.
    """
    if len(values) <= count:
        return np.arange(len(values))
    threshold = np.partition(values, count - 1)[count - 1]
    below = np.flatnonzero(values < threshold)
    at = np.flatnonzero(values == threshold)[: count - len(below)]
    return np.sort(np.concatenate([below, at]))


class _Work:
    """A partition under local search: item lists (placement order matters for ties), loads, tokens.

    Loads start as ``math.fsum`` of each part and are then updated one item at a time, in the order the plain
    loops used, so every float is the same as theirs. The loops on small inputs use the Python lists; the
    vectorised search builds numpy copies on first use (:meth:`arrays`) and they are kept equal to the lists.
    """

    def __init__(self, costs, tokens, parts) -> None:
        self.cost_list = [float(c) for c in costs]
        self.token_list = [0] * len(costs) if tokens is None else [int(t) for t in tokens]
        self.parts = [list(p) for p in parts]
        self.load_list = part_costs(self.cost_list, self.parts)
        self.tok_list = [sum(self.token_list[i] for i in p) for p in self.parts]
        self.has_arrays = False

    def arrays(self) -> None:
        """Builds the numpy state: per part loads, tokens, sizes; per item cost, tokens, part, position.

        An item in no part belongs to the sentinel part ``len(parts)``.
        """
        if self.has_arrays:
            return
        self.has_arrays = True
        num_parts = len(self.parts)
        self.costs = np.array(self.cost_list, dtype=np.float64)
        self.tokens = np.array(self.token_list, dtype=np.int64)
        self.loads = np.array(self.load_list, dtype=np.float64)
        self.toks = np.array(self.tok_list, dtype=np.int64)
        self.sizes_ext = np.zeros(num_parts + 1, dtype=np.int64)  # with the sentinel part
        self.sizes = self.sizes_ext[:-1]
        self.sizes[:] = [len(p) for p in self.parts]
        self.part_of = np.full(len(self.cost_list), num_parts, dtype=np.int64)
        self.pos_of = np.zeros(len(self.cost_list), dtype=np.int64)
        self._items: dict[int, np.ndarray] = {}
        self._pairs: dict[int, tuple[np.ndarray, ...]] = {}
        for j in range(num_parts):
            self._place(j)

    def _place(self, j: int) -> None:
        items = self.items(j)
        self.part_of[items] = j
        self.pos_of[items] = np.arange(len(items))

    def items(self, j: int) -> np.ndarray:
        """Item indices of part j, in placement order."""
        if j not in self._items:
            self._items[j] = np.array(self.parts[j], dtype=np.int64)
        return self._items[j]

    def pairs(self, j: int) -> tuple[np.ndarray, ...]:
        """Pairs of items of part j in nested-loop order: (first, second, cost, tokens, index, count)."""
        if j not in self._pairs:
            items = self.items(j)
            a, b = _pair_index(len(items))
            first, second = items[a], items[b]
            self._pairs[j] = (
                first,
                second,
                self.costs[first] + self.costs[second],
                self.tokens[first] + self.tokens[second],
                np.arange(len(a)),
                np.full(len(a), len(a)),
            )
        return self._pairs[j]

    def exchange(self, h: int, p: int, xs: Sequence[int], ys: Sequence[int]) -> None:
        """Moves items xs from part h to part p and items ys from p to h."""
        for items, src, dst in ((xs, h, p), (ys, p, h)):
            for item in items:
                cost, tok = self.cost_list[item], self.token_list[item]
                self.parts[src].remove(item)
                self.parts[dst].append(item)
                self.load_list[src] -= cost
                self.load_list[dst] += cost
                self.tok_list[src] -= tok
                self.tok_list[dst] += tok
        if self.has_arrays:
            for j in (h, p):
                self.loads[j] = self.load_list[j]
                self.toks[j] = self.tok_list[j]
                self.sizes[j] = len(self.parts[j])
                self._items.pop(j, None)
                self._pairs.pop(j, None)
                self._place(j)


def _better(new, old) -> bool:
    """Whether candidate ``new`` (score, part, gen, ...) beats ``old`` (higher score, then lower part, gen)."""
    if new is None:
        return False
    if old is None:
        return True
    return new[0] > old[0] or (new[0] == old[0] and (new[1], new[2]) < (old[1], old[2]))


_PAIRS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _pair_index(m: int) -> tuple[np.ndarray, np.ndarray]:
    """All pairs (a, b), a < b < m, in the order of two nested loops."""
    if m not in _PAIRS:
        _PAIRS[m] = np.triu_indices(m, 1)
    return _PAIRS[m]


def _size_ok(num_h, num_l, num_out: int, num_in: int, equal_count: bool):
    """Whether moving num_out items out of a part of num_h and num_in back keeps sizes within one."""
    if not equal_count:
        return True
    after = abs((num_h - num_out + num_in) - (num_l + num_out - num_in))
    return not after > max(1, abs(num_h - num_l))


# Exchange shapes (items out of the heavy part, items back from the light one) tried in one round, in order.
_SINGLE_SHAPES = ((1, 0), (1, 1))
_PAIR_SHAPES = ((1, 2), (2, 1))


def _subsets(items, costs, tokens, size):
    """(cost, tokens, items) of every subset of ``size`` items (0, 1 or 2), in nested-loop order."""
    if size == 0:
        return [(0.0, 0, ())]
    if size == 1:
        return [(costs[i], tokens[i], (i,)) for i in items]
    return [
        (costs[i] + costs[j], tokens[i] + tokens[j], (i, j))
        for a, i in enumerate(items)
        for j in items[a + 1 :]
    ]


def _loop_search(work: _Work, h: int, eps: float, equal_count: bool, cap_tokens, pairs: bool):
    """The best exchange out of part h by plain loops over every part: (score, p, gen, xs, ys) or None.

    The reference rules (and the fast path on small inputs): parts by index, then the shapes in order, items
    in placement order; a candidate must score above ``eps`` and above the best so far.
    """
    costs, tokens, loads, toks = work.cost_list, work.token_list, work.load_list, work.tok_list
    heavy = work.parts[h]
    num_h = len(heavy)
    top = loads[h]
    h_limit = None if cap_tokens is None else max(cap_tokens, toks[h]) - toks[h]
    shapes = _PAIR_SHAPES if pairs else _SINGLE_SHAPES
    outs = {n: _subsets(heavy, costs, tokens, n) for n in {out for out, _ in shapes}}
    best = None
    best_score = eps
    for p, light in enumerate(work.parts):
        gap = top - loads[p]
        if p == h or gap <= eps:
            continue
        num_l = len(light)
        if pairs and max(num_h, num_l) ** 2 * min(num_h, num_l) > _MAX_PAIR_EXCHANGES:
            continue
        room = None if cap_tokens is None else cap_tokens - toks[p]
        for num_out, num_in in shapes:
            if not _size_ok(num_h, num_l, num_out, num_in, equal_count):
                continue
            ins = _subsets(light, costs, tokens, num_in)
            for cost_x, tok_x, xs in outs[num_out]:
                for cost_y, tok_y, ys in ins:
                    delta = cost_x - cost_y
                    rest = gap - delta
                    score = delta if delta < rest else rest
                    if score <= best_score:
                        continue
                    if room is not None and (tok_x - tok_y > room or tok_y - tok_x > h_limit):
                        continue
                    best_score = score
                    best = (score, p, 0, xs, ys)
    return best


class _Search:
    """The best exchange out of the heaviest part ``h`` of a :class:`_Work`, vectorised (see :func:`refine`).

    A candidate is a row (items out of h) and a column (items back from a partner part ``p``, possibly none);
    its place in the reference enumeration order of :func:`_loop_search` within part ``p`` is
    ``gen = base[column] + row * step[column]``, so ties resolve as they do there: lowest ``p``, then ``gen``.
    Arrays indexed by part have one more entry, the sentinel part of items in no part (gap 0: never valid).
    """

    def __init__(self, work: _Work, h: int, eps: float, equal_count: bool, cap_tokens) -> None:
        work.arrays()
        self.work, self.h, self.eps = work, h, eps
        self.equal_count, self.cap = equal_count, cap_tokens
        self.num_parts = len(work.parts)
        self.hx = work.items(h)
        self.cx = work.costs[self.hx]
        self.tx = work.tokens[self.hx]
        self.mh = len(self.hx)
        self.gaps = np.zeros(self.num_parts + 1)
        self.gaps[:-1] = work.loads[h] - work.loads
        if cap_tokens is not None:
            self.room = np.zeros(self.num_parts + 1, dtype=np.int64)
            self.room[:-1] = cap_tokens - work.toks
            self.h_limit = max(cap_tokens, int(work.toks[h])) - int(work.toks[h])

    def _size_ok(self, partners: np.ndarray, num_out: int, num_in: int) -> np.ndarray:
        """Per partner: whether this shape of exchange keeps the sizes within one (``equal_count``)."""
        if not self.equal_count:
            return np.ones(len(partners), dtype=bool)
        sizes = self.work.sizes[partners].tolist()
        return np.array([_size_ok(self.mh, m, num_out, num_in, True) for m in sizes], dtype=bool)

    def _columns(self, partners: np.ndarray, everyone: bool) -> np.ndarray:
        """The items of the partner parts (all items when ``everyone``: the others never score)."""
        work = self.work
        if everyone:
            return np.arange(len(work.part_of))
        member = np.zeros(self.num_parts + 1, dtype=bool)
        member[partners] = True
        return np.flatnonzero(member[work.part_of])

    def _evaluate(self, row_cost, row_tok, col_cost, col_tok, part, base, step):
        """Best candidate of the matrix rows x columns: (score, part, gen, row, column) or None."""
        if not row_cost.size or not col_cost.size:
            return None
        if self.cap is None:
            return self._nearest(row_cost, col_cost, part, base, step)
        delta = row_cost[:, None] - col_cost[None, :]
        rest = self.gaps[part][None, :] - delta
        score = np.where(delta < rest, delta, rest)
        moved = row_tok[:, None] - col_tok[None, :]
        ok = (score > self.eps) & (moved <= self.room[part][None, :]) & (-moved <= self.h_limit)
        masked = np.where(ok, score, -np.inf)
        flat = int(np.argmax(masked))
        top = masked.flat[flat]
        if top == -np.inf:
            return None
        hits = np.flatnonzero(masked == top)
        if len(hits) > 1:
            rows, cols = np.divmod(hits, len(col_cost))
            order = np.lexsort((base[cols] + rows * step[cols], part[cols]))
            flat = int(hits[order[0]])
        row, col = divmod(flat, len(col_cost))
        return float(top), int(part[col]), int(base[col] + row * step[col]), row, col

    def _nearest(self, row_cost, col_cost, part, base, step):
        """:meth:`_evaluate` without a token cap, in O((rows + columns) log rows).

        For a column, the score min(delta, gap - delta) of ``delta = row cost - column cost`` peaks at
        ``delta = gap / 2``, so the best row is the nearest one by cost below or above ``column cost + gap / 2``;
        of rows of equal cost the first (lowest gen) counts.
        """
        order = np.argsort(row_cost, kind="stable")
        costs = row_cost[order]
        # first_of_run[i]: the first sorted position holding costs[i] (equal costs sort by row).
        first_of_run = np.arange(len(costs))
        first_of_run[1:][costs[1:] == costs[:-1]] = 0
        first_of_run = np.maximum.accumulate(first_of_run)
        gap = self.gaps[part]
        above = np.searchsorted(costs, col_cost + gap * 0.5, side="left")
        below = first_of_run[np.maximum(above - 1, 0)]
        above = np.minimum(above, len(costs) - 1)
        both = np.stack([below, above])
        delta = costs[both] - col_cost
        rest = gap - delta
        score = np.where(delta < rest, delta, rest)
        rows = order[both]
        # Per column the better of the two rows (the lower row on equal scores).
        pick = (score[1] > score[0]) | ((score[1] == score[0]) & (rows[1] < rows[0]))
        best_score = np.where(pick, score[1], score[0])
        col = int(np.argmax(best_score))
        top = best_score[col]
        if not top > self.eps:
            return None
        best_row = np.where(pick, rows[1], rows[0])
        cols = np.flatnonzero(best_score == top)
        if len(cols) > 1:
            gens = base[cols] + best_row[cols] * step[cols]
            col = int(cols[np.lexsort((gens, part[cols]))[0]])
        row = int(best_row[col])
        return float(top), int(part[col]), int(base[col] + row * step[col]), row, col

    def singles(self, partners: np.ndarray, everyone: bool):
        """Best single move or 1-for-1 swap into the partner parts: (score, part, gen, xs, ys) or None.

        A move is a swap with a virtual empty item of cost 0 placed first in its part (gen = row); the swaps
        follow, by x and then by y's position.
        """
        work, mh = self.work, self.mh
        movers = partners[self._size_ok(partners, 1, 0)]
        ys = self._columns(partners, everyone)
        owner = work.part_of[ys]
        num_moves = len(movers)
        found = self._evaluate(
            self.cx,
            self.tx,
            np.concatenate([np.zeros(num_moves), work.costs[ys]]),
            np.concatenate([np.zeros(num_moves, dtype=np.int64), work.tokens[ys]]),
            np.concatenate([movers, owner]),
            np.concatenate([np.zeros(num_moves, dtype=np.int64), mh + work.pos_of[ys]]),
            np.concatenate([np.ones(num_moves, dtype=np.int64), work.sizes_ext[owner]]),
        )
        if found is None:
            return None
        xs = (int(self.hx[found[3]]),)
        col = found[4] - num_moves
        return (*found[:3], xs, () if col < 0 else (int(ys[col]),))

    def pairs(self, partners: np.ndarray, everyone: bool):
        """Best 1-for-2 or 2-for-1 swap into the partner parts: (score, part, gen, xs, ys) or None."""
        work, mh = self.work, self.mh
        sizes = work.sizes[partners]
        small = np.maximum(mh, sizes) ** 2 * np.minimum(mh, sizes) <= _MAX_PAIR_EXCHANGES
        everyone = everyone and bool(small.all())
        partners = partners[small]
        best = None
        # 1-for-2: x out (row), a pair (y, y2) of part p in (column); gen = row * pairs(p) + pair index.
        keep = partners[self._size_ok(partners, 1, 2)]
        if len(keep):
            first, second, cost, tok, index, count = (
                np.concatenate(column) for column in zip(*(work.pairs(p) for p in keep.tolist()))
            )
            owner = work.part_of[first]
            found = self._evaluate(self.cx, self.tx, cost, tok, owner, index, count)
            if found is not None:
                col = found[4]
                best = (*found[:3], (int(self.hx[found[3]]),), (int(first[col]), int(second[col])))
        # 2-for-1: a pair (x, x2) out (row), y of part p in (column); after the 1-for-2 of part p.
        keep_mask = self._size_ok(partners, 2, 1)
        ha, hb = _pair_index(mh)
        if keep_mask.any() and len(ha):
            ys = self._columns(partners[keep_mask], everyone and bool(keep_mask.all()))
            owner = work.part_of[ys]
            size = work.sizes_ext[owner]
            found = self._evaluate(
                self.cx[ha] + self.cx[hb],
                self.tx[ha] + self.tx[hb],
                work.costs[ys],
                work.tokens[ys],
                owner,
                mh * (size * (size - 1) // 2) + work.pos_of[ys],
                size,
            )
            if _better(found, best):
                row = found[3]
                xs = (int(self.hx[ha[row]]), int(self.hx[hb[row]]))
                best = (*found[:3], xs, (int(ys[found[4]]),))
        return best

    def best(self, *, pairs: bool):
        """Best exchange over the partner parts, pruned by gap (see [Note: planner speed])."""
        search = self.pairs if pairs else self.singles
        loads, gaps = self.work.loads, self.gaps[:-1]
        eligible = np.flatnonzero(gaps > self.eps)  # never h: its gap is 0
        if len(eligible) <= _MAX_PARTNERS:
            # Parts outside `eligible` never score, so a search over every item gives the same answer.
            return search(eligible, everyone=self.cap is None)
        first = eligible[_smallest(loads[eligible], _MAX_PARTNERS)]
        best = search(first, everyone=False)
        rest = np.setdiff1d(eligible, first, assume_unique=True)
        if best is not None:
            rest = rest[gaps[rest] * 0.5 >= best[0] * (1.0 - _PRUNE_SLACK)]
        if len(rest) > _MAX_PARTNERS:
            rest = rest[_smallest(loads[rest], _MAX_PARTNERS)]
        if len(rest):
            more = search(rest, everyone=False)
            if _better(more, best):
                best = more
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
    heaviest part's cost (ties: lowest part index, then moves before swaps, in item order); only when no such
    single exchange exists are 2-for-1 and 1-for-2 swaps tried. The sorted vector of part costs strictly
    decreases, so the search terminates; it also stops after ``max_rounds`` rounds. Moves are only allowed from
    a larger to a smaller part when ``equal_count`` is set, so part sizes stay within one of each other; with
    ``cap_tokens``, no change may push a part over the cap (parts already over it are not made worse by a move
    out). On many parts the search of one round is bounded (see [Note: planner speed]).

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
    if not parts:
        return []
    work = _Work(costs, tokens, parts)
    rounds = 4 * len(costs) + 16 if max_rounds is None else max_rounds
    # Stop once the heaviest part is within rel_tol of a lower bound on any partition's heaviest part.
    lower_bound = heaviest_lower_bound([costs[i] for p in parts for i in p], len(parts))
    for _ in range(rounds):
        if work.has_arrays:
            h = int(np.argmax(work.loads))  # the first of equal maxima
        else:
            h = max(range(len(parts)), key=lambda j: (work.load_list[j], -j))
        top = work.load_list[h]
        if top <= lower_bound * (1.0 + rel_tol):
            break
        eps = _REL_EPS * max(abs(top), 1.0)
        if len(work.parts[h]) * (len(costs) + len(parts)) <= _LOOP_LIMIT:
            best = _loop_search(work, h, eps, equal_count, cap_tokens, pairs=False)
            if best is None:
                best = _loop_search(work, h, eps, equal_count, cap_tokens, pairs=True)
        else:
            search = _Search(work, h, eps, equal_count, cap_tokens)
            best = search.best(pairs=False)
            if best is None:
                best = search.best(pairs=True)
        if best is None:
            break
        _, p, _, xs, ys = best
        work.exchange(h, p, xs, ys)
    return [sorted(p) for p in work.parts]


def repair_cap(
    costs: Sequence[float], tokens: Sequence[int], parts: Sequence[Sequence[int]], cap_tokens: int
) -> list[list[int]] | None:
    """Moves and swaps items until no part holds more than ``cap_tokens`` tokens.

    Each step takes the part with the largest excess (lowest index on ties) and applies the move (or swap) that
    leaves it the smallest excess without pushing another part over the cap, preferring the lower resulting
    cost (ties: lowest part index, then item order, a move before swaps). The total excess strictly
    decreases, so it terminates. On many parts the candidates of a step are bounded (see [Note: planner
    speed]).

    Returns:
        The repaired parts (positions kept, items sorted), or ``None`` if it got stuck.
    """
    work = _Work(costs, tokens, parts)
    work.arrays()
    num_parts = len(work.parts)
    every_part = np.arange(num_parts)
    chosen = np.zeros(num_parts, dtype=bool)
    while True:
        excess = work.toks - cap_tokens
        h = int(np.argmax(excess))
        if excess[h] <= 0:
            return [sorted(p) for p in work.parts]
        others = np.concatenate((every_part[:h], every_part[h + 1 :]))
        if len(others) <= _MAX_PARTNERS:
            best = _repair_step(work, h, others, cap_tokens)
        else:
            chosen[:] = False
            chosen[others[_smallest(work.loads[others], _REPAIR_PARTNERS)]] = True
            chosen[others[_smallest(work.toks[others], _REPAIR_PARTNERS)]] = True
            best = _repair_step(work, h, np.flatnonzero(chosen), cap_tokens)
            if best is None:
                best = _repair_step(work, h, others, cap_tokens)
        if best is None:
            return None
        p, xs, ys = best
        work.exchange(h, p, xs, ys)


def _repair_step(work: _Work, h: int, partners: np.ndarray, cap_tokens: int):
    """The repair move of :func:`repair_cap` out of part h into the partners: (p, xs, ys) or None.

    Candidates are ranked by (excess left in h, new cost of p, p, x, 0 for a move or 1 + position of y).
    """
    num_parts = len(work.parts)
    hx = work.items(h)
    cx, tx = work.costs[hx], work.tokens[hx]
    over = int(work.toks[h]) - cap_tokens
    room = cap_tokens - work.toks
    # Moves of x into p.
    move_x, move_p = np.nonzero((tx[:, None] > 0) & (tx[:, None] <= room[partners][None, :]))
    move_part = partners[move_p]
    # Swaps of x for y (of a partner part).
    member = np.zeros(num_parts + 1, dtype=bool)
    member[partners] = True
    ys = np.flatnonzero(member[work.part_of])
    owner = work.part_of[ys]
    delta = tx[:, None] - work.tokens[ys][None, :]
    swap_x, swap_y = np.nonzero((delta > 0) & (delta <= room[owner][None, :]))
    num_moves = len(move_x)
    if not num_moves and not len(swap_x):
        return None
    swap_part = owner[swap_y]
    key0 = np.concatenate(
        [np.maximum(0, over - tx[move_x]), np.maximum(0, over - delta[swap_x, swap_y])]
    )
    key1 = np.concatenate(
        [
            work.loads[move_part] + cx[move_x],
            (work.loads[swap_part] + cx[swap_x]) - work.costs[ys[swap_y]],
        ]
    )
    part = np.concatenate([move_part, swap_part])
    x = np.concatenate([move_x, swap_x])
    sub = np.concatenate([np.zeros(num_moves, dtype=np.int64), 1 + work.pos_of[ys[swap_y]]])
    pick = int(np.lexsort((sub, x, part, key1, key0))[0])
    xs = (int(hx[x[pick]]),)
    return int(part[pick]), xs, (() if pick < num_moves else (int(ys[swap_y[pick - num_moves]]),))


def heaviest_lower_bound(costs: Sequence[float], k: int) -> float:
    """A lower bound on the heaviest part of any ``k``-way split: max(mean part cost, largest item)."""
    return max(math.fsum(costs) / k, max(costs, default=0.0), 0.0)


def balanced_partition(
    costs: Sequence[float], k: int, *, equal_count: bool = False, rel_tol: float = 1e-6
) -> list[list[int]]:
    """Karmarkar-Karp followed by :func:`refine`: the default balanced k-way split.

    Without ``equal_count``, unless the refined KK split is already within ``rel_tol`` of
    :func:`heaviest_lower_bound`, the refined greedy LPT split is computed too and kept if its heaviest part
    is strictly lighter, so the result is never worse than LPT by more than ``rel_tol``.

    Returns:
        ``k`` parts as in :func:`karmarkar_karp` (ordered by cost descending, then first index).
    """
    best = refine(
        costs,
        karmarkar_karp(costs, k, equal_count=equal_count),
        equal_count=equal_count,
        rel_tol=rel_tol,
    )
    good_enough = heaviest_lower_bound(costs, k) * (1.0 + rel_tol)
    if not equal_count and max(part_costs(costs, best), default=0.0) > good_enough:
        lpt = refine(costs, greedy_lpt(costs, k), rel_tol=rel_tol)
        if max(part_costs(costs, lpt), default=0.0) < max(part_costs(costs, best), default=0.0):
            best = lpt
    return _ordered(costs, best)
