"""``runner/health.py`` on its own: how a peer's record is read, and the watchdog's exit.

The records live in a ``torch.distributed.HashStore`` here (no process group needed); the peers are real
processes of this machine (a dead one, a stopped one, a live one), since the diagnosis reads ``/proc``.
The watchdog ends its process with ``os._exit``, so it runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from megatron_odc.runner import health
from megatron_odc.runner.health import HealthMonitor, PeerFailureError


def _record(store, rank: int, pid: int, *, age_s: float = 0.0, phase: str = "forward-backward"):
    record = {
        "pid": pid,
        "host": socket.gethostname(),
        "iteration": 7,
        "phase": phase,
        "time": time.time() - age_s,
    }
    dist.PrefixStore("megatron_odc/health/", store).set(f"rank{rank}", json.dumps(record))


@pytest.fixture
def peers():
    """A dead pid, a stopped process and a live one (all reaped or killed afterwards)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stopped = subprocess.Popen(["sleep", "60"])
    os.kill(stopped.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while health._process_state(stopped.pid) != "is stopped" and time.monotonic() < deadline:
        time.sleep(0.01)  # the signal is delivered asynchronously
    alive = subprocess.Popen(["sleep", "60"])
    yield dead.pid, stopped.pid, alive.pid
    for proc in (stopped, alive):
        proc.kill()
        proc.wait()


def test_the_diagnosis_names_dead_stopped_and_silent_peers_only(peers):
    dead, stopped, alive = peers
    store = dist.HashStore()
    monitor = HealthMonitor(store, 0, 6, timeout_s=60)
    _record(store, 1, dead)
    _record(store, 2, stopped)
    _record(store, 3, alive)
    _record(store, 4, alive, age_s=health.SILENT_AFTER_S + 3)
    _record(store, 5, dead, phase="finished")  # ended normally: not a failure
    diagnosis = monitor.diagnose()
    assert f"rank 1 (pid {dead} on {socket.gethostname()}) died" in diagnosis
    assert f"rank 2 (pid {stopped} on {socket.gethostname()}) is stopped" in diagnosis
    assert "rank 4 " in diagnosis
    assert "stopped responding" in diagnosis
    assert "(last seen in forward-backward, iteration 7)" in diagnosis
    assert "rank 3 " not in diagnosis
    assert "rank 5 " not in diagnosis


def test_a_failure_with_every_peer_alive_stays_this_ranks_own(peers, monkeypatch):
    _, _, alive = peers
    monkeypatch.setattr(health, "DIAGNOSIS_WAIT_S", 0.3)
    store = dist.HashStore()
    monitor = HealthMonitor(store, 0, 2, timeout_s=60)
    _record(store, 1, alive)
    error = RuntimeError("a bug of this rank")
    assert monitor.failure(error) is error
    _record(store, 1, peers[0])  # now rank 1 is dead
    failure = monitor.failure(RuntimeError("Connection reset by peer"))
    assert isinstance(failure, PeerFailureError)
    assert "rank 0 failed in start-up at iteration 0 because rank 1" in str(failure)
    assert "(RuntimeError: Connection reset by peer)" in str(failure)


WATCHDOG = textwrap.dedent(
    """
    import logging, sys, time
    import torch.distributed as dist
    from megatron_odc.runner import health
    logging.basicConfig(level=logging.INFO)
    health.WATCHDOG_SLACK_S = 0.5
    store = dist.HashStore()
    monitor = health.HealthMonitor(store, 0, 2, timeout_s=0.5, period_s=0.1).start()
    import json, socket, threading
    def peer_heartbeat():  # rank 1's own heartbeat thread, as a live rank has
        while True:
            dist.PrefixStore("megatron_odc/health/", store).set("rank1", json.dumps(
                {"pid": int(sys.argv[1]), "host": socket.gethostname(), "iteration": 3,
                 "phase": "optimizer step", "time": time.time()}))
            time.sleep(0.2)
    threading.Thread(target=peer_heartbeat, daemon=True).start()
    with monitor.phase(sys.argv[2], 3):
        time.sleep(6)  # stands for a collective that ignores its timeout
    print("phase ended")
    """
)


@pytest.mark.parametrize(
    ("peer", "phase", "ends"),
    [
        pytest.param(0, "forward-backward", True, id="dead-peer"),
        pytest.param(2, "forward-backward", False, id="live-peer"),
        pytest.param(0, "save", False, id="dead-peer-in-a-save"),
    ],
)
def test_the_watchdog_ends_a_rank_stuck_on_a_gone_peer_only(peers, peer, phase, ends):
    proc = subprocess.run(
        [sys.executable, "-c", WATCHDOG, str(peers[peer]), phase],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if ends:
        assert proc.returncode == health.EXIT_PEER_FAILURE, proc.stderr[-2000:]
        assert "phase ended" not in proc.stdout
        stuck = re.search(rf"stuck in {phase} at iteration 3 for (\d+) s", proc.stderr)
        assert stuck, proc.stderr[-2000:]
        # timeout + slack = 1 s: ended well before the stuck call (6 s) would have returned
        assert int(stuck[1]) < 4, stuck[0]
        assert "because rank 1 (pid" in proc.stderr
        assert "died" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "phase ended" in proc.stdout
