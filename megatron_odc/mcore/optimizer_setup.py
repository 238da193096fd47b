"""megatron-core's optimizer configuration and learning-rate schedule, from Megatron-LM-named arguments.

:func:`optimizer_config` copies every ``OptimizerConfig`` field an argument namespace carries under
the same name (what Megatron-LM does), so the entry writes no field list of its own;
:func:`scheduler` builds ``OptimizerParamScheduler`` counted in samples, as Megatron-LM does, and
:func:`schedule_differences` names what a resumed checkpoint's schedule changes (Megatron-LM refuses a
resume whose schedule differs unless ``--override-opt_param-scheduler`` or
``--use-checkpoint-opt_param-scheduler`` says which one wins).
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
    ``lr_decay_style``, ``weight_decay``, ``train_iters`` and ``global_batch_size``, and which schedule
    wins on a resume (``override_opt_param_scheduler``, ``use_checkpoint_opt_param_scheduler``;
    neither: they must agree, see :func:`schedule_differences`).
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
        use_checkpoint_opt_param_scheduler=getattr(
            args, "use_checkpoint_opt_param_scheduler", False
        ),
        override_opt_param_scheduler=getattr(args, "override_opt_param_scheduler", False),
    )


SCHEDULE_SETTINGS: dict[str, str] = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters (in samples)",
    "lr_decay_steps": "--lr-decay-iters, default --train-iters (in samples)",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay",
    "end_wd": "--weight-decay",
    "wd_incr_steps": "--train-iters (weight-decay increment, in samples)",
}
"""``OptimizerParamScheduler.state_dict`` key -> the flag it comes from: what its ``load_state_dict``
checks against the checkpoint."""


def schedule_differences(scheduler: OptimizerParamScheduler, saved: dict[str, Any]) -> list[str]:
    """Each setting of ``scheduler`` that differs from the checkpoint's ``saved`` scheduler state, as
    ``"<flag>: <this run's> (checkpoint: <saved>)"``.

    The weight-decay increment length is left out while weight decay is constant on both sides
    (``start_wd == end_wd``): it changes nothing there, and a longer ``--train-iters`` changes it.
    """
    current = scheduler.state_dict()
    constant_wd = all(state.get("start_wd") == state.get("end_wd") for state in (current, saved))
    differences = []
    for key, flag in SCHEDULE_SETTINGS.items():
        if key == "wd_incr_steps" and constant_wd:
            continue
        if key in saved and saved[key] != current[key]:
            text = f"{flag}: {current[key]} (checkpoint: {saved[key]})"
            if text not in differences:
                differences.append(text)
    return differences


def group_lr_bounds(optimizer: Any) -> list[tuple[Any, Any]]:
    """Each param group's ``max_lr`` / ``min_lr``: megatron-core's scheduler reads the peak and floor
    from the groups first, and an optimizer load restores the checkpoint's (so a resume that lets the
    flags' schedule win must put this run's back: :func:`set_group_lr_bounds`)."""
    return [(group.get("max_lr"), group.get("min_lr")) for group in optimizer.param_groups]


def set_group_lr_bounds(optimizer: Any, bounds: list[tuple[Any, Any]]) -> None:
    """Put back what :func:`group_lr_bounds` returned (a group without a bound keeps its own)."""
    for group, (max_lr, min_lr) in zip(optimizer.param_groups, bounds, strict=True):
        for key, value in (("max_lr", max_lr), ("min_lr", min_lr)):
            if value is not None:
                group[key] = value
