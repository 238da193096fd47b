"""The checks: each runs its rank body in a world and judges the ranks' results against its targets;
``CHECKS`` (name -> check, in the order they run) and ``RANK_FUNCTIONS`` (what is sent to the ranks)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from benchmarks.gpu_check_lib.sft_ranks import run_thd_sft
from benchmarks.gpu_check_lib.training_ranks import (
    PARITY_COUNTS,
    run_fp8_emulated,
    run_parity,
    run_te_fp8,
)
from benchmarks.gpu_check_lib.transport_ranks import run_bandwidth, run_correctness, run_nvshmem
from benchmarks.gpu_check_lib.world import accumulate_modes, rehearsing, run_world

GET_TARGET = 0.8
ACCUMULATE_TARGET = 0.5
BF16_LOSS_RTOL = 2e-2
BF16_PARAM_RTOL = 2e-2
FP8_LOSS_RTOL = 5e-2


def _check_correctness(args, world_size: int) -> tuple[bool, str, dict]:
    modes = accumulate_modes()
    results = run_world(
        run_correctness, world_size, modes, args.fence_via, timeout_s=args.timeout_s
    )
    failures = [
        f"rank {r}: {f}" for r, res in enumerate(results) for m in modes for f in res[m]["failures"]
    ]
    err = max(res[m]["max_abs_err"] for res in results for m in modes)
    detail = f"{'+'.join(modes)}, max|err| {err:.2g}" if not failures else "; ".join(failures[:3])
    return not failures, detail, {"results": results}


NVSHMEM_MODES = ("all", "auto")
"""``remote_peers`` of the nvshmem check: every peer through NVSHMEM get / put, then by load / store."""


def _check_nvshmem(args) -> tuple[bool, str, dict]:
    if not rehearsing():  # in a rehearsal the fakes give the ranks an NVSHMEM PyTorch
        from megatron_odc.transport.nvshmem import load_device_ops, nvshmem_unavailable_reason

        reason = nvshmem_unavailable_reason()
        if reason is None:
            try:
                load_device_ops()
            except ValueError as exc:
                reason = str(exc)
        if reason is not None:
            return True, f"NVSHMEM unavailable: {reason}", {"skipped": True}
    modes = list(NVSHMEM_MODES)
    results = run_world(run_nvshmem, 2, modes, timeout_s=args.timeout_s)
    failures = [
        f"rank {r}: {f}" for r, res in enumerate(results) for m in modes for f in res[m]["failures"]
    ]
    err = max(res[m]["max_abs_err"] for res in results for m in modes)
    auto_remote = [res["auto"]["remote"] for res in results]
    detail = (
        f"get/put through NVSHMEM (all) and load/store (auto: NVSHMEM peers {auto_remote}), "
        f"max|err| {err:.2g}"
        if not failures
        else "; ".join(failures[:3])
    )
    return not failures, detail, {"results": results}


def _check_bandwidth(args) -> tuple[bool, str, dict]:
    res = run_world(
        run_bandwidth, 2, args.size_mib, args.repeats, args.fence_via, timeout_s=args.timeout_s
    )[0]
    get = f"get {res['get_gbps']:.0f} vs copy {res['copy_gbps']:.0f} GB/s"
    detail = f"{get} ({res['get_vs_copy']:.2f}x); "
    if rehearsing():  # host memory: the numbers say the code ran, not how fast a GPU is
        ok = all(math.isfinite(v) and v > 0 for v in res.values())
        detail += (
            f"det acc {res['acc_det_gbps']:.1f} vs add_ {res['add_gbps']:.1f} GB/s; "
            "targets not judged on CPU"
        )
        return ok, detail, res
    ok = res["get_vs_copy"] >= GET_TARGET and res["acc_vs_add"] >= ACCUMULATE_TARGET
    detail += (
        f"acc {res['acc_atomic_gbps']:.0f} vs add_ {res['add_gbps']:.0f} ({res['acc_vs_add']:.2f}x); "
        f"det acc {res['acc_det_gbps']:.0f} ({res['acc_det_vs_add']:.2f}x)"
    )
    return ok, detail, res


def _check_parity(args) -> tuple[bool, str, dict]:
    res = run_world(run_parity, 2, 3, timeout_s=args.timeout_s)[0]
    loss_err = max(
        abs(a - b) / abs(b)
        for losses in (res["odc_losses"], res["det_losses"])
        for a, b in zip(losses, res["ddp_losses"])
    )
    worst_param = max(res["param_rel_err"], res["det_param_rel_err"])
    fused_loss_err = max(
        abs(a - b) / abs(b) for a, b in zip(res["fused_losses"], res["ddp_losses"])
    )
    ok = (
        loss_err <= BF16_LOSS_RTOL
        and worst_param <= BF16_PARAM_RTOL
        and res["det_bitwise_repeat"]
        and fused_loss_err <= BF16_LOSS_RTOL
        and res["fused_model_rel_err"] <= BF16_PARAM_RTOL
    )
    detail = (
        f"counts {PARITY_COUNTS}: loss rel err {loss_err:.2g}, param rel err {worst_param:.2g} "
        f"(bf16 tol 2e-2); deterministic repeat bitwise {'yes' if res['det_bitwise_repeat'] else 'NO'}; "
        f"fused Adam: loss {fused_loss_err:.2g}, model {res['fused_model_rel_err']:.2g}"
        + ("; shm in place of atomic" if rehearsing() else "")
    )
    return ok, detail, res


def _check_fp8_emulated(args) -> tuple[bool, str, dict]:
    from megatron_odc.core.fp8 import quantization_error_bound

    results = run_world(run_fp8_emulated, 2, timeout_s=args.timeout_s)
    oracle_losses, oracle_values = results[0]["oracle"]
    odc = [r["odc"] for r in results]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(odc[0]["losses"], oracle_losses))
    same_scales = odc[0]["scale_inv"] == odc[1]["scale_inv"] and bool(odc[0]["scale_inv"])
    worst, matched = 0.0, 1.0
    for name, want in oracle_values.items():
        got = odc[0]["state"][name].view(want.shape)
        if name in odc[0]["scale_inv"]:
            bound = quantization_error_bound(want, 1 / odc[0]["scale_inv"][name]) * 2.000001
            if not bool(((got - want).abs() <= bound).all()):
                worst = float("inf")
            matched = min(matched, float(((got - want).abs() <= 1e-4 * want.abs()).float().mean()))
        else:
            worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-12)))
    ok = loss_err <= 1e-4 and same_scales and worst <= 1e-4 and matched >= 0.99
    detail = (
        f"vs one-process oracle: loss rel err {loss_err:.2g}, other params {worst:.2g}, FP8 values "
        f"matching {matched:.3f}, DP scales equal {'yes' if same_scales else 'NO'}"
    )
    return ok, detail, {"losses": odc[0]["losses"], "oracle_losses": oracle_losses}


def _check_te_fp8(args) -> tuple[bool, str, dict]:
    from megatron_odc.core.fp8 import transformer_engine_available

    if not transformer_engine_available():
        return True, "TransformerEngine not importable here", {"skipped": True}
    res = run_world(run_te_fp8, 2, 3, timeout_s=args.timeout_s)[0]
    ref = res["ddp_bf16_params"]["losses"]
    errs = {
        name: max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        for name, r in res.items()
        if name != "ddp_bf16_params"
    }
    finite = all(math.isfinite(x) for r in res.values() for x in r["losses"])
    ok = (
        finite
        and all(e <= FP8_LOSS_RTOL for e in errs.values())
        and res["odc_fp8_params"]["num_fp8"] > 0
    )
    detail = (
        f"vs DDP (FP8 compute, bf16 params): ODC bf16 params {errs['odc_bf16_params']:.2g}, ODC FP8 "
        f"params {errs['odc_fp8_params']:.2g} ({res['odc_fp8_params']['num_fp8']} FP8 tensors; tol 5e-2)"
    )
    return ok, detail, res


def _check_thd_sft(args) -> tuple[bool, str, dict]:
    from megatron_odc.core.fp8 import transformer_engine_available

    if not rehearsing() and not transformer_engine_available():
        return (
            True,
            "TransformerEngine not importable here (its THD attention is the check)",
            {"skipped": True},
        )
    res = run_world(run_thd_sft, 2, 3, timeout_s=args.timeout_s)[0]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(res["odc_losses"], res["ddp_losses"]))
    uneven = len(set(res["odc_counts"])) > 1
    ok = loss_err <= BF16_LOSS_RTOL and uneven
    detail = (
        f"packed THD records, ODC+LB-Mini counts {res['odc_counts']} vs DDP+LB-Micro "
        f"{res['ddp_counts']}: loss rel err {loss_err:.2g} (bf16 tol 2e-2)"
        + (
            "; local spec, the CPU runtime's THD attention"
            if rehearsing()
            else "; TE THD attention"
        )
    )
    return ok, detail, res


CHECKS: dict[str, Callable[[argparse.Namespace], tuple[bool, str, dict]]] = {
    "correctness w=2": lambda a: _check_correctness(a, 2),
    "correctness w=4": lambda a: _check_correctness(a, 4),
    "nvshmem w=2": _check_nvshmem,
    "bandwidth w=2": _check_bandwidth,
    "parity w=2 odc vs ddp": _check_parity,
    "fp8 emulated w=2": _check_fp8_emulated,
    "te fp8 w=2": _check_te_fp8,
    "thd sft w=2": _check_thd_sft,
}
RANK_FUNCTIONS = (
    run_correctness,
    run_nvshmem,
    run_bandwidth,
    run_parity,
    run_fp8_emulated,
    run_te_fp8,
    run_thd_sft,
)
