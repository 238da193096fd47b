"""Megatron-LM's own ``pretrain_gpt.py --sft`` through the launcher, DP=2 on CPU: what ODC's balancing
buys a Megatron-LM user, rows paired in one run.

Needs ``MEGATRON_LM_PATH`` (a Megatron-LM tree of a supported tag) and the ``[megatron-lm]`` extra.
The data is made at run time (``megatron_odc/integration/megatron_lm/sft_example.py``): a word-level
tokenizer and a chat JSONL whose lengths follow a shipped profile (``--profile``, default ``longalign``)
scaled so that its longest sample is ``--seq-length`` tokens, or repeat ``--lengths-pattern``. Rows (``--rows``):

==================  =========================================================================================
row                 what runs
==================  =========================================================================================
``stock_ddp``       ``--dp-backend ddp``: Megatron-LM's own sampler, one record per microbatch padded to
                    ``--seq-length`` (what a user runs today; with ``--calculate-per-token-loss`` so that its
                    losses are comparable, which does not change its work)
``ddp_lb_micro``    ``--dp-backend ddp --balance lb_micro``: the plugin's packing of real lengths, the same
                    count on every rank (LB-Micro); Megatron-LM's DDP syncs once per step
``odc_lb_mini``     ``--dp-backend odc`` (LB-Mini): the same packing, each rank its own count
``odc_lb_mini_``    ``--dp-backend odc --odc-unsharded-budget all``: LB-Mini with every unit kept unsharded
``kept``            for the step (one fetch and one push per unit per step, not per microbatch; still less
                    memory than DDP, whose optimizer state is replicated)
``fsdp_lb_micro``   ``--dp-backend fsdp --balance lb_micro``: the plugin's lockstep ZeRO-3 (the same sharding
                    as ODC, per-layer all-gathers and reduce-scatters every microbatch) on the same
                    packing with equal counts: the equal-memory peer without padding
``odc_lb_micro``    ``--dp-backend odc --balance lb_micro``: ODC on the equal-count plan (its compute
                    imbalance against LB-Mini's, in ODC's log line)
``odc_lb_mini_``    ``--dp-backend odc --balance-cost measured``: LB-Mini planned with the cost model timed
``measured``        at start-up on this machine, a fixed cost per microbatch included
``fsdp2``           ``--use-torch-fsdp2`` (Megatron-LM's ZeRO-3 peer, at ODC's memory: parameters, gradients
                    and optimizer state sharded over DP), Megatron-LM's sampler (``--use-torch-fsdp2`` takes
                    no ``--dp-backend``, so not the packing), per-token loss like ``stock_ddp`` (the
                    launcher supplies the gradient scaling megatron-core's wrapper lacks). Runs on CPU with
                    ``core_v0.19.0``; the launcher refuses it with earlier tags, whose megatron-core
                    wrapper fails at the first step on every device: the row reports that line
==================  =========================================================================================

Each round runs every row once, in order, on the same data (``--rounds`` rounds: paired under the
machine's load). A row's step time is the median of Megatron-LM's ``elapsed time per iteration`` over
the iterations after ``--warmup``; tokens/s counts real tokens (the records' lengths, not padding).
The cost model's prediction for the same global batches (``CostModel.from_model_config`` of the model;
DP ranks wait for the slowest at every step under every backend, so a step costs its busiest rank):
stock = ``gbs/dp`` padded records per rank, LB-Micro's and LB-Mini's busiest rank of their plans, and
each plan's bubble (``Plan.bubble_odc``). Prints one line per row and a summary with the ratios.

``python benchmarks/megatron_lm_sft.py [--rounds 2] [--iters 10] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_odc.balance.cost import CostModel  # noqa: E402
from megatron_odc.balance.plan import make_plan  # noqa: E402
from megatron_odc.integration.megatron_lm.sft_example import (  # noqa: E402
    ROLE_WORDS,
    SPECIAL_TOKENS,
    WORDS,
    write_chats,
    write_chats_of_lengths,
    write_tokenizer,
)

ROWS = {
    "stock_ddp": ("--dp-backend", "ddp", "--calculate-per-token-loss"),
    "ddp_lb_micro": ("--dp-backend", "ddp", "--balance", "lb_micro"),
    "odc_lb_mini": ("--dp-backend", "odc", "--balance", "lb_mini"),
    "odc_lb_mini_kept": (
        "--dp-backend",
        "odc",
        "--balance",
        "lb_mini",
        "--odc-unsharded-budget",
        "all",
    ),
    "fsdp_lb_micro": ("--dp-backend", "fsdp", "--balance", "lb_micro"),
    "odc_lb_micro": ("--dp-backend", "odc", "--balance", "lb_micro"),
    "odc_lb_mini_measured": (
        "--dp-backend",
        "odc",
        "--balance",
        "lb_mini",
        "--balance-cost",
        "measured",
    ),
    "fsdp2": (
        "--use-torch-fsdp2",
        "--untie-embeddings-and-output-weights",  # Megatron-LM asserts it with FSDP2
        "--calculate-per-token-loss",  # scaled by the launcher (integration/megatron_lm/torch_fsdp2.py)
    ),
}

_ITER_RE = re.compile(
    r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+).*?lm loss: ([0-9.E+-]+)"
)
_ODC_RE = re.compile(
    r"odc iteration\s+(\d+)/.*?num microbatches min/max: (\d+)/(\d+)"
    r"(?:.*?odc compute imbalance: ([0-9.]+)x)?"
)


def model_args(args: argparse.Namespace, data: Path) -> list[str]:
    return [
        *shlex.split(
            f"--num-layers {args.layers} --hidden-size {args.hidden} --num-attention-heads "
            f"{args.heads} --seq-length {args.seq_length} --max-position-embeddings "
            f"{args.seq_length} --micro-batch-size 1 --global-batch-size {args.gbs} --train-iters "
            f"{args.iters} --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 1 "
            "--weight-decay 0.01 --clip-grad 1.0 --seed 1234 --split 100,0,0 --eval-iters 0 "
            "--eval-interval 100000 --log-interval 1 --hidden-dropout 0 --attention-dropout 0 "
            "--sft --tokenizer-type SFTTokenizer"
        ),
        "--data-path",
        str(data / "chats.jsonl"),
        "--tokenizer-model",
        str(data / "tokenizer"),
    ]


def run_row(name: str, args: argparse.Namespace, data: Path, out: Path, rnd: int) -> dict:
    # --standalone: torchrun binds a free port itself (one picked beforehand may be taken meanwhile)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "megatron_odc.launch", "pretrain_gpt.py"]
    cmd += [*model_args(args, data), *ROWS[name]]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "OMP_NUM_THREADS": str(args.threads),
    }
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=1800)
    log = proc.stdout + proc.stderr
    (out / f"{name}.round{rnd}.log").write_text(log)
    result: dict = {"row": name, "round": rnd, "wall_s": time.perf_counter() - started}
    steps = {int(i): (float(ms), float(loss)) for i, ms, loss in _ITER_RE.findall(log)}
    if proc.returncode != 0 or len(steps) < args.iters:
        errors = [
            ln.strip()
            for ln in log.splitlines()
            if re.search(r"\w*(Error|Exception)\b:", ln) and "ChildFailedError" not in ln
        ]
        result["error"] = (errors or log.splitlines() or ["(no output)"])[0][:300]
        return result
    kept = [ms for i, (ms, _) in sorted(steps.items()) if i > args.warmup]
    result["step_ms"] = statistics.median(kept)
    result["losses"] = [steps[i][1] for i in sorted(steps)]
    odc = _ODC_RE.findall(log)
    if odc:
        result["counts"] = [(int(lo), int(hi)) for _, lo, hi, _ in odc]
        imbalance = [float(x) for *_, x in odc if x]
        if imbalance:
            result["imbalance_median"] = statistics.median(imbalance[args.warmup :] or imbalance)
    return result


def predicted(lengths: list[int], args: argparse.Namespace) -> dict:
    """The cost model's step costs of the run's global batches (busiest rank per step)."""
    # the example tokenizer's vocabulary, padded by Megatron-LM to a multiple of 128
    vocab = 128 * math.ceil((len(SPECIAL_TOKENS) + len(ROLE_WORDS) + WORDS) / 128)
    cost = CostModel.from_model_config(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=4 * args.hidden,
        num_attention_heads=args.heads,
        vocab_size=vocab,
    )
    stock = micro = mini = 0.0
    bubbles: dict[str, list[float]] = {"lb_micro": [], "lb_mini": []}
    for step in range(args.iters):
        batch = lengths[step * args.gbs : (step + 1) * args.gbs]
        ids = list(range(len(batch)))
        stock += args.gbs // 2 * cost.sample_cost(args.seq_length)
        for kind in bubbles:
            plan = make_plan(
                kind, ids, batch, 2, cap_tokens=args.seq_length, cost_model=cost, too_long="error"
            )
            busiest = max(plan.rank_costs())
            if kind == "lb_micro":
                micro += busiest
            else:
                mini += busiest
            bubbles[kind].append(plan.bubble_odc())
    return {
        "stock_over_lb_mini": stock / mini,
        "lb_micro_over_lb_mini": micro / mini,
        "bubble_lb_micro": statistics.mean(bubbles["lb_micro"]),
        "bubble_lb_mini": statistics.mean(bubbles["lb_mini"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--gbs", type=int, default=32)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--profile", default="longalign")
    parser.add_argument(
        "--lengths-pattern",
        default=None,
        help="comma-separated record lengths repeated instead of --profile's, e.g. a skewed global "
        "batch 280,280,280,200,200,200,200,40",
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    parser.add_argument("--out", type=Path, default=None, help="keep the logs and data here")
    args = parser.parse_args(argv)
    if not os.environ.get("MEGATRON_LM_PATH"):
        raise SystemExit("needs MEGATRON_LM_PATH: a Megatron-LM tree of a supported tag")
    out = args.out or Path(tempfile.mkdtemp(prefix="megatron_lm_sft_"))
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    data.mkdir(exist_ok=True)
    write_tokenizer(data / "tokenizer")
    if args.lengths_pattern:
        pattern = [int(n) for n in args.lengths_pattern.split(",")]
        count = args.iters * args.gbs
        lengths = write_chats_of_lengths(
            data / "chats.jsonl", (pattern * -(-count // len(pattern)))[:count]
        )
    else:
        lengths = write_chats(
            data / "chats.jsonl",
            args.iters * args.gbs,
            profile=args.profile,
            max_tokens=args.seq_length,
            seed=0,
        )
    print(f"load average before: {os.getloadavg()}", flush=True)
    results = []
    for rnd in range(args.rounds):
        for name in args.rows:
            result = run_row(name, args, data, out, rnd)
            results.append(result)
            print(json.dumps(result), flush=True)
    print(f"load average after: {os.getloadavg()}", flush=True)
    real_tokens = sum(lengths[args.warmup * args.gbs :]) / (args.iters - args.warmup)
    summary: dict = {"predicted": predicted(lengths, args), "rows": {}}
    for name in args.rows:
        ok = [r for r in results if r["row"] == name and "step_ms" in r]
        if not ok:
            summary["rows"][name] = {"error": next(r["error"] for r in results if r["row"] == name)}
            continue
        step_ms = statistics.median(r["step_ms"] for r in ok)
        row = {"step_ms": step_ms, "tokens_per_s": real_tokens / step_ms * 1000}
        row["losses"] = ok[0]["losses"]
        for key in ("imbalance_median",):
            if key in ok[0]:
                row[key] = statistics.median(r[key] for r in ok if key in r)
        if "counts" in ok[0]:
            row["counts_min_max"] = sorted(set(ok[0]["counts"]))
        summary["rows"][name] = row
    base = summary["rows"].get("odc_lb_mini", {})
    for name, row in summary["rows"].items():
        if "step_ms" in row and "step_ms" in base:
            paired = [
                a["step_ms"] / b["step_ms"]
                for a in results
                for b in results
                if a["row"] == name
                and b["row"] == "odc_lb_mini"
                and a["round"] == b["round"]
                and "step_ms" in a
                and "step_ms" in b
            ]
            row["speedup_of_odc_lb_mini_paired"] = statistics.median(paired)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
