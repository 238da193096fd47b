"""One clear error per job from ``python -m megatron_odc.train``, and no silent NaN.

Each case runs :func:`megatron_odc.train.main` on 2 spawned CPU ranks (``tests/_dist.py``) with a tiny
model and captures every rank's exit status, stdout (the log) and stderr:

- user errors found once the process group is up (bad data, tokenizer, checkpoint) print one line
  ``python -m megatron_odc.train: error: ...`` on rank 0 only, and every rank returns 2, with no traceback;
- a rank that alone finds a user error prints it itself, naming its rank, and the job ends;
- data whose responses are all truncated away by ``--seq-length`` is refused before iteration 1;
- a non-finite loss stops every rank at that iteration (``--check-for-nan-in-loss-and-grad``, on by
  default); ``--no-check-for-nan-in-loss-and-grad`` keeps training.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import warnings
from pathlib import Path

import pytest

from tests._dist import run_ranks

TINY = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
    "--seq-length", "64", "--global-batch-size", "4", "--train-iters", "3",
    "--log-interval", "1",
]  # fmt: skip
"""A model and run small enough that a 2-rank run takes a few seconds."""
PREFIX = "python -m megatron_odc.train: error: "


def _main_on_rank(rank: int, world_size: int, workdir: str, argv: list[str], patch: str | None):
    """Runs ``main(argv)`` on this rank; returns (exit status or the exception, stdout, stderr)."""
    del world_size
    os.chdir(workdir)
    warnings.simplefilter("ignore")  # megatron's import-time UserWarnings would fill stderr
    if patch is not None:
        globals()[patch](rank)
    from megatron_odc.train import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status: int | str = main(argv)
        except Exception as exc:  # a bug: the test names it
            status = f"raised {type(exc).__name__}: {exc}"
    return status, out.getvalue(), err.getvalue()


def _run(tmp_path: Path, argv: list[str], patch: str | None = None, timeout_s: float = 120):
    return run_ranks(_main_on_rank, 2, str(tmp_path), [*TINY, *argv], patch, timeout_s=timeout_s)


def _assert_one_error(results, *fragments: str) -> str:
    """Every rank returned 2; rank 0 alone printed one error line holding ``fragments``."""
    statuses = [r[0] for r in results]
    assert statuses == [2, 2], results
    line = results[0][2]
    assert line.startswith(PREFIX), line
    assert line.count("\n") == 1, line
    for fragment in fragments:
        assert fragment in line, line
    assert results[1][2] == "", results[1][2]
    assert "Traceback" not in results[0][2] + results[1][2]
    return line.removeprefix(PREFIX).strip()


def _write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# Task 2: user errors after the process group is up #


def test_malformed_json_line_is_one_error_naming_file_and_line(tmp_path):
    good = {"prompt": "what is two and two", "response": "four"}
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(good) + "\n" + '{"prompt": "x", "response": \n' + json.dumps(good))
    results = _run(tmp_path, ["--sft", "--data-path", str(data)])
    _assert_one_error(results, f"{data}:2", "invalid JSON", "--skip-bad-lines")


def test_missing_tokenizer_directory_is_one_error(tmp_path):
    missing = str(tmp_path / "no-such-tokenizer")
    results = _run(tmp_path, ["--tokenizer-model", missing])
    _assert_one_error(results, f"--tokenizer-model {missing!r} is not a directory")


def test_garbage_load_directory_is_one_error_naming_it(tmp_path):
    load = tmp_path / "garbage"
    load.mkdir()
    (load / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe\x00\x81garbage\xc3")
    (load / "iter_0000001").mkdir()
    (load / "iter_0000001" / "common.pt").write_bytes(os.urandom(64))
    results = _run(tmp_path, ["--load", str(load)])
    message = _assert_one_error(results, str(load), "latest_checkpointed_iteration.txt")
    assert "UnicodeDecodeError" not in message


def _fail_on_rank_1(rank: int) -> None:
    """Rank 1 alone finds a user error while loading its data; rank 0 goes on."""
    if rank != 1:
        return
    from megatron_odc.runner import data_pipeline

    def refuse(*args, **kwargs):
        raise ValueError("the data of this rank is bad; fix it")

    data_pipeline.DataPipeline.__init__ = refuse


def test_an_error_on_one_rank_ends_the_job_and_names_the_rank(tmp_path):
    results = _run(tmp_path, [], patch="_fail_on_rank_1")
    assert results[1][0] == 2, results
    assert results[1][2] == f"{PREFIX}rank 1: the data of this rank is bad; fix it\n", results[1]
    # Rank 0 was waiting for rank 1: it stops too (no hang), without a traceback or a second message.
    assert results[0][0] == 2, results
    assert "Traceback" not in results[0][2], results[0]
    assert "bad; fix it" not in results[0][2], results[0]


def test_save_pointing_at_a_file_is_refused_before_training(tmp_path):
    from megatron_odc.train import main

    target = tmp_path / "a-file"
    target.write_text("not a directory")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["--save", str(target)]) == 2
    assert err.getvalue().startswith(f"{PREFIX}--save "), err.getvalue()
    assert str(target) in err.getvalue()


LAUNCH_VARS = ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "PMI_RANK", "MPI_LOCALRANKID")


@pytest.mark.parametrize("argv", [["--train-iters", "0"], ["--dp-backend", "foo"]])
def test_a_flag_error_is_printed_by_the_first_rank_of_a_host_only(argv, monkeypatch, capsys):
    from megatron_odc.train import main

    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    printed = {}
    for local_rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse's own refusal
            status = exc.code
        printed[local_rank] = capsys.readouterr()
        assert status == 2
    assert printed["0"].err.count(PREFIX) == 1, printed["0"].err
    assert printed["1"].err == printed["1"].out == "", printed["1"]


def test_started_without_a_launcher_is_one_error(monkeypatch, capsys):
    from megatron_odc.train import main

    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{PREFIX}started without a launcher"), err
    assert "torchrun --nproc-per-node" in err


def test_ctrl_c_is_one_line_and_the_shell_status(monkeypatch, capsys):
    from megatron_odc import train

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(train, "run", interrupted)
    assert train.main([]) == train.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "python -m megatron_odc.train: interrupted\n"


# Task 1: no silent NaN #


def test_data_whose_responses_are_all_truncated_is_refused_before_training(tmp_path):
    long_prompt = "please read this long question carefully " * 3  # > 64 bytes
    data = _write_jsonl(tmp_path / "long.jsonl", [{"prompt": long_prompt, "response": "yes"}] * 8)
    results = _run(tmp_path, ["--sft", "--data-path", data])
    message = _assert_one_error(
        results, data, "--seq-length 64", "all 8 samples lose every response token"
    )
    assert "iteration" not in results[0][1].replace(message, ""), results[0][1]


def test_some_truncated_samples_are_a_warning(tmp_path):
    long_prompt = "please read this long question carefully " * 3
    records = [{"prompt": long_prompt, "response": "yes"}] * 2 + [
        {"prompt": "short", "response": "fine"}
    ] * 6
    data = _write_jsonl(tmp_path / "mixed.jsonl", records)
    results = _run(tmp_path, ["--sft", "--data-path", data, "--train-iters", "1"])
    assert [r[0] for r in results] == [0, 0], results
    assert results[0][1].count("2 of 8 samples lose every response token") == 1, results[0][1]
    assert "lose every response token" not in results[1][1] + results[1][2]
    # The dataset's own warning, found alike by every rank, is printed once per job too.
    assert results[0][1].count("2 of 8 samples truncated to max_length=64") == 1, results[0][1]
    assert "truncated" not in results[1][1] + results[1][2], results[1][1]


def _scale_reported_losses_at_iteration_2(rank: int, scale: list[float], ranks: tuple[int, ...]):
    """Multiply the ``[loss_sum, num_tokens]`` reports of iteration 2 on ``ranks`` by ``scale``."""
    import torch

    from megatron_odc.runner import trainer

    real = trainer.train_step
    calls = []

    def scaled(*args, **kwargs):
        report = real(*args, **kwargs)
        calls.append(None)
        if rank in ranks and len(calls) == 2:
            for r in report["losses"]:
                r["lm loss"] = r["lm loss"] * torch.tensor(scale)
        return report

    trainer.train_step = scaled


def _nan_loss_on_rank_1_at_iteration_2(rank: int) -> None:
    """Rank 1's loss of iteration 2 is NaN (as after a blow-up); rank 0's is fine."""
    _scale_reported_losses_at_iteration_2(rank, [float("nan"), 1.0], ranks=(1,))  # the sum only


def test_nan_loss_stops_every_rank_naming_iteration_and_rank(tmp_path):
    results = _run(tmp_path, [], patch="_nan_loss_on_rank_1_at_iteration_2")
    message = _assert_one_error(results, "iteration 2", "rank 1", "--no-check-for-nan")
    assert "lm loss" in message
    assert not re.search(r"iteration +3/", results[0][1]), results[0][1]


def _no_loss_token_at_iteration_2(rank: int) -> None:
    """Iteration 2's minibatch carries no loss token on any rank (every response cut away)."""
    _scale_reported_losses_at_iteration_2(rank, [0.0, 0.0], ranks=(0, 1))


def test_minibatch_without_loss_tokens_stops_the_run(tmp_path):
    results = _run(tmp_path, [], patch="_no_loss_token_at_iteration_2")
    _assert_one_error(results, "iteration 2", "no loss token on any rank", "--seq-length")
    assert not re.search(r"iteration +2/", results[0][1]), results[0][1]


def test_nan_check_off_trains_through(tmp_path):
    results = _run(
        tmp_path,
        ["--no-check-for-nan-in-loss-and-grad"],
        patch="_nan_loss_on_rank_1_at_iteration_2",
    )
    assert [r[0] for r in results] == [0, 0], results
    assert re.search(r"iteration +3/", results[0][1]), results[0][1]


@pytest.mark.parametrize("flag", ["--check-for-nan-in-loss-and-grad"])
def test_nan_check_flag_names(flag):
    from megatron_odc.runner.arguments import build_parser

    parser = build_parser()
    assert parser.parse_args([]).check_for_nan_in_loss_and_grad is True
    assert parser.parse_args([flag]).check_for_nan_in_loss_and_grad is True
    off = parser.parse_args(["--no-check-for-nan-in-loss-and-grad"])
    assert off.check_for_nan_in_loss_and_grad is False


# Checkpoint files read without unpickling arbitrary objects #


class _Payload:
    """An object a pickle could carry (and run code when unpickled)."""


def test_extra_state_is_loaded_with_weights_only(tmp_path):
    import random

    import torch

    from megatron_odc.runner.checkpoint import load_extra_state_file

    state = {
        "sampler": {"version": 1, "epoch": 0, "next_index": 3, "fingerprint": "abc"},
        "scheduler": {"max_lr": 3e-3, "num_steps": 48, "lr_decay_style": "cosine"},
        "rng_states": [{"python": random.getstate(), "torch_cpu": torch.get_rng_state()}],
        "world_size": 1,
    }
    torch.save(state, tmp_path / "good.pt")
    loaded = load_extra_state_file(tmp_path / "good.pt")
    assert loaded["rng_states"][0]["python"] == state["rng_states"][0]["python"]
    torch.save({"sampler": _Payload()}, tmp_path / "object.pt")
    (tmp_path / "garbage.pt").write_bytes(os.urandom(64))
    for name in ("object.pt", "garbage.pt"):
        with pytest.raises(ValueError, match=re.escape(str(tmp_path / name))):
            load_extra_state_file(tmp_path / name)


def test_tracker_of_garbage_names_the_directory(tmp_path):
    from megatron_odc.runner.checkpoint import latest_iteration

    (tmp_path / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\x00\x81")
    with pytest.raises(ValueError, match="is not a checkpoint directory") as info:
        latest_iteration(tmp_path)
    assert str(tmp_path) in str(info.value)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12\n")
    assert latest_iteration(tmp_path) == 12


def test_samples_without_loss_agrees_on_jsonl_and_preprocessed_data(tmp_path):
    from megatron_odc.data import ByteTokenizer, IndexedSFTDataset, SFTDataset, samples_without_loss
    from megatron_odc.data.preprocess import preprocess

    long_prompt = "please read this long question carefully " * 3  # 126 bytes of prompt
    records = [
        {"prompt": "short", "response": "fine"},
        {"prompt": long_prompt, "response": "yes"},
        {"prompt": long_prompt[:40], "response": "a response that straddles the cut " * 3},
        {"prompt": long_prompt, "response": "no"},
    ]
    data = _write_jsonl(tmp_path / "mixed.jsonl", records)
    preprocess(data, str(tmp_path / "mixed"), workers=0, progress=False)
    tokenizer = ByteTokenizer()
    # Sample 2's response starts after ~50 tokens: kept at 64, cut away at 32.
    for cap, max_length, lost in ((64, 64, [1, 3]), (32, 64, [1, 2, 3]), (64, None, [1, 3])):
        jsonl = SFTDataset(data, tokenizer, max_length=max_length)
        indexed = IndexedSFTDataset(str(tmp_path / "mixed"), tokenizer, max_length=max_length)
        assert samples_without_loss(jsonl, cap) == lost, (cap, max_length)
        assert samples_without_loss(indexed, cap) == lost, (cap, max_length)
    assert samples_without_loss(SFTDataset(data, tokenizer), 1000) == []
