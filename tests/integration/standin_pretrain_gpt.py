"""A stand-in for Megatron-LM's ``pretrain_gpt.py`` over the megatron-core wheel's own ``megatron/training``.

From 0.17 the megatron-core wheel ships ``megatron/training``, so CI can run the Megatron-LM integration
without a checkout: ``python -m megatron_odc.launch tests/integration/standin_pretrain_gpt.py <args>``.
Written for this project (not a copy of Megatron-LM's script): mock GPT data (or, with ``--sft``,
Megatron-LM's ``SFTDataset`` with THD packed sequences, as ``pretrain_gpt.py --sft`` does) and a
per-token loss, then ``training.pretrain`` called the way the installed release's ``pretrain_gpt.py``
calls it (:func:`main`, chosen by what the wheel has, not by its version):

- 0.19: arguments parsed first, the model described by a config container
  (``argument_utils.gpt_config_from_args`` / ``pretrain_cfg_container_from_args``) and built by
  ``megatron/training/models``, wrapped in ``models.dist_utils._ddp_wrap``;
- 0.18: arguments parsed first, a config container without a model config, and a model provider
  (:func:`model_provider`: a ``GPTModel`` of the local layer spec) that ``training.get_model`` wraps;
- 0.17: ``pretrain`` parses the arguments itself, with the same model provider.

Tensor and pipeline parallelism are not handled (DP only).
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training import argument_utils, get_args, get_tokenizer, training
from megatron.training.datasets.sft_dataset import SFTDataset

ARGS_DEFAULTS = {"tokenizer_type": "NullTokenizer"}


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


def model_provider(
    pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None
):
    """A ``GPTModel`` of the local (no TransformerEngine) layer spec, for releases whose ``pretrain``
    takes a model provider (0.17, 0.18)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    return GPTModel(
        config=config or core_transformer_config_from_args(args),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def main() -> None:
    """``training.pretrain`` as the installed release's ``pretrain_gpt.py`` calls it."""
    from megatron.training import arguments

    model_type = ModelType.encoder_or_decoder
    if hasattr(argument_utils, "gpt_config_from_args"):  # 0.19: the model is in the config
        margs = arguments.parse_and_validate_args(args_defaults=ARGS_DEFAULTS)
        config = argument_utils.pretrain_cfg_container_from_args(
            margs, argument_utils.gpt_config_from_args(margs)
        )
        training.pretrain(config, datasets_provider, model_type, forward_step)
    elif "cfg_container" in inspect.signature(training.pretrain).parameters:  # 0.18
        config = argument_utils.pretrain_cfg_container_from_args(
            arguments.parse_and_validate_args(args_defaults=ARGS_DEFAULTS)
        )
        training.pretrain(config, datasets_provider, model_provider, model_type, forward_step)
    else:  # 0.17: pretrain parses the arguments
        training.pretrain(
            datasets_provider, model_provider, model_type, forward_step, args_defaults=ARGS_DEFAULTS
        )


if __name__ == "__main__":
    main()
