"""The megatron-core CPU runtime (megatron_odc.integration.cpu) and the GPT builder, checked against oracles.

Layers, cheapest first: in-process checks that apply/revert restores every attribute by identity, the
mode stack, the version check and the scoped ``cuda_type_names``; then spawned gloo worlds: TP=2 x DP=2
(with and without sequence parallelism) against a TP=1 reference on the same weights and batches, and
megatron-core's DDP / distributed optimizer training at TP=1 x DP=2.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_ranks

# ---------------------------------------------------------------------------------------------------
# In-process checks
# ---------------------------------------------------------------------------------------------------


def _resolve_owner(qualname: str) -> tuple[object, str]:
    """("a.b.C.attr") -> (a.b.C, "attr"), importing the longest module prefix."""
    parts = qualname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:-1]:
            obj = getattr(obj, name)
        return obj, parts[-1]
    raise AssertionError(f"cannot resolve {qualname}")


def test_apply_revert_restores_every_attribute_and_the_mode_stack():
    from megatron_odc.integration import cpu
    from megatron_odc.integration.cpu import DeviceRemapMode, active_cpu_patches, apply_cpu_patches
    from megatron_odc.mcore.releases import current_release

    assert active_cpu_patches() is None
    stack_len = torch._C._len_torch_function_stack()
    handle = apply_cpu_patches()
    try:
        owners = {name: _resolve_owner(name) for name in handle.patched}
        # Every shim named in the module docstring is there, and nothing twice.
        expected = {
            "torch.cuda.current_device",
            "torch.cuda.manual_seed",
            "torch.cuda.get_rng_state",
            "torch.cuda.set_rng_state",
            "torch.cuda.synchronize",
            "torch.cuda.empty_cache",
            "megatron.core.tensor_parallel.random._get_cuda_rng_state",
            "megatron.core.tensor_parallel.random._set_cuda_rng_state",
            "torch.Tensor.cuda",
            "torch.nn.Module.cuda",
            "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
            "megatron.core.transformer.dot_product_attention.DotProductAttention.forward",
        }
        if "current_stream" in current_release().cpu_shims:  # 0.17 and later
            expected.add("torch.cuda.current_stream")
            assert torch.cuda.current_stream().query()
        assert set(handle.patched) == expected
        assert handle.skipped == []
        assert len(handle.patched) == len(expected)
        originals = {name: before for (_, _, name, before) in handle._saved}
        # Behaviour while applied.
        assert torch.cuda.current_device() == "cpu"
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.ones(1, device=0).device.type == "cpu"
        assert torch.ones(3).to("cuda:0").device.type == "cpu"
        assert torch.tensor([1.0], device="cuda", pin_memory=True).device.type == "cpu"
        t = torch.ones(3)
        assert t.cuda() is t
        assert t.pin_memory() is t
        m = torch.nn.Linear(2, 2)
        assert m.cuda() is m
        torch.cuda.manual_seed(123)
        a = torch.rand(4)
        torch.manual_seed(123)
        assert torch.equal(a, torch.rand(4))
        state = torch.cuda.get_rng_state()
        b = torch.rand(4)
        torch.cuda.set_rng_state(state)
        assert torch.equal(b, torch.rand(4))
        assert isinstance(torch._C._get_function_stack_at(stack_len), DeviceRemapMode)
        # Idempotent: a second apply returns the same handle and patches nothing more.
        assert apply_cpu_patches() is handle
        assert len(handle.patched) == len(expected)
        assert torch._C._len_torch_function_stack() == stack_len + 1
    finally:
        handle.revert()
    assert torch._C._len_torch_function_stack() == stack_len
    assert active_cpu_patches() is None
    for name, (owner, attr) in owners.items():
        before = originals[name]
        if before is cpu._MISSING:  # inherited (Tensor.cuda from TensorBase): the override is gone
            assert attr not in vars(owner), name
        else:
            assert vars(owner)[attr] is before, name
    assert "cuda" not in vars(torch.Tensor)
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    cfg.sequence_parallel = True
    with pytest.raises(AssertionError, match="sequence parallel"):  # the original refuses SP again
        WrappedTorchNorm(cfg, 8)
    handle.revert()  # idempotent


def test_revert_keeps_a_mode_pushed_above_and_works_as_context_manager():
    from torch.overrides import TorchFunctionMode

    from megatron_odc.integration.cpu import DeviceRemapMode, apply_cpu_patches

    class Other(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    stack_len = torch._C._len_torch_function_stack()
    other = Other()
    with apply_cpu_patches() as handle:
        other.__enter__()
        handle.revert()
        assert torch._C._len_torch_function_stack() == stack_len + 1
        assert torch._C._get_function_stack_at(stack_len) is other
        other.__exit__(None, None, None)
    assert torch._C._len_torch_function_stack() == stack_len
    with apply_cpu_patches():
        assert isinstance(torch._C._get_function_stack_at(stack_len), DeviceRemapMode)
    assert torch._C._len_torch_function_stack() == stack_len
    assert torch.cuda.current_device.__module__.startswith("torch")


def test_version_check_refuses_releases_outside_the_range(monkeypatch):
    """Outside ``mcore/releases.py``'s range: one line naming the range, nothing patched; with the skip
    variable the nearest row's shims apply (``tests/mcore/test_releases.py`` has the table's own tests).
    """
    from megatron.core import package_info

    from megatron_odc.integration.cpu import (
        SKIP_VERSION_CHECK_ENV,
        active_cpu_patches,
        apply_cpu_patches,
    )
    from megatron_odc.mcore.releases import SUPPORTED_RANGE

    before = torch.cuda.current_device
    monkeypatch.delenv(SKIP_VERSION_CHECK_ENV, raising=False)
    for version in ("0.20.0", "0.15.3", "0.16.0"):
        monkeypatch.setattr(package_info, "__version__", version)
        with pytest.raises(ValueError, match=rf"megatron-core {version} is not supported") as info:
            apply_cpu_patches()
        assert SUPPORTED_RANGE in str(info.value)
        assert "\n" not in str(info.value)
        assert SKIP_VERSION_CHECK_ENV in str(info.value)
        assert torch.cuda.current_device is before
        assert active_cpu_patches() is None
    monkeypatch.setenv(SKIP_VERSION_CHECK_ENV, "1")
    monkeypatch.setattr(package_info, "__version__", "0.20.0")
    with apply_cpu_patches() as handle:
        assert torch.cuda.current_device() == "cpu"
        assert "torch.cuda.current_stream" in handle.patched  # the newest row's shims
    assert torch.cuda.current_device is before
    monkeypatch.setattr(package_info, "__version__", "0.16.7")
    monkeypatch.delenv(SKIP_VERSION_CHECK_ENV)
    apply_cpu_patches().revert()


def test_cuda_type_names_is_scoped_and_nests():
    from megatron_odc.mcore.cpu_optimizers import cuda_type_names

    t = torch.ones(2)
    assert t.type() == "torch.FloatTensor"
    with cuda_type_names():
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert t.half().type() == "torch.cuda.HalfTensor"
        assert t.type(torch.float64).dtype == torch.float64  # conversions unchanged
        assert t.type("torch.DoubleTensor").dtype == torch.float64
        with cuda_type_names():
            assert t.type() == "torch.cuda.FloatTensor"
        assert t.type() == "torch.cuda.FloatTensor"
    assert t.type() == "torch.FloatTensor"
    assert "type" not in vars(torch.Tensor)


# ---------------------------------------------------------------------------------------------------
# TP=2 x DP=2 against a TP=1 reference
# ---------------------------------------------------------------------------------------------------

_SEED = 1234
_GRAD_PARAMS = (
    "embedding.word_embeddings.weight",
    "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.self_attention.linear_qkv.bias",
    "decoder.layers.0.self_attention.linear_proj.weight",
    "decoder.layers.1.mlp.linear_fc1.weight",
    "decoder.layers.1.mlp.linear_fc1.bias",
    "decoder.layers.1.mlp.linear_fc2.weight",
    "decoder.layers.0.input_layernorm.weight",
    "decoder.final_layernorm.weight",
)


def _configs():
    from megatron_odc.mcore.model import GPTConfig

    plain = GPTConfig(seq_length=32)
    sp = GPTConfig(
        seq_length=32,
        sequence_parallel=True,
        normalization="RMSNorm",
        swiglu=True,
        ffn_hidden_size=96,
    )
    return {"tp2": plain, "tp2_sp_rmsnorm_swiglu": sp}


def _run_tp_parity(rank: int, world_size: int, tp: int) -> dict:
    from megatron.core import parallel_state

    from megatron_odc.mcore.model import build_gpt_model
    from tests._megatron import (
        allreduce_sequence_parallel_grads,
        full_state_dict_to_tp,
        gather_tp_tensor,
        gpt_loss,
        init_megatron,
        make_batch,
        teardown_megatron,
    )

    dp_rank = rank // tp  # megatron's default order puts TP innermost
    out = {}
    for name, cfg in _configs().items():
        batch = make_batch(cfg, num_samples=2, seed=100 + dp_rank)
        # TP=1 reference on the full weights.
        init_megatron(tp=1, seed=_SEED)
        ref = build_gpt_model(dataclasses.replace(cfg, sequence_parallel=False), seed=_SEED)
        ref_loss, ref_tokens = gpt_loss(ref, batch)
        ref_loss.backward()
        ref_sd = {
            k: v.detach().clone()
            for k, v in ref.state_dict().items()
            if isinstance(v, torch.Tensor)
        }
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if n in _GRAD_PARAMS}
        teardown_megatron()

        init_megatron(tp=tp, seed=_SEED)
        assert parallel_state.get_data_parallel_rank() == dp_rank
        model = build_gpt_model(cfg, seed=_SEED + 1)  # different weights until the copy
        params = dict(model.named_parameters())
        qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
        differs_before = not torch.equal(
            gather_tp_tensor(params[qkv].data, params[qkv]), ref_sd[qkv]
        )
        full_state_dict_to_tp(ref_sd, model)
        loss, tokens = gpt_loss(model, batch)
        loss.backward()
        allreduce_sequence_parallel_grads(model)
        grads = {n: gather_tp_tensor(params[n].grad, params[n]) for n in _GRAD_PARAMS}
        norm_params = [n for n, p in params.items() if "layernorm" in n]
        sp_marked = [getattr(params[n], "sequence_parallel", False) for n in norm_params]
        teardown_megatron()
        out[name] = {
            "loss": float(loss),
            "ref_loss": float(ref_loss),
            "tokens": tokens,
            "ref_tokens": ref_tokens,
            "differs_before": differs_before,
            "grad_rel_err": {
                n: float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm())
                for n in _GRAD_PARAMS
            },
            "grad_close": {
                n: bool(torch.allclose(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6))
                for n in _GRAD_PARAMS
            },
            "sp_marked": sp_marked,
            "num_norm_params": len(norm_params),
        }
    return out


def test_tp2_dp2_matches_tp1_on_the_same_weights_with_and_without_sequence_parallel():
    results = run_ranks(_run_tp_parity, 4, 2, timeout_s=150)
    for rank, per_case in enumerate(results):
        for name, r in per_case.items():
            where = f"rank {rank} {name}"
            assert r["differs_before"], f"{where}: TP model should start from other weights"
            assert r["tokens"] == r["ref_tokens"], where
            assert math.isclose(r["loss"], r["ref_loss"], rel_tol=1e-5), (where, r)
            assert all(r["grad_close"].values()), (where, r["grad_rel_err"])
            assert r["num_norm_params"] > 0
            assert all(r["sp_marked"]) == name.endswith("swiglu"), (where, r["sp_marked"])
    # Each DP rank ran its own batch: losses differ across DP, agree across TP.
    for name in results[0]:
        assert results[0][name]["loss"] == results[1][name]["loss"]
        assert results[2][name]["loss"] == results[3][name]["loss"]
        assert results[0][name]["loss"] != results[2][name]["loss"]


# ---------------------------------------------------------------------------------------------------
# megatron-core DDP / distributed optimizer, TP=1 x DP=2
# ---------------------------------------------------------------------------------------------------


def _flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for _, p in sorted(model.named_parameters())])


def _reference_grad_norm(cfg, all_batches, seed: int) -> float:
    """Global grad norm of step 1 from a plain model on every rank's batches (per-token loss)."""
    from megatron_odc.mcore.model import build_gpt_model
    from tests._megatron import gpt_loss

    model = build_gpt_model(cfg, seed=seed)
    total_loss, total_tokens = 0.0, 0
    for batch in all_batches:
        loss, tokens = gpt_loss(model, batch)
        total_loss = total_loss + loss
        total_tokens += tokens
    (total_loss / total_tokens).backward()
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())))


def _run_ddp_training(rank: int, world_size: int, num_steps: int) -> dict:
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from tests._megatron import (
        build_megatron_ddp,
        init_megatron,
        make_batch,
        teardown_megatron,
        train_step,
    )

    cfg = GPTConfig(seq_length=32)
    # Uneven microbatch counts per rank (2 and 1) are fine under per-token loss.
    num_microbatches = [2, 1]

    def batches_of(dp_rank: int, step: int) -> list:
        return [
            make_batch(cfg, num_samples=2, seed=1000 * step + 10 * dp_rank + i)
            for i in range(num_microbatches[dp_rank])
        ]

    out = {}
    for use_distopt in (False, True):
        init_megatron(tp=1, seed=_SEED)
        if not use_distopt:
            all_step0 = [b for r in range(world_size) for b in batches_of(r, 0)]
            out["ref_grad_norm"] = _reference_grad_norm(cfg, all_step0, _SEED)
        model = build_gpt_model(cfg, seed=_SEED)
        init = _flat_params(model)
        ddp_model, optimizer = build_megatron_ddp(
            model, use_distributed_optimizer=use_distopt, lr=1e-2, weight_decay=0.1
        )
        reports = [train_step(ddp_model, optimizer, batches_of(rank, s)) for s in range(num_steps)]
        params = _flat_params(model)
        gathered = [torch.empty_like(params) for _ in range(world_size)]
        dist.all_gather(gathered, params)
        teardown_megatron()
        out["distopt" if use_distopt else "ddp"] = {
            "params": params,
            "replicas_equal": all(torch.equal(g, gathered[0]) for g in gathered),
            "moved": float((params - init).abs().max()),
            "reports": reports,
        }
    return out


def test_megatron_ddp_and_distopt_train_on_cpu_and_agree():
    results = run_ranks(_run_ddp_training, 2, 2, timeout_s=150)
    for rank, r in enumerate(results):
        for variant in ("ddp", "distopt"):
            v = r[variant]
            assert v["replicas_equal"], f"rank {rank} {variant}: DP replicas differ"
            assert v["moved"] > 1e-4, f"rank {rank} {variant}: parameters did not change"
            assert all(rep["update_successful"] for rep in v["reports"])
            # Step 1's grad norm is the global norm of the per-token-normalised gradient.
            assert math.isclose(v["reports"][0]["grad_norm"], r["ref_grad_norm"], rel_tol=1e-5), (
                rank,
                variant,
                v["reports"][0]["grad_norm"],
                r["ref_grad_norm"],
            )
        torch.testing.assert_close(r["distopt"]["params"], r["ddp"]["params"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        results[0]["ddp"]["params"], results[1]["ddp"]["params"], rtol=0, atol=0
    )


def test_cpu_runtime_applies_on_cpu_and_reverts_only_what_it_applied():
    from megatron_odc.integration.cpu import active_cpu_patches, apply_cpu_patches, cpu_runtime

    assert not torch.cuda.is_available()
    assert active_cpu_patches() is None
    with cpu_runtime() as handle:
        assert handle is not None
        assert active_cpu_patches() is handle
    assert active_cpu_patches() is None
    outer = apply_cpu_patches()
    try:
        with cpu_runtime() as handle:
            assert handle is outer
        assert active_cpu_patches() is outer  # someone else's patches stay applied
    finally:
        outer.revert()
    assert active_cpu_patches() is None
