"""Offline planner: ``python -m megatron_odc.balance``, predicted bubble rates of every plan kind.

Owns the command line (:func:`build_parser`, :func:`main`) and the comparison it prints
(:func:`compare_plans`, :func:`format_table`): it draws minibatches from a length profile (or a
lengths file) after a seeded shuffle, plans each with every kind of
:data:`~megatron_odc.balance.plan.PLAN_KINDS` (and the reference LB-Micro of
:mod:`megatron_odc.tools.reference`), and writes a table (or ``--json``) of the bubble rate each
(schedule, plan) pair would have under the cost model, as in the ODC paper's Table 6. See
``docs/balancing.md``. Example::

    python -m megatron_odc.balance --profile longalign --dp 8 --minibatch 4 --cap 65536 --model 1.5b
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Sequence

from megatron_odc.balance.cost import CostModel
from megatron_odc.balance.plan import PLAN_KINDS, TOO_LONG_POLICIES, Plan, make_plan
from megatron_odc.balance.profiles import minibatch_sample_ids
from megatron_odc.tools.cli_args import (
    draw_options,
    explicit_cost_model,
    lengths_from_args,
    non_negative_float,
)
from megatron_odc.tools.presets import MODEL_PRESETS, preset_cost_model
from megatron_odc.tools.reference import reference_lb_micro

__all__ = ["ROWS", "build_parser", "compare_plans", "format_table", "main"]

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


def compare_plans(
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
    """Plans ``num_minibatches`` consecutive minibatches of shuffled lengths with each plan kind.

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
        A JSON-ready dict: ``config`` and ``rows`` (one per (schedule, plan), see :data:`ROWS`);
        each row's ``bubble`` is total idle rank-time / total rank-time over all minibatches,
        ``bubble_mean`` the mean of the per-minibatch rates.

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
        plans: dict[str, Plan] = {
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
            stats[(schedule, kind)].add(plans[kind], schedule)
    rows = [
        {"schedule": schedule, "plan": kind, **row_stats.summary()}
        for (schedule, kind), row_stats in stats.items()
    ]
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
    """Renders :func:`compare_plans`'s result as a text table."""
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
            f"{100 * row['bubble_mean']:>8.2f}{row['max_over_mean_cost']:>10.3f}"
            f"{mbs['mean']:>14.2f}"
            f"{mbs['min']:>5}{mbs['max']:>5}{tokens['mean']:>13.0f}{tokens['max']:>10.0f}"
        )
    lines.append(
        "bubble% = idle / total rank-time over all minibatches; "
        "mean% = mean of per-minibatch rates; "
        "collective = lockstep schedule, odc = one sync per minibatch"
    )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """Returns the command-line parser."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_odc.balance",
        description=(
            "Predicted bubble rates of the balancing plans under a cost model (ODC Table 6)."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lengths", help="file with one length per line, or a JSON list")
    source.add_argument("--profile", help="profile name in the profiles file (e.g. longalign)")
    parser.add_argument(
        "--profiles-file",
        help=(
            "profile JSON (default: $MEGATRON_ODC_PROFILES, else the profiles shipped in "
            "megatron_odc/balance/length_profiles.json)"
        ),
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
        "--cost-a", type=non_negative_float, help="explicit quadratic coefficient (with --cost-b)"
    )
    parser.add_argument(
        "--cost-b", type=non_negative_float, help="explicit linear coefficient (with --cost-a)"
    )
    parser.add_argument("--json", action="store_true", help="write JSON instead of a table")
    return parser


# make_plan's error for a sample over the cap with too_long="error", worded for Python callers.
_TOO_LONG_ERROR = re.compile(
    r"sample (\d+) has length (\d+) > cap_tokens=(\d+); pass too_long='truncate' or too_long='alone'"
)


def _cli_message(err: ValueError, args: argparse.Namespace) -> str:
    """``err``'s message in terms of this command line (flags, not keyword arguments)."""
    match = _TOO_LONG_ERROR.fullmatch(str(err))
    if match is None:
        return str(err)
    sid, length, cap = (int(group) for group in match.groups())
    source = args.lengths if args.lengths is not None else f"profile {args.profile!r}"
    return (
        f"{source}: item {sid + 1} has length {length} > --cap {cap}; pass --too-long truncate "
        "or --too-long alone, or a larger --cap"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the tool; returns the exit code (2 on a usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cost_model = explicit_cost_model(args)
        if cost_model is None:
            cost_model = preset_cost_model(args.model)
        lengths = lengths_from_args(args)
        result = compare_plans(
            lengths, cost_model=cost_model, too_long=args.too_long, **draw_options(args)
        )
    except ValueError as err:
        parser.error(_cli_message(err, args))
    result["config"]["source"] = args.lengths or f"profile:{args.profile}"
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    else:
        sys.stdout.write(format_table(result))
    return 0
