"""Pretraining prefixes (``--data-path PREFIX``): damaged megatron-core files are refused by the flag
check, before anything is built, naming the file (megatron-core asserts on a bad index, with ``__del__``
noise, and reads past the end of a short ``.bin`` only at the first sample it reaches, naming no
file: ``data/indexed_files.py``); intact ones build megatron-core's GPTDataset (``mcore/datasets.py``)."""

from __future__ import annotations

import argparse
import os
import random

import numpy as np
import pytest
import torch

from megatron_odc.data import ByteTokenizer
from megatron_odc.mcore.datasets import gpt_pretraining_dataset
from megatron_odc.runner.arguments import build_parser, validate_args
from tests._refusal import one_line_refusal


def _write(prefix: str, num_docs: int = 30) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = random.Random(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_docs):
        ids = [rng.randrange(250) for _ in range(rng.randint(20, 80))] + [ByteTokenizer().eos_id]
        builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(prefix + ".idx")


def _args(tmp_path, data_path: list[str]) -> argparse.Namespace:
    return argparse.Namespace(
        seed=1,
        seq_length=32,
        data_path=data_path,
        split="100,0,0",
        data_cache_path=str(tmp_path / "cache"),
        train_iters=2,
        global_batch_size=4,
    )


@pytest.fixture
def prefixes(tmp_path) -> tuple[str, str]:
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    _write(good)
    _write(bad)
    return good, bad


def _refused(tmp_path, data_path: list[str], monkeypatch) -> str:
    return one_line_refusal(
        lambda: validate_args(build_parser().parse_args(["--data-path", *data_path]), world_size=2),
        str(data_path),
        monkeypatch,
    )


def test_an_index_that_is_not_one_is_refused_by_name(tmp_path, prefixes, monkeypatch):
    good, bad = prefixes
    with open(bad + ".idx", "wb") as f:
        f.write(b"garbage " * 20)
    message = _refused(tmp_path, [good, bad], monkeypatch)
    assert message.startswith(f"--data-path {bad}: {bad}.idx is not a megatron-core indexed ")
    assert "re-run the preprocessing" in message


@pytest.mark.parametrize("cut", [1000, 0])
def test_a_truncated_bin_is_refused_before_building(tmp_path, prefixes, cut, monkeypatch):
    _, bad = prefixes
    full = os.path.getsize(bad + ".bin")
    assert full > cut
    with open(bad + ".bin", "r+b") as f:
        f.truncate(cut)
    message = _refused(tmp_path, [bad], monkeypatch)
    assert message.startswith(
        f"--data-path {bad}: {bad}.bin is {cut} bytes, but its index {bad}.idx says it holds "
        f"{full} bytes: the file is incomplete"
    )


def test_intact_prefixes_build(tmp_path, prefixes):
    dataset = gpt_pretraining_dataset(_args(tmp_path, [prefixes[0]]), ByteTokenizer())
    assert len(dataset) >= 8
    assert dataset[0]["tokens"].shape == (32,)


def test_weighted_prefixes_build_the_train_split(tmp_path, prefixes):
    """``--data-path W1 P1 W2 P2``: megatron-core asserted "size_is_none => weights_are_none" (and a
    sized split without documents never ended); the weighted blend is now the train split's alone."""
    good, other = prefixes
    _one_process_group(tmp_path)
    try:
        args = _args(tmp_path, ["1", good, "2", other])
        dataset = gpt_pretraining_dataset(args, ByteTokenizer())
    finally:
        torch.distributed.destroy_process_group()
    assert len(dataset) >= args.train_iters * args.global_batch_size
    assert dataset[0]["tokens"].shape == (32,)


def _one_process_group(tmp_path):
    """megatron-core's blended datasets ask torch.distributed for the rank: a one-process group."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )


def test_small_unweighted_prefixes_build_the_train_split(tmp_path):
    """``--data-path P1 P2`` with the default ``--split 969,30,1``: a prefix with no document in the
    valid split made megatron-core's valid blend weigh it 0, and ``BlendedDataset`` refused that
    (weights must be > 0), although only the train split is used; only the train split is built now."""
    big, small = str(tmp_path / "big"), str(tmp_path / "small")
    _write(big, num_docs=40)
    _write(small, num_docs=3)
    _one_process_group(tmp_path)
    try:
        args = _args(tmp_path, [big, small])
        args.split = "969,30,1"
        dataset = gpt_pretraining_dataset(args, ByteTokenizer())
        samples = [dataset[i]["tokens"] for i in range(len(dataset))]
    finally:
        torch.distributed.destroy_process_group()
    assert len(samples) >= args.train_iters * args.global_batch_size
    assert not list((tmp_path / "cache").rglob("*valid*")), "a valid split was built"


def test_the_train_split_is_megatron_cores(tmp_path):
    """The train split built alone holds the same samples as megatron-core's train split of the same
    ``--split`` built beside valid and test (a resumed run keeps its data)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megatron_odc.mcore.datasets import _DatasetTokenizer

    prefix = str(tmp_path / "data")
    _write(prefix, num_docs=60)
    args = _args(tmp_path, [prefix])
    args.split = "80,15,5"
    ours = gpt_pretraining_dataset(args, ByteTokenizer())
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=([prefix], None),
        split=args.split,
        path_to_cache=str(tmp_path / "reference_cache"),
        tokenizer=_DatasetTokenizer(ByteTokenizer()),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,
    )
    num_samples = args.train_iters * args.global_batch_size
    reference, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, None, None], lambda: True, config
    ).build()
    assert valid is not None
    assert len(valid) > 0
    assert len(ours) == len(reference)
    for i in range(len(ours)):
        assert torch.equal(ours[i]["tokens"], reference[i]["tokens"]), i
