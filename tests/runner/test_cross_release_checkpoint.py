"""A checkpoint saved under one megatron-core release resumes under another (issue 34).

Needs a second Python whose megatron-core is another release, named by ``MEGATRON_ODC_OTHER_PYTHON``
(``.ci/run`` sets it in its Python 3.12 + megatron-core 0.19.2 run to the Python 3.11 + 0.16.1 venv);
skipped otherwise, saying so. In each direction the entry saves at iteration 2 under one release and
resumes to 4 under the other, optimizer state, sampler and scheduler included; the resumed losses equal
the saving release's uninterrupted run, where megatron-core can read the other release's format:
0.16.1 cannot read a 0.19 checkpoint (0.19 keeps the common state inside the torch_dist files, 0.16
only reads ``common.pt``), and that is refused in one line naming both.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest

from tests.runner.test_trainer import _clean_env, _logged_losses, _torchrun_command

OTHER_PYTHON_ENV = "MEGATRON_ODC_OTHER_PYTHON"

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--seq-length", "64", "--global-batch-size", "8",
    "--synthetic-num-samples", "64", "--log-interval", "1", "--train-iters", "4",
]  # fmt: skip


def _other_python() -> str:
    python = os.environ.get(OTHER_PYTHON_ENV)
    if not python:
        pytest.skip(f"needs {OTHER_PYTHON_ENV}: a Python with another megatron-core release")
    if not Path(python).is_file():
        pytest.fail(f"{OTHER_PYTHON_ENV}={python} is not a file")
    return python


@functools.cache  # each call imports megatron-core in a fresh interpreter (seconds)
def _release(python: str) -> str:
    return subprocess.run(
        [python, "-c", "from megatron.core import package_info as p; print(p.__version__)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()


def _train(python: str, argv: list[str], cwd: Path, shm: Path, *, ok: bool = True):
    """The run's logged losses; with ``ok=False`` it must fail, and its stderr is returned."""
    command = _torchrun_command("megatron_odc.train", [*TINY, *argv])
    command[0] = python
    proc = subprocess.run(
        ["timeout", "200", *command],
        cwd=cwd,
        env=_clean_env(shm),
        capture_output=True,
        text=True,
        timeout=220,
    )
    if not ok:
        assert proc.returncode != 0, proc.stdout[-3000:]
        return proc.stderr
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _logged_losses(proc.stdout)


@pytest.mark.parametrize("direction", ["other-to-this", "this-to-other"])
def test_a_checkpoint_resumes_under_another_megatron_core_release(tmp_path, shm_dir, direction):
    import sys

    other = _other_python()
    saver, loader = (
        (other, sys.executable) if direction == "other-to-this" else (sys.executable, other)
    )
    assert _release(saver) != _release(loader), "both Pythons have the same megatron-core"
    ckpt = str(tmp_path / "ckpt")
    straight = _train(saver, ["--save", ckpt, "--save-interval", "2"], tmp_path, shm_dir)
    # Resume from iteration 2 (the tracker names the latest complete iteration, Megatron-LM's format).
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2\n")
    if _release(saver) >= "0.19" > _release(loader):
        refused = _train(loader, ["--load", ckpt], tmp_path, shm_dir, ok=False)
        errors = [line for line in refused.splitlines() if "megatron_odc.train: error:" in line]
        assert len(errors) == 1, refused[-3000:]
        assert "was saved by megatron-core 0.19 or later" in errors[0], errors
        assert "Resume it with megatron-core >= 0.19" in errors[0], errors
        return
    resumed = _train(loader, ["--load", ckpt], tmp_path, shm_dir)
    assert sorted(resumed) == [3, 4], resumed
    for it in (3, 4):
        assert resumed[it] == pytest.approx(straight[it], rel=1e-5), (it, resumed, straight)
