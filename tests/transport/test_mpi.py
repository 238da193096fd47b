"""Tests of ``megatron_odc.transport.mpi.MpiTransport``: ranks under ``mpiexec`` (``tests/_mpi.py``).

The rank-side checks are the ones the shm transport passes (``_cases.py``): integer-valued fp32, bf16
and fp16 accumulates from every rank into every owner at once must sum exactly (oracle: every source's
operations replayed in float64), gets of every dtype return the owner's bytes, a fence orders writes,
mismatched registrations are refused. Then MPI's own: a fence returns only after the slowest rank's
accumulate has landed; a fence a peer does not reach times out naming it; closing frees every window
(``MPI.WIN_NULL``); in deterministic mode the sums are bitwise equal whatever the arrival order. A rank
that dies makes ``mpiexec`` end the job within seconds (no rank waits on it). The refusals (torchrun,
no launcher, no mpi4py) run in-process. Skipped where mpiexec or mpi4py is missing.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_odc.runner.launch_env import apply_launch_env, check_mpi_launch, launched_by_mpi
from megatron_odc.transport import TransportError, build_transport
from megatron_odc.transport.mpi import MPI_ACCUMULATE_MODES, import_mpi, spans_hosts
from megatron_odc.transport.mpich_segments import (
    MPICH_SEGMENT_PREFIX,
    mapped_mpich_segments,
    unlink_mapped_mpich_segments,
)
from tests._dist import RankFailureError
from tests._mpi import requires_mpi, run_mpi
from tests.transport._cases import (
    ARRIVAL_NUMEL,
    check_accumulate,
    check_fence_orders_writes,
    check_get,
    mismatched_registrations,
    sum_in_two_arrival_orders,
)

SHARD_NUMEL = 16 * 1024 + 13
NUM_ACC_OPS = 60
ARRIVAL_SEED = 5
LATE_S = 0.5


def _check_fence_waits_for_the_slowest(t) -> None:
    """The last rank accumulates into rank 0 late: no rank's fence returns before that landed."""
    shard = t.register("late", 8, torch.float32)
    t.fence()
    last = t.world_size - 1
    sent_at = None
    if t.rank == last:
        time.sleep(LATE_S)
        t.accumulate("late", 0, 0, torch.ones(8))
        sent_at = time.time()
    t.fence()
    returned_at = time.time()
    if t.rank == 0:
        assert torch.equal(shard, torch.ones(8)), shard
    times: list = [None] * t.world_size
    dist.all_gather_object(times, (sent_at, returned_at))
    sent = times[last][0]
    assert all(returned >= sent for _, returned in times), (sent, times)


def _check_registration_refusals(t) -> None:
    last = t.world_size - 1
    for field, name, numel, dtype in mismatched_registrations(t.rank, t.world_size):
        with pytest.raises(ValueError, match=rf"rank {last} registered buffer .* with {field} "):
            t.register(name, numel, dtype)
        assert "mm" not in t.buffer_names
    assert t.register("empty", 0, torch.float32).numel() == 0
    peer = (t.rank + 1) % t.world_size
    t.get("empty", peer, 0, torch.empty(0))
    t.accumulate("empty", peer, 0, torch.empty(0))
    t.fence()


def _check_close_frees_the_windows(t) -> None:
    mpi = import_mpi()
    windows = [arena.win for arena in t._arenas] + [t._ctrl_win]
    assert len(windows) >= 2
    t.close()
    t.close()  # idempotent
    assert all(win == mpi.WIN_NULL for win in windows), "a window was not freed"
    assert t._comm is None
    for fn in (lambda: t.local("acc"), t.fence, t.flush):
        with pytest.raises(TransportError, match="MpiTransport is closed"):
            fn()


def _check_mode(rank: int, world_size: int, mode: str) -> list[bytes]:
    t = build_transport("mpi", None, accumulate_mode=mode, timeout_s=60)
    assert (t.rank, t.world_size, t.accumulate_mode) == (rank, world_size, mode)
    t.register("acc", SHARD_NUMEL, torch.float32)
    check_accumulate(t, "acc", SHARD_NUMEL, NUM_ACC_OPS, seed=1)
    check_get(t)
    fetched = torch.empty(16)
    t.get("acc", (rank + 1) % world_size, 0, fetched)
    fetched.untyped_storage().resize_(0)  # the engine frees fetched buffers so: still resizable
    check_fence_orders_writes(t)
    _check_registration_refusals(t)
    _check_fence_waits_for_the_slowest(t)
    shard = t.register("grad", ARRIVAL_NUMEL, torch.float32)
    t.register("params", 64, torch.float32, accumulate=False)  # no staging slots: read-only
    assert "params" not in t._staging
    assert ("grad" in t._staging) == (mode == "deterministic")

    def drained() -> None:
        for staging in t._staging.values():
            assert int(staging.count_nonzero()) == 0
        assert int(t._dirty.sum()) == 0

    results = sum_in_two_arrival_orders(t, shard, ARRIVAL_SEED, drained)
    _check_close_frees_the_windows(t)
    return results


def _check_late_peer(rank: int, world_size: int) -> str | None:
    """Every rank but the last reaches a fence the last one reaches only after their timeout."""
    t = build_transport("mpi", None, timeout_s=1.0)
    t.register("x", 4, torch.float32)
    t.fence()
    message = None
    if rank == world_size - 1:
        time.sleep(
            2.5
        )  # late: the others gave up; their abandoned meeting cannot complete any more
    else:
        with pytest.raises(TransportError) as failure:
            t.fence()
        message = str(failure.value)
    dist.barrier()
    t.close()  # leaves the windows to the process's exit (the failed ones at once, the late after 1 s)
    return message


def _run_main(rank: int, world_size: int) -> dict:
    """Both accumulate modes, then a late peer, in one launch (a launch costs more than the checks)."""
    assert launched_by_mpi(os.environ)
    return {
        "sums": {mode: _check_mode(rank, world_size, mode) for mode in MPI_ACCUMULATE_MODES},
        "late": _check_late_peer(rank, world_size),
    }


def _run_dead_peer(rank: int, world_size: int, record_dir: str) -> None:
    # The MPICH segments this rank maps, named or not any more (the test checks none is left).
    segments = [
        line.split(maxsplit=5)[5].strip().removesuffix(" (deleted)")
        for line in Path("/proc/self/maps").read_text().splitlines()
        if MPICH_SEGMENT_PREFIX in line
    ]
    Path(record_dir, f"rank{rank}.txt").write_text("\n".join(sorted(set(segments))))
    t = build_transport("mpi", None, timeout_s=60)
    t.register("x", 4, torch.float32)
    t.fence()
    if rank == 1:
        os._exit(3)
    t.fence()  # never completes: mpiexec ends the job


@requires_mpi
def test_mpi_transport() -> None:
    world_size = 3
    results = run_mpi(_run_main, world_size, timeout_s=180)
    for rank, res in enumerate(results):
        first, second = res["sums"]["deterministic"]
        assert first == second, f"owner {rank}: the sums differ between arrival orders"
        if rank < world_size - 1:
            pattern = (
                rf"rank {rank}: fence 2 timed out after 1 s waiting for rank {world_size - 1}$"
            )
            assert re.search(pattern, res["late"]), res["late"]


@requires_mpi
def test_a_dead_peer_ends_the_job(tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailureError, match=r"rank 1 died") as failure:
        run_mpi(_run_dead_peer, 2, str(tmp_path), timeout_s=60)
    # MPICH's launcher kills the whole job when a rank exits without MPI_Finalize: no one waits.
    assert time.monotonic() - start < 30, failure.value
    assert "hung" not in str(failure.value), failure.value
    # Nobody finalized, yet MPICH's shared-memory segment is not left in /dev/shm.
    segments = {
        name for rank in range(2) for name in (tmp_path / f"rank{rank}.txt").read_text().split()
    }
    assert segments, "the ranks mapped no MPICH segment: the check below would prove nothing"
    assert not [name for name in segments if Path(name).exists()], segments


def test_only_this_process_s_named_mpich_segments_are_removed(tmp_path) -> None:
    ours = Path(f"{MPICH_SEGMENT_PREFIX}odctest_{os.getpid()}_0")
    another_job = Path(f"{MPICH_SEGMENT_PREFIX}odctest_{os.getpid()}_1")
    gone_already = f"{MPICH_SEGMENT_PREFIX}odctest_{os.getpid()}_2"
    maps = tmp_path / "maps"
    maps.write_text(
        f"7f00-7f01 rw-s 00000000 00:1a 11 {ours}\n"
        f"7f01-7f02 rw-s 00000000 00:1a 12 {gone_already} (deleted)\n"
        "7f02-7f03 r-xp 00000000 08:01 13 /usr/lib/libc.so.6\n"
        "7f03-7f04 rw-p 00000000 00:00 0\n"
    )
    try:
        ours.write_bytes(b"x")
        another_job.write_bytes(b"x")
        assert mapped_mpich_segments(str(maps)) == [str(ours)]
        assert unlink_mapped_mpich_segments(str(maps)) == [str(ours)]
        assert not ours.exists()
        assert another_job.exists()  # not mapped by this process: another job's, kept
        assert unlink_mapped_mpich_segments(str(maps)) == []  # removed by a peer already: fine
        assert mapped_mpich_segments(str(tmp_path / "no-proc")) == []
    finally:
        for path in (ours, another_job):
            path.unlink(missing_ok=True)


# Refusals (in-process, no launcher needed) #


def test_mpi_is_refused_under_torchrun_and_without_a_launcher() -> None:
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}
    for environ, how in ((torchrun, "under torchrun"), ({}, "without an MPI launcher")):
        with pytest.raises(ValueError, match=f"--odc-transport mpi was started {how}.*mpiexec -n"):
            check_mpi_launch("mpi", environ)
        check_mpi_launch("shm", environ)  # other transports do not care
    assert launched_by_mpi({"PMI_RANK": "0"})
    assert not launched_by_mpi({"PMI_RANK": "0", "TORCHELASTIC_RUN_ID": "x"})
    environ = dict(torchrun)
    apply_launch_env("auto", environ)
    assert environ == torchrun


def test_missing_mpi4py_is_refused_naming_the_flag(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py raises ImportError
    with pytest.raises(
        ValueError, match=r"--odc-transport mpi needs mpi4py .*pip install mpi4py mpich"
    ):
        import_mpi()
    with pytest.raises(ValueError, match=r"--odc-transport mpi needs mpi4py"):
        apply_launch_env("mpi", {"PMI_RANK": "0"})
    # Other transports under mpiexec also take their ranks from MPI: the launcher is named.
    with pytest.raises(
        ValueError, match=r"started by an MPI launcher \(PMI_RANK is set\).*torchrun"
    ):
        apply_launch_env("auto", {"PMI_RANK": "0"})
    set_by_a_script = {"PMI_RANK": "1", "RANK": "1", "WORLD_SIZE": "2"}
    # torch's variables already there (set by a launch script): kept, no MPI needed.
    apply_launch_env("auto", set_by_a_script)
    assert set_by_a_script == {"PMI_RANK": "1", "RANK": "1", "WORLD_SIZE": "2"}


def test_unknown_accumulate_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="accumulate_mode 'locked' is not one of 'atomic'"):
        build_transport("mpi", None, accumulate_mode="locked")
    assert MPI_ACCUMULATE_MODES == ("atomic", "deterministic")


def test_async_progress_is_asked_for_only_across_hosts() -> None:
    # See [Note: MPI progress]: accumulates through the network wait for a busy target without it.
    assert spans_hosts({"PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"})
    assert not spans_hosts({"PMI_SIZE": "4", "MPI_LOCALNRANKS": "4"})
    assert spans_hosts({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert spans_hosts({}) is None
