"""The transport registry: the one list of transports, auto resolution, and lazy backends."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from megatron_odc.transport import (
    TRANSPORT_CHOICES,
    TRANSPORTS,
    resolve_transport_name,
    transport_class,
)
from megatron_odc.transport.cuda import SymmMemFeatures


def test_choices_are_the_registry_plus_auto() -> None:
    assert ("auto", *TRANSPORTS) == TRANSPORT_CHOICES
    assert set(TRANSPORTS) == {"shm", "collective", "cuda", "mpi", "nvshmem"}
    for name in TRANSPORTS:
        assert transport_class(name).__module__ == f"megatron_odc.transport.{name}"
    with pytest.raises(ValueError, match="unknown transport 'auto'"):
        transport_class("auto")  # auto is resolved first, never built


def test_auto_follows_the_device() -> None:
    assert resolve_transport_name("auto", torch.device("cuda", 1)) == "cuda"
    assert resolve_transport_name("auto", torch.device("cpu")) == "shm"
    assert resolve_transport_name("collective", torch.device("cuda")) == "collective"


def test_auto_crosses_hosts_over_mpi_for_cpu_ranks_and_nvshmem_for_gpus(monkeypatch) -> None:
    import megatron_odc.transport.nvshmem as nvshmem

    assert resolve_transport_name("auto", torch.device("cpu"), spans_hosts=True) == "mpi"
    assert resolve_transport_name("shm", torch.device("cpu"), spans_hosts=True) == "shm"
    # GPUs across hosts: nvshmem where this PyTorch has it (the probe decides, whatever the build).
    with_nvshmem = SymmMemFeatures(True, True, True, has_set_backend=True, nvshmem_available=True)
    monkeypatch.setattr(nvshmem, "probe_symm_mem", lambda: with_nvshmem)
    assert resolve_transport_name("auto", torch.device("cuda"), spans_hosts=True) == "nvshmem"
    without = dataclasses.replace(with_nvshmem, nvshmem_available=False)
    monkeypatch.setattr(nvshmem, "probe_symm_mem", lambda: without)
    with pytest.raises(ValueError, match=r"is nvshmem, but PyTorch .*--odc-shard-group-size unset"):
        resolve_transport_name("auto", torch.device("cuda"), spans_hosts=True)


def test_importing_the_package_loads_no_backend() -> None:
    code = (
        "import sys\n"
        "import megatron_odc.transport\n"
        "loaded = [m for m in ('shm', 'cuda', 'collective', 'mpi', 'nvshmem') if f'megatron_odc.transport.{m}' in sys.modules]\n"
        "loaded += [m for m in ('mpi4py',) if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
