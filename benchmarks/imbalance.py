"""Imbalance benchmark: real megatron-core GPT training steps under FSDP, ODC and DDP with each plan.

Spawns two CPU ranks (gloo through a file store, one torch thread each), builds the same GPT three times
(``odc`` over the shared-memory transport, ``fsdp`` = the same engine over the collective transport, ``ddp`` =
megatron-core's DDP) and trains them, interleaved, on the same SFT-like minibatches of random tokens:

==============================  =======================================================================
configuration                   what runs
==============================  =======================================================================
``fsdp+lb_micro``               lockstep ZeRO-3 with the microbatch-level balancer (the baseline of every ratio)
``fsdp+local_sort``             lockstep ZeRO-3, one sample per microbatch sorted by length (LongAlign's policy)
``odc+lb_micro``                ODC with the same plan as the baseline (the communication change alone)
``odc+lb_mini``                 ODC with the minibatch-level balancer (uneven microbatch counts)
``odc-all+lb_mini``             the same with ``--odc-unsharded-budget all`` (one fetch and one push per unit per
                                minibatch; unsharded state kept from first use to the fence)
``ddp+lb_mini``                 replicated parameters (megatron-core DDP): the memory upper bound
``fsdp2+lb_micro``              PyTorch FSDP2 (``fully_shard`` per TransformerLayer and the root, reshard after
                                forward), the same plan as the baseline, no gradient sync until the last
                                microbatch
``fsdp2-noreshard+lb_micro``    the same with ``reshard_after_forward=False`` and no reshard after
                                backward until the last microbatch (each unit all-gathered once per minibatch)
``odc-loop+lb_mini``            ``odc+lb_mini`` with its optimizer on torch's per-tensor Adam loop, the kernel
                                before the fused one (only when ``--configs`` names it)
==============================  =======================================================================

The FSDP2 rows are the same GPT (same seed) in fp32, rounded to bf16 when ``--dtype bf16`` (the initial
weights of the other rows' bf16 parameters), wrapped with ``fully_shard(mp_policy=MixedPrecisionPolicy(
param_dtype=<--dtype>, reduce_dtype=fp32))``; ``torch.optim.AdamW`` with the settings megatron's optimizer runs with here (lr
1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.01 on every parameter, as no scheduler applies megatron's
``wd_mult``) and ``clip_grad_norm_(1.0)``. A plain loop over the rank's microbatches runs the model forward, the same
per-token loss sum, divided by the loss tokens of the whole global minibatch (known to every rank from the
plan), and ``backward``; FSDP2 sums the gradients over ranks (divide factor 1), so the gradients equal
megatron's per-token ones.

[Note: workload]
Sample lengths are drawn (seeded) from a profile of ``length_profiles.json`` and divided by ``--length-scale``
(default 16: the paper's 64K cap becomes 4096 tokens). Each rank packs every microbatch of its plan into one
sequence with a block-diagonal causal mask (``megatron_odc.data.packing``); the model's core attention runs
each diagonal block on its own (:class:`SegmentedDotProductAttention`, exact because the off-block scores are
all masked), so attention costs ``sum(s_i**2)`` like varlen flash attention, not ``(sum s_i)**2``. Loss is
per token (``calculate_per_token_loss``). The model (:data:`MODEL`, bf16 in ``Float16Module`` by default) is
sized so that at the longest sample (4096 tokens) the quadratic term is about 60% of the cost (61% by the
FLOP model, 54-66% in fits of measured times), as for the paper's 1.5B at 64K (65% by the FLOP model); see
``docs/benchmarks.md``. Plans use the cost model fitted to this machine (:data:`CPU_COST`, ``--calibrate``).

[Note: what is measured]
- Step time: per rank, from a barrier to the end of ``train_step`` (zero grads, forward/backward of the
  rank's microbatches, gradient sync, optimizer step); the step time is the max over ranks. ``cpu_s`` is the
  rank's main-thread CPU time over the same span (wall - cpu = waiting + time preempted by other load).
- Kernel warm-up: before a repeat's timed steps, each plan's microbatches run forward and backward once
  through an unwrapped copy of the model (untimed, gradients dropped). oneDNN builds a kernel for each new
  GEMM shape (about 3 ms a shape in bf16 on an AMX host); without this the first configuration of each plan
  in a repeat paid that for the rest (0.1-0.3 s of a 1 s step, 2026-12-06).
- Busy/idle per rank: ``odc``/``fsdp``: idle = fetch wait + push + fence time of the engine telemetry
  (for ``fsdp`` these are the blocking collectives, which include waiting for the slower rank; for ``odc``
  they are shared-memory copies plus the per-minibatch fence); ``ddp``: idle = time inside
  ``finalize_model_grads`` (the gradient all-reduce, which waits for the slower rank); ``fsdp2*``: idle =
  time inside FSDP2's all-gathers (``unshard`` / ``wait_for_unshard``) and gradient reductions
  (``post_backward`` / ``finalize_backward``, which include waiting for the slower rank and FSDP2's copies).
  busy = step - idle.
- Memory per rank, in bytes, never RSS: ``state_nbytes`` = persistent model/optimizer state (unique
  storages of parameters, gradient buffers, engine shards and accumulators, fp32 main shards and optimizer
  state) + ``unsharded_peak_nbytes`` (peak of the engine's unsharded parameter and gradient buffers,
  sampled after each fetch and at each backward start); ``activation_peak_nbytes`` = the largest sum over one
  microbatch of the unique storages saved for backward (autograd saved-tensor hooks, parameters excluded);
  ``peak_nbytes`` = the sum of the two. ``fsdp2*``: persistent = local shards of parameters, gradients and
  AdamW state; unsharded peak = unique storages of FSDP2's unsharded parameters (all-gather outputs) and
  unsharded / accumulated gradients, sampled around each all-gather and gradient reduction (for
  ``fsdp2-noreshard`` it reaches the whole model, plus the unsharded gradients kept between
  microbatches); ``None`` if FSDP2's internals cannot be read.

Usage::

    python benchmarks/imbalance.py --quick [--json]
    python benchmarks/imbalance.py [--profiles longalign,uniform] [--minibatches 1,2,4,8] [--repeats 5]
        [--json] [--out results.json] [--timeline timeline.json]

``--json`` writes one JSON object per (profile, minibatch, configuration) line. ``--quick`` runs longalign,
minibatch 4 (unless ``--profiles`` / ``--minibatches`` say otherwise; every other flag applies as given),
5 repeats by default (about 1.1 minutes on an idle 2-core AVX-512 machine in bf16, 5.3 minutes on an AVX2
one in fp32) and ends with a line per cell holding the ratios of ``odc+lb_mini`` to ``fsdp+lb_micro`` and to
``fsdp2+lb_micro``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout: benchmarks.imbalance_lib
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.imbalance_lib.host import (  # noqa: E402
    SLOW_MATMUL_RATIO,
    calibrate,
    matmul_slowdown,
)
from benchmarks.imbalance_lib.report import (  # noqa: E402
    format_rows,
    format_shares,
    paired_bound,
    paired_ratio,
    summarize,
    timeline_records,
)
from benchmarks.imbalance_lib.settings import (  # noqa: E402
    CONFIGS,
    CPU_COST,
    DEFAULT_LENGTH_SCALE,
    DTYPES,
    EXTRA_CONFIGS,
    FULL,
    MODEL,
    PAPER_CAP_TOKENS,
    PROFILES,
    QUICK,
    config_name,
)
from benchmarks.imbalance_lib.world import run_ranks  # noqa: E402

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """Returns the command-line parser."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag in ("profiles", "minibatches"):
        parser.add_argument(f"--{flag}", help=f"default {FULL[flag]} ({QUICK[flag]} with --quick)")
    parser.add_argument(
        "--configs", default=",".join(config_name(*c) for c in CONFIGS), help="backend+plan list"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--length-scale", type=int, default=DEFAULT_LENGTH_SCALE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="longalign, minibatch 4 where --profiles / --minibatches are not given (a few minutes)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per configuration")
    parser.add_argument("--out", help="write the summary rows and raw steps to this JSON file")
    parser.add_argument("--timeline", help="write per-rank events of one step to this JSON file")
    parser.add_argument(
        "--calibrate", action="store_true", help="fit the CPU cost model (a, b in seconds) and exit"
    )
    return parser


def _parse_configs(text: str) -> list[tuple[str, str]]:
    configs = []
    for item in text.split(","):
        backend, _, plan = item.partition("+")
        if (backend, plan) not in CONFIGS + EXTRA_CONFIGS:
            raise ValueError(
                f"--configs entry {item!r} is not one of "
                f"{[config_name(*c) for c in CONFIGS + EXTRA_CONFIGS]}"
            )
        configs.append((backend, plan))
    return configs


def settings_from_args(args: argparse.Namespace) -> dict:
    """The run's settings from the parsed flags (``--quick``'s defaults where a flag is not given).

    Raises:
        ValueError: a ``--profiles``, ``--minibatches`` or ``--configs`` entry or ``--repeats`` is not valid.
    """
    defaults = QUICK if args.quick else FULL
    profiles = (args.profiles or defaults["profiles"]).split(",")
    for p in profiles:
        if p not in PROFILES:
            raise ValueError(f"--profiles entry {p!r} is not one of {PROFILES}")
    minibatches = []
    for m in (args.minibatches or defaults["minibatches"]).split(","):
        if not m.strip().isdigit() or int(m) < 1:
            raise ValueError(f"--minibatches entry {m!r} is not an integer >= 1")
        minibatches.append(int(m))
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats} must be >= 1")
    return {
        "profiles": profiles,
        "minibatches": minibatches,
        "configs": _parse_configs(args.configs),
        "repeats": args.repeats,
        "length_scale": args.length_scale,
        "seed": args.seed,
        "dtype": args.dtype,
        "cost": CPU_COST,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.calibrate:
        cap = PAPER_CAP_TOKENS // args.length_scale
        fit = calibrate([cap // 16, cap // 8, cap // 4, cap // 2, 3 * cap // 4, cap], args.dtype)
        sys.stdout.write(json.dumps(fit) + "\n")
        return 0
    try:
        settings = settings_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    slowdown = matmul_slowdown(args.dtype)
    if slowdown > SLOW_MATMUL_RATIO:
        logger.warning(
            "a %s matmul is %.0fx slower than fp32 on this host (%s): compute dominates and the "
            "ratios are not comparable with other hosts; use --dtype fp32 or a host with AVX-512 BF16",
            args.dtype,
            slowdown,
            torch.backends.cpu.get_cpu_capability(),
        )
    start = time.perf_counter()
    payload = run_ranks(settings)
    elapsed = time.perf_counter() - start
    rows = summarize(payload)
    if args.json:
        for row in rows:
            sys.stdout.write(json.dumps({k: v for k, v in row.items() if k != "step_s"}) + "\n")
    else:
        sys.stdout.write(format_rows(rows) + "\n" + format_shares(rows))
    for row in rows:
        if args.quick and row["config"] == "odc+lb_mini" and "speedup_vs_baseline_median" in row:
            cell = next(
                c
                for c in payload["results"]
                if c["profile"] == row["profile"] and c["minibatch"] == row["minibatch_per_rank"]
            )
            line = {
                "ratio_odc_lb_mini_vs_fsdp_lb_micro": row["speedup_vs_baseline_median"],
                "ratio_odc_lb_mini_vs_fsdp2_lb_micro": paired_ratio(
                    cell["steps"], "fsdp2+lb_micro", "odc+lb_mini"
                ),
                "bound_odc_lb_mini_vs_fsdp2_lb_micro": paired_bound(
                    cell["steps"], "fsdp2+lb_micro", "odc+lb_mini"
                ),
                "profile": row["profile"],
                "minibatch_per_rank": row["minibatch_per_rank"],
                "elapsed_s": elapsed,
            }
            sys.stdout.write((json.dumps(line) if args.json else str(line)) + "\n")
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": elapsed,
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "matmul_slowdown_vs_fp32": slowdown,
        "settings": settings,
        "model": MODEL,
        "torch": torch.__version__,
    }
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "meta": meta,
                    "rows": rows,
                    "results": payload["results"],
                    "comm_probe": payload["comm_probe"],
                }
            )
        )
    if args.timeline:
        names = [
            n
            for n in ("fsdp+lb_micro", "odc+lb_micro", "odc+lb_mini")
            if n in payload["results"][0]["steps"]
        ]
        Path(args.timeline).write_text(json.dumps(timeline_records(payload, names)))
    logger.info("benchmark took %.1f s", elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
