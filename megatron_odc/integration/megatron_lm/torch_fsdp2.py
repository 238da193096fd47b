"""Megatron-LM's own torch FSDP2 (``--use-torch-fsdp2``) under the launcher: one bug refused, one fixed.

The launcher runs Megatron-LM's own data parallelism where no ``--dp-backend`` is given, FSDP2
included (on CPU through two shims, ``cpu_shims.py``). megatron-core's
``TorchFullyShardedDataParallel`` has two defects, each found by running it
(``tests/integration/test_megatron_lm_sft_e2e.py``, ``benchmarks/megatron_lm_sft.py``):

- up to megatron-core 0.18 its ``finish_grad_sync`` takes no ``force_all_reduce``, which
  ``finalize_model_grads`` passes: every run stops at the first step with a ``TypeError``.
  :func:`refuse_broken_torch_fsdp2` checks the installed classes (not tags) and stops the job before
  anything is built, in one line naming what to change;
- it does not override ``scale_gradients`` (the base class's is a no-op), so under
  ``--calculate-per-token-loss`` the gradients are never divided by the step's token count (FSDP2's
  reduce-scatter averages over DP: they come out tokens / DP times too large), and clipping and
  Adam's epsilon then train another model, silently. :func:`scale_torch_fsdp2_gradients` gives every
  such chunk the scaling megatron-core's DDP does (the DP average undone, then divided by the global
  token count), once Megatron-LM has built the model (``builders.wrap_setup_model_and_optimizer``), so
  per-token loss trains what Megatron-LM's DDP trains (on Megatron-LM's sampler: ``--use-torch-fsdp2``
  takes no ``--dp-backend``, so not the plugin's packing).
"""

from __future__ import annotations

import argparse
import inspect
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_odc.mcore.releases import installed_version

FAILS_AT_FIRST_STEP = (
    "its finish_grad_sync takes no force_all_reduce, which finalize_model_grads passes (every run "
    "stops at the first step)"
)


def torch_fsdp2_defects() -> list[str]:
    """:data:`FAILS_AT_FIRST_STEP` if the installed megatron-core's torch FSDP2 wrapper has it (empty:
    none; the missing gradient scaling is fixed, :func:`scale_torch_fsdp2_gradients`)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel,
    )

    passes = "force_all_reduce" in inspect.signature(finalize_model_grads).parameters
    takes = (
        "force_all_reduce"
        in inspect.signature(TorchFullyShardedDataParallel.finish_grad_sync).parameters
    )
    return [FAILS_AT_FIRST_STEP] if passes and not takes else []


def refuse_broken_torch_fsdp2(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` unchanged unless ``--use-torch-fsdp2`` meets :data:`FAILS_AT_FIRST_STEP`.

    Raises:
        ValueError: one line naming the defect and what to change: drop ``--use-torch-fsdp2`` (ODC's
            own ZeRO-3 instead), or run ``core_v0.19.0``.
    """
    if not getattr(args, "use_torch_fsdp2", False):
        return args
    defects = torch_fsdp2_defects()
    if not defects:
        return args
    raise ValueError(
        f"--use-torch-fsdp2: megatron-core {installed_version()}'s TorchFullyShardedDataParallel: "
        f"{'; '.join(defects)}. Drop --use-torch-fsdp2 and use --dp-backend odc (ZeRO-3; or fsdp, "
        "its lockstep baseline), or run core_v0.19.0 with megatron-core 0.19"
    )


def scale_torch_fsdp2_gradients(chunks: Sequence) -> int:
    """Give each of the model's ``chunks`` that is a ``TorchFullyShardedDataParallel`` whose class
    keeps the base no-op ``scale_gradients`` the one :func:`_scale_sharded_gradients` does, on the
    instance; returns how many chunks got it."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel,
    )

    if TorchFullyShardedDataParallel.scale_gradients is not _BaseDataParallel.scale_gradients:
        return 0  # a megatron-core that scales them itself
    fixed = 0
    for chunk in chunks:
        if isinstance(chunk, TorchFullyShardedDataParallel):
            chunk.scale_gradients = types.MethodType(_scale_sharded_gradients, chunk)
            fixed += 1
    return fixed


def _scale_sharded_gradients(chunk: Any, scaling_factor: float | torch.Tensor) -> None:
    """What megatron-core's DDP does with ``scale_gradients``, on FSDP2's sharded gradients: its
    reduce-scatter averaged them over the DP group, where DDP sums, so the factor is
    ``scaling_factor`` (``1 / global tokens`` under per-token loss) times the group's size."""
    factor = scaling_factor * dist.get_world_size(chunk.process_group)
    with torch.no_grad():
        for param in chunk.module.parameters():
            grad = param.grad
            if grad is not None:
                local = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor's shard
                local.mul_(factor)
