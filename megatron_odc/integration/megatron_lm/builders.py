"""What Megatron-LM builds for ``--dp-backend odc`` / ``fsdp``: the DP wrapper and the optimizer.

:func:`wrap_get_model`: while ``get_model`` runs, ``megatron.training.training.DDP`` is a factory that
builds ``ODCDataParallel`` with Megatron-LM's ``DistributedDataParallelConfig`` and the ``ODCConfig`` of
the ``--odc-*`` flags; the global is restored afterwards. :func:`wrap_ddp_wrap` does the same for
``models.dist_utils._ddp_wrap`` (``core_v0.18.2`` on; ``pretrain_gpt.py`` of ``core_v0.19.0`` builds
its model there, never calling ``get_model``) with that module's ``DistributedDataParallel``.
:func:`wrap_setup_model_and_optimizer` checks, once Megatron-LM has built the model and before it
trains, that every chunk is ``ODCDataParallel`` under ``--dp-backend odc|fsdp``: a tag building its
model somewhere ODC does not hook must stop, not train with Megatron's own DDP. :func:`wrap_get_megatron_optimizer`: an
:class:`ODCChainedOptimizer` over one ``ODCOptimizer`` when every chunk is ODC. Both route Megatron-LM's
checkpointing of the chunks through ODC's (``checkpointing.py``). :func:`close_odc_chunks` releases the
transports of the chunks built (the launcher calls it when the script ends normally: Megatron-LM
never closes its model, and an ``mpi`` transport's windows would otherwise outlive ``MPI_Finalize``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from megatron.core.optimizer.optimizer import ChainedOptimizer

from megatron_odc.integration.megatron_lm.checkpointing import install_megatron_lm_checkpointing
from megatron_odc.integration.megatron_lm.torch_fsdp2 import scale_torch_fsdp2_gradients
from megatron_odc.mcore.config import ODC_ENGINE_BACKENDS, ODCConfig
from megatron_odc.mcore.data_parallel import ODCDataParallel
from megatron_odc.mcore.optimizer import ODCOptimizer
from megatron_odc.runner.log import info_once

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


def _odc_factory(margs: Any) -> Callable:
    """A stand-in for Megatron-LM's DDP class that builds ``ODCDataParallel`` (``full_param_layout``
    and ``pg_collection`` are passed on; ``ODCDataParallel`` refuses a layout)."""
    odc_config = ODCConfig.from_args(margs)

    def odc_ddp(config, ddp_config, module, disable_bucketing=False, **extra):
        return ODCDataParallel(
            config, ddp_config, module, disable_bucketing, odc_config=odc_config, **extra
        )

    return odc_ddp


def _built(model: list, backend: str, where: str) -> list:
    wrapped = [c for c in model if isinstance(c, ODCDataParallel)]
    for chunk in wrapped:
        install_megatron_lm_checkpointing(chunk)
    _BUILT.extend(wrapped)
    if wrapped:
        logger.info(
            "--dp-backend %s: %d model chunk(s) wrapped in ODCDataParallel by %s (transport %s)",
            backend,
            len(wrapped),
            where,
            wrapped[0].transport_name,
        )
    return model


def _swapping(original: Callable, owner: Any, attr: str) -> Callable:
    """``original`` run with ``owner.attr`` (Megatron-LM's DDP class) swapped for ODC's factory."""

    @functools.wraps(original)
    def build(*args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        if getattr(margs, "dp_backend", None) not in ODC_ENGINE_BACKENDS:
            return original(*args, **kwargs)
        saved = getattr(owner, attr)
        setattr(owner, attr, _odc_factory(margs))
        try:
            model = original(*args, **kwargs)
        finally:
            setattr(owner, attr, saved)
        return _built(model, margs.dp_backend, f"{owner.__name__}.{original.__name__}")

    build.__megatron_odc_original__ = original
    return build


def wrap_get_model(original: Callable, training: Any) -> Callable:
    """``get_model`` that wraps ODC chunks in ``ODCDataParallel`` (see the module docstring)."""
    return _swapping(original, training, "DDP")


def wrap_ddp_wrap(original: Callable, dist_utils: Any) -> Callable:
    """``models.dist_utils._ddp_wrap`` that wraps ODC chunks in ``ODCDataParallel``."""
    return _swapping(original, dist_utils, "DistributedDataParallel")


def check_odc_wrapped(chunks: Sequence, backend: str | None) -> None:
    """Under ``--dp-backend odc|fsdp``, every one of the model's ``chunks`` must be ``ODCDataParallel``.

    Raises:
        ValueError: one line naming the chunks Megatron-LM wrapped otherwise.
    """
    if backend not in ODC_ENGINE_BACKENDS:
        return
    other = [
        (i, type(c).__name__) for i, c in enumerate(chunks) if not isinstance(c, ODCDataParallel)
    ]
    if other:
        from megatron_odc.integration.megatron_lm.releases import training_dir

        listed = ", ".join(f"chunk {i} is {name}" for i, name in other)
        raise ValueError(
            f"--dp-backend {backend}: Megatron-LM built the model without ODC ({listed}); the "
            f"megatron/training at {training_dir()} wraps its model where megatron_odc does not "
            "hook, so training stops here instead of running Megatron's own DDP; use a supported "
            "Megatron-LM tag (docs/megatron_lm.md)"
        )


def wrap_setup_model_and_optimizer(original: Callable) -> Callable:
    """``setup_model_and_optimizer`` followed by :func:`check_odc_wrapped` on the model it built, and
    under ``--use-torch-fsdp2`` the gradient scaling its chunks lack (``torch_fsdp2.py``)."""

    @functools.wraps(original)
    def setup_model_and_optimizer(*args, **kwargs):
        from megatron.training import get_args

        result = original(*args, **kwargs)
        model, optimizer = result[0], result[1]
        chunks = model if isinstance(model, list | tuple) else [model]
        margs = get_args()
        if optimizer is not None or not getattr(margs, "skip_train", False):
            check_odc_wrapped(chunks, getattr(margs, "dp_backend", None))
        scaled = getattr(margs, "use_torch_fsdp2", False) and scale_torch_fsdp2_gradients(chunks)
        if scaled and getattr(margs, "calculate_per_token_loss", False):
            info_once(
                logger,
                "--use-torch-fsdp2 with --calculate-per-token-loss: megatron-core's "
                "TorchFullyShardedDataParallel leaves scale_gradients a no-op; its chunks now "
                "divide the gradients by the global token count as its DDP does",
            )
        return result

    setup_model_and_optimizer.__megatron_odc_original__ = original
    return setup_model_and_optimizer


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
