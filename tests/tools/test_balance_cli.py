"""The balance tool's comparison of every plan kind (its command line: tests/balance)."""

from __future__ import annotations

import random

import pytest

from megatron_odc.balance import CostModel
from megatron_odc.tools.balance_cli import ROWS, compare_plans, format_table, main
from tests.tools._cli import cli_error


def test_compare_plans_reports_every_row_and_its_config() -> None:
    rng = random.Random(3)
    pool = [rng.randint(100, 6000) for _ in range(200)]
    cost = CostModel(a=1e-4, b=1.0)
    result = compare_plans(
        pool, dp_size=4, minibatch=3, cap_tokens=8192, cost_model=cost, num_minibatches=4, seed=1
    )
    assert result["config"]["global_minibatch"] == 12
    assert result["config"]["cost_model"] == {"a": 1e-4, "b": 1.0}
    rows = {(r["schedule"], r["plan"]): r for r in result["rows"]}
    assert list(rows) == list(ROWS)
    for (schedule, kind), row in rows.items():
        assert 0.0 <= row["bubble"] < 1.0
        if schedule == "odc":  # one sync per minibatch never idles more than lockstep
            assert row["bubble"] <= rows[("collective", kind)]["bubble"] + 1e-12
    assert all(name in format_table(result) for name in ("collective+lb_micro_ref", "odc+lb_mini"))


def test_compare_plans_names_the_flags() -> None:
    with pytest.raises(ValueError, match="--dp, --minibatch and --num-minibatches"):
        compare_plans([1, 2], dp_size=0, minibatch=1, cap_tokens=None, cost_model=CostModel(1, 1))


def test_every_row_covers_the_same_minibatches_with_oversize_samples() -> None:
    # Samples over the cap (planned alone) used to make lb_micro_ref skip their minibatch, so its average was
    # over other minibatches than the other rows'. Every row now plans every minibatch: the same mean tokens.
    rng = random.Random(5)
    pool = [rng.randint(100, 6000) for _ in range(120)]
    pool[7] = pool[40] = 9000
    cost = CostModel(a=1e-4, b=1.0)
    result = compare_plans(
        pool,
        dp_size=3,
        minibatch=4,
        cap_tokens=8192,
        cost_model=cost,
        num_minibatches=10,
        seed=2,
        too_long="alone",
    )
    means = {(r["schedule"], r["plan"]): r["tokens_per_rank"]["mean"] for r in result["rows"]}
    assert len(means) == len(ROWS)
    assert max(means.values()) == pytest.approx(min(means.values()), rel=1e-12)


def test_cli_errors_name_the_flag_the_file_and_the_line(tmp_path, capsys) -> None:
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n200\n\n9000\n300\n")
    run = ["--lengths", str(lengths), "--dp", "2", "--minibatch", "2", "--num-minibatches", "1"]
    # A sample over the cap: the CLI flags, not make_plan's keyword, and the sample's item.
    line = cli_error(capsys, main, [*run, "--cap", "1000", "--seed", "0"])
    assert f"error: {lengths}: item " in line
    assert "has length 9000 > --cap 1000; pass --too-long truncate or --too-long alone" in line
    assert "too_long=" not in line
    assert main([*run, "--cap", "1000", "--too-long", "truncate"]) == 0
    capsys.readouterr()
    # Non-finite or negative cost coefficients are refused at parse time, naming the flag.
    for flag, value in (("--cost-a", "nan"), ("--cost-b", "-1"), ("--cost-a", "inf")):
        others = {"--cost-a": "1", "--cost-b": "1", flag: value}
        line = cli_error(capsys, main, [*run, *(x for kv in others.items() for x in kv)])
        assert line.endswith(f"error: argument {flag}: must be a finite number >= 0, got '{value}'")
    # Unparsable JSON: the file and the line.
    broken = tmp_path / "len.json"
    broken.write_text("[1,2,\n")
    line = cli_error(capsys, main, ["--lengths", str(broken), "--dp", "1", "--minibatch", "1"])
    assert line.endswith(
        f"error: {broken}:2: not valid JSON (Expecting value, line 2 column 1); "
        "expected a JSON list of lengths, or one integer per line"
    )
    # A negative length: the file, its line and the value.
    lengths.write_text("100\n\n-3\n")
    line = cli_error(capsys, main, ["--lengths", str(lengths), "--dp", "1", "--minibatch", "1"])
    assert line.endswith(
        f"error: {lengths}:3: length -3 is not allowed; lengths must be non-negative integers"
    )
