"""Apply and revert the Megatron-LM patches: one handle that puts every replaced attribute back.

:data:`PATCH_POINTS` is the catalogue of the names of ``megatron.training`` that ODC replaces in any
supported tag, each with the wrapper that builds its replacement from the original; which of them a tag
has is its row's ``patch_points`` (``releases.py``):

1. ``arguments.parse_args`` (and its binding in ``initialize`` up to ``core_v0.17.1``): ODC's flags and
   their policy (``flags.py``); ``validate_args`` (the same bindings): ``--fp8-param-gather`` for ODC's
   engine and the refusals that need validated args;
2. ``training.get_model`` and, from ``core_v0.18.2``, ``models.dist_utils._ddp_wrap`` (the config
   container's builders; ``pretrain_gpt.py`` of ``core_v0.19.0`` builds through it): ODC chunks wrapped in
   ``ODCDataParallel`` (``builders.py``);
3. ``training.get_megatron_optimizer``: the ODC optimizer for ODC chunks (``builders.py``);
4. ``training.get_forward_backward_func``: each rank's planned microbatch count (``schedule.py``);
5. ``training.build_pretraining_data_loader``: the length-balanced train loader (``data.py``);
6. ``training.setup_model_and_optimizer``: after Megatron-LM built the model, every chunk must be
   ``ODCDataParallel`` under ``--dp-backend odc|fsdp`` (``builders.py``), else the run stops;
7. ``checkpointing._build_sharded_state_dict_metadata``: ODC's optimizer format in the metadata
   (``checkpointing.py``);
8. ``training.initialize_megatron``, ``train_step``, ``save_checkpoint`` and ``load_checkpoint``: rank
   health, the watchdog, the checkpoint-writer guard and one job per ``--save`` (``health.py``), for
   every ``--dp-backend``.

:func:`apply_megatron_lm_patches` (the launcher) checks the installed Megatron-LM (``version.py``) and
replaces every patch point of its row at runtime (explicit and reversible; nothing happens on import). A patched
Megatron-LM source (``patches/``) binds the same wrappers where the names are defined, through
``source_hooks.py``. With ``cpu=True`` (no CUDA) the launcher also applies megatron-core's CPU runtime
(``integration/cpu.py``) and the Megatron-LM-only shims (``cpu_shims.py``):
:func:`apply_megatron_lm_cpu_patches` alone, which the patched source calls too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from megatron_odc.integration.cpu import apply_cpu_patches
from megatron_odc.integration.megatron_lm.builders import (
    wrap_ddp_wrap,
    wrap_get_megatron_optimizer,
    wrap_get_model,
    wrap_setup_model_and_optimizer,
)
from megatron_odc.integration.megatron_lm.checkpointing import (
    wrap_build_sharded_state_dict_metadata,
    wrap_load_checkpoint,
)
from megatron_odc.integration.megatron_lm.cpu_shims import cpu_shims
from megatron_odc.integration.megatron_lm.data import wrap_build_pretraining_data_loader
from megatron_odc.integration.megatron_lm.flags import wrap_parse_args, wrap_validate_args
from megatron_odc.integration.megatron_lm.health import (
    wrap_initialize_megatron,
    wrap_save_checkpoint,
    wrap_train_step,
)
from megatron_odc.integration.megatron_lm.releases import MegatronLmRelease
from megatron_odc.integration.megatron_lm.schedule import wrap_get_forward_backward_func
from megatron_odc.integration.megatron_lm.sft import sft_tokenizer_adapter
from megatron_odc.integration.megatron_lm.version import (
    check_megatron_lm_version,
    installed_megatron_lm_release,
    is_missing,
    resolve_name,
)
from megatron_odc.mcore.cpu_optimizers import cuda_type_names, unfused_distopt_patches

logger = logging.getLogger(__name__)

_MISSING = object()


def _of_original(
    wrap: Callable[[Callable], Callable],
) -> Callable[[Callable, ModuleType], Callable]:
    return lambda original, owner: wrap(original)


@dataclasses.dataclass(frozen=True)
class PatchPoint:
    """One name ODC replaces: ``module.attr`` becomes ``wrap(original, module)``."""

    module: str
    attr: str
    wrap: Callable[[Callable, ModuleType], Callable]

    @property
    def name(self) -> str:
        """``"module.attr"``."""
        return f"{self.module}.{self.attr}"


PATCH_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint("megatron.training.arguments", "parse_args", _of_original(wrap_parse_args)),
    PatchPoint("megatron.training.initialize", "parse_args", _of_original(wrap_parse_args)),
    PatchPoint("megatron.training.arguments", "validate_args", _of_original(wrap_validate_args)),
    PatchPoint("megatron.training.initialize", "validate_args", _of_original(wrap_validate_args)),
    PatchPoint("megatron.training.training", "get_model", wrap_get_model),
    PatchPoint("megatron.training.models.dist_utils", "_ddp_wrap", wrap_ddp_wrap),
    PatchPoint(
        "megatron.training.training",
        "get_megatron_optimizer",
        _of_original(wrap_get_megatron_optimizer),
    ),
    PatchPoint(
        "megatron.training.training",
        "get_forward_backward_func",
        _of_original(wrap_get_forward_backward_func),
    ),
    PatchPoint(
        "megatron.training.training",
        "build_pretraining_data_loader",
        _of_original(wrap_build_pretraining_data_loader),
    ),
    PatchPoint(
        "megatron.training.training",
        "setup_model_and_optimizer",
        _of_original(wrap_setup_model_and_optimizer),
    ),
    PatchPoint(
        "megatron.training.checkpointing",
        "_build_sharded_state_dict_metadata",
        _of_original(wrap_build_sharded_state_dict_metadata),
    ),
    PatchPoint(
        "megatron.training.training",
        "initialize_megatron",
        _of_original(wrap_initialize_megatron),
    ),
    PatchPoint("megatron.training.training", "train_step", _of_original(wrap_train_step)),
    PatchPoint("megatron.training.training", "save_checkpoint", _of_original(wrap_save_checkpoint)),
    PatchPoint("megatron.training.training", "load_checkpoint", _of_original(wrap_load_checkpoint)),
)
"""Every Megatron-LM name the launcher replaces and a patched source wraps, in any supported tag."""


def patch_points_of(release: MegatronLmRelease) -> tuple[PatchPoint, ...]:
    """The patch points of ``release``, in its order."""
    by_name = {point.name: point for point in PATCH_POINTS}
    return tuple(by_name[name] for name in release.patch_points)


class MegatronLmPatches:
    """Handle on the applied Megatron-LM patches; reverts them all (CPU ones included).

    Attributes:
        patched: ``"module.attr"`` names of every replaced attribute, in patch order.
        cpu_patches: the ``CpuPatches`` handle when ``cpu=True`` applied them, else None.
        release: the Megatron-LM row the patches were chosen by (None for the CPU part alone).
    """

    def __init__(self, release: MegatronLmRelease | None = None) -> None:
        self.release = release
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


def _module_or_none(name: str) -> ModuleType | None:
    """``name`` imported, or None where the tree has no such module (only reachable under
    ``MEGATRON_ODC_SKIP_VERSION_CHECK=1``; its shims are then skipped with a warning)."""
    owner = resolve_name(f"{name}.__name__")
    return None if is_missing(owner) else importlib.import_module(name)


def _apply_cpu_patches(handle: MegatronLmPatches, release: MegatronLmRelease) -> None:
    initialize = _module_or_none("megatron.training.initialize")
    training = _module_or_none("megatron.training.training")
    handle.cpu_patches = apply_cpu_patches()
    # Megatron's own optimizers (the ddp / distopt baselines) check param.type() at
    # construction and in every clip: the whole run is the scope here.
    handle._scoped.enter_context(cuda_type_names())
    for owner, attr, value in cpu_shims(initialize, training, release.cpu_shims):
        handle._patch(owner, attr, value)
    # distopt's checkpoint load over torch's Adam (no TE / Apex), as in the plugin's entry.
    for owner, attr, value in unfused_distopt_patches():
        handle._patch(owner, attr, value)


def apply_megatron_lm_cpu_patches() -> MegatronLmPatches:
    """Only the CPU part of ``apply_megatron_lm_patches(cpu=True)`` (see its ``cpu`` argument).

    Returns:
        A handle whose ``revert()`` restores everything.
    """
    release = installed_megatron_lm_release()
    handle = MegatronLmPatches(release)
    handle._active = True
    try:
        _apply_cpu_patches(handle, release)
    except BaseException:
        handle.revert()
        raise
    return handle


def apply_megatron_lm_patches(*, cpu: bool = False) -> MegatronLmPatches:
    """Replace every patch point of the installed tag's row in an importable ``megatron.training``.

    Args:
        cpu: first apply :func:`apply_megatron_lm_cpu_patches`' patches (``torch.cuda.is_available``
            -> True, ``device_count`` -> 1, streams and ``set_device`` no-ops, fused-kernel loading and
            JIT fusion setup skipped, ``Tensor.type()`` reporting CUDA names until ``revert``).

    Returns:
        A handle whose ``revert()`` restores everything.

    Raises:
        ValueError: not a supported Megatron-LM tag (see :func:`check_megatron_lm_version`).
    """
    release = check_megatron_lm_version()
    handle = MegatronLmPatches(release)
    handle._active = True
    try:
        if cpu:
            _apply_cpu_patches(handle, release)
        for point in patch_points_of(release):
            original = resolve_name(point.name)
            if is_missing(original):  # only under MEGATRON_ODC_SKIP_VERSION_CHECK=1
                logger.warning("patch point %s skipped: not in this Megatron-LM", point.name)
                continue
            owner = importlib.import_module(point.module)
            handle._patch(owner, point.attr, point.wrap(original, owner))
        # transformers 5 under the tag's SFTTokenizer (sft.py); not a patch point: the class is
        # only reached with --sft, and from core_v0.18.2 it needs no adapter.
        handle._scoped.enter_context(sft_tokenizer_adapter(release.sft_tokenizer))
    except BaseException:
        handle.revert()
        raise
    logger.info("applied %d Megatron-LM patches (%s)", len(handle.patched), release.tag)
    return handle
