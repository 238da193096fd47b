"""Plans are the same in every process (every rank plans alone), on inputs large enough to take the
planner's vectorised and pruned search paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_PLAN = """
import json, random, sys
from megatron_odc.balance import CostModel, make_plan
rng = random.Random(7)
lengths = [int(rng.lognormvariate(9.5, 0.6)) + 1 for _ in range(600)]
cost = CostModel(a=1.0, b=3.0e4)
out = {}
for kind in ("lb_mini", "lb_micro", "round_robin"):
    plan = make_plan(kind, list(range(600)), lengths, 80, cap_tokens=40000, cost_model=cost,
                     too_long="alone")
    out[kind] = [list(map(list, mbs)) for mbs in plan.microbatches]
for kind in ("lb_mini", "lb_micro"):  # pipeline-aware plans: 80 replicas of 3 stages
    plan = make_plan(kind, list(range(600)), lengths, 80, cap_tokens=40000, cost_model=cost,
                     too_long="alone", pipeline_stages=3)
    out[kind + "_pp3"] = [list(map(list, mbs)) for mbs in plan.microbatches]
json.dump({"plans": out, "lengths": lengths}, sys.stdout)
"""


def _plans(hash_seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run(
        [sys.executable, "-c", _PLAN], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def two_processes() -> tuple[dict, dict]:
    return _plans("1"), _plans("4242")


def test_plans_are_identical_across_processes(two_processes) -> None:
    first, second = two_processes
    assert first["plans"] == second["plans"]


@pytest.mark.parametrize(
    "kind", ["lb_mini", "lb_micro", "round_robin", "lb_mini_pp3", "lb_micro_pp3"]
)
def test_no_sample_lost_or_duplicated_and_cap_kept(two_processes, kind) -> None:
    result = two_processes[0]
    lengths, per_rank = result["lengths"], result["plans"][kind]
    assert len(per_rank) == 80
    ids = sorted(s for mbs in per_rank for mb in mbs for s in mb)
    assert ids == list(range(len(lengths)))
    oversize = {i for i, n in enumerate(lengths) if n > 40000}
    for mbs in per_rank:
        for mb in mbs:
            if len(mb) == 1 and mb[0] in oversize:
                continue  # too_long="alone": its own microbatch, over the cap
            assert not oversize & set(mb), mb
            assert sum(lengths[i] for i in mb) <= 40000, mb


def _benchmark(hash_seed: str) -> list[dict]:
    """benchmarks/planner.py at a small size, speed part only, targets not judged."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "planner.py"
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    argv = ["--sizes", "700x90,64x8", "--repeats", "1", "--no-bubbles", "--no-targets", "--json"]
    proc = subprocess.run(
        [sys.executable, str(script), *argv], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_planner_benchmark_small_size_gives_the_same_checked_plans_in_two_processes() -> None:
    # The benchmark checks each plan itself (coverage, cap) and fails the run otherwise; CI runs it small,
    # as a test of correctness, not of speed.
    first, second = _benchmark("3"), _benchmark("977")
    assert [(r["samples"], r["ranks"]) for r in first] == [(700, 90), (64, 8)]
    for a, b in zip(first, second, strict=True):
        assert (
            a["lb_micro_microbatches"] % a["ranks"] == 0
        )  # lb_micro: the same count on every rank
        for kind in ("lb_mini", "lb_micro"):
            assert a[f"{kind}_digest"] == b[f"{kind}_digest"]
            assert 0.0 <= a[f"{kind}_bubble"] < 1.0
