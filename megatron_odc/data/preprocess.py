"""Tokenise an SFT JSONL file once, into the memory-mapped format training reads without tokenising.

Owns the command line ``python -m megatron_odc.data.preprocess`` (see docs/data.md)::

    python -m megatron_odc.data.preprocess --input data.jsonl --output-prefix data/sft \\
        [--tokenizer byte|HF_DIR] [--workers 2] [--skip-bad-lines]

The main process reads the file in chunks of lines and writes, in file order; worker processes decode,
validate and tokenise the chunks (:func:`~megatron_odc.data.sft.parse_line` and
:func:`~megatron_odc.data.sft.conversation_arrays`, the same code as the JSONL path, so both give the same
samples). A bad line (invalid UTF-8, invalid JSON, missing keys) stops the run with its file and line,
unless ``--skip-bad-lines`` skips and counts it. The output is written by
:class:`~megatron_odc.data.indexed_sft.IndexedSFTWriter`; train with ``--data-path PREFIX``.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from megatron_odc.data.indexed_sft import IndexedSFTWriter
from megatron_odc.data.sft import BadLines, conversation_arrays, parse_line
from megatron_odc.data.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "preprocess"]

_worker_tokenizer = None


def _init_worker(tokenizer) -> None:
    """Sets the tokenizer of this process: the loaded one, or (in a spawned worker) its spec to load."""
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer


def _tokenize_chunk(chunk: tuple[str, int, list[bytes]]):
    """Tokenises lines ``first, first+1, ...`` of ``path``: (tokens, masks, lengths, bad line errors)."""
    path, first, lines = chunk
    tokens, masks, lengths, errors = [], [], [], []
    for line_number, raw in enumerate(lines, start=first):
        try:
            messages = parse_line(raw, f"{path}:{line_number}")
        except ValueError as exc:
            errors.append(str(exc))
            continue
        if messages is None:
            continue
        ids, mask = conversation_arrays(messages, _worker_tokenizer)
        tokens.append(ids)
        masks.append(mask)
        lengths.append(len(ids))
    if not lengths:
        return np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0, np.int64), errors
    return np.concatenate(tokens), np.concatenate(masks), np.array(lengths, np.int64), errors


def _chunks(path: str, chunk_lines: int, progress) -> Iterator[tuple[str, int, list[bytes]]]:
    with open(path, "rb") as f:
        first, lines = 1, []
        for raw in f:
            lines.append(raw)
            if len(lines) == chunk_lines:
                progress.update(sum(len(line) for line in lines))
                yield path, first, lines
                first, lines = first + len(lines), []
        if lines:
            progress.update(sum(len(line) for line in lines))
            yield path, first, lines


def preprocess(
    input_path: str,
    output_prefix: str,
    *,
    tokenizer: str = "byte",
    workers: int = 1,
    skip_bad_lines: bool = False,
    chunk_lines: int = 1024,
    progress: bool = True,
) -> dict:
    """Tokenises ``input_path`` into ``output_prefix`` (see the module docstring); returns the sidecar.

    Args:
        input_path: the SFT JSONL file.
        output_prefix: where the dataset goes (``PREFIX.bin``, ``.idx``, ``.sft.json``, ...).
        tokenizer: ``"byte"`` or a local Hugging Face tokenizer directory (as training's
            ``--tokenizer-model``).
        workers: tokenising processes; 0 tokenises in this process.
        skip_bad_lines: skip and count bad lines instead of stopping at the first.
        chunk_lines: lines per unit of work.
        progress: show a progress bar (tqdm, on stderr).

    Raises:
        ValueError: the input is missing, a line is bad (without ``skip_bad_lines``), or no sample is left.
    """
    if not os.path.isfile(input_path):
        raise ValueError(f"--input {input_path!r} is not a file")
    if workers < 0 or chunk_lines < 1:
        raise ValueError(
            f"--workers must be >= 0 and --chunk-lines >= 1, got {workers}, {chunk_lines}"
        )
    loaded = load_tokenizer(tokenizer)
    writer = IndexedSFTWriter(output_prefix, loaded)
    bad = BadLines()
    start = time.perf_counter()
    bar = tqdm(
        total=os.path.getsize(input_path),
        unit="B",
        unit_scale=True,
        desc="tokenising",
        disable=not progress,
        file=sys.stderr,
    )
    pool = None
    try:
        chunks = _chunks(input_path, chunk_lines, bar)
        if workers == 0:
            _init_worker(loaded)
            results = map(_tokenize_chunk, chunks)
        else:
            pool = multiprocessing.get_context("fork" if os.name == "posix" else "spawn").Pool(
                workers, initializer=_init_worker, initargs=(tokenizer,)
            )
            results = pool.imap(_tokenize_chunk, chunks)
        for tokens, masks, lengths, errors in results:
            for error in errors:
                if not skip_bad_lines:
                    raise ValueError(f"{error}; fix the line or pass --skip-bad-lines")
                bad.add(ValueError(error))
            writer.add(tokens, masks, lengths)
        sidecar = writer.finish(source=input_path, skipped_lines=bad.count)
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    bad.log(input_path)
    elapsed = time.perf_counter() - start
    logger.info(
        "%s -> %s: %d samples, %d tokens (%d with loss) in %.1f s (%.0f samples/s), %d bad lines skipped",
        input_path,
        output_prefix,
        sidecar["num_samples"],
        sidecar["num_tokens"],
        sidecar["num_loss_tokens"],
        elapsed,
        sidecar["num_samples"] / elapsed if elapsed > 0 else float("inf"),
        bad.count,
    )
    return sidecar


def build_parser() -> argparse.ArgumentParser:
    """Returns the command-line parser."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_odc.data.preprocess", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--input", required=True, help="SFT JSONL file")
    parser.add_argument("--output-prefix", required=True, help="output path without extension")
    parser.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (ByteTokenizer, the default) or a local Hugging Face tokenizer directory; "
        "train with the same one",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="tokenising processes (0: in this process)",
    )
    parser.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip and count lines that are not valid UTF-8 / JSON / records instead of stopping",
    )
    parser.add_argument("--chunk-lines", type=int, default=1024, help="lines per unit of work")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        preprocess(
            args.input,
            args.output_prefix,
            tokenizer=args.tokenizer,
            workers=args.workers,
            skip_bad_lines=args.skip_bad_lines,
            chunk_lines=args.chunk_lines,
            progress=not args.no_progress,
        )
    except ValueError as exc:
        logger.error("error: %s", exc)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
