"""The benchmark's results as rows: medians, paired ratios and bounds, memory, the text table, timelines."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from benchmarks.imbalance_lib.settings import BASELINE, LOCKSTEP_BACKENDS, WORLD_SIZE


def summarize(payload: dict) -> list[dict]:
    """One row per (profile, minibatch, configuration): medians, ratios, busy/idle, memory."""
    rows = []
    state = payload["state_nbytes"]
    for cell in payload["results"]:
        steps = cell["steps"]
        base = steps.get(BASELINE)
        for name, repeats in steps.items():
            backend = name.split("+")[0]
            step_s = [max(r["wall_s"] for r in ranks) for ranks in repeats]
            samples = [len(ranks[0]["lengths"]) for ranks in repeats]
            tokens = [sum(r["num_tokens"] for r in ranks) for ranks in repeats]
            row = {
                "profile": cell["profile"],
                "minibatch_per_rank": cell["minibatch"],
                "config": name,
                "backend": backend,
                "plan": name.split("+")[1],
                "num_repeats": len(repeats),
                "step_s_median": statistics.median(step_s),
                "step_s": step_s,
                "samples_per_s": sum(samples) / sum(step_s),
                "tokens_per_s": sum(tokens) / sum(step_s),
                "busy_fraction_per_rank": [
                    statistics.median(1 - r[rank]["idle_s"] / r[rank]["wall_s"] for r in repeats)
                    for rank in range(WORLD_SIZE)
                ],
                "cpu_s_per_rank": [
                    statistics.median(r[rank].get("cpu_s", math.nan) for r in repeats)
                    for rank in range(WORLD_SIZE)
                ],
                "microbatches_per_rank": [
                    statistics.median(r[rank]["num_microbatches"] for r in repeats)
                    for rank in range(WORLD_SIZE)
                ],
                "event_share_per_rank": [
                    event_shares([r[rank] for r in repeats]) for rank in range(WORLD_SIZE)
                ],
                "plan_bubble": statistics.mean(
                    r[0][
                        "plan_bubble_lockstep"
                        if backend in LOCKSTEP_BACKENDS
                        else "plan_bubble_odc"
                    ]
                    for r in repeats
                ),
            }
            if base is not None:
                base_s = [max(r["wall_s"] for r in ranks) for ranks in base]
                ratios = [b / s for b, s in zip(base_s, step_s)]
                row["speedup_vs_baseline_median"] = statistics.median(ratios)
                row["speedup_bound_vs_baseline_median"] = paired_bound(steps, BASELINE, name)
                row["speedup_vs_baseline_of_medians"] = statistics.median(
                    base_s
                ) / statistics.median(step_s)
                row["speedup_vs_baseline_total"] = sum(base_s) / sum(step_s)
            mem = []
            for rank in range(WORLD_SIZE):
                peaks = [r[rank]["unsharded_peak_nbytes"] for r in repeats]
                unsharded = None if None in peaks else max(peaks)  # None: not measurable
                activations = max(r[rank]["activation_peak_nbytes"] for r in repeats)
                persistent = state[rank][backend]
                total = None if unsharded is None else persistent + unsharded
                mem.append(
                    {
                        "persistent_nbytes": persistent,
                        "unsharded_peak_nbytes": unsharded,
                        "state_nbytes": total,
                        "activation_peak_nbytes": activations,
                        "peak_nbytes": None if total is None else total + activations,
                    }
                )
            row["memory_per_rank"] = mem
            rows.append(row)
    return rows


EVENT_KINDS = ("fetch_wait", "push", "fence", "allreduce", "optimizer")
"""The timed events of a step (``probes.py``, ``fsdp2.py``): fetch waits (FSDP2: all-gathers), pushes
(FSDP2: gradient reductions), ODC's fence, DDP's all-reduce, the optimizer step."""


def event_shares(records: Sequence[dict]) -> dict[str, float]:
    """Median over one rank's repeats of each event kind's share of its step; overlapping events of
    one kind (nested calls) count once. Kinds the backend never records are left out."""
    kinds = [k for k in EVENT_KINDS if any(e[0] == k for r in records for e in r["events"])]
    shares = {}
    for kind in kinds:
        per_repeat = []
        for record in records:
            covered, reach = 0.0, -math.inf
            for start, end in sorted((s, e) for name, s, e in record["events"] if name == kind):
                covered += max(0.0, end - max(start, reach))
                reach = max(reach, end)
            per_repeat.append(covered / record["wall_s"])
        shares[kind] = statistics.median(per_repeat)
    return shares


def format_shares(rows: list[dict]) -> str:
    """Where each configuration's step goes: :func:`event_shares` per rank, the rest compute."""
    lines = [
        f"{'profile':<10}{'mb':>3} {'config':<27}"
        + "".join(f"{k:>16}" for k in EVENT_KINDS)
        + f"{'rest':>16}"
    ]
    for row in rows:
        shares = row["event_share_per_rank"]
        cells = [
            "/".join(f"{100 * s[k]:.1f}" for s in shares) if k in shares[0] else ""
            for k in EVENT_KINDS
        ]
        rest = "/".join(f"{100 * (1 - sum(s.values())):.1f}" for s in shares)
        lines.append(
            f"{row['profile']:<10}{row['minibatch_per_rank']:>3} {row['config']:<27}"
            + "".join(f"{c:>16}" for c in cells)
            + f"{rest:>16}"
        )
    lines.append(
        "% of the step per rank (r0/r1), median over repeats; fsdp2*: fetch_wait = all-gathers, "
        "push = gradient reductions; rest = compute and framework"
    )
    return "\n".join(lines) + "\n"


def paired_ratio(steps: dict, numerator: str, denominator: str) -> float | None:
    """Median over repeats of (``numerator``'s step time / ``denominator``'s), paired per repeat."""
    if numerator not in steps or denominator not in steps:
        return None
    num = [max(r["wall_s"] for r in ranks) for ranks in steps[numerator]]
    den = [max(r["wall_s"] for r in ranks) for ranks in steps[denominator]]
    return statistics.median(n / d for n, d in zip(num, den))


def paired_bound(steps: dict, peer: str, config: str) -> float | None:
    """The most ``config`` could gain over ``peer`` without doing less work: the median over repeats
    of (``peer``'s step time / the mean over ranks of ``config``'s busy time), paired per repeat.

    Busy = wall - idle (compute, optimizer step and framework time; idle is the communication and
    waiting of [Note: what is measured] in ``benchmarks/imbalance.py``). A step with no communication
    and the work split perfectly evenly would take that mean, so a ratio to ``peer`` above this bound
    needs faster compute."""
    if peer not in steps or config not in steps:
        return None
    ratios = []
    for peer_ranks, ranks in zip(steps[peer], steps[config]):
        balanced_busy_s = statistics.fmean(r["wall_s"] - r["idle_s"] for r in ranks)
        ratios.append(max(r["wall_s"] for r in peer_ranks) / balanced_busy_s)
    return statistics.median(ratios)


def format_rows(rows: list[dict]) -> str:
    """A text table of :func:`summarize`'s rows."""
    mib = 1024.0 * 1024.0
    lines = [
        f"{'profile':<10}{'mb':>3} {'config':<27}{'step s':>8}{'speedup':>9}{'bound':>7}{'samples/s':>10}"
        f"{'tokens/s':>10}{'busy r0/r1':>12}{'mbs r0/r1':>10}{'state MiB':>10}{'act MiB':>9}"
        f"{'bubble%':>8}"
    ]
    for row in rows:
        mem = max(row["memory_per_rank"], key=lambda m: m["state_nbytes"] or 0)
        state_mib = math.nan if mem["state_nbytes"] is None else mem["state_nbytes"] / mib
        busy = "/".join(f"{b:.2f}" for b in row["busy_fraction_per_rank"])
        counts = "/".join(f"{c:g}" for c in row["microbatches_per_rank"])
        lines.append(
            f"{row['profile']:<10}{row['minibatch_per_rank']:>3} {row['config']:<27}"
            f"{row['step_s_median']:>8.3f}{row.get('speedup_vs_baseline_median', math.nan):>9.3f}"
            f"{row.get('speedup_bound_vs_baseline_median', math.nan):>7.3f}"
            f"{row['samples_per_s']:>10.2f}{row['tokens_per_s']:>10.0f}{busy:>12}{counts:>10}"
            f"{state_mib:>10.2f}{mem['activation_peak_nbytes'] / mib:>9.2f}"
            f"{100 * row['plan_bubble']:>8.1f}"
        )
    lines.append(
        "speedup = median over repeats of (fsdp+lb_micro step time / this step time), same samples; "
        "bound = the same over this configuration's busy time split evenly over the ranks (no "
        "communication, perfect balance); state = persistent + unsharded peak (max rank); bubble = "
        "cost-model bubble of the plan"
    )
    return "\n".join(lines) + "\n"


def timeline_records(payload: dict, configs: Sequence[str]) -> dict:
    """Per-rank events of one step of the first cell for each of ``configs`` (for the timeline plot).

    The step shown is the repeat where the plans differ most: the largest ratio of the baseline plan's
    lockstep time to ``odc+lb_mini``'s plan time (the first repeat if either is missing).
    """
    cell = payload["results"][0]
    steps = cell["steps"]
    repeat = 0
    if BASELINE in steps and "odc+lb_mini" in steps:
        gains = [
            base[0]["plan_time_lockstep"] / max(mini[0]["plan_time_odc"], 1e-12)
            for base, mini in zip(steps[BASELINE], steps["odc+lb_mini"])
        ]
        repeat = max(range(len(gains)), key=gains.__getitem__)
    out = {
        "profile": cell["profile"],
        "minibatch_per_rank": cell["minibatch"],
        "repeat": repeat,
        "configs": {},
    }
    for name in configs:
        ranks = steps[name][repeat]
        out["configs"][name] = [
            {"wall_s": r["wall_s"], "events": r["events"], "plan": r["plan"]} for r in ranks
        ]
    return out
