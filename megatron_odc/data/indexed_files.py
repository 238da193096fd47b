"""The megatron-core indexed dataset files of a prefix (``PREFIX.idx`` / ``PREFIX.bin``), checked
before megatron-core opens them.

megatron-core asserts on an index that is not one (``bad header``, followed by its ``__del__``
complaining about the half-built object) and finds a ``.bin`` shorter than its index says only when
a sample beyond its end is first read, naming no file. :func:`check_indexed_dataset` reads the
index's fixed part and last entries (a few bytes whatever the dataset's size) and the ``.bin``'s
size, and refuses what megatron-core could not read with one ``ValueError`` naming the file. Used for
pretraining prefixes (``runner/arguments.py``, before anything is built) and preprocessed SFT data
(``indexed_sft.py``).
"""

from __future__ import annotations

import os
import struct

_INDEX_HEADER = b"MMIDIDX\x00\x00"
"""The magic opening a megatron-core indexed dataset index (``indexed_dataset._INDEX_HEADER``)."""
_INDEX_FIXED = struct.Struct("<9sQBQQ")
"""An index's fixed part: magic, version, dtype code, sequence count, document count; then the int32
sequence lengths, the int64 sequence pointers (byte offsets into the .bin) and the int64 document
indices."""


def _read_at(f, offset: int, fmt: str) -> int:
    f.seek(offset)
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def check_indexed_dataset(path_prefix: str, lead: str) -> None:
    """Refuses a megatron-core indexed dataset (``path_prefix``.idx / .bin) megatron-core cannot read.

    megatron-core asserts on an index that is not one (``bad header``) and finds a .bin shorter than
    its index only when a sample beyond its end is first read, naming no file. This reads the index's
    fixed part and last entries (a few bytes whatever the dataset's size) and the .bin's size.

    Raises:
        ValueError: starting with ``lead`` (e.g. ``--data-path PREFIX``), naming the file, what is
            wrong and what to do.
    """
    from megatron.core.datasets.indexed_dataset import DType

    idx, bin_path = path_prefix + ".idx", path_prefix + ".bin"
    codes = {d.value for d in DType}
    redo = "check the prefix, or re-run the preprocessing that wrote it"
    try:
        with open(idx, "rb") as f:
            idx_size = os.fstat(f.fileno()).st_size
            head = f.read(_INDEX_FIXED.size)
            if len(head) < _INDEX_FIXED.size or not head.startswith(_INDEX_HEADER):
                raise ValueError(
                    f"{lead}: {idx} is not a megatron-core indexed dataset index (no "
                    f"{_INDEX_HEADER!r} header); {redo}"
                )
            _, version, code, num_seqs, num_docs = _INDEX_FIXED.unpack(head)
            if version != 1 or code not in codes:
                raise ValueError(
                    f"{lead}: {idx} is not a megatron-core indexed dataset index (version "
                    f"{version}, dtype code {code}; megatron-core reads version 1, dtype codes "
                    f"{min(codes)}-{max(codes)}); {redo}"
                )
            size = _INDEX_FIXED.size + num_seqs * 12 + num_docs * 8
            if idx_size < size:
                raise ValueError(
                    f"{lead}: {idx} is {idx_size} bytes, but its header announces {num_seqs} "
                    f"sequences and {num_docs} document indices ({size} bytes): the file is "
                    f"incomplete; copy it again or re-run the preprocessing"
                )
            last_doc = _read_at(f, size - 8, "<q") if num_docs else -1
            length = pointer = 0
            if num_seqs:
                length = _read_at(f, _INDEX_FIXED.size + (num_seqs - 1) * 4, "<i")
                pointer = _read_at(f, _INDEX_FIXED.size + num_seqs * 4 + (num_seqs - 1) * 8, "<q")
            if last_doc != num_seqs or length < 0 or pointer < 0:
                raise ValueError(
                    f"{lead}: {idx} is corrupt (its entries contradict its {num_seqs} sequences); "
                    f"{redo}"
                )
            need = pointer + length * DType.size(code)
    except OSError as exc:
        raise ValueError(f"{lead}: cannot read {idx}: {exc}") from None
    try:
        bin_size = os.path.getsize(bin_path)
    except OSError as exc:
        raise ValueError(f"{lead}: cannot read {bin_path}: {exc}") from None
    if bin_size < need:
        raise ValueError(
            f"{lead}: {bin_path} is {bin_size} bytes, but its index {idx} says it holds {need} "
            f"bytes: the file is incomplete (an interrupted copy or preprocessing run); copy it "
            f"again or re-run the preprocessing"
        )
