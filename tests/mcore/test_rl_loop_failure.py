"""A rank stopped by the loss-contract check never leaves a peer with no microbatch waiting.

Under the external loop's schedule (``mcore/rl/loop.py``) the contract is checked at a rank's first
microbatch, so a rank given 0 microbatches is already past it, waiting at ODC's fence, when its peer
raises. The refused rank's process ends, as in a real job; the peer's fence then names it as dead
within the shared-memory transport's liveness period, long before ODC's timeout (600 s here).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests._dist import RankFailureError, run_ranks
from tests._megatron import SMALL_GPT
from tests.mcore._rl_loop import mean_loss_forward_step, optimizer_config, samples

FENCE_TIMEOUT_S = 600.0


def _refused_on_rank_0(rank: int, world_size: int, outcomes: str) -> None:
    from megatron_odc.mcore.config import ODCConfig
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from megatron_odc.mcore.rl.loop import build_rl_backend, get_forward_backward_func
    from tests._megatron import init_megatron

    init_megatron(1, seed=5)
    cfg = GPTConfig(**SMALL_GPT, calculate_per_token_loss=False)  # the global_tokens contract
    model, _ = build_rl_backend(
        "odc",
        build_gpt_model(cfg, seed=11),
        optimizer_config(cfg),
        loss_contract="global_tokens",
        odc_config=ODCConfig(timeout_s=FENCE_TIMEOUT_S),
    )
    count = 1 if rank == 0 else 0
    start = time.monotonic()
    try:
        get_forward_backward_func()(
            forward_step_func=mean_loss_forward_step,  # a 3-tuple: refused under global_tokens
            data_iterator=iter(samples(cfg, 0, rank, count)),
            model=[model],
            num_microbatches=count,
            seq_length=cfg.seq_length,
            micro_batch_size=1,
            forward_only=False,
        )
    except Exception as error:
        Path(outcomes, f"rank{rank}").write_text(
            f"{time.monotonic() - start:.1f}\n{type(error).__name__}: {error}"
        )
        raise  # the process ends, as a job's rank does on an error
    Path(outcomes, f"rank{rank}").write_text("0\nno error")


@pytest.mark.timeout(240)
def test_a_refused_rank_ends_and_its_peer_with_no_microbatch_stops_promptly(tmp_path) -> None:
    with pytest.raises(RankFailureError):
        run_ranks(_refused_on_rank_0, 2, str(tmp_path), timeout_s=180, grace_s=120)
    refused = (tmp_path / "rank0").read_text()
    assert "calculate_per_token_loss=False" in refused, refused
    seconds, peer = (tmp_path / "rank1").read_text().split("\n", 1)
    assert "died before reaching the fence" in peer, peer
    assert "rank 0 (pid" in peer, peer
    assert float(seconds) < 30, (seconds, peer)  # the liveness check, not the 600 s timeout
