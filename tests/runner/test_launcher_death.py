"""Workers end when their launcher dies (issue 37, item 4).

The torchrun agent of a 2-rank run of the entry is killed with SIGKILL once training runs. Before the
fix both workers trained on with no parent (about 25x slower), wrote into the dead agent's store from
the training thread (one C++ stack trace per phase change) and kept saving into ``--save``. Now the
heartbeat thread of each rank sees that its parent is gone and ends the rank with one line, within a
heartbeat or two, and nothing of the job is left running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import psutil

from tests.runner.test_trainer import _clean_env, _torchrun_command

TINY = [
    "--num-layers", "1", "--hidden-size", "32", "--seq-length", "64", "--global-batch-size", "8",
    "--synthetic-num-samples", "64", "--log-interval", "1", "--train-iters", "100000",
]  # fmt: skip


def _read_lines(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def test_workers_end_with_one_line_when_the_torchrun_agent_is_killed(tmp_path, shm_dir):
    proc = subprocess.Popen(
        _torchrun_command("megatron_odc.train", [*TINY, "--save", str(tmp_path / "ckpt")]),
        cwd=tmp_path,
        env=_clean_env(shm_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out: list[str] = []
    err: list[str] = []
    readers = [
        threading.Thread(target=_read_lines, args=(proc.stdout, out), daemon=True),
        threading.Thread(target=_read_lines, args=(proc.stderr, err), daemon=True),
    ]
    for reader in readers:
        reader.start()
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not any("iteration        3/" in line for line in out):
            assert proc.poll() is None, "".join(out[-20:] + err[-40:])
            assert time.monotonic() < deadline, "no third iteration in 120 s"
            time.sleep(0.1)
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2, workers
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        gone, alive = psutil.wait_procs(workers, timeout=20)
        assert not alive, f"workers {[p.pid for p in alive]} outlived their launcher by 20 s"
        took_s = time.monotonic() - killed_at
        for reader in readers:
            reader.join(timeout=10)  # the workers held the pipes open: they close with them
    finally:
        for worker in workers:
            if worker.is_running():
                worker.kill()
    assert took_s < 10, took_s
    assert len(gone) == 2  # their exit status went to their new parent, not to this test
    ended = [line for line in out + err if "its launcher (pid" in line and "is gone" in line]
    assert len(ended) == 2, "".join(err[-40:])  # one line per rank
    assert not any("Traceback" in line or "Exception raised from" in line for line in err), "".join(
        err[-60:]
    )
    assert not list(shm_dir.iterdir()), "shared memory left behind"
