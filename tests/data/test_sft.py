"""Tests of megatron_odc.data: SFT JSONL and tokenisation, packing, and exact global loss weights.

Layer 1 (pure functions, no process group). Oracles: hand-built token layouts, a mask built by loops,
each sample run separately through a tiny causal attention LM, and the global per-token mean loss
computed directly over unpacked samples. DP ranks are simulated in one process: every rank's
microbatches run on the same model and their gradients add up, as the ODC push does.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import types

import pytest
import torch

from megatron_odc.balance.plan import PLAN_KINDS
from megatron_odc.data import (
    ByteTokenizer,
    LengthBalancedSampler,
    SFTDataset,
    SFTSample,
    global_loss_token_count,
    load_microbatch,
    load_tokenizer,
    loss_weights,
    make_synthetic_sft,
    pack_microbatch,
    tokenize_conversation,
)


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# SFT reading and tokenisation #


def test_prompt_response_layout_and_mask(tmp_path):
    tok = ByteTokenizer()
    path = _write(tmp_path / "a.jsonl", [json.dumps({"prompt": "hi", "response": "ok!"})])
    sample = SFTDataset(path, tok)[0]
    user, assistant = tok.role_ids["user"], tok.role_ids["assistant"]
    expected = [tok.bos_id, user, *b"hi", assistant, *b"ok!", tok.eos_id]
    mask = [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert sample.tokens.tolist() == expected
    assert sample.loss_mask.int().tolist() == mask
    assert sample.num_loss_tokens == 4


def test_messages_format_masks_only_assistant_turns(tmp_path):
    tok = ByteTokenizer()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "héllo ✓"},
        {"role": "assistant", "content": "日本"},
    ]
    path = _write(tmp_path / "m.jsonl", ["", json.dumps({"messages": messages}), "  "])
    ds = SFTDataset(path, tok)
    assert len(ds) == 1
    assert ds.line_numbers == [2]
    sample = ds[0]
    ids, mask = sample.tokens.tolist(), sample.loss_mask.tolist()
    # Masked ids are exactly the assistant contents, each followed by eos.
    masked = [i for i, m in zip(ids, mask, strict=True) if m]
    assert masked == [*b"4", tok.eos_id, *"日本".encode(), tok.eos_id]
    # Unmasked ids decode to the other messages, in order.
    unmasked = [i for i, m in zip(ids, mask, strict=True) if not m]
    assert tok.decode(unmasked) == "be brief2+2?héllo ✓"
    assert ids.count(tok.role_ids["assistant"]) == 2
    assert ds.lengths == [len(ids)]
    assert ds.num_loss_tokens == [len(masked)]


def test_bad_lines_name_file_and_line(tmp_path):
    good = json.dumps({"prompt": "a", "response": "b"})
    bad_lines = {
        "not json": "invalid JSON",
        "[1, 2]": "JSON object",
        json.dumps({"text": "x"}): "'messages' list or 'prompt'",
        json.dumps({"messages": []}): "non-empty",
        json.dumps({"messages": [{"role": "bot", "content": "x"}]}): "role 'bot'",
        json.dumps({"messages": [{"role": "user", "content": 3}]}): "content",
        json.dumps({"messages": [{"role": "user", "content": "x"}]}): "no assistant",
        json.dumps({"prompt": "a", "response": None}): "'response'",
    }
    for i, (line, reason) in enumerate(bad_lines.items()):
        path = _write(tmp_path / f"bad{i}.jsonl", [good, "", line, good])
        with pytest.raises(ValueError, match=rf"bad{i}\.jsonl:3: .*{reason}"):
            SFTDataset(path, ByteTokenizer())
    with pytest.raises(ValueError, match="does not exist"):
        SFTDataset(tmp_path / "missing.jsonl", ByteTokenizer())
    with pytest.raises(ValueError, match="no samples"):
        SFTDataset(_write(tmp_path / "empty.jsonl", [""]), ByteTokenizer())


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "plain ASCII, héllo ✓ 日本語 \n\t \U0001f600"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    specials = [tok.bos_id, tok.eos_id, tok.pad_id, *tok.role_ids.values()]
    assert len(set(specials)) == len(specials)
    assert all(255 < s < tok.vocab_size for s in specials)
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text


def test_max_length_truncates_and_counts(tmp_path):
    tok = ByteTokenizer()
    path = _write(tmp_path / "t.jsonl", [json.dumps({"prompt": "p", "response": "r" * 20})])
    full = SFTDataset(path, tok)[0]
    ds = SFTDataset(path, tok, max_length=10)
    assert ds.lengths == [10]
    assert ds[0].tokens.tolist() == full.tokens[:10].tolist()
    assert ds.num_loss_tokens == [int(full.loss_mask[1:10].sum())]
    assert ds.loss_token_count(0, 6) == int(full.loss_mask[1:6].sum())


def test_synthetic_generator_lengths(tmp_path):
    rng = random.Random(3)
    profile = [
        int(min(65536, max(1024, rng.lognormvariate(math.log(13800), 0.62)))) for _ in range(500)
    ]
    path = tmp_path / "syn.jsonl"
    lengths = make_synthetic_sft(path, 400, seed=1, length_profile=profile, max_tokens=192)
    ds = SFTDataset(path, ByteTokenizer())
    assert ds.lengths == lengths
    assert all(8 <= n <= 192 for n in lengths)
    assert all(c >= 2 for c in ds.num_loss_tokens)
    # Both JSONL formats occur.
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert any("messages" in r for r in records)
    assert any("prompt" in r for r in records)
    # The lengths follow the scaled profile (oracle: scale the profile directly).
    scaled = sorted(min(max(round(x * 192 / max(profile)), 8), 192) for x in profile)
    for q in (0.25, 0.5, 0.9):
        want = scaled[int(q * len(scaled))]
        got = sorted(lengths)[int(q * len(lengths))]
        assert abs(got - want) <= 0.15 * want + 2, (q, got, want)
    # Deterministic by seed.
    again = tmp_path / "again.jsonl"
    assert make_synthetic_sft(again, 400, seed=1, length_profile=profile, max_tokens=192) == lengths
    assert again.read_bytes() == path.read_bytes()
    other = make_synthetic_sft(
        tmp_path / "o.jsonl", 400, seed=2, length_profile=profile, max_tokens=192
    )
    assert other != lengths
    # Default profile (LongAlign-like): median about 13.8K/64K of max_tokens.
    default = make_synthetic_sft(tmp_path / "d.jsonl", 300, seed=0, max_tokens=512)
    assert SFTDataset(tmp_path / "d.jsonl", ByteTokenizer()).lengths == default
    assert abs(statistics.median(default) - 13800 * 512 / 65536) < 0.2 * 13800 * 512 / 65536


class _FakeHFTokenizer:
    """Character-level stand-in for a transformers tokenizer with a ChatML-like template."""

    def __init__(self, stable=True):
        self.vocab = {c: i for i, c in enumerate(sorted(set("abcdefghijklmnopqrstuvwxyz <>|\n?!")))}
        self.vocab.update({"<s>": 40, "<|im_end|>": 41, "<pad>": 42})
        self.bos_token_id, self.eos_token_id, self.pad_token_id = 40, 41, 42
        self.chat_template = "chatml"
        self.stable = stable

    def __len__(self):
        return 43

    def encode(self, text, add_special_tokens=False):
        return [self.vocab[c] for c in text]

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        ids = [self.bos_token_id]
        for i, m in enumerate(messages):
            content = m["content"]
            if not self.stable and m["role"] == "assistant" and i < len(messages) - 1:
                content = content[:1]  # drops earlier turns' content, like a thinking template
            ids += [*self.encode(f"<{m['role'][0]}>\n{content}"), self.eos_token_id]
        if add_generation_prompt:
            ids += self.encode("<a>\n")
        return ids


def test_load_tokenizer_errors_and_hf_chat_template(tmp_path, monkeypatch):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(tmp_path / "nope")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails even if installed
    with pytest.raises(ValueError, match="transformers"):
        load_tokenizer(tmp_path)

    fake = types.SimpleNamespace(
        AutoTokenizer=types.SimpleNamespace(from_pretrained=lambda path, **kw: _FakeHFTokenizer())
    )
    monkeypatch.setitem(sys.modules, "transformers", fake)
    tok = load_tokenizer(tmp_path)
    assert tok.has_chat_template
    assert tok.eos_id == 41
    assert tok.vocab_size == 43
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok?"},
        {"role": "assistant", "content": "yes"},
    ]
    sample = tokenize_conversation(messages, tok)
    fake_tok = _FakeHFTokenizer()
    assert sample.tokens.tolist() == fake_tok.apply_chat_template(messages, True, False)
    masked = [
        i for i, m in zip(sample.tokens.tolist(), sample.loss_mask.tolist(), strict=True) if m
    ]
    assert masked == [*fake_tok.encode("yo"), 41, *fake_tok.encode("yes"), 41]

    fake.AutoTokenizer.from_pretrained = lambda path, **kw: _FakeHFTokenizer(stable=False)
    with pytest.raises(ValueError, match="use_chat_template=False"):
        tokenize_conversation(messages, load_tokenizer(tmp_path))
    plain = load_tokenizer(tmp_path, use_chat_template=False)
    sample = tokenize_conversation(messages, plain)
    masked = [
        i for i, m in zip(sample.tokens.tolist(), sample.loss_mask.tolist(), strict=True) if m
    ]
    assert masked == [*fake_tok.encode("yo"), 41, *fake_tok.encode("yes"), 41]
    prefix = [40, *fake_tok.encode("<|user|>\nhi<|assistant|>\n")]
    assert sample.tokens[: len(prefix)].tolist() == prefix


# Packing #


def _sample(tokens, mask):
    return SFTSample(torch.tensor(tokens), torch.tensor(mask, dtype=torch.bool))


def _mask_by_loops(seqlens):
    seg = [s for s, n in enumerate(seqlens) for _ in range(n)]
    total = len(seg)
    mask = torch.ones(total, total, dtype=torch.bool)
    for i in range(total):
        for j in range(i + 1):
            if seg[i] == seg[j]:
                mask[i, j] = False
    return mask.view(1, 1, total, total)


def test_pack_hand_example():
    a = _sample([11, 12, 13], [0, 1, 1])
    b = _sample([14, 15], [0, 1])
    c = _sample([16], [1])
    packed = pack_microbatch([a, b, c], pad_to=9, pad_id=0)
    assert packed.tokens.tolist() == [[11, 12, 13, 14, 15, 16, 0, 0, 0]]
    assert packed.labels.tolist() == [[12, 13, 0, 15, 0, 0, 0, 0, 0]]
    assert packed.loss_mask.tolist() == [[1, 1, 0, 1, 0, 0, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1, 2]]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 6, 9]
    assert packed.max_seqlen == 3
    assert (packed.num_samples, packed.num_segments, packed.num_tokens) == (3, 4, 9)
    assert torch.equal(packed.attention_mask(), _mask_by_loops([3, 2, 1, 3]))
    unpadded = pack_microbatch([a, b], pad_id=0)
    assert unpadded.cu_seqlens.tolist() == [0, 3, 5]
    assert torch.equal(unpadded.attention_mask(), _mask_by_loops([3, 2]))
    with pytest.raises(ValueError, match="pad_to"):
        pack_microbatch([a, b], pad_to=4, pad_id=0)
    with pytest.raises(ValueError, match="empty microbatch"):
        pack_microbatch([], pad_id=0)
    empty = pack_microbatch([], pad_to=4, pad_id=7)
    assert empty.cu_seqlens.tolist() == [0, 4]
    assert empty.loss_mask.sum() == 0


class _TinyLM(torch.nn.Module):
    """Embedding + learned positions + one causal attention layer + LM head, fp32."""

    def __init__(self, vocab_size, dim=16, max_positions=512):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(vocab_size, dim, generator=gen) * 0.5)
        self.pos = torch.nn.Parameter(torch.randn(max_positions, dim, generator=gen) * 0.5)
        self.qkv = torch.nn.Parameter(torch.randn(dim, 3 * dim, generator=gen) / dim**0.5)
        self.head = torch.nn.Parameter(torch.randn(dim, vocab_size, generator=gen) / dim**0.5)

    def forward(self, tokens, position_ids, mask):
        """tokens, position_ids [1, T]; mask [1, 1, T, T] bool (True = masked). Returns logits."""
        x = self.embed[tokens[0]] + self.pos[position_ids[0]]
        q, k, v = (x @ self.qkv).chunk(3, dim=-1)
        scores = (q @ k.T) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(mask[0, 0], float("-inf"))
        h = x + torch.softmax(scores, dim=-1) @ v
        return (h @ self.head).unsqueeze(0)


def _causal(length):
    return torch.ones(length, length, dtype=torch.bool).triu(1).view(1, 1, length, length)


def test_packed_attention_equals_separate_samples():
    gen = torch.Generator().manual_seed(1)
    model = _TinyLM(50)
    samples = [
        _sample(torch.randint(0, 50, (n,), generator=gen).tolist(), [1] * n) for n in (7, 1, 12, 4)
    ]
    packed = pack_microbatch(samples, pad_to=30, pad_id=49)
    with torch.no_grad():
        logits = model(packed.tokens, packed.position_ids, packed.attention_mask())
        for i, s in enumerate(samples):
            start, end = packed.cu_seqlens[i].item(), packed.cu_seqlens[i + 1].item()
            alone = model(s.tokens.view(1, -1), torch.arange(len(s)).view(1, -1), _causal(len(s)))
            torch.testing.assert_close(logits[:, start:end], alone, rtol=1e-6, atol=1e-6)
        assert torch.isfinite(logits).all()
        # Sanity of the oracle: a plain causal mask over the pack gives different logits.
        leaky = model(packed.tokens, packed.position_ids, _causal(packed.num_tokens))
        assert not torch.allclose(leaky[:, 7:8], logits[:, 7:8])


# Exact global loss weighting #


def _reference_grads(model, samples):
    """Global per-token mean loss over unpacked samples, counted directly."""
    model.zero_grad()
    total, count = 0.0, 0
    for s in samples:
        logits = model(s.tokens.view(1, -1), torch.arange(len(s)).view(1, -1), _causal(len(s)))
        losses = torch.nn.functional.cross_entropy(logits[0, :-1], s.tokens[1:], reduction="none")
        total = total + (losses * s.loss_mask[1:].float()).sum()
        count += int(s.loss_mask[1:].sum())
    (total / count).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]).clone(), total.item() / count


def _rank_grads(model, dataset, sampler_kwargs, dp_size, pad_multiple, normalise="global"):
    model.zero_grad()
    loss_sum = 0.0
    for dp_rank in range(dp_size):
        sampler = LengthBalancedSampler(
            dataset.lengths, dp_size=dp_size, dp_rank=dp_rank, **sampler_kwargs
        )
        (assignment,) = list(sampler)
        global_count = global_loss_token_count(assignment, dataset)
        rank_count = sum(
            dataset.loss_token_count(i, assignment.plan.lengths[i])
            for mb in assignment.microbatches
            for i in mb
        )
        for mb in assignment.microbatches:
            samples = load_microbatch(dataset, mb, assignment.plan.lengths)
            if not samples:  # lb_micro's empty slot: an all-padding microbatch
                packed = pack_microbatch([], pad_to=pad_multiple, pad_id=dataset.tokenizer.pad_id)
            else:
                num_tokens = sum(len(s) for s in samples)
                pad_to = -(-num_tokens // pad_multiple) * pad_multiple
                packed = pack_microbatch(samples, pad_to=pad_to, pad_id=dataset.tokenizer.pad_id)
            logits = model(packed.tokens, packed.position_ids, packed.attention_mask())
            losses = torch.nn.functional.cross_entropy(
                logits[0], packed.labels[0], reduction="none"
            )
            if normalise == "global":
                weights = loss_weights(packed.loss_mask[0], global_count)
            else:  # the per-rank mean averaged over ranks: the bug class of peers.md
                weights = loss_weights(packed.loss_mask[0], rank_count * dp_size)
            loss = (weights * losses).sum()
            loss.backward()
            loss_sum += loss.item()
    return torch.cat([p.grad.flatten() for p in model.parameters()]).clone(), loss_sum


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("truncate", [False, True])
def test_loss_gradient_independent_of_split(tmp_path, truncate):
    tok = ByteTokenizer()
    path = tmp_path / "d.jsonl"
    make_synthetic_sft(path, 13, seed=4, max_tokens=48, min_tokens=8)
    dataset = SFTDataset(path, tok)
    cap = 32 if truncate else max(dataset.lengths)
    if truncate:
        assert max(dataset.lengths) > cap
    kwargs = {
        "global_batch_size": len(dataset),
        "seed": 3,
        "cap_tokens": cap,
        "too_long": "truncate" if truncate else "error",
    }
    model = _TinyLM(tok.vocab_size)
    reference_samples = [
        dataset[i].truncate(min(len(dataset[i]), cap)) for i in range(len(dataset))
    ]
    ref_grad, ref_loss = _reference_grads(model, reference_samples)
    for dp_size in (1, 2, 4):
        for plan_kind in PLAN_KINDS:
            grad, loss = _rank_grads(
                model, dataset, dict(kwargs, plan_kind=plan_kind), dp_size, pad_multiple=8
            )
            assert _rel(grad, ref_grad) < 1e-6, (dp_size, plan_kind, _rel(grad, ref_grad))
            assert loss == pytest.approx(ref_loss, rel=1e-6)
    # The check can fail: normalising by the per-rank count gives a different gradient.
    naive, _ = _rank_grads(
        model, dataset, dict(kwargs, plan_kind="lb_mini"), 4, pad_multiple=8, normalise="rank"
    )
    assert _rel(naive, ref_grad) > 1e-3


def test_loss_weights_and_global_count(tmp_path):
    path = tmp_path / "d.jsonl"
    make_synthetic_sft(path, 10, seed=0, max_tokens=40)
    dataset = SFTDataset(path, ByteTokenizer())
    sampler = LengthBalancedSampler(dataset.lengths, global_batch_size=6, dp_size=2, dp_rank=1)
    for assignment in sampler:
        direct = sum(int(dataset[i].loss_mask[1:].sum()) for i in assignment.global_sample_ids)
        assert global_loss_token_count(assignment, dataset) == direct
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    torch.testing.assert_close(loss_weights(mask, 6), mask / 6)
    assert loss_weights(mask, 0).abs().sum() == 0
    with pytest.raises(ValueError, match="global_num_loss_tokens"):
        loss_weights(mask, -1)


def test_a_directory_without_tokenizer_files_is_named(tmp_path):
    # A model directory with config.json alone: transformers picks a tokenizer class from the
    # config and fails with a several-line message about sentencepiece; the error says what is missing.
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 100, "hidden_size": 64}'
    )
    with pytest.raises(ValueError) as exc:
        load_tokenizer(tmp_path)
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith(f"{str(tmp_path)!r} holds no tokenizer files (none of tokenizer.json")
    assert message.endswith(
        "copy the model's tokenizer files there, or use 'byte' for the byte-level fallback"
    )
