"""Per-rank instrumentation of the megatron-core and ODC backends: events, busy/idle, memory."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import torch

from benchmarks.imbalance_lib.workload import loss_func


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


def make_forward_step(probe: Probe):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        with probe.saved_tensors():
            out = model(
                batch["tokens"],
                batch["position_ids"],
                batch["attention_mask"],
                labels=batch["labels"],
            )
        return out, functools.partial(loss_func, batch["loss_mask"])

    return forward_step
