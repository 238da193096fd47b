"""``--balance-cost``: the cost model the balanced loader plans Megatron-LM's records with.

Owns :func:`balance_cost` and :func:`megatron_lm_cost_model`: ``flops`` is ``CostModel.from_model_config``
of the run's GPT (no fixed cost per microbatch); ``measured`` builds a plain GPT of the run's shape on the CPU runtime's local attention
(``mcore/model.py``), times one-sample microbatches from 32 tokens to the microbatch cap on every rank
(``mcore/cost_probe.py``, averaged over every rank of the job so that every rank plans alike), fits
``CostModel.fit`` and discards the model; its fixed cost per microbatch lets LB-Mini weigh a rank of
many short microbatches against a rank of one long one ([Note: microbatch overhead] in
``balance/plan.py``; why: [Note: measured cost model] in ``balance/cost.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_odc.balance.cost import CostModel, describe_fit

logger = logging.getLogger(__name__)


def megatron_lm_cost_model(args: Any) -> CostModel:
    """The FLOP cost model of Megatron-LM's GPT from its args (``CostModel.from_model_config``, the
    plugin's entry's model)."""
    return CostModel.from_model_config(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=getattr(args, "padded_vocab_size", None) or args.vocab_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        gated_mlp=bool(args.swiglu),
    )


def balance_cost(args: Any, cap_tokens: int) -> tuple[CostModel, float]:
    """``(cost model, fixed cost per microbatch)`` for ``--balance-cost`` (in the cost model's units).

    Raises:
        ValueError: ``measured`` outside the CPU runtime (on GPUs the FLOP model describes
            TransformerEngine's attention, which the probe's local attention is not).
    """
    if getattr(args, "balance_cost", "flops") != "measured":
        return megatron_lm_cost_model(args), 0.0
    from megatron_odc.integration.cpu import active_cpu_patches

    if active_cpu_patches() is None:
        raise ValueError(
            "--balance-cost measured times the CPU runtime's local attention; on GPUs use "
            "--balance-cost flops (TransformerEngine's attention costs its FLOPs)"
        )
    from megatron_odc.mcore.cost_probe import probe_lengths, time_microbatches
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from megatron_odc.mcore.rng import restored_rng

    vocab_size = getattr(args, "padded_vocab_size", None) or args.vocab_size
    # build_gpt_model reseeds: the run's streams stay where Megatron-LM left them
    with restored_rng():
        model = build_gpt_model(GPTConfig.from_args(args, vocab_size=vocab_size), seed=args.seed)
    lengths = probe_lengths(cap_tokens)
    seconds = time_microbatches(model, lengths, vocab_size=vocab_size)
    del model
    try:
        cost_model, microbatch_s = CostModel.fit(lengths, seconds)
    except ValueError as error:
        raise ValueError(
            f"--balance-cost measured: {error}; on this machine the model's microbatch times "
            "do not resolve its cost by length: use --balance-cost flops"
        ) from None
    logger.info(
        "--balance-cost measured (mean over every rank): %s",
        describe_fit(cost_model, microbatch_s, lengths, seconds),
    )
    return cost_model, microbatch_s
