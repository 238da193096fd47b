"""The benchmark's GPT: megatron-core's ``GPTModel`` with core attention run per packed sample."""

from __future__ import annotations

import copy
import itertools

import torch
from torch.nn import functional

from benchmarks.imbalance_lib.settings import DTYPES, MODEL


def _segmented_attention_cls() -> type:
    """Builds :class:`SegmentedDotProductAttention` lazily (megatron is imported only in the ranks)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SegmentedDotProductAttention(DotProductAttention):
        """Core attention over a block-diagonal causal mask, one fused causal kernel per diagonal block.

        Segment ``k`` starts at token ``i`` when ``mask[i, i-1]`` is masked (True). Scores between segments
        are all masked, so running each diagonal block alone through torch's fused causal attention
        (``scaled_dot_product_attention(is_causal=True)``, the CPU analogue of varlen flash attention)
        gives the output of the masked dense attention at ``sum(s_k**2)`` cost. No dropout, no GQA.
        """

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            num_tokens = query.shape[0]
            if attention_mask is None:
                starts = [0]
            else:
                below = attention_mask[0, 0].diagonal(offset=-1)
                starts = [0, *(int(i) + 1 for i in below.nonzero().flatten())]
            bounds = [*starts, num_tokens]
            outs = []
            for lo, hi in itertools.pairwise(bounds):
                # [s, b, np, hn] -> [b, np, s, hn]
                q, k, v = (t[lo:hi].permute(1, 2, 0, 3) for t in (query, key, value))
                ctx = functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale
                )
                outs.append(ctx.permute(2, 0, 1, 3).reshape(hi - lo, ctx.shape[0], -1))
            return torch.cat(outs, dim=0)

    return SegmentedDotProductAttention


def build_model(seed: int, seq_length: int, dtype: str = "fp32") -> torch.nn.Module:
    """A megatron-core GPTModel of :data:`MODEL` with segmented core attention (CPU patches applied).

    With ``dtype="bf16"`` the parameters are bf16 and the model is wrapped in ``Float16Module``, as
    Megatron-LM does for ``--bf16``.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from megatron_odc.mcore.model import GPTConfig, transformer_config

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    bf16 = dtype == "bf16"
    cfg = GPTConfig(**MODEL, seq_length=seq_length, params_dtype=DTYPES[dtype], bf16=bf16)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=cfg.normalization))
    spec.submodules.self_attention.submodules.core_attention = _segmented_attention_cls()
    model = GPTModel(
        config=transformer_config(cfg),
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type,
    )
    return Float16Module(model.config, model) if bf16 else model
