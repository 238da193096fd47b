"""``mcore/dist_ckpt/writer_processes.py``: what a rank's checkpoint-writer children do when the rank is
interrupted or killed (issue 37, item 8).

A stand-in rank (a subprocess) installs the guard, starts megatron-core's results-queue manager through
it and forks a stand-in writer. Ctrl-C (SIGINT) reaches the children without a traceback from them
(before: one ``KeyboardInterrupt`` traceback per writer process), and when the rank is killed both die
and nothing is left in ``$TMPDIR`` (before: the manager's ``pymp-*`` directory, one per killed rank).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

RANK = textwrap.dedent(
    """
    import os, sys, time
    from megatron_odc.mcore.dist_ckpt import writer_processes
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if __name__ == "__main__":
        writer_processes.install()
        filesystem_async._results_queue.put("ok")  # the manager answers
        assert filesystem_async._results_queue.get() == "ok"
        print(writer_processes._manager._process.pid, flush=True)
        if os.fork() == 0:  # a writer: its fork hooks have run once it prints
            print(os.getpid(), flush=True)
            time.sleep(60)
            os._exit(0)
        time.sleep(60)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard is Linux-only")
def test_children_ignore_ctrl_c_and_die_with_the_rank_leaving_no_temp_dir(tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    rank = subprocess.Popen(
        [sys.executable, str(script)],
        env={**os.environ, "TMPDIR": str(tmpdir)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    children = []
    try:
        manager_pid, writer_pid = int(rank.stdout.readline()), int(rank.stdout.readline())
        children = [psutil.Process(manager_pid), psutil.Process(writer_pid)]
        for child in children:
            os.kill(child.pid, signal.SIGINT)
        time.sleep(1.0)
        assert all(child.is_running() for child in children), "a child died of Ctrl-C"
        rank.kill()
        rank.wait()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"{[p.pid for p in alive]} outlived the killed rank"
    finally:
        for child in children:
            if child.is_running():
                child.kill()
    stderr = rank.stderr.read()
    assert "KeyboardInterrupt" not in stderr, stderr[-2000:]
    assert list(tmpdir.glob("pymp-*")) == [], "multiprocessing's directory left in $TMPDIR"
