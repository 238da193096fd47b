"""Timing a megatron-core GPT's microbatches on this machine, for a measured balancing cost model.

Owns :func:`time_microbatches` (the forward and backward of one-sample microbatches of a few lengths,
averaged over the ranks so that every rank holds the same numbers) and :func:`probe_lengths`. The
caller fits them with ``balance.CostModel.fit`` (this layer does not import the planner); why a
measured model at all: [Note: measured cost model] in ``balance/cost.py``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_odc.mcore.rng import restored_rng

__all__ = ["probe_lengths", "time_microbatches"]

SHORTEST_PROBE = 32
"""Tokens of the shortest probed microbatch: shorter ones measure only the fixed cost."""


PROBE_POINTS = 12
"""Lengths probed by default. The fit's error on the microbatches a plan builds falls with more of
them: on the GRPO example's model (2 CPU cores), the fit's predicted speedup of LB-Mini's plan over
the padded one exceeded what the same microbatches gave, timed alone, by 1.5-3.2 points with 6
lengths and by 1.4-1.5 with 12; the probe takes about twice as long (a few seconds there)."""


def probe_lengths(longest: int, points: int = PROBE_POINTS) -> list[int]:
    """``points`` lengths from :data:`SHORTEST_PROBE` to ``longest`` tokens, evenly spaced in log."""
    if longest < 4 * SHORTEST_PROBE or points < 3:
        raise ValueError(
            f"measuring a cost model needs a longest microbatch of at least {4 * SHORTEST_PROBE} "
            f"tokens and 3 points, got {longest} tokens and {points} points"
        )
    ratio = (longest / SHORTEST_PROBE) ** (1 / (points - 1))
    return sorted({round(SHORTEST_PROBE * ratio**i) for i in range(points - 1)} | {longest})


def time_microbatches(
    model: torch.nn.Module,
    lengths: Sequence[int],
    *,
    vocab_size: int,
    repeats: int = 2,
    group: dist.ProcessGroup | None = None,
) -> tuple[float, ...]:
    """Seconds of the forward and backward of a one-sample microbatch of each of ``lengths``.

    ``model`` is a plain megatron-core ``GPTModel`` (not wrapped by a DP backend, whose gradient
    hooks would move or sum the probes' gradients), on the device it trains on, with the attention
    it trains with: every probe is a packed THD microbatch of one sample (``cu_seqlens``), as the
    balanced loaders feed it. One unmeasured round over every length, then ``repeats`` measured
    rounds; each length's median counts. Rounds over all lengths, rather than each length's repeats
    in a row, spread a slow spell of the machine (another job, a garbage collection) over the
    lengths instead of charging it to one, which could make the timings shrink with the length. The
    parameters' ``.grad`` are reset to ``None`` and the RNG states restored afterwards.
    Collective over ``group`` (every rank must call it with the same lengths): the result is the
    ranks' mean, the same on every rank, so that every rank fits the same cost model.
    """
    device = next(model.parameters()).device
    times: list[list[float]] = [[] for _ in lengths]
    with restored_rng():
        probes = [_probe(length, vocab_size, device) for length in lengths]
        for measured in [False] + [True] * repeats:
            for i, (tokens, positions, packed) in enumerate(probes):
                _synchronize(device)
                start = time.perf_counter()
                losses = model(tokens, positions, None, labels=tokens, packed_seq_params=packed)
                losses.float().sum().backward()
                _synchronize(device)
                if measured:
                    times[i].append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    seconds = torch.tensor([statistics.median(t) for t in times], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(seconds, group=group)  # the same sum on every rank: the same fit
        seconds /= dist.get_world_size(group)
    return tuple(float(t) for t in seconds)


def _probe(length: int, vocab_size: int, device: torch.device) -> tuple:
    """``(tokens, position ids, PackedSeqParams)`` of a one-sample THD microbatch of ``length``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    tokens = torch.randint(1, vocab_size, (1, length), device=device)
    positions = torch.arange(length, device=device).view(1, -1)
    bounds = torch.tensor([0, length], dtype=torch.int32, device=device)
    packed = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=bounds,
        cu_seqlens_kv=bounds,
        max_seqlen_q=length,
        max_seqlen_kv=length,
    )
    return tokens, positions, packed


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
