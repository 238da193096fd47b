"""megatron-core GPT models: a config dataclass and a deterministic builder.

The builder uses CPU weight initialisation, so a model built from the same seed holds the same *full*
weights under every tensor-parallel layout (each TP layer draws its full master weight from the CPU
generator and keeps its partition); with pipeline stages each rank builds its stage's layers (the first
stage the embeddings, the last the output layer); the layer spec is megatron-core's local one (no TransformerEngine)
or, where TE is installed, TE's, with FP8 compute if asked. ``parallel.model_parallel`` (or
``parallel_state.initialize_model_parallel``) must be active; on CPU, apply ``integration/cpu.py``'s
``apply_cpu_patches`` first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn import functional

from megatron_odc.mcore.config import check_pipeline_layers
from megatron_odc.mcore.releases import quiet_notices


def params_dtype(*, bf16: bool, fp16: bool) -> torch.dtype:
    """The parameter dtype of Megatron's ``--bf16`` / ``--fp16`` (fp32 with neither)."""
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


@dataclasses.dataclass
class GPTConfig:
    """Shape and numerics of a small GPT.

    Attributes:
        num_layers: transformer layers.
        hidden_size: model width.
        num_attention_heads: attention heads (divisible by the TP size).
        ffn_hidden_size: MLP width; None means 4 * hidden_size.
        vocab_size: vocabulary size (divisible by the TP size; no padding is added).
        seq_length: maximum sequence length (learned position embeddings use it).
        params_dtype: dtype of the parameters.
        bf16: bf16 mixed precision flag passed to TransformerConfig.
        fp16: fp16 mixed precision flag passed to TransformerConfig.
        sequence_parallel: Megatron sequence parallelism (needs TP > 1 and the CPU norm shim on CPU).
        share_embeddings_and_output_weights: tie the word embedding and the output layer.
        position_embedding_type: "rope" or "learned_absolute".
        normalization: "LayerNorm" or "RMSNorm".
        init_method_std: std of the normal weight init.
        calculate_per_token_loss: Megatron's per-token loss contract (finalize divides by global tokens).
        hidden_dropout: dropout after attention and MLP.
        attention_dropout: dropout of attention probabilities.
        swiglu: gated SiLU MLP (fc1 holds [gate; up], TP-split with stride 2).
        add_bias_linear: biases on the linear layers.
        num_query_groups: key/value heads (grouped-query attention); None means num_attention_heads.
        kv_channels: width of one attention head; None means hidden_size / num_attention_heads.
        norm_epsilon: epsilon of the LayerNorm / RMSNorm layers.
        rotary_base: base of the rotary position embedding (RoPE theta).
        add_qkv_bias: biases on the query/key/value projection even without add_bias_linear (Qwen2).
        qk_layernorm: a norm on each query and key head (Qwen3).
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    vocab_size: int = 256
    seq_length: int = 64
    params_dtype: torch.dtype = torch.float32
    bf16: bool = False
    fp16: bool = False
    sequence_parallel: bool = False
    share_embeddings_and_output_weights: bool = True
    position_embedding_type: str = "rope"
    normalization: str = "LayerNorm"
    init_method_std: float = 0.02
    calculate_per_token_loss: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    swiglu: bool = False
    add_bias_linear: bool = True
    num_query_groups: int | None = None
    kv_channels: int | None = None
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    add_qkv_bias: bool = False
    qk_layernorm: bool = False

    @classmethod
    def from_args(cls, args: Any, *, vocab_size: int) -> GPTConfig:
        """The GPT that Megatron-LM-named arguments describe.

        Fields named like an attribute of ``args`` are copied; the others follow Megatron-LM's flags:
        ``seq_length`` is ``--max-position-embeddings``, ``params_dtype`` follows ``--bf16`` /
        ``--fp16``, ``share_embeddings_and_output_weights`` is ``not --untie-embeddings-and-output-
        weights``, ``add_bias_linear`` is ``not --disable-bias-linear`` (Megatron-LM's own parsed
        ``add_bias_linear`` where there is no such flag) and ``num_query_groups`` is
        ``--num-query-groups`` under ``--group-query-attention``.
        """
        values = {
            f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
        }
        return cls(
            **{
                **values,
                "vocab_size": vocab_size,
                "seq_length": args.max_position_embeddings,
                "params_dtype": params_dtype(bf16=args.bf16, fp16=args.fp16),
                "share_embeddings_and_output_weights": not args.untie_embeddings_and_output_weights,
                # the plugin's parser has --disable-bias-linear; Megatron-LM's validated args
                # hold add_bias_linear itself (copied above)
                "add_bias_linear": not args.disable_bias_linear
                if hasattr(args, "disable_bias_linear")
                else values.get("add_bias_linear", True),
                "num_query_groups": args.num_query_groups if args.group_query_attention else None,
            }
        )


def transformer_config(cfg: GPTConfig) -> TransformerConfig:
    """Build the TransformerConfig for ``cfg`` with the current TP size and CPU-safe options.

    Raises:
        ValueError: heads or vocabulary not divisible by the TP size, sequence parallelism at TP=1, or
            layers that do not split into the pipeline stages.
    """
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if cfg.num_attention_heads % tp_size:
        raise ValueError(
            f"num_attention_heads={cfg.num_attention_heads} is not divisible by TP size {tp_size}"
        )
    query_groups = cfg.num_query_groups or cfg.num_attention_heads
    if cfg.num_attention_heads % query_groups or query_groups % tp_size:
        raise ValueError(
            f"num_query_groups={query_groups} must divide num_attention_heads="
            f"{cfg.num_attention_heads} and be divisible by TP size {tp_size}"
        )
    if cfg.vocab_size % tp_size:
        raise ValueError(f"vocab_size={cfg.vocab_size} is not divisible by TP size {tp_size}")
    if cfg.sequence_parallel and tp_size == 1:
        raise ValueError("sequence_parallel=True needs a tensor-parallel size > 1")
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    check_pipeline_layers(cfg.num_layers, pp_size)
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        # Pipeline stages: activations of any length cross between stages (packed microbatches
        # differ in length; megatron-core sends each shape first; its check of that against MoE's
        # default allgather dispatcher is moot without experts), and a sent activation's memory is
        # freed as Megatron-LM does.
        variable_seq_lengths=pp_size > 1,
        moe_token_dispatcher_type="alltoall" if pp_size > 1 else "allgather",
        deallocate_pipeline_outputs=pp_size > 1,
        sequence_parallel=cfg.sequence_parallel,
        params_dtype=cfg.params_dtype,
        pipeline_dtype=cfg.params_dtype,
        bf16=cfg.bf16,
        fp16=cfg.fp16,
        normalization=cfg.normalization,
        init_method_std=cfg.init_method_std,
        calculate_per_token_loss=cfg.calculate_per_token_loss,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        gated_linear_unit=cfg.swiglu,
        activation_func=functional.silu if cfg.swiglu else functional.gelu,
        add_bias_linear=cfg.add_bias_linear,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        layernorm_epsilon=cfg.norm_epsilon,
        add_qkv_bias=cfg.add_qkv_bias,
        qk_layernorm=cfg.qk_layernorm,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


@dataclasses.dataclass(frozen=True)
class FP8Settings:
    """FP8 compute of TransformerEngine layers (``--fp8-format`` and friends).

    Attributes:
        fmt: ``e4m3`` or ``hybrid``.
        recipe: Megatron's ``--fp8-recipe``.
        param: keep FP8 parameters (``--fp8-param-gather``); ODC shards and fetches their bytes.
    """

    fmt: str
    recipe: str = "delayed"
    param: bool = False


TRANSFORMER_IMPLS = ("local", "transformer_engine")
"""Layer specs: megatron-core's local modules, or TransformerEngine's (needs TE)."""


def build_gpt_model(
    cfg: GPTConfig,
    seed: int,
    *,
    transformer_impl: str = "local",
    fp8: FP8Settings | None = None,
) -> GPTModel:
    """Build a GPTModel, deterministic given ``seed`` and the TP layout.

    Reseeds the model-parallel RNG trackers and the CPU generator with ``seed``. Under any TP size the
    TP partitions are slices of the same full weights (CPU initialisation draws each full weight).

    Args:
        cfg: shape and numerics.
        seed: initialisation seed.
        transformer_impl: one of ``TRANSFORMER_IMPLS``.
        fp8: FP8 compute (TransformerEngine layers only); its amax is reduced over TP only, because
            ODC ranks run different numbers of microbatches ([Note: FP8 amax reductions]).
    """
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(
            f"--transformer-impl {transformer_impl!r} is not one of {', '.join(TRANSFORMER_IMPLS)}"
        )
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = transformer_config(cfg)
    if transformer_impl == "local":
        spec = get_gpt_layer_local_spec(
            normalization=cfg.normalization, qk_layernorm=cfg.qk_layernorm
        )
    else:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        # TE's norms read config.normalization; this spec takes no normalization argument.
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_layernorm)
    if fp8 is not None:
        # FP8 parameters (fp8_param) are built by the TE layers under fp8_model_init.
        config = dataclasses.replace(
            config, fp8=fp8.fmt, fp8_recipe=fp8.recipe, fp8_param=fp8.param, tp_only_amax_red=True
        )
    with quiet_notices():  # 0.19's "GPTModel IS DEPRECATED" (mcore/releases.py)
        return GPTModel(
            config=config,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            transformer_layer_spec=spec,
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length,
            share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
            position_embedding_type=cfg.position_embedding_type,
            rotary_base=cfg.rotary_base,
        )


def with_mixed_precision(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` inside megatron-core's ``Float16Module`` when its config is bf16 or fp16, else itself."""
    if not (model.config.bf16 or model.config.fp16):
        return model
    from megatron.core.transformer.module import Float16Module

    return Float16Module(model.config, model)
