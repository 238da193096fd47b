"""Runtime patches of third-party code, applied explicitly and never on import.

``cpu``: lets megatron-core 0.16.x run on CPU under gloo (tests, CI); see its module docstring.
"""

from megatron_odc.integration.cpu import (
    CpuPatches,
    DeviceRemapMode,
    active_cpu_patches,
    apply_cpu_patches,
    cuda_type_names,
)

__all__ = [
    "CpuPatches",
    "DeviceRemapMode",
    "active_cpu_patches",
    "apply_cpu_patches",
    "cuda_type_names",
]
