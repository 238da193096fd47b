"""Where megatron-odc meets code it does not own, at run time and only when asked.

- ``cpu``: megatron-core on CPU under gloo (explicit, reversible patches per release; ``cpu_runtime``);
- ``megatron_lm/``: ``--dp-backend odc`` in Megatron-LM's own training loop (``core_v0.16.1``);
- ``launch``: ``python -m megatron_odc.launch SCRIPT``, a Megatron-LM script with the patches.

The only layer that touches ``megatron.training``. Nothing is patched on import.
"""
