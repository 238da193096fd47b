"""Megatron-LM's ``--sft`` data (a JSONL of chats) when its reader fails: the file and line named.

``SFTLowLevelDataset`` (``megatron.training.datasets.sft_dataset``, every supported tag) reads
``--data-path`` with Hugging Face ``datasets``' JSON builder, which fails on an empty file with a bare
``StopIteration`` and on a malformed line with a ``DatasetGenerationError`` traceback.
:func:`name_bad_sft_data` wraps its ``__init__`` for the rest of the process (run with ``--sft``'s
argument handling, ``sft.apply_sft_args``, so the launcher and a patched source both get it): when
the reader raises, :func:`first_problem` scans the file and the error becomes one line naming the
file, the line and what is wrong; a reader that succeeds costs nothing more.
"""

from __future__ import annotations

import functools
import importlib
import json
from typing import Any

from megatron_odc.data.sft import parse_line

SFT_DATASET_MODULE = "megatron.training.datasets.sft_dataset"
"""Where every supported tag defines ``SFTLowLevelDataset``."""


def first_problem(path: str) -> str | None:
    """The first thing wrong with ``path`` as Megatron-LM's SFT JSONL, ``"file:line: ..."`` (the
    plugin's own record checks, ``data.sft.parse_line``: UTF-8, JSON, roles and contents, an
    assistant message; then Megatron-LM's: a ``"messages"`` list whose every conversation, from a
    ``system`` message on, holds a message of another role), or None."""
    records = 0
    try:
        with open(path, "rb") as lines:
            for number, raw in enumerate(lines, 1):
                where = f"{path}:{number}"
                try:
                    messages = parse_line(raw, where)
                except ValueError as error:
                    return str(error)
                if messages is None:
                    continue
                if "messages" not in json.loads(raw):
                    return f"{where}: Megatron-LM's SFTDataset reads a 'messages' list only"
                if not _every_conversation_has_a_turn(messages):
                    return f"{where}: a conversation holds a system message alone"
                records += 1
    except OSError as error:
        return f"{path}: cannot be read ({error})"
    return None if records else f"{path}: holds no records"


def _every_conversation_has_a_turn(messages: list[dict[str, str]]) -> bool:
    """Megatron-LM splits a record into conversations at each system message and tokenizes each."""
    turns: list[bool] = []
    for message in messages:
        if message["role"] == "system" or not turns:
            turns.append(False)
        if message["role"] != "system":
            turns[-1] = True
    return all(turns)


def _wrap_init(original: Any) -> Any:
    @functools.wraps(original)
    def init(self, dataset_path: str, *args: Any, **kwargs: Any) -> None:
        try:
            original(self, dataset_path, *args, **kwargs)
        except Exception as error:  # the user's data through datasets' reader: any error
            problem = first_problem(str(dataset_path))
            if problem is None:  # the file reads well here: datasets' own failure
                problem = f"{dataset_path}: {type(error).__name__}: {error}"
            raise ValueError(
                f"--sft data {problem}; Megatron-LM's SFTDataset reads one JSON object per line "
                "with a 'messages' list of {'role', 'content'} (docs/data.md)"
            ) from error

    init.__megatron_odc_original__ = original
    return init


def name_bad_sft_data() -> bool:
    """Wrap ``SFTLowLevelDataset.__init__`` (once) so that a reader error names the file and line;
    returns whether the class exists here."""
    try:
        cls = importlib.import_module(SFT_DATASET_MODULE).SFTLowLevelDataset
    except (ImportError, AttributeError):
        return False
    if not hasattr(cls.__dict__["__init__"], "__megatron_odc_original__"):
        cls.__init__ = _wrap_init(cls.__dict__["__init__"])
    return True
