"""The packed-SFT check's rank body: THD microbatches of real lengths under uneven counts.

Every step trains the same skewed global batch of records (:data:`SFT_LENGTHS`), packed without padding
into microbatches of at most :data:`SFT_CAP` tokens whose samples attend only within themselves (THD
``cu_seqlens``): ODC with LB-Mini's plan (uneven counts per rank) against megatron-core DDP with
LB-Micro's (equal counts) of the same records, both with the per-token loss. On a GPU the model is the
TransformerEngine spec (TE's THD attention kernels); in a CPU rehearsal the local spec, whose THD path
is the CPU runtime's per-segment attention.
"""

from __future__ import annotations

import functools

import torch

from benchmarks.gpu_check_lib.training_ranks import (
    _adam,
    _gpt_config,
    _local_gpt,
    _odc_options,
    _shm_options,
    _te_gpt,
    _train,
)
from benchmarks.gpu_check_lib.world import rank_device, rehearsing

SFT_LENGTHS = (140, 140, 140, 100, 100, 100, 100, 20)
"""One global batch: three 140s never share a 256-token microbatch, the 100s and the 20 do (LB-Mini:
counts 3 and 2; LB-Micro: 2 and 2)."""
SFT_CAP = 256
PROMPT_TOKENS = 4
"""Tokens of each record without loss (its prompt)."""


def _plan(kind: str, cfg):
    from megatron_odc.balance import CostModel, make_plan

    cost = CostModel.from_model_config(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        vocab_size=cfg.vocab_size,
    )
    ids = list(range(len(SFT_LENGTHS)))
    return make_plan(kind, ids, list(SFT_LENGTHS), 2, cap_tokens=SFT_CAP, cost_model=cost)


def _packed_batches(cfg, kind: str, step: int, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """This rank's packed microbatches of ``step`` under plan ``kind``, on the rank's device."""
    from megatron_odc.data.packing import pack_microbatch
    from megatron_odc.data.sft import SFTSample

    batches = []
    for microbatch in _plan(kind, cfg).rank_microbatches(dp_rank):
        samples = []
        for sample in microbatch:
            gen = torch.Generator().manual_seed(1000 * step + sample)
            tokens = torch.randint(1, cfg.vocab_size, (SFT_LENGTHS[sample],), generator=gen)
            mask = torch.ones(tokens.numel(), dtype=torch.bool)
            mask[:PROMPT_TOKENS] = False
            samples.append(SFTSample(tokens, mask))
        packed = pack_microbatch(samples, pad_id=0)
        device = rank_device()
        batches.append(
            {
                "tokens": packed.tokens.to(device),
                "labels": packed.labels.to(device),
                "position_ids": packed.position_ids.to(device),
                "loss_mask": packed.loss_mask.to(device),
                "cu_seqlens": packed.cu_seqlens.to(torch.int32).to(device),
                "max_seqlen": packed.max_seqlen,
            }
        )
    return batches


def _thd_forward_step(data_iterator, model):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_odc.mcore.step import per_token_loss

    batch = next(data_iterator)
    packed = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch["cu_seqlens"],
        cu_seqlens_kv=batch["cu_seqlens"],
        max_seqlen_q=batch["max_seqlen"],
        max_seqlen_kv=batch["max_seqlen"],
    )
    output = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        packed_seq_params=packed,
    )
    return output, functools.partial(per_token_loss, batch["loss_mask"])


def run_thd_sft(rank: int, world_size: int, steps: int) -> dict:
    """ODC + LB-Mini against DDP + LB-Micro on packed THD microbatches; losses and counts."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        cfg = _gpt_config(seq_length=SFT_CAP)
        opt = _adam(cfg)
        model = (
            (lambda: _local_gpt(cfg, 7)) if rehearsing() else (lambda: _te_gpt(cfg, 7, False, None))
        )
        options = _shm_options(20_000) if rehearsing() else _odc_options(20_000)
        runs = {
            backend: _train(
                backend,
                model(),
                cfg,
                steps,
                opt,
                options,
                batches=functools.partial(_packed_batches, cfg, kind),
                forward_step=_thd_forward_step,
            )
            for backend, kind in (("ddp", "lb_micro"), ("odc", "lb_mini"))
        }
    finally:
        parallel_state.destroy_model_parallel()
    return {
        "ddp_losses": runs["ddp"]["losses"],
        "odc_losses": runs["odc"]["losses"],
        "ddp_counts": _plan("lb_micro", cfg).num_microbatches(),
        "odc_counts": _plan("lb_mini", cfg).num_microbatches(),
    }
