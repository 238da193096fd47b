"""megatron-core's optimizer configuration and learning-rate schedule, from Megatron-LM-named arguments.

:func:`optimizer_config` copies every ``OptimizerConfig`` field an argument namespace carries under
the same name (what Megatron-LM does), so the entry writes no field list of its own;
:func:`scheduler` builds ``OptimizerParamScheduler`` counted in samples, as Megatron-LM does.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_odc.mcore.model import params_dtype


def optimizer_config(args: argparse.Namespace, **overrides: Any) -> OptimizerConfig:
    """``OptimizerConfig`` from every same-named attribute of ``args``, then ``overrides``.

    ``params_dtype`` follows ``--bf16`` / ``--fp16`` unless overridden.
    """
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(OptimizerConfig)
        if f.init and hasattr(args, f.name)
    }
    values["params_dtype"] = params_dtype(
        bf16=bool(values.get("bf16")), fp16=bool(values.get("fp16"))
    )
    return OptimizerConfig(**{**values, **overrides})


def scheduler(args: argparse.Namespace, optimizer: Any) -> OptimizerParamScheduler:
    """Megatron's scheduler over ``optimizer``, in samples (iterations * ``--global-batch-size``).

    Reads ``lr``, ``min_lr``, ``lr_warmup_init``, ``lr_warmup_iters``, ``lr_decay_iters``,
    ``lr_decay_style``, ``weight_decay``, ``train_iters`` and ``global_batch_size``.
    """
    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
