"""``--override-opt_param-scheduler`` under Megatron-LM applies the flags' schedule (issue 37), gated on
``MEGATRON_LM_PATH``.

Megatron-LM's optimizer load restores the checkpoint's param groups, whose ``max_lr`` / ``min_lr``
megatron-core's scheduler reads first: a resume with a new ``--lr`` and the override flag kept the old
peak on every backend (``core_v0.16.1``, DDP and ODC alike: iteration 4 at 4.109e-4 instead of 2.382e-4).
The launcher's ``load_checkpoint`` wrapper (``integration/megatron_lm/checkpointing.py``) keeps this run's
bounds: the resumed iterations' learning rates equal a fresh run's with the new ``--lr``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests._megatron_lm import E2E_ARGS, MEGATRON_LM_PATH_ENV, REPO_ROOT, torchrun_command

_LR_RE = re.compile(r"iteration\s+(\d+)/.*?learning rate: ([0-9.E+-]+)")


_GROUP_KEY_REFUSAL = "Could not find parameter group with key"
"""megatron-core 0.19's optimizer load matches param groups by a key that holds their max_lr: its own
optimizers refuse a resume with a new ``--lr`` (ODC's optimizer keeps its groups)."""


def _learning_rates(megatron_lm_path: Path, cwd: Path, *flags: str) -> dict[int, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env[MEGATRON_LM_PATH_ENV] = str(megatron_lm_path)
    command = [*torchrun_command(2), "-m", "megatron_odc.launch", "pretrain_gpt.py"]
    proc = subprocess.run(
        [*command, *E2E_ARGS, *flags], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 and _GROUP_KEY_REFUSAL in log and "--dp-backend ddp" in " ".join(flags):
        pytest.skip(f"this tag's own DDP optimizer refuses the new --lr ({_GROUP_KEY_REFUSAL} ...)")
    assert proc.returncode == 0, log[-4000:]
    return {int(i): float(v) for i, v in _LR_RE.findall(log)}


@pytest.mark.parametrize("backend", ["odc", "ddp"])
def test_override_opt_param_scheduler_applies_the_new_lr(megatron_lm_path, tmp_path, backend):
    ckpt = str(tmp_path / "ckpt")
    common = ("--dp-backend", backend)
    _learning_rates(
        megatron_lm_path, tmp_path, *common, "--save", ckpt, "--save-interval", "3",
        "--exit-interval", "3",
    )  # fmt: skip
    resumed = _learning_rates(
        megatron_lm_path, tmp_path, *common, "--load", ckpt, "--lr", "5e-4",
        "--override-opt_param-scheduler",
    )  # fmt: skip
    fresh = _learning_rates(megatron_lm_path, tmp_path, *common, "--lr", "5e-4")
    assert sorted(resumed) == [4, 5, 6], resumed
    for iteration in (4, 5, 6):
        assert resumed[iteration] == pytest.approx(fresh[iteration], rel=1e-6), (resumed, fresh)
