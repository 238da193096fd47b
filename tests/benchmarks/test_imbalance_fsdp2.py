"""``benchmarks/imbalance.py``'s FSDP2 rows train the same model as megatron-core DDP.

Two CPU ranks build ``ddp`` (megatron-core DDP), ``fsdp2`` and ``fsdp2-noreshard`` from the benchmark's own
``build_all`` (fp32, same seed) and run one minibatch of four samples through the benchmark's
``one_step``: ``ddp`` with the ``lb_mini`` plan, the FSDP2 backends with ``lb_micro`` (several microbatches
per rank, so gradient accumulation without sync, and without reshard, is exercised). The gradient norm
before clipping, the (clipped) gradients of each parameter and all parameters after the AdamW step must
match DDP's to 1e-5 relative, and the update (new minus initial weights) to 1e-3 (Adam amplifies rounding
noise in near-zero gradients); the gradient norm catches a wrong loss normalisation, to which Adam's
update and the clipped gradients are nearly blind.
"""

from __future__ import annotations

from tests._dist import run_ranks

LENGTHS = [37, 21, 52, 30]
CAP = 64
FSDP2 = ("fsdp2", "fsdp2-noreshard")


def _relative_error(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _rank_fsdp2_vs_ddp(rank: int, world_size: int) -> dict:
    import warnings

    import torch
    from megatron.core import parallel_state

    from benchmarks.imbalance_lib.settings import CPU_COST, MODEL
    from benchmarks.imbalance_lib.workload import build_microbatches, global_loss_tokens
    from benchmarks.imbalance_lib.world import build_all, one_step
    from megatron_odc.balance import CostModel, make_plan
    from megatron_odc.integration.cpu import apply_cpu_patches

    warnings.filterwarnings("ignore")
    patches = apply_cpu_patches()
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        built = build_all(seq_length=CAP, dtype="fp32", backends=("ddp", *FSDP2))
        vocab = MODEL["vocab_size"]
        ids = list(range(len(LENGTHS)))
        cost = CostModel(**CPU_COST)
        records, counts = {}, {}
        for backend, kind in (("ddp", "lb_mini"), *((b, "lb_micro") for b in FSDP2)):
            plan = make_plan(kind, ids, LENGTHS, world_size, cap_tokens=CAP, cost_model=cost)
            mbs = build_microbatches(plan.rank_microbatches(rank), dict(plan.lengths), vocab)
            tokens = global_loss_tokens(plan, world_size, vocab)
            records[backend] = one_step(built, backend, mbs, CAP, tokens)
            counts[backend] = len(mbs)
        ddp_params = [q.detach() for q in built["ddp"][0].module.parameters()]
        ddp_grads = [q.main_grad for q in built["ddp"][0].module.parameters()]
        # The initial weights (same seed), to compare the updates as well as the weights.
        reference = build_all(seq_length=CAP, dtype="fp32", backends=("ddp",))["ddp"][0]
        initial = [r.detach() for r in reference.module.parameters()]
        initial_flat = torch.cat([r.flatten() for r in initial])
        ddp_flat = torch.cat([q.flatten() for q in ddp_params])
        ddp_update = ddp_flat - initial_flat
        out = {"counts": counts, "grad_norm": {}, "param_err": {}, "update_err": {}, "grad_err": {}}
        for backend in FSDP2:
            params = list(built[backend][0].parameters())
            assert len(params) == len(ddp_params)
            full = [p.detach().full_tensor() for p in params]
            assert [f.shape for f in full] == [q.shape for q in ddp_params]
            flat = torch.cat([f.flatten() for f in full])
            out["param_err"][backend] = _relative_error(flat, ddp_flat)
            out["update_err"][backend] = _relative_error(flat - initial_flat, ddp_update)
            out["grad_err"][backend] = max(
                _relative_error(p.grad.full_tensor(), g) for p, g in zip(params, ddp_grads)
            )
            out["grad_norm"][backend] = records[backend]["grad_norm"]
        out["grad_norm"]["ddp"] = records["ddp"]["grad_norm"]
        out["model_nbytes"] = sum(q.numel() * q.element_size() for q in ddp_params)
        out["moved"] = float(ddp_update.norm() / ddp_flat.norm())
        out["unsharded"] = {b: records[b]["unsharded_peak_nbytes"] for b in FSDP2}
        out["state"] = {b: built[b][2].state_nbytes() for b in FSDP2}
        parallel_state.destroy_model_parallel()
        return out
    finally:
        patches.revert()


def test_fsdp2_matches_megatron_ddp_after_one_minibatch() -> None:
    results = run_ranks(_rank_fsdp2_vs_ddp, 2, timeout_s=120.0)
    for rank, out in enumerate(results):
        for backend in FSDP2:
            assert out["counts"][backend] >= 2, (rank, out["counts"])  # accumulation is exercised
            ratio = out["grad_norm"][backend] / out["grad_norm"]["ddp"]
            assert abs(ratio - 1) < 1e-5, (rank, backend, out["grad_norm"])
            assert out["grad_err"][backend] < 1e-5, (rank, backend, out["grad_err"])
            assert out["param_err"][backend] < 1e-5, (rank, backend, out["param_err"])
            # The update itself (lr-sized) agrees too, not just the weights it is added to.
            assert out["update_err"][backend] < 1e-3, (rank, backend, out["update_err"])
        assert out["moved"] > 1e-4, out["moved"]  # the step ran: the weights moved
        # Unsharded peak: noreshard holds the whole model unsharded; reshard holds less.
        noreshard, reshard = out["unsharded"]["fsdp2-noreshard"], out["unsharded"]["fsdp2"]
        assert noreshard is not None
        assert reshard is not None
        assert noreshard >= out["model_nbytes"]
        assert 0 < reshard < noreshard
        assert out["state"]["fsdp2"] == out["state"]["fsdp2-noreshard"] > 0
