"""The Megatron-LM patch layer (``megatron_odc.integration.megatron_lm``) and the launcher.

Megatron-LM's ``megatron.training`` is not a dependency (megatron-core's wheel ships a copy only from
0.17), so the patch layer is exercised against a fake of the patched names, written from the
installed megatron-core series' row of ``integration/megatron_lm/releases.py`` (the tag's modules, and
every name of the row with the row's parameters: :func:`fake_megatron_lm_sources`) to a tmp dir and put
on ``sys.path`` inside spawned ranks; megatron-core is the real installed one (0.16.1 on Python 3.11,
0.19.2 on 3.12). One
2-rank world checks: flags composed with the caller's provider and post-processed, refusals naming the
flag, ``get_model`` building ``ODCDataParallel`` and restoring ``DDP``, the optimizer factory, the
planned-count schedule (uneven and zero counts give the same step as another split of the same samples),
the TP broadcast of the count, the balanced loader through the patched factory, version refusal, and
``revert``, and the checkpoint overrides the factories install. The symbols that live in megatron-core are checked against the installed package here.

The end-to-end run of the real ``pretrain_gpt.py`` needs ``MEGATRON_LM_PATH`` and Megatron-LM's dependencies
(skipped otherwise, with the reason: ``tests/_megatron_lm.py``): ODC
with LB-Mini and megatron-core DDP must print the same losses (dropout off, same seed), also launched
as across nodes (``mpiexec`` with ``--odc-transport mpi``; hybrid sharding over pretend hosts), and ODC's
``--save`` / ``--load`` resume must print the uninterrupted run's losses.
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_odc.integration.megatron_lm.releases import (
    MEGATRON_LM_RELEASES,
    MegatronLmRelease,
    release_for_series,
)
from megatron_odc.transport.hosts import LOCAL_WORLD_SIZE_ENV
from tests._dist import run_ranks
from tests._megatron_lm import E2E_ARGS, megatron_lm_tag, pretrain_gpt_losses
from tests._mpi import requires_mpi

# ----------------------------------------------------------------------------- the fake Megatron-LM
#
# Written from the row of the installed megatron-core's series (``integration/megatron_lm/releases.py``):
# every name of the row's ``signatures`` exists where the tag has it, with the row's parameter names (so
# the version guard accepts the fake exactly as it accepts the tag), and the modules are the tag's
# (``models/dist_utils.py`` from core_v0.18.2). A name the row adds that the fake has no behaviour for
# is a stub that raises when called. What the fake does is the tags' own flow, read from the row: where
# the row has ``arguments.parse_and_validate_args``, parsing is that (pretrain_gpt.py's call from
# core_v0.18.2) and ``initialize_megatron`` parses nothing; ``setup_model_and_optimizer`` builds through
# the row's first model builder (``get_model``, or ``dist_utils._ddp_wrap`` for core_v0.19.0).

_T = "megatron.training"
_ARGS = f"{_T}.arguments"
_INIT = f"{_T}.initialize"
_TRAIN = f"{_T}.training"
_DIST_UTILS = f"{_T}.models.dist_utils"

_HEADERS = {
    f"{_T}": "from megatron.training.global_vars import get_args, set_args",
    f"{_T}.global_vars": """
        _GLOBAL_ARGS = None

        def get_args():
            return _GLOBAL_ARGS

        def set_args(args):
            global _GLOBAL_ARGS
            _GLOBAL_ARGS = args

        def get_tensorboard_writer():
            return None

        def get_wandb_writer():
            return None
    """,
    _ARGS: """
        import argparse

        from megatron.training.global_vars import set_args
    """,
    _INIT: """
        from megatron.training.global_vars import get_args, set_args

        def _compile_dependencies():
            raise RuntimeError('compiles helpers')

        def set_jit_fusion_options(*args, **kwargs):
            raise RuntimeError('needs CUDA')
    """,
    f"{_T}.checkpointing": "",
    f"{_T}.datasets": "",
    f"{_T}.datasets.data_samplers": "",
    _TRAIN: """
        import dataclasses

        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.enums import ModelType
        from megatron.core.utils import get_model_config
        from megatron.training.global_vars import get_args
        from megatron.training.initialize import set_jit_fusion_options

        def _ddp_config(args):
            kwargs = {}
            for f in dataclasses.fields(DistributedDataParallelConfig):
                if hasattr(args, f.name):
                    kwargs[f.name] = getattr(args, f.name)
            return DistributedDataParallelConfig(**kwargs)

        def _build_elsewhere(model_provider_func):
            # a builder ODC does not hook (as core_v0.19.0's models/dist_utils.py would be unhooked)
            module = model_provider_func(pre_process=True, post_process=True)
            return [DDP(config=get_model_config(module), ddp_config=DistributedDataParallelConfig(),
                        module=module)]
    """,
    f"{_T}.models": "",
    _DIST_UTILS: "from megatron.core.utils import get_model_config",
}
"""Each fake module's fixed part; the row's names are added below it."""

_IMPORTED = {
    f"{_TRAIN}.DDP": "from megatron.core.distributed import DistributedDataParallel as DDP",
    f"{_DIST_UTILS}.DistributedDataParallel": (
        "from megatron.core.distributed import DistributedDataParallel"
    ),
    f"{_TRAIN}.get_megatron_optimizer": "from megatron.core.optimizer import get_megatron_optimizer",
    f"{_TRAIN}.get_forward_backward_func": (
        "from megatron.core.pipeline_parallel import get_forward_backward_func"
    ),
}
"""Names of the row that are megatron-core's own objects (the tag imports them)."""

_DEFINED_IN = {
    f"{_INIT}.parse_args": _ARGS,
    f"{_INIT}.validate_args": _ARGS,
    f"{_TRAIN}.initialize_megatron": _INIT,
    f"{_TRAIN}.build_pretraining_data_loader": f"{_T}.datasets.data_samplers",
}
"""Names the tag binds by import from another of its modules: defined there, imported here."""

_PARSE = """
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args()
    else:
        args = parser.parse_args()
    return args
"""
_FLAGS = [
    "'--micro-batch-size', type=int, default=None",
    "'--global-batch-size', type=int, default=None",
    "'--seq-length', type=int, default=None",
    "'--tensor-model-parallel-size', type=int, default=1",
    "'--num-layers', type=int, default=None",
    "'--hidden-size', type=int, default=None",
    "'--ffn-hidden-size', type=int, default=None",
    "'--num-attention-heads', type=int, default=None",
    "'--group-query-attention', action='store_true'",
    "'--num-query-groups', type=int, default=1",
    "'--swiglu', action='store_true'",
    "'--vocab-size', type=int, default=None",
    "'--train-iters', type=int, default=None",
    "'--log-interval', type=int, default=100",
    "'--pipeline-model-parallel-size', type=int, default=1",
    "'--num-virtual-stages-per-pipeline-rank', type=int, default=None",
    "'--use-distributed-optimizer', action='store_true'",
    "'--use-megatron-fsdp', action='store_true'",
    "'--use-torch-fsdp2', action='store_true'",
    "'--overlap-grad-reduce', action='store_true'",
    "'--overlap-param-gather', action='store_true'",
    "'--fp8-format', type=str, default=None, dest='fp8'",
    "'--fp8-recipe', type=str, default='delayed'",
    "'--fp8-param-gather', action='store_true'",
    "'--transformer-impl', type=str, default='transformer_engine'",
    "'--calculate-per-token-loss', action='store_true'",
    "'--dataloader-type', type=str, default=None",
    "'--save', type=str, default=None",
    "'--load', type=str, default=None",
    "'--ckpt-format', type=str, default='torch_dist'",
]

_BODIES = {
    f"{_ARGS}.parse_args": "parser = argparse.ArgumentParser(description='Megatron-LM Arguments', "
    "allow_abbrev=False)\n"
    + "".join(f"parser.add_argument({flag})\n" for flag in _FLAGS)
    + textwrap.dedent(_PARSE),
    f"{_ARGS}.validate_args": """
        import torch

        if args.fp8_param_gather:  # core_v0.16.1's check, which ODC's wrapper must get past
            assert args.use_distributed_optimizer or not torch.is_grad_enabled(), \\
                '--fp8-param-gather only supported with distributed optimizer, or inference mode'
        args.validated = (args.fp8_param_gather, torch.is_grad_enabled())  # as printed
        # the tags derive the virtual stages here (None for one)
        vpp = args.num_virtual_stages_per_pipeline_rank
        args.virtual_pipeline_model_parallel_size = vpp if vpp and vpp > 1 else None
        return args
    """,
    f"{_ARGS}.parse_and_validate_args": """
        args = parse_args(extra_args_provider, ignore_unknown_args)
        validate_args(args, args_defaults or {})
        set_args(args)
        return args
    """,
    f"{_T}.checkpointing._build_sharded_state_dict_metadata": "return {}",
    f"{_TRAIN}.build_pretraining_data_loader": (
        "return ('megatron-sampler', dataset, consumed_samples)"
    ),
    f"{_TRAIN}.get_model": """
        args = get_args()
        model = [model_provider_func(pre_process=True, post_process=True)]
        if wrap_with_ddp:
            DP = DDP
            ddp_config = _ddp_config(args)
            config = get_model_config(model[0])
            model = [DP(config=config, ddp_config=ddp_config, module=m,
                        disable_bucketing=(i > 0)) for i, m in enumerate(model)]
        return model
    """,
    f"{_DIST_UTILS}._ddp_wrap": """
        config = get_model_config(model[0])
        return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=m,
                                        disable_bucketing=(i > 0)
                                        or bool(overlap_param_gather_with_optimizer_step))
                for i, m in enumerate(model)]
    """,
}
"""What the fake's functions do, keyed by the row's names; the parameters are the row's."""

_DEFAULTS = {"wrap_with_ddp": "True", "ignore_unknown_args": "False"}
"""Defaults the fake's bodies rely on (every other parameter defaults to None)."""


def _parses_in_initialize(row: MegatronLmRelease) -> bool:
    """Whether the tag's ``initialize_megatron`` parses the arguments (before core_v0.18.2's
    ``arguments.parse_and_validate_args``, which ``pretrain_gpt.py`` calls first)."""
    return f"{_ARGS}.parse_and_validate_args" not in row.signatures


def _row_signatures(row: MegatronLmRelease) -> dict[str, tuple[str, ...]]:
    """The row's names, and ``initialize_megatron`` (which the fake's callers use) where it has none."""
    parses = ("extra_args_provider", "args_defaults", "ignore_unknown_args")
    default = parses if _parses_in_initialize(row) else ()
    return {f"{_TRAIN}.initialize_megatron": default, **row.signatures}


def _row_bodies(row: MegatronLmRelease) -> dict[str, str]:
    """:data:`_BODIES` plus the two whose behaviour the row decides."""
    bodies = dict(_BODIES)
    if _parses_in_initialize(row):
        bodies[f"{_TRAIN}.initialize_megatron"] = _BODIES[f"{_ARGS}.parse_and_validate_args"]
    else:  # the row's pretrain_gpt.py parses first (parse_and_validate_args)
        bodies[f"{_TRAIN}.initialize_megatron"] = "return get_args()"
    if row.model_builders[0] == f"{_TRAIN}.get_model":
        build = "model = get_model(model_provider_func, model_type)"
    else:
        assert row.model_builders[0] == f"{_DIST_UTILS}._ddp_wrap", row.model_builders
        build = (
            "from megatron.training.models import dist_utils\n\n"
            "modules = [model_provider_func(pre_process=True, post_process=True)]\n"
            "model = dist_utils._ddp_wrap(modules, False, _ddp_config(get_args()), False, "
            "pg_collection=None)"
        )
    bodies[f"{_TRAIN}.setup_model_and_optimizer"] = (
        "if getattr(get_args(), 'build_elsewhere', False):\n"
        "    return _build_elsewhere(model_provider_func), None, None\n"
        f"{build}\nreturn model, None, None"
    )
    return bodies


def fake_megatron_lm_sources(row: MegatronLmRelease) -> dict[str, str]:
    """``{relative path: source}`` of the fake Megatron-LM of ``row`` (see above)."""
    bodies, signatures = _row_bodies(row), _row_signatures(row)
    parts: dict[str, list[str]] = {m: [textwrap.dedent(h).strip("\n")] for m, h in _HEADERS.items()}
    defined: set[str] = set()
    for name in dict.fromkeys([*signatures, *row.patch_points]):
        module, attr = name.rsplit(".", 1)
        if name in _IMPORTED:
            parts[module].append(_IMPORTED[name])
            continue
        home = _DEFINED_IN.get(name, module)
        if home != module:
            parts[module].append(f"from {home} import {attr}")
        if f"{home}.{attr}" in defined:
            continue
        defined.add(f"{home}.{attr}")
        params = ", ".join(f"{p}={_DEFAULTS.get(p, 'None')}" for p in signatures[name])
        body = bodies.get(
            name,
            f"raise NotImplementedError('{attr}: the fake Megatron-LM has no behaviour for it')",
        )
        parts[home].append(
            f"def {attr}({params}):\n" + textwrap.indent(textwrap.dedent(body).strip("\n"), "    ")
        )
    used = {n.rsplit(".", 1)[0] for n in signatures} | set(_DEFINED_IN.values())
    used |= {_ARGS, _INIT, _TRAIN, f"{_T}.global_vars"}
    used |= {".".join(m.split(".")[:i]) for m in used for i in range(2, m.count(".") + 1)}
    packages = {m for m in used if any(o.startswith(f"{m}.") for o in used)}
    return {
        m.replace(".", "/") + ("/__init__.py" if m in packages else ".py"): "\n\n".join(parts[m])
        + "\n"
        for m in sorted(used)
    }


def _installed_row() -> MegatronLmRelease:
    """The Megatron-LM row of the installed megatron-core's series."""
    from megatron_odc.mcore.releases import current_release

    row = release_for_series(current_release().series)
    assert row is not None, current_release()
    return row


CFG_KW = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "ffn_hidden_size": 64,
    "vocab_size": 64,
    "seq_length": 8,
}
BASE_ARGV = ["pretrain_gpt.py", "--micro-batch-size", "1", "--global-batch-size", "4"]
BASE_ARGV += ["--seq-length", str(CFG_KW["seq_length"]), "--transformer-impl", "local"]
BASE_ARGV += [f"--{k.replace('_', '-')}={v}" for k, v in CFG_KW.items() if k != "seq_length"]
BASE_ARGV += ["--train-iters", "1", "--log-interval", "1"]


def _write_fake_megatron_lm(root: Path, row: MegatronLmRelease) -> None:
    for rel, text in fake_megatron_lm_sources(row).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _import_fake(fake_root: str):
    sys.path.insert(0, fake_root)
    import importlib

    training = importlib.import_module("megatron.training.training")
    assert training.__file__.startswith(fake_root), training.__file__
    return (
        importlib.import_module("megatron.training.arguments"),
        importlib.import_module("megatron.training.initialize"),
        training,
    )


def _parse(initialize, argv: list[str], extra=None):
    """Megatron-LM's args from ``argv`` as the row's ``pretrain_gpt.py`` gets them."""
    sys.argv = list(argv)
    if not _parses_in_initialize(_installed_row()):
        sys.modules[_ARGS].parse_and_validate_args(extra_args_provider=extra)
        return initialize.initialize_megatron()
    return initialize.initialize_megatron(extra_args_provider=extra)


def _error_of(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return ""


class _PlanIterable:
    """A data iterator offering a planned count, like the balanced loader's iterator."""

    def __init__(self, counts: list[int], batches: list[dict]) -> None:
        self.counts = list(counts)
        self.batches = list(batches)
        self.asked = 0

    def next_num_microbatches(self) -> int:
        self.asked += 1
        return self.counts.pop(0)

    def __next__(self) -> dict:
        return self.batches.pop(0)


def _check_flags(arguments, initialize) -> dict:
    def extra(parser):
        parser.add_argument("--caller-flag", type=int, default=0)
        return parser

    args = _parse(
        initialize,
        [*BASE_ARGV, "--dp-backend", "odc", "--odc-bucket-size", "777", "--caller-flag", "5"],
        extra,
    )
    stock = _parse(initialize, BASE_ARGV)
    distopt = _parse(initialize, [*BASE_ARGV, "--dp-backend", "distopt"])
    refusals = {}
    sys.argv = [*BASE_ARGV, "--dp-backend", "odc", "--pipeline-model-parallel-size", "2"]
    refusals["pp_accepted"] = _error_of(lambda: arguments.parse_args())
    vpp = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
    refusals["vpp"] = _error_of(
        lambda: _parse(initialize, [*BASE_ARGV, "--dp-backend", "odc", *vpp])
    )
    refusals["vpp_ddp_accepted"] = _error_of(
        lambda: _parse(initialize, [*BASE_ARGV, "--dp-backend", "ddp", *vpp])
    )
    for extra_argv in (
        ["--use-megatron-fsdp"],
        ["--use-torch-fsdp2"],
        ["--use-distributed-optimizer"],
        ["--overlap-grad-reduce"],
        ["--save", "/tmp/ckpt", "--ckpt-format", "torch"],
        ["--load", "/tmp/ckpt", "--ckpt-format", "torch_dcp"],
    ):
        sys.argv = [*BASE_ARGV, "--dp-backend", "odc", *extra_argv]
        refusals[extra_argv[0]] = _error_of(lambda: arguments.parse_args())
    sys.argv = [
        *BASE_ARGV,
        "--dp-backend",
        "odc",
        "--micro-batch-size",
        "2",
        "--balance",
        "lb_mini",
    ]
    refusals["mbs"] = _error_of(lambda: arguments.parse_args())
    sys.argv = [*BASE_ARGV, "--dp-backend", "fsdp", "--balance", "lb_mini"]
    refusals["fsdp"] = _error_of(lambda: arguments.parse_args())
    sys.argv = [*BASE_ARGV, "--dp-backend", "odc", "--save", "/tmp/c", "--load", "/tmp/c"]
    refusals["torch_dist_accepted"] = _error_of(lambda: arguments.parse_args())
    # FP8 parameters: refused where ODC cannot run them, accepted (past Megatron-LM's
    # distributed-optimizer assertion, the flag intact afterwards) where it can.
    from megatron_odc.core.fp8 import recipes as fp8_module

    te = ["--transformer-impl", "transformer_engine"]
    fp8 = ["--fp8-format", "hybrid", "--fp8-param-gather"]
    for key, extra_argv in (
        ("fp8_no_format", ["--fp8-param-gather"]),
        ("fp8_blockwise", [*te, *fp8, "--fp8-recipe", "blockwise"]),
        ("fp8_local", fp8),
        ("te_missing", te),
        ("fp8_te_missing", [*te, *fp8]),
    ):
        sys.argv = [*BASE_ARGV, "--dp-backend", "odc", *extra_argv]
        refusals[key] = _error_of(lambda: arguments.parse_args())
    fp8_args = {"te_available": fp8_module.transformer_engine_available()}
    real_require = fp8_module.require_transformer_engine
    fp8_module.require_transformer_engine = lambda feature: None  # a TE install, as far as flags go
    try:
        for backend in ("odc", "fsdp"):
            parsed = _parse(initialize, [*BASE_ARGV, "--dp-backend", backend, *te, *fp8])
            fp8_args[backend] = (parsed.fp8_param_gather, parsed.validated, parsed.fp8)
    finally:
        fp8_module.require_transformer_engine = real_require
    fp8_args["grad_mode_after"] = torch.is_grad_enabled()
    try:  # neither the stock path nor the distopt baseline is changed
        _parse(initialize, [*BASE_ARGV, *fp8])
        fp8_args["stock"] = "accepted"
    except ValueError as exc:  # Megatron-LM's assertion, as the patched validate_args' one line
        fp8_args["stock"] = str(exc)
    fp8_args["distopt"] = _parse(initialize, [*BASE_ARGV, "--dp-backend", "distopt", *fp8]).fp8
    mbs2 = _parse(initialize, [*BASE_ARGV, "--dp-backend", "odc", "--micro-batch-size", "2"])
    fsdp = _parse(initialize, [*BASE_ARGV, "--dp-backend", "fsdp"])
    return {
        "caller_flag": args.caller_flag,
        "dp_backend": args.dp_backend,
        "per_token": args.calculate_per_token_loss,
        "tp_only_amax_red": args.tp_only_amax_red,
        "odc_bucket_size": args.odc_bucket_size,
        "balance": args.balance,
        "stock_backend": stock.dp_backend,
        "stock_per_token": stock.calculate_per_token_loss,
        "stock_has_amax": hasattr(stock, "tp_only_amax_red"),
        "distopt_sets_flag": distopt.use_distributed_optimizer,
        "mbs2_balance": mbs2.balance,
        "fsdp": (fsdp.odc_transport, fsdp.balance, fsdp.calculate_per_token_loss),
        "refusals": refusals,
        "fp8_args": fp8_args,
    }


def _build(training, cfg, seed: int):
    from megatron_odc.mcore.model import build_gpt_model

    return training.get_model(lambda pre_process, post_process: build_gpt_model(cfg, seed=seed))


def _full_params(chunk) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in chunk.state_dict().items() if torch.is_tensor(v)}


def _step(training, cfg, counts, batches, rank: int):
    """Build an ODC model through the patched factories, run one planned step, return results."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.utils import unwrap_model

    from tests._megatron import _forward_step

    model = _build(training, cfg, seed=11)
    gpt = unwrap_model(model[0])
    installed = [type(gpt.sharded_state_dict).__name__, model[0].load_state_dict.optimizer]
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, weight_decay=0.0)
    optimizer = training.get_megatron_optimizer(opt_config, model)
    # Megatron-LM's checkpointing calls land on the ODC overrides, with this optimizer.
    installed.append(model[0].load_state_dict.optimizer is optimizer.chained_optimizers[0])
    installed.append("param_state" in optimizer.sharded_state_dict({}, metadata={}))
    model[0].config.finalize_model_grads_func = finalize_model_grads
    before = _full_params(model[0])
    fb = training.get_forward_backward_func()
    plan = _PlanIterable(counts, batches)
    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    losses = fb(
        forward_step_func=_forward_step,
        data_iterator=RerunDataIterator(plan),
        model=model,
        num_microbatches=99,  # ignored: the plan decides
        seq_length=cfg.seq_length,
        micro_batch_size=1,
        forward_only=False,
    )
    success, grad_norm, _ = optimizer.step()
    after = _full_params(model[0])
    report = torch.stack([r["lm loss"] for r in losses]).sum(0) if losses else None
    out = {
        "optimizer": (type(optimizer).__mro__, type(optimizer.chained_optimizers[0]).__name__),
        "num_chained": len(optimizer.chained_optimizers),
        "keys": [sorted(r) for r in losses],
        "num_reports": len(losses),
        "report": report,
        "asked": plan.asked,
        "changed": max(float((after[k] - before[k]).abs().max()) for k in after),
        "after": after,
        "grad_norm": float(grad_norm),
        "success": success,
        "schedule_type": type(fb).__name__,
        "checkpoint_overrides": installed,
    }
    model[0].close()
    return out


def _run_fake_training(rank: int, world_size: int, fake_root: str) -> dict:
    from megatron.core import package_info, parallel_state
    from megatron.core.distributed import DistributedDataParallel

    from megatron_odc.integration import megatron_lm
    from megatron_odc.integration.cpu import SKIP_VERSION_CHECK_ENV
    from megatron_odc.integration.megatron_lm.schedule import PlannedCountSchedule
    from megatron_odc.integration.megatron_lm.version import resolve_name
    from megatron_odc.mcore.data_parallel import ODCDataParallel
    from megatron_odc.mcore.model import GPTConfig
    from tests._megatron import init_megatron, make_batch, teardown_megatron

    arguments, initialize, training = _import_fake(fake_root)
    row = _installed_row()
    # Every patch point and swapped class of the row, and the CPU shims' targets in the tree.
    names = sorted({*row.patch_points, *row.signatures, f"{_TRAIN}.set_jit_fusion_options"})
    originals = {n: resolve_name(n) for n in names}
    originals["is_available"] = torch.cuda.is_available
    out: dict = {"row": row.tag}

    # Version refusal: a wrong megatron-core version, then a changed signature; nothing stays patched.
    real_version = package_info.__version__
    package_info.__version__ = "0.15.0"
    try:
        out["refuse_version"] = _error_of(megatron_lm.apply_megatron_lm_patches)
        os.environ[SKIP_VERSION_CHECK_ENV] = "1"
        megatron_lm.apply_megatron_lm_patches().revert()
        out["skip_env_ok"] = True
    finally:
        os.environ.pop(SKIP_VERSION_CHECK_ENV, None)
        package_info.__version__ = real_version
    training.get_forward_backward_func = lambda pp_size=None: None
    out["refuse_signature"] = _error_of(megatron_lm.apply_megatron_lm_patches)
    training.get_forward_backward_func = originals[f"{_TRAIN}.get_forward_backward_func"]
    # The skip variable with a patch point gone: skipped with a warning, never an AttributeError.
    setup = training.setup_model_and_optimizer
    del training.setup_model_and_optimizer
    out["refuse_missing"] = _error_of(megatron_lm.apply_megatron_lm_patches)
    os.environ[SKIP_VERSION_CHECK_ENV] = "1"
    try:
        skipped = megatron_lm.apply_megatron_lm_patches()
        out["skip_missing_patched"] = list(skipped.patched)
        skipped.revert()
    finally:
        os.environ.pop(SKIP_VERSION_CHECK_ENV, None)
        training.setup_model_and_optimizer = setup
    out["clean_after_refusal"] = all(resolve_name(n) is originals[n] for n in names)

    init_megatron(1, seed=7)
    handle = megatron_lm.apply_megatron_lm_patches()
    try:
        out["patched"] = list(handle.patched)
        out["flags"] = _check_flags(arguments, initialize)
        cfg = GPTConfig(**CFG_KW, calculate_per_token_loss=True)

        # get_model: ODC while it runs, DDP back afterwards; stock DDP without --dp-backend.
        _parse(initialize, [*BASE_ARGV, "--dp-backend", "odc", "--odc-bucket-size", "3000"])
        model = _build(training, cfg, seed=11)
        out["odc_wrapped"] = isinstance(model[0], ODCDataParallel)
        out["odc_config"] = (
            type(model[0].ddp_config).__name__,
            model[0].odc_config.bucket_size,
        )
        ddp_names = [n for n in row.signatures if n.endswith((".DDP", ".DistributedDataParallel"))]
        out["ddp_restored"] = [resolve_name(n) is DistributedDataParallel for n in ddp_names]
        model[0].close()
        # After Megatron-LM built the model, a chunk ODC did not wrap stops the run (one line).
        from megatron_odc.integration.megatron_lm.builders import close_odc_chunks
        from megatron_odc.mcore.model import build_gpt_model

        margs = _parse(initialize, [*BASE_ARGV, "--dp-backend", "odc"])

        def provider(pre_process, post_process):
            return build_gpt_model(cfg, seed=11)

        built = training.setup_model_and_optimizer(model_provider_func=provider, model_type=None)
        out["setup_odc"] = type(built[0][0]).__name__
        out["setup_ddp_restored"] = [resolve_name(n) is DistributedDataParallel for n in ddp_names]
        close_odc_chunks()
        margs.build_elsewhere = True
        out["unhooked"] = _error_of(
            lambda: training.setup_model_and_optimizer(
                model_provider_func=provider, model_type=None
            )
        )
        margs.dp_backend = None
        out["unhooked_stock"] = type(
            training.setup_model_and_optimizer(model_provider_func=provider, model_type=None)[0][0]
        ).__name__
        _parse(initialize, BASE_ARGV)
        stock = _build(training, cfg, seed=11)
        out["stock_type"] = type(stock[0]).__name__
        del stock

        # Planned counts: (3, 0) and (1, 2) over the same three samples give the same step.
        _parse(initialize, [*BASE_ARGV, "--dp-backend", "odc", "--odc-bucket-size", "3000"])
        batch = make_batch(cfg, 3, seed=5)
        samples = [
            {k: v[i : i + 1] for k, v in batch.items() if k != "attention_mask"} for i in range(3)
        ]
        for s in samples:
            s["attention_mask"] = batch["attention_mask"]
        split_a = [samples, []][rank]
        split_b = [samples[:1], samples[1:]][rank]
        out["a"] = _step(training, cfg, [len(split_a)], split_a, rank)
        out["b"] = _step(training, cfg, [len(split_b)], split_b, rank)

        # The balanced loader through the patched factory (train split only).
        from megatron.core.datasets.utils import Split

        class _Dataset(list):
            index_split = Split.train

        class _Valid(list):
            index_split = Split.valid

        dataset = _Dataset({"i": torch.tensor(i)} for i in range(12))
        loader = training.build_pretraining_data_loader(dataset, 4)
        it = iter(loader)
        count = it.next_num_microbatches()
        got = [int(next(it)["i"]) for _ in range(count)]
        out["loader"] = (type(loader).__name__, count, got)
        out["valid_loader"] = training.build_pretraining_data_loader(_Valid([1]), 0)[0]
    finally:
        handle.revert()
        teardown_megatron()
    out["restored"] = {n: resolve_name(n) is originals[n] for n in names}

    # The count is broadcast over TP from the rank that has data (TP=2: both ranks).
    init_megatron(2, seed=7)
    try:
        schedule = PlannedCountSchedule(inner=None)
        source = (
            _PlanIterable([5], []) if parallel_state.get_tensor_model_parallel_rank() == 0 else None
        )
        out["tp_count"] = schedule.planned_count(source, default=2)
        # Megatron-LM's DDP on the balanced loader: the TP rank without a loader runs the planned
        # count too (it used to pass through with the caller's, beside its peer's broadcast).
        from megatron.training.global_vars import get_args, set_args

        saved = get_args()
        set_args(argparse.Namespace(dp_backend="ddp", balance="lb_micro", log_interval=1000))
        ran = []
        ddp_schedule = PlannedCountSchedule(inner=lambda **kw: ran.append(kw["num_microbatches"]))
        source = (
            _PlanIterable([3], []) if parallel_state.get_tensor_model_parallel_rank() == 0 else None
        )
        ddp_schedule(
            forward_step_func=None,
            data_iterator=source,
            model=[torch.nn.Linear(1, 1)],
            num_microbatches=8,
        )
        set_args(saved)
        out["ddp_tp_counts"] = ran
    finally:
        teardown_megatron()

    # cpu=True adds Megatron-LM's CPU shims (and distopt's checkpoint-load workarounds over torch's
    # Adam) and reverts them with everything else.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    distopt_methods = dict(vars(DistributedOptimizer))
    handle = megatron_lm.apply_megatron_lm_patches(cpu=True)
    out["cpu_shims"] = (torch.cuda.is_available(), torch.zeros(1).type(), torch.cuda.device_count())
    out["distopt_patched"] = sorted(
        name.split(".")[1] for name in handle.patched if name.startswith("DistributedOptimizer.")
    )
    handle.revert()
    from megatron_odc.integration.cpu import active_cpu_patches

    out["cpu_reverted"] = (
        torch.cuda.is_available is originals["is_available"],
        torch.zeros(1).type(),
        active_cpu_patches() is None,
        training.set_jit_fusion_options is originals[f"{_TRAIN}.set_jit_fusion_options"],
        dict(vars(DistributedOptimizer)) == distopt_methods,
    )
    return out


@pytest.fixture(scope="module")
def fake_results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("fake_megatron_lm")
    _write_fake_megatron_lm(root, _installed_row())
    return run_ranks(_run_fake_training, 2, str(root), timeout_s=120, pg_timeout_s=60)


# ----------------------------------------------------------------------------- tests


def test_core_symbols_match_the_expected_signatures() -> None:
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.rerun_state_machine import (
        RerunDataIterator,
        RerunState,
        get_rerun_state_machine,
    )

    from megatron_odc.integration.megatron_lm.releases import release_for_series
    from megatron_odc.mcore.releases import current_release

    def names(fn) -> tuple[str, ...]:
        return tuple(inspect.signature(fn).parameters)

    release = release_for_series(current_release().series)
    table = {name.rsplit(".", 1)[1]: sig for name, sig in release.signatures.items()}
    # Megatron-LM's training.py binds these megatron-core objects by name.
    assert names(get_megatron_optimizer) == table["get_megatron_optimizer"]
    assert names(DistributedDataParallel.__init__) == table["DDP"]
    assert names(get_forward_backward_func) == table["get_forward_backward_func"]
    # What the zero-count path and the wrapper call.
    assert names(finalize_model_grads)[:2] == ("model", "num_tokens")
    schedule = inspect.signature(forward_backward_no_pipelining).parameters
    for p in ("forward_step_func", "data_iterator", "model", "num_microbatches", "forward_only"):
        assert schedule[p].kind is inspect.Parameter.KEYWORD_ONLY
    assert names(ChainedOptimizer.__init__) == ("self", "chained_optimizers")
    rerun = RerunDataIterator(iter([]))
    assert hasattr(rerun, "iterable")
    # what the schedule asks to reuse a step's count when it is re-run in place
    assert get_rerun_state_machine().state in set(RerunState)
    assert RerunState.RERUNNING_IN_PLACE.name == "RERUNNING_IN_PLACE"


def test_flags_are_composed_and_postprocessed(fake_results) -> None:
    flags = fake_results[0]["flags"]
    assert flags["caller_flag"] == 5  # the caller's extra_args_provider still runs
    assert (flags["dp_backend"], flags["per_token"], flags["tp_only_amax_red"]) == (
        "odc",
        True,
        True,
    )
    assert flags["odc_bucket_size"] == 777
    assert flags["balance"] == "lb_mini"
    assert flags["stock_backend"] is None
    assert flags["stock_per_token"] is False
    assert not flags["stock_has_amax"]
    assert flags["distopt_sets_flag"] is True
    assert flags["mbs2_balance"] == "none"  # the default falls back to Megatron-LM's sampler
    assert flags["fsdp"] == ("collective", "lb_micro", True)
    refusals = dict(flags["refusals"])
    # --save / --load are accepted with torch_dist (Megatron-LM's checkpointing through the ODC
    # overrides) and refused, naming the format, with any other --ckpt-format.
    assert refusals.pop("torch_dist_accepted") == ""
    # Pipeline stages run Megatron-LM's 1F1B; virtual stages (interleaved) are refused by name after
    # validate_args derives them, for the ODC engine only.
    assert refusals.pop("pp_accepted") == ""
    assert "--num-layers-per-virtual-pipeline-stage" in refusals.pop("vpp"), refusals
    assert refusals.pop("vpp_ddp_accepted") == ""
    for flag in ("--save", "--load"):
        assert flag in refusals[flag], refusals
        assert "--ckpt-format torch_dist" in refusals[flag], refusals
    assert "needs --fp8-format" in refusals.pop("fp8_no_format"), refusals
    assert "--fp8-recipe blockwise" in refusals.pop("fp8_blockwise"), refusals
    assert "--transformer-impl transformer_engine (got local)" in refusals.pop("fp8_local"), (
        refusals
    )
    te_missing, fp8_te_missing = refusals.pop("te_missing"), refusals.pop("fp8_te_missing")
    if flags["fp8_args"]["te_available"]:
        assert (te_missing, fp8_te_missing) == ("", ""), refusals
    else:  # Megatron-LM's default --transformer-impl and the FP8 flags say TE is what is missing
        assert "--transformer-impl transformer_engine needs TransformerEngine" in te_missing
        assert (
            "--fp8-format hybrid and --fp8-param-gather needs TransformerEngine" in fp8_te_missing
        )
        assert "--transformer-impl local" in te_missing  # the way out
    for flag, message in refusals.items():
        expected = {"mbs": "--micro-batch-size", "fsdp": "--balance lb_mini"}.get(flag, flag)
        assert expected in message, (flag, message)


def test_fp8_param_gather_passes_validation_only_for_the_odc_engine(fake_results) -> None:
    fp8_args = fake_results[0]["flags"]["fp8_args"]
    for backend in ("odc", "fsdp"):
        # the flag is never flipped (Megatron-LM prints it during validation); only grad mode is off
        assert fp8_args[backend] == (True, (True, False), "hybrid"), fp8_args
    assert fp8_args["grad_mode_after"] is True
    assert "only supported with distributed optimizer" in fp8_args["stock"], fp8_args
    assert fp8_args["distopt"] == "hybrid", fp8_args


def test_get_model_swaps_ddp_only_while_it_runs(fake_results) -> None:
    for res in fake_results:
        assert res["setup_odc"] == "ODCDataParallel"
        # a model built where ODC does not hook stops the run, naming the chunk; ddp runs as before
        assert res["unhooked"].startswith(
            "--dp-backend odc: Megatron-LM built the model without ODC"
        )
        assert "chunk 0 is DistributedDataParallel" in res["unhooked"]
        assert "\n" not in res["unhooked"]
        assert res["unhooked_stock"] == "DistributedDataParallel"
        assert res["odc_wrapped"]
        assert res["odc_config"] == ("DistributedDataParallelConfig", 3000)
        assert res["ddp_restored"]  # training.DDP, and dist_utils' from core_v0.18.2
        assert all(res["ddp_restored"]), res["ddp_restored"]
        assert res["setup_ddp_restored"] == res["ddp_restored"]
        assert res["stock_type"] == "DistributedDataParallel"


def test_optimizer_factory_returns_chained_odc_optimizer(fake_results) -> None:
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    mro, inner = fake_results[0]["a"]["optimizer"]
    assert ChainedOptimizer in mro
    assert inner == "ODCOptimizer"
    assert fake_results[0]["a"]["num_chained"] == 1
    for res in fake_results:
        # get_model installs the module's override; the optimizer factory binds the optimizer.
        assert res["a"]["checkpoint_overrides"] == ["_ODCModuleShardedStateDict", None, True, True]


def test_planned_counts_including_zero_give_the_same_step(fake_results) -> None:
    r0a, r1a = fake_results[0]["a"], fake_results[1]["a"]
    r0b, r1b = fake_results[0]["b"], fake_results[1]["b"]
    assert r0a["schedule_type"] == "PlannedCountSchedule"
    # The plan was asked once per step; 99 would have exhausted the iterator.
    assert all(r["asked"] == 1 for r in (r0a, r1a, r0b, r1b))
    assert (r0a["num_reports"], r1a["num_reports"]) == (3, 1)
    assert (r0b["num_reports"], r1b["num_reports"]) == (1, 2)
    # The zero-count rank reports zeros under the same key.
    assert r1a["keys"] == [["lm loss"]]
    assert torch.equal(r1a["report"], torch.zeros(2))
    total_a = r0a["report"] + r1a["report"]
    total_b = r0b["report"] + r1b["report"]
    torch.testing.assert_close(total_a, total_b, rtol=1e-6, atol=1e-5)
    assert r0a["changed"] > 1e-4  # the step moved the weights
    for res in (r1a, r0b, r1b):
        assert res["grad_norm"] == pytest.approx(r0a["grad_norm"], rel=1e-5)
        for name, value in res["after"].items():
            torch.testing.assert_close(value, r0a["after"][name], rtol=1e-5, atol=1e-6)


def test_balanced_loader_and_tp_broadcast(fake_results) -> None:
    seen = []
    for res in fake_results:
        kind, count, got = res["loader"]
        assert kind == "BalancedPretrainingLoader"
        assert count == len(got) == 2
        seen += got
        assert res["valid_loader"] == "megatron-sampler"
        assert res["tp_count"] == 5
        assert res["ddp_tp_counts"] == [3]
    assert sorted(seen) == [4, 5, 6, 7]  # global batch 1 of 4 (4 samples consumed), split over DP


def test_version_refusal_and_revert(fake_results) -> None:
    row = _installed_row()
    for res in fake_results:
        assert res["row"] == row.tag
        assert "0.15.0" in res["refuse_version"]
        assert "core_v0.16.1" in res["refuse_version"]
        assert "MEGATRON_ODC_SKIP_VERSION_CHECK" in res["refuse_version"]
        assert res["skip_env_ok"]
        assert "get_forward_backward_func" in res["refuse_signature"]
        assert res["clean_after_refusal"]
        assert all(res["restored"].values()), res["restored"]
        # Exactly the row's patch points (the source patch reaches the same list).
        assert res["patched"] == list(row.patch_points)
        assert "setup_model_and_optimizer is missing" in res["refuse_missing"]
        assert res["skip_missing_patched"] == [
            p for p in row.patch_points if not p.endswith("setup_model_and_optimizer")
        ]
        assert res["cpu_shims"] == (True, "torch.cuda.FloatTensor", 1)
        assert res["cpu_reverted"] == (True, "torch.FloatTensor", True, True, True)
        assert res["distopt_patched"] == ["load_state_dict", "sharded_state_dict"]


def test_balanced_loader_partitions_every_global_batch() -> None:
    from megatron_odc.integration.megatron_lm.data import BalancedPretrainingLoader

    dataset = [{"i": torch.tensor(i)} for i in range(24)]
    per_step: dict[int, list[int]] = {}
    for dp_rank in range(3):
        loader = BalancedPretrainingLoader(
            dataset, 6, global_batch_size=6, dp_rank=dp_rank, dp_size=3, seq_length=16
        )
        it = iter(loader)
        for step in range(3):
            n = it.next_num_microbatches()
            per_step.setdefault(step, []).extend(int(next(it)["i"]) for _ in range(n))
        with pytest.raises(StopIteration):
            it.next_num_microbatches()
    for step, ids in per_step.items():
        assert sorted(ids) == list(range(6 * (step + 1), 6 * (step + 2)))
    # consumed_samples no multiple of the batch (a resume with another --global-batch-size): the
    # batches start there, as Megatron-LM's sampler takes them (samples 5-10, 11-16, 17-22)
    firsts = []
    for dp_rank in range(3):
        it = iter(
            BalancedPretrainingLoader(
                dataset, 5, global_batch_size=6, dp_rank=dp_rank, dp_size=3, seq_length=4
            )
        )
        firsts.extend(int(next(it)["i"]) for _ in range(it.next_num_microbatches()))
        it.plans.close()
    assert sorted(firsts) == list(range(5, 11))


def _run_pipeline_counts(rank: int, world_size: int) -> dict:
    from megatron_odc.integration.megatron_lm.schedule import NO_COUNT
    from megatron_odc.mcore.pipeline import agree_pipeline_count
    from tests._megatron import init_megatron, teardown_megatron

    def pipeline_count(count: int) -> int:  # as the launcher's schedule calls it
        return agree_pipeline_count(count, unplanned=NO_COUNT)

    init_megatron(1, seed=1, pp=2)  # 2 ranks: one pipeline of 2 stages, DP=1
    try:
        out = {
            "equal": pipeline_count(2),
            "middle_stage_takes_the_planned": pipeline_count(3 if rank == 0 else NO_COUNT),
            "none_planned": pipeline_count(NO_COUNT),
            "zero": pipeline_count(0),
        }
        try:
            pipeline_count(3 if rank == 0 else 1)
            out["differ"] = ""
        except ValueError as exc:
            out["differ"] = str(exc)
        return out
    finally:
        teardown_megatron()


def test_pipeline_stages_agree_on_the_planned_count() -> None:
    """The stages of one pipeline run one count: a stage without a planned loader takes the others';
    stages planned different counts are named before the 1F1B schedule could deadlock."""
    for res in run_ranks(_run_pipeline_counts, 2, timeout_s=120):
        assert res["equal"] == 2, res
        assert res["middle_stage_takes_the_planned"] == 3, res
        assert res["none_planned"] == -1, res
        assert res["zero"] == 0, res
        assert "DP replica 0" in res["differ"], res
        assert "stage 0: 3, stage 1: 1" in res["differ"], res


def test_launcher_resolves_the_script(tmp_path, monkeypatch) -> None:
    from megatron_odc.integration.launch import resolve_script

    (tmp_path / "pretrain_gpt.py").write_text("")
    assert resolve_script("pretrain_gpt.py", str(tmp_path)) == str(tmp_path / "pretrain_gpt.py")
    monkeypatch.chdir(tmp_path)
    assert resolve_script("pretrain_gpt.py", None) == str(tmp_path / "pretrain_gpt.py")
    with pytest.raises(ValueError, match="MEGATRON_LM_PATH"):
        resolve_script("missing.py", str(tmp_path))


def test_launcher_destroys_the_process_groups_after_a_normal_end(tmp_path, monkeypatch) -> None:
    """Megatron-LM's ``pretrain`` leaves its groups to the interpreter's exit, where a gloo group's
    unjoined threads can abort a finished rank: the launcher destroys them once the script ended
    normally, and leaves them after a failure (a collective may still wait on a peer there)."""
    from megatron_odc.integration import launch

    def script(name: str, error: Exception | None):
        def run(argv) -> None:
            store = f"file://{tmp_path / name}"
            torch.distributed.init_process_group("gloo", init_method=store, rank=0, world_size=1)
            if error is not None:
                raise error

        return run

    monkeypatch.setattr(launch, "_main", script("finished", None))
    launch.main([])
    assert not torch.distributed.is_initialized()

    monkeypatch.setattr(launch, "_main", script("failed", RuntimeError("a bug")))
    try:
        with pytest.raises(RuntimeError, match="a bug"):
            launch.main([])
        assert torch.distributed.is_initialized()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_launch_env_reads_the_transport_of_megatron_lm_argv(monkeypatch) -> None:
    """``--odc-transport mpi`` in Megatron-LM's argv under torchrun is refused naming the flag (in
    either spelling, among Megatron-LM's own flags); other transports leave the environment alone."""
    from megatron_odc.integration.megatron_lm.flags import apply_megatron_lm_launch_env

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    for argv in (
        ["--lr", "1e-3", "--odc-transport", "mpi"],
        ["--odc-transport=mpi", "--mock-data"],
    ):
        with pytest.raises(ValueError, match="--odc-transport mpi was started under torchrun"):
            apply_megatron_lm_launch_env(argv)
    before = dict(os.environ)
    apply_megatron_lm_launch_env(["--lr", "1e-3", "--odc-transport", "shm", "--dp-backend", "odc"])
    apply_megatron_lm_launch_env(["--lr", "1e-3"])
    assert dict(os.environ) == before


# ----------------------------------------------------------------------------- end to end


def _odc_log_holds(megatron_lm_path: Path) -> tuple[str, ...]:
    """What an ODC run of the launcher must log: the tag's patches, the checkout's megatron/training
    (first on sys.path, not the wheel's copy) and every chunk wrapped in ODCDataParallel."""
    tag = megatron_lm_tag(megatron_lm_path)
    training = (Path(megatron_lm_path) / "megatron" / "training").resolve()
    return (f"patches for {tag}", f"megatron/training from {training}", "in ODCDataParallel by")


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("layout", "nproc"),
    [((), 2), (("--tensor-model-parallel-size", "2", "--sequence-parallel"), 4)],
    ids=["dp2", "tp2-sp-dp2"],
)
def test_pretrain_gpt_end_to_end_odc_equals_ddp(megatron_lm_path, tmp_path, layout, nproc) -> None:
    """DP=2, and TP=2 x DP=2 with sequence parallelism, on the tag MEGATRON_LM_PATH points at."""
    holds = _odc_log_holds(megatron_lm_path)
    odc = pretrain_gpt_losses("odc", tmp_path, *layout, nproc=nproc, log_holds=holds)
    ddp = pretrain_gpt_losses("ddp", tmp_path, *layout, nproc=nproc)
    for it, loss in ddp.items():
        assert odc[it] == pytest.approx(loss, rel=1e-5), (it, odc, ddp)
    assert ddp[1] != ddp[6]  # training moved


@pytest.mark.usefixtures("megatron_lm_path")
@pytest.mark.timeout(600)
def test_pretrain_gpt_pipeline_odc_equals_ddp(tmp_path) -> None:
    """PP=2 x DP=2 (4 ranks, tied embeddings): ODC's stages sharded over their DP groups under
    Megatron-LM's own 1F1B, with the balanced loader's counts, equal Megatron-LM's DDP with the same
    pipeline layout."""
    pp = ("--pipeline-model-parallel-size", "2")
    holds = ("BalancedPretrainingLoader", *_odc_log_holds(Path(os.environ["MEGATRON_LM_PATH"])))
    odc = pretrain_gpt_losses("odc", tmp_path, *pp, nproc=4, log_holds=holds)
    ddp = pretrain_gpt_losses("ddp", tmp_path, *pp, nproc=4)
    for it, loss in ddp.items():
        assert odc[it] == pytest.approx(loss, rel=1e-5), (it, odc, ddp)
    assert ddp[1] != ddp[6]  # training moved


@pytest.mark.usefixtures("megatron_lm_path")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("pp", [1, 2])
def test_pretrain_gpt_save_and_resume_odc(tmp_path, pp) -> None:
    """Megatron-LM's own --save at iteration 3 and --load resume to 6 equal the uninterrupted run
    (DP=2; with ``pp=2`` PP=2 x DP=2 on 4 ranks)."""
    ckpt = str(tmp_path / "ckpt")
    layout = ("--pipeline-model-parallel-size", str(pp))
    nproc = 2 * pp
    full = pretrain_gpt_losses("odc", tmp_path, *layout, nproc=nproc)
    pretrain_gpt_losses(
        "odc",
        tmp_path,
        *layout,
        "--save",
        ckpt,
        "--save-interval",
        "3",
        "--exit-interval",
        "3",
        iterations=range(1, 4),
        nproc=nproc,
    )
    resumed = pretrain_gpt_losses(
        "odc", tmp_path, *layout, "--load", ckpt, iterations=range(4, 7), nproc=nproc
    )
    assert resumed[4] == pytest.approx(full[4], rel=1e-6), (resumed, full)
    # Megatron-LM does not reset its loss average after a run's first logged iteration, so the
    # second one prints the mean of both (the uninterrupted run's iteration 2 does the same).
    assert resumed[5] == pytest.approx((full[4] + full[5]) / 2, rel=1e-6), (resumed, full)
    assert resumed[6] == pytest.approx(full[6], rel=1e-6), (resumed, full)


@pytest.mark.usefixtures("megatron_lm_path")
@pytest.mark.timeout(600)
def test_pretrain_gpt_odc_checkpoint_resumes_under_distopt(tmp_path) -> None:
    """An ODC checkpoint saved by Megatron-LM at iteration 3 resumes (optimizer state included) under
    ``--dp-backend distopt`` and prints distopt's uninterrupted losses (issue 19). On CPU it needs the
    content metadata naming ODC's format and megatron-core's distopt load over torch's Adam
    (``mcore/cpu_optimizers.py``); a restart from zero Adam moments misses iteration 6 by ~1e-2."""
    ckpt = str(tmp_path / "ckpt")
    full = pretrain_gpt_losses("distopt", tmp_path)
    save = ["--save", ckpt, "--save-interval", "3", "--exit-interval", "3"]
    pretrain_gpt_losses("odc", tmp_path, *save, iterations=range(1, 4))
    resumed = pretrain_gpt_losses("distopt", tmp_path, "--load", ckpt, iterations=range(4, 7))
    assert resumed[4] == pytest.approx(full[4], rel=1e-5), (resumed, full)
    # The second logged iteration prints the mean of both (see test_pretrain_gpt_save_and_resume_odc).
    assert resumed[5] == pytest.approx((full[4] + full[5]) / 2, rel=1e-5), (resumed, full)
    assert resumed[6] == pytest.approx(full[6], rel=1e-5), (resumed, full)


@requires_mpi
@pytest.mark.usefixtures("megatron_lm_path")
@pytest.mark.timeout(900)
def test_pretrain_gpt_multinode_launches_equal_ddp(tmp_path) -> None:
    """The README's multi-node launches of ``pretrain_gpt.py``, on this machine: full sharding over
    ``mpiexec`` with ``--odc-transport mpi`` (rank, world and rendezvous from MPI), and hybrid sharding
    over 2 pretend hosts x 2 ranks under torchrun (shard groups of 2, replicas summed once per
    minibatch) print megatron-core DDP's losses."""
    ddp = pretrain_gpt_losses("ddp", tmp_path)
    mpi = pretrain_gpt_losses(
        "odc",
        tmp_path,
        "--odc-transport",
        "mpi",
        mpiexec=True,
        log_holds=("(transport mpi)", "wrapped in ODCDataParallel by"),
    )
    hybrid = pretrain_gpt_losses(
        "odc",
        tmp_path,
        nproc=4,
        env={LOCAL_WORLD_SIZE_ENV: "2"},
        log_holds=("ODC hybrid sharding: 2 shard groups of 2 ranks",),
    )
    for it, loss in ddp.items():
        assert mpi[it] == pytest.approx(loss, rel=1e-5), (it, mpi, ddp)
        assert hybrid[it] == pytest.approx(loss, rel=1e-5), (it, hybrid, ddp)
    assert ddp[1] != ddp[6]  # training moved


_REAL_VALIDATE = """
import json, os, shlex, sys
sys.path.append(os.environ["MEGATRON_LM_PATH"])
from megatron_odc.core.fp8 import recipes as fp8
from megatron_odc.integration.megatron_lm import apply_megatron_lm_patches
fp8.require_transformer_engine = lambda feature: None  # flags only: no TE layer is built here
apply_megatron_lm_patches(cpu=True)
from megatron.training import arguments
sys.argv = ["pretrain_gpt.py", *shlex.split(sys.argv[1])]
args = arguments.parse_args()
try:
    arguments.validate_args(args, {})
except ValueError as exc:  # the patched validate_args' one line for Megatron-LM's assertion
    print(json.dumps({"refused": str(exc)}))
    raise SystemExit(0)
config = arguments.core_transformer_config_from_args(args)
print(json.dumps({"fp8_param": config.fp8_param, "fp8": config.fp8, "flag": args.fp8_param_gather,
                  "distopt": args.use_distributed_optimizer}))
"""


@pytest.mark.usefixtures("megatron_lm_path")
@pytest.mark.parametrize("backend", ["odc", "fsdp", "ddp"])
def test_real_validate_args_lets_fp8_params_through_for_the_odc_engine(backend, tmp_path) -> None:
    """Megatron-LM's own validate_args: FP8 parameters reach the model config under odc/fsdp only."""
    import json

    argv = " ".join(E2E_ARGS).replace(
        "--transformer-impl local", "--transformer-impl transformer_engine"
    )
    argv += f" --bf16 --fp8-format hybrid --fp8-param-gather --dp-backend {backend}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _REAL_VALIDATE, argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if backend == "ddp":  # Megatron-LM's own rule stands for its own backends
        assert "only supported with distributed optimizer" in result["refused"], result
    else:
        assert result == {"fp8_param": True, "fp8": "hybrid", "flag": True, "distopt": False}


def _dcp_tensors(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint directory, by key (read in this process, no Megatron)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = checkpoint_dir.parent / f"{checkpoint_dir.name}.pt"
    dcp_to_torch_save(str(checkpoint_dir), str(out))
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


@pytest.mark.usefixtures("megatron_lm_path")
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "precision",
    # fp16's default initial scale 2**32 skips every step of so short a run.
    [("--bf16",), ("--fp16", "--initial-loss-scale", "1024")],
    ids=["bf16", "fp16"],
)
def test_pretrain_gpt_mixed_precision_resume_is_bitwise(tmp_path, precision) -> None:
    """bf16 / fp16 under Megatron-LM: a --save at 3 and --load resume to 6 (deterministic sums) end
    with the uninterrupted run's fp32 masters, Adam moments and weights bit for bit, and print its
    losses. Before the fix the model's load_state_dict override refreshed the masters from the
    half-precision weights after Megatron-LM had loaded them in place (issue 37, item 1)."""
    flags = (*precision, "--odc-deterministic")
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    full = pretrain_gpt_losses(
        "odc", tmp_path, *flags, "--save", str(full_dir), "--save-interval", "3"
    )
    pretrain_gpt_losses(
        "odc",
        tmp_path,
        *flags,
        "--save",
        str(part_dir),
        "--save-interval",
        "3",
        "--exit-interval",
        "3",
        iterations=range(1, 4),
    )
    resumed = pretrain_gpt_losses(
        "odc",
        tmp_path,
        *flags,
        "--load",
        str(part_dir),
        "--save",
        str(part_dir),
        "--save-interval",
        "3",
        iterations=range(4, 7),
    )
    assert resumed[4] == full[4], (resumed, full)
    assert resumed[6] == full[6], (resumed, full)
    want = _dcp_tensors(full_dir / "iter_0000006")
    got = _dcp_tensors(part_dir / "iter_0000006")
    assert sorted(got) == sorted(want)
    masters = [k for k in want if k.startswith("optimizer.") and ".param." in k]
    assert masters, sorted(want)[:20]
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, differ[:10]


_UNTESTED_TREE = """
import os, pathlib, sys
root = pathlib.Path(sys.argv[1])
import megatron.core  # the installed one; the tree comes first, as the launcher puts it
sys.path.insert(0, str(root))
from megatron_odc.integration.megatron_lm import apply_megatron_lm_patches
try:
    apply_megatron_lm_patches()
except ValueError as exc:
    print("REFUSED", exc)
os.environ["MEGATRON_ODC_SKIP_VERSION_CHECK"] = "1"
handle = apply_megatron_lm_patches(cpu=True)
print("SKIPPED-TO", handle.release.tag, len(handle.patched))
handle.revert()
"""


def test_untested_tree_refused_and_the_skip_variable_never_ends_in_attribute_error(
    tmp_path,
) -> None:
    """A tree of no supported tag (package_info 0.15, no training modules): refused in one line naming
    the tags; with MEGATRON_ODC_SKIP_VERSION_CHECK=1 the nearest row is used and every missing patch
    point and CPU-shim target is skipped with a warning."""
    training = tmp_path / "megatron" / "training"
    training.mkdir(parents=True)
    (training / "__init__.py").write_text("")
    (tmp_path / "megatron" / "core").mkdir()
    (tmp_path / "megatron" / "core" / "package_info.py").write_text(
        "MAJOR = 0\nMINOR = 15\nPATCH = 0\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("MEGATRON_ODC_SKIP_VERSION_CHECK", None)
    proc = subprocess.run(
        [sys.executable, "-c", _UNTESTED_TREE, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (refused,) = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert f"megatron/training at {training.resolve()} is version 0.15.0" in refused
    for release in MEGATRON_LM_RELEASES:
        assert release.tag in refused
    assert "SKIPPED-TO core_v0.16.1" in proc.stdout
    assert "AttributeError" not in proc.stderr
    assert "patch point megatron.training.training.get_model skipped" in proc.stderr


def test_a_step_rerun_in_place_reuses_its_count_on_every_rank(monkeypatch) -> None:
    """Megatron-LM's rerun state machine re-runs a step in place on every rank (its decision is
    collective): the schedule reuses the step's count there, also on a rank without a loader (a TP
    rank other than the first), which used to enter the count's broadcast alone."""
    from megatron.core import rerun_state_machine as rerun

    from megatron_odc.integration.megatron_lm.schedule import PlannedCountSchedule

    schedule = PlannedCountSchedule(inner=None)
    assert schedule.planned_count(_PlanIterable([4], []), default=1) == 4
    machine = rerun.get_rerun_state_machine()
    monkeypatch.setattr(machine, "state", rerun.RerunState.RERUNNING_IN_PLACE)
    no_plan_left = _PlanIterable([], [])  # asking it again would fail
    assert schedule.planned_count(no_plan_left, default=1) == 4
    assert schedule.planned_count(None, default=1) == 4
    assert no_plan_left.asked == 0
