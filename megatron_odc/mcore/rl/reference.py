"""A frozen reference model under ODC (GRPO's KL term, DPO's reference log-probs).

:func:`build_reference` wraps a model that is never trained in ``ODCDataParallel(frozen=True)``:
its parameters are sharded over DP like the policy's (each rank holds ``1/N`` of them), a forward
fetches each unit from its owners and releases it after use, exactly as the policy's forward does, and
nothing else exists: no gradient accumulators are registered, no gradient hook is installed, nothing is
ever pushed, and no optimizer is built. Ranks may run different numbers of forwards (the fetches are
one-sided). Run it under ``torch.no_grad()`` or through a forward-only schedule call.

sail-sg/odc's unmerged ``ref-model-disable-odc`` branch falls back to FSDP2's collective all-gather for
the reference model; here the reference uses the same one-sided fetches as the policy.
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallelConfig

from megatron_odc.mcore.config import ODCConfig
from megatron_odc.mcore.data_parallel import ODCDataParallel


def build_reference(
    model: torch.nn.Module, *, odc_config: ODCConfig | None = None
) -> ODCDataParallel:
    """Freeze ``model`` (``requires_grad=False`` on every parameter) and wrap it without gradients,
    in eval mode (its dropout off, so that its log-probs of the same samples are the same).

    Args:
        model: a megatron-core model (``GPTModel`` or ``Float16Module``) with the reference weights,
            the same on every DP rank.
        odc_config: ODC's options (transport, bucket size, ...), as for the policy.
    """
    for param in model.parameters():
        param.requires_grad_(False)
    reference = ODCDataParallel(
        model.config, DistributedDataParallelConfig(), model, odc_config=odc_config, frozen=True
    )
    return reference.eval()  # dropout off: the same log-probs for the same samples
