"""A rank stopped (SIGSTOP) or killed (SIGKILL) at any point: its peers fail within the timeout, naming it.

Before ``--distributed-timeout-minutes`` reached every process group and the watchdog named the peers,
a stopped rank left the survivor blocked for megatron-core's 30-minute group timeout, and a killed one
gave gloo's "Connection reset by peer" without a rank (issue 19).

- Rank bodies (``tests/_dist.py::run_ranks``) stop or kill rank 1 inside a forward, a fence or the
  optimizer step, with a 15 s timeout: rank 0 must raise ``PeerFailureError`` naming rank 1, how it
  went (stopped responding / died) and where it was, well before the harness's deadline.
- ``torchrun`` kills rank 1 in its second save: nothing of the job may be left (megatron-core's checkpoint
  writer manager outlived it before), and stops rank 1 inside a save (``--runslow``): rank 0's error names
  it (run_ranks' daemonic children cannot start the checkpoint writer's processes).

The matrix's remaining cases run with ``--runslow``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests._dist import RankFailureError, run_ranks
from tests.runner.test_trainer import SMALL, _clean_env, _free_port

TIMEOUT_MINUTES = 0.25
TIMEOUT_S = 60 * TIMEOUT_MINUTES
ARGV = [*SMALL, "--train-iters", "4", "--distributed-timeout-minutes", str(TIMEOUT_MINUTES)]
PHASE = {
    "forward": "forward-backward",
    "fence": "(forward-backward|optimizer step)",
    "optimizer": "optimizer step",
}
HOW = {"STOP": "is stopped", "KILL": "died"}


def _faulty_rank(rank: int, world_size: int, workdir: str, point: str, signal_name: str) -> None:
    import os

    from megatron_odc.runner.arguments import build_parser, validate_args
    from megatron_odc.train import run
    from tests.runner._faults import inject

    os.chdir(workdir)
    args = validate_args(build_parser().parse_args(ARGV), world_size=world_size)
    if rank == 1:
        inject(point, signal_name, nth=3)  # in iteration 2 (forward: its first microbatch or later)
    run(args)


CASES = [
    pytest.param("fence", "STOP", id="stop-in-fence"),
    pytest.param("optimizer", "KILL", id="kill-in-optimizer-step"),
    pytest.param("forward", "STOP", id="stop-in-forward", marks=pytest.mark.slow),
    pytest.param("optimizer", "STOP", id="stop-in-optimizer-step", marks=pytest.mark.slow),
    pytest.param("forward", "KILL", id="kill-in-forward", marks=pytest.mark.slow),
    pytest.param("fence", "KILL", id="kill-in-fence", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("point", "signal_name"), CASES)
def test_a_stopped_or_killed_rank_is_named_within_the_timeout(tmp_path, point, signal_name):
    start = time.monotonic()
    with pytest.raises(RankFailureError) as failure:
        run_ranks(
            _faulty_rank,
            2,
            str(tmp_path),
            point,
            signal_name,
            timeout_s=150,
            pg_timeout_s=TIMEOUT_S,  # what train() gives init_process_group under torchrun
            grace_s=3,
        )
    elapsed = time.monotonic() - start
    message = str(failure.value)
    rank0 = message.split("rank 0 raised ", 1)[-1]
    assert rank0.startswith("PeerFailureError"), message[-3000:]
    rank0 = rank0.splitlines()[0]
    assert re.search(
        rf"because rank 1 \(pid \d+ on \S+\) {HOW[signal_name]}.*last seen in {PHASE[point]}", rank0
    ), rank0
    assert "rank 0 hung" not in message, message[-3000:]
    # Start-up (~10-25 s on 2 loaded cores) + two iterations + the timeout + the harness's grace.
    assert elapsed < 100, elapsed


def _torchrun_with_fault(fault: str, argv: list[str], workdir: Path, shm: Path) -> tuple[int, str]:
    """Run the entry under torchrun with ``fault``; return (status, output) once torchrun has ended,
    after checking that no process of the job and no shared-memory file is left (and killing any that
    are, so that a failure leaks nothing)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
        "-m",
        "tests.runner._faults",
        *argv,
    ]
    job_id = uuid.uuid4().hex
    env = {**_clean_env(shm), "MEGATRON_ODC_TEST_FAULT": fault, "MEGATRON_ODC_TEST_JOB": job_id}
    log = workdir / "torchrun.log"
    with open(log, "w") as out:  # not a pipe: a leftover child holding it would block the reader
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            status = proc.wait(timeout=170)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            status = proc.wait()
    time.sleep(2)  # children that die with their parent need a moment
    left = _job_processes(job_id)
    for entry in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(entry.split()[0]), signal.SIGKILL)
    output = log.read_text()
    assert not left, f"processes left behind: {left}\n{output[-3000:]}"
    assert not list(shm.iterdir()), f"shared-memory files left behind: {list(shm.iterdir())}"
    return status, output


def _job_processes(job_id: str) -> list[str]:
    """``pid command`` of every process whose environment carries ``MEGATRON_ODC_TEST_JOB=job_id``
    (torchrun starts each worker in a session of its own, so the environment, which every descendant
    inherits, is what marks the job)."""
    marker = f"MEGATRON_ODC_TEST_JOB={job_id}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:120]!r}")
    return found


SAVING = ["--save", "ckpt", "--save-interval", "2"]


def test_a_rank_killed_in_its_second_save_leaves_no_process_or_shared_memory(tmp_path, shm_dir):
    # Before: megatron-core's checkpoint-writer manager (~270 MB) and its resource tracker ran on.
    status, output = _torchrun_with_fault("1:save:KILL:2", [*ARGV, *SAVING], tmp_path, shm_dir)
    assert status != 0, output[-3000:]
    assert "saved checkpoint at iteration 2" in output, output[-3000:]


@pytest.mark.slow
def test_torchrun_names_a_rank_stopped_inside_a_save(tmp_path, shm_dir):
    status, output = _torchrun_with_fault("1:save:STOP:1", [*ARGV, *SAVING], tmp_path, shm_dir)
    assert status != 0, output[-3000:]
    assert re.search(
        r"PeerFailureError: rank 0 failed in save at iteration 2 because rank 1 \(pid \d+ on \S+\) "
        r"is stopped \(last seen in save, iteration 2\)",
        output,
    ), output[-4000:]
