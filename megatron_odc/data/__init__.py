"""Variable-length SFT data for ODC: tokenisation, length-balanced sampling, packing, loss weights.

Entry points: :class:`LengthBalancedSampler` (this rank's microbatches of each minibatch, from a plan
every rank computes alone), :class:`SFTDataset` / :func:`make_synthetic_sft` (JSONL samples with
response-only loss masks), :class:`IndexedSFTDataset` (the same samples preprocessed once by
``python -m megatron_odc.data.preprocess``, memory-mapped), :class:`Lookahead` (the next minibatch planned while this one trains),
:func:`load_tokenizer` / :class:`ByteTokenizer`, and
:func:`pack_microbatch`, :func:`loss_weights`, :func:`global_loss_token_count` (one packed sequence
per microbatch with ``cu_seqlens``, and per-token weights giving the exact global per-token mean).
Nothing in this package imports megatron, except :mod:`.indexed_sft`, which reads and writes megatron-core's
indexed dataset files (it imports ``megatron.core.datasets.indexed_dataset`` when it opens one).
"""

from megatron_odc.data.indexed_sft import IndexedSFTDataset
from megatron_odc.data.lookahead import Lookahead, Prepared
from megatron_odc.data.packing import (
    PackedMicrobatch,
    global_loss_token_count,
    load_microbatch,
    loss_weights,
    pack_microbatch,
    samples_without_loss,
)
from megatron_odc.data.sampler import LengthBalancedSampler, MinibatchAssignment
from megatron_odc.data.sft import (
    SFTDataset,
    SFTSample,
    SFTSamples,
    make_synthetic_sft,
    read_jsonl,
    tokenize_conversation,
)
from megatron_odc.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "IndexedSFTDataset",
    "LengthBalancedSampler",
    "Lookahead",
    "MinibatchAssignment",
    "PackedMicrobatch",
    "Prepared",
    "SFTDataset",
    "SFTSample",
    "SFTSamples",
    "Tokenizer",
    "global_loss_token_count",
    "load_microbatch",
    "load_tokenizer",
    "loss_weights",
    "make_synthetic_sft",
    "pack_microbatch",
    "read_jsonl",
    "samples_without_loss",
    "tokenize_conversation",
]
