"""The simulator's command line: a lengths file through every flag of an explicit model, as JSON."""

from __future__ import annotations

import json

import pytest

from megatron_odc.tools.simulate import main
from tests.tools._cli import cli_error


def test_cli_json_on_a_lengths_file(tmp_path, capsys) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(str(n) for n in [1000, 200, 3000, 50, 700, 2500, 90, 4000] * 4))
    code = main(
        [
            "--lengths",
            str(path),
            "--dp",
            "2",
            "--minibatch",
            "4",
            "--cap",
            "4096",
            "--num-minibatches",
            "3",
            "--cost-a",
            "0",
            "--cost-b",
            "1",
            "--num-layers",
            "2",
            "--layer-param-nbytes",
            "1",
            "--flops-per-s",
            "1",
            "--intra-gbps",
            "1e9",
            "--inter-gbps",
            "1e9",
            "--latency-s",
            "0",
            "--json",
        ]
    )
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {f"{r['schedule']}+{r['plan']}": r for r in rows}
    # Token cost, no communication: each step is the plan's time in tokens, at most a rank's 4
    # samples.
    for row in rows:
        assert len(row["step_times_s"]) == 3
        assert all(t <= 4 * 4000 for t in row["step_times_s"])
    assert by_name["fsdp+lb_micro"]["speedup"] == 1.0
    with pytest.raises(SystemExit):
        main(["--lengths", str(path), "--cost-a", "1"])


def test_cli_pipeline_stages_and_hybrid_rows(tmp_path, capsys) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(str(n) for n in [1000, 200, 3000, 50, 700, 2500, 90, 4000] * 4))
    common = ["--lengths", str(path), "--minibatch", "4", "--cap", "4096", "--num-minibatches", "2"]
    common += ["--model", "1.5b", "--json"]
    assert main([*common, "--dp", "2", "--pipeline-stages", "2", "--hybrid"]) == 0
    names = [f"{r['schedule']}+{r['plan']}" for r in json.loads(capsys.readouterr().out)]
    assert names == [
        "fsdp+lb_micro",
        "odc+lb_micro",
        "odc+lb_mini",
        "odc_hybrid+lb_micro",
        "odc_hybrid+lb_mini",
    ]
    # 16 ranks on nodes of 8, no pipelines: the hybrid rows follow the usual ones.
    assert main([*common, "--dp", "16", "--minibatch", "1", "--hybrid"]) == 0
    names = [f"{r['schedule']}+{r['plan']}" for r in json.loads(capsys.readouterr().out)]
    assert names[-2:] == ["odc_hybrid+lb_micro", "odc_hybrid+lb_mini"]
    with pytest.raises(SystemExit):
        main([*common, "--pipeline-stages", "0"])


def test_cli_refuses_bad_model_and_hardware_flags_naming_them(tmp_path, capsys) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(str(n) for n in [1000, 200, 3000, 50] * 2))
    run = ["--lengths", str(path), "--dp", "2", "--minibatch", "2", "--num-minibatches", "2"]
    explicit = [*run, "--cost-a", "1", "--cost-b", "1"]
    for flag, value, bound in (
        ("--num-layers", "-3", "an integer >= 1"),
        ("--num-layers", "0", "an integer >= 1"),
        ("--layer-param-nbytes", "-10", "a finite number > 0"),
        ("--layer-grad-nbytes", "0", "a finite number > 0"),
        ("--flops-per-s", "inf", "a finite number > 0"),
        ("--intra-gbps", "nan", "a finite number > 0"),
        ("--latency-s", "-1", "a finite number >= 0"),
        ("--cost-a", "nan", "a finite number >= 0"),
        ("--cost-b", "-1", "a finite number >= 0"),
    ):
        argv = [*explicit, "--num-layers", "2", "--layer-param-nbytes", "1", flag, value]
        line = cli_error(capsys, main, argv)
        assert line.endswith(f"error: argument {flag}: must be {bound}, got '{value}'")
    # The layer flags complete an explicit model; with the preset they would be ignored.
    line = cli_error(capsys, main, [*run, "--num-layers", "3"])
    assert line.endswith(
        "error: --num-layers is only used with --cost-a and --cost-b (an explicit model, with "
        "--num-layers and --layer-param-nbytes); add those, or drop it to use the --model preset"
    )
    assert main([*explicit, "--num-layers", "3", "--layer-param-nbytes", "10", "--json"]) == 0
    assert all(r["time_s"] > 0 for r in json.loads(capsys.readouterr().out))


def test_cli_names_a_bad_benchmark_file(tmp_path, capsys) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text("{}\n{}\n")
    line = cli_error(capsys, main, ["--benchmark-json", str(bench)])
    assert line.endswith(
        f"error: {bench}:2: not valid JSON (Extra data, line 2 column 1); "
        "pass a benchmarks/imbalance.py --out file"
    )
    bench.write_text("{}")
    assert f"error: {bench}: no top-level ['meta', 'results', 'rows']" in cli_error(
        capsys, main, ["--benchmark-json", str(bench)]
    )
    bench.write_text(json.dumps({"meta": {}, "results": [], "rows": []}))
    assert f"error: {bench}: no key 'settings'" in cli_error(
        capsys, main, ["--benchmark-json", str(bench)]
    )
    missing = tmp_path / "missing.json"
    assert f"error: benchmark file {missing}: No such file or directory" in cli_error(
        capsys, main, ["--benchmark-json", str(missing)]
    )
    assert "--layer-grad-nbytes is only used with --cost-a and --cost-b" in cli_error(
        capsys, main, ["--benchmark-json", str(bench), "--layer-grad-nbytes", "4"]
    )


def test_cli_refuses_flags_the_mode_does_not_read(tmp_path, capsys) -> None:
    # The report modes run the paper's own settings, a benchmark file replays its own: a size or
    # model flag there would be ignored, so it is refused naming the flags and the mode.
    line = cli_error(capsys, main, ["--paper", "--dp", "16", "--model", "7b"])
    assert line.endswith(
        "error: --dp and --model are not used with --paper, which runs the paper's own models, "
        "GPU counts and minibatches; drop them"
    )
    line = cli_error(capsys, main, ["--pipeline-report", "--cost-a", "1", "--cost-b", "1"])
    assert "error: --cost-a and --cost-b are not used with --pipeline-report," in line
    # Abbreviations are resolved as argparse resolves them.
    line = cli_error(capsys, main, ["--paper-multinode", "--mini", "2"])
    assert "error: --minibatch is not used with --paper-multinode," in line
    bench = tmp_path / "bench.json"
    bench.write_text("{}")
    line = cli_error(capsys, main, ["--benchmark-json", str(bench), "--seed", "3"])
    assert line.endswith(
        "error: --seed is not used with --benchmark-json, which replays the file's own sizes, "
        "lengths and model; drop it"
    )
    line = cli_error(capsys, main, ["--benchmark-json", str(bench), "--flops-per-s", "1e12"])
    assert line.endswith(
        "error: --flops-per-s is not used with --benchmark-json, which calibrates the hardware "
        "from the file unless --cost-a/--cost-b give the model; drop it"
    )
    # An explicit cost model replaces the preset in every mode.
    path = tmp_path / "lengths.txt"
    path.write_text("1000\n200\n")
    argv = ["--lengths", str(path), "--cost-a", "1", "--cost-b", "1", "--model", "1.5b"]
    line = cli_error(capsys, main, argv)
    assert line.endswith(
        "error: --model is not used where --cost-a/--cost-b give the model; drop it"
    )
