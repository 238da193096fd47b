"""Imbalance benchmark: real megatron-core GPT training steps under FSDP, ODC and DDP with each plan.

Spawns two CPU ranks (gloo through a file store, one torch thread each), builds the same GPT three times
(``odc`` over the shared-memory transport, ``fsdp`` = the same engine over the collective transport, ``ddp`` =
megatron-core's DDP) and trains them, interleaved, on the same SFT-like minibatches of random tokens:

==============================  =======================================================================
configuration                   what runs
==============================  =======================================================================
``fsdp+lb_micro``               lockstep ZeRO-3 with the microbatch-level balancer (the baseline of every ratio)
``fsdp+local_sort``             lockstep ZeRO-3, one sample per microbatch sorted by length (LongAlign's policy)
``odc+lb_micro``                ODC with the same plan as the baseline (the communication change alone)
``odc+lb_mini``                 ODC with the minibatch-level balancer (uneven microbatch counts)
``odc-all+lb_mini``             the same with ``--odc-unsharded-budget all`` (one fetch and one push per unit per
                                minibatch; unsharded state kept from first use to the fence)
``ddp+lb_mini``                 replicated parameters (megatron-core DDP): the memory upper bound
``fsdp2+lb_micro``              PyTorch FSDP2 (``fully_shard`` per TransformerLayer and the root, reshard after
                                forward), the same plan as the baseline, no gradient sync until the last
                                microbatch
``fsdp2-noreshard+lb_micro``    the same with ``reshard_after_forward=False`` and no reshard after
                                backward until the last microbatch (each unit all-gathered once per minibatch)
==============================  =======================================================================

The FSDP2 rows are the same GPT (same seed) in fp32, rounded to bf16 when ``--dtype bf16`` (the initial
weights of the other rows' bf16 parameters), wrapped with ``fully_shard(mp_policy=MixedPrecisionPolicy(
param_dtype=<--dtype>, reduce_dtype=fp32))``; ``torch.optim.AdamW`` with the settings megatron's optimizer runs with here (lr
1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.01 on every parameter, as no scheduler applies megatron's
``wd_mult``) and ``clip_grad_norm_(1.0)``. A plain loop over the rank's microbatches runs the model forward, the same
per-token loss sum, divided by the loss tokens of the whole global minibatch (known to every rank from the
plan), and ``backward``; FSDP2 sums the gradients over ranks (divide factor 1), so the gradients equal
megatron's per-token ones.

[Note: workload]
Sample lengths are drawn (seeded) from a profile of ``length_profiles.json`` and divided by ``--length-scale``
(default 16: the paper's 64K cap becomes 4096 tokens). Each rank packs every microbatch of its plan into one
sequence with a block-diagonal causal mask (``megatron_odc.data.packing``); the model's core attention runs
each diagonal block on its own (:class:`SegmentedDotProductAttention`, exact because the off-block scores are
all masked), so attention costs ``sum(s_i**2)`` like varlen flash attention, not ``(sum s_i)**2``. Loss is
per token (``calculate_per_token_loss``). The model (:data:`MODEL`, bf16 in ``Float16Module`` by default) is
sized so that at the longest sample (4096 tokens) the quadratic term is about 60% of the cost (61% by the
FLOP model, 54-66% in fits of measured times), as for the paper's 1.5B at 64K (65% by the FLOP model); see
``docs/benchmarks.md``. Plans use the cost model fitted to this machine (:data:`CPU_COST`, ``--calibrate``).

[Note: what is measured]
- Step time: per rank, from a barrier to the end of ``train_step`` (zero grads, forward/backward of the
  rank's microbatches, gradient sync, optimizer step); the step time is the max over ranks. ``cpu_s`` is the
  rank's main-thread CPU time over the same span (wall - cpu = waiting + time preempted by other load).
- Busy/idle per rank: ``odc``/``fsdp``: idle = fetch wait + push + fence time of the engine telemetry
  (for ``fsdp`` these are the blocking collectives, which include waiting for the slower rank; for ``odc``
  they are shared-memory copies plus the per-minibatch fence); ``ddp``: idle = time inside
  ``finalize_model_grads`` (the gradient all-reduce, which waits for the slower rank); ``fsdp2*``: idle =
  time inside FSDP2's all-gathers (``unshard`` / ``wait_for_unshard``) and gradient reductions
  (``post_backward`` / ``finalize_backward``, which include waiting for the slower rank and FSDP2's copies).
  busy = step - idle.
- Memory per rank, in bytes, never RSS: ``state_nbytes`` = persistent model/optimizer state (unique
  storages of parameters, gradient buffers, engine shards and accumulators, fp32 main shards and optimizer
  state) + ``unsharded_peak_nbytes`` (peak of the engine's unsharded parameter and gradient buffers,
  sampled after each fetch and at each backward start); ``activation_peak_nbytes`` = the largest sum over one
  microbatch of the unique storages saved for backward (autograd saved-tensor hooks, parameters excluded);
  ``peak_nbytes`` = the sum of the two. ``fsdp2*``: persistent = local shards of parameters, gradients and
  AdamW state; unsharded peak = unique storages of FSDP2's unsharded parameters (all-gather outputs) and
  unsharded / accumulated gradients, sampled around each all-gather and gradient reduction (for
  ``fsdp2-noreshard`` it reaches the whole model, plus the unsharded gradients kept between
  microbatches); ``None`` if FSDP2's internals cannot be read.

Usage::

    python benchmarks/imbalance.py --quick [--json]
    python benchmarks/imbalance.py [--profiles longalign,uniform] [--minibatches 1,2,4,8] [--repeats 5]
        [--json] [--out results.json] [--timeline timeline.json]

``--json`` writes one JSON object per (profile, minibatch, configuration) line. ``--quick`` runs longalign,
minibatch 4 (unless ``--profiles`` / ``--minibatches`` say otherwise; every other flag applies as given),
5 repeats by default (about 2.5 minutes on an idle 2-core AVX-512 machine in bf16, 5.3 minutes on an AVX2
one in fp32) and ends with a line per cell holding the ratios of ``odc+lb_mini`` to ``fsdp+lb_micro`` and to
``fsdp2+lb_micro``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import itertools
import json
import logging
import math
import os
import pickle
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional

from megatron_odc.balance import CostModel, make_plan
from megatron_odc.balance.profiles import load_profile_lengths

logger = logging.getLogger(__name__)

WORLD_SIZE = 2
PROFILES = ("longalign", "swe_smith", "rl_aime", "uniform")
MINIBATCHES = (1, 2, 4, 8)
FULL = {"profiles": ",".join(PROFILES), "minibatches": ",".join(map(str, MINIBATCHES))}
QUICK = {"profiles": "longalign", "minibatches": "4"}
"""``--profiles`` / ``--minibatches`` when not given, without and with ``--quick``."""
CONFIGS = (
    ("fsdp", "lb_micro"),
    ("fsdp", "local_sort"),
    ("odc", "lb_micro"),
    ("odc", "lb_mini"),
    ("odc-all", "lb_mini"),
    ("ddp", "lb_mini"),
    ("fsdp2", "lb_micro"),
    ("fsdp2-noreshard", "lb_micro"),
)
BASELINE = "fsdp+lb_micro"
FSDP2_BACKENDS = {"fsdp2": True, "fsdp2-noreshard": False}
"""PyTorch FSDP2 backends and their ``reshard_after_forward``."""
LOCKSTEP_BACKENDS = ("fsdp", *FSDP2_BACKENDS)
"""Backends whose plan bubble is the lockstep one."""
#: megatron's OptimizerConfig of every row (Adam = torch AdamW, betas 0.9/0.999, eps 1e-8 by default).
OPTIMIZER = {"lr": 1e-4, "weight_decay": 0.01, "clip_grad": 1.0}
ODC_VARIANTS = {"odc-all": {"unsharded_budget": "all"}}
"""Benchmark backends that are ``odc`` with other ODCConfig options (``--odc-unsharded-budget all``:
every unit fetched once and pushed once per minibatch)."""
PAPER_CAP_TOKENS = 65536
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_LENGTH_SCALE = 16

#: The GPT trained (megatron_odc.mcore.model.GPTConfig fields).
MODEL = {
    "num_layers": 8,
    "hidden_size": 128,
    "num_attention_heads": 2,
    "ffn_hidden_size": 1024,
    "vocab_size": 512,
}

#: Per-sample cost a*s^2 + b*s in seconds of fwd+bwd on one core (``--calibrate``, bf16, two fits on
#: the shared machine averaged; only a/b matters to the balancer, so fp32 runs plan with it too).
CPU_COST = {"a": 4.7e-8, "b": 1.28e-4}


def config_name(backend: str, plan: str) -> str:
    """Returns ``backend+plan``."""
    return f"{backend}+{plan}"


# ---------------------------------------------------------------------------------------- model


def _segmented_attention_cls() -> type:
    """Builds :class:`SegmentedDotProductAttention` lazily (megatron is imported only in the ranks)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SegmentedDotProductAttention(DotProductAttention):
        """Core attention over a block-diagonal causal mask, one fused causal kernel per diagonal block.

        Segment ``k`` starts at token ``i`` when ``mask[i, i-1]`` is masked (True). Scores between segments
        are all masked, so running each diagonal block alone through torch's fused causal attention
        (``scaled_dot_product_attention(is_causal=True)``, the CPU analogue of varlen flash attention)
        gives the output of the masked dense attention at ``sum(s_k**2)`` cost. No dropout, no GQA.
        """

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            num_tokens = query.shape[0]
            if attention_mask is None:
                starts = [0]
            else:
                below = attention_mask[0, 0].diagonal(offset=-1)
                starts = [0, *(int(i) + 1 for i in below.nonzero().flatten())]
            bounds = [*starts, num_tokens]
            outs = []
            for lo, hi in itertools.pairwise(bounds):
                # [s, b, np, hn] -> [b, np, s, hn]
                q, k, v = (t[lo:hi].permute(1, 2, 0, 3) for t in (query, key, value))
                ctx = functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale
                )
                outs.append(ctx.permute(2, 0, 1, 3).reshape(hi - lo, ctx.shape[0], -1))
            return torch.cat(outs, dim=0)

    return SegmentedDotProductAttention


def build_model(seed: int, seq_length: int, dtype: str = "fp32") -> torch.nn.Module:
    """A megatron-core GPTModel of :data:`MODEL` with segmented core attention (CPU patches applied).

    With ``dtype="bf16"`` the parameters are bf16 and the model is wrapped in ``Float16Module``, as
    Megatron-LM does for ``--bf16``.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from megatron_odc.mcore.model import GPTConfig, transformer_config

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    bf16 = dtype == "bf16"
    cfg = GPTConfig(**MODEL, seq_length=seq_length, params_dtype=DTYPES[dtype], bf16=bf16)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=cfg.normalization))
    spec.submodules.self_attention.submodules.core_attention = _segmented_attention_cls()
    model = GPTModel(
        config=transformer_config(cfg),
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type,
    )
    return Float16Module(model.config, model) if bf16 else model


def build_fsdp2(
    seq_length: int, dtype: str, reshard_after_forward: bool, seed: int = 1
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The GPT of :func:`build_model` under PyTorch FSDP2, with its AdamW (needs the default process group).

    The model is built in fp32 with the other rows' seed (rounded to bf16 first when ``dtype="bf16"``, so
    the fp32 sharded parameters start at the bf16 rows' weights); ``fully_shard`` wraps each
    TransformerLayer and then the root, with ``MixedPrecisionPolicy(param_dtype=<dtype>,
    reduce_dtype=fp32)`` and ``reshard_after_forward`` on every module. Gradients are summed over ranks
    (divide factor 1, plain SUM reductions, which gloo supports): the loss is already divided by the global loss-token count. The optimizer is
    ``torch.optim.AdamW`` with the other rows' effective :data:`OPTIMIZER` settings (weight decay on every
    parameter: megatron's ``wd_mult=0`` for biases is applied only by a scheduler, which none of the rows
    has).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    model = build_model(seed=seed, seq_length=seq_length, dtype="fp32")
    if dtype != "fp32":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(DTYPES[dtype]).float())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": reshard_after_forward}
    for layer in model.decoder.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM / AVG
    # megatron's param groups give biases and 1-D parameters wd_mult 0, but only an
    # OptimizerParamScheduler applies wd_mult; the other rows run without one, so every parameter decays.
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=OPTIMIZER["lr"],
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=OPTIMIZER["weight_decay"],
    )
    return model, optimizer


# ---------------------------------------------------------------------------------------- data


def scaled_lengths(profile: str, length_scale: int) -> list[int]:
    """The profile's lengths divided by ``length_scale`` (at least 2 tokens)."""
    return [max(2, round(n / length_scale)) for n in load_profile_lengths(profile)]


def draw_minibatches(
    pool: Sequence[int], global_batch: int, count: int, seed: int
) -> list[list[int]]:
    """``count`` minibatches of ``global_batch`` lengths drawn without replacement (seeded)."""
    rng = random.Random(seed)
    order = rng.sample(range(len(pool)), global_batch * count)
    return [
        [pool[i] for i in order[k * global_batch : (k + 1) * global_batch]] for k in range(count)
    ]


def _sample(sample_id: int, length: int, vocab_size: int):
    """A random-token SFT sample: the first third is prompt (no loss), the rest response."""
    from megatron_odc.data.sft import SFTSample

    gen = torch.Generator().manual_seed(1_000_003 * sample_id + length)
    tokens = torch.randint(0, vocab_size, (length,), generator=gen)
    loss_mask = torch.zeros(length, dtype=torch.bool)
    loss_mask[length // 3 :] = True
    return SFTSample(tokens=tokens, loss_mask=loss_mask)


def build_microbatches(
    plan_microbatches: Sequence[Sequence[int]], lengths: dict[int, int], vocab_size: int
) -> list[dict[str, torch.Tensor]]:
    """Packs one rank's planned microbatches (an empty one becomes a 1-token pad with no loss)."""
    from megatron_odc.data.packing import pack_microbatch

    out = []
    for mb in plan_microbatches:
        samples = [_sample(sid, lengths[sid], vocab_size) for sid in mb]
        packed = pack_microbatch(samples, pad_to=None if samples else 1, pad_id=0)
        out.append(
            {
                "tokens": packed.tokens,
                "labels": packed.labels,
                "loss_mask": packed.loss_mask,
                "position_ids": packed.position_ids,
                "attention_mask": packed.attention_mask(),
                "num_tokens": sum(len(s) for s in samples),
            }
        )
    return out


def loss_tokens(
    plan_microbatches: Sequence[Sequence[int]], lengths: dict[int, int], vocab_size: int
) -> int:
    """Loss tokens of planned microbatches, packed as :func:`build_microbatches` packs them."""
    from megatron_odc.data.packing import pack_microbatch

    total = 0
    for mb in plan_microbatches:
        samples = [_sample(sid, lengths[sid], vocab_size) for sid in mb]
        if samples:
            total += int(pack_microbatch(samples, pad_to=None, pad_id=0).loss_mask.sum())
    return total


def global_loss_tokens(plan: Any, world_size: int, vocab_size: int) -> int:
    """Loss tokens of the whole global minibatch of ``plan`` (every rank computes the same number)."""
    lengths = dict(plan.lengths)
    return sum(
        loss_tokens(plan.rank_microbatches(r), lengths, vocab_size) for r in range(world_size)
    )


# ---------------------------------------------------------------------------------------- probes


class Probe:
    """Per-rank instrumentation of one wrapped model: events, activation and unsharded-buffer peaks."""

    def __init__(self, backend: str, model: torch.nn.Module, optimizer: Any) -> None:
        self.backend = backend
        self.model = model
        self.optimizer = optimizer
        self.engine = getattr(model, "engine", None)
        self.events: list[tuple[str, float, float]] = []
        self.unsharded_peak_nbytes = 0
        self.activation_peak_nbytes = 0
        self._saved: dict[int, int] = {}
        self.allreduce_s = 0.0
        if self.engine is not None:
            telemetry = self.engine.telemetry
            plain_timed = telemetry.timed

            @contextlib.contextmanager
            def timed(counter: str):
                start = time.perf_counter()
                with plain_timed(counter):
                    yield
                self.events.append((counter.removesuffix("_s"), start, time.perf_counter()))

            telemetry.timed = timed
            for name in ("fetch", "begin_backward"):
                method = getattr(self.engine, name)
                setattr(self.engine, name, self._sampling(method))
        self._time_optimizer_steps(optimizer)
        config = model.config
        finalize = config.finalize_model_grads_func

        def timed_finalize(*args, **kwargs):
            start = time.perf_counter()
            out = finalize(*args, **kwargs)
            end = time.perf_counter()
            if self.engine is None:
                self.allreduce_s += end - start
                self.events.append(("allreduce", start, end))
            return out

        config.finalize_model_grads_func = timed_finalize

    def _time_optimizer_steps(self, optimizer: Any) -> None:
        """Records every ``optimizer.step`` as an ``optimizer`` event."""
        plain_step = optimizer.step

        def timed_step(*args, **kwargs):
            start = time.perf_counter()
            out = plain_step(*args, **kwargs)
            self.events.append(("optimizer", start, time.perf_counter()))
            return out

        optimizer.step = timed_step

    def _sampling(self, method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            out = method(*args, **kwargs)
            self.unsharded_peak_nbytes = max(
                self.unsharded_peak_nbytes, self.engine.unsharded_nbytes()
            )
            return out

        return wrapper

    def reset(self) -> None:
        """Clears the per-step records."""
        self.events = []
        self.unsharded_peak_nbytes = 0
        self.activation_peak_nbytes = 0
        self.allreduce_s = 0.0

    @contextlib.contextmanager
    def saved_tensors(self):
        """Counts the unique storages autograd saves during one microbatch's forward."""
        self._saved = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = t if t._base is None else t._base
            if not (base.is_leaf and base.requires_grad):  # skip parameters and their views
                storage = t.untyped_storage()
                self._saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.activation_peak_nbytes = max(self.activation_peak_nbytes, sum(self._saved.values()))

    def state_nbytes(self) -> int:
        """Persistent bytes: unique storages of params, grads, engine shards and optimizer state."""
        storages: dict[int, int] = {}

        def add(t: torch.Tensor | None) -> None:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s.nbytes():
                    storages[s.data_ptr()] = s.nbytes()

        total = 0
        if self.engine is not None:
            total += self.engine.persistent_nbytes()
            for mains in getattr(self.optimizer, "_main_shards", []):
                for m in mains:
                    add(m)
        else:
            for p in self.model.parameters():
                add(p.data)
                add(getattr(p, "main_grad", None))
        for opt in _torch_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    add(p.data)
            for state in opt.state.values():
                for value in state.values():
                    add(value)
        return total + sum(storages.values())


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a (chained, wrapped) Megatron optimizer."""
    found: list[torch.optim.Optimizer] = []
    todo, seen = [optimizer], set()
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer):
            found.append(obj)
            continue
        for attr in ("_inner", "optimizer", "chained_optimizers"):
            value = getattr(obj, "__dict__", {}).get(attr)
            if isinstance(value, list):
                todo.extend(value)
            elif value is not None:
                todo.append(value)
    return found


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}


def _make_forward_step(probe: Probe):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        with probe.saved_tensors():
            out = model(
                batch["tokens"],
                batch["position_ids"],
                batch["attention_mask"],
                labels=batch["labels"],
            )
        return out, functools.partial(_loss_func, batch["loss_mask"])

    return forward_step


def _fsdp2_param_groups(model: torch.nn.Module) -> list[Any]:
    """FSDP2's parameter groups of every ``fully_shard`` module in ``model`` (FSDP2 internals)."""
    groups = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is not None:
            groups.extend(get_state()._fsdp_param_groups)
    return groups


def fsdp2_unsharded_nbytes(model: torch.nn.Module) -> int:
    """Bytes of FSDP2's live unsharded parameters (all-gather outputs) and unsharded gradients.

    Unique storages of every FSDP parameter's all-gather outputs, unsharded parameter, its ``.grad`` and
    its fp32 accumulated unsharded gradient; freed buffers (resized to 0) count nothing.
    """
    storages: dict[int, int] = {}
    for group in _fsdp2_param_groups(model):
        for fp in group.fsdp_params:
            tensors = list(getattr(fp, "all_gather_outputs", []))
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                tensors += [unsharded, unsharded.grad]
            tensors.append(getattr(fp, "unsharded_accumulated_grad", None))
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    if storage.nbytes():
                        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class Fsdp2Probe(Probe):
    """:class:`Probe` for an FSDP2 model: collective time, unsharded-buffer peak, optimizer time.

    Wraps each FSDP2 parameter group's ``unshard`` / ``wait_for_unshard`` (event ``fetch_wait``) and
    ``post_backward`` / ``finalize_backward`` (event ``push``, the gradient reduce-scatter when it
    runs), sampling :func:`fsdp2_unsharded_nbytes` before and after each. If FSDP2's internals cannot be
    read the unsharded peak is ``None``.
    """

    def __init__(self, backend: str, model: torch.nn.Module, optimizer: Any) -> None:
        self.backend = backend
        self.model = model
        self.optimizer = optimizer
        self.engine = None
        self._saved = {}
        self.reset()
        self.measurable = True
        try:
            groups = _fsdp2_param_groups(model)
            fsdp2_unsharded_nbytes(model)
        except Exception:  # FSDP2 internals changed: report None rather than a guess
            groups, self.measurable = [], False
        if not groups:
            self.measurable = False
        for group in groups:
            for name, event in (
                ("unshard", "fetch_wait"),
                ("wait_for_unshard", "fetch_wait"),
                ("post_backward", "push"),
                ("finalize_backward", "push"),
            ):
                setattr(group, name, self._timed(getattr(group, name), event))
        self._time_optimizer_steps(optimizer)

    def _timed(self, method, event: str):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            self.sample()
            start = time.perf_counter()
            out = method(*args, **kwargs)
            end = time.perf_counter()
            self.idle_s += end - start
            self.events.append((event, start, end))
            self.sample()
            return out

        return wrapper

    def sample(self) -> None:
        """Records the current unsharded bytes into the peak."""
        if self.measurable:
            self.unsharded_peak_nbytes = max(
                self.unsharded_peak_nbytes, fsdp2_unsharded_nbytes(self.model)
            )

    def reset(self) -> None:
        super().reset()
        self.idle_s = 0.0

    def state_nbytes(self) -> int:
        """Persistent bytes: local shards of parameters and gradients, and the AdamW state."""
        storages: dict[int, int] = {}

        def add(t: Any) -> None:
            if isinstance(t, torch.Tensor):
                if hasattr(t, "to_local"):
                    t = t.to_local()
                s = t.untyped_storage()
                if s.nbytes():
                    storages[s.data_ptr()] = s.nbytes()

        for p in self.model.parameters():
            add(p.data)
            add(p.grad)
        for state in self.optimizer.state.values():
            for value in state.values():
                add(value)
        return sum(storages.values())


def fsdp2_train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    microbatches: Sequence[dict[str, Any]],
    global_tokens: int,
    *,
    reshard_after_forward: bool,
    probe: Probe | None = None,
) -> dict[str, Any]:
    """One FSDP2 training step over this rank's microbatches (gradient accumulation without sync).

    Every microbatch but the last skips the gradient reduce-scatter (``set_requires_gradient_sync``);
    without ``reshard_after_forward`` it also keeps the unsharded parameters after backward
    (``set_reshard_after_backward``), so each unit is all-gathered once per minibatch. The loss of a
    microbatch is its per-token loss sum (:func:`_loss_func`) divided by ``global_tokens``, the loss
    tokens of the whole global minibatch; the gradients are clipped to :data:`OPTIMIZER`'s norm.

    Returns:
        ``loss_sum`` (this rank's token-loss sum) and ``grad_norm`` (before clipping).
    """
    if not microbatches:
        raise ValueError("FSDP2 ranks need at least one microbatch each (use an lb_micro plan)")
    optimizer.zero_grad(set_to_none=True)
    loss_total = 0.0
    for i, mb in enumerate(microbatches):
        last = i == len(microbatches) - 1
        model.set_requires_gradient_sync(last)
        if not reshard_after_forward:
            model.set_reshard_after_backward(last)
        saved = probe.saved_tensors() if probe is not None else contextlib.nullcontext()
        with saved:
            out = model(mb["tokens"], mb["position_ids"], mb["attention_mask"], labels=mb["labels"])
        loss_sum, _, _ = _loss_func(mb["loss_mask"], out)
        (loss_sum / global_tokens).backward()
        loss_total += float(loss_sum.detach())
        if isinstance(probe, Fsdp2Probe):
            probe.sample()
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.grad is not None], OPTIMIZER["clip_grad"]
    )
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    return {"loss_sum": loss_total, "grad_norm": float(grad_norm)}


# ---------------------------------------------------------------------------------------- ranks


def _build_all(
    seq_length: int, dtype: str, backends: Sequence[str] | None = None
) -> dict[str, tuple[torch.nn.Module, Any, Probe]]:
    """Builds each backend's model (same seed), optimizer and probe; all of them by default."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.config import ODCConfig

    if backends is None:
        backends = ("fsdp", "odc", *ODC_VARIANTS, "ddp", *FSDP2_BACKENDS)
    built = {}
    for backend in backends:
        if backend in FSDP2_BACKENDS:
            model, optimizer = build_fsdp2(seq_length, dtype, FSDP2_BACKENDS[backend], seed=1)
            built[backend] = (model, optimizer, Fsdp2Probe(backend, model, optimizer))
            continue
        model = build_model(seed=1, seq_length=seq_length, dtype=dtype)
        opt_config = OptimizerConfig(
            optimizer="adam",
            **OPTIMIZER,
            bf16=dtype == "bf16",
            params_dtype=DTYPES[dtype],
        )
        variant = ODC_VARIANTS.get(backend)
        wrapped, optimizer = build_backend(
            "odc" if variant else backend,
            model,
            opt_config,
            odc_config=ODCConfig(**variant) if variant else None,
        )
        built[backend] = (wrapped, optimizer, Probe(backend, wrapped, optimizer))
    return built


def _one_step(
    built, backend: str, microbatches, seq_length: int, global_tokens: int | None = None
) -> dict[str, Any]:
    """One timed training step of ``backend``; ``global_tokens`` (loss tokens of the global minibatch)
    is needed by the FSDP2 backends only."""
    from megatron_odc.mcore.step import train_step

    wrapped, optimizer, probe = built[backend]
    probe.reset()
    dist.barrier()
    cpu_start = time.thread_time()
    start = time.perf_counter()
    if backend in FSDP2_BACKENDS:
        if global_tokens is None:
            raise ValueError(f"{backend} needs the global minibatch's loss-token count")
        out = fsdp2_train_step(
            wrapped,
            optimizer,
            microbatches,
            global_tokens,
            reshard_after_forward=FSDP2_BACKENDS[backend],
            probe=probe,
        )
    else:
        out = train_step(
            wrapped,
            optimizer,
            _make_forward_step(probe),
            [{k: v for k, v in mb.items() if k != "num_tokens"} for mb in microbatches],
            seq_length=seq_length,
        )
    end = time.perf_counter()
    grad_norm = out.get("grad_norm")
    record = {
        "wall_s": end - start,
        "cpu_s": time.thread_time() - cpu_start,
        "num_microbatches": len(microbatches),
        "num_tokens": sum(mb["num_tokens"] for mb in microbatches),
        "unsharded_peak_nbytes": probe.unsharded_peak_nbytes,
        "activation_peak_nbytes": probe.activation_peak_nbytes,
        "events": [(name, s - start, e - start) for name, s, e in probe.events],
        "grad_norm": None if grad_norm is None else float(grad_norm),
    }
    if isinstance(probe, Fsdp2Probe):
        record["idle_s"] = probe.idle_s
        if not probe.measurable:
            record["unsharded_peak_nbytes"] = None
    elif probe.engine is not None:
        snap = wrapped.telemetry()
        record["idle_s"] = snap["fetch_wait_s"] + snap["push_s"] + snap["fence_s"]
        record["fetch_wait_s"] = snap["fetch_wait_s"]
        record["push_s"] = snap["push_s"]
        record["fence_s"] = snap["fence_s"]
    else:
        record["idle_s"] = probe.allreduce_s
    return record


def _probe_allgather(odc_model: torch.nn.Module, repeats: int = 20) -> dict:
    """Median seconds of a gloo all-gather of one transformer layer's parameters (fp32), both ranks."""
    engine = odc_model.engine
    layer_numel = max(b.padded_numel for b in engine.layout.buckets if b.unit != "root")
    shard = torch.zeros(layer_numel // WORLD_SIZE)
    full = torch.zeros(shard.numel() * WORLD_SIZE)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_into_tensor(full, shard)
        times.append(time.perf_counter() - start)
    return {"layer_numel": layer_numel, "allgather_layer_s": statistics.median(times)}


def _rank_main(rank: int, world_size: int, settings: dict, result_path: str) -> None:
    """One rank: build every backend, run every cell interleaved, rank 0 pickles the results."""
    from megatron.core import parallel_state

    from megatron_odc.integration.cpu import apply_cpu_patches

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("megatron").setLevel(logging.ERROR)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{settings['store_path']}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )
    patches = apply_cpu_patches()
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        scale = settings["length_scale"]
        cap = PAPER_CAP_TOKENS // scale
        built = _build_all(seq_length=cap, dtype=settings["dtype"])
        cost = CostModel(**settings["cost"])
        vocab = MODEL["vocab_size"]
        warm_lengths = {0: cap // 2, 1: cap // 4}
        warm = build_microbatches([[0], [1]], warm_lengths, vocab)
        warm_tokens = world_size * loss_tokens([[0], [1]], warm_lengths, vocab)
        for backend in built:
            _one_step(built, backend, warm, cap, warm_tokens)
        state_nbytes = {b: built[b][2].state_nbytes() for b in built}
        comm_probe = _probe_allgather(built["odc"][0])
        results = []
        for profile in settings["profiles"]:
            pool = scaled_lengths(profile, scale)
            for minibatch in settings["minibatches"]:
                global_batch = world_size * minibatch
                seed = settings["seed"] + 1000 * PROFILES.index(profile) + minibatch
                batches = draw_minibatches(pool, global_batch, settings["repeats"], seed)
                cell = {config_name(*c): [] for c in settings["configs"]}
                for repeat, lengths in enumerate(batches):
                    ids = list(range(repeat * global_batch, (repeat + 1) * global_batch))
                    for backend, kind in settings["configs"]:
                        plan = make_plan(
                            kind,
                            ids,
                            lengths,
                            world_size,
                            cap_tokens=cap,
                            cost_model=cost,
                            too_long="truncate",
                        )
                        mbs = build_microbatches(
                            plan.rank_microbatches(rank), dict(plan.lengths), vocab
                        )
                        tokens = (
                            global_loss_tokens(plan, world_size, vocab)
                            if backend in FSDP2_BACKENDS
                            else None
                        )
                        record = _one_step(built, backend, mbs, cap, tokens)
                        record["plan_bubble_odc"] = plan.bubble_odc()
                        record["plan_bubble_lockstep"] = plan.bubble_lockstep()
                        record["plan_time_odc"] = max(plan.rank_costs())
                        record["plan_time_lockstep"] = plan.lockstep_time()
                        record["lengths"] = lengths
                        record["plan"] = [list(map(list, m)) for m in plan.microbatches]
                        gathered: list[Any] = [None] * world_size
                        dist.all_gather_object(gathered, record)
                        cell[config_name(backend, kind)].append(gathered)
                results.append({"profile": profile, "minibatch": minibatch, "steps": cell})
                if rank == 0:
                    logger.info("cell %s minibatch %d done", profile, minibatch)
        gathered_state: list[Any] = [None] * world_size
        dist.all_gather_object(gathered_state, state_nbytes)
        if rank == 0:
            payload = {"results": results, "state_nbytes": gathered_state, "comm_probe": comm_probe}
            with open(result_path, "wb") as f:
                pickle.dump(payload, f)
        for backend in ("odc", *ODC_VARIANTS, "fsdp"):
            built[backend][0].close()
        parallel_state.destroy_model_parallel()
    finally:
        patches.revert()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run_ranks(settings: dict) -> dict:
    """Spawns :data:`WORLD_SIZE` ranks running :func:`_rank_main`; returns rank 0's payload."""
    tmp = Path(tempfile.mkdtemp(prefix="odc-imbalance-"))
    shm_dir = Path("/dev/shm") / f"odc-imbalance-{os.getpid()}"
    shm_dir.mkdir(parents=True, exist_ok=True)
    env_keys = ("OMP_NUM_THREADS", "MEGATRON_ODC_SHM_DIR", "PYTHONWARNINGS")
    env_before = {k: os.environ.get(k) for k in env_keys}
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MEGATRON_ODC_SHM_DIR"] = str(shm_dir)
    os.environ["PYTHONWARNINGS"] = "ignore"
    settings = {**settings, "store_path": str(tmp / "store")}
    result_path = str(tmp / "result.pkl")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(r, WORLD_SIZE, settings, result_path))
        for r in range(WORLD_SIZE)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise RuntimeError(
                f"benchmark ranks {failed} failed (exit codes "
                f"{[procs[r].exitcode for r in failed]})"
            )
        with open(result_path, "rb") as f:
            return pickle.load(f)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------- report


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
    waiting of [Note: what is measured]). A step with no communication and the work split perfectly
    evenly would take that mean, so a ratio to ``peer`` above this bound needs faster compute."""
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


# ---------------------------------------------------------------------------------------- calibration


def calibrate(lengths: Sequence[int], dtype: str, repeats: int = 5) -> dict:
    """Times fwd+bwd of one sample per length on one core; least-squares fit of a*s^2 + b*s (seconds)."""
    settings = {"lengths": list(lengths), "repeats": repeats, "dtype": dtype}
    tmp = Path(tempfile.mkdtemp(prefix="odc-calib-"))
    try:
        ctx = mp.get_context("spawn")
        os.environ["OMP_NUM_THREADS"] = "1"
        proc = ctx.Process(target=_calibrate_main, args=(settings, str(tmp)))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"calibration process failed with exit code {proc.exitcode}")
        with open(tmp / "calib.pkl", "rb") as f:
            times = pickle.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    s = torch.tensor(lengths, dtype=torch.float64)
    t = torch.tensor(times, dtype=torch.float64)
    design = torch.stack([s * s, s, torch.ones_like(s)], dim=1)
    coef = torch.linalg.lstsq(design, t.unsqueeze(1)).solution.flatten()
    a, b, c = float(coef[0]), float(coef[1]), float(coef[2])
    longest = max(lengths)
    return {
        "a": a,
        "b": b,
        "c_per_microbatch_s": c,
        "lengths": list(lengths),
        "times_s": times,
        "attention_share_at_longest": a * longest / (a * longest + b),
    }


def _calibrate_main(settings: dict, out_dir: str) -> None:
    from megatron.core import parallel_state

    from megatron_odc.integration.cpu import apply_cpu_patches

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=0, world_size=1)
    patches = apply_cpu_patches()
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        model = build_model(seed=1, seq_length=max(settings["lengths"]), dtype=settings["dtype"])
        times = []
        for length in settings["lengths"]:
            (mb,) = build_microbatches([[0]], {0: length}, MODEL["vocab_size"])
            samples = []
            for _ in range(settings["repeats"] + 1):
                start = time.perf_counter()
                out = model(
                    mb["tokens"], mb["position_ids"], mb["attention_mask"], labels=mb["labels"]
                )
                (out.float() * mb["loss_mask"]).sum().backward()
                samples.append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
            times.append(min(samples[1:]))  # least disturbed by other load
        with open(Path(out_dir) / "calib.pkl", "wb") as f:
            pickle.dump(times, f)
        parallel_state.destroy_model_parallel()
    finally:
        patches.revert()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- host


SLOW_MATMUL_RATIO = 3.0
"""A ``--dtype`` matmul this many times slower than fp32's is emulated by the host: the benchmark warns."""


def matmul_slowdown(dtype: str, repeats: int = 5) -> float:
    """Time of one benchmark-sized GEMM (tokens x hidden x FFN) in ``dtype`` over fp32's, one thread.

    oneDNN runs bf16 GEMMs natively only with AVX-512 BF16 / AMX; on an AVX2 host it converts and
    is measured 36x slower than fp32 (2026-12-05), so compute dominates every configuration and the
    ratios between them shrink towards 1: such runs are not comparable with runs on other hosts.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {}
        for name in {"fp32", dtype}:
            a = torch.randn(1024, MODEL["hidden_size"], dtype=DTYPES[name])
            b = torch.randn(MODEL["hidden_size"], MODEL["ffn_hidden_size"], dtype=DTYPES[name])
            a @ b
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                samples.append(time.perf_counter() - start)
            times[name] = min(samples)
        return times[dtype] / times["fp32"]
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """Returns the command-line parser."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag in ("profiles", "minibatches"):
        parser.add_argument(f"--{flag}", help=f"default {FULL[flag]} ({QUICK[flag]} with --quick)")
    parser.add_argument(
        "--configs", default=",".join(config_name(*c) for c in CONFIGS), help="backend+plan list"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--length-scale", type=int, default=DEFAULT_LENGTH_SCALE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="longalign, minibatch 4 where --profiles / --minibatches are not given (a few minutes)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per configuration")
    parser.add_argument("--out", help="write the summary rows and raw steps to this JSON file")
    parser.add_argument("--timeline", help="write per-rank events of one step to this JSON file")
    parser.add_argument(
        "--calibrate", action="store_true", help="fit the CPU cost model (a, b in seconds) and exit"
    )
    return parser


def _parse_configs(text: str) -> list[tuple[str, str]]:
    configs = []
    for item in text.split(","):
        backend, _, plan = item.partition("+")
        if (backend, plan) not in CONFIGS:
            raise ValueError(
                f"--configs entry {item!r} is not one of {[config_name(*c) for c in CONFIGS]}"
            )
        configs.append((backend, plan))
    return configs


def settings_from_args(args: argparse.Namespace) -> dict:
    """The run's settings from the parsed flags (``--quick``'s defaults where a flag is not given).

    Raises:
        ValueError: a ``--profiles``, ``--minibatches`` or ``--configs`` entry or ``--repeats`` is not valid.
    """
    defaults = QUICK if args.quick else FULL
    profiles = (args.profiles or defaults["profiles"]).split(",")
    for p in profiles:
        if p not in PROFILES:
            raise ValueError(f"--profiles entry {p!r} is not one of {PROFILES}")
    minibatches = []
    for m in (args.minibatches or defaults["minibatches"]).split(","):
        if not m.strip().isdigit() or int(m) < 1:
            raise ValueError(f"--minibatches entry {m!r} is not an integer >= 1")
        minibatches.append(int(m))
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats} must be >= 1")
    return {
        "profiles": profiles,
        "minibatches": minibatches,
        "configs": _parse_configs(args.configs),
        "repeats": args.repeats,
        "length_scale": args.length_scale,
        "seed": args.seed,
        "dtype": args.dtype,
        "cost": CPU_COST,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.calibrate:
        cap = PAPER_CAP_TOKENS // args.length_scale
        fit = calibrate([cap // 16, cap // 8, cap // 4, cap // 2, 3 * cap // 4, cap], args.dtype)
        sys.stdout.write(json.dumps(fit) + "\n")
        return 0
    try:
        settings = settings_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    slowdown = matmul_slowdown(args.dtype)
    if slowdown > SLOW_MATMUL_RATIO:
        logger.warning(
            "a %s matmul is %.0fx slower than fp32 on this host (%s): compute dominates and the "
            "ratios are not comparable with other hosts; use --dtype fp32 or a host with AVX-512 BF16",
            args.dtype,
            slowdown,
            torch.backends.cpu.get_cpu_capability(),
        )
    start = time.perf_counter()
    payload = run_ranks(settings)
    elapsed = time.perf_counter() - start
    rows = summarize(payload)
    if args.json:
        for row in rows:
            sys.stdout.write(json.dumps({k: v for k, v in row.items() if k != "step_s"}) + "\n")
    else:
        sys.stdout.write(format_rows(rows))
    for row in rows:
        if args.quick and row["config"] == "odc+lb_mini" and "speedup_vs_baseline_median" in row:
            cell = next(
                c
                for c in payload["results"]
                if c["profile"] == row["profile"] and c["minibatch"] == row["minibatch_per_rank"]
            )
            line = {
                "ratio_odc_lb_mini_vs_fsdp_lb_micro": row["speedup_vs_baseline_median"],
                "ratio_odc_lb_mini_vs_fsdp2_lb_micro": paired_ratio(
                    cell["steps"], "fsdp2+lb_micro", "odc+lb_mini"
                ),
                "bound_odc_lb_mini_vs_fsdp2_lb_micro": paired_bound(
                    cell["steps"], "fsdp2+lb_micro", "odc+lb_mini"
                ),
                "profile": row["profile"],
                "minibatch_per_rank": row["minibatch_per_rank"],
                "elapsed_s": elapsed,
            }
            sys.stdout.write((json.dumps(line) if args.json else str(line)) + "\n")
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": elapsed,
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "matmul_slowdown_vs_fp32": slowdown,
        "settings": settings,
        "model": MODEL,
        "torch": torch.__version__,
    }
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "meta": meta,
                    "rows": rows,
                    "results": payload["results"],
                    "comm_probe": payload["comm_probe"],
                }
            )
        )
    if args.timeline:
        names = [
            n
            for n in ("fsdp+lb_micro", "odc+lb_micro", "odc+lb_mini")
            if n in payload["results"][0]["steps"]
        ]
        Path(args.timeline).write_text(json.dumps(timeline_records(payload, names)))
    logger.info("benchmark took %.1f s", elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
