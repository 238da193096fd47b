"""The Megatron-LM CPU shims that reach megatron-core (``cpu_shims.py``), without a Megatron-LM tree:
what ``--use-torch-fsdp2`` needs on gloo ranks (no NCCL options; megatron-core's wrapper builds its
device mesh as ``DeviceMesh.from_group(group, "cuda")``)."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks


def test_every_named_shim_reaches_megatron_core_and_torch() -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import torch_fully_sharded_data_parallel

    from megatron_odc.integration.megatron_lm.cpu_shims import CPU_SHIMS, cpu_shims

    shims = {f"{owner.__name__}.{attr}": value for owner, attr, value in cpu_shims(None, None)}
    named = [n for n in CPU_SHIMS if not n.startswith(("initialize.", "training."))]
    assert len(shims) == len(named)  # nothing skipped for a missing target
    assert shims[f"{parallel_state.__name__}.get_nccl_options"]("dp_cp", {"dp_cp": {}}) is None
    assert f"{torch_fully_sharded_data_parallel.__name__}.DeviceMesh" in shims


def _fully_shard_on_the_mesh(rank: int, world_size: int, shimmed: bool) -> tuple[str, list]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from megatron_odc.integration.megatron_lm.cpu_shims import _CpuDeviceMesh

    mesh_type = _CpuDeviceMesh if shimmed else DeviceMesh
    mesh = mesh_type.from_group(dist.group.WORLD, "cuda")  # megatron-core's call
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 2)
    inputs = [torch.full((3, 4), r + 1.0) for r in range(world_size)]  # each rank's own batch
    expected = sum(torch.autograd.grad(layer(x).sum(), layer.weight)[0] for x in inputs)
    fully_shard(layer, mesh=mesh)
    layer(inputs[rank]).sum().backward()
    full = layer.weight.grad.full_tensor() * world_size  # FSDP2 averages over the ranks
    return mesh.device_type, (full - expected).abs().max().item()


@pytest.mark.timeout(120)
def test_the_mesh_shim_lets_fsdp2_shard_on_gloo_ranks() -> None:
    results = run_ranks(_fully_shard_on_the_mesh, 2, True)
    assert [device for device, _ in results] == ["cpu", "cpu"]
    assert all(diff < 1e-6 for _, diff in results), results


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA only: a CUDA mesh works there")
def test_without_the_mesh_shim_fsdp2_fails_on_cpu() -> None:
    from tests._dist import RankFailureError

    # torch's CPU build: "Torch not compiled with CUDA enabled"; its CUDA build on a CPU machine
    # (Python 3.12): "Cannot re-initialize CUDA in forked subprocess"; under Megatron-LM's CPU shims
    # (current_device() answering a string): torch.device's "must be int, not str".
    with pytest.raises(RankFailureError, match=r"CUDA|must be int, not str"):
        run_ranks(_fully_shard_on_the_mesh, 2, False)
