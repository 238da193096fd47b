"""Which Megatron-LM the patches are written for, and the check that refuses any other.

The patches replace names of ``megatron.training`` (tag ``core_v0.16.1``); :data:`EXPECTED_SIGNATURES`
lists each with the parameter names read from that tag, and :func:`check_megatron_lm_version` compares
them (and megatron-core's version) with what is installed before anything is patched.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os

from megatron_odc.integration.cpu import SKIP_VERSION_CHECK_ENV

logger = logging.getLogger(__name__)

SUPPORTED_MEGATRON_LM_TAG = "core_v0.16.1"
SUPPORTED_MEGATRON_CORE_VERSION = "0.16.1"
_MISSING = object()

# (module, attribute) -> expected parameter names, read from Megatron-LM core_v0.16.1.
EXPECTED_SIGNATURES: dict[tuple[str, str], tuple[str, ...]] = {
    ("megatron.training.arguments", "parse_args"): ("extra_args_provider", "ignore_unknown_args"),
    ("megatron.training.initialize", "parse_args"): ("extra_args_provider", "ignore_unknown_args"),
    ("megatron.training.arguments", "validate_args"): ("args", "defaults"),
    ("megatron.training.initialize", "validate_args"): ("args", "defaults"),
    ("megatron.training.training", "get_model"): (
        "model_provider_func",
        "model_type",
        "wrap_with_ddp",
        "config",
        "pg_collection",
    ),
    ("megatron.training.training", "get_megatron_optimizer"): (
        "config",
        "model_chunks",
        "config_overrides",
        "use_gloo_process_groups",
        "pg_collection",
        "dump_param_to_param_group_map",
    ),
    ("megatron.training.training", "get_forward_backward_func"): ("pp_size", "vp_size"),
    ("megatron.training.training", "build_pretraining_data_loader"): (
        "dataset",
        "consumed_samples",
    ),
    ("megatron.training.checkpointing", "_build_sharded_state_dict_metadata"): (
        "args",
        "dp_cp_group",
    ),
    ("megatron.training.training", "DDP"): (
        "self",
        "config",
        "ddp_config",
        "module",
        "disable_bucketing",
        "pg_collection",
    ),
}


def check_megatron_lm_version() -> str:
    """Check megatron-core's version and every patched symbol against ``core_v0.16.1``.

    Returns:
        The megatron-core version.

    Raises:
        ValueError: another version, a missing symbol or a changed signature, unless
            ``MEGATRON_ODC_SKIP_VERSION_CHECK=1``.
        ImportError: ``megatron.training`` (or one of its dependencies) cannot be imported.
    """
    from megatron.core import package_info

    version = package_info.__version__
    problems = []
    if version != SUPPORTED_MEGATRON_CORE_VERSION:
        problems.append(
            f"megatron.core version {version} (expected {SUPPORTED_MEGATRON_CORE_VERSION})"
        )
    for (module_name, attr), expected in EXPECTED_SIGNATURES.items():
        try:
            owner = importlib.import_module(module_name)
        except ImportError as exc:
            raise ImportError(
                f"cannot import {module_name} ({exc}): put the Megatron-LM checkout on sys.path "
                "(MEGATRON_LM_PATH with megatron_odc.launch) and install its own dependencies "
                "(pip install -e .[megatron-lm])"
            ) from exc
        obj = getattr(owner, attr, _MISSING)
        if obj is _MISSING:
            problems.append(f"{module_name}.{attr} is missing")
            continue
        obj = getattr(obj, "__megatron_odc_original__", obj)
        target = obj.__init__ if inspect.isclass(obj) else obj
        names = tuple(inspect.signature(target).parameters)
        if names != expected:
            problems.append(f"{module_name}.{attr}{names} (expected {expected})")
    if problems and os.environ.get(SKIP_VERSION_CHECK_ENV) != "1":
        raise ValueError(
            f"megatron_odc.integration.megatron_lm supports Megatron-LM {SUPPORTED_MEGATRON_LM_TAG} only: "
            + "; ".join(problems)
            + f". Set {SKIP_VERSION_CHECK_ENV}=1 to try anyway."
        )
    for problem in problems:
        logger.warning("version check skipped: %s", problem)
    return version
