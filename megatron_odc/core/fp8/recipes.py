"""Which FP8 settings ODC can run, and TransformerEngine on request.

[Note: FP8 amax reductions] Delayed scaling all-reduces amax over TP x DP at every ``fp8_autocast`` exit,
i.e. per microbatch; ODC ranks run different numbers of microbatches, so that reduction deadlocks. ODC
requires ``tp_only_amax_red=True`` with the delayed recipe, or a recipe without that per-step DP reduction
(``tensorwise``, ``mxfp8``, ``blockwise``); :func:`check_fp8_recipe` enforces it. FP8 *parameters* need a
per-tensor recipe (``delayed`` or ``tensorwise``): the others keep no flat byte array to fetch. ODC
reduces the amax of FP8 parameters over DP once per step, when it re-quantises the owned shards.

TransformerEngine is only looked up (:func:`transformer_engine_available`) or imported on request
(:func:`require_transformer_engine`), with a ``ValueError`` naming what to do. No megatron import.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType, SimpleNamespace
from typing import Any

FP8_FORMATS = ("e4m3", "hybrid")
"""Megatron ``--fp8-format`` values."""

FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
"""Megatron ``--fp8-recipe`` values ODC knows; only ``delayed`` reduces amax over DP every microbatch."""

FP8_PARAM_RECIPES = ("delayed", "tensorwise")
"""Recipes whose FP8 parameters are per-tensor scaled flat bytes, which ODC can shard and fetch."""

TE_INSTALL_HINT = (
    "install TransformerEngine (pip install --no-build-isolation transformer_engine[pytorch]) or run "
    "without it: --transformer-impl local and no --fp8-format / --fp8-param-gather"
)


def _check_fp8_param_has_format(fp8: str | None, fp8_param: bool) -> None:
    if fp8_param and not fp8:
        raise ValueError(f"--fp8-param-gather needs --fp8-format ({' or '.join(FP8_FORMATS)})")


def check_fp8_recipe(config: Any) -> None:
    """Refuse FP8 settings whose amax reduction would deadlock ranks with uneven microbatch counts.

    Reads ``fp8``, ``fp8_recipe`` and ``tp_only_amax_red`` from ``config`` (a ``TransformerConfig`` or any
    object with those attributes). See [Note: FP8 amax reductions].

    Raises:
        ValueError: the delayed recipe without ``tp_only_amax_red``, a recipe ODC does not know, or FP8
            parameters (``fp8_param``) with a recipe that is not per-tensor scaled.
    """
    _check_fp8_param_has_format(getattr(config, "fp8", None), getattr(config, "fp8_param", False))
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
    if getattr(config, "fp8_param", False) and recipe not in FP8_PARAM_RECIPES:
        raise ValueError(
            f"--fp8-param-gather with --fp8-recipe {recipe}: --dp-backend odc shards and fetches FP8 "
            f"parameters of a per-tensor recipe ({', '.join(FP8_PARAM_RECIPES)}) only; drop "
            "--fp8-param-gather (bf16 parameters, FP8 compute) or use --fp8-recipe tensorwise"
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
    _check_fp8_param_has_format(fp8, fp8_param)
    wanted = []
    if transformer_impl == "transformer_engine":
        wanted.append("--transformer-impl transformer_engine")
    if fp8:
        wanted.append(f"--fp8-format {fp8}")
    if fp8_param:
        wanted.append("--fp8-param-gather")
    if wanted:
        require_transformer_engine(" and ".join(wanted))


def check_fp8_flags(
    *,
    transformer_impl: str | None,
    fp8: str | None,
    fp8_recipe: str,
    fp8_param: bool,
    tp_only_amax_red: bool,
) -> None:
    """Every FP8 / TransformerEngine rule an entry applies to its flags before building a model.

    FP8 parameters are TransformerEngine ``Float8Tensor``s (TE layers); then :func:`check_fp8_recipe`
    and :func:`check_te_request`.

    Raises:
        ValueError: naming the flag.
    """
    if fp8_param and fp8 and transformer_impl != "transformer_engine":
        raise ValueError(
            f"--fp8-param-gather needs --transformer-impl transformer_engine (got {transformer_impl}): "
            "FP8 parameters are TransformerEngine Float8Tensors"
        )
    check_fp8_recipe(
        SimpleNamespace(
            fp8=fp8, fp8_recipe=fp8_recipe, tp_only_amax_red=tp_only_amax_red, fp8_param=fp8_param
        )
    )
    check_te_request(transformer_impl=transformer_impl, fp8=fp8, fp8_param=fp8_param)
