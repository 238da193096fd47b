"""Which Megatron-LM runs here, and the check that refuses any other before anything is patched.

:func:`check_megatron_lm_version` finds the row of ``releases.MEGATRON_LM_RELEASES`` for the
``megatron/training`` that ``import megatron.training`` loads (the checkout's series, read from its
``megatron/core/package_info.py``), checks that the installed megatron-core is of the same series and in
megatron-core's supported range (``mcore/releases.py``), and compares every name of the row's
``signatures`` with what is importable. Any difference is refused in one line naming the supported tags,
unless ``MEGATRON_ODC_SKIP_VERSION_CHECK=1``: then the nearest row is used, each difference is logged,
and a missing patch point or shim target is skipped (never an ``AttributeError``).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os

from megatron_odc.integration.megatron_lm.releases import (
    MegatronLmRelease,
    checkout_version,
    nearest_release,
    release_for_series,
    supported_tags_text,
    training_dir,
)
from megatron_odc.mcore.releases import (
    SKIP_VERSION_CHECK_ENV,
    installed_version,
    parse_version,
    release_for,
)

logger = logging.getLogger(__name__)

_MISSING = object()
_IMPORT_HINT = (
    "put the Megatron-LM checkout on sys.path (MEGATRON_LM_PATH with megatron_odc.launch) and install "
    "its own dependencies (pip install -e .[megatron-lm])"
)


def resolve_name(name: str) -> object:
    """The object ``"module.attr"`` names, or a sentinel when the module or the attribute is absent.

    Raises:
        ImportError: the module exists but one of its own imports fails.
    """
    module_name, attr = name.rsplit(".", 1)
    try:
        owner = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            return _MISSING
        raise ImportError(f"cannot import {module_name} ({exc}): {_IMPORT_HINT}") from exc
    except ImportError as exc:
        raise ImportError(f"cannot import {module_name} ({exc}): {_IMPORT_HINT}") from exc
    return getattr(owner, attr, _MISSING)


def is_missing(obj: object) -> bool:
    """Whether :func:`resolve_name` found nothing."""
    return obj is _MISSING


def signature_problems(release: MegatronLmRelease) -> list[str]:
    """Every name of ``release.signatures`` that is missing or has other parameters (one line each)."""
    problems = []
    for name, expected in release.signatures.items():
        obj = resolve_name(name)
        if obj is _MISSING:
            problems.append(f"{name} is missing")
            continue
        obj = getattr(obj, "__megatron_odc_original__", obj)
        target = obj.__init__ if inspect.isclass(obj) else obj
        names = tuple(inspect.signature(target).parameters)
        if names != expected:
            problems.append(f"{name}{names} (expected {expected})")
    return problems


def check_megatron_lm_version() -> MegatronLmRelease:
    """The row of the ``megatron/training`` that runs here, after checking it (see the module docs).

    Returns:
        The row (the nearest one under ``MEGATRON_ODC_SKIP_VERSION_CHECK=1`` when none matches).

    Raises:
        ValueError: an unsupported megatron-core, a checkout of another series or of no supported tag,
            a missing name or a changed signature: one line naming the supported tags (unless skipped).
        ImportError: ``megatron.training`` (or one of its dependencies) cannot be imported.
    """
    version = installed_version()
    training = training_dir()
    if training is None:
        raise ImportError(f"cannot import megatron.training: {_IMPORT_HINT}")
    checkout = checkout_version(training) or version
    series = parse_version(checkout)[:2]
    release = release_for_series(series)
    problems = []
    if release_for(version) is None:
        problems.append(f"megatron-core {version} is installed")
    if release is None:
        problems.append(f"megatron/training at {training} is version {checkout}")
    elif series != parse_version(version)[:2]:
        problems.append(
            f"megatron/training at {training} is {release.tag}'s ({checkout}) but megatron-core "
            f"{version} is installed (run each tag with its megatron-core series)"
        )
    else:
        problems += signature_problems(release)
    skip = os.environ.get(SKIP_VERSION_CHECK_ENV) == "1"
    if problems and not skip:
        raise ValueError(
            f"megatron_odc supports Megatron-LM {supported_tags_text()}; here "
            + "; ".join(problems)
            + f". Use one of those tags with its megatron-core, or set {SKIP_VERSION_CHECK_ENV}=1 "
            "to try anyway."
        )
    release = release or nearest_release(series)
    for problem in problems:
        logger.warning("version check skipped (%s rows): %s", release.tag, problem)
    return release


def installed_megatron_lm_release() -> MegatronLmRelease:
    """The row of the ``megatron/training`` here by its series alone (the nearest row), unchecked:
    what a patched source uses, whose tree the patch itself already pins to a tag."""
    training = training_dir()
    version = (checkout_version(training) if training else None) or installed_version()
    return nearest_release(parse_version(version)[:2])
