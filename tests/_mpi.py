"""Run N ranks under ``mpiexec`` for a test, with a deadline naming the ranks that failed or hung.

``run_mpi(fn, world_size, *args)`` is ``tests/_dist.py::run_ranks`` for the ``mpi`` transport: it starts
``mpiexec -n world_size python -m tests._mpi WORKDIR`` (the venv's ``mpiexec`` first), each rank sets
torch's launch variables from MPI's with ``megatron_odc.runner.launch_env`` (the product's own path),
joins a gloo group through ``env://`` with ``OMP_NUM_THREADS=1`` and calls ``fn(rank, world_size,
*args)``. It returns the ranks' return values, or raises ``RankFailureError`` naming each rank that
raised, died or hung, with the launcher's output tail. The whole job is killed at ``timeout_s``.

``MPIEXEC`` is ``None`` where no launcher or mpi4py is installed; ``requires_mpi`` skips then.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests._dist import RankFailureError, read_result, record_outcome, run_and_record

REPO_ROOT = Path(__file__).resolve().parents[1]


def _find_mpiexec() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return None
    beside = Path(sys.executable).parent / "mpiexec"  # the venv's, from the mpich wheel
    return str(beside) if beside.exists() else shutil.which("mpiexec")


MPIEXEC = _find_mpiexec()
requires_mpi = pytest.mark.skipif(
    MPIEXEC is None, reason="needs mpi4py and mpiexec (pip install mpi4py mpich)"
)


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an ``mpiexec`` child: no torchrun variables, the repository importable."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def mpiexec_command(world_size: int, argv: list[str]) -> list[str]:
    """``mpiexec -n world_size python ARGV`` with this interpreter."""
    assert MPIEXEC is not None
    return [MPIEXEC, "-n", str(world_size), sys.executable, *argv]


def run_mpi(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks under ``mpiexec``; their results.

    Raises:
        RankFailureError: a rank raised, exited without a result, or the job passed ``timeout_s``.
    """
    workdir = Path(tempfile.mkdtemp(prefix="odc-mpi-test-"))
    try:
        with open(workdir / "call.pkl", "wb") as f:
            pickle.dump((fn, args, pg_timeout_s), f)
        proc = subprocess.Popen(
            mpiexec_command(world_size, ["-m", "tests._mpi", str(workdir)]),
            cwd=REPO_ROOT,
            env=mpi_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
            hung = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            hung = True
        problems, results = [], []
        for rank in range(world_size):
            why = f"hung (killed at the {timeout_s:.0f} s deadline)" if hung else "died"
            outcome = read_result(str(workdir / f"rank{rank}.pkl"))
            record_outcome(rank, outcome, f"{why} with no result", problems, results)
        if problems:
            tail = output[-4000:]
            raise RankFailureError(
                "\n".join(problems) + f"\nmpiexec exit code {proc.returncode}; output:\n{tail}"
            )
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _main(workdir: str) -> None:
    from megatron_odc.runner.launch_env import apply_launch_env

    apply_launch_env("mpi")
    with open(Path(workdir) / "call.pkl", "rb") as f:
        fn, args, pg_timeout_s = pickle.load(f)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result_path = str(Path(workdir) / f"rank{rank}.pkl")
    run_and_record(fn, rank, world_size, args, result_path, "gloo", pg_timeout_s, "env://")
    # Meet before MPI_Finalize (at exit), sleeping: a rank that finished first would otherwise spin a
    # core in Finalize that the others, two to four to a core here, still compute on.
    from megatron_odc.transport.mpi import import_mpi

    request = import_mpi().COMM_WORLD.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


if __name__ == "__main__":
    _main(sys.argv[1])
