"""Module and autograd hooks that drive the ODC engine through forward and backward.

``ODCHooks`` registers, and owns the handles of:

- a forward pre-hook on the root module: fetch the root unit (parameters outside every unit module, such
  as embeddings, the final norm and the output layer, which a tied embedding uses at both ends) and count
  the microbatch and its tokens;
- a forward post-hook on the root: arm the root pre-backward hook on the outputs, which fetches the root
  unit again (see [Note: hooks under 1F1B]) and queues the end of backward callback (push leftovers,
  release all); without grad, release everything at once;
- per unit module (e.g. each transformer layer): a forward pre-hook (fetch, then start the prefetch of the
  next unit, which overlaps this unit's compute on a GPU), a forward post-hook (release, and arm a
  pre-backward hook on the outputs that fetches again and starts the prefetch of the previous unit);
- per parameter: a post-accumulate-grad hook that hands the gradient to the engine, which pushes the unit
  once all of its gradients are in and then releases it.

Forwards that run inside backward (activation recompute) keep their unit unsharded until it is pushed.
No megatron import.

[Note: hooks under 1F1B]
Megatron's 1F1B pipeline schedule runs stage ``s`` of ``p`` up to ``p - s - 1`` forwards ahead of their
backwards (``F0 F1 B0 F2 B1 ...``). Nothing here or in the bucket states is per microbatch, so that order
is legal: each forward fetches and releases its units; each backward fetches them again, pushes its
gradients into the owners' accumulators (sums, so the order does not matter) and ends with every unit
released. The root unit is fetched at the root's forward and again at its pre-backward, because the
backward of an earlier microbatch released it in between (``F1 B0 B1`` on stage 0). The tensors autograd
saved in a forward are views into the units' flat storage, which a refetch refills with the same values
(the shards change only at the optimizer step), so a backward reads the parameters its forward read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from megatron_odc.core.engine import ODCEngine

logger = logging.getLogger(__name__)


def _tensors_requiring_grad(output: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _count_tokens(args: tuple, kwargs: dict) -> int:
    tokens = kwargs.get("input_ids")
    if tokens is None and args and isinstance(args[0], torch.Tensor):
        tokens = args[0]
    return int(tokens.numel()) if isinstance(tokens, torch.Tensor) else 0


class ODCHooks:
    """Registers the hooks that fetch, release and push around forward and backward.

    Args:
        engine: the bucket runtime.
        root: the module whose forward is one microbatch's forward.
        unit_modules: ``(unit, module)`` in forward order; their parameters belong to that unit.
        root_unit: the unit of every other parameter, or ``None`` if there is none.
        prefetch: fetch the next unit (forward) or the previous one (backward) one step early.
    """

    def __init__(
        self,
        engine: ODCEngine,
        root: torch.nn.Module,
        unit_modules: Sequence[tuple[str, torch.nn.Module]],
        root_unit: str | None,
        *,
        prefetch: bool = True,
    ) -> None:
        self.engine = engine
        self.root_unit = root_unit
        self.prefetch = prefetch
        self._order = [unit for unit, _ in unit_modules]
        self._index = {unit: i for i, unit in enumerate(self._order)}
        self._in_backward = False
        self._handles: list[Any] = []
        self._handles.append(
            root.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True)
        )
        self._handles.append(root.register_forward_hook(self._root_post_forward))
        for unit, module in unit_modules:
            self._handles.append(
                module.register_forward_pre_hook(self._make_unit_pre_forward(unit))
            )
            self._handles.append(module.register_forward_hook(self._make_unit_post_forward(unit)))
        for name, param in engine.parameters():
            if param.requires_grad:
                self._handles.append(
                    param.register_post_accumulate_grad_hook(self._make_grad_hook(name))
                )

    # ------------------------------------------------------------------ root

    def _root_pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled() and not self._in_backward:
            self.engine.telemetry.num_microbatches += 1
            self.engine.telemetry.num_tokens += _count_tokens(args, kwargs)
        if self.root_unit is not None:
            self.engine.fetch(self.root_unit)

    def _root_post_forward(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        tensors = _tensors_requiring_grad(output) if torch.is_grad_enabled() else []
        if not tensors:
            if not self._in_backward:
                self.engine.release_all()
            return
        torch.autograd.graph.register_multi_grad_hook(tensors, self._root_pre_backward, mode="any")

    def _root_pre_backward(self, grad: torch.Tensor) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)
        if self.root_unit is not None:
            self.engine.fetch(self.root_unit)  # [Note: hooks under 1F1B]
        if self.prefetch and self._order:
            self.engine.start_fetch(self._order[-1])

    def _post_backward(self) -> None:
        self._in_backward = False
        self.engine.finish_backward()

    # ------------------------------------------------------------------ units

    def _make_unit_pre_forward(self, unit: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            self.engine.fetch(unit)
            nxt = self._index[unit] + 1
            if (
                self.prefetch
                and not self._in_backward
                and torch.is_grad_enabled()
                and nxt < len(self._order)
            ):
                self.engine.start_fetch(self._order[nxt])

        return hook

    def _make_unit_post_forward(self, unit: str):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            tensors = _tensors_requiring_grad(output) if torch.is_grad_enabled() else []
            if not self._in_backward:
                self.engine.release(unit)
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, self._make_unit_pre_backward(unit), mode="any"
                )

        return hook

    def _make_unit_pre_backward(self, unit: str):
        def hook(grad: torch.Tensor) -> None:
            self.engine.fetch(unit)
            self.engine.begin_backward(unit)
            prev = self._index[unit] - 1
            if self.prefetch and prev >= 0:
                self.engine.start_fetch(self._order[prev])

        return hook

    # ------------------------------------------------------------------ parameters

    def _make_grad_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            pushed_unit = self.engine.grad_ready(param, name)
            if pushed_unit is not None:
                # Every gradient of the unit is in, so autograd no longer needs its parameters.
                self.engine.release(pushed_unit)

        return hook

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
