"""``python -m megatron_odc.hf export CKPT OUT --hf-config HF_DIR``: a checkpoint as a Hugging Face model.

Writes the latest checkpoint of a ``--save`` directory as a Hugging Face model directory (safetensors,
config.json and the tokenizer of ``--hf-config``), in one CPU process. Training writes one itself with
``--save-hf``; see docs/hf.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_odc.integration.cpu import cpu_runtime
from megatron_odc.runner.hf_export import export_checkpoint


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m megatron_odc.hf``."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_odc.hf",
        description="Hugging Face models out of megatron_odc checkpoints (in: train --load-hf).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "export", help="write the latest checkpoint of a --save directory as an HF model directory"
    )
    export.add_argument("checkpoint", help="the --save directory of a run")
    export.add_argument("out", help="the Hugging Face model directory to write")
    export.add_argument(
        "--hf-config",
        required=True,
        metavar="HF_DIR",
        help="the Hugging Face model the run started from (--load-hf): its config and tokenizer",
    )
    export.add_argument("--bf16", action="store_true", help="write bf16 weights (default fp32)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (2 with a one-line message for a user error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with cpu_runtime():
            iteration, out = export_checkpoint(
                args.checkpoint, args.out, args.hf_config, bf16=args.bf16
            )
    except ValueError as exc:
        sys.stderr.write(f"{parser.prog}: error: {exc}\n")
        return 2
    print(f"exported iteration {iteration} of {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
