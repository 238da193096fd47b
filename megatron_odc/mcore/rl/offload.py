"""Offload and onload between phases (rollout <-> training): what ODC keeps on the device goes to the
host and comes back bit for bit.

Between steps an ODC chunk holds on its device: the owned parameter shards and fp32 gradient
accumulators (transport memory: CUDA symmetric memory on GPUs, shared memory on CPU) and, in its
optimizer, the fp32 main shards and the inner optimizer's state. Unsharded parameter and gradient
buffers exist only inside a minibatch ([Note: minibatch protocol] in ``core/state.py``); offload
releases any unit still held, so none is left.

- :func:`offload`: each engine copies its shards to the host and closes its transport
  (``ODCEngine.offload_shards``; transport memory cannot be shrunk in place, so it is freed whole);
  each optimizer tensor is copied to the host and its storage resized to 0 (the optimizer's parameter
  views and state keys stay the same objects); the pieces' gradient views are dropped.
- :func:`onload`: each wrapper's transport is rebuilt with its own options, the same buffers are
  registered in the same order and filled back (``ODCEngine.onload_shards``), the optimizer storage is
  given back and filled, the gradient views rebound.

Both are collective over every rank of the job (transport teardown and rendezvous). verl's equivalent
for megatron-core DDP moves each chunk's ``buffer.param_data`` and the distributed optimizer's shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from megatron_odc.transport import build_transport


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
    """Bytes ODC holds on the device, by kind (measured from the live tensors' storage).

    Attributes:
        shards: owned parameter shards and gradient accumulators, with the deterministic mode's
            staging slots (all of it transport memory).
        optimizer: fp32 main shards and optimizer state.
        unsharded: unsharded parameter and gradient buffers.
    """

    shards: int
    optimizer: int
    unsharded: int

    @property
    def total(self) -> int:
        """All of them."""
        return self.shards + self.optimizer + self.unsharded


def device_nbytes(model_chunks: Sequence, optimizer=None) -> DeviceBytes:
    """What the ODC chunks and their optimizer (``None``: a frozen reference has none) hold on the
    device now."""
    shards = unsharded = 0
    for chunk in model_chunks:
        engine = chunk.engine
        if not engine.offloaded:
            shards += engine.transport.local_nbytes()
        unsharded += engine.unsharded_nbytes()
    tensors = optimizer.device_tensors() if optimizer is not None else []
    storages = {t.untyped_storage().data_ptr(): t for t in tensors}
    held = sum(t.untyped_storage().nbytes() for ptr, t in storages.items() if ptr)
    return DeviceBytes(shards, held, unsharded)


@dataclasses.dataclass
class Offloaded:
    """What :func:`offload` moved: pass it to :func:`onload`.

    Attributes:
        model_chunks: the ODC chunks.
        optimizer: their ``ODCOptimizer`` (``None`` for a frozen reference).
        tensors: each optimizer tensor whose storage was freed, with its host copy.
    """

    model_chunks: list
    optimizer: object
    tensors: list[tuple[torch.Tensor, torch.Tensor]]


def offload(model_chunks: Sequence, optimizer=None, host: torch.device | str = "cpu") -> Offloaded:
    """Move every ODC chunk's shards and the optimizer's tensors (``optimizer=None``: a frozen
    reference model's chunks; refused for chunks that train, whose optimizer's gradient views must be
    rebound at onload) to ``host`` (collective; between steps). Until :func:`onload`, nothing may
    run a step, fetch or save."""
    chunks = list(model_chunks)
    trained = [i for i, chunk in enumerate(chunks) if chunk.engine.gradients]
    if optimizer is None and trained:
        raise ValueError(
            f"offload: chunk {trained[0]} trains (it has gradient accumulators) but no optimizer was "
            "passed; its optimizer's gradient views point into those accumulators and must be "
            "rebound at onload, so pass offload(model_chunks, optimizer) (optimizer=None is for a "
            "frozen reference model)"
        )
    for chunk in chunks:  # refused before anything moves: the optimizer's tensors are freed below
        chunk.engine.check_offload()
    host = torch.device(host)
    moved: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    if optimizer is not None:
        optimizer.unbind_grads()
    for tensor in optimizer.device_tensors() if optimizer is not None else []:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        moved.append((tensor, tensor.detach().to(host, copy=True)))
    for tensor, _ in moved:
        tensor.untyped_storage().resize_(0)
    for chunk in chunks:
        chunk.engine.offload_shards(host)
    return Offloaded(chunks, optimizer, moved)


def onload(offloaded: Offloaded) -> None:
    """Bring back what :func:`offload` moved (collective): transports rebuilt with each wrapper's
    options, shards and optimizer tensors copied back, gradient views rebound."""
    for chunk in offloaded.model_chunks:
        transport = build_transport(
            chunk.transport_name, chunk.shard_group, **chunk.transport_options
        )
        chunk.engine.onload_shards(transport)
    for tensor, saved in offloaded.tensors:
        tensor.untyped_storage().resize_(saved.numel() * saved.element_size())
        with torch.no_grad():
            tensor.copy_(saved)
    offloaded.tensors.clear()
    if offloaded.optimizer is not None:
        offloaded.optimizer.bind_grads()
