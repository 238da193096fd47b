"""megatron-core's own optimizers see CUDA type names exactly when the model's parameters are on CPU."""

from __future__ import annotations

import torch

from megatron_odc.mcore.cpu_optimizers import CudaTypeNamesOptimizer, megatron_optimizer_scope


def test_scope_follows_the_parameters_device() -> None:
    cpu_model = torch.nn.Linear(2, 2)
    with megatron_optimizer_scope(cpu_model):
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"
    meta_model = torch.nn.Linear(2, 2, device="meta")
    with megatron_optimizer_scope(meta_model):
        assert torch.zeros(1).type() == "torch.FloatTensor"


def test_wrapped_step_sees_cuda_names_and_the_rest_passes_through() -> None:
    class Inner:
        lr = 0.5

        def step(self) -> str:
            return torch.zeros(1, dtype=torch.bfloat16).type()

    wrapped = CudaTypeNamesOptimizer(Inner())
    assert wrapped.step() == "torch.cuda.BFloat16Tensor"
    assert wrapped.lr == 0.5
    assert torch.zeros(1).type() == "torch.FloatTensor"
