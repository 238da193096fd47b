"""Distributed checkpoints through ``megatron.core.dist_checkpointing`` (torch_dist format).

- ``boxes``: an owned flat range of a tensor as rectangular ``ShardedTensor`` boxes;
- ``model_state``: an ODC model's sharded state dict (owned slices under the unwrapped model's keys);
- ``optimizer_state``: the ODC optimizer's state under DistOpt's fully-reshardable keys;
- ``state``: the whole ``{"model", "optimizer"}`` state of any backend: build, write, load;
- ``writer_processes``: megatron-core's checkpoint-writer processes die with the rank that saves.

Imports nothing on its own (the optimizer imports ``optimizer_state``, and ``state`` imports the
optimizer).
"""
