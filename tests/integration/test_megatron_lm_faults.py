"""Faults under Megatron-LM's own loop (issue 37, item 9), gated on ``MEGATRON_LM_PATH``.

A 2-rank ``pretrain_gpt.py --dp-backend odc`` through the launcher saves every 2 iterations (so
megatron-core's checkpoint-writer processes exist); once it has saved and trained on, the test stops
(SIGSTOP) or kills (SIGKILL) rank 1, or kills the torchrun agent. Each must end the job within the timeout
(``--distributed-timeout-minutes 1``, Megatron-LM's smallest) plus slack, naming the rank, and leave no
process of the job, no shared-memory file (``MEGATRON_ODC_SHM_DIR``) and no ``pymp-*`` directory in its
``TMPDIR``. Before the fix the plugin's health records, watchdog and writer guard did not run under
Megatron-LM: a stopped rank was not named (rank 0 printed gloo's timeout traceback), and orphaned ranks
of a dead agent trained on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests._megatron_lm import E2E_ARGS, MEGATRON_LM_PATH_ENV, REPO_ROOT, torchrun_command

TIMEOUT_S = 60.0
"""``--distributed-timeout-minutes 1``: every collective's and the ODC fence's limit."""
TORCHRUN_GRACE_S = 30.0
"""How long torchrun waits after SIGTERM before SIGKILL when it tears the job down."""


class _Job:
    """A running torchrun job of the launcher, its output collected line by line."""

    def __init__(self, tmp_path: Path, megatron_lm_path: Path, shm_dir: Path) -> None:
        self.tmpdir = tmp_path / "tmp"
        self.tmpdir.mkdir()
        args = [
            *E2E_ARGS, "--dp-backend", "odc", "--train-iters", "100000",
            "--distributed-timeout-minutes", "1", "--save", str(tmp_path / "ckpt"),
            "--save-interval", "2",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(
            OMP_NUM_THREADS="1",
            CUDA_DEVICE_MAX_CONNECTIONS="1",
            MEGATRON_ODC_SHM_DIR=str(shm_dir),
            TMPDIR=str(self.tmpdir),
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        )
        env[MEGATRON_LM_PATH_ENV] = str(megatron_lm_path)
        command = [*torchrun_command(2), "-m", "megatron_odc.launch"]
        self.proc = subprocess.Popen(
            [*command, "pretrain_gpt.py", *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self, last: int = 60) -> str:
        return "".join(self.lines[-last:])

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, f"no {text!r} in {timeout_s} s:\n{self.output()}"
            time.sleep(0.2)

    def workers(self) -> list[psutil.Process]:
        """The two ranks (the agent's children), rank order by their ``RANK``."""
        children = psutil.Process(self.proc.pid).children()
        assert len(children) == 2, children
        return sorted(children, key=lambda p: int(p.environ().get("RANK", "0")))

    def end(self) -> None:
        self.proc.wait(timeout=10)
        self._reader.join(timeout=30)  # orphaned ranks hold the pipe until they end

    def kill(self) -> None:
        """Kill whatever of the job still runs (a failed test's leftovers)."""
        if self.proc.poll() is None:
            self.proc.kill()
        for process in self.descendants:
            if process.is_running():
                process.kill()
        self.proc.wait()

    def rank_tracebacks(self) -> int:
        """Tracebacks printed by the ranks (torchrun prints its own ``ChildFailedError`` one)."""
        tracebacks = sum("Traceback (most recent call last)" in line for line in self.lines)
        return tracebacks - sum("ChildFailedError:" in line for line in self.lines)


@pytest.fixture
def shm_dir():
    path = Path("/dev/shm") / f"megatron_odc_test_mlm_faults_{os.getpid()}_{time.monotonic_ns()}"
    path.mkdir()
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


@pytest.fixture
def job(tmp_path, megatron_lm_path, shm_dir):
    started = _Job(tmp_path, megatron_lm_path, shm_dir)
    started.descendants = []
    try:
        started.wait_for("successfully saved checkpoint from iteration       2", 600)
        started.wait_for("iteration        3/", 120)
        started.descendants = psutil.Process(started.proc.pid).children(recursive=True)
        yield started
    finally:
        started.kill()


def _assert_nothing_left(job: _Job, shm_dir: Path) -> None:
    alive = [p for p in job.descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {[(p.pid, p.cmdline()[:3]) for p in alive]}\n{job.output()}"
    assert not list(shm_dir.iterdir()), f"shared memory left: {list(shm_dir.iterdir())}"
    assert not list(job.tmpdir.glob("pymp-*")), f"left in TMPDIR: {list(job.tmpdir.iterdir())}"


def test_a_stopped_rank_is_named_and_the_job_ends(job, shm_dir) -> None:
    rank1 = job.workers()[1]
    stopped_at = time.monotonic()
    rank1.send_signal(signal.SIGSTOP)
    status = job.proc.wait(timeout=TIMEOUT_S + 60 + TORCHRUN_GRACE_S)
    took_s = time.monotonic() - stopped_at
    job.end()
    assert status != 0
    named = [line for line in job.lines if "megatron_odc: rank 0 failed" in line]
    assert named, job.output()
    assert f"rank 1 (pid {rank1.pid} on" in named[0], named
    assert "is stopped" in named[0], named
    assert took_s < TIMEOUT_S + 60 + TORCHRUN_GRACE_S, took_s
    assert job.rank_tracebacks() == 0, job.output(200)
    _assert_nothing_left(job, shm_dir)


def test_a_killed_rank_ends_the_job(job, shm_dir) -> None:
    rank1 = job.workers()[1]
    killed_at = time.monotonic()
    rank1.send_signal(signal.SIGKILL)
    status = job.proc.wait(timeout=TIMEOUT_S + TORCHRUN_GRACE_S)
    took_s = time.monotonic() - killed_at
    job.end()
    assert status != 0
    # torchrun names the rank it lost (its local rank, pid and the signal).
    report = job.output(200)
    assert f"local_rank: 1 (pid: {rank1.pid})" in report or f"pid: {rank1.pid}" in report, report
    assert "Signal 9 (SIGKILL)" in report, report
    assert took_s < TIMEOUT_S + TORCHRUN_GRACE_S, took_s
    _assert_nothing_left(job, shm_dir)


def test_ranks_end_with_one_line_when_the_launcher_is_killed(job, shm_dir) -> None:
    workers = job.workers()
    killed_at = time.monotonic()
    job.proc.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(workers, timeout=20)
    took_s = time.monotonic() - killed_at
    job.end()
    assert not alive, f"ranks {[p.pid for p in alive]} outlived their launcher by 20 s"
    assert took_s < 10, took_s
    ended = [line for line in job.lines if "its launcher (pid" in line and "is gone" in line]
    assert len(ended) == 2, job.output()  # one line per rank
    time.sleep(2)  # the writer processes die with their rank (parent-death signal)
    _assert_nothing_left(job, shm_dir)
