"""Rank health in Megatron-LM's loop (``integration/megatron_lm/health.py``; issue 37, item 9), on CPU ranks.

The patch points start the job's health monitor and ``--save`` lock after ``initialize_megatron``, record
the phases of ``train_step`` / ``save_checkpoint`` / ``load_checkpoint``, and the launcher turns a failure
into what one rank prints. Before, none of this ran under Megatron-LM: a rank whose peer died printed
gloo's error and traceback without naming the peer, and a refusal was printed by every rank. The real
``pretrain_gpt.py`` with stopped and killed ranks is ``test_megatron_lm_faults.py`` (gated).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import RankFailureError, run_ranks
from tests._megatron_lm import _env


def _dead_peer_rank(rank: int, world_size: int, workdir: str) -> None:
    import torch.distributed as dist

    from megatron_odc.integration.megatron_lm import health
    from megatron_odc.runner.save_lock import LOCK_FILENAME

    del world_size
    save = Path(workdir) / "ckpt"
    health.start_job(argparse.Namespace(save=str(save), distributed_timeout_minutes=1))
    assert (save / LOCK_FILENAME).is_file()
    # (the save wrapper also starts the checkpoint writer's manager, which daemonic ranks cannot)
    with health.phase("load"):
        assert health._job.monitor._phase == "load"
    with health.phase("iteration", 3):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.barrier()
        except RuntimeError as error:
            report = health.failure_report(error, refusal=False)
            (Path(workdir) / "report.json").write_text(json.dumps(report))
            raise


def test_a_dead_peer_is_named_in_one_line(tmp_path) -> None:
    with pytest.raises(RankFailureError):
        run_ranks(_dead_peer_rank, 2, str(tmp_path), timeout_s=120, pg_timeout_s=30)
    status, line = json.loads((tmp_path / "report.json").read_text())
    assert status == 3, (status, line)
    assert line.startswith("rank 0 failed in iteration at iteration 3 because rank 1 (pid "), line
    assert "died (last seen in iteration, iteration 3)" in line, line


PATCHED_SOURCE_END = """
import argparse, atexit, datetime, json, sys
import torch.distributed as dist
from megatron_odc.integration.megatron_lm import health

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
store = dist.PrefixStore("megatron_odc/health/", dist.distributed_c10d._get_default_store())
store.set_timeout(datetime.timedelta(seconds=10))

def report():  # registered before the job's own handler, so it runs after it
    phase = json.loads(store.get("rank0"))["phase"]
    print(f"last phase {phase}, groups left {dist.is_initialized()}", flush=True)

atexit.register(report)
health.start_job(argparse.Namespace(save=None, distributed_timeout_minutes=1))
if sys.argv[2] == "fail":
    raise RuntimeError("a bug")
"""


@pytest.mark.parametrize(
    ("end", "printed"),
    [
        ("return", "last phase finished, groups left False"),
        ("fail", "last phase start-up, groups left True"),
    ],
)
def test_a_patched_source_ends_its_job_at_exit(tmp_path, end, printed) -> None:
    """Without a launcher the job ends at the interpreter's exit: a script that returned is recorded
    finished and its process groups destroyed ([Note: process groups at exit]); one that raised is
    not, and its groups stay (a collective may still wait on a peer)."""
    script = tmp_path / "patched_source.py"
    script.write_text(PATCHED_SOURCE_END)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), end],
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert printed in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert (proc.returncode == 0) == (end == "return"), proc.stderr[-3000:]


def _refusing_rank(rank: int, world_size: int, workdir: str) -> tuple[int, str | None]:
    from megatron_odc.integration.megatron_lm import health

    del rank, world_size
    health.start_job(argparse.Namespace(save=None, distributed_timeout_minutes=1))
    try:
        error = ValueError("--dp-backend odc does not combine with --something: leave it off")
        return health.failure_report(error, refusal=True)
    finally:
        health.end_job(finished=False)


def test_a_refusal_found_by_every_rank_is_printed_once() -> None:
    reports = run_ranks(_refusing_rank, 2, "", timeout_s=120)
    assert reports[0] == (2, "--dp-backend odc does not combine with --something: leave it off")
    assert reports[1] == (2, None)


@pytest.mark.parametrize(("local_rank", "printed"), [("0", True), ("1", False)])
def test_a_refusal_before_the_process_group_is_printed_by_each_hosts_first_rank(
    monkeypatch, local_rank, printed
) -> None:
    from megatron_odc.integration.megatron_lm import health

    monkeypatch.setenv("LOCAL_RANK", local_rank)
    status, line = health.failure_report(ValueError("bad flag"), refusal=True)
    assert status == 2
    assert (line == "bad flag") if printed else line is None
