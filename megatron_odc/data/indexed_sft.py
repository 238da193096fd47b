"""Preprocessed SFT data on disk: megatron-core indexed datasets for tokens and loss masks, plus a sidecar.

Owns the format written by ``python -m megatron_odc.data.preprocess`` and read by training
(``--data-path PREFIX``), see docs/data.md:

- ``PREFIX.bin`` / ``PREFIX.idx``: the token ids, one sequence (and one document) per sample, in a
  megatron-core ``IndexedDataset`` (the dtype megatron-core picks for the vocabulary size);
- ``PREFIX.loss_mask.bin`` / ``.idx``: the token-aligned loss mask (uint8), the same sequence lengths;
- ``PREFIX.loss_tokens.npy``: per sample, the number of positions whose prediction carries loss (int64);
- ``PREFIX.sft.json``: the sidecar: format name and version, sample count, the tokenizer's identity
  (vocabulary size and special ids, checked against the training tokenizer), the source file and the
  number of bad lines skipped.

:class:`IndexedSFTDataset` memory-maps all of it: opening it reads no sample, and a rank's resident
memory beyond the mappings does not grow with the number of samples. It offers what
:class:`~megatron_odc.data.sft.SFTDataset` offers (``lengths``, ``num_loss_tokens``,
``loss_token_count``, ``__getitem__``). megatron-core's ``indexed_dataset`` module is imported lazily,
so importing this package stays megatron-free (the layering test allows this one module of megatron-core
here: it is a file format, with no process group or model state).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from megatron_odc.data.indexed_files import check_indexed_dataset
from megatron_odc.data.sft import SFTSample

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "IndexedSFTDataset",
    "IndexedSFTWriter",
    "is_indexed_sft",
    "sidecar_path",
    "tokenizer_identity",
]

FORMAT_NAME = "megatron_odc.indexed_sft"
FORMAT_VERSION = 1
_SIDECAR = ".sft.json"
_MASK = ".loss_mask"
_LOSS_TOKENS = ".loss_tokens.npy"
_DATA_SUFFIXES = (".bin", ".idx", _MASK + ".bin", _MASK + ".idx", _LOSS_TOKENS)
"""Every file of a dataset but its sidecar: written first, checked before opening."""


def sidecar_path(prefix: str) -> str:
    """The sidecar file of a preprocessed dataset: ``PREFIX.sft.json``."""
    return prefix + _SIDECAR


def is_indexed_sft(prefix: str) -> bool:
    """Whether ``prefix`` names a preprocessed SFT dataset (its sidecar exists)."""
    return os.path.isfile(sidecar_path(prefix))


def tokenizer_identity(tokenizer) -> dict[str, Any]:
    """What must match between the preprocessing and the training tokenizer."""
    return {
        "class": type(tokenizer).__name__,
        "vocab_size": int(tokenizer.vocab_size),
        "eos_id": int(tokenizer.eos_id),
        "pad_id": int(tokenizer.pad_id),
        "bos_id": None if getattr(tokenizer, "bos_id", None) is None else int(tokenizer.bos_id),
        "chat_template": bool(getattr(tokenizer, "has_chat_template", False)),
    }


def _indexed_dataset_module():
    import megatron.core.datasets.indexed_dataset

    return megatron.core.datasets.indexed_dataset


class IndexedSFTWriter:
    """Writes a preprocessed SFT dataset, a batch of samples at a time (see the module docstring).

    Files are written under temporary names and renamed into place by :meth:`finish`, the sidecar last,
    so an interrupted run never leaves something that looks like a complete dataset.
    """

    def __init__(self, prefix: str, tokenizer) -> None:
        indexed = _indexed_dataset_module()
        directory = os.path.dirname(os.path.abspath(prefix))
        try:
            os.makedirs(directory, exist_ok=True)  # docs/data.md's command writes into a new data/
        except OSError as exc:
            raise ValueError(
                f"--output-prefix {prefix!r}: directory {directory} cannot be created "
                f"({exc.strerror or exc})"
            ) from exc
        self.prefix = prefix
        self.identity = tokenizer_identity(tokenizer)
        self._tmp = f"{prefix}.tmp{os.getpid()}"
        self._token_dtype = indexed.DType.optimal_dtype(self.identity["vocab_size"])
        self._tokens = indexed.IndexedDatasetBuilder(self._tmp + ".bin", dtype=self._token_dtype)
        self._masks = indexed.IndexedDatasetBuilder(self._tmp + _MASK + ".bin", dtype=np.uint8)
        self._loss_tokens: list[np.ndarray] = []
        self.num_samples = 0
        self.num_tokens = 0

    def add(self, tokens: np.ndarray, masks: np.ndarray, lengths: np.ndarray) -> None:
        """Appends samples given as concatenated ``tokens`` and ``masks`` and their ``lengths``."""
        assert tokens.shape == masks.shape
        assert int(lengths.sum()) == len(tokens)
        if not len(lengths):
            return
        self._tokens.add_document(tokens.astype(self._token_dtype, copy=False), lengths.tolist())
        self._masks.add_document(masks.astype(np.uint8, copy=False), lengths.tolist())
        # One document per sample, as GPTDataset expects (add_document made the whole batch one).
        for builder in (self._tokens, self._masks):
            builder.document_indices[-1:] = (
                self.num_samples + 1 + np.arange(len(lengths))
            ).tolist()
        starts = np.cumsum(lengths) - lengths
        # Loss-carrying positions of a sample: mask[1:], i.e. its mask minus the first token's.
        counts = np.add.reduceat(masks.astype(np.int64), starts) - masks[starts].astype(np.int64)
        self._loss_tokens.append(counts)
        self.num_samples += len(lengths)
        self.num_tokens += len(tokens)

    def finish(self, *, source: str, skipped_lines: int) -> dict[str, Any]:
        """Writes the indexes and the sidecar and moves everything into place; returns the sidecar."""
        if not self.num_samples:
            self.abort()
            raise ValueError(f"{source}: no sample to write")
        self._tokens.finalize(self._tmp + ".idx")
        self._masks.finalize(self._tmp + _MASK + ".idx")
        loss_tokens = np.concatenate(self._loss_tokens)
        np.save(self._tmp + _LOSS_TOKENS, loss_tokens)
        for suffix in _DATA_SUFFIXES:
            os.replace(self._tmp + suffix, self.prefix + suffix)
        sidecar = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "num_loss_tokens": int(loss_tokens.sum()),
            "tokenizer": self.identity,
            "source": os.path.abspath(source),
            "skipped_lines": skipped_lines,
        }
        tmp = self._tmp + _SIDECAR
        with open(tmp, "w") as f:
            json.dump(sidecar, f, indent=1)
        os.replace(tmp, sidecar_path(self.prefix))
        return sidecar

    def abort(self) -> None:
        """Closes and removes the temporary files."""
        for builder in (self._tokens, self._masks):
            builder.data_file.close()
        for suffix in (*_DATA_SUFFIXES, _SIDECAR):
            if os.path.exists(self._tmp + suffix):
                os.remove(self._tmp + suffix)


class IndexedSFTDataset:
    """A preprocessed SFT dataset, memory-mapped (see the module docstring).

    Args:
        prefix: the ``--output-prefix`` of the preprocessing run.
        tokenizer: the training tokenizer; it must be the one the data was preprocessed with.
        max_length: when set, samples are cut to their first ``max_length`` tokens (lazily).

    Attributes:
        lengths: tokens per sample (after ``max_length``), an int32 array.
        num_loss_tokens: int64 count of loss positions per sample, at the full length.
        sidecar: the sidecar's contents.

    Raises:
        ValueError: a file is missing, unreadable or shorter than its index says, the sidecar is not
            this format or version, the files disagree, or the tokenizer differs from the preprocessing one.
    """

    def __init__(self, prefix: str, tokenizer, max_length: int | None = None) -> None:
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be at least 2 tokens, got {max_length}")
        self.path = prefix
        self.max_length = max_length
        self.sidecar = self._read_sidecar(prefix)
        expected = tokenizer_identity(tokenizer)
        if self.sidecar["tokenizer"] != expected:
            raise ValueError(
                f"--data-path {prefix}: preprocessed with tokenizer {self.sidecar['tokenizer']}, but "
                f"training uses {expected}; preprocess again with the training tokenizer"
            )
        indexed = _indexed_dataset_module()
        for suffix in _DATA_SUFFIXES:
            if not os.path.isfile(prefix + suffix):
                raise ValueError(f"--data-path {prefix}: {prefix + suffix} is missing")
        # Before megatron-core opens them: it asserts on a bad index, and reads past a short .bin late.
        check_indexed_dataset(prefix, f"--data-path {prefix}")
        check_indexed_dataset(prefix + _MASK, f"--data-path {prefix}")
        self._tokens = indexed.IndexedDataset(prefix, mmap=True)
        self._masks = indexed.IndexedDataset(prefix + _MASK, mmap=True)
        self.num_loss_tokens = np.load(prefix + _LOSS_TOKENS, mmap_mode="r")
        full = self._tokens.sequence_lengths
        num = self.sidecar["num_samples"]
        if not (len(full) == num == len(self.num_loss_tokens)) or not np.array_equal(
            full, self._masks.sequence_lengths
        ):
            raise ValueError(
                f"--data-path {prefix}: the files disagree on the samples (sidecar {num}, tokens "
                f"{len(full)}, loss masks {len(self._masks.sequence_lengths)}, loss counts "
                f"{len(self.num_loss_tokens)}); preprocess again"
            )
        num_truncated = 0 if max_length is None else int(np.count_nonzero(full > max_length))
        # The index's own (memory-mapped) lengths unless some sample is cut: then 4 bytes per sample.
        self.lengths = np.minimum(full, max_length) if num_truncated else full
        if num_truncated:
            logger.warning(
                "%s: %d of %d samples truncated to max_length=%d",
                prefix,
                num_truncated,
                num,
                max_length,
            )

    @staticmethod
    def _read_sidecar(prefix: str) -> Mapping[str, Any]:
        path = sidecar_path(prefix)
        try:
            with open(path) as f:
                sidecar = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"--data-path {prefix}: cannot read {path}: {exc}") from None
        if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT_NAME:
            raise ValueError(f"--data-path {prefix}: {path} is not a {FORMAT_NAME} sidecar")
        if sidecar.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"--data-path {prefix}: format version {sidecar.get('version')}, this release reads "
                f"version {FORMAT_VERSION}; preprocess again"
            )
        return sidecar

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> SFTSample:
        length = int(self.lengths[index])
        tokens = self._tokens.get(int(index), 0, length)
        mask = self._masks.get(int(index), 0, length)
        return SFTSample(
            torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(mask.astype(bool))
        )

    def loss_token_count(self, index: int, length: int | None = None) -> int:
        """Loss-carrying positions of sample ``index`` when cut to ``length`` tokens (and to max_length)."""
        full = int(self._tokens.sequence_lengths[index])
        cut = full if self.max_length is None else min(full, self.max_length)
        if length is not None:
            cut = min(cut, length)
        if cut >= full:
            return int(self.num_loss_tokens[index])
        return int(np.count_nonzero(self._masks.get(int(index), 1, cut - 1)))
