"""Megatron-LM's own torch FSDP2 (``--use-torch-fsdp2``) under the launcher: its two bugs, refused.

The launcher runs Megatron-LM's own data parallelism where no ``--dp-backend`` is given, FSDP2
included (on CPU through two shims, ``cpu_shims.py``). megatron-core's
``TorchFullyShardedDataParallel`` has two defects that no flag of the user can work around, each found
by running it (``tests/integration/test_megatron_lm_sft_e2e.py``, ``benchmarks/megatron_lm_sft.py``):

- up to megatron-core 0.18 its ``finish_grad_sync`` takes no ``force_all_reduce``, which
  ``finalize_model_grads`` passes: every run stops at the first step with a ``TypeError``;
- it does not override ``scale_gradients`` (the base class's is a no-op), so under
  ``--calculate-per-token-loss`` the gradients are never divided by the step's token count (FSDP2's
  reduce-scatter averages over DP: they come out tokens / DP times too large), and clipping and
  Adam's epsilon then train another model, silently.

:func:`refuse_broken_torch_fsdp2` checks the installed classes (not tags) and stops the job before
anything is built, in one line naming what to change.
"""

from __future__ import annotations

import argparse
import inspect

from megatron_odc.mcore.releases import installed_version

FAILS_AT_FIRST_STEP = (
    "its finish_grad_sync takes no force_all_reduce, which finalize_model_grads passes (every run "
    "stops at the first step)"
)
LEAVES_PER_TOKEN_UNSCALED = (
    "its scale_gradients is the base class's no-op, so with --calculate-per-token-loss the gradients "
    "are never divided by the token count"
)


def torch_fsdp2_defects(calculate_per_token_loss: bool) -> list[str]:
    """Which of :data:`FAILS_AT_FIRST_STEP` and :data:`LEAVES_PER_TOKEN_UNSCALED` the installed
    megatron-core's torch FSDP2 wrapper has for such a run (empty: none)."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel,
    )

    defects = []
    passes = "force_all_reduce" in inspect.signature(finalize_model_grads).parameters
    takes = (
        "force_all_reduce"
        in inspect.signature(TorchFullyShardedDataParallel.finish_grad_sync).parameters
    )
    if passes and not takes:
        defects.append(FAILS_AT_FIRST_STEP)
    if calculate_per_token_loss and (
        TorchFullyShardedDataParallel.scale_gradients is _BaseDataParallel.scale_gradients
    ):
        defects.append(LEAVES_PER_TOKEN_UNSCALED)
    return defects


def refuse_broken_torch_fsdp2(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` unchanged unless ``--use-torch-fsdp2`` meets a defect of the installed wrapper.

    Raises:
        ValueError: one line naming the defects and what to change: drop ``--use-torch-fsdp2`` (ODC's
            own ZeRO-3 instead), or run ``core_v0.19.0`` / drop ``--calculate-per-token-loss``,
            whichever removes the defects found.
    """
    if not getattr(args, "use_torch_fsdp2", False):
        return args
    defects = torch_fsdp2_defects(bool(getattr(args, "calculate_per_token_loss", False)))
    if not defects:
        return args
    if FAILS_AT_FIRST_STEP in defects:
        other = "run core_v0.19.0 with megatron-core 0.19"
        if LEAVES_PER_TOKEN_UNSCALED in defects:
            other += " without --calculate-per-token-loss"
    else:
        other = "drop --calculate-per-token-loss (the mean loss)"
    raise ValueError(
        f"--use-torch-fsdp2: megatron-core {installed_version()}'s TorchFullyShardedDataParallel: "
        f"{'; '.join(defects)}. Drop --use-torch-fsdp2 and use --dp-backend odc (ZeRO-3; or fsdp, "
        f"its lockstep baseline), or {other}"
    )
