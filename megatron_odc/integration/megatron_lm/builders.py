"""What Megatron-LM builds for ``--dp-backend odc`` / ``fsdp``: the DP wrapper and the optimizer.

:func:`wrap_get_model`: while ``get_model`` runs, ``megatron.training.training.DDP`` is a factory that
builds ``ODCDataParallel`` with Megatron-LM's ``DistributedDataParallelConfig`` and the ``ODCConfig`` of
the ``--odc-*`` flags; the global is restored afterwards. :func:`wrap_get_megatron_optimizer`: an
:class:`ODCChainedOptimizer` over one ``ODCOptimizer`` when every chunk is ODC. Both route Megatron-LM's
checkpointing of the chunks through ODC's (``checkpointing.py``). :func:`close_odc_chunks` releases the
transports of the chunks built (the launcher calls it when the script ends normally: Megatron-LM
never closes its model, and an ``mpi`` transport's windows would otherwise outlive ``MPI_Finalize``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from megatron.core.optimizer.optimizer import ChainedOptimizer

from megatron_odc.integration.megatron_lm.checkpointing import install_megatron_lm_checkpointing
from megatron_odc.mcore.config import ODC_ENGINE_BACKENDS, ODCConfig
from megatron_odc.mcore.data_parallel import ODCDataParallel
from megatron_odc.mcore.optimizer import ODCOptimizer

logger = logging.getLogger(__name__)

_BUILT: list[ODCDataParallel] = []
"""The ``ODCDataParallel`` chunks :func:`wrap_get_model` built and :func:`close_odc_chunks` has not closed."""


def close_odc_chunks() -> int:
    """Release the transport of every chunk built so far; returns how many were closed.

    Collective over each chunk's DP group (every rank calls it once training has ended on all of
    them); the ``mpi`` transport's close waits ``--odc-timeout-s`` at most for its peers.
    """
    closed = len(_BUILT)
    while _BUILT:
        _BUILT.pop(0).close()
    return closed


def wrap_get_model(original: Callable, training: Any) -> Callable:
    """``get_model`` that wraps ODC chunks in ``ODCDataParallel`` (see the module docstring)."""

    @functools.wraps(original)
    def get_model(*args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        if getattr(margs, "dp_backend", None) not in ODC_ENGINE_BACKENDS:
            return original(*args, **kwargs)
        odc_config = ODCConfig.from_args(margs)

        def odc_ddp(config, ddp_config, module, disable_bucketing=False, **extra):
            return ODCDataParallel(
                config, ddp_config, module, disable_bucketing, odc_config=odc_config, **extra
            )

        saved = training.DDP
        training.DDP = odc_ddp
        try:
            model = original(*args, **kwargs)
        finally:
            training.DDP = saved
        wrapped = [c for c in model if isinstance(c, ODCDataParallel)]
        for chunk in wrapped:
            install_megatron_lm_checkpointing(chunk)
        _BUILT.extend(wrapped)
        if wrapped:
            logger.info(
                "--dp-backend %s: %d model chunk(s) wrapped in ODCDataParallel (transport %s)",
                margs.dp_backend,
                len(wrapped),
                wrapped[0].transport_name,
            )
        return model

    get_model.__megatron_odc_original__ = original
    return get_model


class ODCChainedOptimizer(ChainedOptimizer):
    """``ChainedOptimizer`` over one ``ODCOptimizer`` whose ``step`` is the ODC optimizer's own.

    ``ChainedOptimizer.step`` clips through ``clip_grad_by_total_norm_fp32``, which asserts CUDA grads;
    ``ODCOptimizer.step`` does the same unscale / norm / clip / count / step over its owned shards.
    """

    def step(self):
        """One optimizer step; returns ``(update_successful, grad_norm, num_zeros_in_grad)``."""
        (optimizer,) = self.chained_optimizers
        return optimizer.step()


def wrap_get_megatron_optimizer(original: Callable) -> Callable:
    """``get_megatron_optimizer`` that builds the ODC optimizer for ODC chunks."""

    @functools.wraps(original)
    def get_megatron_optimizer(config, model_chunks, config_overrides=None, *args, **kwargs):
        is_odc = [isinstance(chunk, ODCDataParallel) for chunk in model_chunks]
        if not any(is_odc):
            return original(config, model_chunks, config_overrides, *args, **kwargs)
        if not all(is_odc):
            raise ValueError("some model chunks are ODCDataParallel and some are not")
        optimizer = ODCOptimizer(config, list(model_chunks), config_overrides)
        for chunk in model_chunks:  # a weights-only load refreshes this optimizer's main shards
            install_megatron_lm_checkpointing(chunk, optimizer)
        logger.info("optimizer: ChainedOptimizer([ODCOptimizer(%s)])", config.optimizer)
        return ODCChainedOptimizer([optimizer])

    get_megatron_optimizer.__megatron_odc_original__ = original
    return get_megatron_optimizer
