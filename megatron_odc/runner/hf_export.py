"""A saved checkpoint of this plugin as a Hugging Face model directory (``python -m megatron_odc.hf``).

:func:`export_checkpoint` runs in one process: it builds the GPT that ``--load-hf HF_DIR`` would build
(shape from the HF config, vocabulary from the checkpoint), loads the checkpoint's latest weights into
it at TP=1 (torch_dist reshards from any saved TP / DP layout and backend) and writes it with
``mcore/hf_bridge.py``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch.distributed as dist

from megatron_odc.mcore.hf_bridge import checkpoint_vocab_size, export_hf
from megatron_odc.mcore.model import GPTConfig, build_gpt_model
from megatron_odc.mcore.parallel import model_parallel
from megatron_odc.runner import checkpoint
from megatron_odc.runner.arguments import build_parser, validate_args


def export_checkpoint(
    load_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    hf_dir: str | os.PathLike,
    *,
    bf16: bool = False,
) -> tuple[int, Path]:
    """Write the latest checkpoint of ``load_dir`` as the HF model directory ``out_dir``.

    On a machine without CUDA, megatron-core must already run on CPU (``integration/cpu.py``).

    Args:
        load_dir: a ``--save`` directory of ``python -m megatron_odc.train`` (or Megatron-LM's).
        out_dir: the HF directory to write.
        hf_dir: the HF model the run started from (``--load-hf``): config, tokenizer, shard layout.
        bf16: write bf16 weights (default fp32).

    Returns:
        ``(iteration, out_dir)``.

    Raises:
        ValueError: no checkpoint in ``load_dir``, or it does not fit the HF config (named).
    """
    argv = ["--load-hf", os.fspath(hf_dir), *(["--bf16"] if bf16 else [])]
    try:
        args = validate_args(build_parser().parse_args(argv), world_size=1)
    except ValueError as exc:  # the user passed HF_DIR as --hf-config, not the training flag
        raise ValueError(str(exc).replace("--load-hf", "--hf-config")) from None
    tracked = checkpoint.latest_checkpoint(load_dir)  # a Megatron-LM release: release/
    if tracked is None:
        raise ValueError(f"no checkpoint in {load_dir}: {checkpoint.TRACKER_FILENAME} is missing")
    iteration = tracked.iteration
    vocab_size = checkpoint_vocab_size(tracked.directory)
    own_group = not dist.is_initialized()
    with tempfile.TemporaryDirectory() as store:
        if own_group:
            dist.init_process_group(
                "gloo", init_method=f"file://{store}/rendezvous", rank=0, world_size=1
            )
        try:
            with model_parallel(1):
                gpt = build_gpt_model(GPTConfig.from_args(args, vocab_size=vocab_size), args.seed)
                checkpoint.load_checkpoint(load_dir, gpt, None, finetune=True)
                export_hf(gpt, out_dir, hf_dir)
        finally:
            if own_group:
                dist.destroy_process_group()
    return iteration, Path(out_dir)
