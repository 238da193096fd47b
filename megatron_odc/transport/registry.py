"""The one list of transports, and how a transport is chosen and built by name.

``TRANSPORTS`` maps each name to its class (imported when first built, so importing this module loads no
backend); ``TRANSPORT_CHOICES`` adds ``auto``, which :func:`resolve_transport_name` turns into the node's
transport (``cuda`` for memory on a GPU, ``shm`` otherwise) for a group on one host, and into ``nvshmem``
(GPUs) or ``mpi`` (CPU) for a group spanning hosts; :func:`build_transport` checks the options against the
class and builds it over a process group. No megatron import.
"""

from __future__ import annotations

import importlib
import inspect
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from megatron_odc.transport.base import Transport

TRANSPORTS = MappingProxyType(
    {
        "shm": "megatron_odc.transport.shm:ShmTransport",
        "collective": "megatron_odc.transport.collective:CollectiveTransport",
        "cuda": "megatron_odc.transport.cuda:CudaSymmTransport",
        "mpi": "megatron_odc.transport.mpi:MpiTransport",
        "nvshmem": "megatron_odc.transport.nvshmem:NvshmemTransport",
    }
)
"""Backend name -> ``module:class`` of its ``Transport`` subclass."""


def transport_class(name: str) -> type[Transport]:
    """The ``Transport`` subclass registered as ``name``.

    Raises:
        ValueError: ``name`` is not one of ``TRANSPORTS``, or its module cannot be imported.
    """
    choices = ", ".join(repr(n) for n in TRANSPORTS)
    target = TRANSPORTS.get(name) if isinstance(name, str) else None
    if target is None:
        raise ValueError(f"unknown transport {name!r}; choose one of {choices}")
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"transport {name!r} is not available here ({exc}); choose one of {choices}"
        ) from exc
    return getattr(module, class_name)


def build_transport(name: str, group: dist.ProcessGroup | None = None, **options: Any) -> Transport:
    """Build the transport backend ``name`` over ``group`` (collective over the group).

    Args:
        name: one of ``TRANSPORTS`` (``"shm"``, ``"collective"``, ``"cuda"``, ``"mpi"``, ``"nvshmem"``).
        group: the data-parallel process group; ``None`` means WORLD.
        **options: the backend's keyword options (e.g. ``shm_dir``, ``timeout_s``, ``lock_stripe_nbytes``
            for ``"shm"``; ``timeout_s`` for ``"collective"``).

    Raises:
        ValueError: ``name`` is unknown, an option is not accepted by the backend, or the backend refuses
            its arguments.
    """
    cls = transport_class(name)
    try:
        inspect.signature(cls).bind(group, **options)
    except TypeError as exc:
        raise ValueError(f"transport {name!r}: invalid options {sorted(options)}: {exc}") from None
    return cls(group, **options)


TRANSPORT_CHOICES = ("auto", *TRANSPORTS)
"""What a user may ask for: a transport by name, or ``auto``."""


def resolve_transport_name(name: str, device: torch.device, spans_hosts: bool = False) -> str:
    """``auto`` -> the node's transport (``cuda`` for memory on a CUDA device, else ``shm``) for a
    group on one host; for a group spanning hosts, ``nvshmem`` for GPUs (where this PyTorch has an
    NVSHMEM backend) and ``mpi`` for CPU ranks. Other names unchanged.

    Raises:
        ValueError: ``auto`` for a group of GPUs spanning hosts without an NVSHMEM PyTorch (the reason
            and the alternatives named).
    """
    if name != "auto":
        return name
    if not spans_hosts:
        return "cuda" if device.type == "cuda" else "shm"
    if device.type != "cuda":
        return "mpi"
    from megatron_odc.transport.nvshmem import nvshmem_unavailable_reason

    reason = nvshmem_unavailable_reason()
    if reason is None:
        return "nvshmem"
    raise ValueError(
        "--odc-transport auto: the shard group spans hosts and its memory is on GPUs, whose "
        f"transport between nodes is nvshmem, but {reason}; leave --odc-shard-group-size unset "
        "(hybrid sharding: one shard group per host) or use --odc-transport collective"
    )
