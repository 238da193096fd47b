"""``python -m megatron_odc.train``: the plugin's own training entry (run under torchrun, or under
``mpiexec``: ``runner/launch_env.py`` then sets torch's launch variables from MPI's).

Parses and checks the flags (``runner/arguments.py``: a bad flag exits with status 2 and a message
naming it, before anything is built), makes megatron-core run on CPU where there is no CUDA
(``integration/cpu.py``), trains (``runner/trainer.py``) and logs a summary. See the README.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
from collections.abc import Sequence

from megatron_odc.runner.known_warnings import filter_known_warnings

filter_known_warnings()  # before megatron-core is imported below: its import warns

import torch.distributed as dist  # noqa: E402

from megatron_odc.integration.cpu import cpu_runtime  # noqa: E402
from megatron_odc.runner.arguments import build_parser, validate_args  # noqa: E402
from megatron_odc.runner.errors import REPORT_ATTRIBUTE  # noqa: E402
from megatron_odc.runner.health import EXIT_PEER_FAILURE, PeerFailureError  # noqa: E402
from megatron_odc.runner.launch_env import (  # noqa: E402
    apply_launch_env,
    launch_local_rank,
    launched,
)
from megatron_odc.runner.trainer import TrainResult, train  # noqa: E402

logger = logging.getLogger("megatron_odc.train")

EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (SIGINT), as a shell reports it."""


def run(args: argparse.Namespace) -> TrainResult:
    """Train for validated ``args`` on this machine (the CPU runtime where there is no CUDA)."""
    with cpu_runtime():
        return train(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse and check ``argv`` (default ``sys.argv[1:]``), train, and log a summary.

    Returns:
        The exit status: 0 after training, 2 when a flag is invalid (the message, naming the flag,
        goes to stderr before anything is trained) or when a user error (a ``ValueError``: bad data,
        tokenizer, checkpoint, a non-finite loss) stops the run: one line on stderr, printed by rank 0,
        or by the only rank that found it, naming it (``runner/errors.py``); 3 when another rank died
        or stopped (one line naming it, ``runner/health.py``).
    """
    parser = build_parser()
    # Flag errors come before any process group: every rank finds the same one, so only the first
    # rank of each host prints it (once per job on one host; per host where files differ by host).
    reporter = launch_local_rank(os.environ) in (None, 0)
    with contextlib.ExitStack() as quiet:
        if not reporter:
            quiet.enter_context(contextlib.redirect_stderr(io.StringIO()))
            quiet.enter_context(contextlib.redirect_stdout(io.StringIO()))
        args = parser.parse_args(argv)

    def flag_error(message: str) -> int:
        if reporter:
            sys.stderr.write(f"{parser.prog}: error: {message}\n")
        return 2

    try:
        apply_launch_env(args.odc_transport)
    except ValueError as exc:
        return flag_error(str(exc))
    world_size = (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    )
    try:
        validate_args(args, world_size=world_size)
    except ValueError as exc:
        return flag_error(str(exc))
    if not dist.is_initialized() and not launched(os.environ):
        return flag_error(
            "started without a launcher (RANK is not set): run it under torchrun, e.g. torchrun "
            "--nproc-per-node 2 -m megatron_odc.train ..., or under mpiexec -n N"
        )
    try:
        result = run(args)
    except ValueError as exc:  # a user error (bad data, tokenizer, checkpoint): no traceback
        report = getattr(exc, REPORT_ATTRIBUTE, str(exc))
        if report is not None:
            sys.stderr.write(f"{parser.prog}: error: {report}\n")
        return 2
    except PeerFailureError as exc:
        # another rank died or stopped: this rank names it, no traceback
        sys.stderr.write(f"{parser.prog}: error: {exc}\n")
        return EXIT_PEER_FAILURE
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: one line per host, the shell's status
        if reporter:
            sys.stderr.write(f"{parser.prog}: interrupted\n")
        return EXIT_INTERRUPTED
    first = result.losses[min(result.losses)] if result.losses else None
    final = result.final_loss
    logger.info(  # rank 0 only: other ranks log warnings only
        "training finished | iterations %d-%d of %d | first lm loss: %s | final lm loss: %s | "
        "tokens: %d | elapsed: %.1f s",
        result.start_iteration,
        result.iteration,
        args.train_iters,
        f"{first:.6E}" if first is not None else "n/a",
        f"{final:.6E}" if final is not None else "n/a",
        result.num_tokens,
        result.elapsed_s,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
