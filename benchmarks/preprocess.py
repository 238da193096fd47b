"""Preprocessing benchmark: tokenising a large SFT JSONL once, then starting training on it.

Steps, in a temporary directory (or ``--workdir``):

1. Writes ``--num-samples`` generated SFT samples (:func:`megatron_odc.data.make_synthetic_sft`, lengths of
   the LongAlign-like profile scaled so the longest is ``--max-tokens``; not timed) and a second file of
   ``--small-samples`` samples.
2. Preprocesses both with ``python -m megatron_odc.data.preprocess`` (``--workers``, byte tokenizer) as a
   subprocess and reports wall time, samples/s and MB/s of the large one.
3. For each dataset, in a fresh process: the start-up of a rank's data path (imports, megatron-core
   included as in training, then open the memory-mapped dataset, build the length-balanced sampler with its
   cost model, shuffle the epoch, plan and pack the first minibatch; both parts are reported) and
   its resident memory after 20 minibatches, split into anonymous memory (``RssAnon``: what the process
   allocated) and file-backed memory (``RssFile``: pages of the memory-mapped files and libraries, which
   the kernel can drop). The anonymous memory of the two datasets gives the per-sample cost.

Usage: ``python benchmarks/preprocess.py [--num-samples 1000000] [--json]``; with ``--json`` the last stdout
line is one JSON object. Targets (docs/data.md): >= 20,000 samples/s; the data path's start-up <= 5 s
(judged without the imports, which training pays whatever its data: megatron-core takes 2-5 s here).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_odc.data import make_synthetic_sft

logger = logging.getLogger(__name__)

TARGET_SAMPLES_PER_S = 20_000
TARGET_STARTUP_S = 5.0

_STARTUP = r"""
import json, sys, time
start = time.perf_counter()
from megatron_odc.balance import CostModel
from megatron_odc.data import IndexedSFTDataset, LengthBalancedSampler, load_tokenizer
from megatron_odc.runner.data_pipeline import pack_assignment
import megatron.core.datasets.indexed_dataset  # training has megatron.core loaded already

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
imported = time.perf_counter()
anon_imported = status("RssAnon")
prefix, seq_length = sys.argv[1], int(sys.argv[2])
tokenizer = load_tokenizer("byte")
dataset = IndexedSFTDataset(prefix, tokenizer, max_length=seq_length)
sampler = LengthBalancedSampler(
    dataset.lengths, global_batch_size=64, dp_size=8, dp_rank=0, seed=1234, plan_kind="lb_mini",
    cap_tokens=seq_length,
    cost_model=CostModel.from_model_config(num_layers=24, hidden_size=1024, ffn_hidden_size=4096,
                                           num_attention_heads=16, vocab_size=384, gated_mlp=False),
    too_long="truncate", shuffle=True, drop_last=True,
)
def batches(index):
    return pack_assignment(sampler.assignment(0, index), dataset, pad_id=tokenizer.pad_id,
                           seq_length=seq_length, pad_multiple=8)
batches(0)
ready = time.perf_counter()
for index in range(1, 20):
    batches(index)
print(json.dumps({
    "samples": len(dataset), "import_s": imported - start, "startup_s": ready - start,
    "data_path_s": ready - imported,
    "rss_anon_after_import_bytes": anon_imported, "rss_anon_bytes": status("RssAnon"),
    "rss_file_bytes": status("RssFile"),
}))
"""


def _preprocess(jsonl: Path, prefix: Path, workers: int) -> float:
    cmd = [sys.executable, "-m", "megatron_odc.data.preprocess", "--input", str(jsonl)]
    cmd += ["--output-prefix", str(prefix), "--workers", str(workers), "--no-progress"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def _startup(prefix: Path, seq_length: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _STARTUP, str(prefix), str(seq_length)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace, workdir: Path) -> dict:
    large, small = workdir / "large.jsonl", workdir / "small.jsonl"
    start = time.perf_counter()
    lengths = make_synthetic_sft(large, args.num_samples, seed=0, max_tokens=args.max_tokens)
    make_synthetic_sft(small, args.small_samples, seed=1, max_tokens=args.max_tokens)
    logger.info(
        "wrote %d samples (%.0f MB, mean %.0f tokens) in %.0f s",
        args.num_samples,
        large.stat().st_size / 1e6,
        sum(lengths) / len(lengths),
        time.perf_counter() - start,
    )
    seconds = _preprocess(large, workdir / "large", args.workers)
    _preprocess(small, workdir / "small", args.workers)
    result = {
        "num_samples": args.num_samples,
        "mean_tokens": sum(lengths) / len(lengths),
        "jsonl_mb": large.stat().st_size / 1e6,
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "preprocess_s": seconds,
        "samples_per_s": args.num_samples / seconds,
        "mb_per_s": large.stat().st_size / 1e6 / seconds,
        "startup": {
            "large": _startup(workdir / "large", args.max_tokens),
            "small": _startup(workdir / "small", args.max_tokens),
        },
    }
    big, little = result["startup"]["large"], result["startup"]["small"]
    result["rss_anon_bytes_per_sample"] = (big["rss_anon_bytes"] - little["rss_anon_bytes"]) / (
        big["samples"] - little["samples"]
    )
    result["meets_targets"] = (
        result["samples_per_s"] >= TARGET_SAMPLES_PER_S and big["data_path_s"] <= TARGET_STARTUP_S
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=1_000_000)
    parser.add_argument("--small-samples", type=int, default=100_000)
    parser.add_argument("--max-tokens", type=int, default=1024, help="longest generated sample")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="keep the files here (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        result = run(args, Path(args.workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="odc-preprocess-") as tmp:
            result = run(args, Path(tmp))
    big, little = result["startup"]["large"], result["startup"]["small"]
    logger.info(
        "preprocess: %d samples in %.1f s = %.0f samples/s (%.1f MB/s, %d workers, target >= %d)",
        result["num_samples"], result["preprocess_s"], result["samples_per_s"], result["mb_per_s"],
        result["workers"], TARGET_SAMPLES_PER_S,
    )  # fmt: skip
    for name, row in (("large", big), ("small", little)):
        logger.info(
            "start-up %s (%d samples): %.2f s = imports %.2f s + data path %.2f s (target <= %.0f s for the data path); "
            "RssAnon %.0f MB (%.0f MB after imports), RssFile %.0f MB",
            name, row["samples"], row["startup_s"], row["import_s"], row["data_path_s"], TARGET_STARTUP_S,
            row["rss_anon_bytes"] / 1e6, row["rss_anon_after_import_bytes"] / 1e6,
            row["rss_file_bytes"] / 1e6,
        )  # fmt: skip
    logger.info("anonymous memory per sample: %.1f bytes", result["rss_anon_bytes_per_sample"])
    if args.json:
        print(json.dumps(result))
    return 0 if result["meets_targets"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
