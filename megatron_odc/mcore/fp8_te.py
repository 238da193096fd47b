"""The FP8 parameter codec of a model: TransformerEngine ``Float8Tensor`` or the emulated FP8 weight.

``select_fp8_codec(named_params)`` looks at a model's parameters and returns the ``Float8ParamCodec``
(``megatron_odc.core.fp8``) the engine needs for them, or ``None`` when no parameter is FP8:

- ``TEFloat8Codec``: TE's per-tensor-scaled ``Float8Tensor`` parameters (``--fp8-param-gather`` with the
  delayed or tensorwise recipe), through megatron-core's ``fp8_utils`` (the same calls megatron-core's
  distributed optimizer and Megatron-FSDP make): the raw bytes are rebound with
  ``modify_underlying_storage``; after a fetch ``post_all_gather_processing`` builds what TE derives from
  them (the transpose on GPUs without non-TN FP8 GEMMs), before a release the cache is dropped; after a
  step ``quantize_param_shard`` (TE's ``cast_master_weights_to_fp8`` with shard targets, TE >= 2.3)
  re-quantises each rank's owned bytes with the amax reduced over DP;
- ``EmulatedFloat8Codec``: ``EmulatedFloat8Tensor`` parameters (pure torch); ``emulate_fp8_weights``
  turns chosen weights of a megatron-core model into them, to run the FP8 parameter path without TE.

MXFP8, blockwise and NVFP4 parameters have no flat per-tensor byte array to fetch: they are refused with a
message saying what to use instead. This module is Megatron-facing (it imports ``megatron.core``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_odc.core.fp8 import (
    EmulatedFloat8Codec,
    EmulatedFloat8Tensor,
    Float8ParamCodec,
    FP8ShardSlices,
    require_transformer_engine,
)

logger = logging.getLogger(__name__)

TE_MIN_VERSION = "2.3"
"""TransformerEngine that re-quantises into shard targets (``cast_master_weights_to_fp8(fsdp_shard_...)``)."""

_TORCH_FP8_DTYPES = {"kFloat8E4M3": "float8_e4m3fn", "kFloat8E5M2": "float8_e5m2"}


class TEFloat8Codec(Float8ParamCodec):
    """``Float8ParamCodec`` of TransformerEngine's ``Float8Tensor`` (per-tensor scaling).

    Raises:
        ValueError: TransformerEngine is not importable.
    """

    name = "TransformerEngine Float8Tensor"

    def __init__(self) -> None:
        require_transformer_engine("FP8 parameters (--fp8-param-gather)")
        from megatron.core import fp8_utils
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

        self._fp8_utils = fp8_utils
        self._float8_tensor = Float8Tensor

    def is_fp8(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a TE quantized tensor (any recipe; ``check`` refuses the others)."""
        return bool(self._fp8_utils.is_float8tensor(param))

    def check(self, param: torch.Tensor, name: str) -> None:
        """Refuse what ODC cannot shard: non-per-tensor recipes, column-only storage, an old TE."""
        from megatron.core.utils import is_te_min_version

        if not isinstance(param, self._float8_tensor):
            raise ValueError(
                f"FP8 parameter {name!r} is a {type(param).__name__}: --dp-backend odc shards and "
                "fetches per-tensor-scaled Float8Tensor parameters only (--fp8-recipe delayed or "
                "tensorwise); drop --fp8-param-gather (bf16 parameters, FP8 compute) for this recipe"
            )
        if getattr(param, "_data", None) is None:
            raise ValueError(
                f"FP8 parameter {name!r} keeps no row-wise FP8 data (_data is None, transpose-only "
                "storage); --dp-backend odc fetches the row-wise bytes"
            )
        if not is_te_min_version(TE_MIN_VERSION):
            raise ValueError(
                f"FP8 parameter {name!r}: --dp-backend odc re-quantises owned FP8 shards with "
                f"TransformerEngine >= {TE_MIN_VERSION} (cast_master_weights_to_fp8 with shard "
                "targets); upgrade TransformerEngine or drop --fp8-param-gather"
            )

    def raw_data(self, param: torch.Tensor) -> torch.Tensor:
        """The row-wise FP8 bytes ``_data``."""
        return param._data

    def bind(self, param: torch.Tensor, data: torch.Tensor) -> None:
        """``modify_underlying_storage``: copy the bytes into ``data`` and rebind ``_data`` to it."""
        self._fp8_utils.modify_underlying_storage(param, data.view(param._data.shape))

    def after_fetch(self, params: Sequence[torch.Tensor]) -> None:
        """``post_all_gather_processing``: rebuild the transpose where the GPU needs it."""
        self._fp8_utils.post_all_gather_processing(list(params))

    def before_release(self, params: Sequence[torch.Tensor]) -> None:
        """Drop the transpose cache derived from the bytes (rebuilt after the next fetch)."""
        for param in params:
            remove = getattr(param, "remove_caches", None)
            if callable(remove):
                remove()
            elif hasattr(param, "_transpose"):
                param._transpose = None
                param._transpose_invalid = True

    def dequantize_bytes(self, param: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        """``data`` read as the parameter's FP8 format, times its ``_scale_inv``."""
        fmt = getattr(param._fp8_dtype, "name", str(param._fp8_dtype)).split(".")[-1]
        torch_dtype = getattr(torch, _TORCH_FP8_DTYPES[fmt])
        return data.view(torch_dtype).float() * param._scale_inv.float().reshape(-1)[0]

    def master_values(self, param: torch.Tensor, start: int, data: torch.Tensor) -> torch.Tensor:
        """TE's preserved high-precision initial values where kept, else the dequantised bytes."""
        getter = getattr(param, "get_high_precision_init_val", None)
        initial = getter() if callable(getter) else None
        if initial is not None:
            flat = initial.reshape(-1)[start : start + data.numel()]
            return flat.to(device=data.device, dtype=torch.float32)
        return self.dequantize_bytes(param, data)

    def _quantize_shards(self, slices: FP8ShardSlices, group: dist.ProcessGroup | None) -> None:
        """megatron-core's ``quantize_param_shard`` with the owned bytes as shard targets."""
        self._fp8_utils.quantize_param_shard(
            slices.params,
            slices.mains,
            slices.offsets,
            group,
            fsdp_shard_model_params=slices.shards,
        )


def select_fp8_codec(named_params: Iterable[tuple[str, torch.Tensor]]) -> Float8ParamCodec | None:
    """The codec the model's FP8 parameters need; ``None`` if it has none.

    Raises:
        ValueError: the model mixes emulated and TransformerEngine FP8 parameters.
    """
    emulated, te = EmulatedFloat8Codec(), None
    kinds: dict[str, str] = {}
    for name, param in named_params:
        if emulated.is_fp8(param):
            kinds.setdefault("emulated", name)
        elif type(param).__module__.startswith("transformer_engine"):
            te = te or TEFloat8Codec()
            if te.is_fp8(param):
                kinds.setdefault("te", name)
    if len(kinds) > 1:
        raise ValueError(
            f"the model mixes EmulatedFloat8Tensor ({kinds['emulated']!r}) and TransformerEngine FP8 "
            f"parameters ({kinds['te']!r}); use one kind"
        )
    if "emulated" in kinds:
        return emulated
    if "te" in kinds:
        return te
    return None


def emulate_fp8_weights(model: torch.nn.Module, substrings: Sequence[str]) -> list[str]:
    """Replace every weight whose name contains one of ``substrings`` by an ``EmulatedFloat8Tensor``.

    The new parameters keep megatron's tensor-parallel attributes; each is quantised with the scale of
    its own amax. Returns the replaced parameter names.
    """
    from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes

    replaced = []
    for module_name, module in model.named_modules():
        weight = module._parameters.get("weight")
        name = f"{module_name}.weight" if module_name else "weight"
        if weight is None or not any(s in name for s in substrings):
            continue
        fp8 = torch.nn.Parameter(
            EmulatedFloat8Tensor.from_float(weight.detach()), requires_grad=True
        )
        copy_tensor_model_parallel_attributes(fp8, weight)
        module.weight = fp8
        replaced.append(name)
    return replaced
