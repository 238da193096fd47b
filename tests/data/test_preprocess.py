"""Preprocessed SFT data: the same samples as the JSONL path, bad lines named or skipped, clear refusals."""

from __future__ import annotations

import json
import logging
import os
import random
import zlib

import numpy as np
import pytest
import torch

from megatron_odc.data import ByteTokenizer, LengthBalancedSampler, SFTDataset, make_synthetic_sft
from megatron_odc.data.indexed_sft import IndexedSFTDataset, is_indexed_sft, sidecar_path
from megatron_odc.data.preprocess import main, preprocess
from megatron_odc.data.sft import read_jsonl
from megatron_odc.runner.arguments import build_parser, validate_args


def _assert_same_samples(jsonl: SFTDataset, indexed: IndexedSFTDataset, cut: int) -> None:
    assert len(jsonl) == len(indexed)
    assert list(jsonl.lengths) == indexed.lengths.tolist()
    for i in range(len(jsonl)):
        a, b = jsonl[i], indexed[i]
        assert torch.equal(a.tokens, b.tokens), i
        assert torch.equal(a.loss_mask, b.loss_mask), i
        assert jsonl.loss_token_count(i) == indexed.loss_token_count(i), i
        assert jsonl.loss_token_count(i, cut) == indexed.loss_token_count(i, cut), i


@pytest.mark.parametrize("workers", [0, 2])
def test_preprocessed_samples_equal_the_jsonl_ones(tmp_path, workers):
    path = tmp_path / "data.jsonl"
    make_synthetic_sft(path, 300, seed=workers, max_tokens=400)
    with open(
        path, "a", encoding="utf-8"
    ) as f:  # multi-byte UTF-8, a blank line, a long system prompt
        f.write("\n" + json.dumps({"prompt": "naïve café ✓ 数据", "response": "ok ✓"}) + "\n")
        f.write(json.dumps({"system": "s" * 900, "prompt": "p", "response": "r"}) + "\n")
    sidecar = preprocess(
        str(path), str(tmp_path / "out"), workers=workers, chunk_lines=37, progress=False
    )
    assert sidecar["num_samples"] == 302
    assert sidecar["skipped_lines"] == 0
    assert is_indexed_sft(str(tmp_path / "out"))
    tokenizer = ByteTokenizer()
    for max_length in (None, 200):
        _assert_same_samples(
            SFTDataset(path, tokenizer, max_length=max_length),
            IndexedSFTDataset(str(tmp_path / "out"), tokenizer, max_length=max_length),
            cut=37,
        )
    assert not list(tmp_path.glob("*.tmp*")), "temporary files left behind"


def _bad_file(tmp_path):
    good = json.dumps({"prompt": "p", "response": "r"}).encode()
    lines = [
        good,
        b'{"prompt": "p", "response": "\xff\xfe"}',
        good,
        b"{not json",
        good,
        b'{"prompt": "x"}',
        good,
    ]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize(
    ("line", "what"),
    [(2, "invalid UTF-8 at byte 29"), (4, "invalid JSON"), (6, "expected a 'messages' list")],
)
def test_a_bad_line_is_named_by_file_and_line(tmp_path, line, what):
    path = _bad_file(tmp_path)
    lines = path.read_bytes().split(b"\n")
    good = lines[0]
    # Keep only the bad line under test, so the first error is this one.
    for other in {2, 4, 6} - {line}:
        lines[other - 1] = good
    path.write_bytes(b"\n".join(lines))
    for read in (
        lambda: read_jsonl(path),
        lambda: preprocess(str(path), str(tmp_path / "out"), workers=0, progress=False),
    ):
        with pytest.raises(ValueError, match=rf"{path}:{line}: {what}.*--skip-bad-lines"):
            read()
    assert not is_indexed_sft(str(tmp_path / "out"))
    assert not list(tmp_path.glob("out*")), "a failed run left files behind"


def test_skip_bad_lines_skips_and_counts(tmp_path, caplog):
    path = _bad_file(tmp_path)
    with caplog.at_level(logging.WARNING):
        records = read_jsonl(path, skip_bad_lines=True)
    assert [line for line, _ in records] == [1, 3, 5, 7]
    assert "skipped 3 bad line(s)" in caplog.text
    assert f"{path}:2: invalid UTF-8" in caplog.text
    sidecar = preprocess(
        str(path), str(tmp_path / "out"), workers=2, skip_bad_lines=True, progress=False
    )
    assert (sidecar["num_samples"], sidecar["skipped_lines"]) == (4, 3)
    _assert_same_samples(
        SFTDataset(path, ByteTokenizer(), skip_bad_lines=True),
        IndexedSFTDataset(str(tmp_path / "out"), ByteTokenizer()),
        cut=5,
    )


def test_cli_prints_one_error_and_exits_2(tmp_path, caplog):
    path = _bad_file(tmp_path)
    with caplog.at_level(logging.ERROR):
        code = main(["--input", str(path), "--output-prefix", str(tmp_path / "o"), "--no-progress"])
    assert code == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert f"{path}:2: invalid UTF-8" in errors[0].getMessage()
    assert main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", "o"]) == 2


class _OtherTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.pad_id = self.eos_id


def test_refusals_name_the_problem(tmp_path):
    path = tmp_path / "d.jsonl"
    make_synthetic_sft(path, 20, seed=0, max_tokens=64)
    prefix = str(tmp_path / "out")
    preprocess(str(path), prefix, workers=0, progress=False)
    with pytest.raises(ValueError, match=r"preprocessed with tokenizer .* training uses"):
        IndexedSFTDataset(prefix, _OtherTokenizer())
    with open(sidecar_path(prefix)) as f:
        sidecar = json.load(f)
    with open(sidecar_path(prefix), "w") as f:
        json.dump({**sidecar, "version": 99}, f)
    with pytest.raises(ValueError, match="format version 99"):
        IndexedSFTDataset(prefix, ByteTokenizer())
    with open(sidecar_path(prefix), "w") as f:
        json.dump({**sidecar, "num_samples": 21}, f)
    with pytest.raises(ValueError, match="the files disagree"):
        IndexedSFTDataset(prefix, ByteTokenizer())
    with open(sidecar_path(prefix), "w") as f:
        json.dump(sidecar, f)
    os.remove(prefix + ".loss_mask.bin")
    with pytest.raises(ValueError, match=r"out\.loss_mask\.bin is missing"):
        IndexedSFTDataset(prefix, ByteTokenizer())
    # A missing output directory is created (docs/data.md's command writes into a new data/)...
    preprocess(str(path), str(tmp_path / "new" / "dir" / "out"), workers=0, progress=False)
    assert os.path.isfile(sidecar_path(str(tmp_path / "new" / "dir" / "out")))
    # ...one that cannot be is named.
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"directory .*a_file/sub cannot be created"):
        preprocess(str(path), str(tmp_path / "a_file" / "sub" / "out"), workers=0, progress=False)


def test_training_flags_detect_the_format(tmp_path):
    path = tmp_path / "d.jsonl"
    make_synthetic_sft(path, 20, seed=0, max_tokens=64)
    prefix = str(tmp_path / "out")
    preprocess(str(path), prefix, workers=0, progress=False)
    args = validate_args(build_parser().parse_args(["--data-path", prefix]), world_size=2)
    assert args.sft
    with pytest.raises(ValueError, match="neither a JSONL file nor a preprocessed SFT prefix"):
        validate_args(
            build_parser().parse_args(["--sft", "--data-path", str(tmp_path / "nothing")]),
            world_size=2,
        )


def test_sampler_keeps_its_resume_checksum_and_order():
    # The checksum saved with a sampler state is CRC-32 of the comma-joined lengths, computed by chunks.
    rng = random.Random(0)
    lengths = [rng.randint(1, 5000) for _ in range(200_003)]
    sampler = LengthBalancedSampler(lengths, global_batch_size=7, dp_size=1, dp_rank=0, seed=3)
    expected = zlib.crc32(",".join(map(str, lengths)).encode())
    assert sampler.state_dict()["fingerprint"]["lengths_crc32"] == expected
    order = list(range(len(lengths)))
    random.Random("megatron_odc.sampler:3:0").shuffle(order)
    assert sampler.epoch_order(0) == order
    assert sampler.minibatch_sample_ids(0, 2) == tuple(order[14:21])
    assert isinstance(sampler.minibatch_sample_ids(0, 2)[0], int)
    assert isinstance(sampler.lengths, np.ndarray)
