"""What a patched Megatron-LM source calls: ``patches/megatron_lm_<tag>_odc.patch``, one per tag.

The patch gives a Megatron-LM fork ``--dp-backend odc`` without the launcher. It adds one line at each
patch point of the tag's row (names of :data:`~megatron_odc.integration.megatron_lm.patching.PATCH_POINTS`),
where the name is defined or imported::

    get_model = odc_patch_point(__name__, "get_model", get_model)

and one call, :func:`cpu_runtime`, at the start of ``arguments.parse_args`` (:data:`CPU_HOOK`). Both reach the launcher's
own wrappers and CPU patches, so the fork and the launcher run one implementation.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable

import torch

from megatron_odc.integration.megatron_lm.flags import with_cpu_flags
from megatron_odc.integration.megatron_lm.patching import (
    PATCH_POINTS,
    apply_megatron_lm_cpu_patches,
)

CPU_HOOK = ("megatron.training.arguments", "parse_args")
"""The function whose first statement, in a patched source, is :func:`cpu_runtime`: Megatron-LM's
scripts parse their arguments before anything else (``pretrain_gpt.py`` already for its in-process
restart check), and the CPU flags must be in ``sys.argv`` by then."""


def patch_point_line(attr: str) -> str:
    """The line a patched source adds after the ``def`` or ``import`` that binds ``attr``."""
    return f'{attr} = odc_patch_point(__name__, "{attr}", {attr})'


def hook_import_line(module_name: str) -> str:
    """The import a patched source adds to ``module_name`` (after its ``import torch``)."""
    names = []
    if module_name == CPU_HOOK[0]:
        names.append(cpu_runtime.__name__)
    if any(point.module == module_name for point in PATCH_POINTS):
        names.append(odc_patch_point.__name__)
    return f"from {__name__} import {', '.join(names)}"


def odc_patch_point(module_name: str, attr: str, original: Callable) -> Callable:
    """The replacement of ``module_name.attr``: the launcher's wrapper of ``original``.

    ``original`` already wrapped (a binding imported from a module that wrapped it, such as
    ``initialize``'s ``parse_args``) is returned as it is.

    Raises:
        ValueError: ``module_name.attr`` is not one of ``PATCH_POINTS``.
    """
    if hasattr(original, "__megatron_odc_original__"):
        return original
    for point in PATCH_POINTS:
        if (point.module, point.attr) == (module_name, attr):
            return point.wrap(original, sys.modules[module_name])
    known = ", ".join(point.name for point in PATCH_POINTS)
    raise ValueError(f"{module_name}.{attr} is not an ODC patch point (those are: {known})")


def cpu_runtime() -> None:
    """Without CUDA: the launcher's CPU patches and CPU flags, for the rest of the process.

    Adds the missing :data:`~megatron_odc.integration.megatron_lm.flags.CPU_FLAGS` to ``sys.argv``
    (logging what it added) and applies :func:`apply_megatron_lm_cpu_patches`, reverted at exit. With
    CUDA, or once applied (``torch.cuda.is_available`` then answers True), it does nothing.
    """
    if torch.cuda.is_available():
        return
    sys.argv[1:] = with_cpu_flags(sys.argv[1:], cuda=False)
    atexit.register(apply_megatron_lm_cpu_patches().revert)
