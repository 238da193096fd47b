"""Training entry ``python -m megatron_odc.train`` (run under torchrun): a megatron-core GPT with ODC.

Owns the training loop of the CLI: process groups, the model and its data-parallel backend
(:func:`megatron_odc.backends.build_backend`), Megatron's ``OptimizerParamScheduler``, the SFT data
pipeline (length-balanced sampler, one packed sequence per microbatch, per-token loss), Megatron-style
log lines, and the calls into :mod:`megatron_odc.checkpoint` for ``--save`` / ``--load``. Flags and their
checks live in :mod:`megatron_odc.arguments`.

``torchrun --nproc-per-node 2 -m megatron_odc.train`` with no other flag trains a tiny GPT on CPU (gloo, the
CPU patches applied) on a synthetic SFT set it writes once into ``./runs/cpu-default/`` (or
``<--save>/data/``): ODC backend, LB-Mini balancing, byte-level tokenizer. ``--sft --data-path F.jsonl``
trains on a JSONL file; ``--data-path PREFIX...`` without ``--sft`` pretrains on Megatron indexed datasets
(megatron-core's ``GPTDataset``, one ``--seq-length`` sample per microbatch).

[Note: one training iteration]
Every DP rank computes the same plan for the minibatch (no communication) and takes its own microbatches;
DP rank and size come from megatron's ``parallel_state``, so the TP ranks of one DP replica get the same
microbatches. Each microbatch is packed into one sequence (samples separated by a block-diagonal causal
mask, position ids restarting per sample, padded to a multiple of 8 and never beyond ``--seq-length``).
The loss function returns token *sums*; ``finalize_model_grads`` all-reduces the token count over DP and
divides the gradients by it, so the update is the exact global per-token mean whatever the split.
The logged ``lm loss`` is the same global mean: the ``[loss_sum, num_tokens]`` pairs of the iterations
since the last log line are all-reduced over DP when the line is written.

[Note: bitwise resume]
A checkpoint's ``extra_state`` holds the sampler position, the scheduler state, the consumed samples
and the RNG states of every rank (python ``random``, torch CPU, CUDA when present, and megatron's
tensor-parallel RNG tracker), gathered so that each rank gets its own back whatever the checkpoint
layer keeps. Restored after the model, optimizer and data are built, the next iteration sees exactly the
state the uninterrupted run saw.
"""

# ruff: noqa: E402  (the warnings filter below must precede the megatron imports)
from __future__ import annotations

import warnings

# megatron-core warns once per module at import that TransformerEngine / Apex are missing and it falls
# back to torch implementations: the expected setup on CPU, and 12 lines of noise per launch.
warnings.filterwarnings(
    "ignore",
    message=r"(Transformer Engine and Apex are|Apex is) not installed",
    category=UserWarning,
)
# TransformerConfig warns about its own default cuda_graph_scope on every construction.
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)

import argparse
import dataclasses
import datetime
import functools
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_odc.balance import CostModel
from megatron_odc.data import (
    LengthBalancedSampler,
    MinibatchAssignment,
    SFTDataset,
    load_microbatch,
    load_tokenizer,
    make_synthetic_sft,
    pack_microbatch,
)
from megatron_odc.integration.cpu import active_cpu_patches, apply_cpu_patches
from megatron_odc.mcore.backends import build_backend
from megatron_odc.mcore.model import GPTConfig, build_gpt_model, transformer_config
from megatron_odc.mcore.step import train_step
from megatron_odc.runner.arguments import build_parser, validate_args

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = os.path.join("runs", "cpu-default")
"""Where the built-in synthetic SFT set is written when neither --data-path nor --save is given."""
PAD_MULTIPLE = 8
"""Packed microbatches are padded to a multiple of this (times the TP size under sequence parallel)."""
_LOG_HANDLER_NAME = "megatron_odc.train"


@dataclasses.dataclass
class TrainResult:
    """What a training run did, as seen by this rank.

    Attributes:
        start_iteration: iteration the run started from (0, or the loaded checkpoint's).
        iteration: iteration reached at the end.
        losses: iteration -> global per-token mean lm loss of that iteration (every rank has them).
        grad_norms: iteration -> global gradient norm before clipping.
        elapsed_s: wall time of the training loop.
        num_tokens: tokens of every sample trained on in this run, all ranks.
    """

    start_iteration: int
    iteration: int
    losses: dict[int, float]
    grad_norms: dict[int, float]
    elapsed_s: float
    num_tokens: int

    @property
    def final_loss(self) -> float | None:
        """Loss of the last iteration trained in this run, or None when none was."""
        return self.losses[max(self.losses)] if self.losses else None


# Setup #


def _setup_logging(rank: int) -> None:
    """Rank 0 logs INFO from ``megatron_odc`` to stdout; other ranks only warnings."""
    package = logging.getLogger("megatron_odc")
    if not any(h.name == _LOG_HANDLER_NAME for h in package.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.name = _LOG_HANDLER_NAME
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
        package.addHandler(handler)
        package.propagate = False
    package.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # The training log line carries the ODC telemetry; the wrapper's own line would repeat it.
    logging.getLogger("megatron_odc.data_parallel").setLevel(logging.WARNING)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _padded_vocab_size(args: argparse.Namespace, tokenizer_vocab_size: int) -> int:
    if args.vocab_size is not None:
        if args.vocab_size < tokenizer_vocab_size:
            raise ValueError(
                f"--vocab-size {args.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({tokenizer_vocab_size} ids)"
            )
        return args.vocab_size
    # Megatron-LM pads to a multiple of divisible_by * TP, so the padded size (and the checkpoint's
    # embedding shape) changes with TP; lcm keeps it the same for every TP size dividing divisible_by.
    multiple = math.lcm(args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    return _round_up(tokenizer_vocab_size, multiple)


def _synthetic_data_path(args: argparse.Namespace) -> str:
    """Writes the built-in synthetic SFT set once (local rank 0 of each node) and returns its path."""
    cache_dir = os.path.join(args.save, "data") if args.save else DEFAULT_CACHE_DIR
    name = f"synthetic_sft_n{args.synthetic_num_samples}_seed{args.seed}_len{args.seq_length}.jsonl"
    path = os.path.join(cache_dir, name)
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if local_rank == 0 and not os.path.isfile(path):
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        make_synthetic_sft(
            tmp,
            args.synthetic_num_samples,
            seed=args.seed,
            max_tokens=args.seq_length,
            min_tokens=min(8, args.seq_length),
        )
        os.replace(tmp, path)
        logger.info("wrote the synthetic SFT set %s", path)
    dist.barrier()
    return path


def _build_model(args: argparse.Namespace, vocab_size: int, device: torch.device) -> Any:
    """Builds the GPT (local or TransformerEngine spec), on ``device``, wrapped for bf16/fp16."""
    params_dtype = torch.float32
    if args.bf16:
        params_dtype = torch.bfloat16
    elif args.fp16:
        params_dtype = torch.float16
    cfg = GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=vocab_size,
        seq_length=args.max_position_embeddings,
        params_dtype=params_dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        sequence_parallel=args.sequence_parallel,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        normalization=args.normalization,
        init_method_std=args.init_method_std,
        calculate_per_token_loss=args.calculate_per_token_loss,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        swiglu=args.swiglu,
        add_bias_linear=not args.disable_bias_linear,
    )
    if args.transformer_impl == "local":
        model = build_gpt_model(cfg, seed=args.seed)
    else:  # TransformerEngine spec; validate_args made sure TE is importable.
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)
        torch.manual_seed(args.seed)
        config = transformer_config(cfg)
        if args.fp8_format is not None:
            # Delayed scaling's amax all-reduce must not span DP: ranks run different counts.
            # FP8 parameters (--fp8-param-gather) are built by the TE layers under fp8_model_init.
            config = dataclasses.replace(
                config,
                fp8=args.fp8_format,
                fp8_recipe=args.fp8_recipe,
                fp8_param=args.fp8_param_gather,
                tp_only_amax_red=True,
            )
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(
                normalization=cfg.normalization
            ),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length,
            share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
            position_embedding_type=cfg.position_embedding_type,
        )
    model = model.to(device)
    if args.bf16 or args.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    return model


def _optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
    )


def _scheduler(args: argparse.Namespace, optimizer: Any) -> OptimizerParamScheduler:
    """Megatron's scheduler, counted in samples like Megatron-LM (iterations * global batch size)."""
    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )


# Data #


def _next_minibatch(sampler: LengthBalancedSampler) -> MinibatchAssignment:
    """This rank's next minibatch, moving to the next epoch when the current one is used up."""
    assignment = next(iter(sampler), None)
    if assignment is None:
        sampler.set_epoch(sampler.epoch + 1)
        assignment = next(iter(sampler))
    return assignment


def pack_assignment(
    assignment: MinibatchAssignment,
    dataset: SFTDataset,
    *,
    pad_id: int,
    seq_length: int,
    pad_multiple: int,
    device: torch.device,
) -> list[dict[str, torch.Tensor]]:
    """Packs each of this rank's microbatches into one ``[1, T]`` sequence for the GPT forward.

    ``T`` is the packed length rounded up to ``pad_multiple`` and never beyond ``seq_length``; an empty
    microbatch (``lb_micro`` may plan one so that lockstep counts match) becomes ``pad_multiple`` padding
    tokens with no loss.

    Returns:
        One dict per microbatch: ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` and the
        block-diagonal causal ``attention_mask`` (bool ``[1, 1, T, T]``, True = masked out).
    """
    batches = []
    for sample_ids in assignment.microbatches:
        samples = load_microbatch(dataset, sample_ids, assignment.plan.lengths)
        num_tokens = sum(len(s) for s in samples)
        if num_tokens > seq_length:
            raise ValueError(
                f"microbatch {sample_ids} holds {num_tokens} tokens, more than --seq-length "
                f"{seq_length}; lower --max-tokens-per-microbatch"
            )
        pad_to = min(_round_up(max(num_tokens, 1), pad_multiple), seq_length)
        packed = pack_microbatch(samples, pad_to=pad_to, pad_id=pad_id)
        batches.append(
            {
                "tokens": packed.tokens.to(device),
                "labels": packed.labels.to(device),
                "loss_mask": packed.loss_mask.to(device),
                "position_ids": packed.position_ids.to(device),
                "attention_mask": packed.attention_mask().to(device),
            }
        )
    return batches


class _DatasetTokenizer:
    """What megatron-core's GPTDataset reads off a tokenizer: ``vocab_size``, ``eod``, ``pad``, and
    ``unique_identifiers`` (hashed into the names of its index caches)."""

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eos_id
        self.pad = tokenizer.pad_id
        hf = getattr(tokenizer, "hf", None)
        self.unique_identifiers = {
            "class": type(tokenizer).__name__,
            "name_or_path": str(getattr(hf, "name_or_path", "")),
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "pad": self.pad,
        }


def _pretraining_dataset(args: argparse.Namespace, tokenizer: Any) -> Any:
    """The train split of megatron-core's GPTDataset over ``--data-path`` (Megatron indexed data).

    Built on every rank (rank 0 first writes the index caches, the others then read them), with as
    many samples as ``--train-iters`` iterations of ``--global-batch-size`` consume.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=get_blend_from_list(args.data_path),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=_DatasetTokenizer(tokenizer),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,
    )
    num_samples = args.train_iters * args.global_batch_size
    train_ds, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, None, None], lambda: True, config
    ).build()
    if train_ds is None:
        raise ValueError(f"--data-path / --split {args.split!r}: the train split is empty")
    return train_ds


def _pretraining_batches(
    assignment: MinibatchAssignment, *, dataset: Any, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """One GPTDataset sample (``--seq-length`` tokens, causal mask) per microbatch.

    An empty microbatch (``lb_micro`` plans one when a minibatch has fewer samples than lockstep
    slots) runs the minibatch's first sample with no loss.
    """
    batches = []
    for sample_ids in assignment.microbatches:
        if len(sample_ids) > 1:
            raise ValueError(
                f"pretraining microbatch {sample_ids} holds {len(sample_ids)} samples; each "
                "microbatch must be exactly one --seq-length sample"
            )
        sample = dict(dataset[sample_ids[0] if sample_ids else assignment.global_sample_ids[0]])
        if not sample_ids:
            sample["loss_mask"] = torch.zeros_like(sample["loss_mask"])
        batches.append(
            {
                "tokens": sample["tokens"].unsqueeze(0).to(device),
                "labels": sample["labels"].unsqueeze(0).to(device),
                "loss_mask": sample["loss_mask"].unsqueeze(0).to(device),
                "position_ids": sample["position_ids"].unsqueeze(0).to(device),
                "attention_mask": sample["attention_mask"]
                .view(1, 1, *sample["attention_mask"].shape[-2:])
                .to(device),
            }
        )
    return batches


def per_token_loss(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's 3-tuple loss: (token-loss sum, loss-token count, report ``[sum, count]``)."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    """Megatron ``forward_step_func``: GPT forward on one packed microbatch with per-token losses."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, functools.partial(per_token_loss, batch["loss_mask"])


# Checkpoint state #


def _rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "torch_cpu": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch_cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def _extra_state(
    sampler: LengthBalancedSampler, scheduler: OptimizerParamScheduler, iteration: int, gbs: int
) -> dict[str, Any]:
    """The non-tensor training state of a checkpoint (collective: gathers every rank's RNG state)."""
    rng_states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rng_states, _rng_state())
    return {
        "sampler": sampler.state_dict(),
        "scheduler": scheduler.state_dict(),
        "consumed_samples": iteration * gbs,
        "world_size": dist.get_world_size(),
        "rng_states": rng_states,
    }


def _restore_extra_state(
    extra: dict[str, Any], sampler: LengthBalancedSampler, scheduler: OptimizerParamScheduler
) -> None:
    for key in ("sampler", "scheduler", "rng_states", "world_size"):
        if key not in extra:
            raise ValueError(f"--load: the checkpoint's extra state has no {key!r} entry")
    sampler.load_state_dict(extra["sampler"])
    scheduler.load_state_dict(extra["scheduler"])
    if extra["world_size"] == dist.get_world_size():
        _set_rng_state(extra["rng_states"][dist.get_rank()])
    else:
        logger.warning(
            "checkpoint saved with %d ranks, loading on %d: RNG states are not restored, so "
            "dropout draws differ from the uninterrupted run",
            extra["world_size"],
            dist.get_world_size(),
        )


# Logging #


def _format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))


def _log_line(
    *,
    args: argparse.Namespace,
    iteration: int,
    interval_pairs: torch.Tensor,
    interval: dict[str, Any],
    lr: float,
    grad_norm: float | None,
    telemetry: dict[str, float] | None,
    eta_s: float,
) -> str:
    num_iters = interval["num_iters"]
    loss_sum, num_tokens = (float(x) for x in interval_pairs.sum(dim=0))
    loss = loss_sum / num_tokens if num_tokens > 0 else float("nan")
    elapsed_ms = 1000.0 * interval["elapsed_s"] / num_iters
    tokens_per_s = interval["num_tokens"] / interval["elapsed_s"] if interval["elapsed_s"] else 0.0
    parts = [
        f"iteration {iteration:8d}/{args.train_iters:8d}",
        f"consumed samples: {iteration * args.global_batch_size:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
        f"learning rate: {lr:.6E}",
        f"global batch size: {args.global_batch_size:5d}",
        f"lm loss: {loss:.6E}",
        f"grad norm: {grad_norm:.3f}" if grad_norm is not None else "grad norm: n/a",
        f"tokens/s: {tokens_per_s:.0f}",
        f"num microbatches min/max: {interval['min_microbatches']}/{interval['max_microbatches']}",
        f"number of skipped iterations: {interval['num_skipped']:3d}",
    ]
    if telemetry is not None:
        parts.append(f"odc compute imbalance: {telemetry['compute_imbalance']:.2f}x")
        parts.append(
            "fetch/push/fence wait max/mean (ms): "
            f"{1000 * telemetry['fetch_wait_s_max']:.1f}/{1000 * telemetry['fetch_wait_s_mean']:.1f}, "
            f"{1000 * telemetry['push_s_max']:.1f}/{1000 * telemetry['push_s_mean']:.1f}, "
            f"{1000 * telemetry['fence_s_max']:.1f}/{1000 * telemetry['fence_s_mean']:.1f}"
        )
    parts.append(f"ETA {_format_eta(eta_s)}")
    return " | ".join(parts)


def _new_interval() -> dict[str, Any]:
    return {
        "num_iters": 0,
        "elapsed_s": 0.0,
        "num_tokens": 0,
        "min_microbatches": None,
        "max_microbatches": None,
        "num_skipped": 0,
        "iterations": [],
        "pairs": [],
        "grad_norms": [],
    }


# Training #


def train(args: argparse.Namespace) -> TrainResult:
    """Runs training for validated ``args`` (see :func:`megatron_odc.arguments.validate_args`).

    Initialises the default process group from torchrun's environment unless one is already up (it is
    then left up), applies the CPU patches when CUDA is absent (reverted at the end unless they were
    already active), and tears megatron's model-parallel state down at the end.

    Returns:
        The :class:`TrainResult` of this rank.
    """
    on_cuda = torch.cuda.is_available()
    patches = None
    if not on_cuda and active_cpu_patches() is None:
        patches = apply_cpu_patches()
    own_process_group = not dist.is_initialized()
    try:
        if own_process_group:
            if on_cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if on_cuda else "gloo")
        _setup_logging(dist.get_rank())
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        )
        try:
            return _train(args, torch.device("cuda") if on_cuda else torch.device("cpu"))
        finally:
            parallel_state.destroy_model_parallel()
    finally:
        if own_process_group and dist.is_initialized():
            dist.destroy_process_group()
        if patches is not None:
            patches.revert()


def _train(args: argparse.Namespace, device: torch.device) -> TrainResult:
    rank = dist.get_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_group = parallel_state.get_data_parallel_group()
    tp_size = args.tensor_model_parallel_size
    random.seed(args.seed)
    logger.info(
        "megatron_odc.train: world %d (DP %d x TP %d) on %s | --dp-backend %s | --balance %s | "
        "%d layers, hidden %d, %d heads, seq %d",
        dist.get_world_size(),
        dp_size,
        tp_size,
        device.type,
        args.dp_backend,
        args.balance,
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        args.seq_length,
    )

    # Data: every rank reads the same samples and plans every minibatch alone.
    tokenizer = load_tokenizer(
        "byte" if args.tokenizer_type == "ByteTokenizer" else args.tokenizer_model
    )
    vocab_size = _padded_vocab_size(args, tokenizer.vocab_size)
    pad_multiple = PAD_MULTIPLE
    if args.sequence_parallel:
        pad_multiple = math.lcm(PAD_MULTIPLE, args.tensor_model_parallel_size)
    if args.sft:
        data_path = args.data_path[0] if args.data_path else _synthetic_data_path(args)
        dataset = SFTDataset(data_path, tokenizer, max_length=args.seq_length)
        lengths: Sequence[int] = dataset.lengths
        build_batches = functools.partial(
            pack_assignment,
            dataset=dataset,
            pad_id=tokenizer.pad_id,
            seq_length=args.seq_length,
            pad_multiple=pad_multiple,
            device=device,
        )
    else:
        data_path = " ".join(args.data_path)
        dataset = _pretraining_dataset(args, tokenizer)
        lengths = [args.seq_length] * len(dataset)
        build_batches = functools.partial(_pretraining_batches, dataset=dataset, device=device)
    if len(lengths) < args.global_batch_size:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is larger than the dataset "
            f"({len(lengths)} samples in {data_path})"
        )
    cost_model = CostModel.from_model_config(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size,
        gated_mlp=args.swiglu,
    )
    sampler = LengthBalancedSampler(
        lengths,
        global_batch_size=args.global_batch_size,
        dp_size=dp_size,
        dp_rank=dp_rank,
        seed=args.seed,
        plan_kind=args.balance,
        cap_tokens=args.max_tokens_per_microbatch,
        cost_model=cost_model,
        too_long="truncate",
        shuffle=args.sft,  # GPTDataset shuffles its samples itself
        drop_last=True,
    )
    logger.info(
        "data (%s): %s, %d samples, %d tokens (longest %d), vocab %d (tokenizer %d)",
        "sft" if args.sft else "pretraining",
        data_path,
        len(lengths),
        sum(lengths),
        max(lengths),
        vocab_size,
        tokenizer.vocab_size,
    )

    model = _build_model(args, vocab_size, device)
    odc_options: dict[str, Any] | None = None
    if args.dp_backend in ("odc", "fsdp"):
        odc_options = {
            "odc_transport": args.odc_transport,
            "odc_cuda_accumulate": args.odc_cuda_accumulate,
        }
        if args.odc_bucket_size is not None:
            odc_options["odc_bucket_size"] = args.odc_bucket_size
    model, optimizer = build_backend(
        args.dp_backend, model, _optimizer_config(args), odc_options=odc_options
    )
    try:
        scheduler = _scheduler(args, optimizer)
        start_iteration = _maybe_load(args, model, optimizer, sampler, scheduler)
        return _loop(
            args,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            sampler=sampler,
            build_batches=build_batches,
            device=device,
            dp_group=dp_group,
            start_iteration=start_iteration,
            is_logging_rank=rank == 0,
        )
    finally:
        close = getattr(model, "close", None)
        if close is not None:
            close()


def _maybe_load(
    args: argparse.Namespace,
    model: Any,
    optimizer: Any,
    sampler: LengthBalancedSampler,
    scheduler: OptimizerParamScheduler,
) -> int:
    """Loads ``--load`` when given; returns the iteration to start from."""
    if args.load is None:
        return 0
    from megatron_odc.runner import checkpoint

    latest = checkpoint.latest_iteration(args.load)
    if latest is None:
        if args.finetune:
            raise ValueError(f"--finetune: no checkpoint found in --load {args.load!r}")
        logger.warning("no checkpoint found in --load %s: training from scratch", args.load)
        return 0
    iteration, extra = checkpoint.load_checkpoint(
        args.load, model, optimizer, finetune=args.finetune
    )
    if args.finetune:
        logger.info("loaded the weights of iteration %d from %s (--finetune)", latest, args.load)
        return 0
    _restore_extra_state(extra, sampler, scheduler)
    logger.info(
        "resumed from %s at iteration %d (%d consumed samples)",
        args.load,
        iteration,
        extra.get("consumed_samples", iteration * args.global_batch_size),
    )
    return iteration


def _save(
    args: argparse.Namespace,
    iteration: int,
    model: Any,
    optimizer: Any,
    sampler: LengthBalancedSampler,
    scheduler: OptimizerParamScheduler,
) -> None:
    from megatron_odc.runner import checkpoint

    start = time.perf_counter()
    extra = _extra_state(sampler, scheduler, iteration, args.global_batch_size)
    checkpoint.save_checkpoint(args.save, iteration, model, optimizer, extra_state=extra)
    logger.info(
        "saved checkpoint at iteration %d to %s (%.2f s)",
        iteration,
        args.save,
        time.perf_counter() - start,
    )


def _current_lr(optimizer: Any) -> float:
    groups: Sequence[dict] = optimizer.param_groups
    for group in groups:
        if group.get("default_config", True):
            return float(group["lr"])
    return float(groups[0]["lr"])


def _loop(
    args: argparse.Namespace,
    *,
    model: Any,
    optimizer: Any,
    scheduler: OptimizerParamScheduler,
    sampler: LengthBalancedSampler,
    build_batches: Callable[[MinibatchAssignment], list[dict[str, torch.Tensor]]],
    device: torch.device,
    dp_group: Any,
    start_iteration: int,
    is_logging_rank: bool,
) -> TrainResult:
    """The iterations from ``start_iteration`` to ``--train-iters``; see [Note: one training iteration]."""
    has_telemetry = hasattr(model, "log_telemetry")
    result = TrainResult(start_iteration, start_iteration, {}, {}, 0.0, 0)
    interval = _new_interval()
    last_saved = start_iteration if args.load is not None and not args.finetune else None
    loop_start = time.perf_counter()
    iteration = start_iteration
    while iteration < args.train_iters:
        iter_start = time.perf_counter()
        assignment = _next_minibatch(sampler)
        counts = assignment.num_microbatches_per_rank
        if args.dp_backend == "fsdp" and len(set(counts)) != 1:
            raise ValueError(
                f"--balance {args.balance} planned unequal microbatch counts {counts}, which "
                "--dp-backend fsdp cannot run"
            )
        batches = build_batches(assignment)
        lr = _current_lr(optimizer)
        report = train_step(
            model,
            optimizer,
            forward_step,
            batches,
            seq_length=max((b["tokens"].shape[1] for b in batches), default=args.seq_length),
            micro_batch_size=1,
        )
        scheduler.step(increment=args.global_batch_size)
        iteration += 1
        if report["losses"]:
            pair = torch.stack([r["lm loss"].double() for r in report["losses"]]).sum(dim=0)
        else:
            pair = torch.zeros(2, dtype=torch.float64)
        grad_norm = report["grad_norm"]
        interval["num_iters"] += 1
        interval["elapsed_s"] += time.perf_counter() - iter_start
        interval["num_tokens"] += sum(assignment.plan.lengths.values())
        if interval["min_microbatches"] is None:
            interval["min_microbatches"], interval["max_microbatches"] = min(counts), max(counts)
        interval["min_microbatches"] = min(interval["min_microbatches"], min(counts))
        interval["max_microbatches"] = max(interval["max_microbatches"], max(counts))
        interval["num_skipped"] += 0 if report["update_successful"] else 1
        interval["iterations"].append(iteration)
        interval["pairs"].append(pair)
        interval["grad_norms"].append(None if grad_norm is None else float(grad_norm))
        result.num_tokens += sum(assignment.plan.lengths.values())

        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            pairs = torch.stack(interval["pairs"]).to(device)
            dist.all_reduce(pairs, group=dp_group)
            pairs = pairs.cpu()
            for it, (loss_sum, num_tokens), norm in zip(
                interval["iterations"], pairs.tolist(), interval["grad_norms"], strict=True
            ):
                result.losses[it] = loss_sum / num_tokens if num_tokens > 0 else float("nan")
                if norm is not None:
                    result.grad_norms[it] = norm
            telemetry = model.log_telemetry() if has_telemetry else None
            elapsed = time.perf_counter() - loop_start
            done = iteration - start_iteration
            eta_s = elapsed / done * (args.train_iters - iteration)
            if is_logging_rank:
                logger.info(
                    _log_line(
                        args=args,
                        iteration=iteration,
                        interval_pairs=pairs,
                        interval=interval,
                        lr=lr,
                        grad_norm=interval["grad_norms"][-1],
                        telemetry=telemetry,
                        eta_s=eta_s,
                    )
                )
            interval = _new_interval()

        if args.save and args.save_interval and iteration % args.save_interval == 0:
            _save(args, iteration, model, optimizer, sampler, scheduler)
            last_saved = iteration
        if args.exit_interval and iteration % args.exit_interval == 0:
            logger.info(
                "exiting at iteration %d (--exit-interval %d)", iteration, args.exit_interval
            )
            break

    if args.save and last_saved != iteration:
        _save(args, iteration, model, optimizer, sampler, scheduler)
    result.iteration = iteration
    result.elapsed_s = time.perf_counter() - loop_start
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Parses and checks ``argv`` (default ``sys.argv[1:]``), trains, and logs a summary.

    Returns:
        The exit status: 0 after training, 2 when a flag is invalid (the message, naming the flag,
        goes to stderr before anything is trained).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    world_size = (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    )
    try:
        validate_args(args, world_size=world_size)
    except ValueError as exc:
        sys.stderr.write(f"{parser.prog}: error: {exc}\n")
        return 2
    result = train(args)
    final = result.final_loss
    first = result.losses[min(result.losses)] if result.losses else None
    logger.info(  # rank 0 only: other ranks log warnings only
        "training finished | iterations %d-%d of %d | first lm loss: %s | final lm loss: %s | "
        "tokens: %d | elapsed: %.1f s",
        result.start_iteration,
        result.iteration,
        args.train_iters,
        f"{first:.6E}" if first is not None else "n/a",
        f"{final:.6E}" if final is not None else "n/a",
        result.num_tokens,
        result.elapsed_s,
    )
    return 0
