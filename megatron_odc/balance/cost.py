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

[Note: measured cost model]
The FLOP model holds where attention runs as a compute-bound kernel (FlashAttention, TransformerEngine's
THD, ``scaled_dot_product_attention`` per packed sample on CPU). Elsewhere the quadratic term costs far
more than its FLOPs: an unfused attention materialises the ``s x s`` scores and runs softmax and masking
over them, memory-bound (on 2 CPU cores, 4 layers x 128, fp32, a fit gave ``a / b`` about 40x the FLOP
model's). And a small microbatch costs more than its FLOP share everywhere: a fixed cost per microbatch
(kernel launches, Python, parameter fetches; 15-20 ms on that CPU, against 4-5 ms of per-token cost for a
32-token sample). A plan balanced under the FLOP model then gives the rank with many small microbatches, or the
one with the long samples, more time than it predicts.
:meth:`CostModel.fit` fits ``seconds = a * s**2 + b * s + c`` to timings of single samples (the
forward and backward of one microbatch of ``s`` tokens, ``mcore/cost_probe.py`` measures them) by least
squares on relative errors, with ``a, b, c >= 0``; ``c`` is the fixed cost of a microbatch, returned
beside the model (a plan adds it per microbatch where counts differ).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["CostModel", "describe_fit"]


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
    def fit(cls, lengths: Sequence[int], seconds: Sequence[float]) -> tuple[CostModel, float]:
        """Fits ``seconds = a * s**2 + b * s + c`` to measured single-sample microbatches (see
        [Note: measured cost model]): least squares on relative errors, every coefficient ``>= 0``
        (a negative one is dropped and the rest refitted).

        Args:
            lengths: tokens of each measured microbatch (at least 3 distinct positive values).
            seconds: its measured forward and backward time, aligned with ``lengths``.

        Returns:
            ``(model, c)``: the model in seconds, and the fixed seconds of one microbatch.

        Raises:
            ValueError: too few distinct lengths, a length or time that is not positive, or no
                term left positive (the timings do not grow with the length).
        """
        if len(lengths) != len(seconds):
            raise ValueError(f"{len(lengths)} lengths but {len(seconds)} timings")
        if len({int(s) for s in lengths}) < 3:
            raise ValueError(
                f"fitting a*s^2+b*s+c needs 3 distinct lengths, got {sorted(set(lengths))}"
            )
        bad = [(s, t) for s, t in zip(lengths, seconds, strict=True) if s <= 0 or not t > 0]
        if bad:
            raise ValueError(f"lengths and timings must be positive, got (length, seconds) {bad}")
        # Relative errors: row (s^2, s, 1) / t against the target 1.
        rows = [[s * s / t, s / t, 1.0 / t] for s, t in zip(lengths, seconds, strict=True)]
        terms = [0, 1, 2]
        while terms:
            coef = _least_squares([[row[j] for j in terms] for row in rows])
            if all(c >= 0 for c in coef):
                full = dict.fromkeys(range(3), 0.0) | dict(zip(terms, coef, strict=True))
                if full[0] == 0 and full[1] == 0:
                    break
                return cls(a=full[0], b=full[1]), full[2]
            terms = [j for j, c in zip(terms, coef, strict=True) if c > 0]
        raise ValueError(
            f"timings {list(zip(lengths, seconds, strict=True))} do not grow with the length: no cost "
            "model a*s^2+b*s fits them (measure longer samples)"
        )

    @classmethod
    def tokens(cls) -> CostModel:
        """Returns the plain token-count model (``a = 0``, ``b = 1``)."""
        return cls(a=0.0, b=1.0)


def describe_fit(
    model: CostModel, microbatch_s: float, lengths: Sequence[int], seconds: Sequence[float]
) -> str:
    """One line for a :meth:`CostModel.fit` result in seconds and the timings it was fitted to."""
    probes = ", ".join(f"{s}: {t * 1e3:.1f} ms" for s, t in zip(lengths, seconds, strict=True))
    return (
        f"a={model.a:.3g} s/token^2, b={model.b:.3g} s/token, {microbatch_s * 1e3:.1f} ms per "
        f"microbatch (forward+backward of one sample of {probes})"
    )


def _least_squares(rows: list[list[float]]) -> list[float]:
    """Coefficients x minimising ``sum((row . x - 1)**2)`` (normal equations, Gaussian elimination
    with partial pivoting; at most 3 unknowns, so no numerical library is needed)."""
    n = len(rows[0])
    gram = [[math.fsum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    rhs = [math.fsum(r[i] for r in rows) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(gram[i][col]))
        gram[col], gram[pivot] = gram[pivot], gram[col]
        rhs[col], rhs[pivot] = rhs[pivot], rhs[col]
        if gram[col][col] == 0:
            raise ValueError("the timings' lengths do not determine a*s^2+b*s+c (degenerate fit)")
        for i in range(col + 1, n):
            factor = gram[i][col] / gram[col][col]
            gram[i] = [g - factor * p for g, p in zip(gram[i], gram[col], strict=True)]
            rhs[i] -= factor * rhs[col]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (rhs[i] - math.fsum(gram[i][j] * x[j] for j in range(i + 1, n))) / gram[i][i]
    return x
