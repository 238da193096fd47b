"""Tiny random Hugging Face models and SFT data, made offline for the HF bridge tests.

Each model is ``config -> model -> save_pretrained`` with transformers, plus a word-level tokenizer built
with ``tokenizers`` (no download). Shapes are uneven on purpose: 6 query heads in 2 key/value groups, an
MLP width of 80, and a vocabulary of 61 that TP=2 must pad to 62.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["cats", "sit", "on", "warm", "mats", "while", "dogs", "run", "far", "from", "home"]
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|", "|>", "system", "user", "assistant"]
VOCAB_SIZE = 61
"""The HF config's vocabulary (the tokenizer uses the first ``len(SPECIAL) + len(WORDS)`` ids)."""


def write_tokenizer(path: Path) -> None:
    """A word-level tokenizer (whitespace and punctuation split) of ``SPECIAL + WORDS``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(dict.fromkeys([*SPECIAL, *WORDS]))}
    assert len(vocab) <= VOCAB_SIZE
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.save_pretrained(str(path))


def write_tiny_model(path: Path, arch: str, *, seed: int = 0) -> Path:
    """A random ``arch`` model saved to ``path``: "llama" (untied embeddings), "qwen2" (tied, QKV
    bias) or "qwen3" (tied, QK norms, head width 12)."""
    import torch
    import transformers

    shape = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
    }
    torch.manual_seed(seed)
    if arch == "llama":
        config = transformers.LlamaConfig(tie_word_embeddings=False, **shape)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(tie_word_embeddings=True, **shape)
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():  # a random init leaves the QKV biases at zero: make them count
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.5)
    elif arch == "qwen3":  # QK norms, and a head width (12) that is not hidden / heads (8)
        config = transformers.Qwen3Config(tie_word_embeddings=True, head_dim=12, **shape)
        model = transformers.Qwen3ForCausalLM(config)
        with torch.no_grad():  # a random init leaves the norms at one: make them count
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    else:
        raise ValueError(arch)
    model.save_pretrained(str(path))
    write_tokenizer(path)
    return path


def write_sft_jsonl(path: Path, num_samples: int, *, seed: int = 0) -> Path:
    """``num_samples`` prompt/response records of 3-15 words each."""
    rng = random.Random(seed)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15)))

    with open(path, "w") as f:
        for _ in range(num_samples):
            f.write(json.dumps({"prompt": sentence(), "response": sentence()}) + "\n")
    return path
