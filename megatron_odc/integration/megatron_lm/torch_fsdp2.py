"""Megatron-LM's own torch FSDP2 (``--use-torch-fsdp2``) under the launcher: its two bugs, refused.

The launcher runs Megatron-LM's own data parallelism where no ``--dp-backend`` is given, FSDP2
included (on CPU through two shims, ``cpu_shims.py``). megatron-core's
``TorchFullyShardedDataParallel`` has two defects that no flag of the user can work around, each found
by running it (``tests/integration/test_megatron_lm_sft_e2e.py``, ``benchmarks/megatron_lm_sft.py``):

- up to megatron-core 0.18 its ``finish_grad_sync`` takes no ``force_all_reduce``, which
  ``finalize_model_grads`` passes: every run stops at the first step with a ``TypeError``;
- it does not override ``scale_gradients`` (the base class's is a no-op), so under
  ``--calculate-per-token-loss`` the gradients are never divided by the step's token count and come
  out that many times too large: clipping and Adam's epsilon then train another model, silently.

:func:`refuse_broken_torch_fsdp2` checks the installed classes (not tags) and stops the job before
anything is built, in one line naming what to change.
"""

from __future__ import annotations

import argparse
import inspect


def torch_fsdp2_defects(calculate_per_token_loss: bool) -> list[str]:
    """What fails in the installed megatron-core's torch FSDP2 wrapper for such a run (empty: none)."""
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
        defects.append(
            "its finish_grad_sync takes no force_all_reduce, which finalize_model_grads passes (every "
            "run stops at the first step; fixed in megatron-core 0.19)"
        )
    if calculate_per_token_loss and (
        TorchFullyShardedDataParallel.scale_gradients is _BaseDataParallel.scale_gradients
    ):
        defects.append(
            "with --calculate-per-token-loss its gradients are never divided by the token count "
            "(scale_gradients is the base class's no-op): drop --calculate-per-token-loss"
        )
    return defects


def refuse_broken_torch_fsdp2(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` unchanged unless ``--use-torch-fsdp2`` meets a defect of the installed wrapper.

    Raises:
        ValueError: naming each defect and what to run instead.
    """
    if not getattr(args, "use_torch_fsdp2", False):
        return args
    defects = torch_fsdp2_defects(bool(getattr(args, "calculate_per_token_loss", False)))
    if defects:
        import megatron.core

        raise ValueError(
            f"--use-torch-fsdp2 does not train correctly with megatron-core "
            f"{megatron.core.__version__}'s TorchFullyShardedDataParallel: {'; '.join(defects)}. "
            "For ZeRO-3 use --dp-backend odc (or fsdp, its lockstep baseline)"
        )
    return args
