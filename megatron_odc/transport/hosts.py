"""Which ranks share a host: the one place that decides it.

A real run's host is the machine's hostname (``socket.gethostname()``): ``torchrun --nnodes N`` starts
``LOCAL_WORLD_SIZE`` ranks on each of N machines, and ranks on one machine share its memory (``shm``)
and its GPUs' peer pointers (``cuda``).

Tests only: ``MEGATRON_ODC_LOCAL_WORLD_SIZE=k`` (:data:`LOCAL_WORLD_SIZE_ENV`) declares *pretend hosts*
on one machine: global ranks ``[0, k)`` are on pretend host 0, ``[k, 2k)`` on pretend host 1, and so on,
so that every multi-node path (hybrid sharding, transports refusing to span hosts) runs in CPU CI with a
few processes. Pretend hosts also get their own namespace for node-local files (:func:`host_namespace`),
so no shared-memory file is named alike across the pretend boundary. Do not set it in real runs.

:func:`pid_alive` tells whether a peer process on this machine still runs, so that a transport can
name a dead peer at once rather than at its timeout. No megatron import.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch.distributed as dist

LOCAL_WORLD_SIZE_ENV = "MEGATRON_ODC_LOCAL_WORLD_SIZE"
"""Test-only: ranks per pretend host (global ranks ``[i*k, (i+1)*k)`` form pretend host ``i``)."""


def _pretend_local_world_size() -> int | None:
    value = os.environ.get(LOCAL_WORLD_SIZE_ENV)
    if not value:
        return None
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"{LOCAL_WORLD_SIZE_ENV}={value!r} must be an integer >= 1 (test-only)")
    return size


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def host_id() -> str:
    """This rank's host: its hostname, or ``<hostname>/pretend-host-<i>`` under the test override."""
    local = _pretend_local_world_size()
    if local is None:
        return socket.gethostname()
    return f"{socket.gethostname()}/pretend-host-{_global_rank() // local}"


def host_namespace() -> str:
    """A prefix for the names of this host's node-local files: empty on a real host, ``h<i>-`` on
    pretend host ``i``."""
    local = _pretend_local_world_size()
    return "" if local is None else f"h{_global_rank() // local}-"


def hosts_of_group(group: dist.ProcessGroup | None) -> list[str]:
    """Every rank's :func:`host_id`, in group-rank order (collective over ``group``)."""
    if not dist.is_initialized():
        return [host_id()]
    hosts: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, host_id(), group=group)
    return [str(h) for h in hosts]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine and is not a zombie."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs, or the process vanished just now: the next check decides
    # The state letter follows the parenthesised command name, which may itself contain ')'.
    state = stat[stat.rfind(")") + 2 : stat.rfind(")") + 3]
    return state not in ("Z", "X")
