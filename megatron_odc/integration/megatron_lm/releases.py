"""The Megatron-LM tags the launcher and the source patches support, and every difference between them.

:data:`MEGATRON_LM_RELEASES` has one row per tag (``core_v0.16.1``, ``core_v0.17.1``, ``core_v0.18.2``,
``core_v0.19.0``), keyed like megatron-core's own table (``mcore/releases.py``) by the release series
``(major, minor)``: a Megatron-LM checkout is run with the megatron-core of its series. A row lists the
patch points the tag has (names of ``patching.PATCH_POINTS``, the catalogue of every wrapper), the
parameter names of each patched or swapped name (read from the tag's sources), and the CPU shims
(names of ``cpu_shims.CPU_SHIMS``). Code elsewhere never compares tags: it asks ``version.check_megatron_lm_version``
for the row of the ``megatron/training`` it runs and reads a field of it.

Which ``megatron/training`` that is: the checkout's (the launcher puts it first on ``sys.path``), or,
from 0.17 on, the megatron-core wheel's own copy when no checkout is given. Its series is read from the
``megatron/core/package_info.py`` next to it (a checkout's own; tag ``core_v0.19.0`` says 0.19.1),
else from the installed megatron-core.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Mapping
from pathlib import Path

_ARGUMENTS = "megatron.training.arguments"
_INITIALIZE = "megatron.training.initialize"
_TRAINING = "megatron.training.training"
_CHECKPOINTING = "megatron.training.checkpointing"
_DIST_UTILS = "megatron.training.models.dist_utils"

_DDP_INIT_016 = ("self", "config", "ddp_config", "module", "disable_bucketing", "pg_collection")
_INITIALIZE_016 = (
    "allow_no_cuda",
    "skip_mpu_initialization",
    "get_embedding_ranks",
    "get_position_embedding_ranks",
)
_TRAIN_STEP_016 = (
    "forward_step_func",
    "data_iterator",
    "model",
    "optimizer",
    "opt_param_scheduler",
    "config",
    "forward_backward_func",
    "iteration",
)
_CKPT_GROUPS_016 = ("tp_group", "pp_group", "dp_cp_group")
_CKPT_GROUPS_019 = (*_CKPT_GROUPS_016, "dp_group", "expt_dp_group", "rng_state_key_prefix")
_SAVE_016 = (
    "iteration",
    "model",
    "optimizer",
    "opt_param_scheduler",
    "num_floating_point_operations_so_far",
    "checkpointing_context",
    "pipeline_rank",
    "expert_rank",
    "tensor_rank",
    "pipeline_parallel",
    "expert_parallel",
    "non_persistent_ckpt",
    "train_data_iterator",
    "preprocess_common_state_dict_fn",
    "release",
    *_CKPT_GROUPS_016,
)
_LOAD_016 = (
    "ddp_model",
    "optimizer",
    "opt_param_scheduler",
    "load_arg",
    "strict",
    "checkpointing_context",
    "skip_load_to_model_and_opt",
    *_CKPT_GROUPS_016,
)

_POINTS_016 = (
    f"{_ARGUMENTS}.parse_args",
    f"{_INITIALIZE}.parse_args",
    f"{_ARGUMENTS}.validate_args",
    f"{_INITIALIZE}.validate_args",
    f"{_TRAINING}.get_model",
    f"{_TRAINING}.get_megatron_optimizer",
    f"{_TRAINING}.get_forward_backward_func",
    f"{_TRAINING}.build_pretraining_data_loader",
    f"{_TRAINING}.setup_model_and_optimizer",
    f"{_CHECKPOINTING}._build_sharded_state_dict_metadata",
    f"{_TRAINING}.initialize_megatron",
    f"{_TRAINING}.train_step",
    f"{_TRAINING}.save_checkpoint",
    f"{_TRAINING}.load_checkpoint",
)
# core_v0.18.2: initialize no longer imports parse_args / validate_args (pretrain_gpt.py calls
# arguments.parse_and_validate_args); models/dist_utils.py builds models from a config container.
_POINTS_018 = (
    f"{_ARGUMENTS}.parse_args",
    f"{_ARGUMENTS}.validate_args",
    f"{_TRAINING}.get_model",
    f"{_DIST_UTILS}._ddp_wrap",
    f"{_TRAINING}.get_megatron_optimizer",
    f"{_TRAINING}.get_forward_backward_func",
    f"{_TRAINING}.build_pretraining_data_loader",
    f"{_TRAINING}.setup_model_and_optimizer",
    f"{_CHECKPOINTING}._build_sharded_state_dict_metadata",
    f"{_TRAINING}.initialize_megatron",
    f"{_TRAINING}.train_step",
    f"{_TRAINING}.save_checkpoint",
    f"{_TRAINING}.load_checkpoint",
)

_SIGNATURES_016: dict[str, tuple[str, ...]] = {
    f"{_ARGUMENTS}.parse_args": ("extra_args_provider", "ignore_unknown_args"),
    f"{_INITIALIZE}.parse_args": ("extra_args_provider", "ignore_unknown_args"),
    f"{_ARGUMENTS}.validate_args": ("args", "defaults"),
    f"{_INITIALIZE}.validate_args": ("args", "defaults"),
    f"{_TRAINING}.get_model": (
        "model_provider_func",
        "model_type",
        "wrap_with_ddp",
        "config",
        "pg_collection",
    ),
    f"{_TRAINING}.get_megatron_optimizer": (
        "config",
        "model_chunks",
        "config_overrides",
        "use_gloo_process_groups",
        "pg_collection",
        "dump_param_to_param_group_map",
    ),
    f"{_TRAINING}.get_forward_backward_func": ("pp_size", "vp_size"),
    f"{_TRAINING}.build_pretraining_data_loader": ("dataset", "consumed_samples"),
    f"{_TRAINING}.setup_model_and_optimizer": (
        "model_provider_func",
        "model_type",
        "checkpointing_context",
    ),
    f"{_CHECKPOINTING}._build_sharded_state_dict_metadata": ("args", "dp_cp_group"),
    f"{_TRAINING}.DDP": _DDP_INIT_016,
    f"{_TRAINING}.initialize_megatron": (
        "extra_args_provider",
        "args_defaults",
        "ignore_unknown_args",
        *_INITIALIZE_016,
        "parsed_args",
        "store",
    ),
    f"{_TRAINING}.train_step": _TRAIN_STEP_016,
    f"{_TRAINING}.save_checkpoint": _SAVE_016,
    f"{_TRAINING}.load_checkpoint": _LOAD_016,
}
"""``"module.attr"`` -> parameter names (a class: its ``__init__``'s), from ``core_v0.16.1``: every
patch point, and ``training.DDP``, which ``get_model``'s wrapper swaps for ODC's factory."""

_SIGNATURES_018 = {
    **{k: v for k, v in _SIGNATURES_016.items() if not k.startswith(_INITIALIZE)},
    f"{_TRAINING}.DDP": (*_DDP_INIT_016, "full_param_layout"),
    f"{_DIST_UTILS}._ddp_wrap": (
        "model",
        "data_parallel_random_init",
        "ddp_config",
        "overlap_param_gather_with_optimizer_step",
        "use_megatron_fsdp",
        "use_torch_fsdp2",
        "pg_collection",
    ),
    f"{_DIST_UTILS}.DistributedDataParallel": (*_DDP_INIT_016, "full_param_layout"),
    f"{_TRAINING}.initialize_megatron": (*_INITIALIZE_016, "store"),
    f"{_ARGUMENTS}.parse_and_validate_args": (
        "extra_args_provider",
        "ignore_unknown_args",
        "args_defaults",
    ),
}
_SIGNATURES_019 = {
    **_SIGNATURES_018,
    f"{_TRAINING}.initialize_megatron": (
        *_INITIALIZE_016,
        "store",
        "skip_model_parallel_init",
        "seed_pp_group",
        "seed_dp_group",
        "seed_tp_group",
        "seed_ep_group",
        "seed_etp_group",
        "skip_random_seed",
    ),
    f"{_TRAINING}.train_step": (*_TRAIN_STEP_016, "pg_collection", "p2p_communicator"),
    f"{_TRAINING}.save_checkpoint": (*_SAVE_016, *_CKPT_GROUPS_019[3:]),
    f"{_TRAINING}.load_checkpoint": (*_LOAD_016, *_CKPT_GROUPS_019[3:]),
    f"{_TRAINING}.get_forward_backward_func": ("pp_size", "vp_size", "schedule_pg_collection"),
    f"{_TRAINING}.setup_model_and_optimizer": (
        "model_type",
        "model_provider_func",
        "checkpointing_context",
        "cfg_container",
        "pg_collection",
    ),
}

_CPU_SHIMS = (
    "cuda.is_available",
    "cuda.device_count",
    "cuda.set_device",
    "cuda.get_device_properties",
    "cuda.get_device_capability",
    "cuda.Stream",
    "cuda.stream",
    "cuda.current_stream",
    "initialize.set_jit_fusion_options",
    "training.set_jit_fusion_options",
    "initialize._compile_dependencies",
    "parallel_state.get_nccl_options",
    "torch_fully_sharded_data_parallel.DeviceMesh",
)
_CPU_SHIMS_017 = (*_CPU_SHIMS, "accelerator.is_available")
"""From 0.17 (Python 3.12, torch's CUDA build): torch.accelerator would report CUDA on CPU."""


@dataclasses.dataclass(frozen=True)
class MegatronLmRelease:
    """One supported Megatron-LM tag and what differs in it.

    Attributes:
        tag: the Megatron-LM git tag, e.g. ``"core_v0.19.0"``.
        series: ``(major, minor)``; the megatron-core row it runs with (``mcore.releases.RELEASES``).
        python: the Python it was tested on.
        patch_points: ``"module.attr"`` of every patch point the tag has, in patch order (each one of
            ``patching.PATCH_POINTS``).
        signatures: ``"module.attr"`` -> parameter names of each patch point and swapped class.
        cpu_shims: names of the Megatron-LM CPU shims it needs (``cpu_shims.CPU_SHIMS``), in order.
        model_builders: where the tag wraps model chunks in its DDP, for people (each is a patch point).
        sft_tokenizer: the module whose ``SFTTokenizer`` indexes ``apply_chat_template(...)[0]``
            (transformers 4's result) and needs ``sft.sft_tokenizer_adapter`` under transformers 5;
            None where the tag reads both results itself (from ``core_v0.18.2``).
        sft_middle_stages_packed: whether the tag's ``pretrain_gpt.py`` gives middle pipeline stages
            the ``cu_seqlens`` of an ``--sft`` microbatch (from ``core_v0.17.1``); without them a
            middle stage attends across the records the balanced loader packs together, so
            ``--sft`` with more than 2 stages is refused there (``flags.py``).
        sft_micro_batch_size_one: whether the tag's ``get_batch`` asserts ``--micro-batch-size 1``
            for ``--sft``'s packed records (``core_v0.16.1``, ``core_v0.17.1``), under every backend.
        sft_tensor_parallel: whether ``--sft`` runs with TP > 1 (``core_v0.16.1``'s
            ``get_batch_on_this_tp_rank`` gives TP ranks other than the first no ``max_seqlen``,
            under every backend).
        sft_long_records_fail: whether the tag's ``SFTDataset`` fails on a record longer than
            ``--seq-length`` instead of truncating it (``core_v0.16.1``: ``pack_tokens.extend(pad)``
            raises ``TypeError``), under every backend; the balanced loader names the record.
        notes: what changed against the previous row.
    """

    tag: str
    series: tuple[int, int]
    python: str
    patch_points: tuple[str, ...]
    signatures: Mapping[str, tuple[str, ...]]
    cpu_shims: tuple[str, ...]
    model_builders: tuple[str, ...]
    sft_tokenizer: str | None
    sft_middle_stages_packed: bool = True
    sft_micro_batch_size_one: bool = False
    sft_tensor_parallel: bool = True
    sft_long_records_fail: bool = False
    notes: str = ""


MEGATRON_LM_RELEASES: tuple[MegatronLmRelease, ...] = (
    MegatronLmRelease(
        tag="core_v0.16.1",
        series=(0, 16),
        python="3.11",
        patch_points=_POINTS_016,
        signatures=_SIGNATURES_016,
        cpu_shims=_CPU_SHIMS,
        model_builders=(f"{_TRAINING}.get_model",),
        sft_tokenizer="megatron.training.tokenizer.sft_tokenizer",
        sft_middle_stages_packed=False,
        sft_micro_batch_size_one=True,
        sft_tensor_parallel=False,
        sft_long_records_fail=True,
    ),
    MegatronLmRelease(
        tag="core_v0.17.1",
        series=(0, 17),
        python="3.12",
        patch_points=_POINTS_016,
        signatures=_SIGNATURES_016,
        cpu_shims=_CPU_SHIMS_017,
        model_builders=(f"{_TRAINING}.get_model",),
        sft_tokenizer="megatron.core.tokenizers.text.libraries.sft_tokenizer",
        sft_micro_batch_size_one=True,
        notes="the megatron-core wheel ships megatron/training (the launcher puts the checkout first); "
        "free_overlap_buffers() on every chunk before a save; SFTTokenizer moves to megatron-core",
    ),
    MegatronLmRelease(
        tag="core_v0.18.2",
        series=(0, 18),
        python="3.12",
        patch_points=_POINTS_018,
        signatures=_SIGNATURES_018,
        cpu_shims=_CPU_SHIMS_017,
        model_builders=(f"{_TRAINING}.get_model", f"{_DIST_UTILS}._ddp_wrap"),
        sft_tokenizer=None,
        notes="initialize no longer binds parse_args / validate_args (arguments.parse_and_validate_args"
        ", called by pretrain_gpt.py); DDP.__init__ gains full_param_layout; get_model wraps through "
        "wrap_model_chunks_with_ddp(DP=DDP); models/dist_utils._ddp_wrap (config-container builders)",
    ),
    MegatronLmRelease(
        tag="core_v0.19.0",
        series=(0, 19),
        python="3.12",
        patch_points=_POINTS_018,
        signatures=_SIGNATURES_019,
        cpu_shims=_CPU_SHIMS_017,
        model_builders=(f"{_DIST_UTILS}._ddp_wrap", f"{_TRAINING}.get_model"),
        sft_tokenizer=None,
        notes="pretrain_gpt.py builds the model through models/gpt.py -> dist_utils._ddp_wrap "
        "(get_model is not called); get_forward_backward_func(schedule_pg_collection); "
        "setup_model_and_optimizer(model_type, ..., cfg_container, pg_collection); "
        "set_jit_fusion_options(tp_size)",
    ),
)
"""Every supported Megatron-LM tag, oldest first."""


def supported_tags_text() -> str:
    """``"core_v0.16.1 (megatron-core 0.16.x, Python 3.11), ..."``."""
    return ", ".join(
        f"{r.tag} (megatron-core {r.series[0]}.{r.series[1]}.x, Python {r.python})"
        for r in MEGATRON_LM_RELEASES
    )


def release_for_series(series: tuple[int, int]) -> MegatronLmRelease | None:
    """The row of a ``(major, minor)`` series, or None."""
    for release in MEGATRON_LM_RELEASES:
        if release.series == series:
            return release
    return None


def nearest_release(series: tuple[int, int]) -> MegatronLmRelease:
    """The row of ``series``, else the oldest row below the range or the newest above it."""
    release = release_for_series(series)
    if release is not None:
        return release
    return (
        MEGATRON_LM_RELEASES[0]
        if series < MEGATRON_LM_RELEASES[0].series
        else (MEGATRON_LM_RELEASES[-1])
    )


def training_dir() -> Path | None:
    """The ``megatron/training`` directory ``import megatron.training`` would load, or None."""
    try:
        spec = importlib.util.find_spec("megatron.training")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def checkout_version(training: Path) -> str | None:
    """The version in ``megatron/core/package_info.py`` beside ``training``, or None without one."""
    info = training.parent / "core" / "package_info.py"
    try:
        text = info.read_text()
    except OSError:
        return None
    parts = {}
    for name in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"^{name}\s*=\s*(\d+)", text, re.MULTILINE)
        if match is None:
            return None
        parts[name] = match.group(1)
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"
