"""Transports: one-sided get/accumulate between the ranks of a data-parallel group.

``build_transport(name, group, **options)`` builds a backend by name:

- ``"shm"``: ``ShmTransport``, shared memory between the ranks of one host (CPU; the CI workhorse);
- ``"collective"``: ``CollectiveTransport``, torch.distributed collectives in lockstep (the FSDP baseline);
- ``"cuda"``: ``CudaSymmTransport``, PyTorch symmetric memory between the GPUs of one node.

Backend modules are imported when first built, so importing this package stays light. This package owns
the backend registry. It imports no megatron module.
"""

from __future__ import annotations

import importlib
import inspect
from types import MappingProxyType
from typing import Any

import torch.distributed as dist

from megatron_odc.transport.base import (
    ACCUMULATE_SOURCE_DTYPES,
    BufferSpec,
    Transport,
    TransportError,
)
from megatron_odc.transport.collective import CollectiveTransport
from megatron_odc.transport.shm import ShmTransport

TRANSPORTS = MappingProxyType(
    {
        "shm": "megatron_odc.transport.shm:ShmTransport",
        "collective": "megatron_odc.transport.collective:CollectiveTransport",
        "cuda": "megatron_odc.transport.cuda:CudaSymmTransport",
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
        name: one of ``TRANSPORTS`` (``"shm"``, ``"collective"``, ``"cuda"``).
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


__all__ = [
    "ACCUMULATE_SOURCE_DTYPES",
    "TRANSPORTS",
    "BufferSpec",
    "CollectiveTransport",
    "ShmTransport",
    "Transport",
    "TransportError",
    "build_transport",
    "transport_class",
]
