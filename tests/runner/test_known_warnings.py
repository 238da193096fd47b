"""Quiet output (issue 37, item 10): what a run prints besides its log is explained.

Before: two thirds of a quick-start run's output were megatron-core / torch warnings, once per rank and
again in each checkpoint-writer process, and ``--help`` printed 12 warning lines first. Now the known
harmless ones (``runner/known_warnings.py``) are filtered before megatron-core is imported;
``MEGATRON_ODC_SHOW_WARNINGS=1`` shows them again.
"""

from __future__ import annotations

import os
import subprocess
import sys

from megatron_odc.runner.known_warnings import SHOW_WARNINGS_ENV
from tests.runner.test_trainer import _clean_env, _torchrun_status

TORCHRUN_BANNER = {
    "*****************************************",
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
    "your system being overloaded, please further tune the variable for optimal performance in "
    "your application as needed.",
}
"""torchrun's own lines (its agent prints them before any rank starts)."""


def _help(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_odc.train", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_prints_no_warning_unless_asked(tmp_path, shm_dir):
    env = _clean_env(shm_dir)
    env.pop(SHOW_WARNINGS_ENV, None)
    quiet = _help(env)
    assert quiet.returncode == 0
    assert quiet.stdout.startswith("usage:")
    assert quiet.stderr == "", quiet.stderr[-2000:]
    loud = _help({**env, SHOW_WARNINGS_ENV: "1"})
    assert "Transformer Engine and Apex are not installed" in loud.stderr  # they exist here


def test_a_run_with_tp_and_saves_prints_only_its_log_and_torchrun_s_banner(tmp_path, shm_dir):
    argv = ["--num-layers", "1", "--hidden-size", "32", "--seq-length", "64"]
    argv += ["--global-batch-size", "8", "--synthetic-num-samples", "64", "--train-iters", "2"]
    argv += ["--tensor-model-parallel-size", "2", "--save", str(tmp_path / "ck")]
    argv += ["--save-interval", "1", "--log-interval", "1"]
    env = _clean_env(shm_dir)
    env.pop(SHOW_WARNINGS_ENV, None)
    proc = _torchrun_status(argv, tmp_path, shm_dir, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    extra = [line for line in proc.stderr.splitlines() if line.strip() not in TORCHRUN_BANNER]
    assert [line for line in extra if line.strip()] == [], "\n".join(extra[-40:])
    assert "training finished" in proc.stdout
    assert "Warning" not in proc.stdout
    assert os.path.isdir(tmp_path / "ck" / "iter_0000002")
