"""Hugging Face models in and out of megatron-core's GPT, through mbridge.

mbridge (PyPI ``mbridge``) knows each architecture: the megatron-core ``TransformerConfig`` an HF config
means (GQA groups, QKV bias for Qwen2, QK norms for Qwen3, ...), which HF tensors make each megatron
parameter, the QKV interleave and the SwiGLU [gate; up] stacking, the split and merge across TP ranks,
the vocabulary padding, and the safetensors files. This module adds what it lacks
(docs/hf.md says why for each):

- the local (non-TE) layer spec: mbridge names the norms as TransformerEngine's fused layers do
  (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``); megatron-core's
  local spec keeps them as ``input_layernorm`` / ``pre_mlp_layernorm``, so the bridge's name mapping is
  given TE's names for those two (``LOCAL_TO_TE_NAMES``); TE layer specs pass through unchanged;
- export from a model whose parameters are sharded over DP (ODC frees the module's parameter storage
  between fetches): the full TP-local parameters come from the backend (``model.state_dict()``), then
  are merged across TP and converted with mbridge's per-tensor functions, and written by rank 0;
- the RoPE base (transformers 5 moved ``rope_theta`` into ``rope_parameters``, which mbridge 0.15.1 does
  not read) and refusals of what the GPT would silently get wrong (RoPE scaling, sliding windows,
  HF tensors no megatron parameter takes).

Entry points: :func:`hf_model_flags` (the Megatron flags an HF directory's config means),
:func:`load_hf_weights` (into a bare ``GPTModel``, before a backend wraps it), :func:`export_hf` (a
trained model, any backend, to an HF directory) and :func:`checkpoint_vocab_size`.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

logger = logging.getLogger(__name__)

LOCAL_TO_TE_NAMES = {
    ".input_layernorm.": ".self_attention.linear_qkv.layer_norm_",
    ".pre_mlp_layernorm.": ".mlp.linear_fc1.layer_norm_",
}
"""Local-spec parameter name part -> the TE-spec name part mbridge maps (``weight`` / ``bias`` follow)."""

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
"""HF ``model_type`` values tested here (mbridge registers more; they are refused, see docs/hf.md)."""

TOKENIZER_EXTRAS = ("generation_config.json",)
"""Files copied from the source HF directory to an export besides the tokenizer's own."""


def _import_mbridge() -> Any:
    try:
        import mbridge
    except ImportError as exc:
        raise ValueError(
            "Hugging Face import/export needs the packages mbridge, transformers and safetensors "
            "(pip install -r requirements.txt, or pip install -e .[hf])"
        ) from exc
    return mbridge


def read_hf_config(hf_dir: str | os.PathLike) -> Any:
    """The ``transformers`` config of a local HF model directory (nothing is downloaded).

    Raises:
        ValueError: no such directory, no config.json, a config.json that does not parse, or a model
            type not in ``SUPPORTED_MODEL_TYPES``.
    """
    _import_mbridge()
    import transformers

    path = os.fspath(hf_dir)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"{path!r} is not a Hugging Face model directory (no config.json); pass a local "
            "directory written by save_pretrained (nothing is downloaded)"
        )
    config_file = os.path.join(path, "config.json")
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:  # transformers wraps a JSON error in an OSError
        cause = exc.__cause__ or exc.__context__ or exc
        detail = str(cause).splitlines()[0] if str(cause) else ""
        raise ValueError(
            f"{config_file} cannot be read as a Hugging Face config ({type(cause).__name__}: "
            f"{detail}); fix or replace the file"
        ) from exc
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {config.model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def rope_base(hf_config: Any) -> float:
    """The RoPE theta of ``hf_config`` (transformers 5: ``rope_parameters``; 4.x: ``rope_theta``).

    Raises:
        ValueError: RoPE scaling other than the default (llama3, yarn, linear, ...), which the GPT
            built here does not apply.
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ValueError(
            f"the HF config's RoPE scaling {rope_type!r} is not supported (only plain RoPE)"
        )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("the HF config names no rope_theta")
    return float(theta)


def _bridge_class(base: type) -> type:
    """``base`` (an mbridge bridge class) mapping the local spec's norm names, with its own mappings.

    mbridge's Qwen2 bridge writes the tied-embedding mapping into its *class* dict when tied; each
    instance here gets its own copy, reset to the untied default first.
    """

    class LocalSpecBridge(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._DIRECT_MAPPING = {**base._DIRECT_MAPPING, "output_layer.weight": "lm_head.weight"}
            super().__init__(*args, **kwargs)

        def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
            return super()._weight_name_mapping_mcore_to_hf(te_name(mcore_weights_name))

    LocalSpecBridge.__name__ = f"LocalSpec{base.__name__}"
    return LocalSpecBridge


def te_name(name: str) -> str:
    """The TE-spec name of a local-spec parameter name (other names unchanged)."""
    for local, te in LOCAL_TO_TE_NAMES.items():
        if local in name:
            return name.replace(local, te)
    return name


def make_bridge(hf_config: Any, dtype: torch.dtype, *, parallel: bool) -> Any:
    """An mbridge bridge for ``hf_config``; ``parallel``: megatron's current TP groups (else TP=1)."""
    mbridge = _import_mbridge()
    from mbridge.core.parallel_states import ParallelStates

    states = ParallelStates.get_parallel_state() if parallel else ParallelStates()
    selected = mbridge.AutoBridge.from_config(hf_config, dtype=dtype, parallel_states=states)
    return _bridge_class(type(selected))(hf_config, dtype=dtype, parallel_states=states)


def hf_model_flags(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """The Megatron model flags (argparse ``dest`` -> value) that the HF config of ``hf_dir`` means.

    The architecture comes from mbridge's ``TransformerConfig`` for the config; the RoPE base and the
    tied embeddings from the HF config. ``vocab_size`` is the HF config's (unpadded).

    Raises:
        ValueError: see :func:`read_hf_config` and :func:`rope_base`; a sliding-window Qwen config.
    """
    hf_config = read_hf_config(hf_dir)
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(f"{hf_dir}: sliding-window attention is not supported")
    if getattr(hf_config, "mlp_bias", False) or (
        hf_config.model_type == "llama" and getattr(hf_config, "attention_bias", False)
    ):
        raise ValueError(f"{hf_dir}: Llama with attention_bias / mlp_bias is not supported")
    config = make_bridge(hf_config, torch.float32, parallel=False).config
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    return {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.ffn_hidden_size,
        "num_attention_heads": heads,
        "group_query_attention": groups != heads,
        "num_query_groups": groups if groups != heads else 1,
        "kv_channels": config.kv_channels,
        "norm_epsilon": config.layernorm_epsilon,
        "normalization": config.normalization,
        "swiglu": config.gated_linear_unit,
        "disable_bias_linear": not config.add_bias_linear,
        "add_qkv_bias": bool(config.add_qkv_bias),
        "qk_layernorm": bool(config.qk_layernorm),
        "position_embedding_type": "rope",
        "rotary_base": rope_base(hf_config),
        "untie_embeddings_and_output_weights": not getattr(hf_config, "tie_word_embeddings", False),
        "vocab_size": hf_config.vocab_size,
    }


def _set_vocab_padding(bridge: Any, model_vocab_size: int) -> None:
    """mbridge pads (load) and cuts (export) the embedding and output rows beyond the HF vocabulary."""
    hf_vocab = bridge.hf_config.vocab_size
    if model_vocab_size < hf_vocab:
        raise ValueError(
            f"the model's vocabulary ({model_vocab_size}) is smaller than the HF config's ({hf_vocab})"
        )
    if model_vocab_size != hf_vocab:
        bridge.make_vocab_size_divisible_by = 1  # any value: mbridge pads when it is set
    bridge.vocab_size = hf_vocab
    bridge.padded_vocab_size = model_vocab_size


def load_hf_weights(gpt: torch.nn.Module, hf_dir: str | os.PathLike) -> None:
    """Load the safetensors weights of ``hf_dir`` into ``gpt``, a bare (TP-sharded) ``GPTModel``.

    Collective over the TP group: TP rank 0 of each replica reads the files and scatters the shards
    (mbridge's ``load_weights``). Padded vocabulary rows are zero.

    Raises:
        ValueError: an HF tensor that no parameter of ``gpt`` takes (the GPT would ignore it), named.
    """
    hf_config = read_hf_config(hf_dir)
    bridge = make_bridge(hf_config, gpt.config.params_dtype, parallel=True)
    _set_vocab_padding(bridge, gpt.vocab_size)
    path = os.fspath(hf_dir)
    from mbridge.core.safetensor_io import SafeTensorIO

    on_disk = set(SafeTensorIO(path).load_hf_weight_names())
    global_names = bridge._weight_name_mapping_mcore_local_to_global(gpt)
    taken = {
        n for name in global_names.values() for n in bridge._weight_name_mapping_mcore_to_hf(name)
    }
    unused = sorted(n for n in on_disk - taken if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(
            f"{path}: {len(unused)} tensor(s) have no place in the megatron GPT built from its "
            f"config (first: {unused[0]!r}); this architecture variant is not supported"
        )
    with torch.no_grad():
        bridge.load_weights([gpt], path)
    logger.info("loaded %d HF tensors from %s", len(taken), path)


def bridge_for(gpt: torch.nn.Module, hf_config: Any) -> Any:
    """The bridge of ``gpt`` (a bare, TP-sharded ``GPTModel``) to ``hf_config`` (from
    :func:`read_hf_config`): megatron's current TP groups, the model's padded vocabulary."""
    bridge = make_bridge(hf_config, gpt.config.params_dtype, parallel=True)
    _set_vocab_padding(bridge, gpt.vocab_size)
    return bridge


def checkpoint_vocab_size(checkpoint_dir: str | os.PathLike) -> int:
    """The vocabulary (embedding rows) of a torch_dist checkpoint of a GPT.

    Raises:
        ValueError: the checkpoint holds no word embedding.
    """
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(os.fspath(checkpoint_dir))
    for key, tensor in metadata.items():
        if key.endswith("embedding.word_embeddings.weight"):
            return int(tensor.global_shape[0])
    raise ValueError(f"{checkpoint_dir}: the checkpoint holds no embedding.word_embeddings.weight")


def hf_global_names(bridge: Any, gpt: torch.nn.Module) -> dict[str, str]:
    """The bridge's global megatron name of each of ``gpt``'s (TP-local) parameter names."""
    return bridge._weight_name_mapping_mcore_local_to_global(gpt, consider_ep=False)


def hf_tensors_of(
    bridge: Any, global_name: str, name: str, param: torch.nn.Parameter, value: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """``(hf name, tensor)`` of one parameter's full TP-local ``value``, merged across TP (collective
    over the TP group for a TP-split parameter), on the CPU."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = dist.get_world_size(tp_group)
    value = value.detach()
    if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
        parts = [torch.empty_like(value) for _ in range(tp_size)]
        dist.all_gather(parts, value.contiguous(), group=tp_group)
        value = bridge._weight_merge_across_tp(name, parts, param)
    names, tensors = bridge._weight_to_hf_format(global_name, value)
    return [
        (hf_name, tensor.detach().to("cpu").contiguous())
        for hf_name, tensor in zip(names, tensors, strict=True)
    ]


def _hf_tensors(bridge: Any, gpt: torch.nn.Module, full: dict[str, torch.Tensor]):
    """``(hf name, tensor)`` of every parameter, merged across TP (collective over the TP group)."""
    global_names = hf_global_names(bridge, gpt)
    for name, param in gpt.named_parameters():
        yield from hf_tensors_of(bridge, global_names[name], name, param, full[name])


def export_hf(
    model: torch.nn.Module, out_dir: str | os.PathLike, hf_dir: str | os.PathLike
) -> Path | None:
    """Write ``model`` as a Hugging Face model directory ``out_dir`` (config and tokenizer from ``hf_dir``).

    Collective over every rank: the full TP-local parameters come from the backend
    (``model.state_dict()``; ODC gathers them from their owners), the first DP replica merges them
    across TP, and global rank 0 writes into a temporary directory renamed to ``out_dir`` (replacing
    an earlier export), so ``out_dir`` always holds a complete model.

    Args:
        model: the trained model: a backend wrapper (``ODCDataParallel``, megatron-core DDP) or a bare
            ``GPTModel``.
        out_dir: the HF directory to write.
        hf_dir: the HF directory the model was loaded from (config, tokenizer, shard layout).

    Returns:
        ``out_dir`` on global rank 0, else None.
    """
    gpt = unwrap_model(model)
    full = model.state_dict()  # ODC: collective over DP
    hf_config = read_hf_config(hf_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    written = None
    if parallel_state.get_data_parallel_rank() == 0:
        bridge = bridge_for(gpt, hf_config)
        tensors = _hf_tensors(bridge, gpt, full)
        if rank == 0:
            written = _write_hf_dir(bridge, tensors, Path(out_dir), Path(hf_dir))
        else:
            for _ in tensors:  # join the TP gathers
                pass
    if dist.is_initialized():
        dist.barrier()
    return written


def _write_hf_dir(bridge: Any, tensors: Iterator, out_dir: Path, hf_dir: Path) -> Path:
    from mbridge.core.safetensor_io import SafeTensorIO

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    io = SafeTensorIO(os.fspath(hf_dir))  # keeps the source's shard layout and index
    io.save_hf_weight(tensors, os.fspath(tmp), bridge._get_hf_shared_weight_keys())
    if io.origin_index:
        io.save_index(os.fspath(tmp))
    bridge.hf_config.save_pretrained(os.fspath(tmp))
    _copy_tokenizer(hf_dir, tmp)
    if out_dir.exists():
        old = out_dir.with_name(f"{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out_dir, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, out_dir)
    logger.info("wrote the Hugging Face model %s", out_dir)
    return out_dir


def _copy_tokenizer(hf_dir: Path, out_dir: Path) -> None:
    """The tokenizer of ``hf_dir`` (re-saved by transformers) and ``TOKENIZER_EXTRAS``, when present."""
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            os.fspath(hf_dir), local_files_only=True
        )
    except (OSError, ValueError) as exc:
        logger.warning("no tokenizer copied from %s (%s)", hf_dir, exc)
    else:
        tokenizer.save_pretrained(os.fspath(out_dir))
    for name in TOKENIZER_EXTRAS:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, out_dir / name)
