"""A local chat JSONL and Hugging Face tokenizer for Megatron-LM's ``pretrain_gpt.py --sft``, made at
run time (nothing downloaded, nothing committed).

:func:`write_sft_example` writes ``<out>/chats.jsonl`` (one conversation per line in Megatron-LM's
``SFTDataset`` format: ``{"messages": [system, user, assistant]}``) whose lengths follow a shipped length
profile (``megatron_odc/balance/length_profiles.json``) scaled so that its longest sample has
``max_tokens`` tokens, and ``<out>/tokenizer/``: a word-level tokenizer (``tokenizers``' ``WordLevel``,
loaded by ``transformers.AutoTokenizer``) with the special tokens of Megatron-LM's
``nemotron-h-aligned`` SFT prompt format (``<SPECIAL_10>``, ``<SPECIAL_11>``, pad ``<SPECIAL_233>``) and
an end-of-sequence token. Every word of the text is one token, so a record's length is what was drawn.

``python -m megatron_odc.integration.megatron_lm.sft_example OUT [--num-records N] [--profile P]
[--max-tokens T] [--seed S]`` prints the two paths (the README's SFT recipe).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from megatron_odc.balance.profiles import load_profile_lengths

WORDS = 256
"""Distinct content words (``w0`` ... ``w255``)."""

SPECIAL_TOKENS = ("<unk>", "<eos>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_233>")
"""The tokenizer's special tokens: unknown, end of sequence, and those of the ``nemotron-h-aligned``
prompt format (system marker, user / assistant marker, padding)."""

ROLE_WORDS = ("System", "User", "Assistant")

TEMPLATE_TOKENS = 7
"""Tokens the ``nemotron-h-aligned`` template adds to a system + user + assistant conversation
(``<SPECIAL_10> System``, ``<SPECIAL_11> User``, ``<SPECIAL_11> Assistant``, and the end of sequence
Megatron-LM appends)."""


def write_tokenizer(out: Path) -> Path:
    """Writes the word-level tokenizer to ``out`` (a directory) and returns it."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *ROLE_WORDS))}
    for i in range(WORDS):
        vocab[f"w{i}"] = len(vocab)
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "eos_token": "<eos>",
        "pad_token": "<SPECIAL_233>",
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(f"w{rng.randrange(WORDS)}" for _ in range(num_words))


def write_chats(
    path: Path, num_records: int, *, profile: str, max_tokens: int, seed: int
) -> list[int]:
    """Writes ``num_records`` conversations to ``path``; returns each one's token count.

    A length is drawn (seeded, with replacement) from the profile, scaled so that the profile's
    longest sample maps to ``max_tokens`` and clamped to ``[TEMPLATE_TOKENS + 3, max_tokens]``.
    """
    if num_records < 1:
        raise ValueError(f"num_records must be positive, got {num_records}")
    if max_tokens < TEMPLATE_TOKENS + 3:
        raise ValueError(f"max_tokens must be at least {TEMPLATE_TOKENS + 3}, got {max_tokens}")
    lengths = load_profile_lengths(profile)
    scale = max_tokens / max(lengths)
    rng = random.Random(f"megatron_odc.megatron_lm_sft:{profile}:{seed}")
    drawn = [
        min(max(round(rng.choice(lengths) * scale), TEMPLATE_TOKENS + 3), max_tokens)
        for _ in range(num_records)
    ]
    return write_chats_of_lengths(path, drawn, seed=seed)


def write_chats_of_lengths(path: Path, lengths: list[int], *, seed: int = 0) -> list[int]:
    """Writes one conversation of each length (tokens, at least ``TEMPLATE_TOKENS + 3``) to
    ``path``: the words beyond the template are split between system (1-3), user and assistant (at
    least 1 each). Returns ``lengths``."""
    rng = random.Random(f"megatron_odc.megatron_lm_sft.text:{seed}")
    with open(path, "w", encoding="utf-8") as f:
        for length in lengths:
            words = length - TEMPLATE_TOKENS
            if words < 3:
                raise ValueError(f"a conversation needs at least {TEMPLATE_TOKENS + 3} tokens")
            system = min(rng.randint(1, 3), words - 2)
            user = rng.randint(1, words - system - 1)
            assistant = words - system - user
            messages = [
                {"role": "system", "content": _text(rng, system)},
                {"role": "user", "content": _text(rng, user)},
                {"role": "assistant", "content": _text(rng, assistant)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return list(lengths)


def write_sft_example(
    out: str | Path,
    *,
    num_records: int = 256,
    profile: str = "swe_smith",
    max_tokens: int = 128,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Writes ``out/chats.jsonl`` and ``out/tokenizer/``; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(out / "tokenizer")
    chats = out / "chats.jsonl"
    write_chats(chats, num_records, profile=profile, max_tokens=max_tokens, seed=seed)
    return chats, tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--num-records", type=int, default=256)
    parser.add_argument("--profile", default="swe_smith")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    chats, tokenizer = write_sft_example(
        args.out,
        num_records=args.num_records,
        profile=args.profile,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    print(f"data {chats}\ntokenizer {tokenizer}")


if __name__ == "__main__":
    main()
