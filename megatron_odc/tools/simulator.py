"""Analytic step-time model of lockstep FSDP and ODC (full-shard or hybrid) under each plan, up to 1024 ranks.

Owns the schedule model behind ``python -m megatron_odc.simulate``: :class:`Hardware` (compute
rate, link bandwidths, per-transfer latency), :class:`ModelSpec` (layers, parameter bytes,
per-sample cost), :func:`layer_comm_s`, :func:`simulate_plan` (one minibatch under one schedule),
:func:`simulate_minibatches` / :func:`simulate` (many minibatches, every row of :data:`ROWS`) and
:func:`format_rows`. Plans come from :mod:`megatron_odc.balance`. Pure Python: no torch, no
megatron. The model is stated in [Note: schedule model], [Note: communication volumes] and
[Note: pipeline schedule model] below.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence

from megatron_odc.balance import CostModel, Plan, make_plan
from megatron_odc.balance.pipeline import one_f_one_b_time
from megatron_odc.balance.profiles import minibatch_sample_ids
from megatron_odc.tools.presets import MODEL_PRESETS, preset_cost_model
from megatron_odc.tools.reference import reference_lb_micro

__all__ = [
    "A100_ROCE",
    "BASELINE",
    "HYBRID_ROWS",
    "PIPELINE_ROWS",
    "ROWS",
    "SCHEDULES",
    "Hardware",
    "ModelSpec",
    "StepResult",
    "draw_minibatches",
    "format_rows",
    "layer_comm_s",
    "minibatch_allreduce_s",
    "simulate",
    "simulate_minibatches",
    "simulate_plan",
]

# [Note: schedule model]
# A microbatch of cost ``c`` (FLOPs / ``flops_per_s`` + a fixed per-microbatch overhead) spends
# ``c / 3`` in forward and ``2c / 3`` in backward, split evenly over the ``L`` layers. Per layer,
# the forward fetches the layer's parameters (``t_get``) and the backward fetches them again and
# pushes the gradients (``t_get + t_push``); prefetch overlaps communication with compute, so a
# layer takes ``max(compute, communication)`` (``compute + communication`` with
# ``Hardware.overlap=False``, as on one CPU thread per rank).
#
# - Lockstep FSDP (``fsdp``): every all-gather / reduce-scatter is a barrier, so layer ``l`` of
#   microbatch index ``i`` takes ``max(max_r compute(r, i, l), comm)`` on every rank; a rank without
#   an ``i``-th microbatch computes nothing but still joins the collectives. Step = sum over ``i``
#   and ``l``.
# - ODC (``odc``): each rank runs its own microbatches, each layer taking ``max(compute, comm)``;
#   ranks meet once per minibatch, so step = max over ranks of the rank's sum.
# - Hybrid ODC (``odc_hybrid``): as ODC with node-local volumes, plus the once-per-minibatch
#   all-reduce of [Note: communication volumes] after the slowest rank.
#
# Bubble = idle compute time / (N * step), where a rank's busy time is its pure compute
# (communication not hidden behind compute counts as idle). With infinite bandwidth and no overhead
# the bubbles equal ``Plan.bubble_lockstep`` / ``Plan.bubble_odc``, the paper's Table 6 definition.

# [Note: communication volumes]
# Per layer with ``P`` bytes of parameters, ``D`` ranks, ``G`` per node and shard ``K = P / D`` (the
# paper's Table 2), on more than one node: a ring collective moves ``(G-1)/G * (D-1) * K`` bytes per
# rank over the intra-node link and ``(D-1) * K / G`` over the inter-node link; ODC's point-to-point
# gather / scatter-accumulate moves ``(G-1) * K`` intra-node and ``(D-G) * K`` inter-node; within
# one node both move ``(D-1) * K``. Links run in parallel, so the time is the max of the two, plus
# ``latency_s`` per peer transfer (ODC) or per collective (ring). The inter-node bandwidth is per
# node, shared by its ``G`` ranks.
#
# Hybrid ODC (``odc_hybrid``, issue 15): parameters, gradients and optimizer state are sharded over the
# ``S = min(G, D)`` ranks of a node (the shard group), so a layer's gather and scatter-accumulate move
# ``(S-1) * P / S`` bytes per rank over the intra-node link only, with ``latency_s`` per peer; once per
# minibatch, after the last push, each rank all-reduces its fp32 shard of all gradients (``W / S``
# bytes, ``W`` = gradient bytes of the whole model) over its replica group of ``R = D / S`` ranks on
# other nodes: a ring all-reduce sends ``2 (R-1)/R * W / S`` bytes per rank over the inter-node link
# (shared by the node's ``S`` ranks), plus one collective latency. It is not overlapped with compute
# (it follows the fence), so it counts as idle time. Memory (18P/S bytes per rank) is not modelled.
#
# [Note: pipeline schedule model]
# With ``Plan.pipeline_stages = p > 1`` the plan's ranks are DP replicas and each stage's DP group has
# ``D = dp_size`` ranks; stages are contiguous in rank order (Megatron's default order puts PP
# outermost), so a stage's DP group spans ``D / G`` nodes and a stage boundary crosses nodes when
# ``D >= G``. A stage holds ``L / p`` layers; a microbatch's forward on a stage takes
# ``L/p * combine(c / (3L), get)``, its backward ``L/p * combine(2c / (3L), get + push)``, with the
# per-layer get / push of the stage's DP group as above. Between stages a microbatch's activation
# (``tokens * activation_nbytes_per_token``) takes a hop over the boundary link (inter-node per-rank
# share, else intra-node). The stage ops run through the 1F1B model of
# ``megatron_odc.balance.pipeline`` ([Note: 1F1B with variable microbatches]): ODC per replica
# (step = the slowest replica), lockstep FSDP on the per-index max over replicas (every op of stage
# ``s`` is a barrier of that stage's DP group). Busy time of a rank = its replica's compute / p.

SCHEDULES = ("fsdp", "odc", "odc_hybrid")
#: (schedule, plan) rows; ``lb_micro_ref`` is the sail-sg/odc code's LB-Micro
#: (:mod:`megatron_odc.tools.reference`, docs/balancing.md).
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
#: Rows of the multi-node report: the baseline, full-shard ODC and hybrid ODC.
HYBRID_ROWS = (
    BASELINE,
    ("odc", "lb_micro"),
    ("odc", "lb_mini"),
    ("odc_hybrid", "lb_micro"),
    ("odc_hybrid", "lb_mini"),
)
#: Rows with pipelines: the pipeline-aware plans under lockstep FSDP and ODC.
PIPELINE_ROWS = (BASELINE, ("odc", "lb_micro"), ("odc", "lb_mini"))


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
        microbatch_overhead_s: fixed compute time per microbatch (kernel launches, Python), any
            schedule.
        collective_latency_s: fixed time per collective (ring), when it differs from ``latency_s``.
        overlap: communication overlaps compute (GPU streams); False adds them (one CPU thread).
        step_overhead_s: fixed time per minibatch on every rank (optimizer step), counted as busy.
        push_latency_factor: a push's fixed time in units of ``latency_s`` (the owner also adds).
        collective_push_latency_factor: a reduce-scatter's fixed time in units of the collective
            latency.
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
        activation_nbytes_per_token: bytes a pipeline stage sends the next per token (0: free hops).
    """

    num_layers: int
    param_nbytes_per_layer: float
    grad_nbytes_per_layer: float
    cost: CostModel
    activation_nbytes_per_token: float = 0.0

    @classmethod
    def from_preset(cls, name: str, *, param_bytes: int = 2, grad_bytes: int = 4) -> ModelSpec:
        """A DeepSeek-R1-Distill-Qwen preset (``MODEL_PRESETS``) with the FLOP cost model.

        Raises:
            ValueError: ``name`` is not a preset.
        """
        cost = preset_cost_model(name)
        p = MODEL_PRESETS[name]
        h, f, layers = p["hidden_size"], p["ffn_hidden_size"], p["num_layers"]
        head_dim = h // p["num_attention_heads"]
        layer_numel = h * (h + 2 * p["num_query_groups"] * head_dim) + h * h + 3 * h * f + 2 * h
        total_numel = layers * layer_numel + 2 * h * p["vocab_size"]  # untied in/out embeddings
        return cls(
            num_layers=layers,
            param_nbytes_per_layer=total_numel * param_bytes / layers,
            grad_nbytes_per_layer=total_numel * grad_bytes / layers,
            cost=cost,
            activation_nbytes_per_token=h * param_bytes,
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
    if (
        schedule == "odc_hybrid"
    ):  # sharded over the node's ranks only (see [Note: communication volumes])
        dp_size = g
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


def minibatch_allreduce_s(hw: Hardware, grad_nbytes: float, dp_size: int) -> float:
    """Seconds of hybrid ODC's once-per-minibatch all-reduce of ``grad_nbytes`` of gradients.

    See [Note: communication volumes]: each rank all-reduces its ``1/S`` shard over the ``D / S``
    ranks holding the same shard on other nodes; 0 on one node.

    Raises:
        ValueError: ``dp_size`` spans nodes but is not a multiple of the node size.
    """
    g = min(hw.gpus_per_node, dp_size)
    if dp_size % g:
        raise ValueError(
            f"hybrid ODC needs the DP size ({dp_size}) to be a multiple of --gpus-per-node ({g})"
        )
    replicas = dp_size // g
    if replicas == 1:
        return 0.0
    sent = 2.0 * (replicas - 1) / replicas * grad_nbytes / g
    return sent / (hw.inter_node_gbps * 1e9 / g) + hw.ring_latency_s


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
    if plan.pipeline_stages > 1:
        return _simulate_pipeline(plan, schedule, model, hw)
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
    if schedule == "odc_hybrid":
        grad_nbytes = model.grad_nbytes_per_layer * layers
        time_s += minibatch_allreduce_s(hw, grad_nbytes, plan.dp_size)
    return _step_result(time_s, busy, hw)


def _step_result(time_s: float, busy: Sequence[float], hw: Hardware) -> StepResult:
    """Adds the per-step overhead (busy on every rank) and computes the bubble."""
    time_s += hw.step_overhead_s
    busy = tuple(b + hw.step_overhead_s for b in busy)
    bubble = math.fsum(time_s - b for b in busy) / (len(busy) * time_s) if time_s > 0 else 0.0
    return StepResult(time_s=time_s, busy_s=busy, bubble=bubble)


def _simulate_pipeline(plan: Plan, schedule: str, model: ModelSpec, hw: Hardware) -> StepResult:
    """One minibatch of a pipeline plan (see [Note: pipeline schedule model])."""
    stages, dp = plan.pipeline_stages, plan.dp_size
    layers = model.num_layers
    stage_layers = layers / stages
    get_s = layer_comm_s(hw, model.param_nbytes_per_layer, dp, schedule)
    push_s = layer_comm_s(hw, model.grad_nbytes_per_layer, dp, schedule, push=True)
    combine = max if hw.overlap else operator.add
    if dp >= hw.gpus_per_node:
        hop_bytes_per_s = hw.inter_node_gbps * 1e9 / hw.gpus_per_node
    else:
        hop_bytes_per_s = hw.intra_node_gbps * 1e9

    def run(compute: Sequence[float], tokens: Sequence[int]) -> float:
        forward = [stage_layers * combine(c / 3.0 / layers, get_s) for c in compute]
        backward = [stage_layers * combine(2.0 * c / 3.0 / layers, get_s + push_s) for c in compute]
        hop = [t * model.activation_nbytes_per_token / hop_bytes_per_s for t in tokens]
        return one_f_one_b_time(forward, backward, stages, hop)

    per_rank = [_microbatch_compute_s(plan, r, hw) for r in range(dp)]
    per_rank_tokens = [
        [sum(plan.lengths[s] for s in mb) for mb in plan.rank_microbatches(r)] for r in range(dp)
    ]
    if schedule == "fsdp":
        depth = max(len(c) for c in per_rank)
        slots = [max(c[i] if i < len(c) else 0.0 for c in per_rank) for i in range(depth)]
        slot_tokens = [
            max(t[i] if i < len(t) else 0 for t in per_rank_tokens) for i in range(depth)
        ]
        time_s = run(slots, slot_tokens)
    else:
        time_s = max(run(c, t) for c, t in zip(per_rank, per_rank_tokens, strict=True))
    if schedule == "odc_hybrid":
        grad_nbytes = model.grad_nbytes_per_layer * layers / stages
        time_s += minibatch_allreduce_s(hw, grad_nbytes, dp)
    return _step_result(time_s, [math.fsum(c) / stages for c in per_rank], hw)


def _pipeline_options(
    schedule: str, model: ModelSpec, hw: Hardware, dp_size: int, stages: int
) -> dict:
    """``make_plan``'s pipeline keywords for ``schedule`` (none without pipelines).

    The planner's cost units are the model's (FLOPs); a microbatch's communication per stage is that
    of every layer (two gets and a push), a floor under its time when overlapped, an overhead when not.
    """
    if stages == 1:
        return {}
    get_s = layer_comm_s(hw, model.param_nbytes_per_layer, dp_size, schedule)
    push_s = layer_comm_s(hw, model.grad_nbytes_per_layer, dp_size, schedule, push=True)
    comm_s = model.num_layers * (2.0 * get_s + push_s)
    return {
        "pipeline_stages": stages,
        "microbatch_overhead": (hw.microbatch_overhead_s + (0.0 if hw.overlap else comm_s))
        * hw.flops_per_s,
        "microbatch_floor": comm_s * hw.flops_per_s if hw.overlap else 0.0,
    }


def _plan(
    kind: str,
    ids: list[int],
    lengths: list[int],
    dp: int,
    cap: int | None,
    cost: CostModel,
    pipeline: dict,
):
    if kind == "lb_micro_ref":
        base = make_plan(
            "lb_micro", ids, lengths, dp, cap_tokens=cap, cost_model=cost, too_long="truncate"
        )
        return reference_lb_micro(base)
    return make_plan(
        kind, ids, lengths, dp, cap_tokens=cap, cost_model=cost, too_long="truncate", **pipeline
    )


def simulate_minibatches(
    minibatches: Sequence[Sequence[int]],
    *,
    dp_size: int,
    cap_tokens: int | None,
    model: ModelSpec,
    hw: Hardware,
    rows: Sequence[tuple[str, str]] = ROWS,
    plan_cost: CostModel | None = None,
    pipeline_stages: int = 1,
) -> list[dict]:
    """Simulates every row on the given minibatches (each ``dp_size * minibatch`` lengths).

    Args:
        minibatches: sample lengths of each global minibatch.
        dp_size: ranks N.
        cap_tokens: token cap per microbatch (None = no cap); longer samples are truncated.
        model: layers, bytes and cost model (the cost model also plans, unless ``plan_cost`` is
            given).
        hw: compute and link model.
        rows: (schedule, plan kind) pairs.
        plan_cost: cost model the balancer plans with (default ``model.cost``).
        pipeline_stages: pipeline stages per DP replica (``dp_size`` counts replicas); plans are made
            for them (``make_plan(pipeline_stages=...)``, with each schedule's per-microbatch
            communication as the microbatch floor) and simulated with [Note: pipeline schedule model].

    Returns:
        One dict per row: ``schedule``, ``plan``, ``time_s`` (sum over minibatches), ``bubble``
        (total idle / total rank-time), ``step_times_s`` and ``speedup`` (baseline time / this
        time, when the baseline row is present).

    Raises:
        ValueError: no minibatch, ``dp_size < 1``, or a minibatch not a multiple of ``dp_size``.
    """
    if dp_size < 1 or not minibatches:
        raise ValueError(f"need dp_size >= 1 and at least one minibatch, got {dp_size}")
    plan_cost = plan_cost or model.cost
    if pipeline_stages < 1:
        raise ValueError(f"--pipeline-stages must be >= 1, got {pipeline_stages}")
    if pipeline_stages > 1 and any(kind == "lb_micro_ref" for _, kind in rows):
        raise ValueError("the lb_micro_ref plan has no pipeline variant; leave it out of the rows")
    results = {row: [] for row in rows}
    for index, lengths in enumerate(minibatches):
        if len(lengths) % dp_size:
            raise ValueError(
                f"minibatch {index} has {len(lengths)} samples, not a multiple of dp_size={dp_size}"
            )
        ids = list(range(len(lengths)))
        plans: dict[tuple, Plan] = {}
        for schedule, kind in rows:
            pipeline = _pipeline_options(schedule, model, hw, dp_size, pipeline_stages)
            key = (kind, *pipeline.values())
            if key not in plans:
                plans[key] = _plan(
                    kind, ids, list(lengths), dp_size, cap_tokens, plan_cost, pipeline
                )
            plan = plans[key]
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
    """Consecutive minibatches of ``random.Random(seed).shuffle``-d lengths.

    The balance tool (:func:`megatron_odc.tools.balance_cli.compare_plans`) draws the same samples.
    """
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
    pipeline_stages: int = 1,
) -> list[dict]:
    """Draws ``num_minibatches`` minibatches of ``dp_size * minibatch`` samples; simulates each row.

    With ``pipeline_stages > 1``, ``dp_size`` counts DP replicas and ``minibatch`` samples per replica.

    Raises:
        ValueError: ``dp_size`` outside 1..1024, ``minibatch`` or ``num_minibatches`` below 1, or
            a pool too small for the draw.
    """
    if dp_size < 1 or dp_size > 1024 or minibatch < 1 or num_minibatches < 1:
        raise ValueError(
            f"need 1 <= --dp <= 1024, --minibatch >= 1, --num-minibatches >= 1; got {dp_size}, "
            f"{minibatch}, {num_minibatches}"
        )
    batches = draw_minibatches(lengths, dp_size * minibatch, num_minibatches, seed)
    return simulate_minibatches(
        batches,
        dp_size=dp_size,
        cap_tokens=cap_tokens,
        model=model,
        hw=hw,
        rows=rows,
        pipeline_stages=pipeline_stages,
    )


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
