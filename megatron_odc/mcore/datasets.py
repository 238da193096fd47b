"""megatron-core's pretraining datasets (Megatron indexed data through ``GPTDataset``).

:func:`gpt_pretraining_dataset` builds the train split of ``--data-path`` with megatron-core's
``BlendedMegatronDatasetBuilder``; each sample is one ``--seq-length`` sequence with its causal mask.
"""

from __future__ import annotations

import argparse
from typing import Any


class _DatasetTokenizer:
    """What megatron-core's GPTDataset reads off a tokenizer: ``vocab_size``, ``eod``, ``pad``, and
    ``unique_identifiers`` (hashed into the names of its index caches)."""

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eos_id
        self.pad = tokenizer.pad_id
        hf = getattr(tokenizer, "hf", None)
        self.unique_identifiers = {
            "class": type(tokenizer).__name__,
            "name_or_path": str(getattr(hf, "name_or_path", "")),
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "pad": self.pad,
        }


def gpt_pretraining_dataset(args: argparse.Namespace, tokenizer: Any) -> Any:
    """The train split of megatron-core's GPTDataset over ``--data-path`` (Megatron indexed data).

    Built on every rank (rank 0 first writes the index caches, the others then read them), with as
    many samples as ``--train-iters`` iterations of ``--global-batch-size`` consume. With weights
    (``--data-path W1 P1 W2 P2``) every document of each prefix is train data: ``--split`` applies to
    unweighted prefixes only, whose train share alone is built. Reads ``seed``,
    ``seq_length``, ``data_path``, ``split``, ``data_cache_path``, ``train_iters`` and
    ``global_batch_size`` from ``args``; ``tokenizer`` has ``vocab_size``, ``eos_id`` and ``pad_id``.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    blend = get_blend_from_list(args.data_path)
    # Weighted (--data-path W1 P1 W2 P2 ...): megatron-core sizes every split of a weighted blend,
    # and a split with no documents then never ends (GPTDataset._get_num_epochs), so the weighted
    # blend is the train split's alone, every document of each prefix (--split does not apply).
    weighted = blend[1] is not None
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if weighted else blend,
        blend_per_split=[blend, None, None] if weighted else None,
        split=None if weighted else args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=_DatasetTokenizer(tokenizer),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,
    )
    if not weighted:
        # Only the train split is used. Building the others too failed on small unweighted prefixes:
        # a prefix without a document in a valid / test split gave that split's blend a weight of 0,
        # which megatron-core's BlendedDataset refuses. The train split's document range is the same.
        config.split_matrix = [config.split_matrix[0], None, None]
    num_samples = args.train_iters * args.global_batch_size
    train_ds, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, None, None], lambda: True, config
    ).build()
    if train_ds is None:
        raise ValueError(f"--data-path / --split {args.split!r}: the train split is empty")
    return train_ds
