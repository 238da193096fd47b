"""Offline planner: ``python -m megatron_odc.balance``, the predicted bubble rates of every plan kind.

Owns the command line only: it draws minibatches from a length profile (or a lengths file) after a seeded
shuffle, plans each with every kind of :data:`~megatron_odc.balance.plan.PLAN_KINDS`, and writes a table (or
``--json``) of the bubble rate each (schedule, plan) pair would have under the cost model, as in the ODC
paper's Table 6. See ``docs/balancing.md``. Example::

    python -m megatron_odc.balance --profile longalign --dp 8 --minibatch 4 --cap 65536 --model 1.5b
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence

from megatron_odc.balance.cost import CostModel
from megatron_odc.balance.partition import karmarkar_karp, part_costs
from megatron_odc.balance.plan import PLAN_KINDS, TOO_LONG_POLICIES, Plan, make_plan
from megatron_odc.balance.profiles import (
    load_lengths_file,
    load_profile_lengths,
    minibatch_sample_ids,
)

__all__ = ["MODEL_PRESETS", "build_parser", "main", "reference_lb_micro", "simulate"]

# DeepSeek-R1-Distill-Qwen sizes (Qwen2 architecture: gated MLP, GQA), as used in the ODC paper.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "1.5b": {
        "num_layers": 28,
        "hidden_size": 1536,
        "ffn_hidden_size": 8960,
        "num_attention_heads": 12,
        "num_query_groups": 2,
        "vocab_size": 151936,
    },
    "7b": {
        "num_layers": 28,
        "hidden_size": 3584,
        "ffn_hidden_size": 18944,
        "num_attention_heads": 28,
        "num_query_groups": 4,
        "vocab_size": 152064,
    },
    "14b": {
        "num_layers": 48,
        "hidden_size": 5120,
        "ffn_hidden_size": 13824,
        "num_attention_heads": 40,
        "num_query_groups": 8,
        "vocab_size": 152064,
    },
    "32b": {
        "num_layers": 64,
        "hidden_size": 5120,
        "ffn_hidden_size": 27648,
        "num_attention_heads": 40,
        "num_query_groups": 8,
        "vocab_size": 152064,
    },
}

# (schedule, plan kind) rows of the report. "collective" = lockstep bubble, "odc" = ODC bubble.
# "lb_micro_ref" is the sail-sg/odc code's equal-count LB-Micro (see reference_lb_micro).
ROWS = (
    ("collective", "local_sort"),
    ("odc", "local_sort"),
    ("collective", "round_robin"),
    ("odc", "round_robin"),
    ("collective", "lb_micro"),
    ("odc", "lb_micro"),
    ("collective", "lb_micro_ref"),
    ("odc", "lb_micro_ref"),
    ("collective", "lb_mini"),
    ("odc", "lb_mini"),
)


def reference_lb_micro(plan: Plan) -> Plan | None:
    """Re-plans ``plan``'s samples the way sail-sg/odc's ``DynamicSameMicro`` packing does (for comparison).

    KK with equal sample counts splits the minibatch over the ranks; every rank then splits its share with KK
    into k microbatches, where k starts at the max over ranks of ceil(tokens / cap) and grows until every
    rank's split is under the cap; microbatches are ordered heaviest first. It balances at rank level first,
    so it is a weaker baseline than ``lb_micro`` (which balances microbatches over the whole minibatch).

    Returns:
        A plan of kind ``lb_micro`` over the same samples and planned lengths, or ``None`` when a sample is
        longer than the cap.
    """
    ids = sorted(plan.lengths)
    lengths = [plan.lengths[s] for s in ids]
    cap = plan.cap_tokens
    if cap is not None and any(length > cap for length in lengths):
        return None
    costs = plan.cost_model.costs(lengths)
    shares = karmarkar_karp(costs, plan.dp_size, equal_count=True)
    k = 1
    if cap is not None:
        k = max(1, *(math.ceil(sum(lengths[i] for i in share) / cap) for share in shares))
    while True:
        splits = []
        for share in shares:
            parts = karmarkar_karp([costs[i] for i in share], k)
            splits.append([[share[j] for j in part] for part in parts])
        if cap is None or all(sum(lengths[i] for i in mb) <= cap for s in splits for mb in s):
            break
        k += 1
    microbatches = tuple(
        tuple(
            tuple(ids[i] for i in mb)
            for mb in sorted(
                split, key=lambda mb: (-part_costs(costs, [mb])[0], min(mb, default=0))
            )
        )
        for split in splits
    )
    return dataclasses.replace(plan, kind="lb_micro", microbatches=microbatches)


@dataclasses.dataclass
class _RowStats:
    """Accumulates one report row over minibatches."""

    time: float = 0.0  # sum over minibatches of N * schedule time
    idle: float = 0.0  # sum over minibatches of idle rank-time
    bubbles: list = dataclasses.field(default_factory=list)
    imbalance: list = dataclasses.field(default_factory=list)
    mb_counts: list = dataclasses.field(default_factory=list)
    rank_tokens: list = dataclasses.field(default_factory=list)
    max_rank_tokens: list = dataclasses.field(default_factory=list)

    def add(self, plan: Plan, schedule: str) -> None:
        costs = plan.rank_costs()
        span = plan.lockstep_time() if schedule == "collective" else max(costs)
        self.time += plan.dp_size * span
        self.idle += plan.dp_size * span - math.fsum(costs)
        self.bubbles.append(
            plan.bubble_lockstep() if schedule == "collective" else plan.bubble_odc()
        )
        mean = math.fsum(costs) / plan.dp_size
        self.imbalance.append(max(costs) / mean if mean > 0 else 1.0)
        self.mb_counts.extend(plan.num_microbatches())
        tokens = plan.rank_tokens()
        self.rank_tokens.extend(tokens)
        self.max_rank_tokens.append(max(tokens))

    def summary(self) -> dict:
        def mean(values):
            return math.fsum(values) / len(values)

        return {
            "bubble": self.idle / self.time if self.time > 0 else 0.0,
            "bubble_mean": mean(self.bubbles),
            "max_over_mean_cost": mean(self.imbalance),
            "microbatches_per_rank": {
                "mean": mean(self.mb_counts),
                "min": min(self.mb_counts),
                "max": max(self.mb_counts),
            },
            "tokens_per_rank": {"mean": mean(self.rank_tokens), "max": mean(self.max_rank_tokens)},
        }


def simulate(
    lengths: Sequence[int],
    *,
    dp_size: int,
    minibatch: int,
    cap_tokens: int | None,
    cost_model: CostModel,
    num_minibatches: int = 64,
    seed: int = 0,
    too_long: str = "error",
) -> dict:
    """Plans ``num_minibatches`` consecutive minibatches of the shuffled lengths with every plan kind.

    Args:
        lengths: the length pool (e.g. a profile).
        dp_size: DP ranks N.
        minibatch: samples per rank per minibatch (the global minibatch is ``dp_size * minibatch``).
        cap_tokens: token cap per microbatch or ``None``.
        cost_model: per-sample cost model.
        num_minibatches: minibatches to draw.
        seed: seed of the shuffle (``random.Random(seed).shuffle``).
        too_long: policy for samples longer than the cap (see :func:`make_plan`).

    Returns:
        A JSON-ready dict: ``config`` and ``rows`` (one per (schedule, plan), see :data:`ROWS`); each row's
        ``bubble`` is total idle rank-time / total rank-time over all minibatches, ``bubble_mean`` the mean of
        the per-minibatch rates.

    Raises:
        ValueError: an argument is invalid or the pool is too small.
    """
    if dp_size < 1 or minibatch < 1 or num_minibatches < 1:
        raise ValueError(
            f"--dp, --minibatch and --num-minibatches must be >= 1, got {dp_size}, {minibatch}, "
            f"{num_minibatches}"
        )
    global_batch = dp_size * minibatch
    minibatches = minibatch_sample_ids(len(lengths), global_batch, num_minibatches, seed)
    stats = {row: _RowStats() for row in ROWS}
    for ids in minibatches:
        batch_lengths = [lengths[i] for i in ids]
        plans: dict[str, Plan | None] = {
            kind: make_plan(
                kind,
                ids,
                batch_lengths,
                dp_size,
                cap_tokens=cap_tokens,
                cost_model=cost_model,
                too_long=too_long,
            )
            for kind in PLAN_KINDS
        }
        plans["lb_micro_ref"] = reference_lb_micro(plans["lb_micro"])
        for schedule, kind in ROWS:
            if plans[kind] is not None:
                stats[(schedule, kind)].add(plans[kind], schedule)
    rows = []
    for (schedule, kind), row_stats in stats.items():
        if row_stats.bubbles:
            rows.append({"schedule": schedule, "plan": kind, **row_stats.summary()})
    return {
        "config": {
            "dp_size": dp_size,
            "minibatch_per_rank": minibatch,
            "global_minibatch": global_batch,
            "cap_tokens": cap_tokens,
            "num_minibatches": num_minibatches,
            "seed": seed,
            "too_long": too_long,
            "cost_model": {"a": cost_model.a, "b": cost_model.b},
        },
        "rows": rows,
    }


def format_table(result: dict) -> str:
    """Renders :func:`simulate`'s result as a text table."""
    cfg = result["config"]
    lines = [
        f"dp={cfg['dp_size']} minibatch/rank={cfg['minibatch_per_rank']} cap={cfg['cap_tokens']} "
        f"minibatches={cfg['num_minibatches']} seed={cfg['seed']} "
        f"cost=a*s^2+b*s a={cfg['cost_model']['a']:.6g} b={cfg['cost_model']['b']:.6g}",
        f"{'schedule+plan':<25}{'bubble%':>9}{'mean%':>8}{'max/mean':>10}{'mb/rank mean':>14}"
        f"{'min':>5}{'max':>5}{'tokens/rank':>13}{'max rank':>10}",
    ]
    for row in result["rows"]:
        mbs, tokens = row["microbatches_per_rank"], row["tokens_per_rank"]
        lines.append(
            f"{row['schedule'] + '+' + row['plan']:<25}{100 * row['bubble']:>9.2f}"
            f"{100 * row['bubble_mean']:>8.2f}{row['max_over_mean_cost']:>10.3f}{mbs['mean']:>14.2f}"
            f"{mbs['min']:>5}{mbs['max']:>5}{tokens['mean']:>13.0f}{tokens['max']:>10.0f}"
        )
    lines.append(
        "bubble% = idle / total rank-time over all minibatches; mean% = mean of per-minibatch rates; "
        "collective = lockstep schedule, odc = one sync per minibatch"
    )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """Returns the command-line parser."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_odc.balance",
        description="Predicted bubble rates of the balancing plans under a cost model (ODC Table 6).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lengths", help="file with one length per line, or a JSON list")
    source.add_argument("--profile", help="profile name in the profiles file (e.g. longalign)")
    parser.add_argument(
        "--profiles-file",
        help="profile JSON (default: $MEGATRON_ODC_PROFILES or <repo>/../shared/data/length_profiles.json)",
    )
    parser.add_argument("--dp", type=int, required=True, help="DP size N")
    parser.add_argument(
        "--minibatch", type=int, required=True, help="samples per rank per minibatch"
    )
    parser.add_argument("--cap", type=int, default=65536, help="tokens per microbatch; 0 = no cap")
    parser.add_argument("--num-minibatches", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--too-long", choices=TOO_LONG_POLICIES, default="error")
    parser.add_argument(
        "--model",
        choices=sorted(MODEL_PRESETS),
        default="1.5b",
        help="FLOP cost model preset (DeepSeek-R1-Distill-Qwen sizes)",
    )
    parser.add_argument(
        "--cost-a", type=float, help="explicit quadratic coefficient (with --cost-b)"
    )
    parser.add_argument("--cost-b", type=float, help="explicit linear coefficient (with --cost-a)")
    parser.add_argument("--json", action="store_true", help="write JSON instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the tool; returns the exit code (2 on a usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.cost_a is None) != (args.cost_b is None):
        parser.error("--cost-a and --cost-b go together")
    try:
        if args.cost_a is not None:
            cost_model = CostModel(a=args.cost_a, b=args.cost_b)
        else:
            cost_model = CostModel.from_model_config(**MODEL_PRESETS[args.model], gated_mlp=True)
        if args.lengths is not None:
            lengths = load_lengths_file(args.lengths)
        else:
            lengths = load_profile_lengths(args.profile, args.profiles_file)
        if args.cap < 0:
            raise ValueError(f"--cap must be >= 0, got {args.cap}")
        result = simulate(
            lengths,
            dp_size=args.dp,
            minibatch=args.minibatch,
            cap_tokens=args.cap or None,
            cost_model=cost_model,
            num_minibatches=args.num_minibatches,
            seed=args.seed,
            too_long=args.too_long,
        )
    except ValueError as err:
        parser.error(str(err))
    result["config"]["source"] = args.lengths or f"profile:{args.profile}"
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    else:
        sys.stdout.write(format_table(result))
    return 0
