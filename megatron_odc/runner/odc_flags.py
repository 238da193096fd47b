"""ODC's command-line flags and their rules, shared by the plugin entry and the Megatron-LM integration.

:func:`add_odc_arguments` adds ``--dp-backend``, ``--balance``, ``--max-tokens-per-microbatch`` and one
``--odc-*`` flag per ``ODCConfig`` field (built from the field: its type, choices and help), and
:func:`resolve_odc_args` fills what was left unset and refuses what does not combine, each rule written
here once:

[Note: balancing and backends]
``--balance`` defaults to ``lb_mini`` (ODC's minibatch-level balancing: ranks may run different numbers of
microbatches) for every backend except the lockstep ones (``fsdp``): they run every bucket operation as a
collective, so every rank must run the same number of microbatches; their default is ``lb_micro`` (equal
counts by construction), and a plan that gives unequal counts is refused, because the run would hang.
``ddp`` and ``distopt`` reduce gradients once per minibatch and accept every plan. ``fsdp`` always uses the
collective transport; the ``--odc-*`` options apply to ``odc`` and ``fsdp`` only.
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_odc.balance.plan import EQUAL_COUNT_PLAN_KINDS, PLAN_KINDS
from megatron_odc.mcore.config import (
    BACKENDS,
    LOCKSTEP_BACKENDS,
    LOCKSTEP_TRANSPORT,
    ODC_ENGINE_BACKENDS,
    ODCConfig,
)

MEGATRON_SAMPLER = "none"
"""``--balance`` value of the Megatron-LM integration that keeps Megatron-LM's own sampler."""


def odc_flag(field: dataclasses.Field) -> str:
    """The command-line flag of an ``ODCConfig`` field."""
    prefix = "--no-odc-" if field.default is True else "--odc-"
    return prefix + field.name.replace("_", "-")


def odc_flag_help(field: dataclasses.Field) -> str:
    """The ``--help`` text of an ``ODCConfig`` field's flag: what the option does and its default (a
    ``--no-odc-*`` switch turns off an option that is on by default)."""
    if isinstance(field.default, bool):
        state = "on by default; this flag turns it off" if field.default else "off by default"
        return f"{field.metadata['help']} ({state})"
    shown = field.metadata["default_help"] or field.default
    return f"{field.metadata['help']} (default {shown})"


def add_odc_arguments(
    parser: argparse.ArgumentParser,
    *,
    dp_backend_default: str | None,
    balance_choices: tuple[str, ...] = PLAN_KINDS,
) -> argparse._ArgumentGroup:
    """Add ODC's flags to ``parser`` in a group of their own; returns the group.

    Args:
        parser: the entry's parser.
        dp_backend_default: ``--dp-backend`` when not given (``None``: the entry decides).
        balance_choices: ``--balance`` choices (the Megatron-LM integration adds ``none``).
    """
    group = parser.add_argument_group("ODC")
    group.add_argument(
        "--dp-backend",
        choices=BACKENDS,
        default=dp_backend_default,
        help="data-parallel backend: odc, fsdp (the same sharded engine over lockstep all-gather / "
        "reduce-scatter: the ZeRO-3 baseline), megatron-core's ddp or distopt",
    )
    group.add_argument(
        "--balance",
        choices=balance_choices,
        default=None,
        help="how a minibatch is split over DP ranks and packed into microbatches (default lb_mini; "
        "lb_micro for fsdp, which needs equal microbatch counts and refuses the others)",
    )
    group.add_argument(
        "--max-tokens-per-microbatch",
        type=int,
        default=None,
        help="token cap of one packed microbatch (default --seq-length)",
    )
    for field in dataclasses.fields(ODCConfig):
        help_text = odc_flag_help(field)
        dest = f"odc_{field.name}"
        if isinstance(field.default, bool):  # a switch: --odc-<field>, or --no-odc-<field> if on
            group.add_argument(
                odc_flag(field),
                action="store_false" if field.default else "store_true",
                dest=dest,
                default=None,
                help=help_text,
            )
        else:
            group.add_argument(
                odc_flag(field),
                dest=dest,
                type=type(field.default),
                choices=field.metadata["choices"],
                default=None,
                help=help_text,
            )
    return group


def default_balance(backend: str) -> str:
    """The plan kind a backend runs when ``--balance`` is not given."""
    return EQUAL_COUNT_PLAN_KINDS[0] if backend in LOCKSTEP_BACKENDS else "lb_mini"


def resolve_odc_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill ``balance`` and ``odc_transport`` where unset and refuse what does not combine.

    See [Note: balancing and backends]. ``args.dp_backend`` must be set.

    Raises:
        ValueError: naming the flag.
    """
    backend = args.dp_backend
    if args.balance is None:
        args.balance = default_balance(backend)
    if backend in LOCKSTEP_BACKENDS and args.balance not in (
        *EQUAL_COUNT_PLAN_KINDS,
        MEGATRON_SAMPLER,
    ):
        raise ValueError(
            f"--balance {args.balance} gives DP ranks different numbers of microbatches, which "
            f"--dp-backend {backend} (lockstep collectives) cannot run; use --balance "
            f"{' or '.join(EQUAL_COUNT_PLAN_KINDS)} or --dp-backend odc"
        )
    if backend not in ODC_ENGINE_BACKENDS:
        given = [
            odc_flag(f)
            for f in dataclasses.fields(ODCConfig)
            if getattr(args, f"odc_{f.name}", None) is not None
        ]
        if given:
            raise ValueError(f"{given[0]} applies to --dp-backend odc / fsdp, not {backend}")
        return args
    if backend in LOCKSTEP_BACKENDS:
        if args.odc_transport not in (None, LOCKSTEP_TRANSPORT):
            raise ValueError(
                f"--odc-transport {args.odc_transport} does not apply to --dp-backend {backend}, "
                f"which always uses the {LOCKSTEP_TRANSPORT} transport"
            )
        args.odc_transport = LOCKSTEP_TRANSPORT
    elif args.odc_transport is None:
        args.odc_transport = ODCConfig().transport
    ODCConfig.from_args(args)  # refuse bad values before anything is built
    return args
