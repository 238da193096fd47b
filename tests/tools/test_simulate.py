"""The simulator's command line: a lengths file through every flag of an explicit model, as JSON."""

from __future__ import annotations

import json

import pytest

from megatron_odc.tools.simulate import main


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
