"""A preprocessed SFT prefix whose megatron-core files are damaged: refused at open, naming the file.

megatron-core itself asserts on an index that is not one (``bad header``, plus ``__del__`` noise) and
reads past the end of a short ``.bin`` only at the first sample it reaches, naming no file.
"""

from __future__ import annotations

import os

import pytest

from megatron_odc.data import ByteTokenizer, make_synthetic_sft
from megatron_odc.data.indexed_files import check_indexed_dataset
from megatron_odc.data.indexed_sft import IndexedSFTDataset
from megatron_odc.data.preprocess import preprocess
from tests._refusal import one_line_refusal


@pytest.fixture
def prefix(tmp_path) -> str:
    path = tmp_path / "d.jsonl"
    make_synthetic_sft(path, 40, seed=0, max_tokens=200)
    out = str(tmp_path / "sft")
    preprocess(str(path), out, workers=0, progress=False)
    return out


def _open_refused(prefix: str, monkeypatch) -> str:
    """The one-line ValueError opening ``prefix`` gives; fails on anything megatron-core leaves behind."""
    message = one_line_refusal(
        lambda: IndexedSFTDataset(prefix, ByteTokenizer()), prefix, monkeypatch
    )
    assert message.startswith(f"--data-path {prefix}: "), message
    return message


@pytest.mark.parametrize("suffix", [".idx", ".loss_mask.idx"])
def test_an_index_that_is_not_one_is_refused_by_name(prefix, suffix, monkeypatch):
    with open(prefix + suffix, "wb") as f:
        f.write(b"this is not an index at all\n" * 3)
    message = _open_refused(prefix, monkeypatch)
    assert f"{prefix + suffix} is not a megatron-core indexed dataset index" in message
    assert "re-run the preprocessing" in message


@pytest.mark.parametrize(("suffix", "cut"), [(".bin", 1000), (".loss_mask.bin", 100), (".bin", 0)])
def test_a_truncated_bin_is_refused_at_open_with_its_sizes(prefix, suffix, cut, monkeypatch):
    full = os.path.getsize(prefix + suffix)
    assert full > cut
    with open(prefix + suffix, "r+b") as f:
        f.truncate(cut)
    message = _open_refused(prefix, monkeypatch)
    assert (
        f"{prefix + suffix} is {cut} bytes, but its index {prefix + suffix[:-4]}.idx says it holds "
        f"{full} bytes: the file is incomplete" in message
    )
    assert "re-run the preprocessing" in message


def test_a_truncated_index_is_refused(prefix, monkeypatch):
    full = os.path.getsize(prefix + ".idx")
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(40)
    message = _open_refused(prefix, monkeypatch)
    assert f"{prefix}.idx is 40 bytes, but its header announces 40 sequences" in message
    assert f"({full} bytes)" in message


@pytest.mark.parametrize(
    ("offset", "value", "expected"),
    [
        (9, (2).to_bytes(8, "little"), "(version 2, dtype code"),
        (9 + 8, bytes([99]), "dtype code 99;"),
        (9 + 8 + 1, (39).to_bytes(8, "little"), "is corrupt"),  # the document indices end at 40
    ],
    ids=["version", "dtype", "count"],
)
def test_corrupt_header_fields_are_refused(prefix, offset, value, expected, monkeypatch):
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(value)
    message = _open_refused(prefix, monkeypatch)
    assert f"{prefix}.idx " in message
    assert expected in message


def test_intact_files_pass_and_a_longer_bin_is_accepted(prefix):
    check_indexed_dataset(prefix, "x")
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\0" * 7)
    check_indexed_dataset(prefix, "x")
    assert len(IndexedSFTDataset(prefix, ByteTokenizer())) == 40
