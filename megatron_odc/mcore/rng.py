"""Every random-number generator a megatron-core training step draws from: capture and restore.

Python's ``random``, torch's CPU generator, the current CUDA generator where there is one, and
megatron-core's tensor-parallel RNG tracker (dropout inside TP regions). A checkpoint that restores all
of them lets the next iteration draw exactly what the uninterrupted run drew.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker


def rng_state() -> dict[str, Any]:
    """This process's generator states (picklable)."""
    state = {
        "python": random.getstate(),
        "torch_cpu": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch_cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


@contextlib.contextmanager
def restored_rng() -> Iterator[None]:
    """Every generator is where it was when the block ends (work that draws off the record, such as
    timing probes or building a throwaway model)."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
