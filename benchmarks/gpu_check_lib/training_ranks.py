"""The training checks' rank bodies: a small megatron-core GPT trained by ODC and by DDP on uneven
microbatch counts (parity), emulated FP8 weights against the CPU test's oracle, TransformerEngine FP8;
the model, optimizer and ODC settings they share, and the comparisons of trained parameters."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.gpu_check_lib.world import accumulate_modes, rank_device, rehearsing

PARITY_COUNTS = (1, 3)
"""Microbatches per DP rank in the training checks: uneven, as ODC allows and its users run."""


def _to_cuda(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.contiguous().to(rank_device()) for k, v in batch.items()}


def _gpt_batches(cfg, step: int, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's microbatches of ``step`` (``PARITY_COUNTS[dp_rank]`` of them), on the GPU."""
    from tests._megatron import make_batch

    first = 1000 * step + sum(PARITY_COUNTS[:dp_rank])
    return [_to_cuda(make_batch(cfg, 1, seed=first + i)) for i in range(PARITY_COUNTS[dp_rank])]


def _train(
    backend: str,
    build_model: Callable,
    cfg,
    steps: int,
    opt_config,
    options=None,
    batches: Callable | None = None,
    forward_step: Callable | None = None,
) -> dict:
    """Train ``steps`` steps with ``backend`` on this rank's uneven microbatches; losses and weights.

    ``batches(step, dp_rank)`` gives a rank's microbatches (default: ``_gpt_batches``), which
    ``forward_step`` runs (default: the tests' GPT forward step on padded batches).
    """
    batches = batches or functools.partial(_gpt_batches, cfg)
    from megatron.core.transformer.module import Float16Module

    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.step import train_step
    from tests._megatron import _forward_step

    forward_step = forward_step or _forward_step

    model = build_model()
    if cfg.bf16:
        model = Float16Module(model.config, model)
    wrapped, optimizer = build_backend(
        backend, model, opt_config, odc_config=options if backend == "odc" else None
    )
    dp_rank = dist.get_rank()
    losses = []
    for step in range(steps):
        with _one_by_one_collectives():
            out = train_step(
                wrapped,
                optimizer,
                forward_step,
                batches(step, dp_rank),
                seq_length=cfg.seq_length,
            )
        total = torch.stack([r["lm loss"] for r in out["losses"]]).sum(dim=0)
        report = total.detach().double().cpu()  # gloo: reduce on the host
        dist.all_reduce(report)
        losses.append(float(report[0] / report[1]))
    if backend == "odc":
        state = wrapped.engine.full_parameters()
        scale_inv = {
            n: float(p._scale_inv)
            for n, p in wrapped.engine.parameters()
            if n in wrapped.engine.fp8_names
        }
        wrapped.close()
    else:
        state = {n: p.detach() for n, p in wrapped.module.named_parameters()}
        scale_inv = {}
    state = {k.removeprefix("module."): v.float().cpu() for k, v in state.items()}
    return {"losses": losses, "state": state, "scale_inv": scale_inv}


class _DoneWork:
    """The handle ``_one_by_one_collectives`` yields: its collectives already ran synchronously."""

    def wait(self) -> None:
        return None


@contextlib.contextmanager
def _one_by_one_collectives():
    """Megatron DDP's gradient all-reduce without ``torch.distributed._coalescing_manager``.

    The check's ranks share one GPU, which NCCL refuses, so their process group is gloo; gloo's
    coalesced all-reduce takes no CUDA tensors ("ProcessGroupGloo::allreduce_coalesced: unsupported
    device type cuda", seen on the H200), its plain all-reduce does. Inside this block megatron-core's
    ``param_and_grad_buffer`` issues each bucket's all-reduce on its own; the sums are the same. Only
    the synchronous path is allowed (the check's DDP config has ``overlap_grad_reduce`` off). Used in
    the rehearsal too, so the CPU runs the same DDP path as the GPU.
    """
    from megatron.core.distributed import param_and_grad_buffer

    @contextlib.contextmanager
    def uncoalesced(group=None, device=None, async_ops=False):
        assert not async_ops, "the check's DDP oracle reduces gradients synchronously"
        yield _DoneWork()

    original = param_and_grad_buffer._coalescing_manager
    param_and_grad_buffer._coalescing_manager = uncoalesced
    try:
        yield
    finally:
        param_and_grad_buffer._coalescing_manager = original


def _gpt_config(**overrides):
    from megatron_odc.mcore.model import GPTConfig

    kw = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "ffn_hidden_size": 176,
        "vocab_size": 256,
        "seq_length": 48,
        "params_dtype": torch.bfloat16,
        "bf16": True,
        **overrides,
    }
    return GPTConfig(**kw)


def _adam(cfg):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.01,
        clip_grad=1.0,
        bf16=cfg.bf16,
        params_dtype=cfg.params_dtype,
    )


def _local_gpt(cfg, seed: int) -> Callable:
    from megatron_odc.mcore.model import build_gpt_model

    return lambda: build_gpt_model(cfg, seed).to(rank_device())


def _odc_options(bucket_size: int, mode: str | None = None):
    """ODC over the CUDA transport; ``mode`` None: the first accumulate mode that runs here."""
    from megatron_odc.mcore.config import ODCConfig

    return ODCConfig(
        transport="cuda", cuda_accumulate=mode or accumulate_modes()[0], bucket_size=bucket_size
    )


def _shm_options(bucket_size: int):
    from megatron_odc.mcore.config import ODCConfig

    return ODCConfig(transport="shm", bucket_size=bucket_size)


def _max_param_rel_err(got: dict, ref: dict) -> float:
    worst = 0.0
    for name, want in ref.items():
        have = got[name].view(want.shape)
        worst = max(worst, float((have - want).norm() / want.norm().clamp_min(1e-12)))
    return worst


def _worst_params(got: dict, ref: dict, count: int = 6) -> list[dict]:
    """The ``count`` parameters furthest from ``ref`` (relative norm), with what explains the figure."""
    rows = []
    for name, want in ref.items():
        have = got[name].view(want.shape)
        diff = have - want
        rows.append(
            {
                "name": name,
                "rel_err": float(diff.norm() / want.norm().clamp_min(1e-12)),
                "ref_norm": float(want.norm()),
                "max_abs_diff": float(diff.abs().max()),
                "frac_differing": float((diff != 0).float().mean()),
            }
        )
    return sorted(rows, key=lambda row: -row["rel_err"])[:count]


@contextlib.contextmanager
def _torch_default_optimizer_kernel():
    """ODC's optimizer with torch's default Adam kernel choice (what megatron-core DDP gets without
    TransformerEngine or apex) instead of ``fused=True``: separates the optimizer kernel's rounding
    from the data-parallel path's."""
    from megatron_odc.mcore import optimizer as odc_optimizer

    def default_kernel(optimizer_cls, param_groups, **options):
        return optimizer_cls(param_groups, **options), f"{optimizer_cls.__name__} torch default"

    original = odc_optimizer.fused_multi_tensor
    odc_optimizer.fused_multi_tensor = default_kernel
    try:
        yield
    finally:
        odc_optimizer.fused_multi_tensor = original


def _model_rel_err(got: dict, ref: dict) -> float:
    """The parameters' distance from ``ref`` as a whole: the norm of all differences over ``ref``'s."""
    diff = sum(
        float((got[n].view(want.shape) - want).double().pow(2).sum()) for n, want in ref.items()
    )
    norm = sum(float(want.double().pow(2).sum()) for want in ref.values())
    return math.sqrt(diff / max(norm, 1e-300))


def _fraction_differing(got: dict, ref: dict) -> float:
    """The fraction of parameter elements whose values differ at all."""
    differing = sum(int((got[n].view(want.shape) != want).sum()) for n, want in ref.items())
    return differing / max(sum(want.numel() for want in ref.values()), 1)


def run_parity(rank: int, world_size: int, steps: int) -> dict:
    """bf16 GPT: ODC over the CUDA transport (atomic; deterministic twice) against megatron-core DDP.

    The ODC runs that are compared parameter by parameter use DDP's optimizer kernel (torch's default
    Adam, what megatron-core picks without TransformerEngine or apex), so the comparison isolates the
    data-parallel path. One more run keeps ODC's own ``fused=True`` kernel and is judged on the losses
    and the parameters as a whole: the attention key bias has a mathematically zero gradient (softmax
    is shift-invariant), so Adam's first steps move it by about ``lr`` in the direction of rounding
    noise, and any change of rounding (such as another optimizer kernel) moves its elements by up to
    ``lr`` per step (seen on the H200: 33% of ``linear_qkv.bias``, the key third, at 0.05 relative).
    """
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        cfg = _gpt_config()
        opt = _adam(cfg)
        ddp = _train("ddp", _local_gpt(cfg, 7), cfg, steps, opt)
        # A rehearsal has no Triton: the shm transport stands in for the atomic mode there.
        first = _odc_options(20_000, "atomic") if not rehearsing() else _shm_options(20_000)
        det_options = _odc_options(20_000, "deterministic")
        with _torch_default_optimizer_kernel():
            atomic = _train("odc", _local_gpt(cfg, 7), cfg, steps, opt, first)
            det = [
                _train("odc", _local_gpt(cfg, 7), cfg, steps, opt, det_options) for _ in range(2)
            ]
        fused = _train("odc", _local_gpt(cfg, 7), cfg, steps, opt, det_options)
    finally:
        parallel_state.destroy_model_parallel()
    return {
        "ddp_losses": ddp["losses"],
        "odc_losses": atomic["losses"],
        "det_losses": det[0]["losses"],
        "param_rel_err": _max_param_rel_err(atomic["state"], ddp["state"]),
        "det_param_rel_err": _max_param_rel_err(det[0]["state"], ddp["state"]),
        "param_frac_differing": _fraction_differing(atomic["state"], ddp["state"]),
        "det_param_frac_differing": _fraction_differing(det[0]["state"], ddp["state"]),
        "worst_params": _worst_params(atomic["state"], ddp["state"]),
        "det_bitwise_repeat": det[0]["losses"] == det[1]["losses"]
        and all(torch.equal(det[0]["state"][k], det[1]["state"][k]) for k in det[0]["state"]),
        "fused_losses": fused["losses"],
        "fused_model_rel_err": _model_rel_err(fused["state"], ddp["state"]),
        "fused_worst_params": _worst_params(fused["state"], ddp["state"]),
    }


def run_fp8_emulated(rank: int, world_size: int) -> dict:
    """Emulated FP8 MLP weights, ODC over the CUDA transport, against the CPU test's one-process oracle."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig

    from tests.mcore import test_fp8_params as cpu_test

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        cfg = cpu_test._cfg()

        def build():
            return cpu_test._fp8_model(cfg, seed=3, device=rank_device())

        opt = OptimizerConfig(
            optimizer="sgd", lr=cpu_test.LR, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0
        )
        options = _odc_options(1500)
        odc = _train(
            "odc",
            build,
            cfg,
            cpu_test.STEPS,
            opt,
            options,
            batches=lambda step, dp_rank: [
                _to_cuda(b) for b in cpu_test._batches(cfg, step)[dp_rank]
            ],
        )
        oracle = cpu_test._oracle(cfg, seed=3, device=rank_device()) if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()
    return {"odc": odc, "oracle": oracle}


def run_te_fp8(rank: int, world_size: int, steps: int) -> dict:
    """TE-spec GPT, FP8 compute (hybrid, tensorwise): bf16 parameters under DDP and ODC, FP8 parameters
    under ODC (re-quantised owned shards, FP8 bytes fetched)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        cfg = _gpt_config(hidden_size=128, ffn_hidden_size=256, seq_length=64)
        opt = _adam(cfg)
        options = _odc_options(50_000)
        runs = {
            "ddp_bf16_params": _train("ddp", _te_gpt(cfg, 7, False), cfg, steps, opt),
            "odc_bf16_params": _train("odc", _te_gpt(cfg, 7, False), cfg, steps, opt, options),
            "odc_fp8_params": _train("odc", _te_gpt(cfg, 7, True), cfg, steps, opt, options),
        }
    finally:
        parallel_state.destroy_model_parallel()
    return {
        name: {"losses": r["losses"], "num_fp8": len(r["scale_inv"])} for name, r in runs.items()
    }


def _te_gpt(cfg, seed: int, fp8_params: bool, fp8: str | None = "hybrid") -> Callable:
    """A TE-spec GPT builder; ``fp8=None``: bf16 compute (TE's attention, THD included)."""

    def build():
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from megatron_odc.core.fp8 import check_fp8_recipe, check_te_request
        from megatron_odc.mcore.model import transformer_config

        check_te_request(transformer_impl="transformer_engine", fp8=fp8, fp8_param=fp8_params)
        model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        config = transformer_config(cfg)
        if fp8 is not None:
            config.fp8 = fp8
            config.fp8_recipe = "tensorwise"
            config.fp8_param = fp8_params
        config.use_cpu_initialization = False
        check_fp8_recipe(config)
        return GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length,
        ).cuda()

    return build
