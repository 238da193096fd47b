"""A stand-in for Megatron-LM's ``pretrain_gpt.py`` over the megatron-core wheel's own ``megatron/training``.

From 0.17 the megatron-core wheel ships ``megatron/training``, so CI can run the Megatron-LM integration
without a checkout: ``python -m megatron_odc.launch tests/integration/standin_pretrain_gpt.py <args>``.
Written for this project (not a copy of Megatron-LM's script): it parses with
``arguments.parse_and_validate_args``, builds the GPT model through the config container
(``argument_utils.gpt_config_from_args`` / ``pretrain_cfg_container_from_args``: the model is built by
``megatron/training/models`` and wrapped in ``models.dist_utils._ddp_wrap``, as ``core_v0.19.0``'s
``pretrain_gpt.py`` does), mock GPT data (or, with ``--sft``, Megatron-LM's ``SFTDataset`` with THD packed sequences, as
``pretrain_gpt.py --sft`` does), and a per-token loss, then runs ``training.pretrain``.
Tensor and pipeline parallelism are not handled (DP only).
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training import get_args, get_tokenizer
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.datasets.sft_dataset import SFTDataset
from megatron.training.training import pretrain


def datasets_provider(num_samples, vp_stage=None):
    """Mock GPT train / valid / test datasets of ``--seq-length`` tokens, or ``--sft``'s records."""
    args = get_args()
    sft = bool(args.sft)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        split=args.split,
        blend=([args.data_path[0]], None) if sft else None,
        tokenizer=build_tokenizer(args) if sft else get_tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=not sft,
        context_parallel_size=args.context_parallel_size,
    )
    dataset_type = SFTDataset if sft else MockGPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, num_samples, lambda: True, config).build()


datasets_provider.is_distributed = True


def loss_func(loss_mask, output_tensor):
    """Sum of the masked token losses, the token count, and the report (Megatron's per-token form)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def packed_seq_params(batch):
    """THD parameters of a record batch (micro-batch size 1), or None: ``cu_seqlens`` without the
    right-padding copies of the total that some tags' records carry."""
    if "cu_seqlens" not in batch:
        return None
    cu = batch["cu_seqlens"].reshape(-1)
    cu = cu[: int((cu < cu[-1]).sum()) + 1].to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def forward_step(data_iterator, model):
    """One microbatch through ``model``."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
        packed_seq_params=packed_seq_params(batch),
    )
    return output, partial(loss_func, batch["loss_mask"])


if __name__ == "__main__":
    margs = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    config = pretrain_cfg_container_from_args(margs, gpt_config_from_args(margs))
    pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step)
