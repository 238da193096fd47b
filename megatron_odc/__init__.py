"""megatron-odc: an ODC (on-demand communication) data-parallel backend for megatron-core.

Glossary, used the same way in every module:

- minibatch: the samples of one optimizer step, over all DP ranks.
- microbatch: one forward/backward pass of one rank; ranks may run different numbers of them.
- unit: the parameters fetched and released together (a transformer layer, or the root unit).
- fetch: a rank pulls the parameter shards of a bucket from their owners (one-sided get).
- push: a rank adds its gradient slices into the owners' fp32 accumulators (one-sided accumulate).
- fence: the DP-wide point where every rank's earlier operations are complete and visible.

One layer per folder; imports point down only (``tests/test_layering.py`` holds the rule)::

    integration/  megatron-core CPU runtime, Megatron-LM patches, the launcher
    runner/       the plugin's training entry: flags, trainer, data pipeline, checkpoints, log
    mcore/        the megatron-core adapter: DP wrapper, optimizer, dist checkpoints, backends
    core/         the ODC engine: layout, states, storage, fetch / push, hooks, FP8 (no megatron)
    transport/    one-sided memory between ranks: shm, cuda, collective
    tools/        offline planners' command lines and the simulator (-> balance)
    data/ balance/  SFT data and length-balancing plans (pure)

The entry points ``python -m megatron_odc.train``, ``.launch``, ``.simulate`` and ``.balance`` are the
modules of this folder (and ``balance/__main__.py``). The names below are importable from the package
itself (loaded on first use, so ``import megatron_odc`` stays light).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_PUBLIC = {
    "ODCConfig": "megatron_odc.mcore.config",
    "ODCDataParallel": "megatron_odc.mcore.data_parallel",
    "ODCOptimizer": "megatron_odc.mcore.optimizer",
    "build_backend": "megatron_odc.mcore.backends",
    "train_step": "megatron_odc.mcore.step",
    "GPTConfig": "megatron_odc.mcore.model",
    "build_gpt_model": "megatron_odc.mcore.model",
    "emulate_fp8_weights": "megatron_odc.mcore.fp8_te",
    "LengthBalancedSampler": "megatron_odc.data.sampler",
    "make_plan": "megatron_odc.balance.plan",
    "apply_cpu_patches": "megatron_odc.integration.cpu",
    "apply_megatron_lm_patches": "megatron_odc.integration.megatron_lm.patching",
}
"""Public name -> the module that defines it."""

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_odc' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
