"""ODC's flags in Megatron-LM's parser, and what ``--dp-backend`` sets or refuses there.

:func:`add_odc_args` is an ``extra_args_provider`` (ODC's flag group, shared with the plugin entry:
``runner/odc_flags.py``); :func:`postprocess_odc_args` runs right after Megatron-LM parses, before its
``validate_args``: for ``odc`` / ``fsdp`` it turns on per-token loss and TP-only amax reduction, keeps
Megatron-LM's own distributed optimizer and overlap options off, resolves ``--balance`` for Megatron-LM's
fixed ``[micro_batch_size, seq_length]`` microbatches and refuses what does not combine; for ``ddp`` /
``distopt`` it sets Megatron-LM's own flags. :func:`apply_megatron_lm_launch_env` runs first, before
Megatron-LM reads ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (in ``parse_args``) and ``MASTER_ADDR`` /
``MASTER_PORT`` (``env://`` in ``initialize_megatron``): under ``mpiexec`` (any ``--odc-transport``) it
sets them from MPI's, and it refuses ``mpi`` under torchrun (``runner/launch_env.py``, the plugin entry's
own path). :func:`wrap_parse_args` / :func:`wrap_validate_args` are the two patches that apply them. :data:`CPU_FLAGS` are the flags Megatron-LM needs without CUDA, which
:func:`with_cpu_flags` adds where the user did not set them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_odc.balance.plan import EQUAL_COUNT_PLAN_KINDS, PLAN_KINDS
from megatron_odc.core.fp8 import check_fp8_flags
from megatron_odc.integration.megatron_lm.sft import apply_sft_args
from megatron_odc.integration.megatron_lm.torch_fsdp2 import refuse_broken_torch_fsdp2
from megatron_odc.mcore.config import (
    ODC_ENGINE_BACKENDS,
    moe_auxiliary_losses_on,
    refuse_unsupported,
)
from megatron_odc.runner.launch_env import apply_launch_env
from megatron_odc.runner.log import info_once, warning_once
from megatron_odc.runner.odc_flags import MEGATRON_SAMPLER, add_odc_arguments, resolve_odc_args

logger = logging.getLogger(__name__)

BALANCE_CHOICES = (*PLAN_KINDS, MEGATRON_SAMPLER)
"""``--balance`` here: a plan kind, or ``none`` to keep Megatron-LM's own sampler."""

BALANCE_COSTS = ("flops", "measured")
"""``--balance-cost`` choices (``integration/megatron_lm/measured_cost.py``); the first is the default."""

CPU_FLAGS: tuple[tuple[str, ...], ...] = (
    ("--distributed-backend", "gloo"),
    ("--transformer-impl", "local"),
    ("--no-gradient-accumulation-fusion",),
    ("--no-persist-layer-norm",),
    ("--no-masked-softmax-fusion",),
    ("--no-bias-gelu-fusion",),
    ("--no-bias-dropout-fusion",),
    ("--num-workers", "0"),
    ("--use-cpu-initialization",),
    ("--no-bias-swiglu-fusion",),
    ("--no-rope-fusion",),
)
"""Megatron-LM's flags for a run without CUDA (gloo, torch layers, no fused kernels, no worker
processes, weights initialised on the CPU), each as its command-line words. (Without
``--no-bias-swiglu-fusion``, ``--swiglu`` ends in a ``torch._dynamo`` error on CPU; without
``--no-rope-fusion``, RoPE asks for TransformerEngine.)"""

TP_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
"""Environment Megatron-LM's ``validate_args`` asserts with ``--tensor-model-parallel-size`` > 1 on
a pre-Blackwell device (the CPU shims report compute capability 9.0): the ordering of TP communication
and compute on CUDA; on CPU it changes nothing else. Set only with TP > 1: Megatron-LM's FSDP asserts
the opposite."""


def _tensor_parallel_size(argv: Sequence[str]) -> int:
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--tensor-model-parallel-size", type=int, default=1)
    known, _ = probe.parse_known_args(list(argv))
    return known.tensor_model_parallel_size


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A Megatron-LM setting the ODC engine (``--dp-backend odc|fsdp``) refuses before training.

    Attributes:
        attr: the ``args`` attribute (absent in a tag that has no such flag: never refused there).
        on: whether a value of it is refused.
        flag: the flag as the user writes it (``{value}`` is replaced by the value).
        reason: why, and what to do instead.
    """

    attr: str
    on: Callable[[Any], bool]
    flag: str
    reason: str

    def check(self, backend: str, args: argparse.Namespace) -> None:
        """Raise when ``args`` has this setting on.

        Raises:
            ValueError: one line naming the backend, the flag and what to do.
        """
        value = getattr(args, self.attr, None)
        if value is not None and self.on(value):
            flag = self.flag.format(value=value)
            raise ValueError(f"--dp-backend {backend} does not combine with {flag}: {self.reason}")


_STATIC_SCHEDULE = (
    "a captured graph replays one static schedule on every rank, while ODC ranks run their own "
    "microbatch counts and fetch parameters on demand"
)

MEGATRON_LM_REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "cuda_graph_impl",
        lambda v: v != "none",
        "--cuda-graph-impl {value}",
        f"{_STATIC_SCHEDULE}; use --cuda-graph-impl none",
    ),
    Refusal("enable_cuda_graph", bool, "--enable-cuda-graph", f"{_STATIC_SCHEDULE}; leave it off"),
    Refusal(
        "external_cuda_graph", bool, "--external-cuda-graph", f"{_STATIC_SCHEDULE}; leave it off"
    ),
    Refusal(
        "optimizer_cuda_graph",
        bool,
        "--optimizer-cuda-graph",
        "the ODC optimizer steps its owned shards outside a captured graph; leave it off",
    ),
    Refusal(
        "optimizer",
        lambda v: v not in ("adam", "sgd"),
        "--optimizer {value}",
        "the ODC optimizer is Adam or SGD over element shards of each bucket; Muon and the "
        "layer-wise distributed optimizer need whole 2-D matrices per owner; use adam or sgd",
    ),
    Refusal(
        "use_layer_wise_distributed_optimizer",
        bool,
        "the layer-wise distributed optimizer (--optimizer muon/dist_muon with "
        "--use-distributed-optimizer)",
        "ODC shards parameters itself; use --optimizer adam or sgd",
    ),
    Refusal(
        "hybrid_context_parallel",
        bool,
        "--hybrid-context-parallel",
        "its schedule assumes every DP rank runs the same microbatches; leave it off",
    ),
    Refusal(
        "save_wgrads_interval",
        lambda v: True,
        "--save-wgrads-interval",
        "Megatron-LM then forces an all-reduce (model_chunk.force_all_reduce) and saves every "
        "parameter's main_grad, while ODC's gradients are summed in the owners' shards; leave it unset",
    ),
    Refusal(
        "optimizer_cpu_offload",
        bool,
        "--optimizer-cpu-offload",
        "the ODC optimizer keeps its fp32 shards where its transport is; leave it off",
    ),
)
"""What ``--dp-backend odc|fsdp`` refuses among Megatron-LM's own flags, besides megatron-core's
``UNSUPPORTED`` (``mcore/config.py``): checked after parsing and again after ``validate_args`` (which
turns the deprecated CUDA-graph flags into ``cuda_graph_impl`` and ``--optimizer dist_muon`` into the
layer-wise optimizer). A flag a tag does not have is never refused there."""


def refuse_megatron_lm_flags(args: argparse.Namespace) -> None:
    """Apply :data:`MEGATRON_LM_REFUSALS` for the ODC engine's backends (nothing for others).

    Raises:
        ValueError: the first refused flag, named.
    """
    backend = getattr(args, "dp_backend", None)
    if backend not in ODC_ENGINE_BACKENDS:
        return
    for refusal in MEGATRON_LM_REFUSALS:
        refusal.check(backend, args)


def with_cpu_flags(argv: list[str], *, cuda: bool) -> list[str]:
    """``argv`` plus every :data:`CPU_FLAGS` entry the user did not set, without CUDA, and
    with TP > 1 :data:`TP_ENV` where the environment does not set it; logs what it added.

    A flag counts as set when ``argv`` holds it as ``--flag`` or ``--flag=value``, whatever its value:
    the user's choice wins. With ``cuda`` nothing is added.
    """
    if cuda:
        return list(argv)
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    added = [word for flag in CPU_FLAGS if flag[0] not in given for word in flag]
    if added:
        logger.info("no CUDA: added Megatron-LM's CPU flags %s", " ".join(added))
    env = {name: value for name, value in TP_ENV.items() if name not in os.environ}
    if env and _tensor_parallel_size(argv) > 1:
        os.environ.update(env)
        logger.info("no CUDA: set %s", " ".join(f"{name}={value}" for name, value in env.items()))
    return [*argv, *added]


def add_odc_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ODC's flags to Megatron-LM's parser (an ``extra_args_provider``); returns the parser.

    ``--dp-backend`` has no default here: without it Megatron-LM chooses from its own flags.
    """
    group = add_odc_arguments(parser, dp_backend_default=None, balance_choices=BALANCE_CHOICES)
    group.add_argument(
        "--balance-cost",
        choices=BALANCE_COSTS,
        default=BALANCE_COSTS[0],
        help="the cost model --balance plans records with: flops (a*s^2+b*s from the model's "
        "shape, what TransformerEngine's attention costs on GPUs) or measured (timed at start-up "
        "on this machine, with a fixed cost per microbatch; the CPU runtime, TP = PP = 1) "
        "(default flops)",
    )
    return parser


def apply_megatron_lm_launch_env(argv: Sequence[str]) -> None:
    """torch's launch variables for the ``--odc-transport`` of Megatron-LM's ``argv`` (without the
    script's name): from MPI's under ``mpiexec`` (any transport), nothing under torchrun.

    ``argv`` is read with ODC's own flag group (Megatron-LM's other flags are left alone); a second
    call finds ``MASTER_ADDR`` / ``MASTER_PORT`` set and keeps them, so every call agrees.

    Raises:
        ValueError: ``--odc-transport mpi`` outside an MPI launch, or without mpi4py (the flag named).
    """
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_odc_args(probe)
    known, _ = probe.parse_known_args(list(argv))
    apply_launch_env(known.odc_transport)


def postprocess_odc_args(args: argparse.Namespace) -> argparse.Namespace:
    """Apply ``--dp-backend`` to Megatron-LM's parsed args (before ``validate_args``).

    Raises:
        ValueError: a flag that does not combine with the chosen backend, named.
    """
    backend = getattr(args, "dp_backend", None)
    if backend is None:
        return args
    refuse_unsupported(
        backend,
        use_megatron_fsdp=getattr(args, "use_megatron_fsdp", False),
        use_torch_fsdp2=getattr(args, "use_torch_fsdp2", False),
        use_distributed_optimizer=backend != "distopt"
        and getattr(args, "use_distributed_optimizer", False),
        overlap_grad_reduce=getattr(args, "overlap_grad_reduce", False),
        overlap_param_gather=getattr(args, "overlap_param_gather", False),
        # also refused where the model is wrapped; here they stop the job before anything starts
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        delay_wgrad_compute=getattr(args, "delay_wgrad_compute", False),
        use_precision_aware_optimizer=getattr(args, "use_precision_aware_optimizer", False),
    )
    _refuse_sft_settings_the_tag_cannot_run(args)
    if backend not in ODC_ENGINE_BACKENDS:
        # Megatron-LM's own DDP keeps its sampler unless an equal-count plan is asked for (the
        # packing baseline: the balanced loader's microbatches, the same count on every rank).
        if args.balance is None:
            args.balance = MEGATRON_SAMPLER
        elif args.balance not in (*EQUAL_COUNT_PLAN_KINDS, MEGATRON_SAMPLER):
            raise ValueError(
                f"--balance {args.balance} gives DP ranks different numbers of microbatches; with "
                f"--dp-backend {backend} use --balance {' or '.join(EQUAL_COUNT_PLAN_KINDS)} or none, "
                "or --dp-backend odc"
            )
        resolve_odc_args(args)  # refuses --odc-* options
        _check_balanced_loader(args)
        if args.balance != MEGATRON_SAMPLER:
            _per_token_loss(args, f"--balance {args.balance} packs records into microbatches")
        args.use_distributed_optimizer = backend == "distopt"
        return args
    refuse_megatron_lm_flags(args)
    ckpt_format = getattr(args, "ckpt_format", "torch_dist")
    for attr in ("save", "load", "pretrained_checkpoint"):
        if getattr(args, attr, None) and ckpt_format != "torch_dist":
            flag = "--" + attr.replace("_", "-")
            raise ValueError(
                f"{flag} with --dp-backend {backend} needs --ckpt-format torch_dist "
                f"(got {ckpt_format}): ODC saves each DP rank's owned slices"
            )
    simple = args.micro_batch_size == 1 and args.dataloader_type in (None, "single")
    if args.balance is None and not simple:
        args.balance = MEGATRON_SAMPLER
        info_once(
            logger,
            "--balance none: --micro-batch-size %s --dataloader-type %s, and the balanced loader "
            "needs --micro-batch-size 1 and --dataloader-type single, so Megatron-LM's sampler feeds "
            "every rank the same count of [micro_batch_size, seq_length] microbatches (no packing "
            "of real lengths)",
            args.micro_batch_size,
            args.dataloader_type or "single",
        )
    resolve_odc_args(args)
    _check_balanced_loader(args)
    _per_token_loss(args, f"--dp-backend {backend} lets DP ranks run different microbatch counts")
    args.tp_only_amax_red = True
    # Megatron-LM stores --fp8-format as args.fp8; TE layers are its default --transformer-impl.
    # Unlike the plugin entry, FP8 compute with --transformer-impl local is left to Megatron-LM.
    check_fp8_flags(
        transformer_impl=getattr(args, "transformer_impl", "transformer_engine"),
        fp8=getattr(args, "fp8", None),
        fp8_recipe=getattr(args, "fp8_recipe", "delayed"),
        fp8_param=bool(getattr(args, "fp8_param_gather", False)),
        tp_only_amax_red=args.tp_only_amax_red,
    )
    args.use_distributed_optimizer = False
    args.overlap_grad_reduce = False
    args.overlap_param_gather = False
    return args


def _refuse_sft_settings_the_tag_cannot_run(args: argparse.Namespace) -> None:
    """``--sft`` settings the installed Megatron-LM fails on under every backend, refused before
    anything starts (it stopped on a bare assertion, or on an allocation of petabytes with TP).

    Raises:
        ValueError: naming the tag, the flag and what to use instead.
    """
    if not getattr(args, "sft", False):
        return
    from megatron_odc.integration.megatron_lm.version import installed_megatron_lm_release

    release = installed_megatron_lm_release()
    if release.sft_micro_batch_size_one and args.micro_batch_size != 1:
        raise ValueError(
            f"--sft with --micro-batch-size {args.micro_batch_size} on {release.tag}: its get_batch "
            "asserts micro-batch-size 1 for packed records (under every --dp-backend); pass "
            "--micro-batch-size 1 (--balance packs several records into each microbatch, up to "
            "--max-tokens-per-microbatch)"
        )
    tp = getattr(args, "tensor_model_parallel_size", 1)
    if not release.sft_tensor_parallel and tp > 1:
        raise ValueError(
            f"--sft with --tensor-model-parallel-size {tp} on {release.tag}: its "
            "get_batch_on_this_tp_rank gives TP ranks other than the first no max_seqlen (under "
            "every --dp-backend); use --tensor-model-parallel-size 1, or Megatron-LM core_v0.17.1 "
            "or later"
        )


def balanced_loader_in_use(args: Any) -> bool:
    """Whether the train split is the balanced loader's (``data.py``): a ``--dp-backend`` with a
    ``--balance`` plan, not Megatron-LM's sampler. One fact for every rank of the job, also those
    that build no loader (TP ranks other than the first, middle pipeline stages)."""
    return getattr(args, "dp_backend", None) is not None and getattr(args, "balance", None) not in (
        None,
        MEGATRON_SAMPLER,
    )


def _check_balanced_loader(args: argparse.Namespace) -> None:
    """What the balanced loader needs, for every ``--dp-backend`` (``--balance`` resolved)."""
    if not balanced_loader_in_use(args):
        return
    if args.micro_batch_size != 1:
        packed = "several records" if getattr(args, "sft", False) else "samples"
        raise ValueError(
            f"--balance {args.balance} with --dp-backend {args.dp_backend} needs --micro-batch-size 1 "
            f"(got {args.micro_batch_size}): it packs {packed} into each microbatch up to "
            "--max-tokens-per-microbatch; or pass --balance none to keep Megatron-LM's sampler"
        )
    if args.dataloader_type not in (None, "single"):
        raise ValueError(
            f"--balance {args.balance} needs --dataloader-type single (got {args.dataloader_type})"
        )
    cap = args.seq_length * args.micro_batch_size
    if getattr(args, "sft", False):
        # records of real lengths are packed up to the cap (data.py); each is up to seq_length
        if args.max_tokens_per_microbatch is not None and args.max_tokens_per_microbatch < cap:
            raise ValueError(
                f"--max-tokens-per-microbatch {args.max_tokens_per_microbatch} with --sft: a "
                f"record may hold --seq-length tokens, so it must be at least {cap}"
            )
    elif args.max_tokens_per_microbatch not in (None, cap):
        raise ValueError(
            f"--max-tokens-per-microbatch {args.max_tokens_per_microbatch}: Megatron-LM's "
            f"microbatches are [micro_batch_size, seq_length], so it must be {cap}"
        )
    model_parallel = (
        getattr(args, "tensor_model_parallel_size", 1),
        getattr(args, "pipeline_model_parallel_size", 1),
    )
    if getattr(args, "balance_cost", "flops") == "measured" and model_parallel != (1, 1):
        raise ValueError(
            "--balance-cost measured times whole-model microbatches on each rank where its data "
            "loader is built: it needs --tensor-model-parallel-size 1 and "
            f"--pipeline-model-parallel-size 1 (got {model_parallel[0]} and {model_parallel[1]}); "
            "use --balance-cost flops there"
        )
    stages = model_parallel[1]
    if getattr(args, "sft", False) and stages > 2:
        from megatron_odc.integration.megatron_lm.version import installed_megatron_lm_release

        release = installed_megatron_lm_release()
        if not release.sft_middle_stages_packed:
            raise ValueError(
                f"--sft with --balance {args.balance} and --pipeline-model-parallel-size {stages} "
                f"on {release.tag}: its pretrain_gpt.py gives middle pipeline stages no cu_seqlens, "
                "so the records packed into one microbatch would attend to each other there; use at "
                "most 2 pipeline stages, Megatron-LM core_v0.17.1 or later, or --balance none"
            )
    if moe_auxiliary_losses_on(
        getattr(args, "num_experts", None),
        getattr(args, "moe_aux_loss_coeff", 0.0),
        getattr(args, "moe_z_loss_coeff", None),
    ):
        warning_once(
            logger,
            "--num-experts with --balance %s: MoE auxiliary losses (--moe-aux-loss-coeff, "
            "--moe-z-loss-coeff) are computed and weighted per microbatch, so a run that packs the "
            "same samples into other microbatches (this plan, or Megatron-LM's sampler) trains with "
            "other auxiliary-loss terms; the language-model loss and its gradients stay the same",
            args.balance,
        )
    if getattr(args, "rampup_batch_size", None):
        raise ValueError(
            f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))} with --balance "
            f"{args.balance}: the balanced loader plans every step's --global-batch-size samples, "
            "not the ramp-up's smaller batches; drop --rampup-batch-size or pass --balance none"
        )


def _refuse_skipped_iterations(args: argparse.Namespace) -> None:
    """After ``validate_args``, which adds the iterations the rerun state machine's tracker file
    lists to ``--iterations-to-skip``: Megatron-LM skips one by reading ``--global-batch-size`` / DP
    microbatches on every rank, which the balanced loader's per-rank counts cannot give (the ranks
    would leave the step on different global batches)."""
    skipped = getattr(args, "iterations_to_skip", None)
    if balanced_loader_in_use(args) and skipped:
        raise ValueError(
            f"--iterations-to-skip {' '.join(map(str, skipped))} (with any the rerun state machine's "
            f"tracker file lists) and --balance {args.balance}: Megatron-LM skips an iteration by "
            "reading --global-batch-size / DP microbatches on every rank, while the balanced loader "
            "gives each rank its own count; drop them or pass --balance none"
        )


def _per_token_loss(args: argparse.Namespace, because: str) -> None:
    """Turn on ``--calculate-per-token-loss``, saying so once, where the user did not."""
    if getattr(args, "calculate_per_token_loss", False):
        return
    args.calculate_per_token_loss = True
    info_once(
        logger,
        "set --calculate-per-token-loss: %s, and only the global per-token mean (every loss token "
        "of the global batch weighted alike) gives the same loss and gradient however the samples are "
        "split; compare with Megatron-LM's DDP run with --calculate-per-token-loss (its default "
        "averages per microbatch)",
        because,
    )


def wrap_parse_args(original: Callable) -> Callable:
    """``parse_args`` with ODC's flags added and :func:`postprocess_odc_args` applied, after
    :func:`apply_megatron_lm_launch_env` for the ``sys.argv`` it parses; ``--use-torch-fsdp2``
    refused where the installed wrapper would fail or train wrong (``torch_fsdp2.py``)."""

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        apply_megatron_lm_launch_env(sys.argv[1:])

        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return add_odc_args(parser)

        args = apply_sft_args(original(provider, ignore_unknown_args))
        return refuse_broken_torch_fsdp2(postprocess_odc_args(args))

    parse_args.__megatron_odc_original__ = original
    return parse_args


def _refuse_after_validation(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` after ``validate_args``, which derives ``virtual_pipeline_model_parallel_size`` from
    ``--num-layers-per-virtual-pipeline-stage``, ``--num-virtual-stages-per-pipeline-rank`` or
    ``--pipeline-model-parallel-layout``: the interleaved schedule is refused for the ODC engine's
    backends before any model is built (pipeline stages themselves run megatron-core's 1F1B);
    :data:`MEGATRON_LM_REFUSALS` again, over what validation derived; and the iterations to skip
    under the balanced loader (:func:`_refuse_skipped_iterations`)."""
    backend = getattr(args, "dp_backend", None)
    if backend is not None:
        refuse_unsupported(
            backend,
            virtual_pipeline_model_parallel_size=getattr(
                args, "virtual_pipeline_model_parallel_size", None
            ),
        )
        refuse_megatron_lm_flags(args)
        _refuse_skipped_iterations(args)
    return args


def _one_line_assertions(original: Callable, args: Any, defaults: dict) -> Any:
    """``original(args, defaults)``, its ``AssertionError`` (how Megatron-LM's ``validate_args``
    refuses arguments, e.g. a global batch size DP does not divide) turned into one line naming it
    and where it was raised, which the launcher prints without a traceback.

    Raises:
        ValueError: Megatron-LM refused the arguments.
    """
    try:
        return original(args, defaults)
    except AssertionError as error:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        said = " ".join((str(error) or frame.line or "assertion failed").split())
        raise ValueError(
            f"Megatron-LM's validate_args refused the arguments: {said} "
            f"({os.path.basename(frame.filename)} line {frame.lineno})"
        ) from error


def wrap_validate_args(original: Callable) -> Callable:
    """``validate_args`` that lets ``--fp8-param-gather`` through for the ODC engine's backends and
    then refuses what only validated arguments show (:func:`_refuse_after_validation`).

    ``core_v0.16.1`` asserts the flag needs its distributed optimizer (the only optimizer of its own
    that re-quantises FP8 parameters from sharded masters) unless grad mode is off, its escape for
    inference. ``ODCOptimizer`` does that re-quantisation for ODC, so for ``--dp-backend odc`` /
    ``fsdp`` with the flag set, validation runs under ``torch.no_grad()``: the assertion is the only
    place ``validate_args`` reads grad mode, and the flag itself is never touched (Megatron-LM prints it
    and ``core_transformer_config_from_args`` turns it into ``fp8_param``).
    """

    @functools.wraps(original)
    def validate_args(args, defaults={}):  # noqa: B006 - Megatron-LM's own signature and default
        backend = getattr(args, "dp_backend", None)
        if backend not in ODC_ENGINE_BACKENDS or not getattr(args, "fp8_param_gather", False):
            return _refuse_after_validation(_one_line_assertions(original, args, defaults))
        with torch.no_grad():
            result = _refuse_after_validation(_one_line_assertions(original, args, defaults))
        logger.info(
            "--fp8-param-gather with --dp-backend %s: ODC shards, fetches and re-quantises the FP8 "
            "parameters (Megatron-LM's distributed-optimizer requirement does not apply)",
            backend,
        )
        return result

    validate_args.__megatron_odc_original__ = original
    return validate_args
