"""Megatron-LM ``--sft`` under the launcher, without Megatron-LM: the balanced loader's records (real
lengths, packing, the plan over Megatron-LM's global batches), the CPU runtime's packed (THD) attention
against per-sequence attention, the transformers-5 adapter of ``SFTTokenizer`` and the flags ``--sft``
and the ODC backends set. The end-to-end runs through the real ``pretrain_gpt.py --sft`` are in
``test_megatron_lm_sft_e2e.py`` (gated on ``MEGATRON_LM_PATH``).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import types
from unittest import mock

import pytest
import torch

from megatron_odc.balance.cost import CostModel
from megatron_odc.integration.megatron_lm.data import (
    BalancedPretrainingLoader,
    pack_records,
    record_length,
)

SEQ = 128
PAD = 4
COST = CostModel.from_model_config(
    num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, vocab_size=384
)
SKEWED = [70, 70, 70, 50, 50, 50, 50, 10]
"""Real lengths of one global batch of 8 where LB-Mini's equal costs need uneven counts (three 70s
never pair under a 128-token cap; the 50s and the 10 do)."""


def _record(length: int, conversations: int = 1, width: int | None = None) -> dict:
    """A record as Megatron-LM's ``SFTDataset`` returns it: ``length`` real tokens in
    ``conversations`` parts, padded to ``SEQ`` with ``PAD``, the last ``cu_seqlens`` segment stretched
    over the padding (``width``: right-padded boundaries, ``core_v0.19.0``'s format)."""
    tokens = torch.full((SEQ,), PAD, dtype=torch.int64)
    tokens[:length] = torch.arange(length) % 50 + 10 + length
    labels = torch.full((SEQ,), PAD, dtype=torch.int64)
    labels[: length - 1] = tokens[1:length]
    step = length // conversations
    bounds = [0, *[step * (i + 1) for i in range(conversations - 1)], SEQ]
    positions = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(bounds)])
    cu = torch.tensor(bounds, dtype=torch.int32)
    if width is not None:
        cu = torch.cat([cu, torch.full((width - cu.numel(),), SEQ, dtype=torch.int32)])
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": (labels != PAD).float(),
        "position_ids": positions,
        "cu_seqlens": cu,
        "max_seqlen": (cu[1:] - cu[:-1]).max(),
    }


class _Records:
    """A map-style dataset of records with a tokenizer pad id where ``SFTDataset`` has it."""

    def __init__(self, lengths: list[int], conversations: int = 1, width: int | None = None):
        self.lengths = lengths
        self.conversations = conversations
        self.width = width
        self.config = types.SimpleNamespace(tokenizer=types.SimpleNamespace(pad=PAD))

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        return _record(self.lengths[i], self.conversations, self.width)


def _loaders(dataset, kind: str, dp: int = 2, **kwargs) -> list[BalancedPretrainingLoader]:
    return [
        BalancedPretrainingLoader(
            dataset,
            0,
            global_batch_size=8,
            dp_rank=r,
            dp_size=dp,
            seq_length=SEQ,
            plan_kind=kind,
            cost_model=COST,
            **kwargs,
        )
        for r in range(dp)
    ]


def test_record_length_is_the_tokens_before_the_padding() -> None:
    assert record_length(_record(37), PAD) == 37
    assert record_length(_record(SEQ), PAD) == SEQ
    # a trailing pad token whose label counts (pad = end of document in a pretraining sample) stays
    record = _record(SEQ)
    record["tokens"][-3:] = PAD
    record["loss_mask"][-3:] = 0
    record["loss_mask"][-2] = 1
    assert record_length(record, PAD) == SEQ - 1


def test_pack_records_concatenates_real_tokens_with_every_conversation_boundary() -> None:
    records = [_record(30, conversations=2), _record(45), _record(20, conversations=3)]
    batch = pack_records(records, pad_id=PAD)
    assert batch["tokens"].shape == (1, 95)  # no padding at all without a fixed shape
    assert batch["cu_seqlens"].tolist() == [[0, 15, 30, 75, 81, 87, 95]]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["max_seqlen"].tolist() == [45]
    assert torch.equal(batch["tokens"][0, 30:75], records[1]["tokens"][:45])
    assert torch.equal(batch["labels"][0, :30], records[0]["labels"][:30])
    assert batch["position_ids"][0, 15:30].tolist() == list(range(15))
    # every record's last real token predicts a pad label: nothing is learned across records
    assert batch["loss_mask"][0, [29, 74, 94]].tolist() == [0.0, 0.0, 0.0]
    assert batch["loss_mask"].sum() == sum(r["loss_mask"].sum() for r in records)
    fixed = pack_records(records, pad_id=PAD, pad_to=SEQ, cu_width=SEQ + 1)
    assert fixed["tokens"].shape == (1, SEQ)
    assert fixed["cu_seqlens"].shape == (1, SEQ + 1)
    assert fixed["cu_seqlens"][0, :8].tolist() == [0, 15, 30, 75, 81, 87, 95, SEQ]
    assert set(fixed["cu_seqlens"][0, 8:].tolist()) == {SEQ}
    assert fixed["loss_mask"][0, 95:].sum() == 0
    with pytest.raises(ValueError, match="shorter than the packed microbatch"):
        pack_records(records, pad_id=PAD, pad_to=64)


@pytest.mark.parametrize("kind", ["lb_mini", "lb_micro"])
def test_each_global_batch_is_megatron_lms_samples_packed_under_the_cap(kind) -> None:
    lengths = [11, 120, 33, 64, 9, 128, 70, 15] * 3 + SKEWED
    dataset = _Records(lengths, conversations=2)
    for index in range(4):
        plans = [loader.plan_batch(index) for loader in _loaders(dataset, kind)]
        got = sorted(i for p in plans for mb in p.microbatches for i in mb)
        assert got == list(range(8 * index, 8 * index + 8))  # Megatron-LM's global batch
        for p in plans:
            assert len(p.batches) == len(p.microbatches)
            for mb, batch in zip(p.microbatches, p.batches, strict=True):
                assert batch["tokens"].shape[1] == sum(lengths[i] for i in mb) <= SEQ
        assert [len(p.microbatches) for p in plans] == plans[0].plan.num_microbatches()
    # fewer microbatches than Megatron-LM's one record each
    assert sum(len(p.microbatches) for p in plans) < 8


def test_lb_mini_gives_uneven_counts_where_lb_micro_gives_equal_ones() -> None:
    dataset = _Records(SKEWED)
    mini = [len(loader.plan_batch(0).microbatches) for loader in _loaders(dataset, "lb_mini")]
    micro = [len(loader.plan_batch(0).microbatches) for loader in _loaders(dataset, "lb_micro")]
    assert sorted(mini) == [2, 3]
    assert micro == [2, 2]
    plan_mini = _loaders(dataset, "lb_mini")[0].plan_batch(0).plan
    plan_micro = _loaders(dataset, "lb_micro")[0].plan_batch(0).plan
    assert plan_mini.bubble_odc() < plan_micro.bubble_lockstep()


def test_a_resume_with_another_global_batch_size_starts_where_megatron_lms_sampler_does() -> None:
    """consumed_samples 12 saved at --global-batch-size 4, resumed at 8: the global batches are
    samples 12-19, 20-27, ... (Megatron-LM's sampler takes them from consumed_samples on); it was
    refused as no multiple of 8."""
    lengths = [11, 120, 33, 64, 9, 128, 70, 15] * 4
    loaders = [
        BalancedPretrainingLoader(
            _Records(lengths),
            12,
            global_batch_size=8,
            dp_rank=r,
            dp_size=2,
            seq_length=SEQ,
            cost_model=COST,
        )
        for r in range(2)
    ]
    assert loaders[0].num_global_batches == 3  # samples 4-11 (before the resume), 12-19, 20-27
    for index, first in ((loaders[0].start_index, 12), (loaders[0].start_index + 1, 20)):
        plans = [loader.plan_batch(index) for loader in loaders]
        got = sorted(i for p in plans for mb in p.microbatches for i in mb)
        assert got == list(range(first, first + 8)), (index, got)
    iterator = iter(loaders[1])
    count = iterator.next_num_microbatches()
    assert sorted(i for mb in iterator.last.microbatches for i in mb) == sorted(
        set(range(12, 20)) - {i for mb in loaders[0].plan_batch(1).microbatches for i in mb}
    )
    assert count == len(iterator.last.microbatches)
    iterator.plans.close()


def test_pipeline_replicas_and_fixed_shapes() -> None:
    """With PP the plan is over replicas (a zero count allowed) and microbatches are [1, SEQ]."""
    dataset = _Records([10] * 8)
    plans = [
        loader.plan_batch(0)
        for loader in _loaders(dataset, "lb_mini", dp=4, pipeline_stages=2, fixed_shape=True)
    ]
    assert sorted(i for p in plans for mb in p.microbatches for i in mb) == list(range(8))
    assert all(b["tokens"].shape == (1, SEQ) for p in plans for b in p.batches)
    with pytest.raises(ValueError, match="must be 128"):
        _loaders(dataset, "lb_mini", fixed_shape=True, max_tokens=256)


def test_iterator_counts_then_microbatches_and_records_the_plan_timing() -> None:
    loader = _loaders(_Records(SKEWED * 2), "lb_mini")[1]
    it = iter(loader)
    count = it.next_num_microbatches()
    assert count == len(it.last.microbatches)
    batches = [next(it) for _ in range(count)]
    assert [b["tokens"].shape[1] for b in batches] == [
        sum(SKEWED[i % 8] for i in mb) for mb in it.last.microbatches
    ]
    assert it.last_plan_s > 0
    it.pending.append((0,))  # a microbatch the schedule did not take
    with pytest.raises(RuntimeError, match="not consumed"):
        it.next_num_microbatches()
    it.plans.close()


def test_fixed_packs_keep_one_sample_per_microbatch() -> None:
    """``GPTDataset``'s samples carry no cu_seqlens: every sample costs seq_length, counts equal."""

    class Packs:
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return {"tokens": torch.full((SEQ,), i), "labels": torch.zeros(SEQ)}

    loaders = _loaders(Packs(), "lb_mini")
    assert not loaders[0].records
    plans = [loader.plan_batch(1) for loader in loaders]
    assert [len(p.microbatches) for p in plans] == [4, 4]
    assert all(len(mb) == 1 for p in plans for mb in p.microbatches)
    assert plans[0].batches is None


@pytest.mark.parametrize(
    ("groups", "layer_scaling"),
    [(4, False), (2, False), (4, True)],
    ids=["mha", "gqa", "qk_scaling"],
)
def test_cpu_packed_attention_equals_each_sequence_alone(tmp_path, groups, layer_scaling) -> None:
    """The CPU runtime's THD attention on the local spec (shim 9; fp32 without dropout: one fused
    ``scaled_dot_product_attention`` per segment) = the original attention over the whole pack with
    the block-diagonal causal mask, and = each segment alone; with grouped keys and values, and with
    the query-key layer scaling (its coefficient divided out of the scores, multiplied back)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_odc.data.packing import block_causal_mask
    from megatron_odc.integration.cpu import _sdpa_segments_apply, cpu_runtime

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    with cpu_runtime():
        parallel_state.initialize_model_parallel()
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(0)
            config = TransformerConfig(
                num_layers=1,
                hidden_size=32,
                num_attention_heads=4,
                use_cpu_initialization=True,
                attention_dropout=0.0,
                masked_softmax_fusion=False,
                num_query_groups=groups,
                apply_query_key_layer_scaling=layer_scaling,
            )
            attention = DotProductAttention(
                config, layer_number=3, attn_mask_type=AttnMaskType.causal, attention_type="self"
            )
            torch.manual_seed(0)
            cu = torch.tensor([[0, 5, 12, 13, 20]], dtype=torch.int32)
            q = torch.randn(20, 4, 8)
            k, v = (torch.randn(20, groups, 8) for _ in range(2))
            assert _sdpa_segments_apply(attention, q, None)  # the fused path is what runs
            params = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=7,
                max_seqlen_kv=7,
            )
            packed = attention(q, k, v, None, packed_seq_params=params)
            assert packed.shape == (20, 32)
            # the reference: the original attention over all 20 tokens under the dense
            # block-diagonal causal mask of cu_seqlens
            dense = DotProductAttention.forward.__megatron_odc_original__(
                attention, q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), block_causal_mask(cu)
            )
            torch.testing.assert_close(packed, dense.reshape(20, -1))
            bounds = cu.reshape(-1).tolist()
            for a, b in itertools.pairwise(bounds):
                alone = attention(
                    q[a:b].unsqueeze(1), k[a:b].unsqueeze(1), v[a:b].unsqueeze(1), None
                )
                torch.testing.assert_close(packed[a:b], alone.reshape(b - a, -1))
            with pytest.raises(ValueError, match="'thd'"):
                attention(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


def test_sft_tokenizer_adapter_gives_transformers_4_ids(tmp_path) -> None:
    """core_v0.16.1's ``SFTTokenizer`` indexes ``apply_chat_template(..., return_tensors="np")[0]``
    and takes ``len()`` of a turn's result; under transformers 5 both need ``return_dict=False``."""
    transformers = pytest.importorskip("transformers")
    from megatron_odc.integration.megatron_lm.sft import ChatTemplateIds
    from megatron_odc.integration.megatron_lm.sft_example import write_tokenizer

    hf = transformers.AutoTokenizer.from_pretrained(str(write_tokenizer(tmp_path / "tok")))
    template = "{% for m in messages %}{{ '<SPECIAL_11>User\n' + m['content'] + '\n' }}{% endfor %}"
    turn = [{"role": "user", "content": "w1 w2 w3"}]
    adapted = ChatTemplateIds(hf)
    ids = adapted.apply_chat_template(
        turn, tokenize=True, return_tensors="np", chat_template=template
    )[0]
    assert ids.tolist() == hf.convert_tokens_to_ids(["<SPECIAL_11>", "User", "w1", "w2", "w3"])
    assert ids.copy().tolist() == ids.tolist()
    assert len(adapted.apply_chat_template(turn, tokenize=True, chat_template=template)) == 5
    assert len(adapted) == len(hf)
    assert adapted.eos_token_id == hf.eos_token_id


def test_sft_tokenizer_adapter_reaches_a_patched_source_once(monkeypatch) -> None:
    """A patched Megatron-LM source has no launcher to adapt its ``SFTTokenizer``: ``--sft``'s
    argument handling does, for the rest of the process, and not a second time where the launcher's
    adapter is already on (a stand-in module in the tag's place)."""
    from megatron_odc.integration.megatron_lm import sft, version
    from megatron_odc.integration.megatron_lm.releases import MEGATRON_LM_RELEASES

    class SFTTokenizer:
        def __init__(self, tokenizer) -> None:
            self._tokenizer = tokenizer

    release = MEGATRON_LM_RELEASES[0]
    module = types.ModuleType(release.sft_tokenizer)
    module.SFTTokenizer = SFTTokenizer
    monkeypatch.setitem(sys.modules, release.sft_tokenizer, module)
    monkeypatch.setattr(version, "installed_megatron_lm_release", lambda: release)
    original = SFTTokenizer.__init__
    sft.apply_sft_args(_args(sft=False))
    assert SFTTokenizer.__init__ is original  # without --sft nothing changes
    with sft.sft_tokenizer_adapter(release.sft_tokenizer):  # the launcher's
        launcher_init = SFTTokenizer.__init__
        sft.apply_sft_args(_args())
        assert SFTTokenizer.__init__ is launcher_init
    assert SFTTokenizer.__init__ is original
    sft.apply_sft_args(_args())  # a patched source: no launcher around
    sft.apply_sft_args(_args())
    assert SFTTokenizer.__init__.__megatron_odc_original__ is original
    assert isinstance(SFTTokenizer(object())._tokenizer, sft.ChatTemplateIds)
    with sft.sft_tokenizer_adapter(release.sft_tokenizer):  # the launcher after it: no second wrap
        assert SFTTokenizer.__init__.__megatron_odc_original__ is original
    assert SFTTokenizer.__init__.__megatron_odc_original__ is original  # and it stays


def _args(*flags: str, **kw) -> argparse.Namespace:
    """ODC's flags as Megatron-LM's patched parser gives them, plus the Megatron-LM fields read."""
    from megatron_odc.integration.megatron_lm.flags import add_odc_args

    args = add_odc_args(argparse.ArgumentParser()).parse_args(["--dp-backend", "odc", *flags])
    fields = {
        "micro_batch_size": 1,
        "dataloader_type": None,
        "seq_length": SEQ,
        "calculate_per_token_loss": False,
        "sft": True,
        "legacy_tokenizer": False,
        "create_attention_mask_in_dataloader": True,
        "transformer_impl": "local",
        **kw,
    }
    for key, value in fields.items():
        setattr(args, key, value)
    return args


def test_sft_and_per_token_flags_are_set_with_one_line(caplog) -> None:
    from megatron_odc.integration.megatron_lm import flags
    from megatron_odc.integration.megatron_lm.sft import apply_sft_args
    from megatron_odc.runner.log import info_once

    info_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="megatron_odc"):
        args = apply_sft_args(_args())
        assert args.legacy_tokenizer
        assert not args.create_attention_mask_in_dataloader
        args = flags.postprocess_odc_args(args)
        flags.postprocess_odc_args(_args())
    assert args.calculate_per_token_loss
    assert args.balance == "lb_mini"
    lines = [r.getMessage() for r in caplog.records if "calculate-per-token-loss" in r.getMessage()]
    assert len(lines) == 1
    assert "different microbatch counts" in lines[0]
    # ddp keeps Megatron-LM's sampler; an equal-count plan packs and turns per-token loss on too
    ddp = flags.postprocess_odc_args(_args("--dp-backend", "ddp"))
    assert ddp.balance == "none"
    assert not ddp.calculate_per_token_loss
    ddp = flags.postprocess_odc_args(_args("--dp-backend", "ddp", "--balance", "lb_micro"))
    assert ddp.calculate_per_token_loss
    with pytest.raises(ValueError, match="--balance lb_mini gives DP ranks different numbers"):
        flags.postprocess_odc_args(_args("--dp-backend", "ddp", "--balance", "lb_mini"))
    with pytest.raises(ValueError, match="at least 128"):
        flags.postprocess_odc_args(_args("--max-tokens-per-microbatch", "64"))
    assert (
        flags.postprocess_odc_args(_args("--max-tokens-per-microbatch", "256")).balance == "lb_mini"
    )


@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.17.1", "core_v0.19.0"])
def test_sft_settings_a_tag_cannot_run_are_refused_and_mbs_over_1_says_the_sampler_is_used(
    monkeypatch, caplog, tag
) -> None:
    """``--sft --micro-batch-size 2`` stopped on core_v0.16.1 / core_v0.17.1's bare assertion under
    every backend (and the refusal of ``--balance lb_mini`` there advised ``--balance none``, which
    hit it), ``--sft`` with TP 2 on core_v0.16.1 on an allocation of petabytes; where it runs,
    ``--micro-batch-size 2`` falls back to Megatron-LM's sampler with a line saying so."""
    from megatron_odc.integration.megatron_lm import flags, version
    from megatron_odc.integration.megatron_lm.releases import MEGATRON_LM_RELEASES
    from megatron_odc.runner.log import info_once

    release = next(r for r in MEGATRON_LM_RELEASES if r.tag == tag)
    monkeypatch.setattr(version, "installed_megatron_lm_release", lambda: release)
    info_once.cache_clear()
    for backend in ("odc", "ddp"):
        if tag in ("core_v0.16.1", "core_v0.17.1"):
            with pytest.raises(ValueError, match=f"--micro-batch-size 2 on {tag}: its get_batch"):
                flags.postprocess_odc_args(_args("--dp-backend", backend, micro_batch_size=2))
        else:
            with caplog.at_level(logging.INFO, logger="megatron_odc"):
                args = flags.postprocess_odc_args(
                    _args("--dp-backend", backend, micro_batch_size=2)
                )
            assert args.balance == "none"
        tp2 = _args("--dp-backend", backend, tensor_model_parallel_size=2)
        if tag == "core_v0.16.1":
            with pytest.raises(
                ValueError, match=r"--tensor-model-parallel-size 2 on core_v0\.16\.1"
            ):
                flags.postprocess_odc_args(tp2)
        else:
            assert flags.postprocess_odc_args(tp2).tensor_model_parallel_size == 2
    if tag == "core_v0.19.0":
        said = [
            r.getMessage() for r in caplog.records if r.getMessage().startswith("--balance none")
        ]
        assert len(said) == 1, said
        assert "Megatron-LM's sampler" in said[0], said
        with pytest.raises(ValueError, match="packs several records into each microbatch"):
            flags.postprocess_odc_args(_args("--balance", "lb_mini", micro_batch_size=2))


def test_cpu_flags_and_tensor_parallel_environment(monkeypatch) -> None:
    from megatron_odc.integration.megatron_lm.flags import with_cpu_flags

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    argv = with_cpu_flags(["--swiglu"], cuda=False)
    assert "--no-bias-swiglu-fusion" in argv
    assert "--no-rope-fusion" in argv
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ  # TP = 1: left alone (FSDP needs it so)
    with_cpu_flags(["--tensor-model-parallel-size", "2"], cuda=False)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


class _Writer:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))


def test_odc_line_and_scalars_at_megatron_lms_log_interval(tmp_path, monkeypatch, caplog) -> None:
    """The per-step figures are reduced and logged at Megatron-LM's log iterations only, in the
    entry's words, and the same figures go to Megatron-LM's TensorBoard writer under ``odc/`` tags."""
    import sys

    from megatron_odc.integration.megatron_lm.odc_log import OdcLogLine

    args = types.SimpleNamespace(curr_iteration=0, log_interval=2, train_iters=4)
    writer = _Writer()
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars.get_tensorboard_writer = lambda: writer
    global_vars.get_wandb_writer = lambda: None
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    telemetry = {
        "minibatch": 1,
        "wall_s": 1.0,
        "compute_s": 0.8,
        "fetch_wait_s": 0.05,
        "push_s": 0.05,
        "fence_s": 0.1,
        "fetch_bytes": 0,
        "push_bytes": 0,
        "num_fetches": 0,
        "num_pushes": 0,
        "num_microbatches": 3,
        "num_tokens": 10,
    }
    chunk = types.SimpleNamespace(telemetry=lambda: telemetry, dp_group=None)
    source = types.SimpleNamespace(last_plan_s=0.004, last_wait_s=0.001)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        line = OdcLogLine()
        with caplog.at_level(logging.INFO, logger="megatron_odc"):
            line.after_step(3, source, [chunk], None)  # iteration 1: nothing yet
            assert not caplog.records
            assert not writer.scalars
            args.curr_iteration = 1
            line.after_step(1, None, [chunk], None)  # iteration 2: the interval's figures
    finally:
        torch.distributed.destroy_process_group()
    (record,) = caplog.records
    text = record.getMessage()
    assert text.startswith("odc iteration        2/       4 | num microbatches min/max: 1/3 | ")
    assert "plan ahead/wait max (ms): 4.0/1.0" in text
    assert "odc compute imbalance: 1.00x" in text
    assert "fetch/push/fence wait max/mean (ms): 50.0/50.0, 50.0/50.0, 100.0/100.0" in text
    got = {tag: (value, step) for tag, value, step in writer.scalars}
    assert got["odc/num-microbatches-min"] == (1, 2)
    assert got["odc/num-microbatches-max"] == (3, 2)
    assert got["odc/plan-ahead-ms-max"] == (4.0, 2)
    assert got["odc/fence-ms-max"] == (100.0, 2)
    assert set(got) >= {"odc/compute-imbalance", "odc/fetch-wait-ms-mean", "odc/push-ms-max"}


def _measured_cost(rank: int, world_size: int) -> tuple:
    from megatron_odc.integration.cpu import cpu_runtime
    from megatron_odc.integration.megatron_lm.balance_cost import balance_cost
    from megatron_odc.mcore import cost_probe
    from megatron_odc.mcore.parallel import model_parallel

    args = _args("--balance-cost", "measured")
    model = {
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 256,
        "num_attention_heads": 4,
        "padded_vocab_size": 384,
        "max_position_embeddings": SEQ,
        "bf16": False,
        "fp16": False,
        "untie_embeddings_and_output_weights": False,
        "disable_bias_linear": False,
        "group_query_attention": False,
        "num_query_groups": None,
        "swiglu": False,
        "seed": 1234,
    }
    for key, value in model.items():
        setattr(args, key, value)
    with pytest.raises(ValueError, match="on GPUs use --balance-cost flops"):
        balance_cost(args, SEQ)  # no CPU runtime: a GPU run
    real_timings = cost_probe.time_microbatches

    def timings_that_grow(model, lengths, **kwargs) -> tuple[float, ...]:
        # The real probe runs (each rank's own timings, averaged over the job), plus 1 ms per token:
        # on a loaded machine a tiny model's timings alone need not grow with the length (the
        # refusal below is that case), and speed is the benchmarks' to check, not a test's.
        seconds = real_timings(model, lengths, **kwargs)
        return tuple(t + 1e-3 * s for t, s in zip(seconds, lengths, strict=True))

    with cpu_runtime(), model_parallel(1):
        before = torch.get_rng_state()
        with mock.patch.object(cost_probe, "time_microbatches", timings_that_grow):
            cost, overhead = balance_cost(args, SEQ)
        untouched = torch.equal(before, torch.get_rng_state())
        flops = balance_cost(argparse.Namespace(**{**vars(args), "balance_cost": "flops"}), SEQ)
        with mock.patch(  # timings that shrink with the length (a machine too noisy for the model)
            "megatron_odc.mcore.cost_probe.time_microbatches",
            lambda model, lengths, **_: tuple(1.0 / s for s in lengths),
        ):
            try:
                balance_cost(args, SEQ)
                unresolved = "not refused"
            except ValueError as error:
                unresolved = str(error)
    return cost.a, cost.b, overhead, untouched, flops, unresolved


def test_measured_balance_cost_is_the_same_on_every_rank_and_refused_where_it_cannot_run() -> None:
    from megatron_odc.integration.megatron_lm import flags
    from tests._dist import run_ranks

    first, second = run_ranks(_measured_cost, 2, timeout_s=240)
    assert first[:3] == second[:3]  # every rank plans with the same numbers
    a, b, overhead, untouched, flops, unresolved = first
    assert unresolved.startswith("--balance-cost measured: timings "), unresolved
    assert unresolved.endswith("use --balance-cost flops"), unresolved
    assert a + b > 0
    assert overhead >= 0
    assert untouched  # the run's random stream is where Megatron-LM left it
    assert flops == (COST, 0.0)
    with pytest.raises(ValueError, match="needs --tensor-model-parallel-size 1"):
        flags.postprocess_odc_args(
            _args("--balance-cost", "measured", pipeline_model_parallel_size=2)
        )


def test_a_record_megatron_lms_dataset_cannot_build_is_named_in_one_line(monkeypatch) -> None:
    """core_v0.16.1's SFTDataset raised a bare ``TypeError`` on a record longer than --seq-length
    (``pack_tokens.extend(pad)``), an empty ``messages`` an ``IndexError``: the balanced loader
    names the sample, its record and file, and for that tag the likely cause."""
    from megatron_odc.integration.megatron_lm import version
    from megatron_odc.integration.megatron_lm.data import read_sample
    from megatron_odc.integration.megatron_lm.releases import MEGATRON_LM_RELEASES

    class _Broken(_Records):
        indices = tuple(range(7, 40))
        dataset_path = "/data/chats.jsonl"

        def __getitem__(self, i: int) -> dict:
            if i == 3:
                raise TypeError("'int' object is not iterable")
            if i == 5:
                raise IndexError("list index out of range")
            return super().__getitem__(i)

    monkeypatch.setattr(version, "installed_megatron_lm_release", lambda: MEGATRON_LM_RELEASES[0])
    loader = _loaders(_Broken([20] * 16), "lb_mini")[0]
    with pytest.raises(ValueError, match="could not build sample 3 of the train split") as error:
        loader.plan_batch(0)
    message = str(error.value)
    assert "(record 10: line 11 of /data/chats.jsonl" in message, message
    assert "TypeError: 'int' object is not iterable; core_v0.16.1's SFTDataset" in message, message
    assert "\n" not in message
    with pytest.raises(ValueError, match=r"sample 5 .* IndexError: list index out of range$"):
        read_sample(loader.dataset, 5)  # no hint for another error


def test_an_sft_jsonl_the_reader_fails_on_is_named_by_file_and_line(monkeypatch, tmp_path) -> None:
    """Megatron-LM's SFT reader (``datasets``' JSON builder) ended an empty file with a bare
    ``StopIteration`` and a malformed line with a ``DatasetGenerationError`` traceback: with ``--sft``
    the reader's error becomes one line naming the file and line (a stand-in reader here)."""
    import json

    from megatron_odc.integration.megatron_lm import sft_data

    class SFTLowLevelDataset:
        def __init__(self, dataset_path: str) -> None:
            with open(dataset_path) as lines:
                self.records = [json.loads(line) for line in lines]
            if not self.records:
                raise StopIteration

    module = types.ModuleType(sft_data.SFT_DATASET_MODULE)
    module.SFTLowLevelDataset = SFTLowLevelDataset
    monkeypatch.setitem(sys.modules, sft_data.SFT_DATASET_MODULE, module)
    assert sft_data.name_bad_sft_data()
    assert sft_data.name_bad_sft_data()  # a second call does not wrap twice
    original = SFTLowLevelDataset.__init__.__megatron_odc_original__
    assert not hasattr(original, "__megatron_odc_original__")
    good = '{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}'
    cases = {
        "empty.jsonl": ("", "empty.jsonl: holds no records"),
        "bad.jsonl": (f"{good}\n{{oops\n", "bad.jsonl:2: invalid JSON"),
        "system.jsonl": (
            good[:-2] + ', {"role": "system", "content": "s"}]}\n',
            "system.jsonl:1: a conversation holds a system message alone",
        ),
    }
    for name, (text, named) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        if name == "system.jsonl":  # the stand-in reads it; the wrapper is not reached
            assert len(SFTLowLevelDataset(str(path)).records) == 1
            assert named in sft_data.first_problem(str(path))
            continue
        with pytest.raises(ValueError, match=r"^--sft data ") as error:
            SFTLowLevelDataset(str(path))
        assert named in str(error.value), error.value
        assert "\n" not in str(error.value)
    (tmp_path / "good.jsonl").write_text(good + "\n")
    assert len(SFTLowLevelDataset(str(tmp_path / "good.jsonl")).records) == 1
    assert sft_data.first_problem(str(tmp_path / "good.jsonl")) is None
