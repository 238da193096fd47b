"""What the script prints: the closing table of checks, and the dry run (imports, pickling of the rank
bodies, the probes' verdicts, the checks it would run)."""

from __future__ import annotations

import argparse
import pickle
import sys

import torch

from benchmarks.gpu_check_lib.checks import CHECKS, RANK_FUNCTIONS


def table(rows: list[tuple[str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in [("check", "result"), *rows]) for i in range(2)]
    lines = [f"{'check':<{widths[0]}}  {'result':<{widths[1]}}  numbers"]
    lines += [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]
    return "\n".join(lines) + "\n"


def megatron_core_version() -> str:
    """The installed megatron-core's version (the check runs on whichever the image has), or why none."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return "not installed"


def dry_run(args: argparse.Namespace) -> int:
    import megatron_odc.core.fp8
    import megatron_odc.core.streams
    import megatron_odc.transport.cuda as cuda_transport
    from megatron_odc.transport.nvshmem import nvshmem_unavailable_reason

    for fn in RANK_FUNCTIONS:
        pickle.dumps(fn)
    feats = cuda_transport.probe_symm_mem()
    try:  # exactly the names the parity and FP8 rank bodies import
        from megatron.core.models.gpt import GPTModel  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: F401
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.optimizer import OptimizerConfig  # noqa: F401
        from megatron.core.tensor_parallel.random import (  # noqa: F401
            model_parallel_cuda_manual_seed,
        )
        from megatron.core.transformer.module import Float16Module  # noqa: F401

        from megatron_odc.core.fp8 import check_fp8_recipe, quantization_error_bound  # noqa: F401
        from megatron_odc.mcore.backends import build_backend  # noqa: F401
        from megatron_odc.mcore.model import GPTConfig, build_gpt_model, transformer_config  # noqa: F401
        from megatron_odc.mcore.step import train_step  # noqa: F401
        from tests._megatron import _forward_step, make_batch  # noqa: F401
        from tests.mcore import test_fp8_params  # noqa: F401

        megatron_state = f"importable ({megatron_core_version()})"
    except ImportError as exc:
        megatron_state = f"missing ({exc}): the parity check would fail"
    triton_state = "importable"
    try:
        import triton  # noqa: F401
    except ImportError:
        triton_state = "not importable (atomic mode needs it on the GPU box)"
    names = args.only or list(CHECKS)
    sys.stdout.write(
        f"dry run: torch {torch.__version__}, cuda available {torch.cuda.is_available()}\n"
        f"symm_mem: {', '.join(cuda_transport.describe_features(feats))}\n"
        f"nvshmem: {nvshmem_unavailable_reason(feats) or 'available'}\n"
        f"triton: {triton_state}; megatron-core: {megatron_state}; TransformerEngine: "
        f"{'importable' if megatron_odc.core.fp8.transformer_engine_available() else 'not importable'}\n"
        + "".join(f"would run: {name}\n" for name in names)
    )
    return 0
