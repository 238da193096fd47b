"""The multi-rank test harness itself: results come back, failures and hangs are named, nothing is left."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import RankFailureError, run_ranks


def _sum_ranks(rank: int, world_size: int, scale: int) -> tuple[int, int, str]:
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return rank, int(t), os.environ["OMP_NUM_THREADS"]


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _rank0_hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(3600)


def _rank1_dies(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(7)
    time.sleep(3600)


def test_results_come_back_in_rank_order():
    results = run_ranks(_sum_ranks, 3, 10, timeout_s=60)
    assert results == [(0, 30, "1"), (1, 30, "1"), (2, 30, "1")]


def test_a_raising_rank_is_named_with_its_error():
    with pytest.raises(RankFailureError, match=r"rank 1 raised ValueError: boom on purpose"):
        run_ranks(_rank1_raises, 2, timeout_s=60, pg_timeout_s=5)


def test_a_hung_rank_is_named_and_killed():
    start = time.monotonic()
    with pytest.raises(RankFailureError, match=r"rank 0 hung"):
        run_ranks(_rank0_hangs, 2, timeout_s=8)
    assert time.monotonic() - start < 40


def test_a_dead_rank_is_named():
    with pytest.raises(RankFailureError, match=r"rank 1 died with exit code 7"):
        run_ranks(_rank1_dies, 2, timeout_s=60)
