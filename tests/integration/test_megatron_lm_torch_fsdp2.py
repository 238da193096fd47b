"""The gradient scaling the launcher gives megatron-core's torch FSDP2 chunks (``torch_fsdp2.py``), on
the real ``TorchFullyShardedDataParallel`` over 2 gloo ranks, without a Megatron-LM tree: under
per-token loss ``finalize_model_grads`` calls ``scale_gradients(1 / global tokens)``, which must leave
what megatron-core's DDP leaves (the token-loss gradients summed over the ranks, divided by the global
token count); the wrapper's own no-op leaves FSDP2's average instead."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks


def _per_token_gradient_error(rank: int, world_size: int, scaled: bool) -> float:
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import torch_fully_sharded_data_parallel as fsdp2
    from megatron.core.transformer import TransformerConfig

    from megatron_odc.integration.megatron_lm.cpu_shims import _CpuDeviceMesh
    from megatron_odc.integration.megatron_lm.torch_fsdp2 import scale_torch_fsdp2_gradients

    fsdp2.DeviceMesh = _CpuDeviceMesh  # the launcher's CPU shim (this process only)
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 2)
    inputs = [torch.full((r + 2, 4), r + 1.0) for r in range(world_size)]  # uneven token counts
    tokens = sum(x.shape[0] for x in inputs)
    grads = [torch.autograd.grad(layer(x).sum(), layer.weight)[0] for x in inputs]
    expected = sum(grads) / tokens  # megatron-core DDP: summed over DP, then / global tokens
    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    chunk = fsdp2.TorchFullyShardedDataParallel(
        config, DistributedDataParallelConfig(), layer, process_group=dist.group.WORLD
    )
    if scaled:
        assert scale_torch_fsdp2_gradients([chunk, torch.nn.Linear(1, 1)]) == 1
    chunk(inputs[rank]).sum().backward()
    chunk.finish_grad_sync()
    chunk.scale_gradients(torch.tensor(1.0 / tokens))  # what finalize_model_grads passes
    return (layer.weight.grad.full_tensor() - expected).abs().max().item()


@pytest.mark.timeout(120)
def test_scaled_fsdp2_chunks_divide_per_token_gradients_as_ddp_does() -> None:
    assert all(error < 1e-6 for error in run_ranks(_per_token_gradient_error, 2, True))


@pytest.mark.timeout(120)
def test_without_the_scaling_fsdp2_leaves_per_token_gradients_undivided() -> None:
    errors = run_ranks(_per_token_gradient_error, 2, False)
    assert all(error > 1e-2 for error in errors), errors
