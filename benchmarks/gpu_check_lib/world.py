"""The spawned world of a check: the rehearsal switch, where the rank bodies allocate, and ``run_world``,
which runs a rank body on processes that share ``cuda:0`` (or, in a rehearsal, on CPU with the fakes)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

OVERLAP_ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "OMP_NUM_THREADS": "1"}

_REHEARSAL = False
"""True under ``--cpu-rehearsal`` (host memory, faked GPU): set by ``set_rehearsal`` in the main process
and by ``_on_device`` in each rank process."""


def set_rehearsal(on: bool) -> None:
    """Switches this process to a rehearsal on CPU (``--cpu-rehearsal``) or to the GPU."""
    global _REHEARSAL
    _REHEARSAL = on


def rehearsing() -> bool:
    """Whether this process runs a rehearsal on CPU."""
    return _REHEARSAL


def rank_device() -> str:
    """Where the rank bodies allocate: ``cpu`` in a rehearsal, else the one GPU."""
    return "cpu" if _REHEARSAL else "cuda"


def accumulate_modes() -> list[str]:
    """The CUDA transport's accumulate modes that can run here (atomic needs Triton on a real GPU)."""
    return ["deterministic"] if _REHEARSAL else ["atomic", "deterministic"]


def _on_device(rank: int, world_size: int, fn: Callable, rehearsal: bool, *args: Any) -> Any:
    """One rank of a check: on ``cuda:0``, or in a rehearsal on CPU with the fakes."""
    set_rehearsal(rehearsal)
    with contextlib.ExitStack() as undo:
        if rehearsal:  # megatron-core's CPU runtime, and host memory as the "GPU"
            from megatron_odc.integration.cpu import apply_cpu_patches
            from tests._fake_cuda import install_fake_cuda

            undo.callback(apply_cpu_patches().revert)
            undo.callback(install_fake_cuda(nvshmem=True).revert)
        else:
            torch.cuda.set_device(0)
        return fn(rank, world_size, *args)


def run_world(fn: Callable, world_size: int, *args: Any, timeout_s: float) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes sharing cuda:0.

    The spawning, deadline and per-rank reports are the test harness's (``tests/_dist.py``), which
    gives every run a private ``MEGATRON_ODC_SHM_DIR`` and removes it. In a rehearsal the processes run
    on CPU instead: megatron-core's CPU patches, and ``tests/_fake_cuda.py``'s host-memory symmetric
    memory under that directory.
    """
    from tests._dist import run_ranks

    return run_ranks(
        _on_device,
        world_size,
        fn,
        _REHEARSAL,
        *args,
        timeout_s=timeout_s,
        pg_timeout_s=120,
        env=OVERLAP_ENV,
    )
