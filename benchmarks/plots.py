"""Plots of the imbalance benchmark: per-rank step timelines (FSDP vs ODC) and a bar chart of the sweep.

Reads the JSON files ``benchmarks/imbalance.py`` writes (``--timeline`` and ``--out``) and writes PNGs:

- ``timeline``: one panel per configuration, one row per rank; the step runs from the barrier (0 s) to the
  end of ``train_step``; coloured spans are the engine's timed waits (fetch wait, push, fence), the DDP
  gradient all-reduce and the optimizer step, and the rest of the row is compute;
- ``bars``: one panel per profile, speedup of each configuration over ``fsdp+lb_micro`` per minibatch size.

matplotlib is optional for the project: without it the tool says how to install it and exits with code 2.

Usage::

    python benchmarks/plots.py timeline TIMELINE.json OUT.png
    python benchmarks/plots.py bars RESULTS.json OUT.png
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

logger = logging.getLogger(__name__)

EVENT_COLOURS = {
    "compute": "#9ecae1",
    "fetch_wait": "#fd8d3c",
    "push": "#e6550d",
    "fence": "#636363",
    "allreduce": "#756bb1",
    "optimizer": "#31a354",
}
CONFIG_ORDER = ("fsdp+lb_micro", "fsdp+local_sort", "odc+lb_micro", "odc+lb_mini", "ddp+lb_mini")


def _pyplot():
    """Imports matplotlib's pyplot with a non-interactive backend, or raises a clear ImportError."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(
            "benchmarks/plots.py needs matplotlib, which is not a project dependency: "
            "pip install matplotlib"
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(timeline: dict, out_path: str) -> None:
    """Per-rank timeline of one step for each configuration in ``timeline`` (see module docstring)."""
    plt = _pyplot()
    configs = list(timeline["configs"])
    horizon = max(r["wall_s"] for c in configs for r in timeline["configs"][c])
    fig, axes = plt.subplots(len(configs), 1, figsize=(10, 1.3 + 1.1 * len(configs)), sharex=True)
    if len(configs) == 1:
        axes = [axes]
    for ax, name in zip(axes, configs):
        ranks = timeline["configs"][name]
        for rank, record in enumerate(ranks):
            y = len(ranks) - 1 - rank
            ax.broken_barh([(0, record["wall_s"])], (y - 0.35, 0.7), color=EVENT_COLOURS["compute"])
            for kind, start, end in record["events"]:
                ax.broken_barh(
                    [(start, max(end - start, horizon * 1e-4))],
                    (y - 0.35, 0.7),
                    color=EVENT_COLOURS.get(kind, "black"),
                )
            counts = len(record["plan"][rank]) if record.get("plan") else "?"
            ax.text(record["wall_s"], y, f" {record['wall_s']:.2f}s, {counts} mb", va="center")
        ax.set_yticks(range(len(ranks)))
        ax.set_yticklabels([f"rank {r}" for r in reversed(range(len(ranks)))])
        ax.set_title(name, loc="left", fontsize=10)
        ax.set_xlim(0, horizon * 1.15)
    axes[-1].set_xlabel("seconds since the step's barrier")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in EVENT_COLOURS.values()]
    fig.legend(
        handles, list(EVENT_COLOURS), loc="upper center", ncol=len(EVENT_COLOURS), fontsize=8
    )
    fig.suptitle(
        f"one step, profile {timeline['profile']}, minibatch {timeline['minibatch_per_rank']}/rank",
        y=0.94,
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def plot_bars(results: dict, out_path: str) -> None:
    """Speedup over ``fsdp+lb_micro`` per configuration and minibatch size, one panel per profile."""
    plt = _pyplot()
    rows = results["rows"]
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    configs = [c for c in CONFIG_ORDER if any(r["config"] == c for r in rows)]
    fig, axes = plt.subplots(1, len(profiles), figsize=(4.2 * len(profiles), 3.6), squeeze=False)
    width = 0.8 / max(len(configs), 1)
    for ax, profile in zip(axes[0], profiles):
        minibatches = sorted({r["minibatch_per_rank"] for r in rows if r["profile"] == profile})
        for k, config in enumerate(configs):
            values = []
            for mb in minibatches:
                match = [
                    r
                    for r in rows
                    if r["profile"] == profile
                    and r["minibatch_per_rank"] == mb
                    and r["config"] == config
                ]
                values.append(match[0].get("speedup_vs_baseline_median", 0.0) if match else 0.0)
            xs = [i + (k - (len(configs) - 1) / 2) * width for i in range(len(minibatches))]
            ax.bar(xs, values, width=width, label=config)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(minibatches)))
        ax.set_xticklabels([str(m) for m in minibatches])
        ax.set_xlabel("minibatch (samples per rank)")
        ax.set_title(profile, fontsize=10)
    axes[0][0].set_ylabel("speedup vs fsdp+lb_micro (median)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the tool; returns the exit code (2 when matplotlib is missing or on a usage error)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=("timeline", "bars"))
    parser.add_argument("input", help="JSON from benchmarks/imbalance.py (--timeline or --out)")
    parser.add_argument("output", help="PNG to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with open(args.input) as f:
        data = json.load(f)
    try:
        if args.kind == "timeline":
            plot_timeline(data, args.output)
        else:
            plot_bars(data, args.output)
    except ImportError as err:
        logger.error("%s", err)
        return 2
    logger.info("wrote %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
