"""Plans: invariants of every kind over random inputs, bubble oracles, determinism, the offline tool."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest

from megatron_odc.balance import __main__ as tool
from megatron_odc.balance.cost import CostModel
from megatron_odc.balance.partition import balanced_partition, first_fit_decreasing
from megatron_odc.balance.plan import BALANCE_TOLERANCE, PLAN_KINDS, Plan, make_plan
from megatron_odc.balance.profiles import PROFILES_ENV, default_profiles_path, load_lengths_file

QUAD = CostModel(a=1.0, b=2000.0)


def _random_batch(rng, num_samples, max_length):
    # distinct, unordered, non-contiguous ids
    ids = rng.sample(range(10 * num_samples + 10), num_samples)
    lengths = [rng.randint(1, max_length) for _ in range(num_samples)]
    return ids, lengths


def _check_plan(plan, ids, lengths, cap, too_long):
    assert sorted(plan.sample_ids()) == sorted(ids), "every sample exactly once"
    expected = {
        s: (min(n, cap) if cap and too_long == "truncate" else n)
        for s, n in zip(ids, lengths, strict=True)
    }
    assert dict(plan.lengths) == expected
    for mbs in plan.microbatches:
        for mb in mbs:
            assert list(mb) == sorted(mb, key=ids.index)
            tokens = sum(plan.lengths[s] for s in mb)
            if cap is not None and tokens > cap:
                assert too_long == "alone", (mb, tokens, cap)
                assert len(mb) == 1, (mb, tokens, cap)
        costs = [sum(QUAD.sample_cost(plan.lengths[s]) for s in mb) for mb in mbs]
        if plan.kind != "lb_micro":  # lb_micro orders by rounds; the others heaviest first
            assert costs == sorted(costs, reverse=True)
    if plan.kind == "lb_micro":
        assert len(set(plan.num_microbatches())) == 1
        num_slots = plan.num_microbatches()[0] * plan.dp_size
        num_empty = sum(1 for mbs in plan.microbatches for mb in mbs if not mb)
        assert num_empty == 0 or len(ids) < num_slots
    elif plan.kind != "local_sort":
        assert all(mb for mbs in plan.microbatches for mb in mbs), "no empty microbatch"


@pytest.mark.parametrize("kind", PLAN_KINDS)
def test_random_plans_keep_invariants(kind):
    rng = random.Random(hash(kind) % 1000)
    for case in range(60):
        num_samples = rng.randint(0, 40)
        dp_size = rng.choice([1, 2, 3, 4, 8, 16, 64])  # includes N > #samples
        cap = rng.choice([None, 1000, 3000, 10000])
        too_long = rng.choice(["truncate", "alone"]) if cap else "error"
        ids, lengths = _random_batch(rng, num_samples, 2 * (cap or 5000) if case % 2 else 900)
        plan = make_plan(
            kind, ids, lengths, dp_size, cap_tokens=cap, cost_model=QUAD, too_long=too_long
        )
        assert (plan.kind, plan.dp_size) == (kind, dp_size)
        _check_plan(plan, ids, lengths, cap, too_long)
        assert plan == make_plan(
            kind, ids, lengths, dp_size, cap_tokens=cap, cost_model=QUAD, too_long=too_long
        )


def test_lb_mini_matches_balanced_partition_and_ffd_counts():
    rng = random.Random(2)
    for _ in range(30):
        ids, lengths = _random_batch(rng, rng.randint(1, 40), 3000)
        dp_size, cap = rng.choice([2, 4, 8]), 4000
        plan = make_plan("lb_mini", ids, lengths, dp_size, cap_tokens=cap, cost_model=QUAD)
        costs = QUAD.costs(lengths)
        parts = balanced_partition(costs, dp_size, rel_tol=BALANCE_TOLERANCE)
        expected = sorted(math.fsum(costs[i] for i in p) for p in parts)
        assert sorted(plan.rank_costs()) == pytest.approx(expected, rel=1e-12)
        for r in range(dp_size):
            rank_lengths = [plan.lengths[s] for mb in plan.rank_microbatches(r) for s in mb]
            assert plan.num_microbatches()[r] == len(first_fit_decreasing(rank_lengths, cap))


def test_lb_mini_counts_a_microbatch_overhead_without_pipelines():
    # One long sample against many short ones of the same total cost: without the overhead the
    # short ones' rank pays it once per microbatch on top of its share; with it, LB-Mini moves work.
    lengths = [1000] + [100] * 8 + [60] * 6
    ids = list(range(len(lengths)))
    cost = CostModel(a=0.0, b=1.0)
    overhead = 150.0

    def slowest(plan):
        return max(
            c + overhead * n
            for c, n in zip(plan.rank_costs(), plan.num_microbatches(), strict=True)
        )

    args = {"cap_tokens": 200, "cost_model": cost, "too_long": "alone"}
    plain = make_plan("lb_mini", ids, lengths, 2, **args)
    aware = make_plan("lb_mini", ids, lengths, 2, **args, microbatch_overhead=overhead)
    _check_plan(aware, ids, lengths, 200, "alone")
    assert slowest(aware) < slowest(plain) * 0.95, (plain.microbatches, aware.microbatches)
    # With no overhead the option changes nothing.
    again = make_plan("lb_mini", ids, lengths, 2, **args, microbatch_overhead=0.0)
    assert again.microbatches == plain.microbatches


def test_lb_micro_count_bounds_and_round_order():
    rng = random.Random(3)
    for _ in range(30):
        ids, lengths = _random_batch(rng, rng.randint(1, 40), 3000)
        dp_size, cap = rng.choice([2, 4, 8]), 4000
        plan = make_plan("lb_micro", ids, lengths, dp_size, cap_tokens=cap, cost_model=QUAD)
        num = plan.num_microbatches()[0]
        assert math.ceil(math.ceil(sum(lengths) / cap) / dp_size) <= num
        assert num <= math.ceil(len(first_fit_decreasing(lengths, cap)) / dp_size)
        # Round i holds microbatches no lighter than any microbatch of round i + 1.
        per_index = [[plan.microbatch_costs(r)[i] for r in range(dp_size)] for i in range(num)]
        for i in range(num - 1):
            assert min(per_index[i]) >= max(per_index[i + 1])


def test_baseline_assignments():
    ids = [10, 11, 12, 13, 14, 15, 16]
    lengths = [5, 9, 1, 7, 3, 8, 2]
    sort = make_plan("local_sort", ids, lengths, 3, cap_tokens=None, cost_model=QUAD)
    # contiguous slices of 3, 2, 2 samples, each sorted by length descending
    assert sort.microbatches == (((11,), (10,), (12,)), ((13,), (14,)), ((15,), (16,)))
    rr = make_plan("round_robin", ids, lengths, 3, cap_tokens=10, cost_model=QUAD)
    # rank 0: 10(5), 13(7), 16(2) -> first fit: [10, 16], [13]; rank 1: 11(9), 14(3) -> [11], [14]
    assert rr.microbatches == (((13,), (10, 16)), ((11,), (14,)), ((12, 15),))


def _lockstep_by_simulation(plan):
    """Event simulation of a barrier after every microbatch index (independent of Plan's formula)."""
    clock, busy = 0.0, [0.0] * plan.dp_size
    depth = max(plan.num_microbatches())
    for i in range(depth):
        finish = []
        for r in range(plan.dp_size):
            cost = plan.microbatch_costs(r)[i] if i < plan.num_microbatches()[r] else 0.0
            busy[r] += cost
            finish.append(clock + cost)
        clock = max(finish)  # barrier
    return sum(clock - b for b in busy) / (plan.dp_size * clock)


def test_bubble_definitions():
    tokens = CostModel.tokens()
    plan = Plan("lb_mini", 2, None, (((0,), (1,)), ((2,),)), {0: 3, 1: 1, 2: 2}, tokens)
    # lockstep: index 0 takes max(3, 2) = 3, index 1 takes 1 -> 4; idle = 0 + 2 -> 2 / 8
    assert plan.bubble_lockstep() == pytest.approx(0.25)
    # odc: max total 4; idle = 0 + 2 -> 2 / 8
    assert plan.bubble_odc() == pytest.approx(0.25)
    plan = Plan("lb_micro", 2, None, (((0,), (1,)), ((2,), (3,))), {0: 3, 1: 1, 2: 1, 3: 3}, tokens)
    assert plan.bubble_odc() == 0.0
    assert plan.bubble_lockstep() == pytest.approx(((6 - 4) + (6 - 4)) / 12)
    rng = random.Random(4)
    for _ in range(40):
        ids, lengths = _random_batch(rng, rng.randint(1, 30), 3000)
        for kind in PLAN_KINDS:
            p = make_plan(
                kind, ids, lengths, rng.choice([2, 3, 8]), cap_tokens=5000, cost_model=QUAD
            )
            assert p.bubble_lockstep() == pytest.approx(_lockstep_by_simulation(p), abs=1e-12)
            totals = p.rank_costs()
            assert p.bubble_odc() == pytest.approx(1 - sum(totals) / (len(totals) * max(totals)))
            assert p.bubble_odc() <= p.bubble_lockstep() + 1e-12
            m = p.metrics()
            assert sum(m["tokens_per_rank"]) == sum(lengths)
            assert sum(m["sum_sq_tokens_per_rank"]) == sum(n * n for n in lengths)
            assert m["max_cost"] / m["mean_cost"] == pytest.approx(m["imbalance_ratio"])


def test_too_long_policies():
    ids, lengths = [7, 8, 9], [100, 50, 30]
    with pytest.raises(ValueError, match=r"sample 7 has length 100 > cap_tokens=80"):
        make_plan("lb_mini", ids, lengths, 2, cap_tokens=80, cost_model=QUAD)
    plan = make_plan(
        "lb_micro", ids, lengths, 2, cap_tokens=80, cost_model=QUAD, too_long="truncate"
    )
    assert plan.lengths[7] == 80
    plan = make_plan("lb_mini", ids, lengths, 1, cap_tokens=80, cost_model=QUAD, too_long="alone")
    assert (7,) in plan.rank_microbatches(0)
    assert plan.lengths[7] == 100


def test_argument_errors():
    with pytest.raises(ValueError, match="plan kind"):
        make_plan("nope", [1], [1], 1, cap_tokens=None, cost_model=QUAD)
    with pytest.raises(ValueError, match="sample id 3 appears more than once"):
        make_plan("lb_mini", [3, 3], [1, 1], 1, cap_tokens=None, cost_model=QUAD)
    with pytest.raises(ValueError, match="2 sample ids but 1 lengths"):
        make_plan("lb_mini", [1, 2], [1], 1, cap_tokens=None, cost_model=QUAD)
    with pytest.raises(ValueError, match="dp_size"):
        make_plan("lb_mini", [1], [1], 0, cap_tokens=None, cost_model=QUAD)
    with pytest.raises(ValueError, match="too_long"):
        make_plan("lb_mini", [1], [1], 1, cap_tokens=None, cost_model=QUAD, too_long="drop")
    plan = make_plan("lb_mini", [1], [1], 2, cap_tokens=None, cost_model=QUAD)
    with pytest.raises(ValueError, match="dp_rank=2"):
        plan.rank_microbatches(2)


def test_plan_is_identical_in_another_process():
    rng = random.Random(9)
    ids, lengths = _random_batch(rng, 37, 9000)
    code = (
        "import json, sys\n"
        "from megatron_odc.balance import CostModel, make_plan, PLAN_KINDS\n"
        "ids, lengths = json.loads(sys.argv[1])\n"
        "out = [make_plan(k, ids, lengths, 5, cap_tokens=10000, cost_model=CostModel(1.0, 2000.0),"
        " too_long='alone').microbatches for k in PLAN_KINDS]\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps([ids, lengths])],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    )
    assert result.returncode == 0, result.stderr
    here = [
        make_plan(
            k, ids, lengths, 5, cap_tokens=10000, cost_model=QUAD, too_long="alone"
        ).microbatches
        for k in PLAN_KINDS
    ]
    assert json.loads(result.stdout) == json.loads(json.dumps(here))


def test_tool_longalign_table6_setting(monkeypatch, capsys):
    monkeypatch.delenv(PROFILES_ENV, raising=False)  # the profiles shipped in the package
    argv = [
        "--profile",
        "longalign",
        "--dp",
        "8",
        "--minibatch",
        "4",
        "--cap",
        "65536",
        "--model",
        "1.5b",
        "--json",
        "--num-minibatches",
        "32",
    ]
    assert tool.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {(r["schedule"], r["plan"]): r for r in result["rows"]}
    micro = rows[("collective", "lb_micro")]["bubble"]
    mini = rows[("odc", "lb_mini")]["bubble"]
    sort = rows[("collective", "local_sort")]["bubble"]
    assert 0.15 < micro < 0.55, micro  # paper Table 6: 35.3%
    assert 0.03 < mini < 0.30, mini  # paper Table 6: 14.8%
    assert mini < micro < sort
    assert rows[("collective", "lb_micro")]["microbatches_per_rank"]["min"] >= 1
    assert tool.main([*argv[:-3], "--num-minibatches", "2"]) == 0
    table = capsys.readouterr().out
    assert "collective+lb_micro" in table
    assert "odc+lb_mini" in table


def test_tool_lengths_files_and_profile_overrides(tmp_path, capsys, monkeypatch):
    text = tmp_path / "lengths.txt"
    text.write_text("\n".join(str(n) for n in [100, 2000, 50, 7000, 300, 10, 4000, 90]) + "\n\n")
    as_json = tmp_path / "lengths.json"
    as_json.write_text(json.dumps([100, 2000, 50, 7000, 300, 10, 4000, 90]))
    assert load_lengths_file(text) == load_lengths_file(as_json)
    argv = [
        "--dp",
        "2",
        "--minibatch",
        "2",
        "--cap",
        "8000",
        "--num-minibatches",
        "2",
        "--json",
        "--cost-a",
        "1",
        "--cost-b",
        "0",
    ]
    assert tool.main(["--lengths", str(text), *argv]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["config"]["cost_model"] == {"a": 1.0, "b": 0.0}
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({"tiny": {"lengths": load_lengths_file(text)}}))
    assert tool.main(["--profile", "tiny", "--profiles-file", str(profiles), *argv]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == first["rows"]
    monkeypatch.setenv(PROFILES_ENV, str(profiles))
    assert default_profiles_path() == profiles
    assert tool.main(["--profile", "tiny", *argv]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == first["rows"]
    with pytest.raises(SystemExit):
        tool.main(["--profile", "tiny", "--dp", "2", "--minibatch", "2", "--num-minibatches", "3"])
    assert "needs 12 samples" in capsys.readouterr().err
