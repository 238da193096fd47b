"""Transports: one-sided get / accumulate between the ranks of a data-parallel group.

- ``base``: the protocol every transport speaks (:class:`Transport`) and its error type;
- ``shm`` (:class:`ShmTransport`): shared memory between the CPU ranks of one host, the CI workhorse;
- ``cuda`` (:class:`CudaSymmTransport`): PyTorch symmetric memory between the GPUs of one node;
- ``mpi`` (:class:`MpiTransport`): MPI-3 RMA through mpi4py, on one host or across hosts (``mpiexec``);
- ``nvshmem`` (:class:`NvshmemTransport`): PyTorch symmetric memory with its NVSHMEM backend, GPUs across
  nodes (a ``cuda`` transport whose peers on other nodes go through NVSHMEM get / put);
- ``collective`` (:class:`CollectiveTransport`): torch.distributed collectives in lockstep (the FSDP
  baseline);
- ``staging``: the staging slots and fixed-order owner reduce of the deterministic accumulate modes
  (``shm``, ``cuda``, ``mpi``; always ``nvshmem``'s);
- ``registry``: the one list of transports, ``build_transport(name, group, **options)``;
- ``devices``: which device a process group's collectives need;
- ``hosts``: which ranks share a host (tests: pretend hosts, ``MEGATRON_ODC_LOCAL_WORLD_SIZE``), and
  whether a peer process on this machine is alive.

Importing this package loads no backend: they are imported when built (or imported by name). It
imports no megatron module.
"""

from megatron_odc.transport.base import (
    ACCUMULATE_SOURCE_DTYPES,
    BufferSpec,
    Transport,
    TransportError,
)
from megatron_odc.transport.registry import (
    TRANSPORT_CHOICES,
    TRANSPORTS,
    build_transport,
    resolve_transport_name,
    transport_class,
)

__all__ = [
    "ACCUMULATE_SOURCE_DTYPES",
    "TRANSPORTS",
    "TRANSPORT_CHOICES",
    "BufferSpec",
    "Transport",
    "TransportError",
    "build_transport",
    "resolve_transport_name",
    "transport_class",
]
