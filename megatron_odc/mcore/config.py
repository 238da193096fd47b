"""What can be asked of the data-parallel backends: the backend list, ODC's options, and every refusal.

Owns, each written once:

- ``BACKENDS`` (``odc``, ``fsdp``, ``ddp``, ``distopt``) and the subsets that share a property;
- :class:`ODCConfig`, ODC's own options (one frozen dataclass whose ``__post_init__`` holds every check);
- :data:`UNSUPPORTED` and :func:`refuse_unsupported`, the Megatron features a backend does not combine
  with, each with its flag and reason; :func:`check_pipeline_layers`, the one layout megatron-core
  cannot build that the entries check before building a model;
- :func:`moe_auxiliary_losses_on`, whether a MoE model has the per-microbatch auxiliary losses that
  the loss contracts and packed plans must account for.

Imports megatron nothing: the entries (``runner/``, ``integration/``) and the adapter (``data_parallel.py``,
``optimizer.py``) call these with what they know.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from megatron_odc.core.budget import BUDGET_ALL, BUDGET_NONE, parse_budget
from megatron_odc.core.groups import SHARD_GROUP_SIZE_FLAG
from megatron_odc.transport import TRANSPORT_CHOICES
from megatron_odc.transport.cuda import ACCUMULATE_MODES

BACKENDS = ("odc", "fsdp", "ddp", "distopt")
"""``--dp-backend`` choices: ODC; the same engine over lockstep collectives (the ZeRO-3 baseline);
megatron-core's ``DistributedDataParallel`` without and with its distributed optimizer."""

ODC_ENGINE_BACKENDS = ("odc", "fsdp")
"""Backends built on ``ODCDataParallel`` and ``ODCOptimizer``."""

LOCKSTEP_BACKENDS = ("fsdp",)
"""Backends whose ranks must run the same number of microbatches (every bucket operation is a
collective)."""

LOCKSTEP_TRANSPORT = "collective"
"""The transport of the lockstep backends."""


def _option(
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
    parse: Callable[[Any], Any] | None = None,
    default_help: str | None = None,
) -> Any:
    """A field of :class:`ODCConfig`: its flag's help, its choices, the function that checks a
    value that is neither a choice nor a plain number (raising ``ValueError`` naming the flag), and
    the default as ``--help`` shows it where the entry fills it from something else."""
    return dataclasses.field(
        default=default,
        metadata={"help": help, "choices": choices, "parse": parse, "default_help": default_help},
    )


def check_shard_group_size_value(value: Any) -> None:
    """``--odc-shard-group-size``: 0 (the DP ranks of one host) or a positive integer; whether it
    divides the DP size is checked where the DP group is known (``core/groups.py``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{SHARD_GROUP_SIZE_FLAG} must be 0 (the ranks of one host) or an integer >= 1, got "
            f"{value!r}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ODCConfig:
    """ODC's own options. Each field's ``metadata["help"]`` says what it means; its command-line flag
    is ``--odc-<field>`` (a ``True`` default: ``--no-odc-<field>``), built from the field by
    ``runner/odc_flags.py`` for both entries."""

    transport: str = _option(
        "auto",
        "one-sided transport: shm (CPU ranks of one host), cuda (PyTorch symmetric memory, the GPUs "
        "of one node), mpi (MPI-3 RMA through mpi4py, across hosts; launch with mpiexec), nvshmem "
        "(PyTorch symmetric memory over NVSHMEM, GPUs across nodes), collective (lockstep all-gather "
        "/ reduce-scatter: the fsdp baseline) or auto (a shard group on one host: cuda for a model on "
        "GPUs, else shm; across hosts: nvshmem on GPUs, mpi on CPU)",
        TRANSPORT_CHOICES,
    )
    cuda_accumulate: str = _option(
        "atomic",
        "cuda transport: atomic (Triton peer atomics) or deterministic (staging slots reduced in a "
        "fixed order at the fence: bitwise reproducible, one extra shard per source; also chosen by "
        "--odc-deterministic)",
        ACCUMULATE_MODES,
    )
    deterministic: bool = _option(
        False,
        "fixed-order gradient sums, so that two identical runs are bitwise equal: each source adds "
        "into its own staging slot at the owner, which the owner reduces in source order at the fence "
        "(shm, cuda and mpi; memory: one fp32 gradient shard per source at each owner; the collective "
        "and nvshmem transports are deterministic already)",
    )
    pushes_in_flight: int = _option(
        1, "unsharded gradient buffers whose push may still run while compute goes on"
    )
    bucket_size: int = _option(
        40_000_000, "bucket size in elements; a larger parameter is split across buckets"
    )
    alignment: int = _option(64, "element alignment of parameter starts and shards")
    prefetch: bool = _option(
        True, "fetch the next unit (forward) or the previous one (backward) one step early"
    )
    timeout_s: float = _option(
        600.0,
        "seconds a fence waits for a peer before naming it and failing",
        default_help="--distributed-timeout-minutes x 60",
    )
    check_params_equal: bool = _option(
        True, "check at construction that every DP rank holds the same weights"
    )
    unsharded_budget: str = _option(
        BUDGET_NONE,
        f"bytes per rank for units kept unsharded from their first use in a minibatch to its fence, "
        f"fetched once and pushed once per minibatch ({BUDGET_NONE}: ZeRO-3, fetch per use and push "
        f"per microbatch; {BUDGET_ALL}: every unit; or a size such as 2GiB)",
        parse=parse_budget,
    )

    shard_group_size: int = _option(
        0,
        "ranks each parameter, gradient and optimizer state is sharded over (a divisor of the DP "
        "size); the shard groups' replicas sum their gradients with one all-reduce per bucket per "
        "minibatch (hybrid sharding). 0: the DP ranks of one host (full sharding on one host, hybrid "
        "across hosts)",
        parse=check_shard_group_size_value,
    )

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value, kind = getattr(self, field.name), type(field.default)
            flag = f"--odc-{field.name.replace('_', '-')}"
            choices = field.metadata["choices"]
            if field.metadata["parse"] is not None:
                field.metadata["parse"](value)
            elif choices is not None:
                if value not in choices:
                    raise ValueError(f"{flag} {value!r} is not one of {', '.join(choices)}")
            elif kind is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"{flag} must be True or False, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{flag} must be a number > 0, got {value!r}")
            elif kind is int and not isinstance(value, int):
                raise ValueError(f"{flag} must be an integer, got {value!r}")

    @classmethod
    def from_args(cls, args: Any) -> ODCConfig:
        """The options set on ``args`` (an argparse namespace with ``odc_<field>`` attributes, as
        ``runner/odc_flags.py`` adds them; ``None`` or a missing attribute keeps the default). The
        fence's ``timeout_s`` defaults to Megatron's ``--distributed-timeout-minutes`` where ``args``
        has it.

        Raises:
            ValueError: a value the checks refuse (the message names the flag).
        """
        values = {}
        for field in dataclasses.fields(cls):
            value = getattr(args, f"odc_{field.name}", None)
            if value is not None:
                values[field.name] = value
        minutes = getattr(args, "distributed_timeout_minutes", None)
        if "timeout_s" not in values and minutes is not None:
            values["timeout_s"] = 60.0 * minutes  # the fence waits as long as any collective
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A Megatron feature that some backends do not combine with."""

    flag: str
    """The Megatron flag that turns it on, as a user types it."""
    backends: tuple[str, ...]
    """The backends that refuse it."""
    reason: str
    """Why, and what to do instead."""
    reason_by_backend: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """A reason of its own for some of ``backends`` (backend -> why, and what to do instead)."""

    def reason_for(self, backend: str) -> str:
        """Why ``backend`` refuses it, and what to do instead."""
        return self.reason_by_backend.get(backend, self.reason)


_SHARDED = "ODC already shards parameters, gradients and optimizer state"

UNSUPPORTED: Mapping[str, Unsupported] = {
    "virtual_pipeline_model_parallel_size": Unsupported(
        "--num-layers-per-virtual-pipeline-stage (virtual pipeline stages)",
        ODC_ENGINE_BACKENDS,
        "ODC runs megatron-core's 1F1B pipeline schedule, not the interleaved one; leave it unset",
    ),
    "context_parallel_size": Unsupported(
        "--context-parallel-size > 1",
        ODC_ENGINE_BACKENDS,
        "ODC does not support context parallelism yet; use 1",
    ),
    "expert_model_parallel_size": Unsupported(
        "--expert-model-parallel-size > 1",
        ODC_ENGINE_BACKENDS,
        "ODC does not support expert parallelism yet; use 1",
    ),
    "use_distributed_optimizer": Unsupported(
        "--use-distributed-optimizer",
        (*ODC_ENGINE_BACKENDS, "ddp"),
        _SHARDED,
        {
            "ddp": "--dp-backend ddp is megatron-core DDP with the optimizer state replicated on "
            "every rank; for Megatron's distributed optimizer use --dp-backend distopt instead "
            "(it sets --use-distributed-optimizer itself)"
        },
    ),
    "use_megatron_fsdp": Unsupported("--use-megatron-fsdp", BACKENDS, "pick one backend"),
    "use_torch_fsdp2": Unsupported("--use-torch-fsdp2", BACKENDS, "pick one backend"),
    "overlap_grad_reduce": Unsupported(
        "--overlap-grad-reduce",
        ODC_ENGINE_BACKENDS,
        "ODC pushes each unit's gradients as soon as they are ready",
    ),
    "overlap_param_gather": Unsupported(
        "--overlap-param-gather", ODC_ENGINE_BACKENDS, "ODC prefetches the next unit's parameters"
    ),
    "delay_wgrad_compute": Unsupported(
        "--delay-wgrad-compute",
        ODC_ENGINE_BACKENDS,
        "gradients are pushed when a unit's backward ends",
    ),
    "use_precision_aware_optimizer": Unsupported(
        "--use-precision-aware-optimizer",
        ODC_ENGINE_BACKENDS,
        "the ODC optimizer keeps fp32 main shards",
    ),
    "cuda_graph": Unsupported(
        "--cuda-graph-impl local/transformer_engine/full_iteration (CUDA graphs)",
        ODC_ENGINE_BACKENDS,
        "a captured graph replays one static schedule on every rank, while ODC ranks run their own "
        "microbatch counts and fetch parameters on demand; use --cuda-graph-impl none",
    ),
    "optimizer_cuda_graph": Unsupported(
        "--optimizer-cuda-graph",
        ODC_ENGINE_BACKENDS,
        "the ODC optimizer steps its owned shards outside a captured graph; leave it off",
    ),
}
"""Setting (the ``args`` / config attribute) -> what a backend refuses about it. A setting is on when
it is ``True`` or, for the ``*_size`` ones, larger than 1. Pipeline stages themselves are not refused
(the wrapper, the plugin's entry and the Megatron-LM launcher run megatron-core's 1F1B: [Note: ODC with
pipeline stages] in ``pipeline.py``); virtual stages (the interleaved schedule) are."""


def refuse_unsupported(backend: str, **settings: Any) -> None:
    """Raise for the first setting in ``settings`` that ``backend`` does not combine with.

    Args:
        backend: one of ``BACKENDS``.
        **settings: keys of ``UNSUPPORTED`` with the values the caller knows (flags, config fields or
            process-group sizes); ``None`` counts as off.

    Raises:
        ValueError: naming the backend, the flag and what to do.
    """
    for key, value in settings.items():
        rule = UNSUPPORTED[key]
        on = (value or 1) > 1 if key.endswith("_size") else bool(value)
        if on and backend in rule.backends:
            raise ValueError(
                f"--dp-backend {backend} does not combine with {rule.flag}: "
                f"{rule.reason_for(backend)}"
            )


def moe_auxiliary_losses_on(num_experts: int | None, *coefficients: Any) -> bool:
    """Whether a MoE model (``num_experts`` experts) has an auxiliary loss: any of ``coefficients``
    (``moe_aux_loss_coeff``, ``moe_z_loss_coeff``: a number, a list of them, or None) is non-zero.
    megatron-core computes those losses per microbatch and scales them by the local microbatch count
    unless ``calculate_per_token_loss``."""
    if not num_experts:
        return False
    values = [
        v
        for c in coefficients
        if c is not None
        for v in (c if isinstance(c, list | tuple) else [c])
    ]
    return any(float(v) != 0 for v in values)


def check_pipeline_layers(num_layers: int, pipeline_stages: int) -> None:
    """Refuse a number of layers that megatron-core cannot split into equal pipeline stages.

    Raises:
        ValueError: naming ``--num-layers`` and ``--pipeline-model-parallel-size``.
    """
    if num_layers % pipeline_stages:
        raise ValueError(
            f"--num-layers {num_layers} does not split into --pipeline-model-parallel-size "
            f"{pipeline_stages} stages of equal layers; choose a number of layers divisible by "
            f"{pipeline_stages}"
        )
