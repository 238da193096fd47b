"""Spawn N CPU ranks for a test, with a deadline, file-store rendezvous and one thread per rank.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh ranks, each of which
joins a gloo process group through a ``file://`` store under a private temporary directory, sets
``OMP_NUM_THREADS=1`` and calls ``fn(rank, world_size, *args)``. It returns the list of the ranks' return
values, or raises ``RankFailureError`` naming every rank that raised, died or hung past the deadline, with the
rank's traceback. Whatever happens, every child is killed and reaped, and the private shared-memory
directory the ranks used (``MEGATRON_ODC_SHM_DIR``) is removed.

``fn`` must be a module-level function (it is pickled); so must ``args``.

On a machine without CUDA, ranks are forked from multiprocessing's ``forkserver``, which imports torch and
megatron-core once per test session (``_PRELOAD``) instead of once per rank: a fresh interpreter spends about
8 s on those imports on a 2-core host, and the suite starts hundreds of ranks. The server imports only; it
runs no torch operation, so no thread pool or process group is forked. Each rank gets the parent's
environment as it is at ``run_ranks`` time (the server's own is the one it was started with), exactly what
``spawn`` gave it. Where CUDA exists (the GPU check, ``benchmarks/gpu_check.py``) ranks are spawned: the
server's imports could initialise the CUDA driver, which a forked child cannot use.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHM_ROOT_ENV = "MEGATRON_ODC_TEST_SHM_ROOT"
SHM_ROOT = Path(os.environ.get(SHM_ROOT_ENV, "/dev/shm"))
"""Where each run's private shared-memory directory is made; a test that checks what a subprocess
leaves behind points it at a directory of its own, so that concurrent test runs do not count."""
_PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron_odc.mcore.data_parallel",
]
_GRACE_AFTER_FAILURE_S = 10.0


class RankFailureError(AssertionError):
    """One or more ranks raised, died or hung; the message names each of them."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    store_path: str,
    result_path: str,
    backend: str,
    pg_timeout_s: float,
    environ: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    run_and_record(
        fn,
        rank,
        world_size,
        args,
        result_path,
        backend,
        pg_timeout_s,
        init_method=f"file://{store_path}",
    )


def run_and_record(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    result_path: str,
    backend: str,
    pg_timeout_s: float,
    init_method: str,
) -> None:
    """A rank's body: join the process group, run ``fn``, and write its outcome to ``result_path``
    (read back by :func:`read_result`). Shared with ``tests/_mpi.py``."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    outcome: tuple[str, Any]
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        try:
            outcome = ("ok", fn(rank, world_size, *args))
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    except BaseException as exc:
        outcome = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(outcome, f)
    os.replace(tmp, result_path)


def _context() -> multiprocessing.context.BaseContext:
    import torch

    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts, on the first run
    return ctx


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    backend: str = "gloo",
    pg_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    grace_s: float = _GRACE_AFTER_FAILURE_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results.

    Args:
        fn: module-level function run by each rank after the process group is up.
        world_size: number of ranks.
        *args: picklable extra arguments for ``fn``.
        timeout_s: deadline for the whole run; ranks still alive then are killed and named as hung.
        backend: torch.distributed backend.
        pg_timeout_s: the process group's own timeout for collectives.
        env: extra environment variables for the children.
        grace_s: once a rank has failed, how long the others may take to fail or finish on their own.

    Raises:
        RankFailureError: a rank raised, exited without a result, or hung past ``timeout_s``.
    """
    ctx = _context()
    run_id = uuid.uuid4().hex[:12]
    workdir = Path(tempfile.mkdtemp(prefix=f"odc-test-{run_id}-"))
    shm_dir = SHM_ROOT / f"megatron_odc_test_{run_id}"
    shm_dir.mkdir()
    child_env = {"OMP_NUM_THREADS": "1", "MEGATRON_ODC_SHM_DIR": str(shm_dir), **(env or {})}
    saved_env = {k: os.environ.get(k) for k in child_env}
    procs: list[multiprocessing.Process] = []
    result_paths = [str(workdir / f"rank{r}.pkl") for r in range(world_size)]
    try:
        # The environment reaches a rank twice on purpose: a spawned interpreter reads it at start (torch
        # reads OMP_NUM_THREADS on import, while the target is unpickled, before ``_child`` runs), so the
        # parent's own is set around ``start``; a forked one starts with the forkserver's, so ``_child``
        # applies the copy passed as ``environ``.
        os.environ.update(child_env)
        try:
            for rank in range(world_size):
                p = ctx.Process(
                    target=_child,
                    args=(
                        fn,
                        rank,
                        world_size,
                        args,
                        str(workdir / "store"),
                        result_paths[rank],
                        backend,
                        pg_timeout_s,
                        dict(os.environ),
                    ),
                    name=f"rank{rank}",
                    daemon=True,
                )
                p.start()
                procs.append(p)
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return _collect(procs, result_paths, timeout_s, grace_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        _remove_tree(shm_dir)
        _remove_tree(workdir)


def read_result(path: str) -> tuple[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def record_outcome(
    rank: int,
    outcome: tuple[str, Any] | None,
    missing: str,
    problems: list[str],
    results: list[Any],
) -> None:
    """Append ``rank``'s return value (``None`` if it failed) to ``results`` and what went wrong, if
    anything, to ``problems``; ``missing`` says why a rank left no outcome."""
    if outcome is None:
        problems.append(f"rank {rank} {missing}")
        results.append(None)
    elif outcome[0] == "error":
        problems.append(f"rank {rank} raised {outcome[1]}")
        results.append(None)
    else:
        results.append(outcome[1])


def _collect(
    procs: list[multiprocessing.Process],
    result_paths: list[str],
    timeout_s: float,
    grace_s: float,
) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    first_failure_at: float | None = None
    while True:
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        now = time.monotonic()
        failed = any(
            not p.is_alive()
            and (p.exitcode != 0 or read_result(rp) is None or read_result(rp)[0] != "ok")
            for p, rp in zip(procs, result_paths)
        )
        if failed and first_failure_at is None:
            first_failure_at = now
        if now > deadline or (first_failure_at is not None and now - first_failure_at > grace_s):
            break
        time.sleep(0.05)

    problems: list[str] = []
    results: list[Any] = []
    for rank, (p, rp) in enumerate(zip(procs, result_paths)):
        if p.is_alive():
            if first_failure_at is None:
                reason = f"still running at the {timeout_s:.0f} s deadline"
            else:
                reason = f"still running {grace_s:.0f} s after another rank failed"
            problems.append(f"rank {rank} hung ({reason}; killed)")
            results.append(None)
            continue
        missing = f"died with exit code {p.exitcode} and no result"
        record_outcome(rank, read_result(rp), missing, problems, results)
    if problems:
        raise RankFailureError("\n".join(problems))
    return results


def torchrun_command(nproc: int) -> list[str]:
    """``python -m torch.distributed.run`` on ``nproc`` local ranks; ``--standalone``: torchrun binds
    a free port itself, where a port picked beforehand may be taken meanwhile."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
    ]
