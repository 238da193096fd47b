"""GPU check of the CUDA path, in one call on one GPU (H200: 76 s measured; installs nothing itself).

Runs, each in its own spawned world of processes that share ``cuda:0`` (gloo process group through a file
store, ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``), with a deadline per check:

==================  ======================================================================================
check               what it runs and what passes
==================  ======================================================================================
correctness w=2/4   ``CudaSymmTransport`` in both accumulate modes (atomic, deterministic): whole-bucket
                    gather (bf16 and fp32) equals every rank's shard; a partial get at an offset; every rank
                    accumulating integer-valued fp32 and bf16 sources into every owner at once, 3 times
                    (exact sums: a lost update shows); random fp32 sums against a float64 oracle, and in
                    deterministic mode bitwise equal across two repeats; read-only buffers refuse
                    accumulates; 4 buckets through ``OverlapSchedule`` on CUDA streams
nvshmem w=2         ``NvshmemTransport`` (PyTorch symmetric memory, NVSHMEM backend) through the same round
                    as the correctness check, with ``remote_peers="all"`` (every peer through the NVSHMEM
                    get / put Triton kernels and the bounce buffers, as across nodes) and ``"auto"`` (the
                    peer by load / store); exact and bitwise repeatable staged sums. SKIP, with the reason,
                    where PyTorch has no NVSHMEM or Triton / NVSHMEM's device library is missing
bandwidth w=2       rank 0 alone (rank 1 idle): get from the peer vs a device-to-device ``copy_``, and
                    accumulate (atomic, and deterministic) into the peer vs a local ``add_``; payload GB/s,
                    median of ``--repeats``; targets: get >= 0.8x copy, atomic accumulate >= 0.5x add_
parity w=2          a bf16 megatron-core GPT (local spec) trained 3 steps with microbatch counts 1 and 3:
                    ODC over the CUDA transport (fetch / push on side streams, prefetch on) in atomic and
                    deterministic mode against megatron-core DDP, with DDP's optimizer kernel: losses and
                    every parameter within bf16 tolerance; deterministic mode bitwise equal across two
                    runs; ODC's own fused Adam: losses and the whole model within bf16 tolerance
fp8 emulated w=2    ``EmulatedFloat8Tensor`` MLP weights (FP8 bytes sharded, fetched, re-quantised with a
                    DP-wide amax) trained by ODC on the GPU against ``tests/mcore/test_fp8_params.py``'s
                    one-process oracle, run on the GPU too
te fp8 w=2          if TransformerEngine imports: TE-spec GPT with ``fp8=hybrid`` (tensorwise), 3 steps:
                    DDP with bf16 parameters, ODC with bf16 parameters, ODC with FP8 parameters
                    (``fp8_param``, TE's ``Float8Tensor``); finite losses within 5% of DDP's. Otherwise SKIP
==================  ======================================================================================

megatron-core is not on the GPU image: ``benchmarks/gpu_check.sh`` installs it from wheels carried in
``.whl/`` (``docs/benchmarks.md`` says how to fetch them) and runs this script. The report ends with one
short table (check, result, numbers). ``--json PATH`` also writes every number. ``--dry-run`` (CPU) checks
imports, argument parsing and that the rank functions pickle, lists the checks and exits 0.

``--cpu-rehearsal`` runs the same checks, rank bodies and judgements on CPU, so the harness is known to
work before a GPU's minutes are spent on it: megatron-core's CPU patches, ``tests/_fake_cuda.py``'s host
memory as symmetric memory (the transport's own code runs unchanged), the deterministic accumulate mode
only (the atomic one's Triton kernel needs a GPU; the parity check puts the shm transport in its place),
a small bandwidth shard whose numbers are reported but not judged. Its table says "CPU rehearsal (not a
GPU result)". Usage: ``python benchmarks/gpu_check.py [--cpu-rehearsal] [--size-mib 256] [--repeats 5]
[--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout: benchmarks.gpu_check_lib
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.gpu_check_lib.checks import CHECKS  # noqa: E402
from benchmarks.gpu_check_lib.report import dry_run, megatron_core_version, table  # noqa: E402
from benchmarks.gpu_check_lib.world import rehearsing, set_rehearsal  # noqa: E402

logger = logging.getLogger("gpu_check")

REHEARSAL_SIZE_MIB = 8


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="check imports and arguments; run nothing"
    )
    parser.add_argument(
        "--cpu-rehearsal",
        action="store_true",
        help="run the checks on CPU (host memory as symmetric memory, no Triton): the harness itself",
    )
    parser.add_argument(
        "--size-mib",
        type=int,
        default=None,
        help=f"shard size of the bandwidth check (default 256; {REHEARSAL_SIZE_MIB} in a rehearsal)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per operation")
    parser.add_argument("--timeout-s", type=float, default=150.0, help="deadline of one check")
    parser.add_argument(
        "--budget-s", type=float, default=450.0, help="skip checks that start later"
    )
    parser.add_argument(
        "--only", nargs="+", choices=sorted(CHECKS), metavar="CHECK", help="run only these checks"
    )
    parser.add_argument(
        "--fence-via",
        choices=("symm_mem", "process_group"),
        default="symm_mem",
        help="fence of the transport checks: symm-mem barrier kernel or a host barrier",
    )
    parser.add_argument("--json", type=Path, help="also write every number to this file")
    args = parser.parse_args(argv)
    if args.size_mib is None:
        args.size_mib = REHEARSAL_SIZE_MIB if args.cpu_rehearsal else 256
    if args.size_mib < 1 or args.repeats < 1 or args.timeout_s <= 0:
        parser.error("--size-mib, --repeats and --timeout-s must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the checks; print the table last; exit 0 only if every check passed."""
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.dry_run:
        return dry_run(args)
    set_rehearsal(args.cpu_rehearsal)
    if not rehearsing() and not torch.cuda.is_available():
        sys.stdout.write(
            "no CUDA device: nothing to check (use --dry-run or --cpu-rehearsal on CPU)\n"
        )
        return 2
    start = time.monotonic()
    rows, numbers = [], {}
    for name in args.only or list(CHECKS):
        if time.monotonic() - start > args.budget_s:
            rows.append((name, "NOT RUN", f"time budget {args.budget_s:.0f} s spent"))
            continue
        logger.info("running %s", name)
        t0 = time.monotonic()
        try:
            ok, detail, extra = CHECKS[name](args)
        except Exception as exc:  # report and go on with the next check
            ok, detail, extra = False, f"{type(exc).__name__}: {str(exc)[:300]}", {}
            logger.error("%s failed:\n%s", name, exc)
        numbers[name] = {"ok": ok, "detail": detail, "seconds": time.monotonic() - t0}
        with contextlib.suppress(TypeError, ValueError):
            json.dumps(extra)
            numbers[name]["extra"] = extra
        result = ("SKIP" if extra.get("skipped") else "PASS") if ok else "FAIL"
        rows.append((name, result, f"{detail} [{time.monotonic() - t0:.0f} s]"))
    if args.json:
        args.json.write_text(json.dumps(numbers, indent=2, default=str))
    where = "CPU rehearsal (not a GPU result)" if rehearsing() else torch.cuda.get_device_name(0)
    header = (
        f"gpu_check: torch {torch.__version__}, megatron-core {megatron_core_version()}, {where}, "
        f"{time.monotonic() - start:.0f} s\n"
    )
    sys.stdout.write(header + table(rows))
    return 0 if all(r[1] in ("PASS", "SKIP") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
