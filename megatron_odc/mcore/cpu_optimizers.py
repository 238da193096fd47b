"""megatron-core's own optimizers over CPU tensors: the CUDA type names they check for.

megatron-core's ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` / ``DistributedOptimizer``
check ``param.type() == 'torch.cuda.FloatTensor'`` (and Half / BFloat16) at construction, and
``clip_grads.clip_grad_by_total_norm_fp32`` asserts it on every step. The ``ddp`` / ``distopt`` backends
and their checkpoints call them inside :func:`cuda_type_names` when the parameters are on CPU
(:func:`megatron_optimizer_scope`); nothing changes for parameters on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_MISSING = object()


def on_cpu(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters live on the CPU."""
    first = next(model.parameters(), None)
    return first is not None and first.device.type == "cpu"


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
