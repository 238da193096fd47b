"""``--dp-backend odc`` inside Megatron-LM's own training loop (``core_v0.16.1``), without editing it.

Owns :func:`apply_megatron_lm_patches` (explicit, reversible; nothing happens on import), the flags ODC
adds to Megatron-LM's parser (:func:`add_odc_args`, :func:`postprocess_odc_args`), the planned-count
forward-backward wrapper and the length-balanced train loader. The patched names (docs/megatron.md
section 3.5):

1. ``megatron.training.arguments.parse_args`` and its by-name binding in ``megatron.training.initialize``:
   compose :func:`add_odc_args` with the caller's ``extra_args_provider``; after parsing,
   :func:`postprocess_odc_args` (per-token loss, ``tp_only_amax_red``, refusals). Likewise
   ``validate_args`` (both bindings): for odc/fsdp with ``--fp8-param-gather`` it runs without grad
   mode, which is what its distributed-optimizer assertion allows (``OdcOptimizer`` re-quantises
   FP8 parameters itself).
2. ``megatron.training.training.get_model``: while it runs with ``--dp-backend odc`` (or ``fsdp``: the
   same engine over the lockstep collective transport), the module global ``DDP`` is a factory that
   builds ``OdcDataParallel`` with an ``OdcConfig`` (DDP's fields plus the ``--odc-*`` flags); the
   global is restored afterwards.
3. ``megatron.training.training.get_megatron_optimizer``: an :class:`OdcChainedOptimizer` (a
   ``ChainedOptimizer`` over one ``OdcOptimizer`` that steps through it) when every chunk is an
   ``OdcDataParallel``.
4. ``megatron.training.training.get_forward_backward_func``: the returned schedule is wrapped; for ODC
   chunks in training it runs this rank's planned microbatch count (asked from the data iterator on TP
   rank 0 and broadcast over TP) and, for a count of 0, only finalizes the gradients and returns a zero
   ``[loss_sum, num_tokens]`` report with the keys of the last report (default ``"lm loss"``).
5. ``megatron.training.training.build_pretraining_data_loader``: with ``--balance`` other than
   ``none``, the train split gets a :class:`BalancedPretrainingLoader` whose iterator exposes
   ``next_num_microbatches()``.

Megatron-LM's samples are fixed ``[seq_length]`` packs, so every sample costs the same and LB-Mini
gives every DP rank the same count; the plan is still made per global batch by
:class:`~megatron_odc.data.sampler.LengthBalancedSampler` and its count drives the schedule.

Megatron-LM's own checkpointing (``--save`` / ``--load``, ``--ckpt-format torch_dist`` only) works
through :func:`megatron_odc.checkpoint.install_megatron_lm_checkpointing`, which the ``get_model`` and
optimizer wrappers call on every ODC chunk: the unwrapped module's ``sharded_state_dict`` yields this
DP rank's owned slices and the chunk's ``load_state_dict`` writes them back; ``OdcOptimizer`` has
its own ``sharded_state_dict`` / ``load_state_dict`` (DistOpt's fully-reshardable keys).

On a machine without CUDA, ``cpu=True`` also applies :func:`megatron_odc.patches.cpu.apply_cpu_patches`
and the Megatron-LM-only shims of docs/megatron.md section 4 item 9.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core.optimizer.optimizer import ChainedOptimizer

from megatron_odc.balance.plan import PLAN_KINDS
from megatron_odc.integration.cpu import SKIP_VERSION_CHECK_ENV

logger = logging.getLogger(__name__)

SUPPORTED_MEGATRON_LM_TAG = "core_v0.16.1"
SUPPORTED_MEGATRON_CORE_VERSION = "0.16.1"
DP_BACKENDS = ("odc", "fsdp", "ddp", "distopt")
ODC_ENGINE_BACKENDS = ("odc", "fsdp")
"""Backends built on ``OdcDataParallel``; ``fsdp`` uses the lockstep collective transport."""
BALANCE_CHOICES = (*PLAN_KINDS, "none")
DEFAULT_LOSS_KEYS = ("lm loss",)
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
    ("megatron.training.training", "DDP"): (
        "self",
        "config",
        "ddp_config",
        "module",
        "disable_bucketing",
        "pg_collection",
    ),
}


# --------------------------------------------------------------------------- flags


def add_odc_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ODC's flags to Megatron-LM's parser (an ``extra_args_provider``); returns the parser."""
    group = parser.add_argument_group("ODC data parallelism (megatron-odc)")
    group.add_argument(
        "--dp-backend",
        choices=DP_BACKENDS,
        default=None,
        help="data-parallel backend; default: Megatron-LM's own choice from its flags",
    )
    group.add_argument(
        "--balance",
        choices=BALANCE_CHOICES,
        default=None,
        help="with --dp-backend odc/fsdp: per-global-batch microbatch plan of the train split "
        "(default lb_mini for odc, lb_micro for fsdp; none: Megatron-LM's sampler)",
    )
    group.add_argument(
        "--max-tokens-per-microbatch",
        type=int,
        default=None,
        help="token cap of a microbatch; Megatron-LM's path needs seq_length * micro_batch_size",
    )
    group.add_argument(
        "--odc-transport",
        choices=("auto", "shm", "collective", "cuda"),
        default=None,
        help="one-sided transport (default auto: cuda for a model on GPUs, else shm)",
    )
    group.add_argument(
        "--odc-cuda-accumulate",
        choices=("atomic", "deterministic"),
        default=None,
        help="cuda transport: peer atomics, or staging slots reduced in a fixed order (reproducible)",
    )
    group.add_argument(
        "--odc-pushes-in-flight",
        type=int,
        default=None,
        help="gradient pushes that may still run while compute goes on (default 1)",
    )
    group.add_argument("--odc-bucket-size", type=int, default=None, help="elements per bucket")
    group.add_argument("--odc-alignment", type=int, default=None, help="element alignment")
    group.add_argument(
        "--no-odc-prefetch", action="store_false", dest="odc_prefetch", help="fetch on demand"
    )
    group.add_argument("--odc-timeout-s", type=float, default=None, help="fence timeout")
    return parser


def postprocess_odc_args(args: argparse.Namespace) -> argparse.Namespace:
    """Apply ``--dp-backend`` to Megatron-LM's parsed args (before ``validate_args``).

    ``odc`` and ``fsdp`` (the same engine over the lockstep collective transport, the ZeRO-3
    baseline) set ``calculate_per_token_loss`` and ``tp_only_amax_red``, keep the distributed
    optimizer and the ``overlap_*`` options off and resolve ``--balance`` (default ``lb_mini`` for
    odc, ``lb_micro`` for fsdp; ``none`` when ``--micro-batch-size`` is not 1). ``ddp`` / ``distopt``
    set Megatron-LM's own flags. ``None`` leaves everything as parsed.

    Raises:
        ValueError: a flag that does not combine with the chosen backend, named.
    """
    backend = getattr(args, "dp_backend", None)
    if backend is None:
        return args
    if backend in ("ddp", "distopt"):
        for attr, flag in (
            ("use_megatron_fsdp", "--use-megatron-fsdp"),
            ("use_torch_fsdp2", "--use-torch-fsdp2"),
        ) + (
            (("use_distributed_optimizer", "--use-distributed-optimizer"),)
            if backend == "ddp"
            else ()
        ):
            if getattr(args, attr, False):
                raise ValueError(f"--dp-backend {backend} does not combine with {flag}")
        args.use_distributed_optimizer = backend == "distopt"
        return args
    refusals = (
        ("pipeline_model_parallel_size", "--pipeline-model-parallel-size > 1"),
        ("use_megatron_fsdp", "--use-megatron-fsdp"),
        ("use_torch_fsdp2", "--use-torch-fsdp2"),
        ("use_distributed_optimizer", "--use-distributed-optimizer"),
        ("overlap_grad_reduce", "--overlap-grad-reduce"),
        ("overlap_param_gather", "--overlap-param-gather"),
    )
    for attr, flag in refusals:
        value = getattr(args, attr, None)
        if (value > 1) if attr == "pipeline_model_parallel_size" else bool(value):
            raise ValueError(f"--dp-backend {backend} does not combine with {flag}")
    ckpt_format = getattr(args, "ckpt_format", "torch_dist")
    for attr in ("save", "load", "pretrained_checkpoint"):
        if getattr(args, attr, None) and ckpt_format != "torch_dist":
            flag = "--" + attr.replace("_", "-")
            raise ValueError(
                f"{flag} with --dp-backend {backend} needs --ckpt-format torch_dist "
                f"(got {ckpt_format}): ODC saves each DP rank's owned slices"
            )
    if backend == "fsdp":
        if args.odc_transport not in (None, "collective"):
            raise ValueError(
                f"--dp-backend fsdp is the collective transport; --odc-transport "
                f"{args.odc_transport} needs --dp-backend odc"
            )
        args.odc_transport = "collective"
        if args.balance not in (None, "none", "lb_micro"):
            raise ValueError(
                f"--dp-backend fsdp runs in lockstep and needs equal microbatch counts: "
                f"--balance {args.balance} is not allowed (use lb_micro or none)"
            )
    if args.balance is None:
        simple = args.micro_batch_size == 1 and args.dataloader_type in (None, "single")
        args.balance = ("lb_micro" if backend == "fsdp" else "lb_mini") if simple else "none"
    if args.balance != "none":
        if args.micro_batch_size != 1:
            raise ValueError(
                f"--balance {args.balance} with --dp-backend {backend} needs --micro-batch-size 1 "
                f"(got {args.micro_batch_size}); pass --balance none to keep Megatron-LM's sampler"
            )
        if args.dataloader_type not in (None, "single"):
            raise ValueError(
                f"--balance {args.balance} needs --dataloader-type single "
                f"(got {args.dataloader_type})"
            )
        cap = args.seq_length * args.micro_batch_size
        if args.max_tokens_per_microbatch not in (None, cap):
            raise ValueError(
                f"--max-tokens-per-microbatch {args.max_tokens_per_microbatch}: Megatron-LM's "
                f"microbatches are [micro_batch_size, seq_length], so it must be {cap}"
            )
    args.calculate_per_token_loss = True
    args.tp_only_amax_red = True
    _check_te_and_fp8_args(args)
    args.use_distributed_optimizer = False
    args.overlap_grad_reduce = False
    args.overlap_param_gather = False
    return args


def _check_te_and_fp8_args(args: argparse.Namespace) -> None:
    """Refuse TE / FP8 flags ODC cannot run, at parse time rather than when the model is built.

    Megatron-LM's ``--fp8-format`` is stored as ``args.fp8``. FP8 parameters need TE layers; TE layers
    (Megatron-LM's default ``--transformer-impl``) and FP8 need an importable TransformerEngine
    (:func:`megatron_odc.fp8.check_te_request`); and the recipe rules of
    :func:`megatron_odc.fp8.check_fp8_recipe` apply (``OdcDataParallel`` applies them again to the
    model config). Unlike the plugin entry, FP8 compute with ``--transformer-impl local`` is left to
    Megatron-LM.
    """
    from megatron_odc.core.fp8 import check_fp8_recipe, check_te_request

    fp8 = getattr(args, "fp8", None)
    fp8_param = bool(getattr(args, "fp8_param_gather", False))
    impl = getattr(args, "transformer_impl", "transformer_engine")
    if fp8_param and fp8 and impl != "transformer_engine":
        raise ValueError(
            f"--fp8-param-gather needs --transformer-impl transformer_engine (got {impl}): FP8 "
            "parameters are TransformerEngine Float8Tensors"
        )
    recipe = getattr(args, "fp8_recipe", "delayed")
    check_fp8_recipe(
        argparse.Namespace(
            fp8=fp8, fp8_recipe=recipe, tp_only_amax_red=args.tp_only_amax_red, fp8_param=fp8_param
        )
    )
    check_te_request(transformer_impl=impl, fp8=fp8, fp8_param=fp8_param)


def _wrap_validate_args(original: Callable) -> Callable:
    """``validate_args`` that lets ``--fp8-param-gather`` through for the ODC engine's backends.

    ``core_v0.16.1`` asserts the flag needs its distributed optimizer (the only optimizer of its own
    that re-quantises FP8 parameters from sharded masters) unless grad mode is off, its escape for
    inference. ``OdcOptimizer`` does that re-quantisation for ODC, so for ``--dp-backend odc`` /
    ``fsdp`` with the flag set, validation runs under ``torch.no_grad()``: the assertion is the only
    place ``validate_args`` reads grad mode, and the flag itself is never touched (Megatron-LM prints it
    and ``core_transformer_config_from_args`` turns it into ``fp8_param``).
    """

    @functools.wraps(original)
    def validate_args(args, defaults={}):  # noqa: B006 - Megatron-LM's own signature and default
        backend = getattr(args, "dp_backend", None)
        if backend not in ODC_ENGINE_BACKENDS or not getattr(args, "fp8_param_gather", False):
            return original(args, defaults)
        with torch.no_grad():
            result = original(args, defaults)
        logger.info(
            "--fp8-param-gather with --dp-backend %s: ODC shards, fetches and re-quantises the FP8 "
            "parameters (Megatron-LM's distributed-optimizer requirement does not apply)",
            backend,
        )
        return result

    validate_args.__megatron_odc_original__ = original
    return validate_args


# --------------------------------------------------------------------------- version guard


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
                "(docs/megatron_lm.md)"
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
            f"megatron_odc.patches.megatron_lm supports Megatron-LM {SUPPORTED_MEGATRON_LM_TAG} only: "
            + "; ".join(problems)
            + f". Set {SKIP_VERSION_CHECK_ENV}=1 to try anyway."
        )
    for problem in problems:
        logger.warning("version check skipped: %s", problem)
    return version


# --------------------------------------------------------------------------- replacements


def _wrap_parse_args(original: Callable) -> Callable:
    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return add_odc_args(parser)

        return postprocess_odc_args(original(provider, ignore_unknown_args))

    parse_args.__megatron_odc_original__ = original
    return parse_args


def odc_config_from(ddp_config: Any, args: argparse.Namespace) -> Any:
    """An ``OdcConfig`` with every field of ``ddp_config`` plus the ``--odc-*`` flags that were set."""
    from megatron_odc.mcore.data_parallel import OdcConfig

    kwargs = {f.name: getattr(ddp_config, f.name) for f in dataclasses.fields(ddp_config) if f.init}
    for name in (
        "odc_transport",
        "odc_bucket_size",
        "odc_alignment",
        "odc_timeout_s",
        "odc_cuda_accumulate",
        "odc_pushes_in_flight",
    ):
        value = getattr(args, name, None)
        if value is not None:
            kwargs[name] = value
    kwargs["odc_prefetch"] = getattr(args, "odc_prefetch", True)
    return OdcConfig(**kwargs)


def _wrap_get_model(original: Callable, training: Any) -> Callable:
    @functools.wraps(original)
    def get_model(*args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        if getattr(margs, "dp_backend", None) not in ODC_ENGINE_BACKENDS:
            return original(*args, **kwargs)
        from megatron_odc.mcore.data_parallel import OdcDataParallel

        def odc_ddp(config, ddp_config, module, disable_bucketing=False, **extra):
            return OdcDataParallel(
                config, odc_config_from(ddp_config, margs), module, disable_bucketing, **extra
            )

        saved = training.DDP
        training.DDP = odc_ddp
        try:
            model = original(*args, **kwargs)
        finally:
            training.DDP = saved
        wrapped = [c for c in model if isinstance(c, OdcDataParallel)]
        from megatron_odc.runner.checkpoint import install_megatron_lm_checkpointing

        for chunk in wrapped:
            install_megatron_lm_checkpointing(chunk)
        if wrapped:
            logger.info(
                "--dp-backend %s: %d model chunk(s) wrapped in OdcDataParallel (transport %s)",
                margs.dp_backend,
                len(wrapped),
                wrapped[0].transport_name,
            )
        return model

    get_model.__megatron_odc_original__ = original
    return get_model


class OdcChainedOptimizer(ChainedOptimizer):
    """``ChainedOptimizer`` over one ``OdcOptimizer`` whose ``step`` is the ODC optimizer's own.

    ``ChainedOptimizer.step`` clips through ``clip_grad_by_total_norm_fp32``, which asserts CUDA grads;
    ``OdcOptimizer.step`` does the same unscale / norm / clip / count / step over its owned shards.
    """

    def step(self):
        """One optimizer step; returns ``(update_successful, grad_norm, num_zeros_in_grad)``."""
        (optimizer,) = self.chained_optimizers
        return optimizer.step()


def _wrap_get_megatron_optimizer(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_megatron_optimizer(config, model_chunks, config_overrides=None, *args, **kwargs):
        from megatron_odc.mcore.data_parallel import OdcDataParallel
        from megatron_odc.mcore.optimizer import OdcOptimizer

        is_odc = [isinstance(chunk, OdcDataParallel) for chunk in model_chunks]
        if not any(is_odc):
            return original(config, model_chunks, config_overrides, *args, **kwargs)
        if not all(is_odc):
            raise ValueError("some model chunks are OdcDataParallel and some are not")
        optimizer = OdcOptimizer(config, list(model_chunks), config_overrides)
        from megatron_odc.runner.checkpoint import install_megatron_lm_checkpointing

        for chunk in model_chunks:  # a weights-only load refreshes this optimizer's main shards
            install_megatron_lm_checkpointing(chunk, optimizer)
        logger.info("optimizer: ChainedOptimizer([OdcOptimizer(%s)])", config.optimizer)
        return OdcChainedOptimizer([optimizer])

    get_megatron_optimizer.__megatron_odc_original__ = original
    return get_megatron_optimizer


def _count_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class PlannedCountSchedule:
    """Wraps a megatron-core forward-backward function to run this rank's planned microbatch count.

    Applies to training calls (``forward_only=False``) on ``OdcDataParallel`` chunks; anything else is
    passed through. The count comes from ``data_iterator.iterable.next_num_microbatches()`` (or the
    iterator's own method) when offered, else the caller's ``num_microbatches``; with TP > 1 it is
    broadcast from the TP source rank (the only one with data). During a rerun replay the last count
    is reused.

    Args:
        inner: the schedule from megatron-core's ``get_forward_backward_func``.
    """

    def __init__(self, inner: Callable) -> None:
        self.inner = inner
        self.loss_keys: tuple[str, ...] = DEFAULT_LOSS_KEYS
        self.last_num_microbatches: int | None = None

    def planned_count(self, data_iterator: Any, default: int) -> int:
        """This rank's microbatch count for the next step (a collective over TP when TP > 1)."""
        if getattr(data_iterator, "replaying", False) and self.last_num_microbatches is not None:
            return self.last_num_microbatches
        source = data_iterator
        if source is not None and not hasattr(source, "next_num_microbatches"):
            source = getattr(source, "iterable", None)
        count = default
        if source is not None and hasattr(source, "next_num_microbatches"):
            count = int(source.next_num_microbatches())
        from megatron.core import parallel_state

        if (
            parallel_state.model_parallel_is_initialized()
            and parallel_state.get_tensor_model_parallel_world_size() > 1
        ):
            buf = torch.tensor([count], dtype=torch.int64, device=_count_device())
            torch.distributed.broadcast(
                buf,
                parallel_state.get_tensor_model_parallel_src_rank(),
                group=parallel_state.get_tensor_model_parallel_group(),
            )
            count = int(buf.item())
        self.last_num_microbatches = count
        return count

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, **kwargs):
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.utils import get_model_config

        from megatron_odc.mcore.data_parallel import OdcDataParallel

        chunks = model if isinstance(model, list) else [model]
        if kwargs.get("forward_only", False) or not all(
            isinstance(c, OdcDataParallel) for c in chunks
        ):
            return self.inner(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=num_microbatches,
                **kwargs,
            )
        count = self.planned_count(data_iterator, num_microbatches)
        if count > 0:
            losses = self.inner(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=count,
                **kwargs,
            )
            if losses and isinstance(losses[0], dict):
                self.loss_keys = tuple(losses[0])
            return losses
        config = get_model_config(chunks[0])
        finalize = config.finalize_model_grads_func or finalize_model_grads
        device = _count_device()
        finalize(chunks, torch.zeros([], dtype=torch.int, device=device))
        return [{key: torch.zeros(2, device=device) for key in self.loss_keys}]


def _wrap_get_forward_backward_func(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        return PlannedCountSchedule(original(*args, **kwargs))

    get_forward_backward_func.__megatron_odc_original__ = original
    return get_forward_backward_func


# --------------------------------------------------------------------------- balanced data


class BalancedPretrainingLoader:
    """This DP rank's microbatches of every global batch of a Megatron-LM dataset, planned per batch.

    Global batch ``i`` is samples ``[i * global_batch_size, (i + 1) * global_batch_size)`` in dataset
    order (like Megatron-LM's ``single`` sampler); its plan is :meth:`LengthBalancedSampler.assignment`
    over the sample lengths (every sample is ``seq_length`` tokens: a Megatron-LM GPT sample is a fixed
    pack). Iterating yields an iterator whose ``next_num_microbatches()`` starts the next global batch
    and returns this rank's count; ``next()`` then returns its collated microbatches one by one.

    Args:
        dataset: a map-style dataset of sample dicts.
        consumed_samples: samples already trained on (a multiple of ``global_batch_size``).
        global_batch_size: samples per step over all DP ranks.
        dp_rank: this DP rank.
        dp_size: number of DP ranks.
        seq_length: tokens per sample.
        plan_kind: one of ``PLAN_KINDS``.
    """

    def __init__(
        self,
        dataset: Any,
        consumed_samples: int,
        *,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seq_length: int,
        plan_kind: str = "lb_mini",
    ) -> None:
        if consumed_samples % global_batch_size:
            raise ValueError(
                f"consumed_samples {consumed_samples} is not a multiple of --global-batch-size "
                f"{global_batch_size}"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seq_length = seq_length
        self.plan_kind = plan_kind
        self.num_global_batches = len(dataset) // global_batch_size
        self.start_index = consumed_samples // global_batch_size

    def rank_microbatches(self, index: int) -> tuple[tuple[int, ...], ...]:
        """This rank's microbatches (dataset indices) of global batch ``index``.

        The plan covers one global batch at a time, so the cost does not grow with the dataset.
        """
        from megatron_odc.data.sampler import LengthBalancedSampler

        sampler = LengthBalancedSampler(
            [self.seq_length] * self.global_batch_size,
            global_batch_size=self.global_batch_size,
            dp_size=self.dp_size,
            dp_rank=self.dp_rank,
            plan_kind=self.plan_kind,
            cap_tokens=self.seq_length,
            shuffle=False,
        )
        offset = index * self.global_batch_size
        microbatches = sampler.assignment(0, 0).microbatches
        return tuple(tuple(offset + i for i in mb) for mb in microbatches)

    def __iter__(self) -> _BalancedIterator:
        return _BalancedIterator(self, self.start_index)


class _BalancedIterator(Iterator):
    def __init__(self, loader: BalancedPretrainingLoader, index: int) -> None:
        self.loader = loader
        self.index = index
        self.pending: list[tuple[int, ...]] = []

    def next_num_microbatches(self) -> int:
        if self.pending:
            raise RuntimeError(
                f"{len(self.pending)} microbatches of the last step were not consumed"
            )
        if self.index >= self.loader.num_global_batches:
            raise StopIteration
        self.pending = list(self.loader.rank_microbatches(self.index))
        self.index += 1
        return len(self.pending)

    def __next__(self) -> Any:
        if not self.pending:
            self.next_num_microbatches()
            if not self.pending:
                raise RuntimeError("this rank has no microbatch in this step; ask the count first")
        sample_ids = self.pending.pop(0)
        return torch.utils.data.default_collate([self.loader.dataset[i] for i in sample_ids])


def _wrap_build_pretraining_data_loader(original: Callable) -> Callable:
    @functools.wraps(original)
    def build_pretraining_data_loader(dataset, consumed_samples):
        from megatron.core import mpu
        from megatron.core.datasets.utils import Split
        from megatron.training import get_args

        args = get_args()
        split = getattr(dataset, "index_split", getattr(dataset, "split", None))
        if (
            dataset is None
            or getattr(args, "dp_backend", None) not in ODC_ENGINE_BACKENDS
            or args.balance == "none"
            or split != Split.train
        ):
            return original(dataset, consumed_samples)
        logger.info(
            "train split: BalancedPretrainingLoader (--balance %s, %d samples)",
            args.balance,
            len(dataset),
        )
        return BalancedPretrainingLoader(
            dataset,
            consumed_samples,
            global_batch_size=args.global_batch_size,
            dp_rank=mpu.get_data_parallel_rank(),
            dp_size=mpu.get_data_parallel_world_size(),
            seq_length=args.seq_length,
            plan_kind=args.balance,
        )

    build_pretraining_data_loader.__megatron_odc_original__ = original
    return build_pretraining_data_loader


# --------------------------------------------------------------------------- CPU shims (item 9)


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU: every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _CpuStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@dataclasses.dataclass
class _CpuDeviceProperties:
    name: str = "cpu"
    major: int = 9
    minor: int = 0
    total_memory: int = 0
    multi_processor_count: int = 1


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


# --------------------------------------------------------------------------- handle


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
            from megatron_odc.integration.cpu import apply_cpu_patches, cuda_type_names

            handle.cpu_patches = apply_cpu_patches()
            # Megatron's own optimizers (the ddp / distopt baselines) check param.type() at
            # construction and in every clip: the whole run is the scope here.
            handle._scoped.enter_context(cuda_type_names())
            cuda = torch.cuda
            handle._patch(cuda, "is_available", lambda: True)
            handle._patch(cuda, "device_count", lambda: 1)
            handle._patch(cuda, "set_device", _noop)
            handle._patch(cuda, "get_device_properties", lambda *a, **k: _CpuDeviceProperties())
            handle._patch(cuda, "get_device_capability", lambda *a, **k: (9, 0))
            handle._patch(cuda, "Stream", _CpuStream)
            handle._patch(cuda, "stream", lambda *a, **k: _CpuStream())
            handle._patch(cuda, "current_stream", lambda *a, **k: _CpuStream())
            handle._patch(initialize, "set_jit_fusion_options", _noop)
            handle._patch(training, "set_jit_fusion_options", _noop)
            handle._patch(initialize, "_compile_dependencies", _noop)
        wrapped_parse = _wrap_parse_args(arguments.parse_args)
        handle._patch(arguments, "parse_args", wrapped_parse)
        handle._patch(initialize, "parse_args", _wrap_parse_args(initialize.parse_args))
        handle._patch(arguments, "validate_args", _wrap_validate_args(arguments.validate_args))
        handle._patch(initialize, "validate_args", _wrap_validate_args(initialize.validate_args))
        handle._patch(training, "get_model", _wrap_get_model(training.get_model, training))
        handle._patch(
            training,
            "get_megatron_optimizer",
            _wrap_get_megatron_optimizer(training.get_megatron_optimizer),
        )
        handle._patch(
            training,
            "get_forward_backward_func",
            _wrap_get_forward_backward_func(training.get_forward_backward_func),
        )
        handle._patch(
            training,
            "build_pretraining_data_loader",
            _wrap_build_pretraining_data_loader(training.build_pretraining_data_loader),
        )
    except BaseException:
        handle.revert()
        raise
    logger.info("applied %d Megatron-LM patches", len(handle.patched))
    return handle
