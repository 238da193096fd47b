"""``python -m megatron_odc.simulate``: the command line of the step-time simulator.

Owns the flags (:func:`build_parser`) and the dispatch (:func:`main`) over five modes: a length
pool (``--profile`` / ``--lengths``) through the model of :mod:`megatron_odc.tools.simulator`, the
paper's tables (``--paper``) and its multi-node cells with hybrid ODC (``--paper-multinode``, both
:mod:`megatron_odc.tools.paper`), the pipeline-parallel speedups (``--pipeline-report``,
:mod:`megatron_odc.tools.pipeline_report`) and a CPU benchmark file (``--benchmark-json``,
:mod:`megatron_odc.tools.calibration`). A flag the chosen mode does not read is refused, not
ignored (:data:`_UNREAD_BY_MODE`). See docs/benchmarks.md. Example::

    python -m megatron_odc.simulate --profile longalign --dp 8 --minibatch 4 --model 1.5b
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from megatron_odc.tools.calibration import (
    benchmark_report,
    calibrate_from_benchmark,
    format_benchmark_report,
    load_benchmark_file,
    model_from_benchmark,
)
from megatron_odc.tools.cli_args import (
    cap_tokens,
    draw_options,
    explicit_cost_model,
    lengths_from_args,
    non_negative_float,
    positive_float,
    positive_int,
)
from megatron_odc.tools.paper import (
    format_multinode_report,
    format_paper_report,
    multinode_report,
    paper_report,
)
from megatron_odc.tools.pipeline_report import format_pipeline_report, pipeline_report
from megatron_odc.tools.presets import MODEL_PRESETS
from megatron_odc.tools.simulator import (
    A100_ROCE,
    HYBRID_ROWS,
    PIPELINE_ROWS,
    ROWS,
    Hardware,
    ModelSpec,
    format_rows,
    simulate,
)

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """Returns the command-line parser."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_odc.simulate",
        description=(
            "Predicted step time, bubble rate and speedup of lockstep FSDP and ODC per plan."
        ),
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--profile", help="length profile name (e.g. longalign)")
    mode.add_argument("--lengths", help="file with one length per line, or a JSON list")
    mode.add_argument(
        "--paper", action="store_true", help="the paper's settings next to its Tables 5 and 6"
    )
    mode.add_argument(
        "--paper-multinode",
        action="store_true",
        help="Table 5's 14B/16-GPU and 32B/32-GPU cells with full-shard and hybrid ODC (~20 s)",
    )
    mode.add_argument(
        "--pipeline-report",
        action="store_true",
        help="32B at PP=1/2/4 on 32 and 64 GPUs: ODC+LB-Mini vs FSDP+LB-Micro (a few minutes)",
    )
    mode.add_argument(
        "--benchmark-json",
        help="compare with a benchmarks/imbalance.py --out file (CPU calibration)",
    )
    parser.add_argument("--profiles-file", help="profile JSON (default: see megatron_odc.balance)")
    parser.add_argument(
        "--dp", type=int, default=8, help="DP size (replicas with --pipeline-stages), up to 1024"
    )
    parser.add_argument(
        "--pipeline-stages",
        type=int,
        default=1,
        help="pipeline stages per DP replica (1F1B); --minibatch is then samples per replica",
    )
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="add hybrid ODC rows (sharded over each node, one inter-node all-reduce per minibatch)",
    )
    parser.add_argument("--minibatch", type=int, default=4, help="samples per rank per minibatch")
    parser.add_argument("--cap", type=int, default=65536, help="tokens per microbatch; 0 = no cap")
    parser.add_argument("--num-minibatches", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="1.5b")
    parser.add_argument(
        "--cost-a", type=non_negative_float, help="quadratic cost coefficient (with --cost-b)"
    )
    parser.add_argument(
        "--cost-b", type=non_negative_float, help="linear cost coefficient (with --cost-a)"
    )
    parser.add_argument("--num-layers", type=positive_int, help="layers (with --cost-a/--cost-b)")
    parser.add_argument(
        "--layer-param-nbytes",
        type=positive_float,
        help="parameter bytes per layer (with --cost-a/b)",
    )
    parser.add_argument(
        "--layer-grad-nbytes",
        type=positive_float,
        help="gradient bytes per layer (with --cost-a/b; default 2x params)",
    )
    parser.add_argument("--flops-per-s", type=positive_float, default=A100_ROCE.flops_per_s)
    parser.add_argument("--intra-gbps", type=positive_float, default=A100_ROCE.intra_node_gbps)
    parser.add_argument("--inter-gbps", type=positive_float, default=A100_ROCE.inter_node_gbps)
    parser.add_argument("--gpus-per-node", type=positive_int, default=A100_ROCE.gpus_per_node)
    parser.add_argument("--latency-s", type=non_negative_float, default=A100_ROCE.latency_s)
    parser.add_argument(
        "--collective-latency-s",
        type=non_negative_float,
        help="fixed time per collective (default --latency-s)",
    )
    parser.add_argument("--microbatch-overhead-s", type=non_negative_float, default=0.0)
    parser.add_argument(
        "--no-overlap", action="store_true", help="communication adds to compute (CPU ranks)"
    )
    parser.add_argument("--json", action="store_true", help="write JSON instead of tables")
    return parser


_LAYER_FLAGS = ("--num-layers", "--layer-param-nbytes", "--layer-grad-nbytes")
_SIZE_FLAGS = ("--dp", "--pipeline-stages", "--hybrid", "--minibatch")
_MODEL_FLAGS = ("--model", "--cost-a", "--cost-b", *_LAYER_FLAGS)
_HARDWARE_FLAGS = (
    "--flops-per-s",
    "--intra-gbps",
    "--inter-gbps",
    "--gpus-per-node",
    "--latency-s",
    "--collective-latency-s",
    "--no-overlap",
)
_REPORT_SETTINGS = "which runs the paper's own models, GPU counts and minibatches"
# The flags each mode does not read, and why: given, they are refused rather than ignored.
_UNREAD_BY_MODE = {
    "--paper": (_SIZE_FLAGS + _MODEL_FLAGS, _REPORT_SETTINGS),
    "--paper-multinode": (_SIZE_FLAGS + _MODEL_FLAGS, _REPORT_SETTINGS),
    "--pipeline-report": (_SIZE_FLAGS + _MODEL_FLAGS, _REPORT_SETTINGS),
    "--benchmark-json": (
        (*_SIZE_FLAGS, "--model", "--cap", "--num-minibatches", "--seed", "--profiles-file"),
        "which replays the file's own sizes, lengths and model",
    ),
}


def _given_flags(argv: Sequence[str] | None) -> list[str]:
    """The flags written on the command line (abbreviations resolved), in the parser's order."""
    probe = build_parser()
    for action in probe._actions:  # argparse has no public "was this given" query
        action.default = argparse.SUPPRESS
    given = vars(probe.parse_args(argv))
    return [a.option_strings[0] for a in probe._actions if a.option_strings and a.dest in given]


def _check_unread_flags(args: argparse.Namespace, given: Sequence[str]) -> None:
    """Refuses a flag that the chosen mode would silently not read.

    Raises:
        ValueError: naming the flags, the mode and why it does not read them.
    """
    mode = next((flag for flag in given if flag in _UNREAD_BY_MODE), None)
    checks = []
    if mode is not None:
        checks.append((*_UNREAD_BY_MODE[mode], mode))
    if args.cost_a is not None or args.cost_b is not None:
        checks.append((("--model",), "where --cost-a/--cost-b give the model", None))
    elif mode == "--benchmark-json":
        checks.append(
            (
                _HARDWARE_FLAGS,
                "which calibrates the hardware from the file unless --cost-a/--cost-b give the model",
                mode,
            )
        )
    for flags, why, owner in checks:
        unread = [flag for flag in given if flag in flags]
        if unread:
            verb, pronoun = ("is", "it") if len(unread) == 1 else ("are", "them")
            where = f" with {owner}," if owner else ""
            raise ValueError(f"{' and '.join(unread)} {verb} not used{where} {why}; drop {pronoun}")


def _check_layer_flags(args: argparse.Namespace) -> None:
    """Refuses the layer flags without an explicit cost model.

    They are not overrides of a ``--model`` preset (nor of a benchmark file's own model): a
    preset's FLOP cost model and bytes per layer both follow from its layer count, so changing one
    alone would describe no real model. They complete ``--cost-a``/``--cost-b`` instead.

    Raises:
        ValueError: a layer flag is given without ``--cost-a`` and ``--cost-b``.
    """
    given = [flag for flag in _LAYER_FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None]
    if given and args.cost_a is None and args.cost_b is None:
        verb, pronoun = ("is", "it") if len(given) == 1 else ("are", "them")
        default = "the benchmark file's model" if args.benchmark_json else "the --model preset"
        raise ValueError(
            f"{' and '.join(given)} {verb} only used with --cost-a and --cost-b (an explicit "
            "model, with --num-layers and --layer-param-nbytes); add those, or drop "
            f"{pronoun} to use {default}"
        )


def _model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The ``--model`` preset, or the model given by ``--cost-a/--cost-b`` and the layer flags.

    Raises:
        ValueError: the explicit model's flags are incomplete, or given without it.
    """
    _check_layer_flags(args)
    cost = explicit_cost_model(args)
    if cost is None:
        return ModelSpec.from_preset(args.model)
    if args.num_layers is None or args.layer_param_nbytes is None:
        raise ValueError("--cost-a/--cost-b need --num-layers and --layer-param-nbytes")
    grad = args.layer_grad_nbytes
    return ModelSpec(
        num_layers=args.num_layers,
        param_nbytes_per_layer=args.layer_param_nbytes,
        grad_nbytes_per_layer=2 * args.layer_param_nbytes if grad is None else grad,
        cost=cost,
    )


def _benchmark_result(args: argparse.Namespace, hw: Hardware) -> dict:
    """``--benchmark-json``: predicted vs measured cells, calibrated from the file unless
    ``--cost-a/--cost-b`` give the model (then ``hw`` comes from the hardware flags).

    Raises:
        ValueError: the file is not a ``benchmarks/imbalance.py --out`` file, or a flag is bad.
    """
    _check_layer_flags(args)
    try:
        if args.cost_a is None:  # calibrate everything from the file itself
            data = load_benchmark_file(args.benchmark_json)
            hw = calibrate_from_benchmark(data, microbatch_overhead_s=args.microbatch_overhead_s)
            bench_model = model_from_benchmark(data)
        else:
            bench_model = _model_from_args(args)
        cells = benchmark_report(args.benchmark_json, hw=hw, model=bench_model)
    except KeyError as err:  # a field deeper than the top-level keys load_benchmark_file checks
        raise ValueError(
            f"{args.benchmark_json}: no key {err} where a benchmarks/imbalance.py --out file has "
            "one; pass such a file"
        ) from None
    return {"hardware": dataclasses.asdict(hw), "cells": cells}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the tool; returns the exit code (2 on a usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_unread_flags(args, _given_flags(argv))
        hw = Hardware(
            flops_per_s=args.flops_per_s,
            intra_node_gbps=args.intra_gbps,
            inter_node_gbps=args.inter_gbps,
            gpus_per_node=args.gpus_per_node,
            latency_s=args.latency_s,
            microbatch_overhead_s=args.microbatch_overhead_s,
            collective_latency_s=args.collective_latency_s,
            overlap=not args.no_overlap,
        )
        cap_tokens(args)  # rejects a negative --cap in every mode
        if args.paper_multinode or args.pipeline_report:
            make_report, render = (
                (multinode_report, format_multinode_report)
                if args.paper_multinode
                else (pipeline_report, format_pipeline_report)
            )
            result = make_report(
                hw=hw,
                num_minibatches=args.num_minibatches,
                seed=args.seed,
                cap_tokens=args.cap,
                profiles_file=args.profiles_file,
            )
            text = render(result)
        elif args.paper:
            report = paper_report(
                hw=hw,
                num_minibatches=args.num_minibatches,
                seed=args.seed,
                cap_tokens=args.cap,
                profiles_file=args.profiles_file,
            )
            text = format_paper_report(report)
            result: object = report
        elif args.benchmark_json:
            result = _benchmark_result(args, hw)
            text = format_benchmark_report(result)
        else:
            if args.profile is None and args.lengths is None:
                raise ValueError("give --profile, --lengths, --paper or --benchmark-json")
            lengths = lengths_from_args(args)
            model = _model_from_args(args)
            if args.pipeline_stages > 1:
                table = PIPELINE_ROWS + (HYBRID_ROWS[3:] if args.hybrid else ())
            else:
                table = ROWS + (HYBRID_ROWS[3:] if args.hybrid else ())
            rows = simulate(
                lengths,
                model=model,
                hw=hw,
                rows=table,
                pipeline_stages=args.pipeline_stages,
                **draw_options(args),
            )
            result = rows
            text = format_rows(
                rows,
                f"dp={args.dp} pp={args.pipeline_stages} minibatch/rank={args.minibatch} "
                f"cap={args.cap} "
                f"minibatches={args.num_minibatches} seed={args.seed} layers={model.num_layers} "
                f"cost a={model.cost.a:.4g} b={model.cost.b:.4g}",
            )
    except ValueError as err:
        parser.error(str(err))
    sys.stdout.write(json.dumps(result, indent=1) + "\n" if args.json else text)
    return 0
