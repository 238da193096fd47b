"""Fault injection for the reliability tests: stop or kill one rank the n-th time it reaches a point.

``inject(point, signal_name, nth)`` patches the function behind ``point`` in this process so that its
``nth`` call first sends ``signal_name`` (``STOP`` or ``KILL``) to the process itself. Points:

- ``forward``: the GPT forward step of a microbatch (``runner.trainer.gpt_forward_step``);
- ``fence``: the shared-memory transport's fence (inside ``finalize_model_grads`` and the step);
- ``optimizer``: ``ODCOptimizer.step`` (the grad-norm all-reduce and the owned-shard update);
- ``save``: ``runner.checkpoint.save_checkpoint`` (the peers are then inside the save's collectives).

``python -m tests.runner._faults [training flags]`` is the training entry with the fault that
``MEGATRON_ODC_TEST_FAULT=<rank>:<point>:<signal>:<nth>`` names (for torchrun; empty: no fault).
"""

from __future__ import annotations

import functools
import os
import signal
import sys

POINTS = ("forward", "fence", "optimizer", "save")


def _target(point: str) -> tuple[object, str]:
    if point == "forward":
        from megatron_odc.runner import trainer

        return trainer, "gpt_forward_step"
    if point == "fence":
        from megatron_odc.transport.shm import ShmTransport

        return ShmTransport, "fence"
    if point == "optimizer":
        from megatron_odc.mcore.optimizer import ODCOptimizer

        return ODCOptimizer, "step"
    if point == "save":
        from megatron_odc.runner import checkpoint

        return checkpoint, "save_checkpoint"
    raise ValueError(f"unknown fault point {point!r}; one of {POINTS}")


def inject(point: str, signal_name: str, nth: int) -> None:
    """Make the ``nth`` call of ``point`` in this process send ``SIG<signal_name>`` to itself first."""
    owner, name = _target(point)
    original = getattr(owner, name)
    signum = getattr(signal, f"SIG{signal_name}")
    calls = [0]

    @functools.wraps(original)
    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            os.kill(os.getpid(), signum)
        return original(*args, **kwargs)

    setattr(owner, name, faulty)


def main() -> int:
    fault = os.environ.get("MEGATRON_ODC_TEST_FAULT", "")
    if fault:  # empty: the plain entry
        rank, point, signal_name, nth = fault.split(":")
        if int(os.environ["RANK"]) == int(rank):
            inject(point, signal_name, int(nth))
    from megatron_odc.train import main as train_main

    return train_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
