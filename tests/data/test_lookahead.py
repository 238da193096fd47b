"""Tests of megatron_odc.data.lookahead and the sampler positions the training loop plans ahead with."""

from __future__ import annotations

import threading

import pytest

from megatron_odc.data.lookahead import Lookahead
from megatron_odc.data.sampler import LengthBalancedSampler

DEADLINE_S = 30.0


class _Recorder:
    """A ``produce`` that records which keys it made, on which thread, and can hold a key back."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []
        self.started: dict[int, threading.Event] = {}
        self.release: dict[int, threading.Event] = {}

    def hold(self, key: int) -> None:
        self.release[key] = threading.Event()

    def __call__(self, key: int) -> int:
        self.calls.append((key, threading.current_thread().name))
        self.started.setdefault(key, threading.Event()).set()
        if key in self.release:
            assert self.release[key].wait(DEADLINE_S), f"key {key} was never released"
        if key < 0:
            raise ValueError(f"bad key {key}")
        return key * key


def test_the_next_key_is_made_before_it_is_asked_for() -> None:
    produce = _Recorder()
    produce.hold(2)
    lookahead = Lookahead(produce, name="test-lookahead")
    try:
        first = lookahead.get(1, 2)
        assert (first.value, first.ahead) == (1, False)
        # Key 2 starts on the worker while the caller still holds key 1's value.
        produce.started.setdefault(2, threading.Event())
        assert produce.started[2].wait(DEADLINE_S), "the next key was not started ahead"
        produce.release[2].set()
        second = lookahead.get(2, None)
        assert (second.value, second.ahead) == (4, True)
        assert second.produce_s >= 0
        assert second.wait_s >= 0
    finally:
        lookahead.close()
    assert [key for key, _ in produce.calls] == [1, 2]
    # produce runs on the one worker thread only, never on the caller's.
    assert {name for _, name in produce.calls} != {threading.current_thread().name}
    assert len({name for _, name in produce.calls}) == 1


def test_a_moved_caller_gets_the_key_it_asks_for() -> None:
    produce = _Recorder()
    lookahead = Lookahead(produce, name="test-lookahead")
    try:
        assert lookahead.get(1, 2).value == 1
        moved = lookahead.get(7, 8)  # a resume moved the position: key 2 is not used
        assert (moved.value, moved.ahead) == (49, False)
        assert lookahead.get(8, None).ahead
    finally:
        lookahead.close()


def test_errors_reach_the_caller_and_close_is_final() -> None:
    lookahead = Lookahead(_Recorder(), name="test-lookahead")
    lookahead.get(1, -1)
    with pytest.raises(ValueError, match="bad key -1"):
        lookahead.get(-1, None)
    lookahead.close()
    with pytest.raises(RuntimeError, match="after close"):
        lookahead.get(1, None)
    lookahead.close()  # idempotent


@pytest.mark.parametrize("num_samples", [12, 13])
def test_positions_walk_the_same_minibatches_as_iteration(num_samples: int) -> None:
    def sampler() -> LengthBalancedSampler:
        return LengthBalancedSampler(
            [3 + (7 * i) % 11 for i in range(num_samples)],
            global_batch_size=4,
            dp_size=2,
            dp_rank=1,
            seed=5,
            drop_last=True,
        )

    iterated, expected = sampler(), []
    for epoch in range(3):
        iterated.set_epoch(epoch)
        expected += [(a.epoch, a.index, a.microbatches) for a in iterated]
    walked, got = sampler(), []
    position = walked.current()
    for _ in range(len(expected)):
        assert walked.current() == position
        assignment = walked.assignment(*position)
        walked.advance_past(*position)
        got.append((assignment.epoch, assignment.index, assignment.microbatches))
        position = walked.following(*position)
    assert got == expected
    assert walked.state_dict() == iterated.state_dict()
    with pytest.raises(ValueError, match="outside"):
        walked.advance_past(0, len(walked))
