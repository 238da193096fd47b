"""FP8 parameter bookkeeping for ODC: owned-shard re-quantisation, DP-wide amax, fetched FP8 bytes.

With FP8 parameters (TransformerEngine ``Float8Tensor``, per-tensor scaling) the bytes peers fetch are the
FP8 data, so after every optimizer step each owner re-quantises *its* slice of every FP8 parameter from the
fp32 main shard. Every rank must derive the same scale for a parameter, so the per-parameter amax of the
owned slices is reduced (MAX) over the DP group: one ``all_reduce`` of a stacked vector, at the fence after
the step (``FP8ShardBookkeeper.requantize``). A fetched bucket's FP8 bytes plus the shared ``scale_inv``
dequantise to within FP8 rounding of the fp32 master.

[Note: FP8 amax reductions] Delayed scaling all-reduces amax over TP x DP at every ``fp8_autocast`` exit,
i.e. per microbatch; ODC ranks run different numbers of microbatches, so that reduction deadlocks. ODC
requires ``tp_only_amax_red=True`` with the delayed recipe, or a recipe without that per-step DP reduction
(``tensorwise``, ``mxfp8``, ``blockwise``); ``check_fp8_recipe`` enforces it.

The core (scales, quantise / dequantise, amax reduction, the bookkeeper) is pure torch with a real stand-in
quantiser, so CPU tests exercise it. TransformerEngine glue (``te_*`` functions) imports TE lazily and raises
``ValueError`` naming the missing piece. This module imports no megatron module.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import logging
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
"""Largest finite magnitude of each FP8 format (OCP FP8: E4M3FN and E5M2)."""

FP8_MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}
FP8_MIN_SUBNORMAL = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}

FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
"""Megatron ``--fp8-recipe`` values ODC knows; only ``delayed`` reduces amax over DP every microbatch."""

TE_INSTALL_HINT = (
    "install TransformerEngine (pip install --no-build-isolation transformer_engine[pytorch]) or run "
    "without it: --transformer-impl local and no --fp8-format / --fp8-param-gather"
)


# ---------------------------------------------------------------------- stand-in quantiser (real maths)


def _torch_fp8_dtype(fmt: str) -> torch.dtype | None:
    name = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}[fmt]
    return getattr(torch, name, None)


def _check_format(fmt: str) -> None:
    if fmt not in FP8_MAX:
        raise ValueError(f"FP8 format {fmt!r} is not one of {', '.join(FP8_MAX)}")


def compute_scale(amax: torch.Tensor, fmt: str = "e4m3", margin: int = 0) -> torch.Tensor:
    """Per-tensor scale ``fp8_max / amax / 2**margin``; 1 where amax is 0 or not finite (TE's rule).

    Args:
        amax: absolute maxima (any shape, fp32).
        fmt: ``"e4m3"`` or ``"e5m2"``.
        margin: extra power-of-two headroom.
    """
    _check_format(fmt)
    amax = amax.float()
    scale = FP8_MAX[fmt] / amax / (2.0**margin)
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, scale, torch.ones_like(scale))


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str = "e4m3") -> torch.Tensor:
    """Quantise ``x * scale`` to FP8, saturating at the format's max; returns the raw bytes (uint8).

    Uses torch's FP8 dtypes (round to nearest even); if this torch has none, an int8 grid of the same
    range (coarser, still a real quantiser).
    """
    _check_format(fmt)
    fp8_max = FP8_MAX[fmt]
    scaled = (x.float() * scale).clamp(-fp8_max, fp8_max)
    dtype = _torch_fp8_dtype(fmt)
    if dtype is not None:
        return scaled.to(dtype).view(torch.uint8)
    return torch.round(scaled * (127.0 / fp8_max)).to(torch.int8).view(torch.uint8)


def dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor | float, fmt: str = "e4m3"
) -> torch.Tensor:
    """Inverse of ``quantize``: raw FP8 bytes times ``scale_inv`` (= 1 / scale), in fp32."""
    _check_format(fmt)
    if data.dtype != torch.uint8:
        raise ValueError(f"FP8 data must be raw bytes (torch.uint8), got {data.dtype}")
    dtype = _torch_fp8_dtype(fmt)
    if dtype is not None:
        values = data.view(dtype).float()
    else:
        values = data.view(torch.int8).float() * (FP8_MAX[fmt] / 127.0)
    return values * scale_inv


def quantization_error_bound(
    x: torch.Tensor, scale: torch.Tensor | float, fmt: str = "e4m3"
) -> torch.Tensor:
    """Per-element bound on ``|dequantize(quantize(x)) - x|`` for values inside the scaled range.

    Round to nearest: half a unit in the last place, ``|x| * 2**-(m+1)`` for normals, plus half the
    smallest subnormal (divided by the scale) for tiny values.
    """
    _check_format(fmt)
    if _torch_fp8_dtype(fmt) is None:
        return torch.full_like(x.float(), FP8_MAX[fmt] / 127.0 / 2) / scale
    rel = 2.0 ** -(FP8_MANTISSA_BITS[fmt] + 1)
    return x.float().abs() * rel + FP8_MIN_SUBNORMAL[fmt] / 2 / scale


# ---------------------------------------------------------------------- owned-shard bookkeeping


@dataclasses.dataclass(frozen=True)
class FP8ParamShard:
    """Where this rank's owned slice of one FP8 parameter lives.

    Attributes:
        name: parameter name.
        main_offset: element offset of the owned slice in this rank's fp32 main shard.
        data_offset: byte offset of the owned slice in this rank's FP8 (uint8) param shard.
        numel: owned elements (0 when this rank owns none of the parameter).
    """

    name: str
    main_offset: int
    data_offset: int
    numel: int


class FP8ShardBookkeeper:
    """Per-parameter FP8 scales of the owned shards over one DP group.

    Every DP rank constructs it with the same parameter names in the same order (the amax vector is
    reduced position by position).

    Args:
        params: this rank's owned slice of every FP8 parameter (``numel=0`` where it owns nothing).
        fmt: FP8 format of the parameter data (``"e4m3"``; also for ``--fp8-format hybrid``).
        margin: scale headroom in powers of two.
    """

    def __init__(
        self, params: Sequence[FP8ParamShard], *, fmt: str = "e4m3", margin: int = 0
    ) -> None:
        _check_format(fmt)
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise ValueError(f"FP8 parameter names must be unique, got {names}")
        for p in params:
            if min(p.main_offset, p.data_offset, p.numel) < 0:
                raise ValueError(
                    f"FP8 parameter {p.name!r}: offsets and numel must be >= 0, got {p}"
                )
        self.params = list(params)
        self.fmt = fmt
        self.margin = margin
        self._index = {p.name: i for i, p in enumerate(self.params)}
        self.scale = torch.ones(len(self.params))
        """Per-parameter scale, shared by every DP rank after ``requantize``."""
        self.scale_inv = torch.ones(len(self.params))
        """``1 / scale``: what dequantises fetched bytes."""

    def local_amax(self, main_shard: torch.Tensor) -> torch.Tensor:
        """Absolute max of each parameter's owned slice of ``main_shard`` (0 where nothing is owned)."""
        amax = torch.zeros(len(self.params), dtype=torch.float32, device=main_shard.device)
        for i, p in enumerate(self.params):
            if p.numel:
                self._check_range(p, main_shard.numel(), p.main_offset, "main shard")
                amax[i] = main_shard[p.main_offset : p.main_offset + p.numel].abs().max().float()
        return amax

    def reduce_amax(self, amax: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """MAX-reduce the amax vector over ``group`` (one collective); in place, also returned."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return amax
        if amax.is_cuda and dist.get_backend(group) == "gloo":
            # gloo's CUDA all_reduce support varies by build; the vector is tiny, reduce it on the host.
            host = amax.cpu()
            dist.all_reduce(host, op=dist.ReduceOp.MAX, group=group)
            amax.copy_(host)
        else:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    def requantize(
        self,
        main_shard: torch.Tensor,
        fp8_shard: torch.Tensor,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """After a step: new scales from the DP-wide amax, then quantise the owned slices into ``fp8_shard``.

        Collective over ``group`` (call it at the fence, on every DP rank, including ranks that own no part
        of some parameter).

        Args:
            main_shard: this rank's fp32 main-param shard.
            fp8_shard: this rank's FP8 param shard (uint8) that peers fetch.
            group: the DP process group.

        Returns:
            ``scale_inv`` per parameter (identical on every DP rank).
        """
        if fp8_shard.dtype != torch.uint8:
            raise ValueError(
                f"the FP8 param shard must be torch.uint8 bytes, got {fp8_shard.dtype}"
            )
        amax = self.reduce_amax(self.local_amax(main_shard), group).cpu()
        self.scale = compute_scale(amax, self.fmt, self.margin)
        self.scale_inv = 1.0 / self.scale
        for i, p in enumerate(self.params):
            if not p.numel:
                continue
            self._check_range(p, fp8_shard.numel(), p.data_offset, "FP8 shard")
            src = main_shard[p.main_offset : p.main_offset + p.numel]
            fp8_shard[p.data_offset : p.data_offset + p.numel] = quantize(
                src, float(self.scale[i]), self.fmt
            )
        return self.scale_inv

    def dequantize_param(self, name: str, data: torch.Tensor) -> torch.Tensor:
        """Dequantise fetched FP8 bytes of parameter ``name`` with the shared ``scale_inv``."""
        try:
            i = self._index[name]
        except KeyError:
            raise ValueError(f"{name!r} is not an FP8 parameter of this bookkeeper") from None
        return dequantize(data, float(self.scale_inv[i]), self.fmt)

    @staticmethod
    def _check_range(p: FP8ParamShard, size: int, offset: int, what: str) -> None:
        if offset + p.numel > size:
            raise ValueError(
                f"FP8 parameter {p.name!r}: owned range [{offset}, {offset + p.numel}) exceeds the "
                f"{what} of {size} elements"
            )


def select_fp8_params(
    named_params: Iterable[tuple[str, torch.Tensor]],
    is_fp8: Callable[[torch.Tensor], bool] | None = None,
) -> list[str]:
    """Names of the FP8 parameters, in order.

    Args:
        named_params: ``(name, parameter)`` pairs.
        is_fp8: predicate; default TransformerEngine's ``is_float8tensor`` (or, without TE, nothing is
            FP8: FP8 parameters only exist under TE).
    """
    if is_fp8 is None:
        is_fp8 = _te_is_float8tensor()
    return [name for name, p in named_params if is_fp8(p)]


# ---------------------------------------------------------------------- config checks


def check_fp8_recipe(config: Any) -> None:
    """Refuse FP8 settings whose amax reduction would deadlock ranks with uneven microbatch counts.

    Reads ``fp8``, ``fp8_recipe`` and ``tp_only_amax_red`` from ``config`` (a ``TransformerConfig`` or any
    object with those attributes). See [Note: FP8 amax reductions].

    Raises:
        ValueError: the delayed recipe without ``tp_only_amax_red``, or a recipe ODC does not know.
    """
    if not getattr(config, "fp8", None):
        return
    recipe = getattr(config, "fp8_recipe", "delayed")
    recipe = getattr(recipe, "value", recipe)  # Megatron's Fp8Recipe enum or a plain string
    if recipe not in FP8_RECIPES:
        raise ValueError(
            f"--fp8-recipe {recipe!r} is not supported with --dp-backend odc (its amax reduction "
            f"cannot be checked); use one of {', '.join(FP8_RECIPES)}"
        )
    if recipe == "delayed" and not getattr(config, "tp_only_amax_red", False):
        raise ValueError(
            "--fp8-recipe delayed all-reduces amax over TP x DP at every microbatch, which deadlocks "
            "--dp-backend odc ranks that run different numbers of microbatches; add --tp-only-amax-red "
            "(ODC reduces amax over DP once per step) or use --fp8-recipe tensorwise"
        )


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine.pytorch`` can be found (without importing it)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def require_transformer_engine(feature: str) -> ModuleType:
    """Import ``transformer_engine.pytorch`` for ``feature`` or raise a ``ValueError`` that says what to do."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError as exc:
        raise ValueError(
            f"{feature} needs TransformerEngine, which is not importable ({exc}); {TE_INSTALL_HINT}"
        ) from exc


def check_te_request(
    *, transformer_impl: str | None = None, fp8: str | None = None, fp8_param: bool = False
) -> None:
    """Fail early and clearly when the TE layer spec or FP8 is requested without TransformerEngine.

    Args:
        transformer_impl: Megatron's ``--transformer-impl`` (``"transformer_engine"`` or ``"local"``).
        fp8: ``--fp8-format`` (``"e4m3"``, ``"hybrid"``) or ``None``.
        fp8_param: ``--fp8-param-gather``.

    Raises:
        ValueError: a TE feature is requested and TE is not importable, or FP8 params without FP8.
    """
    if fp8_param and not fp8:
        raise ValueError("--fp8-param-gather needs --fp8-format (e4m3 or hybrid)")
    wanted = []
    if transformer_impl == "transformer_engine":
        wanted.append("--transformer-impl transformer_engine")
    if fp8:
        wanted.append(f"--fp8-format {fp8}")
    if fp8_param:
        wanted.append("--fp8-param-gather")
    if wanted:
        require_transformer_engine(" and ".join(wanted))


# ---------------------------------------------------------------------- TransformerEngine glue (lazy)


def _te_is_float8tensor() -> Callable[[torch.Tensor], bool]:
    if not transformer_engine_available():
        return lambda tensor: False
    try:
        from transformer_engine.pytorch.tensor import QuantizedTensor
    except ImportError:
        from transformer_engine.pytorch.float8_tensor import Float8Tensor as QuantizedTensor
    return lambda tensor: isinstance(tensor, QuantizedTensor)


def te_fp8_parts(param: torch.Tensor, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """The raw FP8 bytes (``_data``, uint8) and ``_scale_inv`` of a TE ``Float8Tensor`` parameter.

    Raises:
        ValueError: TE is missing, or ``param`` is not a per-tensor-scaled Float8Tensor (MXFP8 and
            blockwise tensors have no flat ``_data``: fetch bf16 and quantise locally for those).
    """
    require_transformer_engine(f"FP8 parameter {name!r}")
    data = getattr(param, "_data", None)
    scale_inv = getattr(param, "_scale_inv", None)
    if not isinstance(data, torch.Tensor) or not isinstance(scale_inv, torch.Tensor):
        raise ValueError(
            f"parameter {name!r} ({type(param).__name__}) is not a per-tensor-scaled TE Float8Tensor "
            "with _data and _scale_inv; ODC fetches FP8 bytes only for those"
        )
    return data, scale_inv


def te_bind_fetched_data(param: torch.Tensor, data_view: torch.Tensor, name: str = "") -> None:
    """Point a ``Float8Tensor``'s ``_data`` at its bytes inside the fetched (unsharded) bucket."""
    data, _ = te_fp8_parts(param, name)
    if data_view.dtype != torch.uint8 or data_view.numel() != data.numel():
        raise ValueError(
            f"parameter {name!r}: the fetched view has {data_view.numel()} elements of "
            f"{data_view.dtype}, the FP8 data needs {data.numel()} of torch.uint8"
        )
    param._data = data_view.view(data.shape)


def te_post_all_gather_processing(params: Sequence[torch.Tensor]) -> None:
    """Call TE's ``post_all_gather_processing`` after a fetch (transposes / columnwise data).

    On a TE without it this is a no-op: TE then builds the transposes in the next forward (what
    megatron-core does as well).
    """
    require_transformer_engine("post_all_gather_processing")
    try:
        from transformer_engine.pytorch.tensor.utils import post_all_gather_processing
    except ImportError:
        logger.debug("this TransformerEngine has no post_all_gather_processing; skipped")
        return
    post_all_gather_processing(list(params))


def te_quantize_param_shard(
    model_params: Sequence[torch.Tensor],
    main_params: Sequence[torch.Tensor | None],
    start_offsets: Sequence[int | None],
    dp_group: dist.ProcessGroup | None,
    fsdp_shard_model_params: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """TE's re-quantisation of owned shards (it all-reduces amax over ``dp_group``: call at the fence).

    Uses ``cast_master_weights_to_fp8`` (TE >= 2.2) with ``manual_post_all_gather_processing=True`` where
    the installed TE accepts it, since ODC calls ``te_post_all_gather_processing`` after each fetch.

    Raises:
        ValueError: TE is missing or too old to re-quantise shards, or the argument lists differ in length.
    """
    if not len(model_params) == len(main_params) == len(start_offsets):
        raise ValueError(
            f"te_quantize_param_shard: {len(model_params)} params, {len(main_params)} main shards and "
            f"{len(start_offsets)} offsets"
        )
    require_transformer_engine("re-quantising FP8 parameter shards")
    try:
        from transformer_engine.pytorch.tensor.utils import cast_master_weights_to_fp8
    except ImportError as exc:
        raise ValueError(
            "re-quantising FP8 parameter shards needs TransformerEngine >= 2.2 "
            f"(cast_master_weights_to_fp8): {exc}"
        ) from exc
    kwargs: dict[str, Any] = {}
    accepted = inspect.signature(cast_master_weights_to_fp8).parameters
    if fsdp_shard_model_params is not None:
        if "fsdp_shard_model_weights" not in accepted:
            raise ValueError(
                "FP8 shard re-quantisation into ODC's shards needs TransformerEngine >= 2.3 "
                "(cast_master_weights_to_fp8(fsdp_shard_model_weights=...))"
            )
        kwargs["fsdp_shard_model_weights"] = list(fsdp_shard_model_params)
    if "manual_post_all_gather_processing" in accepted:
        kwargs["manual_post_all_gather_processing"] = True
    cast_master_weights_to_fp8(
        list(model_params), list(main_params), list(start_offsets), dp_group, **kwargs
    )
