"""A stand-in GPU for ``CudaSymmTransport`` on CPU: shared host memory as symmetric memory, no-op streams.

Symmetric memory is replaced by ``/dev/shm`` mappings under ``MEGATRON_ODC_SHM_DIR`` (every rank maps every
rank's file, so ``handle.get_buffer(peer, ...)`` is a real view of the peer's memory), its barrier by a
gloo barrier, and CUDA streams by no-ops. ``CudaSymmTransport`` is built as if on ``cuda:0`` and then
holds host memory (``device`` is ``cpu``), so its own code (registration, staging slots at the peer, the
owner reduce at the fence, the error paths) runs unchanged in real processes. Nothing else sees a GPU:
``torch.cuda.is_available()`` is True only while a transport is being constructed.

Used by ``tests/test_transport_cuda_logic.py`` and by ``benchmarks/gpu_check.py --cpu-rehearsal``::

    fake = install_fake_cuda()   # in a rank body, after dist.init_process_group
    ...                          # CudaSymmTransport / odc_transport="cuda" now work on CPU
    fake.revert()

Only the deterministic accumulate mode can run: the atomic mode's Triton kernel needs a real GPU.
"""

from __future__ import annotations

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
    """The symmetric-memory handle: every rank's buffer as a host tensor."""

    buffer_ptrs_dev = 0

    def __init__(self, views: list[torch.Tensor]) -> None:
        self.views = views

    def get_buffer(self, peer: int, sizes, dtype: torch.dtype, storage_offset: int = 0):
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
        return FakeHandle(views)


class FakeCuda:
    """The installed replacements; :meth:`revert` puts every attribute back, last patched first.

    Attributes:
        symm_mem: the fake symmetric memory (its ``groups`` records every rendezvous's group argument).
    """

    def __init__(self, symm_mem: FakeSymmMem) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self.symm_mem = symm_mem

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def revert(self, keep: int = 0) -> None:
        """Undo every patch after the first ``keep`` (all of them by default)."""
        while len(self._saved) > keep:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)


def install_fake_cuda() -> FakeCuda:
    """Patch streams, symmetric memory and ``CudaSymmTransport``'s device (see the module docstring)."""
    import torch.distributed._symmetric_memory as symm_mem

    from megatron_odc.transport.cuda import CudaSymmTransport

    directory = os.environ.get("MEGATRON_ODC_SHM_DIR")
    if not directory:
        raise ValueError("install_fake_cuda: set MEGATRON_ODC_SHM_DIR to a private directory first")
    fake, stream = FakeSymmMem(directory), FakeStream()
    handle = FakeCuda(fake)
    original_init = CudaSymmTransport.__init__

    def init_on_host(self, group=None, *args: Any, device: Any = None, **kwargs: Any) -> None:
        # Torch-function modes off: the CPU patches' device remap would turn cuda:0 into cpu:0 here.
        with _gpu_visible(handle), torch._C.DisableTorchFunction():
            original_init(self, group, *args, device=0, **kwargs)
        self.device = torch.device("cpu")  # the faked "device" memory is host memory

    handle.patch(CudaSymmTransport, "__init__", init_on_host)
    handle.patch(torch.cuda, "Stream", lambda *a, **k: FakeStream())
    handle.patch(torch.cuda, "current_stream", lambda *a, **k: stream)
    handle.patch(torch.cuda, "synchronize", lambda *a, **k: None)
    handle.patch(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    handle.patch(torch.Tensor, "record_stream", lambda self, s: None)
    handle.patch(symm_mem, "empty", fake.empty)
    handle.patch(symm_mem, "rendezvous", fake.rendezvous)
    return handle


@contextlib.contextmanager
def _gpu_visible(handle: FakeCuda):
    before = len(handle._saved)
    handle.patch(torch.cuda, "is_available", lambda: True)
    handle.patch(torch.cuda, "set_device", lambda device: None)
    try:
        yield
    finally:
        handle.revert(keep=before)
