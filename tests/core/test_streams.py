"""The overlap schedule of fetch / compute / push on a fake clock and on CPU "streams".

The fake clock's timeline is compared with an independent recurrence of the intended semantics
(each op starts when its stream is free and its dependencies are done), then the properties are checked
directly: fetch of bucket k+1 overlaps compute of bucket k, in-flight fetches and pushes stay bounded,
every push completes before the fence.
"""

from __future__ import annotations

import pytest
import torch

from megatron_odc.core.streams import (
    BucketWork,
    FakeClockStreams,
    OverlapSchedule,
    TorchStreams,
)


def _works(n: int, fetch: float, compute: float, push: float | None, log: list[str]):
    def op(label: str):
        return lambda: log.append(label)

    return [
        BucketWork(
            fetch=op(f"fetch{k}"),
            compute=op(f"compute{k}"),
            push=None if push is None else op(f"push{k}"),
            fetch_cost_s=fetch,
            compute_cost_s=compute,
            push_cost_s=push or 0.0,
        )
        for k in range(n)
    ]


def _oracle(n: int, fetch: float, compute: float, push: float, max_fetched: int, max_pushing: int):
    """Start/end times from the dependency rules, computed directly (no stream simulation)."""
    f_end, c_end, p_end = [], [], []
    times = {}
    for k in range(n):
        # Fetches are issued ahead, but their start times follow the same rules in bucket order.
        while len(f_end) < min(n, k + max_fetched):
            j = len(f_end)
            start = max(
                f_end[-1] if f_end else 0.0, c_end[j - max_fetched] if j >= max_fetched else 0.0
            )
            f_end.append(start + fetch)
            times[f"fetch{j}"] = (start, start + fetch)
        oldest = k - 1 - max_pushing
        start = max(c_end[-1] if c_end else 0.0, f_end[k], p_end[oldest] if oldest >= 0 else 0.0)
        c_end.append(start + compute)
        times[f"compute{k}"] = (start, start + compute)
        start = max(p_end[-1] if p_end else 0.0, c_end[k])
        p_end.append(start + push)
        times[f"push{k}"] = (start, start + push)
    return times


@pytest.mark.parametrize(
    ("fetch", "compute", "push", "max_fetched", "max_pushing"),
    [(1.0, 3.0, 1.0, 2, 1), (5.0, 1.0, 1.0, 2, 1), (1.0, 1.0, 4.0, 3, 1), (2.0, 2.0, 2.0, 1, 2)],
)
def test_timeline_matches_dependency_oracle(fetch, compute, push, max_fetched, max_pushing) -> None:
    n = 6
    ops = FakeClockStreams()
    log: list[str] = []
    sched = OverlapSchedule(ops, max_fetched=max_fetched, max_pushing=max_pushing)
    sched.run(_works(n, fetch, compute, push, log))
    fence = sched.fence()
    expected = _oracle(n, fetch, compute, push, max_fetched, max_pushing)
    got = {i.label: (i.start_s, i.end_s) for i in ops.timeline}
    assert got == expected
    # Every push is complete before the fence, and the host has waited for the fence.
    assert fence == max(end for label, (_, end) in got.items() if label.startswith("push"))
    assert ops.host_s >= fence
    # Host order: each bucket's fetch ran before its compute, which ran before its push.
    for k in range(n):
        assert log.index(f"fetch{k}") < log.index(f"compute{k}") < log.index(f"push{k}")


def test_prefetch_overlaps_compute_when_compute_bound() -> None:
    ops = FakeClockStreams()
    OverlapSchedule(ops, max_fetched=2).run(_works(5, 1.0, 3.0, 1.0, []))
    for k in range(4):
        fetch_next, compute = ops.interval(f"fetch{k + 1}"), ops.interval(f"compute{k}")
        assert fetch_next.start_s < compute.end_s, f"fetch {k + 1} does not overlap compute {k}"
        assert fetch_next.end_s <= ops.interval(f"compute{k + 1}").start_s
        push_prev = ops.interval(f"push{k}")  # push of bucket k overlaps compute of bucket k + 1
        assert push_prev.start_s < ops.interval(f"compute{k + 1}").end_s
    # Compute-bound: fetch 0, then back-to-back computes, then the last push.
    assert ops.timeline[-1].end_s == pytest.approx(1.0 + 5 * 3.0 + 1.0)


def test_max_fetched_one_serializes() -> None:
    ops = FakeClockStreams()
    OverlapSchedule(ops, max_fetched=1).run(_works(4, 1.0, 3.0, None, []))
    for k in range(3):
        assert ops.interval(f"fetch{k + 1}").start_s >= ops.interval(f"compute{k}").end_s


def _max_overlap(intervals_a, intervals_b_of) -> int:
    """Max over the instants of interval_b starts of how many intervals in ``intervals_a`` are active."""
    worst = 0
    for t in intervals_b_of:
        worst = max(worst, sum(1 for lo, hi in intervals_a if lo <= t < hi))
    return worst


@pytest.mark.parametrize("max_fetched", [1, 2, 3])
@pytest.mark.parametrize(("fetch", "compute"), [(5.0, 1.0), (1.0, 5.0)])
def test_fetched_buckets_stay_bounded(max_fetched: int, fetch: float, compute: float) -> None:
    ops = FakeClockStreams()
    OverlapSchedule(ops, max_fetched=max_fetched).run(_works(8, fetch, compute, 1.0, []))
    # A bucket holds memory from its fetch start to its compute end.
    held = [
        (ops.interval(f"fetch{k}").start_s, ops.interval(f"compute{k}").end_s) for k in range(8)
    ]
    instants = sorted({t for lo, hi in held for t in (lo, hi)})
    assert _max_overlap(held, instants) <= max_fetched
    if compute > fetch:  # compute-bound: prefetching runs ahead, up to the bound and no further
        assert _max_overlap(held, instants) == max_fetched


def test_pushes_stay_bounded() -> None:
    ops = FakeClockStreams()
    OverlapSchedule(ops, max_fetched=2, max_pushing=1).run(_works(6, 0.5, 1.0, 4.0, []))
    for k in range(2, 6):
        # compute k writes a fresh grad buffer only after push k - 2 is done (two grad buffers).
        assert ops.interval(f"compute{k}").start_s >= ops.interval(f"push{k - 2}").end_s


def test_fence_waits_for_slow_pushes() -> None:
    ops = FakeClockStreams()
    sched = OverlapSchedule(ops)
    sched.run(_works(3, 1.0, 1.0, 10.0, []))
    fence = sched.fence()
    assert fence == ops.interval("push2").end_s == pytest.approx(1.0 + 1.0 + 3 * 10.0)
    assert sched.fence() == ops.record(ops.stream("compute"))  # nothing pending: immediate


def test_argument_errors() -> None:
    ops = FakeClockStreams()
    with pytest.raises(ValueError, match="max_fetched"):
        OverlapSchedule(ops, max_fetched=0)
    with pytest.raises(ValueError, match="max_pushing"):
        OverlapSchedule(ops, max_pushing=0)
    with pytest.raises(ValueError, match="cost_s"):
        ops.launch(ops.stream("x"), "bad", lambda: None, -1.0)


def test_torch_streams_on_cpu_move_real_data() -> None:
    # Owners' shards (fetch reads them), one working buffer per bucket, fp32 accumulators (push adds).
    n, numel = 4, 33
    gen = torch.Generator().manual_seed(0)
    remote = [torch.randn(numel, generator=gen) for _ in range(n)]
    working = [torch.zeros(numel) for _ in range(n)]
    grads = [torch.zeros(numel) for _ in range(n)]
    acc = [torch.zeros(numel) for _ in range(n)]

    def work(k: int) -> BucketWork:
        return BucketWork(
            fetch=lambda: working[k].copy_(remote[k]),
            compute=lambda: grads[k].copy_(working[k] * (k + 1)),
            push=lambda: acc[k].add_(grads[k]),
        )

    sched = OverlapSchedule(TorchStreams("cpu"), max_fetched=2)
    sched.run([work(k) for k in range(n)])
    assert sched.fence() is None
    for k in range(n):
        torch.testing.assert_close(acc[k], remote[k] * (k + 1), rtol=0, atol=0)
