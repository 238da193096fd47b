"""``--dp-backend odc`` inside Megatron-LM's own training loop (tags ``core_v0.16.1`` to ``core_v0.19.0``),
without editing it.

Split by job:

- ``releases``: one row per supported tag (its patch points, expected signatures and CPU shims);
- ``patching``: ``PATCH_POINTS`` (the catalogue of replaced names), :func:`apply_megatron_lm_patches`
  and the handle that reverts them;
- ``source_hooks``: what a patched Megatron-LM source calls at the same points (``patches/``);
- ``version``: which row the installed Megatron-LM is, checked before patching;
- ``flags``: ODC's flags in Megatron-LM's parser, what ``--dp-backend`` sets or refuses, the CPU flags;
- ``builders``: the ``ODCDataParallel`` wrapper and the ODC optimizer where Megatron-LM builds its own,
  and the check that every chunk is ODC-wrapped before training;
- ``schedule``: each DP replica's planned microbatch count, including 0;
- ``data``: the length-balanced loader of the train split;
- ``checkpointing``: Megatron-LM's ``save_checkpoint`` / ``load_checkpoint`` of ODC chunks;
- ``cpu_shims``: the Megatron-LM-only CPU stand-ins;
- ``sft``: ``--sft``'s flags and the transformers-5 adapter of the tag's ``SFTTokenizer``;
- ``torch_fsdp2``: ``--use-torch-fsdp2`` refused where megatron-core's wrapper fails at the first
  step, and the per-token gradient scaling its chunks lack supplied.

``python -m megatron_odc.launch`` (``integration/launch.py``) applies the patches and runs a script.
"""

from megatron_odc.integration.megatron_lm.patching import (
    MegatronLmPatches,
    apply_megatron_lm_patches,
)

__all__ = ["MegatronLmPatches", "apply_megatron_lm_patches"]
