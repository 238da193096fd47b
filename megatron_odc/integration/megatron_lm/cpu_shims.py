"""The Megatron-LM-only CPU shims (beyond megatron-core's CPU runtime in ``integration/cpu.py``).

Megatron-LM's training loop asks CUDA for devices, streams, capabilities and fused-kernel setup that
megatron-core itself does not, and reaches parts of megatron-core that only its flags use (the NCCL
options of its process groups, the device mesh of ``--use-torch-fsdp2``): :func:`cpu_shims` lists the
attributes to replace with CPU stand-ins, which
:func:`~megatron_odc.integration.megatron_lm.patching.apply_megatron_lm_patches` applies with
``cpu=True`` (``torch.cuda.is_available`` -> True, ``device_count`` -> 1, streams and ``set_device``
no-ops, fused-kernel loading and JIT fusion setup skipped, no NCCL options on gloo, a CPU mesh for
megatron-core's torch FSDP2 wrapper).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import torch_fully_sharded_data_parallel

logger = logging.getLogger(__name__)


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU: every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _CpuStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@dataclasses.dataclass
class _CpuDeviceProperties:
    name: str = "cpu"
    major: int = 9
    minor: int = 0
    total_memory: int = 0
    multi_processor_count: int = 1


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class _CpuDeviceMesh:
    """``DeviceMesh`` for megatron-core's torch FSDP2 wrapper, which builds its mesh as
    ``DeviceMesh.from_group(group, "cuda")``: on CPU the mesh is a CPU one (gloo)."""

    @staticmethod
    def from_group(group: Any, device_type: str, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(group, "cpu", *args, **kwargs)


def _shim_values() -> dict[str, Any]:
    return {
        "cuda.is_available": lambda: True,
        "cuda.device_count": lambda: 1,
        "cuda.set_device": _noop,
        "cuda.get_device_properties": lambda *a, **k: _CpuDeviceProperties(),
        "cuda.get_device_capability": lambda *a, **k: (9, 0),
        "cuda.Stream": _CpuStream,
        "cuda.stream": lambda *a, **k: _CpuStream(),
        "cuda.current_stream": lambda *a, **k: _CpuStream(),
        # torch's CUDA build (the 3.12 pairs): with device_count() == 1, torch.accelerator would
        # report CUDA and the optimizers' graph-capture check would ask the driver for a stream.
        "accelerator.is_available": lambda: False,
        "initialize.set_jit_fusion_options": _noop,
        "training.set_jit_fusion_options": _noop,
        "initialize._compile_dependencies": _noop,
        # gloo takes no NCCL options; Megatron-LM asks for them for its high-priority-stream
        # groups (with --use-torch-fsdp2 always: 'dp_cp').
        "parallel_state.get_nccl_options": _noop,
        "torch_fully_sharded_data_parallel.DeviceMesh": _CpuDeviceMesh,
    }


CPU_SHIMS: tuple[str, ...] = tuple(_shim_values())
"""Every Megatron-LM CPU shim by name, ``"owner.attribute"`` (``cuda`` is ``torch.cuda``,
``accelerator`` ``torch.accelerator``; ``initialize`` / ``training`` are ``megatron.training``'s modules,
``parallel_state`` / ``torch_fully_sharded_data_parallel`` megatron-core's); a release row lists the
ones its tag needs (``releases.py``)."""


def cpu_shims(initialize: Any, training: Any, names: tuple[str, ...] = CPU_SHIMS) -> list:
    """``(owner, attribute, replacement)`` of each named shim whose target exists.

    A target the installed Megatron-LM lacks (only possible with ``MEGATRON_ODC_SKIP_VERSION_CHECK=1``:
    the version check compares the row with the tree) is skipped with a warning.
    """
    owners = {
        "cuda": torch.cuda,
        "accelerator": getattr(torch, "accelerator", None),
        "initialize": initialize,
        "training": training,
        "parallel_state": parallel_state,
        "torch_fully_sharded_data_parallel": torch_fully_sharded_data_parallel,
    }
    values = _shim_values()
    shims = []
    for name in names:
        owner_name, attr = name.split(".", 1)
        owner = owners[owner_name]
        if not hasattr(owner, attr):
            logger.warning("CPU shim %s skipped: the installed Megatron-LM has no %s", name, attr)
            continue
        shims.append((owner, attr, values[name]))
    return shims
