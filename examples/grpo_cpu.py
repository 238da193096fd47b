#!/usr/bin/env python
"""GRPO on CPU: ODC + LB-Mini with uneven counts next to padded megatron-core DDP and PyTorch FSDP2.

Shows: a verl-style GRPO update driven by its own loop (``megatron_odc/mcore/rl/``, docs/rl.md): a
small megatron-core GPT policy and a frozen reference, synthetic prompts whose rollout lengths are drawn
from the shipped long-tailed agent / SWE-style profile (``agent_rl`` in
``megatron_odc/balance/length_profiles.json``, divided by the settings' length scale), packed
microbatches whose samples attend only within themselves (THD ``cu_seqlens``), group-relative
advantages, a KL term to the reference (k3 estimator), the loss contract ``token-loss sum x local n x DP / global tokens``. Three backends train on the same
rollouts, interleaved step by step:

- ``odc``: ODC with the LB-Mini plan (uneven microbatch counts per rank, 0 allowed), the policy's units
  kept unsharded for the step (``--odc-unsharded-budget all``: one fetch and one push per unit per
  step instead of per microbatch), reference under ODC (``build_reference``);
- ``ddp``: megatron-core DDP the way the stacks feed it: the same number of samples per rank (sample i
  to rank i % DP), packed under the cap, the microbatch counts padded to the largest with empty
  microbatches (no loss tokens); replicated reference;
- ``fsdp2``: PyTorch FSDP2 (``fully_shard`` per layer and the root) with the best equal-count plan
  (LB-Micro), reference under FSDP2 too. Its policy keeps its parameters unsharded from forward to
  backward (``reshard_after_forward=False``) and its gradients unsharded until the step's last
  microbatch, the same peak as ODC keeping every unit (every layer's parameters at the end of a
  forward); with ``--odc-unsharded-budget none`` (ZeRO-3: fetch per use) FSDP2 reshards after forward.

The plans use a cost model measured on this machine first (``mcore/cost_probe.py``: one-sample
microbatches timed, ``a * s**2 + b * s`` per sample plus a fixed cost per microbatch, which LB-Mini
counts). Each backend prints its per-step loss, grad norm and step time (max over ranks, from a barrier
to the end of the optimizer step); the last line gives ODC's measured speedups (ratios of the timed
steps' totals) and the measured cost model's predicted ones for the same plans (ODC and DDP: the
slowest rank's microbatches, DDP's padding included; FSDP2: the lockstep sum over microbatch indices
of the slowest rank's microbatch; communication and parameter copies are not modelled).
Needs: cpu
Takes: about 45 s on 2 CPU cores (--tiny: about 10 s)

``--with-ddp-lb-mini`` adds a diagnostic row: megatron-core DDP on LB-Mini's own plan (its gradient
all-reduce runs once per step, so uneven counts run), which separates the balancing's gain on this
machine from ODC's per-microbatch parameter copies.

Run: ``python examples/grpo_cpu.py [--tiny] [--dp 2] [--steps 12] [--length-scale 32]
[--odc-unsharded-budget {all,none}] [--with-ddp-lb-mini]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from megatron_odc.core.budget import BUDGET_ALL, BUDGET_NONE

BACKENDS = ("odc", "ddp", "fsdp2")
BUDGETS = (BUDGET_ALL, BUDGET_NONE)
"""The ``--odc-unsharded-budget`` values the example pairs with an FSDP2 setting of the same peak
memory (``megatron_odc.core.budget`` also takes a size, which FSDP2 has no counterpart for)."""
PROFILE = "agent_rl"
PROMPT_TOKENS = 8
PAD_ID = 0
PADDING_TOKENS = 16
"""Length of the empty microbatch a padded rank runs (pad tokens, no loss)."""
CAP_DIVISOR = 4
"""Tokens per microbatch: the longest rollout's / 4 (a longer rollout runs alone in its microbatch),
as RL stacks cap microbatches by tokens (verl's ``max_token_len``)."""
DDP_LB_MINI = "ddp_lb_mini"
"""The diagnostic row of ``--with-ddp-lb-mini``: megatron-core DDP on ODC's own plan."""
PLAN_OF = {"odc": "lb_mini", "ddp": "round_robin", "fsdp2": "lb_micro", DDP_LB_MINI: "lb_mini"}
"""Each backend's plan (``megatron_odc.balance.make_plan``): ODC balances the step's samples by cost
with any count per rank; DDP takes the stacks' equal split of samples (sample i to rank i % DP), packs
each rank's under the cap and pads the counts with empty microbatches; FSDP2 gets the best equal-count
plan (LB-Micro). The diagnostic row runs DDP on LB-Mini's uneven counts (megatron-core's DDP reduces
once per step, so they run): the balancing's gain on this machine without ODC's parameter copies."""
NAMES = {
    "odc": "ODC+LB-Mini",
    "ddp": "DDP padded",
    "fsdp2": "FSDP2 LB-Micro",
    DDP_LB_MINI: "DDP LB-Mini",
}
KL_BETA = 0.04
CLIP_EPS = 0.2


@dataclasses.dataclass(frozen=True)
class Settings:
    """Model and workload sizes."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    vocab_size: int
    length_scale: int
    prompts: int
    group_size: int
    steps: int
    warmup: int
    unsharded_budget: str = BUDGET_ALL
    """ODC's ``--odc-unsharded-budget`` for the policy (one of :data:`BUDGETS`); FSDP2's policy
    reshards after forward exactly when it is ``none``, for the same peak memory."""
    ddp_lb_mini: bool = False
    """Also run the diagnostic row (:data:`DDP_LB_MINI`)."""

    @property
    def backends(self) -> tuple[str, ...]:
        """The rows this run trains, in the order they run each step."""
        return BACKENDS + ((DDP_LB_MINI,) if self.ddp_lb_mini else ())


FULL = Settings(4, 128, 512, 256, 32, 2, 8, 12, 1)
TINY = Settings(2, 64, 128, 128, 256, 2, 4, 2, 1)


# ---------------------------------------------------------------------- rollouts (same on every rank)


def rollouts(settings: Settings, step: int, lengths_pool: list[int]) -> dict:
    """The step's synthetic rollouts: lengths from the profile, tokens, rewards, group advantages."""
    rng = random.Random(1000 + step)
    cap = max(lengths_pool) // settings.length_scale
    count = settings.prompts * settings.group_size
    lengths = [
        min(cap, max(PROMPT_TOKENS + 2, rng.choice(lengths_pool) // settings.length_scale))
        for _ in range(count)
    ]
    gen = torch.Generator().manual_seed(2000 + step)
    tokens = [torch.randint(1, settings.vocab_size, (n,), generator=gen) for n in lengths]
    rewards = [rng.random() for _ in range(count)]
    advantages = []
    for g in range(settings.prompts):
        group = rewards[g * settings.group_size : (g + 1) * settings.group_size]
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        advantages += [(r - mean) / (std + 1e-6) for r in group]
    return {"lengths": lengths, "tokens": tokens, "advantages": advantages, "cap": cap}


def microbatch(batch: dict, sample_ids: tuple[int, ...]) -> dict:
    """One packed microbatch of ``sample_ids`` (an empty tuple: a padding microbatch without loss)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_odc.data.packing import pack_microbatch
    from megatron_odc.data.sft import SFTSample

    samples = []
    for sid in sample_ids:
        tokens = batch["tokens"][sid]
        mask = torch.zeros(tokens.numel(), dtype=torch.bool)
        mask[PROMPT_TOKENS:] = True  # the response carries the loss
        samples.append(SFTSample(tokens, mask))
    packed = pack_microbatch(samples, pad_to=None if samples else PADDING_TOKENS, pad_id=PAD_ID)
    advantage = torch.tensor([batch["advantages"][sid] for sid in sample_ids] + [0.0])
    segments = packed.segment_ids()
    cu_seqlens = packed.cu_seqlens.to(torch.int32)
    return {
        "tokens": packed.tokens,
        "labels": packed.labels,
        "position_ids": packed.position_ids,
        "packed_seq_params": PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=packed.max_seqlen,
            max_seqlen_kv=packed.max_seqlen,
        ),
        "loss_mask": packed.loss_mask,
        "advantage": advantage[segments.clamp(max=advantage.numel() - 1)].view(1, -1),
    }


def token_losses(model, mb: dict) -> torch.Tensor:
    """The per-token cross entropy megatron's GPT returns given labels; the packed samples attend
    only within themselves (THD ``cu_seqlens``: on CPU the local attention runs each alone)."""
    return model(
        mb["tokens"],
        mb["position_ids"],
        None,
        labels=mb["labels"],
        packed_seq_params=mb["packed_seq_params"],
    )


def token_logprobs(model, mb: dict) -> torch.Tensor:
    """log p(label) per token."""
    return -token_losses(model, mb)


def grpo_token_loss(logp: torch.Tensor, ref_logp: torch.Tensor, advantage: torch.Tensor):
    """Clipped policy-gradient term (one update per rollout batch: the old policy is this one) plus
    the k3 estimate of KL(policy || reference), per token."""
    ratio = torch.exp(logp - logp.detach())
    policy = -torch.minimum(ratio * advantage, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * advantage)
    log_ratio = ref_logp - logp
    kl = torch.exp(log_ratio) - log_ratio - 1
    return policy + KL_BETA * kl


def verl_loss(mb: dict, ref_logp: torch.Tensor, scale: float, output: torch.Tensor):
    """The verl contract: the microbatch's token-loss sum x (local n x DP / global tokens)."""
    mask = mb["loss_mask"].float()
    loss_sum = (grpo_token_loss(-output.float(), ref_logp, mb["advantage"]) * mask).sum()
    return loss_sum * scale, {"loss": torch.stack([loss_sum.detach(), mask.sum()])}


def verl_forward_step(mbs: list, refs: list, scale: float, data_iterator, model):
    index = next(data_iterator)
    mb = mbs[index]
    return token_losses(model, mb), functools.partial(verl_loss, mb, refs[index], scale)


# ---------------------------------------------------------------------- the three backends


def gpt_config(settings: Settings, seq_length: int):
    """The policy's (and the reference's) shape."""
    from megatron_odc.mcore.model import GPTConfig

    return GPTConfig(
        num_layers=settings.num_layers,
        hidden_size=settings.hidden_size,
        num_attention_heads=4,
        ffn_hidden_size=settings.ffn_hidden_size,
        vocab_size=settings.vocab_size,
        seq_length=seq_length,
        calculate_per_token_loss=False,
    )


@dataclasses.dataclass(frozen=True)
class MeasuredCost:
    """The cost model fitted to this machine's timings (seconds) and its fixed cost per microbatch."""

    cost_model: object
    microbatch_s: float
    line: str


def measured_cost(settings: Settings, longest: int) -> MeasuredCost:
    """Times one-sample microbatches up to ``longest`` tokens on a fresh policy-shaped GPT (every
    rank, averaged) and fits ``a * s**2 + b * s`` per sample plus a fixed cost per microbatch."""
    from megatron_odc.balance.cost import CostModel, describe_fit
    from megatron_odc.mcore.cost_probe import probe_lengths, time_microbatches
    from megatron_odc.mcore.model import build_gpt_model

    lengths = probe_lengths(longest)
    model = build_gpt_model(gpt_config(settings, longest), seed=7)
    seconds = time_microbatches(model, lengths, vocab_size=settings.vocab_size)
    cost_model, microbatch_s = CostModel.fit(lengths, seconds)
    line = describe_fit(cost_model, microbatch_s, lengths, seconds)
    return MeasuredCost(cost_model, microbatch_s, line)


def predicted_seconds(backend: str, plan, measured) -> float:
    """The step time the measured cost model predicts for ``backend`` running ``plan`` (compute only:
    no communication or parameter copies). The plans carry the fixed cost of a microbatch
    (``microbatch_overhead``), which the plan's own times add per microbatch: ODC, the slowest rank;
    DDP, the same with every rank padded to the largest count by empty microbatches of
    :data:`PADDING_TOKENS`; FSDP2, the lockstep sum over microbatch indices of the slowest rank's
    microbatch."""
    if backend == "fsdp2":
        return plan.pipeline_lockstep_time()
    if backend in ("odc", DDP_LB_MINI):
        return plan.pipeline_odc_time()
    counts = plan.num_microbatches()
    padding = measured.cost_model.sample_cost(PADDING_TOKENS) + measured.microbatch_s
    return max(
        plan.replica_pipeline_time(r) + padding * (max(counts) - n) for r, n in enumerate(counts)
    )


def build(backend: str, settings: Settings, seq_length: int):
    """``(policy, optimizer, reference)`` of ``backend`` from the same seed."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_odc.mcore.config import ODCConfig
    from megatron_odc.mcore.model import build_gpt_model
    from megatron_odc.mcore.rl.loop import build_rl_backend
    from megatron_odc.mcore.rl.reference import build_reference

    backend = "ddp" if backend == DDP_LB_MINI else backend  # the diagnostic row is DDP

    cfg = gpt_config(settings, seq_length)
    optimizer_config = OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, clip_grad=1.0)
    if backend in ("odc", "ddp"):
        policy, optimizer = build_rl_backend(
            backend,
            build_gpt_model(cfg, seed=7),
            optimizer_config,
            loss_contract="global_tokens",
            odc_config=ODCConfig(unsharded_budget=settings.unsharded_budget)
            if backend == "odc"
            else None,
        )
        reference = build_gpt_model(cfg, seed=7)
        if backend == "odc":
            reference = build_reference(reference)
        return policy, optimizer, reference
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    models = []
    for frozen in (False, True):
        model = build_gpt_model(cfg, seed=7)
        model.requires_grad_(not frozen)
        # The frozen reference runs forward only: nothing would ever reshard it.
        reshard = frozen or settings.unsharded_budget == BUDGET_NONE
        for layer in model.decoder.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)  # the loss is already over the global tokens
                module.set_force_sum_reduction_for_comms(True)  # gloo has no AVG / PREMUL_SUM
        models.append(model)
    optimizer = torch.optim.AdamW(models[0].parameters(), lr=1e-4, weight_decay=0.01)
    return models[0], optimizer, models[1]


def train_step(
    backend, policy, optimizer, mbs, refs, global_tokens, dp_size
) -> tuple[float, float]:
    """One update; returns (this rank's token-loss sum, grad norm)."""
    n = len(mbs)
    if backend == "fsdp2":
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for i, mb in enumerate(mbs):
            policy.set_requires_gradient_sync(i == n - 1)
            loss, report = verl_loss(mb, refs[i], 1.0 / global_tokens, token_losses(policy, mb))
            loss.backward()
            loss_sum += float(report["loss"][0])
        norm = torch.nn.utils.clip_grad_norm_(list(policy.parameters()), 1.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        optimizer.step()
        return loss_sum, float(norm)
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_schedule

    from megatron_odc.mcore.rl.loop import get_forward_backward_func, global_tokens_scale

    schedule = get_forward_backward_func() if backend == "odc" else megatron_schedule()
    policy.zero_grad_buffer()
    optimizer.zero_grad()
    reports = schedule(
        forward_step_func=functools.partial(
            verl_forward_step, mbs, refs, global_tokens_scale(n, global_tokens, dp_size)
        ),
        data_iterator=iter(range(n)),
        model=[policy],
        num_microbatches=n,
        seq_length=max((mb["tokens"].shape[1] for mb in mbs), default=1),
        micro_batch_size=1,
        forward_only=False,
    )
    _, norm, _ = optimizer.step()
    return sum(float(r["loss"][0]) for r in reports), float(norm)


def rank_main(rank: int, world_size: int, settings: Settings, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    from megatron_odc.balance import make_plan
    from megatron_odc.balance.profiles import load_profile_lengths
    from megatron_odc.integration.cpu import cpu_runtime
    from megatron_odc.mcore.parallel import model_parallel

    pool = load_profile_lengths(PROFILE)
    longest = max(pool) // settings.length_scale
    cap = longest // CAP_DIVISOR
    with cpu_runtime(), model_parallel(1) as coords:
        dp_rank, dp_size = coords.dp_rank, coords.dp_size
        measured = measured_cost(settings, longest)
        if dp_rank == 0:
            print(f"cost model measured on this machine: {measured.line}")
        built = {b: build(b, settings, longest) for b in settings.backends}
        rows: dict = {b: [] for b in settings.backends}
        predicted = dict.fromkeys(settings.backends, 0.0)
        for step in range(settings.warmup + settings.steps):
            batch = rollouts(settings, step, pool)
            ids = list(range(len(batch["lengths"])))
            plans = {
                backend: make_plan(
                    kind,
                    ids,
                    batch["lengths"],
                    dp_size,
                    cap_tokens=cap,
                    cost_model=measured.cost_model,
                    microbatch_overhead=measured.microbatch_s,
                    too_long="alone",
                )
                for backend, kind in PLAN_OF.items()
            }
            timed = step >= settings.warmup
            if timed:
                for backend in settings.backends:
                    predicted[backend] += predicted_seconds(backend, plans[backend], measured)
            global_tokens = sum(n - PROMPT_TOKENS for n in batch["lengths"])
            for backend in settings.backends:
                policy, optimizer, reference = built[backend]
                mine = list(plans[backend].rank_microbatches(dp_rank))
                counts = plans[backend].num_microbatches()
                if backend == "ddp":  # pad to the largest count with empty microbatches
                    mine += [()] * (max(counts) - len(mine))
                    counts = [max(counts)] * dp_size
                mbs = [microbatch(batch, m) for m in mine]
                with torch.no_grad():
                    refs = [token_logprobs(reference, mb) for mb in mbs]
                dist.barrier()
                start = time.perf_counter()
                loss_sum, norm = train_step(
                    backend, policy, optimizer, mbs, refs, global_tokens, dp_size
                )
                elapsed = torch.tensor([time.perf_counter() - start, loss_sum])
                dist.all_reduce(elapsed[:1], op=dist.ReduceOp.MAX)
                total = elapsed[1:].clone()
                dist.all_reduce(total)
                rows[backend].append(
                    (step, float(total) / global_tokens, norm, float(elapsed[0]), counts, timed)
                )
        if dp_rank == 0:
            report(rows, predicted, settings, dp_size)
        policy, _, reference = built["odc"]
        policy.close()  # release the shared-memory shards
        reference.close()
    dist.destroy_process_group()


def report(rows: dict, predicted: dict, settings: Settings, dp_size: int) -> None:
    print(
        f"GRPO on CPU, DP={dp_size}, profile {PROFILE} / {settings.length_scale}, "
        f"{settings.prompts} prompts x {settings.group_size} rollouts, {settings.num_layers} layers "
        f"x {settings.hidden_size}; step {settings.warmup - 1} and before: warm-up (not timed)"
    )
    for backend in rows:
        for step, loss, norm, seconds, counts, _ in rows[backend]:
            print(
                f"{NAMES[backend]:<12} step {step}: loss {loss:.6f} grad norm {norm:.6f} "
                f"step time {seconds:.3f} s microbatches per rank {counts}"
            )
    # Totals of the timed steps, as the predictions sum the same steps' planned costs.
    times = {b: math.fsum(r[3] for r in rows[b] if r[5]) for b in rows}
    if DDP_LB_MINI in rows:
        print(
            f"diagnostic: DDP on LB-Mini's plan {times['ddp'] / times[DDP_LB_MINI]:.2f}x vs DDP "
            f"padded (predicted {predicted['ddp'] / predicted[DDP_LB_MINI]:.2f}x: the balancing "
            f"alone); ODC's speed on that plan: {times[DDP_LB_MINI] / times['odc']:.2f}x DDP's (its "
            "parameter copies)"
        )
    print(
        f"measured ODC+LB-Mini speedup (timed steps' total): {times['ddp'] / times['odc']:.2f}x vs "
        f"DDP padded, {times['fsdp2'] / times['odc']:.2f}x vs FSDP2 equal counts; cost model predicts "
        f"{predicted['ddp'] / predicted['odc']:.2f}x vs DDP padded, "
        f"{predicted['fsdp2'] / predicted['odc']:.2f}x vs FSDP2 (measured cost model, no "
        "communication or copies)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model and run (seconds)")
    parser.add_argument("--dp", type=int, default=2, help="CPU ranks (DP size)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps")
    parser.add_argument(
        "--length-scale",
        type=int,
        default=None,
        help=f"divide the {PROFILE} profile's lengths by this (default {FULL.length_scale}, "
        f"--tiny {TINY.length_scale}; 16: rollouts up to about 4,000 tokens)",
    )
    parser.add_argument(
        "--with-ddp-lb-mini",
        action="store_true",
        help="also run megatron-core DDP on LB-Mini's plan (a diagnostic row: the balancing's gain "
        "without ODC's parameter copies)",
    )
    parser.add_argument(
        "--odc-unsharded-budget",
        default=BUDGET_ALL,
        choices=BUDGETS,
        help="ODC keeps every unit unsharded for the step (all) or fetches it per use (none); "
        "FSDP2 keeps its parameters from forward to backward or reshards after forward to match",
    )
    args = parser.parse_args(argv)
    if args.dp < 1:
        parser.error(f"--dp must be >= 1, got {args.dp}")
    settings = dataclasses.replace(
        TINY if args.tiny else FULL,
        unsharded_budget=args.odc_unsharded_budget,
        ddp_lb_mini=args.with_ddp_lb_mini,
    )
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps must be >= 1, got {args.steps}")
        settings = dataclasses.replace(settings, steps=args.steps)
    if args.length_scale is not None:
        if args.length_scale < 1:
            parser.error(f"--length-scale must be >= 1, got {args.length_scale}")
        settings = dataclasses.replace(settings, length_scale=args.length_scale)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="grpo-cpu-") as tmp:
        mp.start_processes(
            rank_main,
            args=(args.dp, settings, os.path.join(tmp, "store")),
            nprocs=args.dp,
            start_method="spawn",
        )
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
