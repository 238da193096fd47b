"""Step-time simulator of lockstep FSDP and ODC under each balancing plan, from a length profile to 1024 ranks.

Owns the analytic schedule model behind ``python -m megatron_odc.simulate``: :class:`Hardware` (compute rate,
link bandwidths, per-transfer latency), :class:`ModelSpec` (layers, parameter bytes, per-sample cost),
:func:`simulate_plan` (one minibatch under one schedule) and :func:`simulate` (many minibatches, every row of
:data:`ROWS`). Plans come from :mod:`megatron_odc.balance`. Pure Python: no torch, no megatron.

[Note: schedule model]
A microbatch of cost ``c`` (FLOPs / ``flops_per_s`` + a fixed per-microbatch overhead) spends ``c / 3`` in
forward and ``2c / 3`` in backward, split evenly over the ``L`` layers. Per layer, the forward fetches the
layer's parameters (``t_get``) and the backward fetches them again and pushes the gradients (``t_get +
t_push``); prefetch overlaps communication with compute, so a layer takes ``max(compute, communication)``
(``compute + communication`` with ``Hardware.overlap=False``, as on one CPU thread per rank).

- Lockstep FSDP (``fsdp``): every all-gather / reduce-scatter is a barrier, so layer ``l`` of microbatch
  index ``i`` takes ``max(max_r compute(r, i, l), comm)`` on every rank; a rank without an ``i``-th microbatch
  computes nothing but still joins the collectives. Step = sum over ``i`` and ``l``.
- ODC (``odc``): each rank runs its own microbatches, each layer taking ``max(compute, comm)``; ranks meet
  once per minibatch, so step = max over ranks of the rank's sum.

Bubble = idle compute time / (N * step), where a rank's busy time is its pure compute (communication not
hidden behind compute counts as idle). With infinite bandwidth and no overhead the bubbles equal
``Plan.bubble_lockstep`` / ``Plan.bubble_odc``, the paper's Table 6 definition.

[Note: communication volumes]
Per layer with ``P`` bytes of parameters, ``D`` ranks, ``G`` per node and shard ``K = P / D`` (the paper's
Table 2), on more than one node: a ring collective moves ``(G-1)/G * (D-1) * K`` bytes per rank over the intra-node link and
``(D-1) * K / G`` over the inter-node link; ODC's point-to-point gather / scatter-accumulate moves
``(G-1) * K`` intra-node and ``(D-G) * K`` inter-node; within one node both move ``(D-1) * K``. Links run in parallel, so the time is the max of the
two, plus ``latency_s`` per peer transfer (ODC) or per collective (ring). The inter-node bandwidth is per
node, shared by its ``G`` ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import operator
import sys
from collections.abc import Sequence

from megatron_odc.balance import CostModel, Plan, make_plan
from megatron_odc.balance.profiles import (
    load_lengths_file,
    load_profile_lengths,
    minibatch_sample_ids,
)
from megatron_odc.tools.balance_cli import MODEL_PRESETS, reference_lb_micro

__all__ = [
    "PAPER_TABLE5",
    "PAPER_TABLE6_15B_LONGALIGN",
    "ROWS",
    "Hardware",
    "ModelSpec",
    "StepResult",
    "benchmark_report",
    "calibrate_from_benchmark",
    "layer_comm_s",
    "main",
    "simulate",
    "simulate_minibatches",
    "simulate_plan",
]

SCHEDULES = ("fsdp", "odc")
#: (schedule, plan) rows; ``lb_micro_ref`` is the sail-sg/odc code's LB-Micro (see docs/balancing.md).
ROWS = (
    ("fsdp", "lb_micro"),
    ("fsdp", "lb_micro_ref"),
    ("fsdp", "local_sort"),
    ("odc", "local_sort"),
    ("odc", "lb_micro"),
    ("odc", "lb_micro_ref"),
    ("odc", "lb_mini"),
)
BASELINE = ("fsdp", "lb_micro")

#: Paper Table 5: throughput change in % per minibatch 1/2/4/8 of ODC-LocalSort (vs Collective LocalSort),
#: ODC-LB-Micro and ODC-LB-Mini (vs Collective LB-Micro). Keys: (model preset, profile, num GPUs).
PAPER_TABLE5: dict[tuple[str, str, int], dict[str, tuple[int, int, int, int]]] = {
    ("1.5b", "longalign", 8): {
        "odc+local_sort": (0, 8, 10, 6),
        "odc+lb_micro": (0, 1, 16, 23),
        "odc+lb_mini": (0, 9, 34, 22),
    },
    ("1.5b", "swe_smith", 8): {
        "odc+local_sort": (1, 4, 8, 6),
        "odc+lb_micro": (1, 18, 22, 12),
        "odc+lb_mini": (1, 27, 22, 12),
    },
    ("7b", "longalign", 8): {
        "odc+local_sort": (0, 8, 9, 7),
        "odc+lb_micro": (0, 1, 15, 19),
        "odc+lb_mini": (0, 11, 34, 19),
    },
    ("7b", "swe_smith", 8): {
        "odc+local_sort": (0, 4, 8, 6),
        "odc+lb_micro": (0, 17, 19, 11),
        "odc+lb_mini": (0, 26, 20, 10),
    },
    ("14b", "longalign", 16): {
        "odc+local_sort": (-2, 3, 12, 9),
        "odc+lb_micro": (-2, 0, 11, 28),
        "odc+lb_mini": (-2, 8, 36, 28),
    },
    ("14b", "swe_smith", 16): {
        "odc+local_sort": (-3, 1, 2, 1),
        "odc+lb_micro": (-3, 11, 19, 7),
        "odc+lb_mini": (-3, 26, 19, 7),
    },
    ("32b", "longalign", 32): {
        "odc+local_sort": (1, 5, 2, 3),
        "odc+lb_micro": (1, -2, 10, 23),
        "odc+lb_mini": (1, 7, 31, 21),
    },
    ("32b", "swe_smith", 32): {
        "odc+local_sort": (-2, 1, 4, 5),
        "odc+lb_micro": (-2, 13, 16, 8),
        "odc+lb_mini": (-2, 29, 16, 8),
    },
}

#: Paper Table 6, 1.5B LongAlign (8 GPUs): bubble % per minibatch 1/2/4/8.
PAPER_TABLE6_15B_LONGALIGN: dict[str, tuple[float, float, float, float]] = {
    "fsdp+lb_micro": (66.81, 52.6, 35.3, 22.1),
    "odc+lb_micro": (66.81, 52.5, 26.3, 1.7),
    "odc+lb_mini": (66.81, 48.6, 14.8, 0.02),
}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Compute and link model of one rank.

    Attributes:
        flops_per_s: effective compute rate (cost units per second; 1.0 when costs are seconds).
        intra_node_gbps: intra-node link bandwidth per rank, GB/s (1e9 bytes) per direction.
        inter_node_gbps: inter-node bandwidth per node, GB/s, shared by the node's ranks.
        gpus_per_node: ranks per node ``G``.
        latency_s: fixed time per point-to-point transfer (ODC), and per collective unless
            ``collective_latency_s`` is set.
        microbatch_overhead_s: fixed compute time per microbatch (kernel launches, Python), any schedule.
        collective_latency_s: fixed time per collective (ring), when it differs from ``latency_s``.
        overlap: communication overlaps compute (GPU streams); False adds them (one CPU thread).
        step_overhead_s: fixed time per minibatch on every rank (optimizer step), counted as busy.
        push_latency_factor: a push's fixed time in units of ``latency_s`` (the owner also adds).
        collective_push_latency_factor: a reduce-scatter's fixed time in units of the collective latency.
    """

    flops_per_s: float
    intra_node_gbps: float
    inter_node_gbps: float
    gpus_per_node: int
    latency_s: float = 0.0
    microbatch_overhead_s: float = 0.0
    collective_latency_s: float | None = None
    overlap: bool = True
    step_overhead_s: float = 0.0
    push_latency_factor: float = 1.0
    collective_push_latency_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.flops_per_s <= 0:
            raise ValueError(f"--flops-per-s must be > 0, got {self.flops_per_s}")
        if self.intra_node_gbps <= 0 or self.inter_node_gbps <= 0:
            raise ValueError(
                f"--intra-gbps and --inter-gbps must be > 0, got {self.intra_node_gbps}, "
                f"{self.inter_node_gbps}"
            )
        if self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.latency_s < 0 or self.microbatch_overhead_s < 0:
            raise ValueError("--latency-s and --microbatch-overhead-s must be >= 0")
        if self.collective_latency_s is not None and self.collective_latency_s < 0:
            raise ValueError("--collective-latency-s must be >= 0")
        if self.push_latency_factor < 0 or self.collective_push_latency_factor < 0:
            raise ValueError("push latency factors must be >= 0")

    @property
    def ring_latency_s(self) -> float:
        """Fixed time of one collective (``collective_latency_s``, else ``latency_s``)."""
        return self.latency_s if self.collective_latency_s is None else self.collective_latency_s


#: A100-80G, NVSwitch (about 200 GB/s achievable per GPU), RoCE 800 Gbps per node, 45% of bf16 peak.
A100_ROCE = Hardware(
    flops_per_s=0.45 * 312e12,
    intra_node_gbps=200.0,
    inter_node_gbps=100.0,
    gpus_per_node=8,
    latency_s=20e-6,
)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the simulator needs of a model.

    Attributes:
        num_layers: transformer layers ``L``.
        param_nbytes_per_layer: bytes fetched per layer (all parameters / L, in the gathered dtype).
        grad_nbytes_per_layer: bytes pushed per layer (all gradients / L, in the reduce dtype).
        cost: per-sample cost model (FLOPs, or seconds with ``flops_per_s=1``).
    """

    num_layers: int
    param_nbytes_per_layer: float
    grad_nbytes_per_layer: float
    cost: CostModel

    @classmethod
    def from_preset(cls, name: str, *, param_bytes: int = 2, grad_bytes: int = 4) -> ModelSpec:
        """A DeepSeek-R1-Distill-Qwen preset (``MODEL_PRESETS``) with the FLOP cost model."""
        if name not in MODEL_PRESETS:
            raise ValueError(f"--model {name!r} is not one of {sorted(MODEL_PRESETS)}")
        p = MODEL_PRESETS[name]
        h, f, layers = p["hidden_size"], p["ffn_hidden_size"], p["num_layers"]
        head_dim = h // p["num_attention_heads"]
        layer_numel = h * (h + 2 * p["num_query_groups"] * head_dim) + h * h + 3 * h * f + 2 * h
        total_numel = layers * layer_numel + 2 * h * p["vocab_size"]  # untied in/out embeddings
        return cls(
            num_layers=layers,
            param_nbytes_per_layer=total_numel * param_bytes / layers,
            grad_nbytes_per_layer=total_numel * grad_bytes / layers,
            cost=CostModel.from_model_config(**p, gated_mlp=True),
        )


def layer_comm_s(
    hw: Hardware, nbytes: float, dp_size: int, schedule: str, *, push: bool = False
) -> float:
    """Seconds to gather (or, with ``push``, scatter-accumulate) one layer of ``nbytes``.

    See [Note: communication volumes]; a push's fixed time is scaled by the hardware's push factor.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if dp_size == 1:
        return 0.0
    g = min(hw.gpus_per_node, dp_size)
    shard = nbytes / dp_size
    inter_per_rank = hw.inter_node_gbps * 1e9 / g
    if dp_size <= g:  # one node: every byte stays on the intra-node link
        intra, inter = (dp_size - 1) * shard, 0.0
        latency = hw.ring_latency_s if schedule == "fsdp" else hw.latency_s * (dp_size - 1)
    elif schedule == "fsdp":
        intra = (g - 1) / g * (dp_size - 1) * shard
        inter = (dp_size - 1) * shard / g
        latency = hw.ring_latency_s
    else:
        intra = (g - 1) * shard
        inter = (dp_size - g) * shard
        latency = hw.latency_s * (dp_size - 1)
    if push:
        latency *= (
            hw.collective_push_latency_factor if schedule == "fsdp" else hw.push_latency_factor
        )
    return max(intra / (hw.intra_node_gbps * 1e9), inter / inter_per_rank) + latency


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One minibatch under one schedule.

    Attributes:
        time_s: step time (all ranks wait for the slowest at the end).
        busy_s: pure compute seconds of each rank.
        bubble: ``sum_r (time - busy_r) / (N * time)``.
    """

    time_s: float
    busy_s: tuple[float, ...]
    bubble: float


def _microbatch_compute_s(plan: Plan, dp_rank: int, hw: Hardware) -> list[float]:
    """Compute seconds of each microbatch of ``dp_rank`` (an empty slot costs only the overhead)."""
    return [c / hw.flops_per_s + hw.microbatch_overhead_s for c in plan.microbatch_costs(dp_rank)]


def simulate_plan(plan: Plan, schedule: str, model: ModelSpec, hw: Hardware) -> StepResult:
    """Simulates one minibatch of ``plan`` under ``schedule`` (see [Note: schedule model]).

    Raises:
        ValueError: unknown schedule.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    layers = model.num_layers
    get_s = layer_comm_s(hw, model.param_nbytes_per_layer, plan.dp_size, schedule)
    push_s = layer_comm_s(hw, model.grad_nbytes_per_layer, plan.dp_size, schedule, push=True)
    per_rank = [_microbatch_compute_s(plan, r, hw) for r in range(plan.dp_size)]
    busy = tuple(math.fsum(c) for c in per_rank)

    combine = max if hw.overlap else operator.add

    def layer_pair(compute_s: float) -> float:
        fwd = compute_s / 3.0 / layers
        bwd = 2.0 * compute_s / 3.0 / layers
        return layers * (combine(fwd, get_s) + combine(bwd, get_s + push_s))

    if schedule == "fsdp":
        depth = max(len(c) for c in per_rank)
        time_s = math.fsum(
            layer_pair(max(c[i] if i < len(c) else 0.0 for c in per_rank)) for i in range(depth)
        )
    else:
        time_s = max(math.fsum(layer_pair(x) for x in c) for c in per_rank)
    time_s += hw.step_overhead_s
    busy = tuple(b + hw.step_overhead_s for b in busy)
    bubble = math.fsum(time_s - b for b in busy) / (plan.dp_size * time_s) if time_s > 0 else 0.0
    return StepResult(time_s=time_s, busy_s=busy, bubble=bubble)


def _plan(kind: str, ids: list[int], lengths: list[int], dp: int, cap: int | None, cost: CostModel):
    if kind == "lb_micro_ref":
        base = make_plan(
            "lb_micro", ids, lengths, dp, cap_tokens=cap, cost_model=cost, too_long="truncate"
        )
        return reference_lb_micro(base)
    return make_plan(kind, ids, lengths, dp, cap_tokens=cap, cost_model=cost, too_long="truncate")


def simulate_minibatches(
    minibatches: Sequence[Sequence[int]],
    *,
    dp_size: int,
    cap_tokens: int | None,
    model: ModelSpec,
    hw: Hardware,
    rows: Sequence[tuple[str, str]] = ROWS,
    plan_cost: CostModel | None = None,
) -> list[dict]:
    """Simulates every row on the given minibatches (each a list of ``dp_size * minibatch`` lengths).

    Args:
        minibatches: sample lengths of each global minibatch.
        dp_size: ranks N.
        cap_tokens: token cap per microbatch (None = no cap); longer samples are truncated.
        model: layers, bytes and cost model (the cost model also plans, unless ``plan_cost`` is given).
        hw: compute and link model.
        rows: (schedule, plan kind) pairs.
        plan_cost: cost model the balancer plans with (default ``model.cost``).

    Returns:
        One dict per row: ``schedule``, ``plan``, ``time_s`` (sum over minibatches), ``bubble`` (total idle /
        total rank-time), ``step_times_s`` and ``speedup`` (baseline time / this time, when the baseline row
        is present).
    """
    if dp_size < 1 or not minibatches:
        raise ValueError(f"need dp_size >= 1 and at least one minibatch, got {dp_size}")
    plan_cost = plan_cost or model.cost
    results = {row: [] for row in rows}
    for index, lengths in enumerate(minibatches):
        if len(lengths) % dp_size:
            raise ValueError(
                f"minibatch {index} has {len(lengths)} samples, not a multiple of dp_size={dp_size}"
            )
        ids = list(range(len(lengths)))
        plans: dict[str, Plan | None] = {}
        for schedule, kind in rows:
            if kind not in plans:
                plans[kind] = _plan(kind, ids, list(lengths), dp_size, cap_tokens, plan_cost)
            plan = plans[kind]
            if plan is None:
                continue
            results[(schedule, kind)].append(simulate_plan(plan, schedule, model, hw))
    out = []
    base_time = None
    if results.get(BASELINE):
        base_time = math.fsum(r.time_s for r in results[BASELINE])
    for (schedule, kind), steps in results.items():
        if not steps:
            continue
        total = math.fsum(r.time_s for r in steps)
        idle = math.fsum(r.time_s * dp_size - math.fsum(r.busy_s) for r in steps)
        row = {
            "schedule": schedule,
            "plan": kind,
            "time_s": total,
            "bubble": idle / (total * dp_size) if total > 0 else 0.0,
            "step_times_s": [r.time_s for r in steps],
        }
        if base_time is not None:
            row["speedup"] = base_time / total
        out.append(row)
    return out


def draw_minibatches(
    pool: Sequence[int], global_batch: int, num_minibatches: int, seed: int
) -> list[list[int]]:
    """Consecutive minibatches of ``random.Random(seed).shuffle``-d lengths, as the balance tool draws them."""
    ids = minibatch_sample_ids(len(pool), global_batch, num_minibatches, seed)
    return [[pool[i] for i in batch] for batch in ids]


def simulate(
    lengths: Sequence[int],
    *,
    dp_size: int,
    minibatch: int,
    cap_tokens: int | None,
    model: ModelSpec,
    hw: Hardware,
    num_minibatches: int = 32,
    seed: int = 0,
    rows: Sequence[tuple[str, str]] = ROWS,
) -> list[dict]:
    """Draws ``num_minibatches`` minibatches of ``dp_size * minibatch`` samples and simulates every row."""
    if dp_size < 1 or dp_size > 1024 or minibatch < 1 or num_minibatches < 1:
        raise ValueError(
            f"need 1 <= --dp <= 1024, --minibatch >= 1, --num-minibatches >= 1; got {dp_size}, "
            f"{minibatch}, {num_minibatches}"
        )
    batches = draw_minibatches(lengths, dp_size * minibatch, num_minibatches, seed)
    return simulate_minibatches(
        batches, dp_size=dp_size, cap_tokens=cap_tokens, model=model, hw=hw, rows=rows
    )


# ------------------------------------------------------------------------------------------ reports


def format_rows(rows: Sequence[dict], header: str) -> str:
    """A text table of :func:`simulate` rows."""
    lines = [header, f"{'schedule+plan':<20}{'step s':>10}{'bubble%':>9}{'speedup':>9}"]
    for row in rows:
        n = len(row["step_times_s"])
        lines.append(
            f"{row['schedule'] + '+' + row['plan']:<20}{row['time_s'] / n:>10.4g}"
            f"{100 * row['bubble']:>9.2f}{row.get('speedup', float('nan')):>9.3f}"
        )
    return "\n".join(lines) + "\n"


def paper_report(
    *,
    hw: Hardware,
    num_minibatches: int,
    seed: int,
    cap_tokens: int,
    profiles_file: str | None,
    table6_minibatches: int = 64,
) -> dict:
    """Predictions for the paper's settings next to Table 5 speedups and Table 6 bubbles (1.5B LA).

    Table 5 rows run ``num_minibatches`` minibatches on ``hw`` (fewer where the profile's 4096 samples
    run out); Table 6 rows are the cost-model bubbles
    (no communication) over ``table6_minibatches`` minibatches, as in ``docs/balancing.md``.
    """
    pools = {}
    table5 = []
    for (preset, profile, gpus), paper in PAPER_TABLE5.items():
        if profile not in pools:
            pools[profile] = load_profile_lengths(profile, profiles_file)
        model = ModelSpec.from_preset(preset)
        for col, minibatch in enumerate((1, 2, 4, 8)):
            count = min(num_minibatches, len(pools[profile]) // (gpus * minibatch))
            rows = simulate(
                pools[profile],
                dp_size=gpus,
                minibatch=minibatch,
                cap_tokens=cap_tokens,
                model=model,
                hw=hw,
                num_minibatches=count,
                seed=seed,
            )
            by_name = {f"{r['schedule']}+{r['plan']}": r for r in rows}
            entry = {
                "model": preset,
                "profile": profile,
                "gpus": gpus,
                "minibatch": minibatch,
                "num_minibatches": count,
            }
            ref_time = by_name["fsdp+lb_micro_ref"]["time_s"]
            for name, values in paper.items():
                if name == "odc+local_sort":
                    pred = pred_ref = by_name["fsdp+local_sort"]["time_s"] / by_name[name]["time_s"]
                else:
                    pred = by_name[name]["speedup"]
                    ref_name = "odc+lb_micro_ref" if name == "odc+lb_micro" else name
                    pred_ref = ref_time / by_name[ref_name]["time_s"]
                entry[name] = {
                    "paper_pct": values[col],
                    "predicted_pct": 100 * (pred - 1),
                    "predicted_vs_ref_policy_pct": 100 * (pred_ref - 1),
                }
            entry["bubbles_pct"] = {n: 100 * r["bubble"] for n, r in by_name.items()}
            table5.append(entry)
    # Table 6 is the cost model's imbalance bubble (no communication): infinite links, no overhead.
    no_comm = Hardware(
        flops_per_s=hw.flops_per_s,
        intra_node_gbps=1e12,
        inter_node_gbps=1e12,
        gpus_per_node=hw.gpus_per_node,
    )
    table6 = []
    for col, minibatch in enumerate((1, 2, 4, 8)):
        rows = simulate(
            pools["longalign"],
            dp_size=8,
            minibatch=minibatch,
            cap_tokens=cap_tokens,
            model=ModelSpec.from_preset("1.5b"),
            hw=no_comm,
            num_minibatches=table6_minibatches,
            seed=seed,
        )
        bubbles = {f"{r['schedule']}+{r['plan']}": 100 * r["bubble"] for r in rows}
        entry = {"minibatch": minibatch, "fsdp+lb_micro_ref": bubbles["fsdp+lb_micro_ref"]}
        for name, paper in PAPER_TABLE6_15B_LONGALIGN.items():
            entry[name] = {"paper": paper[col], "predicted": bubbles[name]}
        table6.append(entry)
    return {"hardware": dataclasses.asdict(hw), "table5": table5, "table6_15b_longalign": table6}


def format_paper_report(report: dict) -> str:
    """Renders :func:`paper_report` as two text tables."""
    lines = [
        "Table 5 (speedup %, paper / predicted / predicted with the sail-sg/odc LB-Micro policy as "
        "the baseline): ODC-LocalSort vs FSDP-LocalSort, ODC-LB-Micro and ODC-LB-Mini vs FSDP-LB-Micro",
        f"{'model':<6}{'profile':<11}{'gpus':>5}{'mb':>4}{'local_sort':>22}{'lb_micro':>22}"
        f"{'lb_mini':>22}",
    ]
    for e in report["table5"]:
        cells = "".join(
            f"{e[n]['paper_pct']:>+8d}/{e[n]['predicted_pct']:>+6.1f}/"
            f"{e[n]['predicted_vs_ref_policy_pct']:>+6.1f}"
            for n in ("odc+local_sort", "odc+lb_micro", "odc+lb_mini")
        )
        lines.append(f"{e['model']:<6}{e['profile']:<11}{e['gpus']:>5}{e['minibatch']:>4}{cells}")
    lines.append("")
    lines.append("Table 6, 1.5B LongAlign, 8 GPUs (bubble %, paper / predicted)")
    lines.append(
        f"{'mb':>3}{'fsdp+lb_micro':>18}{'(ref policy)':>14}{'odc+lb_micro':>18}{'odc+lb_mini':>18}"
    )
    for e in report["table6_15b_longalign"]:
        lines.append(
            f"{e['minibatch']:>3}"
            f"{e['fsdp+lb_micro']['paper']:>9.2f}/{e['fsdp+lb_micro']['predicted']:>7.2f}"
            f"{e['fsdp+lb_micro_ref']:>14.2f}"
            f"{e['odc+lb_micro']['paper']:>9.2f}/{e['odc+lb_micro']['predicted']:>7.2f}"
            f"{e['odc+lb_mini']['paper']:>9.2f}/{e['odc+lb_mini']['predicted']:>7.2f}"
        )
    return "\n".join(lines) + "\n"


def calibrate_from_benchmark(data: dict, *, microbatch_overhead_s: float) -> Hardware:
    """CPU hardware constants from a ``benchmarks/imbalance.py --out`` file (its own telemetry).

    - ``latency_s`` (ODC, per layer transfer): median duration of the ``odc`` fetch-wait events;
    - ``collective_latency_s`` (FSDP): the run's all-gather probe of one layer (median of 20, no load
      imbalance inside, unlike the lockstep fetch waits);
    - ``step_overhead_s``: median duration of the optimizer-step events of ``odc`` and ``fsdp``;
    - push factors: median push / median fetch-wait duration, per backend (a push reduces as well as
      copies; for ``fsdp`` the ratio also cancels most of the lockstep wait both contain);
    - ``flops_per_s`` (cost units per second): sum of the predicted compute (plan cost in seconds of
      ``CPU_COST`` + ``microbatch_overhead_s`` per microbatch) over the ``odc`` ranks' steps, divided by their
      measured busy time (wall - fetch wait - push - fence - optimizer): the slowdown of the (shared) machine
      during the run relative to the calibration fit;
    - no overlap (one thread per rank), infinite bandwidth (the latencies include the copies).
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
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def benchmark_report(
    path: str, *, hw: Hardware, model: ModelSpec, plan_cost: CostModel | None = None
) -> list[dict]:
    """Predicted vs measured speedups for every cell of a ``benchmarks/imbalance.py --out`` file.

    The simulator replays the exact minibatch lengths of each repeat (same plans: planning is
    deterministic), so the comparison is per cell: predicted speedup / measured speedup.
    """
    with open(path) as f:
        data = json.load(f)
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


# ------------------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    """Returns the command-line parser."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_odc.simulate",
        description="Predicted step time, bubble rate and speedup of lockstep FSDP and ODC per plan.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--profile", help="length profile name (e.g. longalign)")
    mode.add_argument("--lengths", help="file with one length per line, or a JSON list")
    mode.add_argument(
        "--paper", action="store_true", help="the paper's settings next to its Tables 5 and 6"
    )
    mode.add_argument(
        "--benchmark-json",
        help="compare with a benchmarks/imbalance.py --out file (CPU calibration)",
    )
    parser.add_argument("--profiles-file", help="profile JSON (default: see megatron_odc.balance)")
    parser.add_argument("--dp", type=int, default=8, help="DP size, up to 1024")
    parser.add_argument("--minibatch", type=int, default=4, help="samples per rank per minibatch")
    parser.add_argument("--cap", type=int, default=65536, help="tokens per microbatch; 0 = no cap")
    parser.add_argument("--num-minibatches", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="1.5b")
    parser.add_argument("--cost-a", type=float, help="quadratic cost coefficient (with --cost-b)")
    parser.add_argument("--cost-b", type=float, help="linear cost coefficient (with --cost-a)")
    parser.add_argument("--num-layers", type=int, help="layers (with --cost-a/--cost-b)")
    parser.add_argument(
        "--layer-param-nbytes", type=float, help="parameter bytes per layer (with --cost-a/b)"
    )
    parser.add_argument(
        "--layer-grad-nbytes", type=float, help="gradient bytes per layer (default 2x params)"
    )
    parser.add_argument("--flops-per-s", type=float, default=A100_ROCE.flops_per_s)
    parser.add_argument("--intra-gbps", type=float, default=A100_ROCE.intra_node_gbps)
    parser.add_argument("--inter-gbps", type=float, default=A100_ROCE.inter_node_gbps)
    parser.add_argument("--gpus-per-node", type=int, default=A100_ROCE.gpus_per_node)
    parser.add_argument("--latency-s", type=float, default=A100_ROCE.latency_s)
    parser.add_argument(
        "--collective-latency-s", type=float, help="fixed time per collective (default --latency-s)"
    )
    parser.add_argument("--microbatch-overhead-s", type=float, default=0.0)
    parser.add_argument(
        "--no-overlap", action="store_true", help="communication adds to compute (CPU ranks)"
    )
    parser.add_argument("--json", action="store_true", help="write JSON instead of tables")
    return parser


def _model_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelSpec:
    if (args.cost_a is None) != (args.cost_b is None):
        parser.error("--cost-a and --cost-b go together")
    if args.cost_a is None:
        return ModelSpec.from_preset(args.model)
    if args.num_layers is None or args.layer_param_nbytes is None:
        parser.error("--cost-a/--cost-b need --num-layers and --layer-param-nbytes")
    grad = args.layer_grad_nbytes
    return ModelSpec(
        num_layers=args.num_layers,
        param_nbytes_per_layer=args.layer_param_nbytes,
        grad_nbytes_per_layer=2 * args.layer_param_nbytes if grad is None else grad,
        cost=CostModel(a=args.cost_a, b=args.cost_b),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the tool; returns the exit code (2 on a usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        hw = Hardware(
            flops_per_s=args.flops_per_s,
            intra_node_gbps=args.intra_gbps,
            inter_node_gbps=args.inter_gbps,
            gpus_per_node=args.gpus_per_node,
            latency_s=args.latency_s,
            microbatch_overhead_s=args.microbatch_overhead_s,
            collective_latency_s=args.collective_latency_s,
            overlap=not args.no_overlap,
        )
        if args.cap < 0:
            raise ValueError(f"--cap must be >= 0, got {args.cap}")
        if args.paper:
            report = paper_report(
                hw=hw,
                num_minibatches=args.num_minibatches,
                seed=args.seed,
                cap_tokens=args.cap,
                profiles_file=args.profiles_file,
            )
            text = format_paper_report(report)
            result: object = report
        elif args.benchmark_json:
            if args.cost_a is None:  # calibrate everything from the file itself
                with open(args.benchmark_json) as f:
                    data = json.load(f)
                hw = calibrate_from_benchmark(
                    data, microbatch_overhead_s=args.microbatch_overhead_s
                )
                bench_model = ModelSpec(
                    num_layers=data["meta"]["model"]["num_layers"],
                    param_nbytes_per_layer=1.0,
                    grad_nbytes_per_layer=1.0,
                    cost=CostModel(**data["meta"]["settings"]["cost"]),
                )
            else:
                bench_model = _model_from_args(args, parser)
            cells = benchmark_report(args.benchmark_json, hw=hw, model=bench_model)
            result = {"hardware": dataclasses.asdict(hw), "cells": cells}
            text = f"hardware: {result['hardware']}\n" + "".join(
                f"{r['profile']:<10}{r['minibatch_per_rank']:>3} {r['config']:<16}"
                f"pred {r['predicted_step_s']:.3f}s meas {r['measured_step_s']:.3f}s  speedup pred "
                f"{r['predicted_speedup']:.3f} meas {r['measured_speedup']:.3f} "
                f"ratio {r.get('ratio', float('nan')):.3f}\n"
                for r in cells
            )
        else:
            if args.profile is None and args.lengths is None:
                parser.error("give --profile, --lengths, --paper or --benchmark-json")
            lengths = (
                load_lengths_file(args.lengths)
                if args.lengths
                else load_profile_lengths(args.profile, args.profiles_file)
            )
            model = _model_from_args(args, parser)
            rows = simulate(
                lengths,
                dp_size=args.dp,
                minibatch=args.minibatch,
                cap_tokens=args.cap or None,
                model=model,
                hw=hw,
                num_minibatches=args.num_minibatches,
                seed=args.seed,
            )
            result = rows
            text = format_rows(
                rows,
                f"dp={args.dp} minibatch/rank={args.minibatch} cap={args.cap} "
                f"minibatches={args.num_minibatches} seed={args.seed} layers={model.num_layers} "
                f"cost a={model.cost.a:.4g} b={model.cost.b:.4g}",
            )
    except ValueError as err:
        parser.error(str(err))
    sys.stdout.write(json.dumps(result, indent=1) + "\n" if args.json else text)
    return 0
