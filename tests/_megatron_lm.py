"""Megatron-LM end-to-end helpers: whether a real tree of a supported tag can run here, and its losses.

:func:`megatron_lm_skip_reason` says why the ``MEGATRON_LM_PATH`` tests cannot run (no path, or an import
of what ``pretrain_gpt.py`` needs fails, e.g. a Megatron-LM dependency that ``pip install -e
.[megatron-lm]`` brings); the ``megatron_lm_path`` fixture (``tests/integration/conftest.py``) skips with
it; :func:`megatron_lm_tag` names the tag of that tree (the gated tests run whichever tag
``MEGATRON_LM_PATH`` points at, one per run, with its megatron-core installed). :func:`pretrain_gpt_losses` runs ``pretrain_gpt.py`` on CPU ranks (2 by default) under torchrun or
``mpiexec``, through the launcher or as a patched tree's own script, and returns the printed losses.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from megatron_odc.integration.megatron_lm.flags import CPU_FLAGS
from megatron_odc.integration.megatron_lm.releases import (
    checkout_version,
    release_for_series,
    supported_tags_text,
)
from megatron_odc.integration.megatron_lm.sft_example import (
    write_chats_of_lengths,
    write_tokenizer,
)
from tests._dist import torchrun_command
from tests._mpi import mpi_env, mpiexec_command

REPO_ROOT = Path(__file__).resolve().parents[1]
MEGATRON_LM_PATH_ENV = "MEGATRON_LM_PATH"

MODEL_ARGS = tuple(
    shlex.split(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 4 --train-iters 6 "
        "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.01 "
        "--clip-grad 1.0 --seed 1234 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 "
        "--split 99,1,0 --eval-iters 1 --eval-interval 1000 --log-interval 1 "
        "--hidden-dropout 0 --attention-dropout 0"
    )
)
"""A tiny GPT on mock data, dropout off (runs with other sample-to-rank splits stay comparable)."""
E2E_ARGS = (*MODEL_ARGS, *(word for flag in CPU_FLAGS for word in flag))
""":data:`MODEL_ARGS` with Megatron-LM's CPU flags spelled out."""

SFT_SKEWED = [70, 70, 70, 50, 50, 50, 50, 10]
"""The real lengths of every global batch of 8 in :func:`sft_args`' JSONL: three records of 70 tokens
never pair under the 128-token cap, the 50s and the 10 do, so LB-Mini's equal costs need counts 3
and 2 on every step, while LB-Micro gives 2 and 2."""


def sft_args(data: Path) -> tuple[str, ...]:
    """``pretrain_gpt.py --sft`` arguments (4 iterations, the CPU flags) over a word-level tokenizer
    and a JSONL of :data:`SFT_SKEWED` lengths written to ``data``."""
    write_tokenizer(data / "tokenizer")
    write_chats_of_lengths(data / "chats.jsonl", SFT_SKEWED * 6, seed=1)
    model = shlex.split(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
        "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 8 --train-iters 4 "
        "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.01 "
        "--clip-grad 1.0 --seed 1234 --split 100,0,0 --eval-iters 0 --eval-interval 1000 "
        "--log-interval 1 --hidden-dropout 0 --attention-dropout 0 --sft "
        "--tokenizer-type SFTTokenizer"
    )
    paths = ["--data-path", str(data / "chats.jsonl"), "--tokenizer-model", str(data / "tokenizer")]
    return (*model, *paths, *(word for flag in CPU_FLAGS for word in flag))


_LOSS_RE = re.compile(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+)")
_GRAD_NORM_RE = re.compile(r"iteration\s+(\d+)/.*?lm loss: .*?grad norm: ([0-9.E+-]+)")

_IMPORT_CHECK = """
import importlib.util, sys
import megatron.core  # as the launcher does: megatron.core stays the installed one,
sys.path.insert(0, sys.argv[1])  # and the checkout comes first (the wheel ships megatron/training)
spec = importlib.util.spec_from_file_location("pretrain_gpt_imports", sys.argv[1] + "/pretrain_gpt.py")
spec.loader.exec_module(importlib.util.module_from_spec(spec))
"""


@functools.cache
def megatron_lm_skip_reason() -> str | None:
    """Why the real Megatron-LM cannot run here, or None when it can (checked once per session)."""
    path = os.environ.get(MEGATRON_LM_PATH_ENV)
    if not path:
        return f"needs {MEGATRON_LM_PATH_ENV} (a Megatron-LM tree of {supported_tags_text()})"
    if not (Path(path) / "pretrain_gpt.py").is_file():
        return f"{MEGATRON_LM_PATH_ENV}={path} holds no pretrain_gpt.py"
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK, str(Path(path).resolve())],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return (
            f"pretrain_gpt.py's imports fail ({last}): install Megatron-LM's dependencies "
            "with pip install -e .[megatron-lm]"
        )
    return None


def megatron_lm_tag(path: Path) -> str:
    """The supported tag of the tree at ``path`` (by its ``megatron/core/package_info.py``)."""
    version = checkout_version(Path(path) / "megatron" / "training")
    assert version is not None, f"{path} has no megatron/core/package_info.py"
    release = release_for_series(tuple(int(p) for p in version.split(".")[:2]))
    assert release is not None, f"{path} is Megatron-LM {version}, not a supported tag"
    return release.tag


def _env() -> dict[str, str]:
    # The children import this checkout's megatron_odc, whatever is installed.
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }


def pretrain_gpt_losses(
    backend: str | None,
    cwd: Path,
    *extra: str,
    iterations: range = range(1, 7),
    args: tuple[str, ...] = E2E_ARGS,
    script: Path | None = None,
    nproc: int = 2,
    mpiexec: bool = False,
    env: dict[str, str] | None = None,
    log_holds: tuple[str, ...] = (),
    launch: str = "pretrain_gpt.py",
    grad_norms: dict[int, float] | None = None,
) -> dict[int, float]:
    """``{iteration: lm loss}`` of an ``nproc``-rank CPU run of ``pretrain_gpt.py --dp-backend backend``
    (``backend`` None: no ``--dp-backend``, Megatron-LM's own choice from its flags).

    Through ``python -m megatron_odc.launch`` by default; ``script`` runs that file itself instead
    (a patched Megatron-LM tree's, without the launcher). Under torchrun, or with ``mpiexec`` under
    ``mpiexec -n nproc`` (``tests/_mpi.py``; the caller passes ``--odc-transport mpi``); ``env`` is
    added to the ranks' environment. Every string of ``log_holds`` must be in the run's output.
    ``launch`` is the script the launcher runs (a stand-in instead of ``pretrain_gpt.py``);
    ``grad_norms``, where given, receives ``{iteration: grad norm}`` of the same log.
    """
    main = [str(script)] if script else ["-m", "megatron_odc.launch", launch]
    main += [*args, *(("--dp-backend", backend) if backend else ()), *extra]
    if mpiexec:
        cmd = mpiexec_command(nproc, main)
        ranks_env = mpi_env({"CUDA_DEVICE_MAX_CONNECTIONS": "1", **(env or {})})
    else:
        cmd = [*torchrun_command(nproc), *main]
        ranks_env = {**_env(), **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, env=ranks_env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    losses = {int(i): float(v) for i, v in _LOSS_RE.findall(log)}
    assert sorted(losses) == list(iterations), log[-4000:]
    for text in log_holds:
        assert text in log, f"{text!r} not in the log:\n{log[-4000:]}"
    if grad_norms is not None:
        grad_norms.update((int(i), float(v)) for i, v in _GRAD_NORM_RE.findall(log))
        assert sorted(grad_norms) == list(iterations), log[-4000:]
    return losses
