"""Predicted ODC + LB-Mini vs lockstep FSDP + LB-Micro speedups with pipeline parallelism (issue 16).

Owns :func:`pipeline_report` (the cells: model, profile, GPUs, pipeline stages, per-GPU minibatch)
and :func:`format_pipeline_report`: ``python -m megatron_odc.simulate --pipeline-report``. The plans
are the pipeline-aware ones of :mod:`megatron_odc.balance` ([Note: pipelines] in ``balance/plan.py``)
and the step model is [Note: pipeline schedule model] in :mod:`megatron_odc.tools.simulator`. Pure
Python: no torch, no megatron.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron_odc.balance.profiles import load_profile_lengths
from megatron_odc.tools.simulator import PIPELINE_ROWS, Hardware, ModelSpec, simulate

__all__ = ["format_pipeline_report", "pipeline_report"]


def pipeline_report(
    *,
    hw: Hardware,
    num_minibatches: int,
    seed: int,
    cap_tokens: int,
    profiles_file: str | None,
    model: str = "32b",
    profiles: Sequence[str] = ("longalign", "swe_smith"),
    gpus: Sequence[int] = (32, 64),
    stages: Sequence[int] = (1, 2, 4),
    minibatches: Sequence[int] = (2, 4, 8),
) -> dict:
    """Speedups of ODC-LB-Micro and ODC-LB-Mini over FSDP-LB-Micro per (profile, GPUs, PP, minibatch).

    ``minibatch`` is samples per GPU per step, as in the paper's Table 5, so every pipeline size runs
    the same global batch ``gpus * minibatch``: ``gpus / p`` replicas of ``minibatch * p`` samples.

    Returns:
        A JSON-ready dict: ``hardware``, ``model`` and ``cells``, each with the predicted speedups in
        % (``odc+lb_micro_pct``, ``odc+lb_mini_pct``), the step time of the baseline, the bubbles and
        the mean microbatches per replica of each plan.

    Raises:
        ValueError: a profile is missing, or a GPU count is not a multiple of a pipeline size.
    """
    spec = ModelSpec.from_preset(model)
    cells = []
    for profile in profiles:
        pool = load_profile_lengths(profile, profiles_file)
        for num_gpus in gpus:
            for p in stages:
                if num_gpus % p:
                    raise ValueError(f"{num_gpus} GPUs do not split into pipelines of {p} stages")
                replicas = num_gpus // p
                for minibatch in minibatches:
                    count = min(num_minibatches, len(pool) // (num_gpus * minibatch))
                    rows = simulate(
                        pool,
                        dp_size=replicas,
                        minibatch=minibatch * p,
                        cap_tokens=cap_tokens,
                        model=spec,
                        hw=hw,
                        num_minibatches=count,
                        seed=seed,
                        rows=PIPELINE_ROWS,
                        pipeline_stages=p,
                    )
                    by_name = {f"{r['schedule']}+{r['plan']}": r for r in rows}
                    base = by_name["fsdp+lb_micro"]
                    cells.append(
                        {
                            "profile": profile,
                            "gpus": num_gpus,
                            "pipeline_stages": p,
                            "replicas": replicas,
                            "minibatch_per_gpu": minibatch,
                            "num_minibatches": count,
                            "baseline_step_s": base["time_s"] / count,
                            "odc+lb_micro_pct": 100 * (by_name["odc+lb_micro"]["speedup"] - 1),
                            "odc+lb_mini_pct": 100 * (by_name["odc+lb_mini"]["speedup"] - 1),
                            "bubbles_pct": {n: 100 * r["bubble"] for n, r in by_name.items()},
                        }
                    )
    return {"hardware": dataclasses.asdict(hw), "model": model, "cells": cells}


def format_pipeline_report(report: dict) -> str:
    """Renders :func:`pipeline_report` as a text table."""
    lines = [
        f"{report['model']}: speedup % vs FSDP-LB-Micro (same pipelines), and bubble % "
        "(FSDP-LB-Micro / ODC-LB-Mini)",
        f"{'profile':<11}{'gpus':>5}{'pp':>4}{'mb':>4}{'base step s':>13}{'odc+lb_micro':>14}"
        f"{'odc+lb_mini':>13}{'bubbles':>16}",
    ]
    for c in report["cells"]:
        bubbles = c["bubbles_pct"]
        lines.append(
            f"{c['profile']:<11}{c['gpus']:>5}{c['pipeline_stages']:>4}{c['minibatch_per_gpu']:>4}"
            f"{c['baseline_step_s']:>13.1f}{c['odc+lb_micro_pct']:>+14.1f}"
            f"{c['odc+lb_mini_pct']:>+13.1f}"
            f"{bubbles['fsdp+lb_micro']:>9.1f} /{bubbles['odc+lb_mini']:>5.1f}"
        )
    return "\n".join(lines) + "\n"
