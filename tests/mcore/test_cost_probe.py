"""Timing microbatches for a measured cost model (``mcore/cost_probe.py``) on the small GPT, 2 CPU ranks.

Each rank times its own probes (different timings), yet both must fit the same model, or their plans
would differ: the fitted coefficients are bitwise equal across ranks. The probes leave the model's
gradients unset and every random stream (torch's and Megatron's tracker) where it was, so a run that
measures first trains exactly as one that does not. Too short a longest microbatch is refused.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from tests._megatron import SMALL_GPT


def _run(rank: int, world_size: int) -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_odc.balance import CostModel
    from megatron_odc.mcore.cost_probe import probe_lengths, time_microbatches
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from tests._megatron import init_megatron, teardown_megatron

    init_megatron(1, seed=5)
    try:
        cfg = GPTConfig(**{**SMALL_GPT, "seq_length": 256})
        model = build_gpt_model(cfg, seed=3)
        torch.manual_seed(100 + rank)
        before = torch.get_rng_state().clone()
        tracker_before = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
        lengths = probe_lengths(256, points=4)
        seconds = time_microbatches(model, lengths, vocab_size=cfg.vocab_size)
        tracker_after = get_cuda_rng_tracker().get_states()
        fitted, microbatch_s = CostModel.fit(lengths, seconds)
        return {
            "fit": (fitted.a, fitted.b, microbatch_s),
            "seconds": seconds,
            "lengths": tuple(lengths),
            "rng_kept": torch.equal(before, torch.get_rng_state()),
            "tracker_kept": tracker_before.keys() == tracker_after.keys()
            and all(torch.equal(tracker_before[k], tracker_after[k]) for k in tracker_before),
            "grads": [p.grad is None for p in model.parameters()],
        }
    finally:
        teardown_megatron()


def test_every_rank_fits_the_same_model_and_the_run_is_untouched() -> None:
    results = run_ranks(_run, 2, timeout_s=300, pg_timeout_s=60)
    assert results[0]["fit"] == results[1]["fit"]  # bitwise: the same plan on every rank
    assert results[0]["seconds"] == results[1]["seconds"]
    for result in results:
        assert result["lengths"] == (32, 64, 128, 256)
        assert all(t > 0 for t in result["seconds"])
        assert result["rng_kept"]
        assert result["tracker_kept"]
        assert all(result["grads"])


def test_a_longest_microbatch_too_short_to_fit_is_refused() -> None:
    from megatron_odc.mcore.cost_probe import probe_lengths

    with pytest.raises(ValueError, match="at least 128 tokens"):
        probe_lengths(100)
