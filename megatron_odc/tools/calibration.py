"""Calibration of the simulator from a ``benchmarks/imbalance.py --out`` file (CPU ranks).

Owns reading a benchmark file's own telemetry into the model of
:mod:`megatron_odc.tools.simulator`: :func:`calibrate_from_benchmark` (the :class:`Hardware`
constants), :func:`model_from_benchmark` (the benchmark model's :class:`ModelSpec`) and
:func:`benchmark_report` (predicted vs measured speedups per cell, rendered by
:func:`format_benchmark_report`): ``python -m megatron_odc.simulate --benchmark-json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from megatron_odc.balance import CostModel
from megatron_odc.tools.simulator import SCHEDULES, Hardware, ModelSpec, simulate_minibatches

__all__ = [
    "benchmark_report",
    "calibrate_from_benchmark",
    "format_benchmark_report",
    "load_benchmark_file",
    "model_from_benchmark",
]


def load_benchmark_file(path: str) -> dict:
    """Reads a ``benchmarks/imbalance.py --out`` file.

    Raises:
        ValueError: the file is missing, is not JSON (naming its line), or lacks a top-level key
            of such a file.
    """
    hint = "pass a benchmarks/imbalance.py --out file"
    try:
        with open(path) as f:
            text = f.read()
    except OSError as err:
        raise ValueError(f"benchmark file {path}: {err.strerror}; {hint}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path}:{err.lineno}: not valid JSON ({err.msg}, line {err.lineno} column "
            f"{err.colno}); {hint}"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object; {hint}")
    missing = [key for key in ("meta", "results", "rows") if key not in data]
    if missing:
        raise ValueError(f"{path}: no top-level {missing}; {hint}")
    return data


def calibrate_from_benchmark(data: dict, *, microbatch_overhead_s: float) -> Hardware:
    """CPU hardware constants from a ``benchmarks/imbalance.py --out`` file (its own telemetry).

    - ``latency_s`` (ODC, per layer transfer): median duration of the ``odc`` fetch-wait events;
    - ``collective_latency_s`` (FSDP): the run's all-gather probe of one layer (median of 20, no
      load imbalance inside, unlike the lockstep fetch waits);
    - ``step_overhead_s``: median duration of the optimizer-step events of ``odc`` and ``fsdp``;
    - push factors: median push / median fetch-wait duration, per backend (a push reduces as well
      as copies; for ``fsdp`` the ratio also cancels most of the lockstep wait both contain);
    - ``flops_per_s`` (cost units per second): sum of the predicted compute (plan cost in seconds
      of the benchmark's ``CPU_COST`` + ``microbatch_overhead_s`` per microbatch) over the ``odc``
      ranks' steps, divided by their measured busy time (wall - fetch wait - push - fence -
      optimizer): the slowdown of the (shared) machine during the run relative to the
      calibration fit;
    - no overlap (one thread per rank), infinite bandwidth (the latencies include the copies).

    Args:
        data: the parsed benchmark file.
        microbatch_overhead_s: fixed compute time per microbatch to assume (not measured).

    Returns:
        The CPU hardware constants of the run.

    Raises:
        ValueError: the file has no ``odc`` steps.
    """
    settings = data["meta"]["settings"]
    cost = CostModel(**settings["cost"])
    odc_fetch, opt, predicted, busy = [], [], 0.0, 0.0
    transfers: dict[tuple[str, str], list[float]] = {}
    for cell in data["results"]:
        for name, repeats in cell["steps"].items():
            backend = name.split("+")[0]
            for ranks in repeats:
                for rank, record in enumerate(ranks):
                    kinds: dict[str, float] = {}
                    for kind, start, end in record["events"]:
                        kinds[kind] = kinds.get(kind, 0.0) + end - start
                        if backend == "odc" and kind == "fetch_wait":
                            odc_fetch.append(end - start)
                        if kind in ("fetch_wait", "push"):
                            transfers.setdefault((backend, kind), []).append(end - start)
                        if backend in SCHEDULES and kind == "optimizer":
                            opt.append(end - start)
                    if backend != "odc":
                        continue
                    mbs = record["plan"][rank]
                    lengths = dict(zip(_ids(record), record["lengths"], strict=True))
                    predicted += math.fsum(
                        cost.sample_cost(lengths[sid]) for mb in mbs for sid in mb
                    ) + microbatch_overhead_s * len(mbs)
                    busy += record["wall_s"] - math.fsum(kinds.values())
    if not odc_fetch or busy <= 0:
        raise ValueError("the benchmark file has no odc steps to calibrate from")
    return Hardware(
        flops_per_s=predicted / busy,
        intra_node_gbps=1e6,
        inter_node_gbps=1e6,
        gpus_per_node=len(data["results"][0]["steps"][next(iter(data["results"][0]["steps"]))][0]),
        latency_s=_median(odc_fetch),
        collective_latency_s=data["comm_probe"]["allgather_layer_s"],
        microbatch_overhead_s=microbatch_overhead_s,
        overlap=False,
        step_overhead_s=_median(opt),
        push_latency_factor=_ratio(transfers, "odc"),
        collective_push_latency_factor=_ratio(transfers, "fsdp"),
    )


def model_from_benchmark(data: dict) -> ModelSpec:
    """The benchmark model as the simulator sees it: its layers and cost model, one byte per layer.

    The bytes do not matter: :func:`calibrate_from_benchmark` assumes infinite bandwidth (its
    latencies include the copies).
    """
    return ModelSpec(
        num_layers=data["meta"]["model"]["num_layers"],
        param_nbytes_per_layer=1.0,
        grad_nbytes_per_layer=1.0,
        cost=CostModel(**data["meta"]["settings"]["cost"]),
    )


def _ratio(transfers: dict[tuple[str, str], list[float]], backend: str) -> float:
    """Median push time / median fetch time of ``backend`` (1.0 when either is missing)."""
    pushes, fetches = transfers.get((backend, "push")), transfers.get((backend, "fetch_wait"))
    if not pushes or not fetches:
        return 1.0
    return _median(pushes) / _median(fetches)


def _ids(record: dict) -> list[int]:
    """Sample ids of a benchmark step record, in the order of its ``lengths``."""
    ids = sorted(sid for rank in record["plan"] for mb in rank for sid in mb)
    assert len(ids) == len(record["lengths"]), "plan and lengths disagree"
    return ids


def _median(values: Sequence[float]) -> float:
    """The median of ``values`` (the mean of the middle two for an even count)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def benchmark_report(
    path: str, *, hw: Hardware, model: ModelSpec, plan_cost: CostModel | None = None
) -> list[dict]:
    """Predicted vs measured speedups for every cell of a ``benchmarks/imbalance.py --out`` file.

    The simulator replays the exact minibatch lengths of each repeat (same plans: planning is
    deterministic), so the comparison is per cell: predicted speedup / measured speedup.

    Args:
        path: the benchmark file.
        hw: compute and link model (e.g. :func:`calibrate_from_benchmark`).
        model: layers, bytes and cost model (e.g. :func:`model_from_benchmark`).
        plan_cost: cost model the balancer plans with (default: the benchmark's own).

    Returns:
        One dict per (cell, config): predicted and measured step time and speedup, and their
        ``ratio`` when both speedups are known.

    Raises:
        ValueError: the file is not a benchmark file (see :func:`load_benchmark_file`).
    """
    data = load_benchmark_file(path)
    settings = data["meta"]["settings"]
    cap = 65536 // settings["length_scale"]
    plan_cost = plan_cost or CostModel(**settings["cost"])
    measured = {(r["profile"], r["minibatch_per_rank"], r["config"]): r for r in data["rows"]}
    out = []
    for cell in data["results"]:
        names = list(cell["steps"])
        rows = [tuple(n.split("+")) for n in names if n.split("+")[0] in SCHEDULES]
        batches = [ranks[0]["lengths"] for ranks in cell["steps"][names[0]]]
        dp = len(cell["steps"][names[0]][0])
        sim = simulate_minibatches(
            batches, dp_size=dp, cap_tokens=cap, model=model, hw=hw, rows=rows, plan_cost=plan_cost
        )
        for row in sim:
            name = f"{row['schedule']}+{row['plan']}"
            meas = measured[(cell["profile"], cell["minibatch"], name)]
            n = len(row["step_times_s"])
            entry = {
                "profile": cell["profile"],
                "minibatch_per_rank": cell["minibatch"],
                "config": name,
                "predicted_step_s": row["time_s"] / n,
                "measured_step_s": sum(meas["step_s"]) / len(meas["step_s"]),
                "predicted_speedup": row.get("speedup"),
                "measured_speedup": meas.get("speedup_vs_baseline_total"),
            }
            if entry["predicted_speedup"] and entry["measured_speedup"]:
                entry["ratio"] = entry["predicted_speedup"] / entry["measured_speedup"]
            out.append(entry)
    return out


def format_benchmark_report(report: dict) -> str:
    """Renders ``{"hardware": ..., "cells": benchmark_report(...)}`` as one line per cell."""
    return f"hardware: {report['hardware']}\n" + "".join(
        f"{r['profile']:<10}{r['minibatch_per_rank']:>3} {r['config']:<16}"
        f"pred {r['predicted_step_s']:.3f}s meas {r['measured_step_s']:.3f}s  speedup pred "
        f"{r['predicted_speedup']:.3f} meas {r['measured_speedup']:.3f} "
        f"ratio {r.get('ratio', float('nan')):.3f}\n"
        for r in report["cells"]
    )
