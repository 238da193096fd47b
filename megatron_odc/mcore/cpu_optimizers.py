"""megatron-core's own optimizers over CPU tensors: the CUDA type names they check for.

megatron-core's ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` / ``DistributedOptimizer``
check ``param.type() == 'torch.cuda.FloatTensor'`` (and Half / BFloat16) at construction, and
``clip_grads.clip_grad_by_total_norm_fp32`` asserts it on every step. The ``ddp`` / ``distopt`` backends
and their checkpoints call them inside :func:`cuda_type_names` when the parameters are on CPU
(:func:`megatron_optimizer_scope`); nothing changes for parameters on a GPU.

Without TransformerEngine or Apex megatron-core builds its optimizers over torch's own Adam, and its
``DistributedOptimizer`` checkpoint load breaks there (issue 19): :func:`init_unfused_distopt_state`
and :func:`load_megatron_optimizer_state` work around it for ``dist_ckpt/state.py``, calling
megatron-core's own code (nothing in megatron-core is edited or patched).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

_MISSING = object()


def on_cpu(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters live on the CPU."""
    first = next(model.parameters(), None)
    return first is not None and first.device.type == "cpu"


def init_unfused_distopt_state(optimizer: Any) -> None:
    """Give a fresh megatron ``DistributedOptimizer`` over torch's own Adam a zero state (step 0).

    Without TransformerEngine or Apex (the CPU path: megatron-core falls back to ``torch.optim.Adam``),
    ``DistributedOptimizer.state_dict`` reads the step from every parameter's state and asserts that
    there is exactly one value (``assert len(steps) == 1``, ``distrib_optimizer.py``); its
    ``sharded_state_dict(is_loading=True)`` calls it first, so loading a checkpoint into an optimizer
    that has not stepped yet fails. With TE's / Apex's fused Adam the step lives in the param groups and
    an empty state passes (``len(steps) <= 1``). This creates the state torch's Adam would have before
    its first step (zero moments, ``step`` 0); the load then overwrites every value. Other optimizers,
    ones that already hold state and the fused path are left alone. Call it before
    ``sharded_state_dict(..., is_loading=True)`` (``dist_ckpt/state.py``).
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, distrib_optimizer.DistributedOptimizer) or not isinstance(
            inner, (torch.optim.Adam, torch.optim.AdamW)
        ):
            continue
        if len(inner.state) > 0:
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }


def load_megatron_optimizer_state(optimizer: Any, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state_dict)``, with distopt's fully-reshardable load made to work
    over torch's own Adam (the CPU path).

    Without TE / Apex, ``DistributedOptimizer.load_state_dict`` first gives every parameter's state a
    ``step`` (one tensor object shared by all of them), then
    ``load_parameter_state_from_fully_reshardable`` copies the loaded tensors over every key of that
    state, ``step`` included, while the loaded tensors never hold one: ``KeyError: 'step'``
    (``_set_main_param_and_optimizer_states``). Here the groups, step and grad scaler are loaded first
    without ``param_state``, the steps are set aside while megatron-core's own
    ``load_parameter_state_from_fully_reshardable`` reads the tensors, and each parameter gets its own
    copy of the step back (torch's single-tensor Adam adds 1 to ``step`` in place per parameter, so a
    shared tensor would count every parameter's update). Any other optimizer or format goes straight
    to ``load_state_dict``.
    """
    chained = getattr(optimizer, "chained_optimizers", None)
    target = chained[0] if chained is not None and len(chained) == 1 else optimizer
    if _is_unfused_distopt_full_load(target, state_dict):
        _load_unfused_distopt(target, state_dict, type(target).load_state_dict)
    else:
        optimizer.load_state_dict(state_dict)


def _is_unfused_distopt_full_load(optimizer: Any, state_dict: dict[str, Any]) -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return (
        not distrib_optimizer.HAVE_APEX_OR_TE
        and isinstance(optimizer, distrib_optimizer.DistributedOptimizer)
        and state_dict.get("param_state_sharding_type") == "fully_reshardable"
        and "param_state" in state_dict
    )


def _load_unfused_distopt(
    optimizer: Any, state_dict: dict[str, Any], load_state_dict: Callable[[Any, dict], None]
) -> None:
    """:func:`load_megatron_optimizer_state` for one ``DistributedOptimizer``; ``load_state_dict`` is
    megatron-core's ``DistributedOptimizer.load_state_dict`` (unbound)."""
    load_state_dict(optimizer, {k: v for k, v in state_dict.items() if k != "param_state"})
    inner_state = optimizer.optimizer.state
    steps = {param: state.pop("step") for param, state in inner_state.items() if "step" in state}
    try:
        optimizer.load_parameter_state_from_fully_reshardable(state_dict["param_state"])
    finally:
        for param, step in steps.items():
            inner_state[param]["step"] = step.clone()


def unfused_distopt_patches() -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, replacement)`` that apply :func:`init_unfused_distopt_state` and
    :func:`load_megatron_optimizer_state` inside megatron-core's ``DistributedOptimizer`` methods.

    For Megatron-LM's ``load_checkpoint``, which calls the optimizer's ``sharded_state_dict(...,
    is_loading=True)`` and ``load_state_dict`` itself (``integration/megatron_lm/patching.py`` applies
    them on CPU and reverts them). Empty with TE / Apex, where megatron-core's own code works.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    cls = distrib_optimizer.DistributedOptimizer
    original_sharded_state_dict = cls.sharded_state_dict
    original_load_state_dict = cls.load_state_dict

    def sharded_state_dict(self, *args, **kwargs):
        bound = inspect.signature(original_sharded_state_dict).bind(self, *args, **kwargs)
        if bound.arguments.get("is_loading", False):
            init_unfused_distopt_state(self)
        return original_sharded_state_dict(self, *args, **kwargs)

    def load_state_dict(self, state_dict):
        if _is_unfused_distopt_full_load(self, state_dict):
            _load_unfused_distopt(self, state_dict, original_load_state_dict)
        else:
            original_load_state_dict(self, state_dict)

    return [
        (cls, "sharded_state_dict", sharded_state_dict),
        (cls, "load_state_dict", load_state_dict),
    ]


def megatron_optimizer_scope(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """:func:`cuda_type_names` for a model on CPU, else nothing."""
    return cuda_type_names() if on_cpu(model) else contextlib.nullcontext()


class CudaTypeNamesOptimizer:
    """A megatron-core optimizer whose ``step`` runs inside :func:`cuda_type_names` (CPU parameters)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The inner optimizer's step, with CUDA type names."""
        with cuda_type_names():
            return self._inner.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """Within the block, ``Tensor.type()`` with no arguments reports ``torch.cuda.*`` names for CPU tensors.

    megatron's optimizers check ``param.type() == 'torch.cuda.FloatTensor'`` (and Half / BFloat16) at
    construction and ``clip_grad_by_total_norm_fp32`` asserts it on grads at each step: wrap
    ``get_megatron_optimizer(...)`` and ``optimizer.step()``. ``Tensor.type(dtype)`` conversions are
    unchanged. Nestable; the previous ``Tensor.type`` is restored on exit.
    """
    before = torch.Tensor.__dict__.get("type", _MISSING)
    original_type = torch.Tensor.type

    def type_with_cuda_names(self, *args, **kwargs):
        if not args and not kwargs:
            name = original_type(self)
            if self.device.type == "cpu" and name.startswith("torch.") and "cuda" not in name:
                return "torch.cuda." + name[len("torch.") :]
            return name
        return original_type(self, *args, **kwargs)

    torch.Tensor.type = type_with_cuda_names
    try:
        yield
    finally:
        if before is _MISSING:
            del torch.Tensor.type
        else:
            torch.Tensor.type = before
