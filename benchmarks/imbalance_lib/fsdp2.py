"""The PyTorch FSDP2 peers: the GPT under ``fully_shard``, its probe and its training step."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.imbalance_lib.model import build_model
from benchmarks.imbalance_lib.probes import Probe
from benchmarks.imbalance_lib.settings import DTYPES, OPTIMIZER
from benchmarks.imbalance_lib.workload import loss_func


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
    microbatch is its per-token loss sum (:func:`loss_func`) divided by ``global_tokens``, the loss
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
        loss_sum, _, _ = loss_func(mb["loss_mask"], out)
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
