"""Command-line arguments of ``python -m megatron_odc.train``: Megatron-LM's flag names plus ODC's flags.

Owns :func:`build_parser` (the argparse parser: Megatron-LM's names and meanings for the flags it shares,
defaults that give a tiny GPT that trains on two CPU cores; ODC's own group comes from
``odc_flags.py``) and :func:`validate_args`, every check that can fail before training starts, one
validator per flag group, each raising ``ValueError`` with a message that names the offending flag.
Imports neither megatron nor a model, so a bad command line fails in about a second.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

from megatron_odc.core.fp8 import FP8_FORMATS, FP8_RECIPES, check_fp8_flags
from megatron_odc.data.indexed_files import check_indexed_dataset
from megatron_odc.data.indexed_sft import is_indexed_sft, sidecar_path
from megatron_odc.mcore.config import check_pipeline_layers
from megatron_odc.runner.launch_env import check_mpi_launch
from megatron_odc.runner.odc_flags import add_odc_arguments, resolve_odc_args
from megatron_odc.runner.tensorboard import require_packages

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
TOKENIZER_TYPES = ("ByteTokenizer", "HuggingFaceTokenizer")
MODEL_SHAPE_DEFAULTS = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "position_embedding_type": "learned_absolute",
    "normalization": "LayerNorm",
    "num_query_groups": 1,
    "norm_epsilon": 1e-5,
    "rotary_base": 10000.0,
}
"""Defaults of the valued model flags that a ``--load-hf`` config also sets. The parser leaves them None,
so a flag the user gave is told from one left unset; :func:`validate_args` fills them."""
DEFAULT_LR_WARMUP_ITERS = 3
DEFAULT_LR_DECAY_RATIO = 10
"""``--min-lr`` when not given is ``--lr`` over this (3e-4 at the default ``--lr`` 3e-3)."""


def build_parser() -> argparse.ArgumentParser:
    """Returns the parser of ``python -m megatron_odc.train``.

    Flags shared with Megatron-LM keep its names and meanings; the defaults describe the built-in tiny
    CPU run (2 layers, hidden 64, 128 tokens, 40 iterations on a generated SFT set).
    """
    parser = argparse.ArgumentParser(
        prog="python -m megatron_odc.train",
        description=(
            "Train a megatron-core GPT with the ODC data-parallel backend (run under torchrun). "
            "With no flags: a tiny GPT on a generated SFT set, on CPU with gloo."
        ),
    )
    model = parser.add_argument_group("model (Megatron-LM flags)")
    model.add_argument(
        "--num-layers", type=int, default=None, help="transformer layers (default 2)"
    )
    model.add_argument("--hidden-size", type=int, default=None, help="model width (default 64)")
    model.add_argument(
        "--ffn-hidden-size", type=int, default=None, help="MLP width (default 4 * hidden size)"
    )
    model.add_argument(
        "--num-attention-heads", type=int, default=None, help="attention heads (default 4)"
    )
    model.add_argument(
        "--seq-length",
        type=int,
        default=128,
        help="maximum tokens of one packed microbatch (samples longer than this are truncated)",
    )
    model.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="size of the position embedding table (default --seq-length)",
    )
    model.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="model vocabulary (default: the tokenizer's, padded by --make-vocab-size-divisible-by)",
    )
    model.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the tokenizer vocabulary to a multiple of lcm(this, TP size) (Megatron-LM: this "
        "times the TP size; lcm keeps the vocabulary, hence checkpoints, the same across TP sizes)",
    )
    model.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="separate input embedding and output layer weights",
    )
    model.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope", "none"),
        default=None,
        help="position embedding type (default learned_absolute)",
    )
    model.add_argument(
        "--normalization",
        choices=("LayerNorm", "RMSNorm"),
        default=None,
        help="norm type (default LayerNorm)",
    )
    model.add_argument("--swiglu", action="store_true", help="gated SiLU MLP")
    model.add_argument(
        "--group-query-attention",
        action="store_true",
        help="grouped-query attention with --num-query-groups key/value heads",
    )
    model.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="key/value heads under --group-query-attention (default 1)",
    )
    model.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help="width of one attention head (default --hidden-size / --num-attention-heads)",
    )
    model.add_argument(
        "--norm-epsilon",
        type=float,
        default=None,
        help="epsilon of the LayerNorm / RMSNorm layers (default 1e-5)",
    )
    model.add_argument(
        "--rotary-base",
        type=float,
        default=None,
        help="base (theta) of the rotary embedding (default 10000)",
    )
    model.add_argument(
        "--add-qkv-bias",
        action="store_true",
        help="biases on the query/key/value projection even with --disable-bias-linear (Qwen2)",
    )
    model.add_argument(
        "--qk-layernorm", action="store_true", help="a norm on each query and key head (Qwen3)"
    )
    model.add_argument(
        "--disable-bias-linear", action="store_true", help="no biases in the linear layers"
    )
    model.add_argument(
        "--init-method-std", type=float, default=0.02, help="std of the normal weight init"
    )
    model.add_argument(
        "--hidden-dropout", type=float, default=0.0, help="dropout after attention and MLP"
    )
    model.add_argument(
        "--attention-dropout", type=float, default=0.0, help="dropout of attention probabilities"
    )
    model.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        default="local",
        help="layer spec: megatron-core's local modules or TransformerEngine's (needs TE)",
    )
    model.add_argument(
        "--fp8-format",
        choices=FP8_FORMATS,
        default=None,
        help="FP8 training format (needs TransformerEngine and --transformer-impl transformer_engine)",
    )
    model.add_argument(
        "--fp8-recipe",
        choices=FP8_RECIPES,
        default="delayed",
        help="FP8 scaling recipe (delayed: amax reduced over TP only, ODC reduces it over DP)",
    )
    model.add_argument(
        "--fp8-param-gather",
        action="store_true",
        help="keep FP8 parameters: ODC shards, fetches and re-quantises FP8 bytes (delayed or "
        "tensorwise recipe; TransformerEngine >= 2.3)",
    )
    model.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    model.add_argument("--fp16", action="store_true", help="fp16 mixed precision (loss scaling)")

    parallel = parser.add_argument_group("parallelism (Megatron-LM flags)")
    parallel.add_argument(
        "--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel size"
    )
    parallel.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="pipeline stages (megatron-core's 1F1B schedule); the plan is made over the DP "
        "replicas, each of whose stages runs the replica's microbatches",
    )
    parallel.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="the interleaved pipeline schedule: not supported (refused)",
    )
    parallel.add_argument(
        "--sequence-parallel", action="store_true", help="Megatron sequence parallelism (TP > 1)"
    )
    parallel.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="timeout of every collective wait: the process groups, the ODC fence (unless "
        "--odc-timeout-s), and the watchdog that ends a rank stuck on a dead or stopped peer",
    )

    train = parser.add_argument_group("training (Megatron-LM flags)")
    train.add_argument(
        "--micro-batch-size",
        type=int,
        default=1,
        help="sequences per microbatch; must be 1 (each microbatch is one packed sequence)",
    )
    train.add_argument(
        "--global-batch-size",
        type=int,
        default=16,
        help="samples per iteration over all DP ranks (one minibatch)",
    )
    train.add_argument("--train-iters", type=int, default=40, help="iterations to train for")
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    train.add_argument(
        "--min-lr",
        type=float,
        default=None,
        help=f"learning rate after decay (default --lr / {DEFAULT_LR_DECAY_RATIO:g})",
    )
    train.add_argument(
        "--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine", help="decay after warmup"
    )
    train.add_argument(
        "--lr-warmup-iters",
        type=int,
        default=None,
        help="linear warmup iterations (default 3, fewer when --lr-decay-iters is smaller)",
    )
    train.add_argument(
        "--lr-warmup-init", type=float, default=0.0, help="learning rate at the start of warmup"
    )
    train.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="iterations to decay over (default --train-iters)",
    )
    train.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    train.add_argument(
        "--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0: off)"
    )
    train.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    train.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    train.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    train.add_argument(
        "--loss-scale", type=float, default=None, help="static loss scale (fp16; default dynamic)"
    )
    train.add_argument(
        "--initial-loss-scale",
        type=float,
        default=2.0**32,
        help="fp16: initial dynamic loss scale (Megatron's default 2**32 skips the first iterations)",
    )
    train.add_argument(
        "--calculate-per-token-loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sum token losses and divide by the global token count (required; on by default)",
    )
    train.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop the run at the first iteration whose global lm loss or grad norm is NaN/inf or "
        "whose minibatch has no loss token (on by default)",
    )
    train.add_argument("--seed", type=int, default=1234, help="random seed")

    data = parser.add_argument_group("data (Megatron-LM flags)")
    data.add_argument(
        "--data-path",
        nargs="+",
        default=None,
        help="SFT: one JSONL file (with --sft) or a prefix written by python -m "
        "megatron_odc.data.preprocess (detected); pretraining: Megatron indexed datasets "
        "'[W1] PREFIX1 [W2 PREFIX2 ...]' (PREFIX.bin / PREFIX.idx)",
    )
    data.add_argument(
        "--sft",
        action="store_true",
        help="SFT on a JSONL file of conversations (a preprocessed prefix is detected without it)",
    )
    data.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="SFT JSONL: skip and count lines that are not valid UTF-8 / JSON / records",
    )
    data.add_argument(
        "--split",
        default="969,30,1",
        help="pretraining: train,valid,test weights of the --data-path documents (only train is "
        "used; with weighted prefixes, --data-path W1 P1 W2 P2, every document is train)",
    )
    data.add_argument(
        "--data-cache-path",
        default=None,
        help="pretraining: where GPTDataset caches its indices (default next to the data)",
    )
    data.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help="ByteTokenizer (default) or HuggingFaceTokenizer (a local --tokenizer-model dir)",
    )
    data.add_argument(
        "--tokenizer-model", default=None, help="local Hugging Face tokenizer directory"
    )
    data.add_argument(
        "--synthetic-num-samples",
        type=int,
        default=512,
        help="samples of the generated SFT set used when no --data-path is given",
    )

    ckpt = parser.add_argument_group("checkpoints and logging (Megatron-LM flags)")
    ckpt.add_argument("--save", default=None, help="checkpoint directory to save to")
    ckpt.add_argument(
        "--save-interval", type=int, default=None, help="save every this many iterations"
    )
    ckpt.add_argument("--load", default=None, help="checkpoint directory to resume from")
    ckpt.add_argument(
        "--finetune",
        action="store_true",
        help="load weights only from --load; start at iteration 0 with fresh optimizer and data",
    )
    schedule = ckpt.add_mutually_exclusive_group()
    schedule.add_argument(
        "--override-opt_param-scheduler",
        action="store_true",
        help="on --load, continue with the learning-rate and weight-decay schedule of this run's "
        "flags (--lr, --min-lr, --lr-warmup-iters, --lr-decay-iters, --lr-decay-style, "
        "--train-iters, --weight-decay) from the checkpoint's iteration on; without it or "
        "--use-checkpoint-opt_param-scheduler, a schedule that differs from the checkpoint's is "
        "refused (Megatron-LM's rule)",
    )
    schedule.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        help="on --load, keep the checkpoint's learning-rate and weight-decay schedule whatever "
        "this run's flags say",
    )
    ckpt.add_argument(
        "--load-hf",
        default=None,
        metavar="DIR",
        help="start from a local Hugging Face model directory (Llama, Qwen2, Qwen3): the GPT's shape "
        "comes from its config.json, its weights from its safetensors, the tokenizer from it too "
        "(model-shape flags that disagree with the config are refused)",
    )
    ckpt.add_argument(
        "--save-hf",
        default=None,
        metavar="DIR",
        help="write the model as a Hugging Face directory at the end of training and at each "
        "--save-interval (needs --load-hf, whose config and tokenizer it copies)",
    )
    ckpt.add_argument("--log-interval", type=int, default=5, help="iterations per log line")
    ckpt.add_argument(
        "--tensorboard-dir",
        default=None,
        help="write TensorBoard scalars here (rank 0): Megatron-LM's tags (lm loss, learning-rate, "
        "grad-norm, ...) and ODC's (odc/...); needs the tensorboard package",
    )
    ckpt.add_argument(
        "--tensorboard-log-interval",
        type=int,
        default=1,
        help="record the per-iteration scalars (lm loss, learning-rate, grad-norm, batch-size) of "
        "every this many iterations (they are written with each --log-interval line)",
    )
    ckpt.add_argument(
        "--wandb-project",
        default=None,
        help="also send the TensorBoard scalars to this wandb project (needs the wandb package)",
    )
    ckpt.add_argument(
        "--wandb-exp-name", default=None, help="wandb run name (needed with --wandb-project)"
    )
    ckpt.add_argument(
        "--wandb-save-dir",
        default=None,
        help="wandb's local directory (default SAVE/wandb with --save)",
    )
    ckpt.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="stop (after saving, with --save) when the iteration is divisible by this value",
    )

    add_odc_arguments(parser, dp_backend_default="odc")
    return parser


def _check_pretraining_data(args: argparse.Namespace) -> None:
    """Pretraining on Megatron indexed datasets: ``--data-path [W1] PREFIX1 [W2 PREFIX2 ...]``."""
    paths = args.data_path
    if len(paths) % 2 == 0 and all(_is_float(p) for p in paths[0::2]):
        prefixes = paths[1::2]
    else:
        prefixes = paths
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                raise ValueError(
                    f"--data-path {prefix!r}: {prefix + suffix} does not exist (pretraining reads "
                    "Megatron indexed datasets PREFIX.bin / PREFIX.idx; pass --sft for a JSONL file)"
                )
        check_indexed_dataset(prefix, f"--data-path {prefix}")
    if args.max_tokens_per_microbatch != args.seq_length:
        raise ValueError(
            "--max-tokens-per-microbatch must equal --seq-length for pretraining: every sample "
            "is one full --seq-length sequence"
        )
    weights = [w.strip() for w in args.split.split(",")]
    if not weights or len(weights) > 3 or not all(_is_float(w) and float(w) >= 0 for w in weights):
        raise ValueError(f"--split {args.split!r} must be up to 3 comma-separated weights >= 0")
    if float(weights[0]) <= 0:
        raise ValueError(f"--split {args.split!r} gives the train split no documents")


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def validate_args(args: argparse.Namespace, *, world_size: int) -> argparse.Namespace:
    """Checks the parsed flags against each other and the world size; fills derived defaults.

    Fills the model flags from ``--load-hf``'s config or ``MODEL_SHAPE_DEFAULTS``, and
    ``max_position_embeddings``, ``min_lr``, ``lr_decay_iters``, ``lr_warmup_iters``, ``balance``,
    ``max_tokens_per_microbatch``, ``odc_transport`` and ``tokenizer_type`` when they were left unset,
    and sets ``sft`` when no ``--data-path`` is given (the built-in synthetic SFT set).

    Args:
        args: the namespace from :func:`build_parser`.
        world_size: number of ranks of the launch (torchrun's ``WORLD_SIZE``).

    Returns:
        ``args``, completed in place.

    Raises:
        ValueError: an invalid flag or combination (or ``--odc-transport mpi`` outside an ``mpiexec``
            launch); the message names the flag.
    """
    _require_positive(args)
    if args.load_hf is not None:
        _apply_hf_config(args)
    for name, default in MODEL_SHAPE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    _check_parallelism(args, world_size)
    _check_precision(args)
    _check_model(args)
    _check_optimization(args)
    resolve_odc_args(args)
    check_mpi_launch(args.odc_transport, os.environ)
    _check_data(args)
    _check_checkpointing(args)
    _check_metrics(args)
    return args


_POSITIVE = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "seq_length",
    "max_position_embeddings",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "global_batch_size",
    "train_iters",
    "lr_decay_iters",
    "log_interval",
    "tensorboard_log_interval",
    "save_interval",
    "exit_interval",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "max_tokens_per_microbatch",
    "synthetic_num_samples",
    "num_query_groups",
    "kv_channels",
)
"""Integer flags that must be >= 1 when given."""


def _require_positive(args: argparse.Namespace) -> None:
    for name in _POSITIVE:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _check_parallelism(args: argparse.Namespace, world_size: int) -> None:
    if not args.distributed_timeout_minutes > 0:
        raise ValueError(
            f"--distributed-timeout-minutes must be > 0, got {args.distributed_timeout_minutes}"
        )
    tp_size, pp_size = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.num_layers_per_virtual_pipeline_stage is not None:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage: this entry runs megatron-core's 1F1B "
            "pipeline schedule (one model chunk per rank), not the interleaved one; drop the flag"
        )
    if world_size % tp_size:
        raise ValueError(
            f"--tensor-model-parallel-size {tp_size} does not divide the world size {world_size}"
        )
    if world_size % (tp_size * pp_size):
        raise ValueError(
            f"--tensor-model-parallel-size {tp_size} x --pipeline-model-parallel-size {pp_size} "
            f"does not divide the world size {world_size}"
        )
    check_pipeline_layers(args.num_layers, pp_size)
    if pp_size > 1:
        for flag, value in (("--load-hf", args.load_hf), ("--save-hf", args.save_hf)):
            if value is not None:
                raise ValueError(
                    f"{flag} does not combine with --pipeline-model-parallel-size {pp_size} yet "
                    "(the Hugging Face bridge maps a whole model); use 1"
                )
    if args.num_attention_heads % tp_size:
        raise ValueError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp_size}"
        )
    if args.vocab_size is not None and args.vocab_size % tp_size:
        raise ValueError(
            f"--vocab-size {args.vocab_size} is not divisible by --tensor-model-parallel-size "
            f"{tp_size}"
        )
    if args.sequence_parallel:
        if tp_size == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        if args.seq_length % math.lcm(8, tp_size):
            raise ValueError(
                f"--seq-length {args.seq_length} must be a multiple of {math.lcm(8, tp_size)} "
                "with --sequence-parallel (packed microbatches are padded to multiples of 8 and "
                "split over the TP ranks)"
            )
    if args.micro_batch_size != 1:
        raise ValueError(
            f"--micro-batch-size {args.micro_batch_size}: each microbatch is one packed sequence "
            "of several samples, so it must be 1 (use --max-tokens-per-microbatch for its size)"
        )


def _apply_hf_config(args: argparse.Namespace) -> None:
    """``--load-hf DIR``: the model flags its config means (``mcore/hf_bridge.py``), and its tokenizer.

    A flag left unset takes the config's value; a flag given with another value is refused.
    The vocabulary is the config's, rounded up to a multiple of the TP size (``--vocab-size`` may pad
    it further).
    """
    from megatron_odc.mcore.hf_bridge import hf_model_flags

    if not os.path.isdir(args.load_hf):
        raise ValueError(f"--load-hf {args.load_hf!r} is not a directory")
    try:
        hf_flags = hf_model_flags(args.load_hf)
    except ValueError as exc:
        raise ValueError(f"--load-hf {args.load_hf}: {exc}") from None
    for name, value in hf_flags.items():
        if name in _POSITIVE and value is not None and value < 1:
            raise ValueError(
                f"--load-hf {args.load_hf}: its config.json means --{name.replace('_', '-')} "
                f"{value}, which must be >= 1; fix the config"
            )
    hf_vocab = hf_flags.pop("vocab_size")
    for name, value in hf_flags.items():
        given = getattr(args, name)
        unset = given is None or given is False  # valued flags default to None, switches to False
        if not unset and given != value:
            raise ValueError(
                f"--{name.replace('_', '-')} {given} conflicts with --load-hf {args.load_hf}, whose "
                f"config means {value}; drop the flag"
            )
        setattr(args, name, value)
    tp_size = args.tensor_model_parallel_size
    if args.vocab_size is None:
        args.vocab_size = -(-hf_vocab // tp_size) * tp_size
    elif args.vocab_size < hf_vocab:
        raise ValueError(
            f"--vocab-size {args.vocab_size} is smaller than the vocabulary of --load-hf "
            f"{args.load_hf} ({hf_vocab})"
        )
    if args.tokenizer_type is None and args.tokenizer_model is None:
        args.tokenizer_model = args.load_hf


def _check_precision(args: argparse.Namespace) -> None:
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 are mutually exclusive")
    # The model is built with tp_only_amax_red=True: ranks run different microbatch counts.
    check_fp8_flags(
        transformer_impl=args.transformer_impl,
        fp8=args.fp8_format,
        fp8_recipe=args.fp8_recipe,
        fp8_param=args.fp8_param_gather,
        tp_only_amax_red=True,
    )
    if args.fp8_format is not None and args.transformer_impl != "transformer_engine":
        raise ValueError("--fp8-format needs --transformer-impl transformer_engine")


def _check_model(args: argparse.Namespace) -> None:
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ValueError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads} (or pass --kv-channels)"
        )
    query_groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    if args.num_attention_heads % query_groups:
        raise ValueError(
            f"--num-query-groups {query_groups} does not divide --num-attention-heads "
            f"{args.num_attention_heads}"
        )
    if query_groups % args.tensor_model_parallel_size:
        raise ValueError(
            f"--num-query-groups {query_groups} is not divisible by --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size}"
        )
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if (
        args.position_embedding_type == "learned_absolute"
        and args.max_position_embeddings < args.seq_length
    ):
        raise ValueError(
            f"--max-position-embeddings {args.max_position_embeddings} is smaller than "
            f"--seq-length {args.seq_length}"
        )
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1)")


_REAL_RANGES: dict[str, tuple[float, float, str]] = {
    "lr": (0.0, math.inf, ">= 0"),
    "min_lr": (0.0, math.inf, ">= 0"),
    "lr_warmup_init": (0.0, math.inf, ">= 0"),
    "weight_decay": (0.0, math.inf, ">= 0"),
    "clip_grad": (0.0, math.inf, ">= 0"),
    "init_method_std": (0.0, math.inf, ">= 0"),
    "adam_beta1": (0.0, 1.0, "in [0, 1)"),
    "adam_beta2": (0.0, 1.0, "in [0, 1)"),
    "adam_eps": (math.ulp(0.0), math.inf, "> 0"),
    "loss_scale": (math.ulp(0.0), math.inf, "> 0"),
    "initial_loss_scale": (math.ulp(0.0), math.inf, "> 0"),
}
"""Real-valued flags -> (lowest allowed, first value above the range, the rule as a message says it).
NaN and infinity are refused for all of them."""


def _check_real_ranges(args: argparse.Namespace) -> None:
    for name, (lowest, above, rule) in _REAL_RANGES.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and lowest <= value < above):
            raise ValueError(
                f"--{name.replace('_', '-')} must be a finite number {rule}, got {value}"
            )


def _check_optimization(args: argparse.Namespace) -> None:
    if not args.calculate_per_token_loss:
        raise ValueError(
            "--no-calculate-per-token-loss is not supported: ranks run different numbers of "
            "microbatches, which is exact only with --calculate-per-token-loss"
        )
    if args.min_lr is None:
        args.min_lr = args.lr / DEFAULT_LR_DECAY_RATIO
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters is None:
        args.lr_warmup_iters = min(DEFAULT_LR_WARMUP_ITERS, args.lr_decay_iters - 1)
    _check_real_ranges(args)
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.lr_warmup_init > args.lr:
        raise ValueError(f"--lr-warmup-init {args.lr_warmup_init} is larger than --lr {args.lr}")
    if not 0 <= args.lr_warmup_iters < args.lr_decay_iters:
        raise ValueError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be in [0, --lr-decay-iters "
            f"{args.lr_decay_iters})"
        )


def _check_data(args: argparse.Namespace) -> None:
    if args.max_tokens_per_microbatch is None:
        args.max_tokens_per_microbatch = args.seq_length
    if args.max_tokens_per_microbatch > args.seq_length:
        raise ValueError(
            f"--max-tokens-per-microbatch {args.max_tokens_per_microbatch} exceeds --seq-length "
            f"{args.seq_length}: a packed microbatch never grows beyond --seq-length"
        )
    if args.data_path is None:
        if args.sft:
            raise ValueError("--sft needs --data-path FILE.jsonl (omit both for the built-in set)")
        args.sft = True
    elif len(args.data_path) == 1 and is_indexed_sft(args.data_path[0]):
        args.sft = True  # preprocessed SFT data (python -m megatron_odc.data.preprocess)
    elif not args.sft:
        _check_pretraining_data(args)
    else:
        if len(args.data_path) != 1:
            raise ValueError(
                f"--data-path with --sft takes one JSONL file or preprocessed prefix, got "
                f"{len(args.data_path)} paths"
            )
        if not os.path.isfile(args.data_path[0]):
            raise ValueError(
                f"--data-path {args.data_path[0]!r} is neither a JSONL file nor a preprocessed SFT "
                f"prefix (no {sidecar_path(args.data_path[0])}; see python -m "
                "megatron_odc.data.preprocess)"
            )
    if args.tokenizer_type is None:
        args.tokenizer_type = (
            "HuggingFaceTokenizer" if args.tokenizer_model is not None else "ByteTokenizer"
        )
    if args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model is None:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR")
    if args.tokenizer_type == "ByteTokenizer" and args.tokenizer_model is not None:
        raise ValueError("--tokenizer-model does not apply to --tokenizer-type ByteTokenizer")


def _check_checkpointing(args: argparse.Namespace) -> None:
    if args.save_interval is not None and args.save is None and args.save_hf is None:
        raise ValueError("--save-interval needs --save DIR or --save-hf DIR")
    if args.save_hf is not None and args.load_hf is None:
        raise ValueError(
            "--save-hf needs --load-hf DIR: the saved model's config and tokenizer come from it"
        )
    if args.save_hf is not None and os.path.realpath(args.save_hf) == os.path.realpath(
        args.load_hf
    ):
        raise ValueError(
            f"--save-hf {args.save_hf} is the --load-hf directory; it would be replaced: pass another"
        )
    if args.finetune and args.load is None:
        raise ValueError("--finetune needs --load DIR")
    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        raise ValueError(
            f"--load {args.load!r} is an existing file, not a checkpoint directory; pass a directory"
        )
    for flag, path in (("--save", args.save), ("--save-hf", args.save_hf)):
        if path is not None:
            check_writable_dir(flag, path)


def check_writable_dir(flag: str, path: str) -> None:
    """Refuse an output directory that cannot be made or written: an existing file, a file among
    its parents, or a nearest existing directory that refuses a new entry (tried: a temporary
    directory is made and removed there, which also catches read-only mounts, also for root).

    Raises:
        ValueError: naming ``flag``, ``path`` and what is in the way.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is an existing file; pass a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {path!r} cannot be made: {existing!r} is a file")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megatron-odc-write-check-", dir=existing))
    except OSError as exc:
        raise ValueError(
            f"{flag} {path!r} cannot be written: {existing!r} refuses new entries "
            f"({exc.strerror}); pass a writable directory"
        ) from exc


def _check_metrics(args: argparse.Namespace) -> None:
    """``--tensorboard-dir`` / ``--wandb-*`` (Megatron-LM's names), checked before anything trains."""
    if args.wandb_project is None:
        for flag, value in (
            ("--wandb-exp-name", args.wandb_exp_name),
            ("--wandb-save-dir", args.wandb_save_dir),
        ):
            if value is not None:
                raise ValueError(f"{flag} applies only with --wandb-project NAME")
    else:
        if not args.wandb_exp_name:
            raise ValueError("--wandb-project needs --wandb-exp-name NAME (the run's name)")
        if args.wandb_save_dir is None and args.save is None:
            raise ValueError(
                "--wandb-project needs --wandb-save-dir DIR, or --save DIR (wandb then writes to "
                "DIR/wandb)"
            )
    for flag, path in (
        ("--tensorboard-dir", args.tensorboard_dir),
        ("--wandb-save-dir", args.wandb_save_dir),
    ):
        if path is not None:
            check_writable_dir(flag, path)
    require_packages(args)
