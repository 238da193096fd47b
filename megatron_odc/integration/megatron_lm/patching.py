"""Apply and revert the Megatron-LM patches: one handle that puts every replaced attribute back.

:func:`apply_megatron_lm_patches` checks the installed Megatron-LM (``version.py``), then replaces, in
``megatron.training`` (explicit and reversible; nothing happens on import):

1. ``arguments.parse_args`` and its binding in ``initialize``: ODC's flags and their policy
   (``flags.py``); ``validate_args`` (both bindings): ``--fp8-param-gather`` for ODC's engine;
2. ``training.get_model``: ODC chunks wrapped in ``ODCDataParallel`` (``builders.py``);
3. ``training.get_megatron_optimizer``: the ODC optimizer for ODC chunks (``builders.py``);
4. ``training.get_forward_backward_func``: each rank's planned microbatch count (``schedule.py``);
5. ``training.build_pretraining_data_loader``: the length-balanced train loader (``data.py``).

With ``cpu=True`` (no CUDA) it also applies megatron-core's CPU runtime (``integration/cpu.py``) and the
Megatron-LM-only shims (``cpu_shims.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from typing import Any

from megatron_odc.integration.cpu import apply_cpu_patches
from megatron_odc.integration.megatron_lm.builders import (
    wrap_get_megatron_optimizer,
    wrap_get_model,
)
from megatron_odc.integration.megatron_lm.checkpointing import (
    wrap_build_sharded_state_dict_metadata,
)
from megatron_odc.integration.megatron_lm.cpu_shims import cpu_shims
from megatron_odc.integration.megatron_lm.data import wrap_build_pretraining_data_loader
from megatron_odc.integration.megatron_lm.flags import wrap_parse_args, wrap_validate_args
from megatron_odc.integration.megatron_lm.schedule import wrap_get_forward_backward_func
from megatron_odc.integration.megatron_lm.version import check_megatron_lm_version
from megatron_odc.mcore.cpu_optimizers import cuda_type_names, unfused_distopt_patches

logger = logging.getLogger(__name__)

_MISSING = object()


class MegatronLmPatches:
    """Handle on the applied Megatron-LM patches; reverts them all (CPU ones included).

    Attributes:
        patched: ``"module.attr"`` names of every replaced attribute, in patch order.
        cpu_patches: the ``CpuPatches`` handle when ``cpu=True`` applied them, else None.
    """

    def __init__(self) -> None:
        self.patched: list[str] = []
        self.cpu_patches = None
        self._scoped = contextlib.ExitStack()
        self._saved: list[tuple[Any, str, Any]] = []
        self._active = False

    @property
    def active(self) -> bool:
        """Whether the patches are applied."""
        return self._active

    def _patch(self, owner: Any, attr: str, value: Any) -> None:
        self._saved.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
        setattr(owner, attr, value)
        name = getattr(owner, "__name__", type(owner).__name__)
        self.patched.append(f"{name}.{attr}")

    def revert(self) -> None:
        """Restore every replaced attribute; idempotent."""
        if not self._active:
            return
        for owner, attr, before in reversed(self._saved):
            if before is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, before)
        self._saved.clear()
        self._scoped.close()
        if self.cpu_patches is not None:
            self.cpu_patches.revert()
        self._active = False

    def __enter__(self) -> MegatronLmPatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.revert()


def apply_megatron_lm_patches(*, cpu: bool = False) -> MegatronLmPatches:
    """Install the patches of the module docstring into an importable ``megatron.training``.

    Args:
        cpu: also apply the CPU patches and Megatron-LM's CPU shims (``torch.cuda.is_available`` ->
            True, ``device_count`` -> 1, streams and ``set_device`` no-ops, fused-kernel loading and
            JIT fusion setup skipped, ``Tensor.type()`` reporting CUDA names until ``revert``).

    Returns:
        A handle whose ``revert()`` restores everything.

    Raises:
        ValueError: not Megatron-LM ``core_v0.16.1`` (see :func:`check_megatron_lm_version`).
    """
    check_megatron_lm_version()
    arguments = importlib.import_module("megatron.training.arguments")
    initialize = importlib.import_module("megatron.training.initialize")
    training = importlib.import_module("megatron.training.training")
    handle = MegatronLmPatches()
    handle._active = True
    try:
        if cpu:
            handle.cpu_patches = apply_cpu_patches()
            # Megatron's own optimizers (the ddp / distopt baselines) check param.type() at
            # construction and in every clip: the whole run is the scope here.
            handle._scoped.enter_context(cuda_type_names())
            for owner, attr, value in cpu_shims(initialize, training):
                handle._patch(owner, attr, value)
            # distopt's checkpoint load over torch's Adam (no TE / Apex), as in the plugin's entry.
            for owner, attr, value in unfused_distopt_patches():
                handle._patch(owner, attr, value)
        handle._patch(arguments, "parse_args", wrap_parse_args(arguments.parse_args))
        handle._patch(initialize, "parse_args", wrap_parse_args(initialize.parse_args))
        handle._patch(arguments, "validate_args", wrap_validate_args(arguments.validate_args))
        handle._patch(initialize, "validate_args", wrap_validate_args(initialize.validate_args))
        handle._patch(training, "get_model", wrap_get_model(training.get_model, training))
        handle._patch(
            training,
            "get_megatron_optimizer",
            wrap_get_megatron_optimizer(training.get_megatron_optimizer),
        )
        handle._patch(
            training,
            "get_forward_backward_func",
            wrap_get_forward_backward_func(training.get_forward_backward_func),
        )
        handle._patch(
            training,
            "build_pretraining_data_loader",
            wrap_build_pretraining_data_loader(training.build_pretraining_data_loader),
        )
        checkpointing = importlib.import_module("megatron.training.checkpointing")
        handle._patch(
            checkpointing,
            "_build_sharded_state_dict_metadata",
            wrap_build_sharded_state_dict_metadata(
                checkpointing._build_sharded_state_dict_metadata
            ),
        )
    except BaseException:
        handle.revert()
        raise
    logger.info("applied %d Megatron-LM patches", len(handle.patched))
    return handle
