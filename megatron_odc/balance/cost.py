"""Per-sample compute cost model for length balancing.

Owns :class:`CostModel`: the cost of one sample of ``s`` tokens is ``a * s**2 + b * s``, in FLOPs when the
coefficients come from :meth:`CostModel.from_model_config`, in tokens for :meth:`CostModel.tokens`, or in any
unit for explicit coefficients. Pure Python; imports neither torch nor megatron.

[Note: cost model]
Forward plus backward of a dense decoder layer costs about 3x its forward (backward computes both the input
gradient and the weight gradient, each as large as the forward matmul). Per token, a matmul with a weight of
``m x n`` costs ``2 * m * n`` forward FLOPs, so every weight element costs 6 FLOPs per token for fwd+bwd::

    b = 6 * (num_layers * (qkv + out + mlp) + lm_head)
      qkv     = hidden * (hidden + 2 * num_query_groups * head_dim)     head_dim = hidden / heads
      out     = hidden * hidden
      mlp     = (3 if gated_mlp else 2) * hidden * ffn_hidden
      lm_head = hidden * vocab

Attention scores (``Q K^T``) and the weighted sum of values (``P V``) each cost ``2 * hidden`` forward FLOPs per
(query, key) pair per layer, so ``4 * hidden`` forward and ``12 * hidden`` fwd+bwd::

    a = 12 * num_layers * hidden * (1/2 if causal else 1)

A causal sample of ``s`` tokens has ``s * (s + 1) / 2`` visible pairs; the model counts ``s**2 / 2`` (the linear
remainder is below 1e-4 of ``b * s``). Softmax, norms, rotary embeddings and the loss are elementwise and
ignored. Samples packed into one microbatch do not attend to each other (block-diagonal mask / THD), so a
microbatch costs the sum of its samples' costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["CostModel"]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-sample cost ``a * s**2 + b * s`` of a sample of ``s`` tokens.

    Attributes:
        a: quadratic coefficient (attention), cost units per token pair.
        b: linear coefficient (matmuls), cost units per token.
    """

    a: float
    b: float

    def __post_init__(self) -> None:
        if self.a < 0 or self.b < 0:
            raise ValueError(f"CostModel coefficients must be >= 0, got a={self.a}, b={self.b}")
        if self.a == 0 and self.b == 0:
            raise ValueError("CostModel needs a > 0 or b > 0 (both are 0)")

    def sample_cost(self, length: int) -> float:
        """Returns the cost of one sample of ``length`` tokens."""
        if length < 0:
            raise ValueError(f"sample length must be >= 0, got {length}")
        s = float(length)
        return self.a * s * s + self.b * s

    def costs(self, lengths: Sequence[int]) -> list[float]:
        """Returns the cost of each sample, in the order of ``lengths``."""
        return [self.sample_cost(length) for length in lengths]

    @classmethod
    def from_model_config(
        cls,
        *,
        num_layers: int,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        vocab_size: int,
        num_query_groups: int | None = None,
        gated_mlp: bool = False,
        causal: bool = True,
    ) -> CostModel:
        """Builds the FLOP cost model of a dense decoder (see [Note: cost model] in this module).

        Args:
            num_layers: transformer layers.
            hidden_size: model width.
            ffn_hidden_size: MLP inner width.
            num_attention_heads: query heads.
            vocab_size: output vocabulary (LM head columns).
            num_query_groups: key/value heads (GQA); ``None`` means as many as query heads.
            gated_mlp: SwiGLU-style MLP with three weight matrices instead of two.
            causal: causal attention counts half of the token pairs.

        Returns:
            A cost model in forward+backward FLOPs.

        Raises:
            ValueError: a size is not positive, or hidden_size is not divisible by num_attention_heads.
        """
        sizes = {
            "num_layers": num_layers,
            "hidden_size": hidden_size,
            "ffn_hidden_size": ffn_hidden_size,
            "num_attention_heads": num_attention_heads,
            "vocab_size": vocab_size,
        }
        if num_query_groups is not None:
            sizes["num_query_groups"] = num_query_groups
        for name, value in sizes.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size={hidden_size} is not divisible by num_attention_heads={num_attention_heads}"
            )
        groups = num_attention_heads if num_query_groups is None else num_query_groups
        head_dim = hidden_size // num_attention_heads
        qkv_numel = hidden_size * (hidden_size + 2 * groups * head_dim)
        out_numel = hidden_size * hidden_size
        mlp_numel = (3 if gated_mlp else 2) * hidden_size * ffn_hidden_size
        lm_head_numel = hidden_size * vocab_size
        matmul_numel = num_layers * (qkv_numel + out_numel + mlp_numel) + lm_head_numel
        b = 6.0 * matmul_numel
        a = 12.0 * num_layers * hidden_size * (0.5 if causal else 1.0)
        return cls(a=a, b=b)

    @classmethod
    def tokens(cls) -> CostModel:
        """Returns the plain token-count model (``a = 0``, ``b = 1``)."""
        return cls(a=0.0, b=1.0)
