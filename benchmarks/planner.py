"""Planner benchmark: how long ``make_plan`` takes at cluster scale, and how balanced its plans are.

Two parts, both on the length profiles shipped in ``megatron_odc/balance/length_profiles.json``:

- **Speed**: for each size ``SAMPLESxRANKS`` (default 1024x64, 4096x256, 16384x1024), one minibatch of
  lengths drawn with replacement from ``--profile`` (``random.Random(samples)``) is planned ``--repeats``
  times with ``lb_mini`` and with ``lb_micro`` (1.5B cost model, cap 65536); the median wall time of each is
  reported beside its target (docs/balancing.md) and the predicted bubble of the plan (ODC bubble for
  ``lb_mini``, lockstep bubble for ``lb_micro``). Every plan is checked (no sample lost or duplicated, no
  microbatch over the cap) and summarised by a digest of its microbatches, so two runs can be compared.
- **Balance** (skip with ``--no-bubbles``): the offline tool's Table 6 setting on every shipped profile
  (8 ranks, 4 samples per rank, cap 65536, 64 minibatches, seed 0) gives the ``odc+lb_mini`` and
  ``collective+lb_micro`` bubbles, printed beside the baseline recorded in ``benchmarks/planner_baseline.json``
  (the planner before its speed work, commit 4a48ec0), with the difference in points.

Usage::

    python benchmarks/planner.py [--sizes 1024x64,4096x256,16384x1024] [--repeats 5] [--json]

With ``--json`` stdout holds one JSON line per size, then one line for the balance part. The exit code is 1
when a target or the balance bound (no worse than the baseline by more than 0.1 points) is missed, and
``--no-targets`` reports without judging (CI's smoke run). To record a new baseline, run the old planner:
``git worktree add /tmp/old 4a48ec0 && PLANNER_COMMIT=4a48ec0 PYTHONPATH=/tmp/old python
benchmarks/planner.py --write-baseline benchmarks/planner_baseline.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

from megatron_odc.balance.plan import make_plan
from megatron_odc.tools.balance_cli import compare_plans
from megatron_odc.tools.presets import preset_cost_model

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
PROFILES_FILE = ROOT / "megatron_odc" / "balance" / "length_profiles.json"
BASELINE_FILE = Path(__file__).with_name("planner_baseline.json")
KINDS = ("lb_mini", "lb_micro")
CAP_TOKENS = 65536
MODEL = "1.5b"
TARGETS_S = {(1024, 64): 0.05, (4096, 256): 0.3, (16384, 1024): 2.0}
"""Median seconds per plan, for lb_mini and lb_micro alike (issue 18)."""
BUBBLE_SLACK = 0.001
"""A profile's bubble may exceed the baseline by at most this (0.1 points)."""
BUBBLE_ROWS = (("odc", "lb_mini"), ("collective", "lb_micro"))


def _parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        samples, _, ranks = item.strip().partition("x")
        if not (samples.isdigit() and ranks.isdigit()) or int(samples) < 1 or int(ranks) < 1:
            raise ValueError(f"--sizes entry {item!r} must be SAMPLESxRANKS, e.g. 1024x64")
        sizes.append((int(samples), int(ranks)))
    return sizes


def _check(plan, lengths: list[int]) -> None:
    """Raises AssertionError if the plan lost or duplicated a sample or broke the cap."""
    ids = sorted(plan.sample_ids())
    assert ids == list(range(len(lengths))), f"{plan.kind}: samples lost or duplicated"
    for mbs in plan.microbatches:
        for mb in mbs:
            assert sum(lengths[i] for i in mb) <= CAP_TOKENS, f"{plan.kind}: {mb} over the cap"


def _digest(plan) -> str:
    return hashlib.sha256(json.dumps(plan.microbatches).encode()).hexdigest()[:16]


def time_size(pool: list[int], samples: int, ranks: int, repeats: int) -> dict:
    """Plans one drawn minibatch ``repeats`` times per kind; medians, bubbles, digests."""
    rng = random.Random(samples)
    lengths = [rng.choice(pool) for _ in range(samples)]
    cost_model = preset_cost_model(MODEL)
    row: dict = {"samples": samples, "ranks": ranks, "target_s": TARGETS_S.get((samples, ranks))}
    for kind in KINDS:
        times, plan = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            plan = make_plan(
                kind,
                list(range(samples)),
                lengths,
                ranks,
                cap_tokens=CAP_TOKENS,
                cost_model=cost_model,
            )
            times.append(time.perf_counter() - start)
        _check(plan, lengths)
        row[f"{kind}_s"] = statistics.median(times)
        row[f"{kind}_bubble"] = plan.bubble_odc() if kind == "lb_mini" else plan.bubble_lockstep()
        row[f"{kind}_microbatches"] = sum(plan.num_microbatches())
        row[f"{kind}_digest"] = _digest(plan)
    target = row["target_s"]
    row["meets_target"] = None if target is None else all(row[f"{k}_s"] <= target for k in KINDS)
    return row


def profile_bubbles(profiles: dict) -> dict:
    """Table 6 setting on every profile: {profile: {"odc+lb_mini": bubble, "collective+lb_micro": ...}}."""
    out = {}
    for name, profile in profiles.items():
        result = compare_plans(
            profile["lengths"],
            dp_size=8,
            minibatch=4,
            cap_tokens=CAP_TOKENS,
            cost_model=preset_cost_model(MODEL),
            num_minibatches=64,
            seed=0,
        )
        rows = {(r["schedule"], r["plan"]): r["bubble"] for r in result["rows"]}
        out[name] = {f"{s}+{k}": rows[(s, k)] for s, k in BUBBLE_ROWS}
    return out


def compare_to_baseline(bubbles: dict, baseline: dict | None) -> dict:
    """Adds the baseline and the difference (points) per profile and row; ``ok`` if within the slack."""
    report: dict = {"setting": "8 ranks x 4 samples, cap 65536, 1.5b, 64 minibatches, seed 0"}
    ok = True
    for name, rows in bubbles.items():
        for row, value in rows.items():
            base = None if baseline is None else baseline.get(name, {}).get(row)
            entry = {"now": value, "baseline": base}
            if base is not None:
                entry["delta_points"] = 100 * (value - base)
                ok = ok and value <= base + BUBBLE_SLACK
            report.setdefault(name, {})[row] = entry
    report["within_0.1_points"] = ok if baseline is not None else None
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024x64,4096x256,16384x1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", default="longalign", help="profile of the timed minibatches")
    parser.add_argument("--no-bubbles", action="store_true", help="skip the balance part")
    parser.add_argument("--no-speed", action="store_true", help="skip the speed part")
    parser.add_argument("--no-targets", action="store_true", help="report without judging")
    parser.add_argument("--json", action="store_true", help="JSON lines on stdout")
    parser.add_argument(
        "--write-baseline",
        metavar="FILE",
        help="write this planner's bubbles as a baseline and stop",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    sizes = _parse_sizes(args.sizes)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    profiles = json.loads(PROFILES_FILE.read_text())
    if args.profile not in profiles:
        raise ValueError(f"--profile {args.profile!r} is not one of {sorted(profiles)}")
    if args.write_baseline:
        baseline = {
            "planner": os.environ.get("PLANNER_COMMIT", "unknown"),
            "bubbles": profile_bubbles(profiles),
        }
        Path(args.write_baseline).write_text(json.dumps(baseline, indent=1) + "\n")
        return 0
    failed = False
    logger.info("load average %s, %d CPUs", os.getloadavg(), os.cpu_count())
    if not args.no_speed:
        logger.info(
            "%-12s %10s %10s %8s %9s %9s", "size", "lb_mini", "lb_micro", "target", "bub mini",
            "bub micro",
        )  # fmt: skip
        for samples, ranks in sizes:
            row = time_size(profiles[args.profile]["lengths"], samples, ranks, args.repeats)
            row["load_average"] = os.getloadavg()[0]
            failed = failed or row["meets_target"] is False
            target = "-" if row["target_s"] is None else f"{row['target_s']:.3f}s"
            logger.info(
                "%-12s %9.3fs %9.3fs %8s %8.2f%% %8.2f%%%s", f"{samples}x{ranks}", row["lb_mini_s"],
                row["lb_micro_s"], target, 100 * row["lb_mini_bubble"], 100 * row["lb_micro_bubble"],
                "  MISSED" if row["meets_target"] is False else "",
            )  # fmt: skip
            if args.json:
                print(json.dumps(row), flush=True)
    if not args.no_bubbles:
        baseline = (
            json.loads(BASELINE_FILE.read_text())["bubbles"] if BASELINE_FILE.is_file() else None
        )
        report = compare_to_baseline(profile_bubbles(profiles), baseline)
        failed = failed or report["within_0.1_points"] is False
        for name in profiles:
            for row, entry in report[name].items():
                base = "-" if entry["baseline"] is None else f"{100 * entry['baseline']:.2f}%"
                logger.info(
                    "%-10s %-20s now %6.2f%%  baseline %7s", name, row, 100 * entry["now"], base
                )
        if args.json:
            print(json.dumps({"bubbles": report}), flush=True)
    return 1 if failed and not args.no_targets else 0


if __name__ == "__main__":
    raise SystemExit(main())
