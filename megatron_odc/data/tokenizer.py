"""Tokenizers for the SFT data pipeline: a byte-level fallback and a local Hugging Face loader.

Owns the tokenizer protocol the rest of ``megatron_odc.data`` relies on (``encode``, ``eos_id``,
``pad_id``, ``vocab_size``, plus the optional ``bos_id``, ``role_prefix_ids`` and chat-template hooks)
and two implementations: :class:`ByteTokenizer` (UTF-8 bytes plus a few special ids; needs no download,
the CPU default) and :class:`HFTokenizer`, returned by :func:`load_tokenizer` for a local Hugging Face
tokenizer directory. ``transformers`` is optional: it is imported only inside :func:`load_tokenizer`.
Nothing here imports megatron.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
"""Message roles understood by the SFT pipeline."""


@runtime_checkable
class Tokenizer(Protocol):
    """What :mod:`megatron_odc.data.sft` needs from a tokenizer.

    Optional extras, looked up with ``getattr``: ``bos_id`` (prepended to every sample when not
    None), ``encode_array(text)`` (``encode`` as an int64 numpy array, faster),
    ``role_prefix_ids(role)`` (the ids that open a message of that role in the simple
    role-marker template; defaults to ``encode(f"<|{role}|>\\n")``), and ``has_chat_template`` plus
    ``encode_chat(messages, add_generation_prompt)`` (a model's own chat template).
    """

    eos_id: int
    pad_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Returns the token ids of ``text`` (no special tokens added)."""
        ...


class ByteTokenizer:
    """UTF-8 byte-level tokenizer: ids 0-255 are bytes, then bos, eos, pad and one marker per role.

    Needs no vocabulary file. ``decode(encode(text)) == text`` for every string.

    Attributes:
        bos_id: id prepended to every sample.
        eos_id: id closing every assistant turn.
        pad_id: id used for padding.
        role_ids: role name -> the single marker id that opens a message of that role.
        vocab_size: number of ids (262).
    """

    NUM_BYTE_IDS = 256

    def __init__(self) -> None:
        self.bos_id: int = self.NUM_BYTE_IDS
        self.eos_id: int = self.NUM_BYTE_IDS + 1
        self.pad_id: int = self.NUM_BYTE_IDS + 2
        self.role_ids: dict[str, int] = {
            role: self.NUM_BYTE_IDS + 3 + i for i, role in enumerate(ROLES)
        }
        self.vocab_size: int = self.NUM_BYTE_IDS + 3 + len(ROLES)
        self.has_chat_template: bool = False

    def encode(self, text: str) -> list[int]:
        """Returns the UTF-8 bytes of ``text`` as ids."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """:meth:`encode` as an int64 array, without a Python list (the preprocessing hot path)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        """Decodes byte ids to text; special ids are dropped, invalid UTF-8 is replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < self.NUM_BYTE_IDS).decode(
            "utf-8", errors="replace"
        )

    def role_prefix_ids(self, role: str) -> list[int]:
        """Returns the one-id marker that opens a message of ``role``."""
        if role not in self.role_ids:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        return [self.role_ids[role]]


class HFTokenizer:
    """Adapter from a ``transformers`` tokenizer to the :class:`Tokenizer` protocol.

    Args:
        hf_tokenizer: a loaded ``transformers`` tokenizer (``PreTrainedTokenizerBase``-like).
        use_chat_template: use the tokenizer's chat template when it has one; when False (or when
            the tokenizer has none) the simple role-marker template of :mod:`.sft` is used.

    Attributes:
        bos_id: the tokenizer's ``bos_token_id`` (may be None).
        eos_id: ``eos_token_id``.
        pad_id: ``pad_token_id``, else ``eos_token_id``.
        vocab_size: ``len(hf_tokenizer)`` (includes added tokens).
        has_chat_template: whether :meth:`encode_chat` is used by the SFT pipeline.
    """

    def __init__(self, hf_tokenizer: Any, *, use_chat_template: bool = True) -> None:
        self.hf = hf_tokenizer
        eos_id = getattr(hf_tokenizer, "eos_token_id", None)
        if eos_id is None:
            raise ValueError(
                f"tokenizer {getattr(hf_tokenizer, 'name_or_path', hf_tokenizer)!r} has no "
                "eos_token_id; SFT samples need an end-of-sequence token"
            )
        pad_id = getattr(hf_tokenizer, "pad_token_id", None)
        self.bos_id: int | None = getattr(hf_tokenizer, "bos_token_id", None)
        self.eos_id: int = int(eos_id)
        self.pad_id: int = int(pad_id) if pad_id is not None else int(eos_id)
        self.vocab_size: int = len(hf_tokenizer)
        self.has_chat_template: bool = bool(
            use_chat_template and getattr(hf_tokenizer, "chat_template", None)
        )

    def encode(self, text: str) -> list[int]:
        """Returns the ids of ``text`` without special tokens."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Decodes ids with the wrapped tokenizer."""
        return self.hf.decode(list(ids))

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool
    ) -> list[int]:
        """Returns the ids of ``messages`` rendered by the tokenizer's chat template."""
        ids = self.hf.apply_chat_template(
            [dict(m) for m in messages], tokenize=True, add_generation_prompt=add_generation_prompt
        )
        if isinstance(ids, Mapping):  # newer transformers may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "*.tiktoken",
)
"""Files of which a Hugging Face tokenizer directory holds at least one (fast, config, sentencepiece,
BPE, WordPiece, tiktoken)."""


def _has_tokenizer_files(path: str) -> bool:
    """Whether ``path`` holds any of :data:`TOKENIZER_FILES`."""
    return any(glob.glob(os.path.join(glob.escape(path), name)) for name in TOKENIZER_FILES)


def load_tokenizer(path_or_name: str | os.PathLike[str], *, use_chat_template: bool = True):
    """Loads a tokenizer for the SFT pipeline.

    Args:
        path_or_name: ``"byte"`` for :class:`ByteTokenizer`, else a local Hugging Face tokenizer
            directory (nothing is downloaded).
        use_chat_template: see :class:`HFTokenizer`.

    Returns:
        A :class:`ByteTokenizer` or an :class:`HFTokenizer`.

    Raises:
        ValueError: the directory does not exist, ``transformers`` is not installed, or the
            tokenizer cannot be loaded.
    """
    if str(path_or_name) == "byte":
        return ByteTokenizer()
    path = os.fspath(path_or_name)
    if not os.path.isdir(path):
        raise ValueError(
            f"tokenizer path {path!r} is not a directory; pass a local Hugging Face tokenizer "
            "directory or 'byte' for the byte-level fallback"
        )
    try:
        import transformers
    except ImportError as exc:
        raise ValueError(
            f"loading the tokenizer at {path!r} needs the optional package 'transformers' "
            "(pip install transformers), or use 'byte' for the byte-level fallback"
        ) from exc
    try:
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        if not _has_tokenizer_files(path):
            raise ValueError(
                f"{path!r} holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): copy "
                "the model's tokenizer files there, or use 'byte' for the byte-level fallback"
            ) from exc
        reason = " ".join(str(exc).split())  # transformers' messages span several lines
        raise ValueError(
            f"could not load a Hugging Face tokenizer from {path!r}: {reason}"
        ) from exc
    tokenizer = HFTokenizer(hf_tokenizer, use_chat_template=use_chat_template)
    logger.info(
        "loaded tokenizer %s (vocab %d, chat template: %s)",
        path,
        tokenizer.vocab_size,
        tokenizer.has_chat_template,
    )
    return tokenizer
