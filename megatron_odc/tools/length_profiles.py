"""Writes the shipped length profiles (``megatron_odc/balance/length_profiles.json``), deterministically.

Each profile is a clipped log-normal whose mean and range match a published statistic (the source is named
in the profile). They are stand-ins for real corpora, not the corpora themselves: a benchmark that uses them
says so. Run ``python -m megatron_odc.tools.length_profiles [--output FILE]`` (seed 0, 4096 lengths each);
with no ``--output`` it rewrites the shipped file, byte for byte the same.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
from pathlib import Path

from megatron_odc.balance.profiles import SHIPPED_PROFILES_PATH

__all__ = ["PROFILES", "draw_profiles", "main", "write_profiles"]

logger = logging.getLogger(__name__)

PROFILES = {
    "longalign": {
        "median": 13800,
        "sigma": 0.62,
        "lo": 1024,
        "hi": 65536,
        "source": "LongAlign SFT: mean about 16.5K tokens, max 64K (ODC paper, sec. 5)",
    },
    "swe_smith": {
        "median": 34000,
        "sigma": 0.40,
        "lo": 4096,
        "hi": 65536,
        "source": "SWE-smith agent trajectories: mean about 34.7K tokens, max 64K (ODC paper, sec. 5)",
    },
    "rl_aime": {
        "median": 6000,
        "sigma": 0.80,
        "lo": 512,
        "hi": 25600,
        "source": "GRPO on AIME prompts, prompt plus response up to about 25K tokens (ODC paper, sec. 5)",
    },
    "short": {
        "median": 1550,
        "sigma": 0.70,
        "lo": 128,
        "hi": 8192,
        "source": "LongAlign truncated to 1/8: max 8K, mean about 2K (ODC paper, app. E)",
    },
    "uniform": {
        "median": 16384,
        "sigma": 0.0,
        "lo": 16384,
        "hi": 16384,
        "source": "balanced control: every sample 16K tokens",
    },
    "agent_rl": {
        "median": 6000,
        "sigma": 1.0,
        "lo": 512,
        "hi": 65536,
        "source": "agent / SWE-style RL rollouts (multi-turn, long tail up to 64K): a stand-in shaped "
        "after swe_smith's cap and a wider spread than rl_aime's; no published statistic",
    },
}
"""Profile name -> clipped log-normal parameters and the published statistic they imitate."""

COUNT = 4096
SEED = 0


def _draw(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    while True:
        length = round(median * math.exp(rng.gauss(0.0, sigma))) if sigma else median
        if lo <= length <= hi:
            return length


def draw_profiles(count: int = COUNT, seed: int = SEED) -> dict[str, dict]:
    """Returns ``{name: {"source", "model", "mean", "max", "min", "lengths"}}`` drawn from one seeded stream."""
    rng = random.Random(seed)
    out = {}
    for name, p in PROFILES.items():
        lengths = [_draw(rng, p["median"], p["sigma"], p["lo"], p["hi"]) for _ in range(count)]
        out[name] = {
            "source": p["source"],
            "model": f"log-normal(median={p['median']}, sigma={p['sigma']}) clipped to [{p['lo']}, {p['hi']}]",
            "mean": round(sum(lengths) / count, 1),
            "max": max(lengths),
            "min": min(lengths),
            "lengths": lengths,
        }
    return out


def write_profiles(path: str | Path) -> dict[str, dict]:
    """Writes :func:`draw_profiles` to ``path`` as JSON and returns it."""
    profiles = draw_profiles()
    Path(path).write_text(json.dumps(profiles))
    return profiles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_odc.tools.length_profiles", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--output", default=str(SHIPPED_PROFILES_PATH), help="file to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name, v in write_profiles(args.output).items():
        logger.info("%-10s mean=%8.1f min=%6d max=%6d", name, v["mean"], v["min"], v["max"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
