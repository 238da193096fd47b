"""A stand-in GPU for ``CudaSymmTransport`` and ``NvshmemTransport`` on CPU: shared host memory as
symmetric memory, host copies as NVSHMEM, no-op streams.

Symmetric memory is replaced by ``/dev/shm`` mappings under ``MEGATRON_ODC_SHM_DIR`` (every rank maps every
rank's file, so ``handle.get_buffer(peer, ...)`` is a real view of the peer's memory), its barrier by a
gloo barrier, and CUDA streams by no-ops. The transports are built as if on ``cuda:0`` and then hold host
memory (``device`` is ``cpu``), so their own code (registration, staging slots at the peer, the owner
reduce at the fence, the error paths) runs unchanged in real processes. Nothing else sees a GPU:
``torch.cuda.is_available()`` is True only while a transport is being constructed.

With ``nvshmem=True`` the installed PyTorch also has an NVSHMEM backend (``is_nvshmem_available``,
``set_backend`` / ``get_backend``), and the nvshmem transport's device operations are
:class:`FakeNvshmemOps`: NVSHMEM get / put as host copies that translate a symmetric address the way
NVSHMEM does (this rank's address of an allocation names the same bytes of the peer's) and, like NVSHMEM's
network transports, refuse a local side that is not symmetric memory. Each handle's ``buffer_ptrs`` is 0
for peers on another (pretend) host (``transport/hosts.py``), as ``nvshmem_ptr`` is for another node, so
those peers take the NVSHMEM path.

Used by ``tests/transport/test_cuda_logic.py``, ``tests/transport/test_nvshmem.py`` and by
``benchmarks/gpu_check.py --cpu-rehearsal``::

    fake = install_fake_cuda()   # in a rank body, after dist.init_process_group
    ...                          # CudaSymmTransport / odc_transport="cuda" now work on CPU
    fake.revert()

Only the deterministic accumulate mode can run: the atomic mode's Triton kernel needs a real GPU.
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist


class FakeStream:
    """A CUDA stream that is always complete."""

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class FakeHandle:
    """The symmetric-memory handle: every rank's buffer as a host tensor.

    ``buffer_ptrs[peer]`` is the peer's mapping here, or 0 for a peer on another (pretend) host.
    """

    buffer_ptrs_dev = 0

    def __init__(self, views: list[torch.Tensor], reachable: list[bool] | None = None) -> None:
        self.views = views
        reachable = reachable if reachable is not None else [True] * len(views)
        self.buffer_ptrs = [v.data_ptr() if ok else 0 for v, ok in zip(views, reachable)]

    def get_buffer(self, peer: int, sizes, dtype: torch.dtype, storage_offset: int = 0):
        assert self.buffer_ptrs[peer], f"rank {peer} is on another host: no load / store mapping"
        view = self.views[peer]
        assert view.dtype == dtype, (view.dtype, dtype)
        numel = int(torch.Size(sizes).numel())
        assert storage_offset + numel <= view.numel(), "get_buffer out of bounds"
        return view[storage_offset : storage_offset + numel].view(sizes)

    def barrier(self, channel: int = 0) -> None:
        dist.barrier()


class FakeSymmMem:
    """``symm_mem.empty`` / ``rendezvous`` over files every rank maps."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.paths: dict[int, str] = {}
        self.count = 0
        self.groups: list[Any] = []  # the group argument of every rendezvous, as given
        self.allocations: list[
            tuple[int, int, list[torch.Tensor]]
        ] = []  # (base, nbytes, rank bytes)

    def empty(self, numel: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
        path = os.path.join(self.directory, f"fake-{os.getpid()}-{self.count}")
        self.count += 1
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        self.paths[tensor.data_ptr()] = path
        return tensor

    def rendezvous(self, tensor: torch.Tensor, group: Any) -> FakeHandle:
        self.groups.append(group)
        paths: list = [None] * dist.get_world_size()
        dist.all_gather_object(paths, self.paths[tensor.data_ptr()])
        views = [
            torch.from_file(p, shared=True, size=tensor.numel(), dtype=tensor.dtype) for p in paths
        ]
        views[dist.get_rank()] = tensor
        from megatron_odc.transport.hosts import host_id

        hosts: list = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, host_id())
        reachable = [h == hosts[dist.get_rank()] for h in hosts]
        nbytes = tensor.numel() * tensor.element_size()
        self.allocations.append((tensor.data_ptr(), nbytes, [v.view(torch.uint8) for v in views]))
        return FakeHandle(views, reachable)

    def translate(self, local: torch.Tensor, pe: int) -> torch.Tensor:
        """PE ``pe``'s bytes at ``local``'s symmetric address, as ``local``'s dtype and shape.

        Raises:
            AssertionError: ``local`` is not (entirely) inside a symmetric allocation of this rank.
        """
        start = local.data_ptr()
        nbytes = local.numel() * local.element_size()
        for base, size, ranks in self.allocations:
            if base <= start and start + nbytes <= base + size:
                offset = start - base
                return ranks[pe][offset : offset + nbytes].view(local.dtype).view(local.shape)
        raise AssertionError(
            f"{nbytes} bytes at {start:#x} are not symmetric memory of this rank: NVSHMEM cannot "
            "address them (a local buffer must be symmetric or registered)"
        )


class FakeNvshmemOps:
    """NVSHMEM get / put as host copies (the interface of ``nvshmem.NvshmemDeviceOps``).

    Attributes:
        calls: how many gets and puts reached each PE, e.g. ``calls["put", 2]``.
    """

    def __init__(self, symm_mem: FakeSymmMem) -> None:
        self.symm_mem = symm_mem
        self.calls: collections.Counter = collections.Counter()

    def get(self, dest: torch.Tensor, source: torch.Tensor, pe: int) -> None:
        self.symm_mem.translate(dest, dist.get_rank())  # the local side must be symmetric memory
        dest.copy_(self.symm_mem.translate(source, pe))
        self.calls["get", pe] += 1

    def put(self, dest: torch.Tensor, source: torch.Tensor, pe: int) -> None:
        self.symm_mem.translate(source, dist.get_rank())
        self.symm_mem.translate(dest, pe).copy_(source)
        self.calls["put", pe] += 1


class FakeCuda:
    """The installed replacements; :meth:`revert` puts every attribute back, last patched first.

    Attributes:
        symm_mem: the fake symmetric memory (its ``groups`` records every rendezvous's group argument).
    """

    def __init__(self, symm_mem: FakeSymmMem) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self.symm_mem = symm_mem
        self.nvshmem_ops = FakeNvshmemOps(symm_mem)
        self.backends: list[str] = []  # every set_backend call

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def revert(self, keep: int = 0) -> None:
        """Undo every patch after the first ``keep`` (all of them by default)."""
        while len(self._saved) > keep:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)


def install_fake_cuda(nvshmem: bool = False) -> FakeCuda:
    """Patch streams, symmetric memory and the transports' device (see the module docstring); with
    ``nvshmem``, also give PyTorch an NVSHMEM backend and the nvshmem transport host-copy operations."""
    import torch.distributed._symmetric_memory as symm_mem

    import megatron_odc.transport.nvshmem as nvshmem_transport
    from megatron_odc.transport.cuda import CudaSymmTransport

    directory = os.environ.get("MEGATRON_ODC_SHM_DIR")
    if not directory:
        raise ValueError("install_fake_cuda: set MEGATRON_ODC_SHM_DIR to a private directory first")
    fake, stream = FakeSymmMem(directory), FakeStream()
    handle = FakeCuda(fake)
    for cls in (CudaSymmTransport, nvshmem_transport.NvshmemTransport):
        handle.patch(cls, "__init__", _init_on_host(handle, cls.__init__))
    if nvshmem:
        handle.patch(symm_mem, "is_nvshmem_available", lambda: True)
        handle.patch(symm_mem, "set_backend", handle.backends.append)
        handle.patch(
            symm_mem, "get_backend", lambda device: handle.backends[-1] if handle.backends else None
        )
        handle.patch(nvshmem_transport, "load_device_ops", lambda: handle.nvshmem_ops)
    handle.patch(torch.cuda, "Stream", lambda *a, **k: FakeStream())
    handle.patch(torch.cuda, "current_stream", lambda *a, **k: stream)
    handle.patch(torch.cuda, "synchronize", lambda *a, **k: None)
    handle.patch(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    handle.patch(torch.Tensor, "record_stream", lambda self, s: None)
    handle.patch(symm_mem, "empty", fake.empty)
    handle.patch(symm_mem, "rendezvous", fake.rendezvous)
    return handle


def _init_on_host(handle: FakeCuda, original_init: Any) -> Any:
    def init_on_host(self, group=None, *args: Any, device: Any = None, **kwargs: Any) -> None:
        # Torch-function modes off: the CPU patches' device remap would turn cuda:0 into cpu:0 here.
        with _gpu_visible(handle), torch._C.DisableTorchFunction():
            original_init(self, group, *args, device=0, **kwargs)
        self.device = torch.device("cpu")  # the faked "device" memory is host memory

    return init_on_host


@contextlib.contextmanager
def _gpu_visible(handle: FakeCuda):
    before = len(handle._saved)
    handle.patch(torch.cuda, "is_available", lambda: True)
    handle.patch(torch.cuda, "set_device", lambda device: None)
    try:
        yield
    finally:
        handle.revert(keep=before)
