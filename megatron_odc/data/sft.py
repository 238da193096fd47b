"""SFT samples: JSONL reading, conversation tokenisation, response-only loss masks.

Owns :class:`SFTSample` (token ids plus a token-aligned loss mask), :func:`tokenize_conversation`,
:class:`SFTDataset` (a JSONL file tokenised once, with cached per-sample lengths and loss-token
counts for the sampler and the global loss normalisation) and :func:`make_synthetic_sft` (a small
JSONL with a realistic length distribution for CPU runs). Packing samples into a microbatch lives in
:mod:`.packing`. Nothing here imports megatron.

Accepted JSONL lines: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
or ``{"prompt": str, "response": str}`` (optionally with ``"system": str``). Other keys are ignored.
Blank lines are skipped. Only assistant/response tokens and the end-of-turn token after each of them
carry loss.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import random
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch

from megatron_odc.data.tokenizer import ROLES

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SFTSample:
    """One tokenised conversation.

    Attributes:
        tokens: int64 ``[L]`` token ids.
        loss_mask: bool ``[L]``; ``loss_mask[t]`` is True when token ``t`` is a response token (or
            the end-of-turn token after a response), i.e. when predicting it carries loss. It is
            aligned with the *tokens*; :mod:`.packing` shifts it onto the labels.
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor

    def __post_init__(self) -> None:
        assert self.tokens.dim() == 1
        assert self.tokens.shape == self.loss_mask.shape

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_loss_tokens(self) -> int:
        """Number of positions whose next-token prediction carries loss (``loss_mask[1:]``)."""
        return int(self.loss_mask[1:].sum())

    def truncate(self, length: int) -> SFTSample:
        """Returns the first ``length`` tokens of this sample (itself when not longer)."""
        if length < 1:
            raise ValueError(f"cannot truncate a sample to {length} tokens; need at least 1")
        if length >= len(self):
            return self
        return SFTSample(self.tokens[:length], self.loss_mask[:length])


def parse_record(record: object, where: str) -> list[dict[str, str]]:
    """Validates one decoded JSONL record and returns its messages.

    Args:
        record: the decoded JSON value of one line.
        where: ``"file:line"`` used in error messages.

    Returns:
        A list of ``{"role", "content"}`` dicts with at least one assistant message.

    Raises:
        ValueError: the record has neither format, a bad role or content, or no assistant message.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        raw = record["messages"]
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"{where}: 'messages' must be a non-empty list")
        messages = []
        for i, msg in enumerate(raw):
            if not isinstance(msg, Mapping) or "role" not in msg or "content" not in msg:
                raise ValueError(
                    f"{where}: message {i} must be an object with 'role' and 'content'"
                )
            if msg["role"] not in ROLES:
                raise ValueError(
                    f"{where}: message {i} has role {msg['role']!r}; expected one of {ROLES}"
                )
            if not isinstance(msg["content"], str):
                raise ValueError(f"{where}: message {i} content must be a string")
            messages.append({"role": msg["role"], "content": msg["content"]})
    elif "prompt" in record and "response" in record:
        for key in ("prompt", "response", "system"):
            if key in record and not isinstance(record[key], str):
                raise ValueError(f"{where}: {key!r} must be a string")
        messages = [{"role": "system", "content": record["system"]}] if "system" in record else []
        messages += [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
    else:
        raise ValueError(
            f"{where}: expected a 'messages' list or 'prompt' and 'response' keys, got keys "
            f"{sorted(record)}"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message, so the sample would carry no loss")
    return messages


def _role_prefix_ids(tokenizer, role: str) -> list[int]:
    prefix = getattr(tokenizer, "role_prefix_ids", None)
    return list(prefix(role)) if prefix is not None else list(tokenizer.encode(f"<|{role}|>\n"))


def _encode(tokenizer, text: str) -> np.ndarray:
    fast = getattr(tokenizer, "encode_array", None)
    if fast is not None:
        return fast(text)
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def conversation_arrays(
    messages: Sequence[Mapping[str, str]], tokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenises a conversation and masks loss to the assistant turns: int64 ids and a bool mask.

    Without a chat template the layout is ``[bos] (role_prefix content [eos if assistant])*``, with
    loss on the assistant contents and their eos. With a chat template
    (``tokenizer.has_chat_template``) the loss span of assistant message ``i`` is what rendering
    ``messages[:i+1]`` adds to rendering ``messages[:i]`` with a generation prompt; the template must
    render earlier turns identically when later turns are added.

    Args:
        messages: ``{"role", "content"}`` dicts (see :func:`parse_record`).
        tokenizer: any object following :class:`megatron_odc.data.tokenizer.Tokenizer`.

    Raises:
        ValueError: the chat template is not prefix-stable.
    """
    if getattr(tokenizer, "has_chat_template", False):
        ids = tokenizer.encode_chat(messages, add_generation_prompt=False)
        mask = np.zeros(len(ids), dtype=bool)
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            before = tokenizer.encode_chat(messages[:i], add_generation_prompt=True) if i else []
            upto = tokenizer.encode_chat(messages[: i + 1], add_generation_prompt=False)
            if upto[: len(before)] != before or ids[: len(upto)] != upto:
                raise ValueError(
                    f"the tokenizer's chat template renders assistant message {i} differently "
                    "once later messages follow, so its loss span cannot be found; load the "
                    "tokenizer with use_chat_template=False"
                )
            mask[len(before) : len(upto)] = True
        return np.asarray(ids, dtype=np.int64), mask
    bos_id = getattr(tokenizer, "bos_id", None)
    pieces: list[np.ndarray] = [np.array([bos_id] if bos_id is not None else [], dtype=np.int64)]
    masks: list[np.ndarray] = [np.zeros(len(pieces[0]), dtype=bool)]
    for msg in messages:
        prefix = np.asarray(_role_prefix_ids(tokenizer, msg["role"]), dtype=np.int64)
        content = _encode(tokenizer, msg["content"])
        pieces += [prefix, content]
        masks.append(np.zeros(len(prefix), dtype=bool))
        if msg["role"] == "assistant":
            pieces.append(np.array([tokenizer.eos_id], dtype=np.int64))
            masks.append(np.ones(len(content) + 1, dtype=bool))
        else:
            masks.append(np.zeros(len(content), dtype=bool))
    return np.concatenate(pieces), np.concatenate(masks)


def tokenize_conversation(messages: Sequence[Mapping[str, str]], tokenizer) -> SFTSample:
    """:func:`conversation_arrays` as an :class:`SFTSample`."""
    ids, mask = conversation_arrays(messages, tokenizer)
    return SFTSample(torch.from_numpy(ids), torch.from_numpy(mask))


def parse_line(raw: bytes, where: str) -> list[dict[str, str]] | None:
    """Decodes one raw JSONL line: its messages, or None for a blank line.

    Raises:
        ValueError: invalid UTF-8 (with the byte offset), invalid JSON, or not a valid record; the message
            starts with ``where`` (``file:line``).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: invalid UTF-8 at byte {exc.start} of the line") from None
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
    return parse_record(record, where)


@dataclasses.dataclass
class BadLines:
    """Lines skipped with ``skip_bad_lines``: how many, and the first error (for the log)."""

    count: int = 0
    first_error: str | None = None

    def add(self, error: ValueError) -> None:
        self.count += 1
        if self.first_error is None:
            self.first_error = str(error)

    def log(self, path: str) -> None:
        if self.count:
            logger.warning(
                "%s: skipped %d bad line(s) (--skip-bad-lines); the first: %s",
                path,
                self.count,
                self.first_error,
            )


def read_jsonl(
    path: str | os.PathLike[str], *, skip_bad_lines: bool = False
) -> list[tuple[int, list[dict[str, str]]]]:
    """Reads and validates an SFT JSONL file.

    Args:
        path: the file.
        skip_bad_lines: skip (and count, in one warning) lines that are not valid UTF-8, not valid
            JSON or not a valid record, instead of failing on the first.

    Returns:
        ``(line_number, messages)`` per non-blank line, line numbers starting at 1.

    Raises:
        ValueError: the file is missing or holds no sample, or a line is bad and ``skip_bad_lines`` is
            off (the message names the file and line).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"SFT data file {path!r} does not exist")
    records = []
    bad = BadLines()
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                messages = parse_line(raw, f"{path}:{line_number}")
            except ValueError as exc:
                if not skip_bad_lines:
                    raise ValueError(f"{exc}; fix the line or pass --skip-bad-lines") from None
                bad.add(exc)
                continue
            if messages is not None:
                records.append((line_number, messages))
    bad.log(path)
    if not records:
        raise ValueError(f"SFT data file {path!r} holds no samples")
    return records


class SFTSamples(Protocol):
    """What packing and the loss normalisation read from a dataset: :class:`SFTDataset` (JSONL) or
    :class:`~megatron_odc.data.indexed_sft.IndexedSFTDataset` (preprocessed, memory-mapped)."""

    lengths: Sequence[int]
    num_loss_tokens: Sequence[int]

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> SFTSample: ...

    def loss_token_count(self, index: int, length: int | None = None) -> int: ...


class SFTDataset:
    """A JSONL SFT file, tokenised once at construction.

    Args:
        path: the JSONL file (see the module docstring for the formats).
        tokenizer: a :class:`megatron_odc.data.tokenizer.Tokenizer`.
        max_length: when set, samples are cut to their first ``max_length`` tokens.
        skip_bad_lines: see :func:`read_jsonl`.

    Attributes:
        lengths: tokens per sample (after ``max_length``); feed it to the sampler.
        num_loss_tokens: per sample, the positions whose prediction carries loss.
        line_numbers: the JSONL line of each sample.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tokenizer,
        max_length: int | None = None,
        *,
        skip_bad_lines: bool = False,
    ):
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be at least 2 tokens, got {max_length}")
        self.path = os.fspath(path)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self._samples: list[SFTSample] = []
        self.line_numbers: list[int] = []
        num_truncated = 0
        for line_number, messages in read_jsonl(self.path, skip_bad_lines=skip_bad_lines):
            sample = tokenize_conversation(messages, tokenizer)
            if max_length is not None and len(sample) > max_length:
                sample = sample.truncate(max_length)
                num_truncated += 1
            self._samples.append(sample)
            self.line_numbers.append(line_number)
        self.lengths: list[int] = [len(s) for s in self._samples]
        self.num_loss_tokens: list[int] = [s.num_loss_tokens for s in self._samples]
        if num_truncated:
            logger.warning(
                "%s: %d of %d samples truncated to max_length=%d",
                self.path,
                num_truncated,
                len(self._samples),
                max_length,
            )

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: int) -> SFTSample:
        return self._samples[index]

    def loss_token_count(self, index: int, length: int | None = None) -> int:
        """Loss-carrying positions of sample ``index`` when cut to ``length`` tokens (cached if not cut)."""
        if length is None or length >= self.lengths[index]:
            return self.num_loss_tokens[index]
        return self._samples[index].truncate(length).num_loss_tokens


_DEFAULT_PROFILE_MEDIAN = 13800.0
_DEFAULT_PROFILE_SIGMA = 0.62
_DEFAULT_PROFILE_RANGE = (1024, 65536)
_WORDS = [
    "the",
    "model",
    "reads",
    "a",
    "long",
    "document",
    "and",
    "answers",
    "questions",
    "about",
    "data",
    "parallel",
    "training",
    "with",
    "sharded",
    "parameters",
    "gradients",
    "optimizer",
    "states",
    "microbatch",
    "minibatch",
    "balance",
    "cost",
    "token",
]


def _text(rng: random.Random, num_bytes: int) -> str:
    words: list[str] = []
    size = -1
    while size < num_bytes:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    text = " ".join(words)[:num_bytes]
    return text[:-1] + "." if text.endswith(" ") else text


def _split(rng: random.Random, total: int, num_parts: int) -> list[int]:
    """Splits ``total`` >= num_parts into ``num_parts`` positive random sizes."""
    cuts = sorted(rng.sample(range(1, total), num_parts - 1))
    bounds = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(bounds)]


def make_synthetic_sft(
    path: str | os.PathLike[str],
    num_samples: int,
    seed: int,
    length_profile: Sequence[int] | None = None,
    *,
    max_tokens: int = 256,
    min_tokens: int = 8,
) -> list[int]:
    """Writes a small SFT JSONL whose sample lengths follow a length distribution scaled down.

    Lengths are drawn (with replacement, seeded) from ``length_profile`` and scaled so that the
    profile's maximum maps to ``max_tokens``; without a profile they follow a LongAlign-like
    log-normal (median 13.8K, sigma 0.62, clipped to [1K, 64K]) scaled by ``max_tokens / 65536``.
    Scaled lengths are clamped to ``[min_tokens, max_tokens]``. The lines mix both JSONL formats,
    single- and two-turn conversations and optional system prompts; the text is ASCII so that each
    sample has exactly the drawn length under :class:`~megatron_odc.data.tokenizer.ByteTokenizer`.

    Args:
        path: the JSONL file to write (overwritten).
        num_samples: number of lines.
        seed: seed of the draw and the text.
        length_profile: token lengths to imitate (e.g. a profile of
            ``megatron_odc/balance/length_profiles.json``), or None.
        max_tokens: the scaled length of the profile's longest sample.
        min_tokens: the shortest sample (at least 8).

    Returns:
        The length of each written sample under ``ByteTokenizer``.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    if min_tokens < 8 or max_tokens < min_tokens:
        raise ValueError(
            f"need 8 <= min_tokens <= max_tokens, got min_tokens={min_tokens}, "
            f"max_tokens={max_tokens}"
        )
    if length_profile is not None and (
        not length_profile or min(int(x) for x in length_profile) < 1
    ):
        raise ValueError("length_profile must be a non-empty list of positive lengths")
    rng = random.Random(f"megatron_odc.synthetic_sft:{seed}")
    if length_profile is not None:
        profile = [int(x) for x in length_profile]
        scale = max_tokens / max(profile)
    else:
        profile = None
        scale = max_tokens / _DEFAULT_PROFILE_RANGE[1]
    lengths = []
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_samples):
            if profile is not None:
                raw = rng.choice(profile)
            else:
                raw = rng.lognormvariate(math.log(_DEFAULT_PROFILE_MEDIAN), _DEFAULT_PROFILE_SIGMA)
                raw = min(max(raw, _DEFAULT_PROFILE_RANGE[0]), _DEFAULT_PROFILE_RANGE[1])
            length = min(max(round(raw * scale), min_tokens), max_tokens)
            style = rng.randrange(4)
            if style == 0:  # prompt/response: bos, user, assistant, eos
                prompt, response = _split(rng, length - 4, 2)
                record = {"prompt": _text(rng, prompt), "response": _text(rng, response)}
            elif style == 1:  # prompt/response with system: one more marker
                system, prompt, response = _split(rng, length - 5, 3)
                record = {
                    "system": _text(rng, system),
                    "prompt": _text(rng, prompt),
                    "response": _text(rng, response),
                }
            elif style == 2 or length < 9 + 4:  # one-turn messages
                prompt, response = _split(rng, length - 4, 2)
                record = {
                    "messages": [
                        {"role": "user", "content": _text(rng, prompt)},
                        {"role": "assistant", "content": _text(rng, response)},
                    ]
                }
            else:  # two turns: bos, 4 markers, 2 eos
                sizes = _split(rng, length - 7, 4)
                roles = ("user", "assistant", "user", "assistant")
                record = {
                    "messages": [
                        {"role": r, "content": _text(rng, n)}
                        for r, n in zip(roles, sizes, strict=True)
                    ]
                }
            f.write(json.dumps(record) + "\n")
            lengths.append(length)
    return lengths
