"""The command-line flags both offline CLIs share, and how their values are read.

Owns the meaning of ``--lengths`` / ``--profile`` / ``--profiles-file`` (:func:`lengths_from_args`),
``--cost-a`` / ``--cost-b`` (:func:`explicit_cost_model`), ``--cap`` (:func:`cap_tokens`) and the
minibatch-drawing flags ``--dp`` / ``--minibatch`` / ``--num-minibatches`` / ``--seed``
(:func:`draw_options`) for :mod:`megatron_odc.tools.balance_cli` and
:mod:`megatron_odc.tools.simulate`. Each CLI declares the flags itself (defaults and help differ);
the ``type=`` checkers :func:`positive_int`, :func:`positive_float` and :func:`non_negative_float`
refuse a bad number at parse time, where argparse names the flag.
"""

from __future__ import annotations

import argparse
import math

from megatron_odc.balance.cost import CostModel
from megatron_odc.balance.profiles import load_lengths_file, load_profile_lengths

__all__ = [
    "cap_tokens",
    "draw_options",
    "explicit_cost_model",
    "lengths_from_args",
    "non_negative_float",
    "positive_float",
    "positive_int",
]


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1 (argparse prefixes the error with the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _finite_float(text: str, bound: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a finite number {bound}, got {text!r}"
        ) from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite number > 0 (argparse prefixes the error with the flag)."""
    value = _finite_float(text, "> 0")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse ``type=``: a finite number >= 0 (argparse prefixes the error with the flag)."""
    value = _finite_float(text, ">= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def lengths_from_args(args: argparse.Namespace) -> list[int]:
    """The length pool: the ``--lengths`` file if given, else profile ``--profile``.

    Raises:
        ValueError: the file or the profile is missing or malformed.
    """
    if args.lengths is not None:
        return load_lengths_file(args.lengths)
    return load_profile_lengths(args.profile, args.profiles_file)


def explicit_cost_model(args: argparse.Namespace) -> CostModel | None:
    """The cost model ``a * s^2 + b * s`` given by ``--cost-a`` and ``--cost-b``, if given.

    Returns:
        The cost model, or ``None`` when neither flag is given (the caller uses ``--model``).

    Raises:
        ValueError: only one of the two flags is given.
    """
    if (args.cost_a is None) != (args.cost_b is None):
        raise ValueError("--cost-a and --cost-b go together")
    if args.cost_a is None:
        return None
    return CostModel(a=args.cost_a, b=args.cost_b)


def cap_tokens(args: argparse.Namespace) -> int | None:
    """The token cap per microbatch of ``--cap``: ``None`` (no cap) for 0.

    Raises:
        ValueError: ``--cap`` is negative.
    """
    if args.cap < 0:
        raise ValueError(f"--cap must be >= 0, got {args.cap}")
    return args.cap or None


def draw_options(args: argparse.Namespace) -> dict:
    """The minibatch-drawing keywords of ``compare_plans`` and ``simulate`` from the shared flags.

    Returns:
        ``dp_size``, ``minibatch``, ``cap_tokens``, ``num_minibatches`` and ``seed``.

    Raises:
        ValueError: ``--cap`` is negative.
    """
    return {
        "dp_size": args.dp,
        "minibatch": args.minibatch,
        "cap_tokens": cap_tokens(args),
        "num_minibatches": args.num_minibatches,
        "seed": args.seed,
    }
