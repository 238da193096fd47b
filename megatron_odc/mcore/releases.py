"""The megatron-core releases megatron_odc supports, and every difference between them: one table.

:data:`RELEASES` has one row per release series (0.16, 0.17, 0.18, 0.19). A row says which Python
installs it, which Megatron-LM tag matches it, which CPU-runtime shims it needs
(``integration/cpu.py``, :data:`~megatron_odc.integration.cpu.CPU_SHIMS`), the public members of
megatron-core's ``DistributedDataParallel`` and ``MegatronOptimizer`` (the contract ``ODCDataParallel``
and ``ODCOptimizer`` answer: each member is implemented with megatron-core's meaning or refused by
name) and the parameter names of every megatron-core callable the plugin calls, subclasses or patches.
Code elsewhere never compares versions: it asks :func:`current_release` for the installed row and reads
a field of it.

A version outside :data:`SUPPORTED_RANGE` is refused in one line naming the range, unless
``MEGATRON_ODC_SKIP_VERSION_CHECK=1``: then the nearest row is used and a CPU shim whose target is gone
is skipped with a warning (``integration/cpu.py``), so trying an untested release ends in megatron-core's
own error, never in one of the plugin's ``AttributeError`` s.

Adding a release: a row below (the members and signatures printed by
``tests/mcore/test_releases.py::test_installed_release_matches_its_row`` when they differ), the range,
and ``requirements-py312.txt`` / ``pyproject.toml``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import os
import re
from collections.abc import Iterator, Mapping

logger = logging.getLogger(__name__)

SKIP_VERSION_CHECK_ENV = "MEGATRON_ODC_SKIP_VERSION_CHECK"
"""Set to ``1`` to run on a megatron-core outside :data:`SUPPORTED_RANGE` anyway."""

SUPPORTED_RANGE = ">=0.16.1,<0.20"
"""The megatron-core versions the plugin supports, as pip writes them (``pyproject.toml`` says the same)."""

_MINIMUM = (0, 16, 1)
_LIMIT = (0, 20, 0)

_DDP_MEMBERS_016 = (
    "broadcast_params",
    "disable_forward_pre_hook",
    "enable_forward_pre_hook",
    "finish_grad_sync",
    "no_sync",
    "offload_grad_buffers",
    "restore_grad_buffers",
    "scale_gradients",
    "start_grad_sync",
    "start_param_sync",
    "zero_grad_buffer",
)
_OPTIMIZER_MEMBERS_016 = (
    "clip_grad_norm",
    "count_zeros",
    "get_grad_norm",
    "get_grad_stats_parallel_group",
    "get_loss_scale",
    "get_main_grads_for_grad_norm",
    "get_parameters",
    "load_state_dict",
    "offload_to_cpu",
    "prepare_grads",
    "reload_model_params",
    "restore_from_cpu",
    "scale_loss",
    "sharded_state_dict",
    "state_dict",
    "step",
    "step_with_ready_grads",
    "zero_grad",
)
_DDP_INIT_016 = ("self", "config", "ddp_config", "module", "disable_bucketing", "pg_collection")
_SIGNATURES_016: dict[str, tuple[str, ...]] = {
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.__init__": (
        _DDP_INIT_016
    ),
    "megatron.core.distributed.data_parallel_base:_BaseDataParallel.__init__": (
        "self",
        "config",
        "module",
    ),
    "megatron.core.distributed.finalize_model_grads:finalize_model_grads": (
        "model",
        "num_tokens",
        "pg_collection",
        "force_all_reduce",
    ),
    "megatron.core.pipeline_parallel:get_forward_backward_func": ("pp_size", "vp_size"),
    "megatron.core.pipeline_parallel.schedules:backward_step": (
        "input_tensor",
        "output_tensor",
        "output_tensor_grad",
        "model_type",
        "config",
    ),
    "megatron.core.optimizer:_get_param_groups": ("model_chunks", "config", "config_overrides"),
    "megatron.core.optimizer:get_standard_config_overrides": ("config",),
    "megatron.core.optimizer.optimizer:MegatronOptimizer.__init__": (
        "self",
        "optimizer",
        "config",
        "init_state_fn",
    ),
    "megatron.core.optimizer.optimizer:MegatronOptimizer.sharded_state_dict": (
        "self",
        "model_sharded_state_dict",
        "is_loading",
        "metadata",
    ),
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state": ("device", "clone", "graph_safe"),
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state": (
        "new_state",
        "device",
        "graph_safe",
    ),
    "megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__": (
        "cls",
        "config",
        "hidden_size",
        "eps",
        "persist_layer_norm",
        "zero_centered_gamma",
        "normalization",
    ),
}
"""``"module:qualified.name"`` -> parameter names, read from megatron-core 0.16.1: what the adapter
subclasses (``DistributedDataParallel``, ``MegatronOptimizer``), calls (``finalize_model_grads``,
``get_forward_backward_func``, ``_get_param_groups``) and what the CPU runtime replaces."""

_CPU_SHIMS_016 = (
    "current_device",
    "cuda_rng",
    "megatron_rng",
    "cuda_no_ops",
    "cuda_moves_are_identity",
    "sequence_parallel_norm",
)


@dataclasses.dataclass(frozen=True)
class Release:
    """One supported megatron-core release series and what differs in it.

    Attributes:
        series: ``(major, minor)``, e.g. ``(0, 19)``.
        tested: the version the suite ran on (pinned in the requirements file named by ``python``).
        python: the Python versions its wheel installs on (``Requires-Python``) and the requirements
            file of the tested pair.
        megatron_lm_tag: the Megatron-LM tag whose ``megatron/core`` this release is.
        cpu_shims: names of the CPU-runtime shims it needs on a machine without CUDA, in order
            (``integration/cpu.py``, ``CPU_SHIMS``).
        ddp_members: the public methods of its ``DistributedDataParallel``: every one is overridden by
            ``ODCDataParallel`` with megatron-core's meaning.
        optimizer_members: the public methods of its ``MegatronOptimizer``: ``ODCOptimizer`` overrides
            each, or inherits it where megatron-core's body already means the right thing over the owned
            pieces (``tests/mcore/test_releases.py`` lists those).
        signatures: ``"module:qualified.name"`` -> parameter names, for every megatron-core callable the
            plugin subclasses, calls or patches.
        common_state_file: the file ``dist_checkpointing.save`` writes the common (every rank's) state
            to, or None where it is a ``ShardedObject`` ("common_state") inside the torch_dist files
            (0.19; it still reads a legacy ``common.pt``).
        quiet_notices: ``(logger name, message start)`` of megatron-core log records about choices the
            plugin made on purpose, dropped while it makes them (:func:`quiet_notices`): 0.19 warns on
            every ``GPTModel`` that it is deprecated and on the first save through its async writer,
            one more stderr line per rank each, which would break the entry's one-line errors.
        notes: what changed against the previous row, for people (docs/architecture.md, section 3).
    """

    series: tuple[int, int]
    tested: str
    python: str
    megatron_lm_tag: str
    cpu_shims: tuple[str, ...]
    ddp_members: tuple[str, ...]
    optimizer_members: tuple[str, ...]
    signatures: Mapping[str, tuple[str, ...]]
    common_state_file: str | None = "common.pt"
    quiet_notices: tuple[tuple[str, str], ...] = ()
    notes: str = ""

    @property
    def name(self) -> str:
        """``"0.19.x"``."""
        return f"{self.series[0]}.{self.series[1]}.x"


def _changed(base: Mapping[str, tuple[str, ...]], changes: Mapping[str, tuple[str, ...]]) -> dict:
    """``base`` with ``changes`` (keys that must already be in it) replaced."""
    unknown = set(changes) - set(base)
    if unknown:
        raise KeyError(f"not in the previous row: {sorted(unknown)}")
    return {**base, **changes}


_SIGNATURES_017 = _changed(
    _SIGNATURES_016,
    {
        "megatron.core.pipeline_parallel.schedules:backward_step": (
            "input_tensor",
            "output_tensor",
            "output_tensor_grad",
            "config",
        )
    },
)
_SIGNATURES_018 = _changed(
    _SIGNATURES_017,
    {
        "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.__init__": (
            *_DDP_INIT_016,
            "full_param_layout",
        )
    },
)
_SIGNATURES_019 = _changed(
    _SIGNATURES_018,
    {
        "megatron.core.pipeline_parallel:get_forward_backward_func": (
            "pp_size",
            "vp_size",
            "schedule_pg_collection",
        )
    },
)

RELEASES: tuple[Release, ...] = (
    Release(
        series=(0, 16),
        tested="0.16.1",
        python="3.11 (requirements.txt); 3.10-3.12 install it",
        megatron_lm_tag="core_v0.16.1",
        cpu_shims=_CPU_SHIMS_016,
        ddp_members=_DDP_MEMBERS_016,
        optimizer_members=_OPTIMIZER_MEMBERS_016,
        signatures=_SIGNATURES_016,
    ),
    Release(
        series=(0, 17),
        tested="0.17.1",
        python="3.12 (Requires-Python >=3.12)",
        megatron_lm_tag="core_v0.17.1",
        cpu_shims=(*_CPU_SHIMS_016, "current_stream"),
        ddp_members=tuple(sorted((*_DDP_MEMBERS_016, "free_overlap_buffers"))),
        optimizer_members=_OPTIMIZER_MEMBERS_016,
        signatures=_SIGNATURES_017,
        notes="DDP.free_overlap_buffers (Megatron-LM calls it on every chunk before a save); "
        "backward_step drops model_type; the megatron-core wheel ships megatron/training",
    ),
    Release(
        series=(0, 18),
        tested="0.18.2",
        python="3.12 (Requires-Python >=3.12)",
        megatron_lm_tag="core_v0.18.2",
        cpu_shims=(*_CPU_SHIMS_016, "current_stream"),
        ddp_members=tuple(sorted((*_DDP_MEMBERS_016, "free_overlap_buffers"))),
        optimizer_members=_OPTIMIZER_MEMBERS_016,
        signatures=_SIGNATURES_018,
        notes="DDP.__init__ gains full_param_layout; _get_param_groups(config_overrides=None) no "
        "longer applies the standard overrides (get_megatron_optimizer does; so does ODCOptimizer); "
        "OptimizerConfig.grad_norm_skip_threshold (the step is skipped above it); "
        "cuda_graph_impl='full_iteration'",
    ),
    Release(
        series=(0, 19),
        tested="0.19.2",
        python="3.12 (Requires-Python >=3.12; requirements-py312.txt)",
        megatron_lm_tag="core_v0.19.0",
        cpu_shims=(*_CPU_SHIMS_016, "current_stream"),
        ddp_members=tuple(
            sorted((*_DDP_MEMBERS_016, "free_overlap_buffers", "reset_param_sync_dispatch_state"))
        ),
        optimizer_members=tuple(
            sorted(
                (
                    *(m for m in _OPTIMIZER_MEMBERS_016 if m != "get_main_grads_for_grad_norm"),
                    "get_grads_for_grad_norm",
                    "has_grad_norm_group",
                    "prepare_model_params_for_param_sync",
                )
            )
        ),
        signatures=_SIGNATURES_019,
        common_state_file=None,
        quiet_notices=(
            ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
            # torch_dist saves through megatron-core's own async writer (its first save on a rank)
            (
                "megatron.core.dist_checkpointing.strategies.torch",
                "MCore's async save is deprecated",
            ),
        ),
        notes="DDP.start_grad_sync calls torch.cuda.current_stream() always (CPU shim); "
        "DDP.reset_param_sync_dispatch_state; MegatronOptimizer.get_main_grads_for_grad_norm -> "
        "get_grads_for_grad_norm(grad_norm_group), has_grad_norm_group (separate MTP norm), "
        "prepare_model_params_for_param_sync; get_forward_backward_func(schedule_pg_collection); "
        "finalize_model_grads scales by 1/clamp(num_tokens, 1); dist_checkpointing keeps the common "
        "state inside the torch_dist files (no common.pt); strategies.base removed; "
        "filesystem_async._get_write_results_queue -> get_write_results_queue(mp_mode)",
    ),
)
"""Every supported megatron-core release series, oldest first."""


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.19.2"`` / ``"0.17.0rc1"`` / ``"0.20.0.dev0+abc"`` -> ``(major, minor, patch)``.

    Raises:
        ValueError: no ``major.minor`` at the start.
    """
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"megatron-core version {version!r} is not major.minor[.patch]")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def supported_range_text() -> str:
    """The range and its rows, as the refusal and the docs say it."""
    rows = ", ".join(f"{r.name} (tested {r.tested})" for r in RELEASES)
    return f"megatron-core {SUPPORTED_RANGE}: {rows}"


def release_for(version: str) -> Release | None:
    """The row of ``version``, or None outside :data:`SUPPORTED_RANGE`."""
    parsed = parse_version(version)
    if not _MINIMUM <= parsed < _LIMIT:
        return None
    for release in RELEASES:
        if release.series == parsed[:2]:
            return release
    return None


def installed_version() -> str:
    """The installed megatron-core's version string."""
    from megatron.core import package_info

    return str(package_info.__version__)


def current_release() -> Release:
    """The row of the installed megatron-core.

    With ``MEGATRON_ODC_SKIP_VERSION_CHECK=1`` a version outside the range gets the nearest row (the
    oldest below it, the newest above it) and a warning.

    Raises:
        ValueError: a version outside :data:`SUPPORTED_RANGE` (one line naming the range and the skip
            variable).
    """
    version = installed_version()
    release = release_for(version)
    if release is not None:
        return release
    if os.environ.get(SKIP_VERSION_CHECK_ENV) != "1":
        raise ValueError(
            f"megatron-core {version} is not supported: megatron_odc supports "
            f"{supported_range_text()}; install one of them (README: Supported releases), or set "
            f"{SKIP_VERSION_CHECK_ENV}=1 to try anyway"
        )
    try:
        below = parse_version(version) < _MINIMUM
    except ValueError:
        below = False
    release = RELEASES[0] if below else RELEASES[-1]
    logger.warning(
        "megatron-core %s is outside %s; %s is set: running with the %s row of the release table",
        version,
        SUPPORTED_RANGE,
        SKIP_VERSION_CHECK_ENV,
        release.name,
    )
    return release


def resolve(qualified: str) -> object:
    """The object ``"module:qualified.name"`` names.

    Raises:
        ImportError: the module does not import.
        AttributeError: a name along the path is missing.
    """
    module_name, path = qualified.split(":")
    obj: object = importlib.import_module(module_name)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def signature_differences(release: Release) -> list[str]:
    """Every callable of ``release.signatures`` that is missing or has other parameters, one line
    each (empty when the installed megatron-core matches the row)."""
    problems = []
    for qualified, expected in release.signatures.items():
        try:
            obj = resolve(qualified)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{qualified} is missing ({exc})")
            continue
        names = tuple(inspect.signature(obj).parameters)
        if names != expected:
            problems.append(f"{qualified}{names} (the {release.name} row expects {expected})")
    return problems


class _DropNotices(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.starts)


@contextlib.contextmanager
def quiet_notices(release: Release | None = None) -> Iterator[None]:
    """Drop the release's ``quiet_notices`` (default: the installed release's) inside the block only."""
    release = release or current_release()
    filters = []
    for name, start in release.quiet_notices:
        notice_filter = _DropNotices((start,))
        logging.getLogger(name).addFilter(notice_filter)
        filters.append((name, notice_filter))
    try:
        yield
    finally:
        for name, notice_filter in filters:
            logging.getLogger(name).removeFilter(notice_filter)
