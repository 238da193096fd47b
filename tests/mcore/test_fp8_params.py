"""FP8 parameters through the whole ODC stack on a megatron-core GPT (CPU, gloo, shm transport).

The MLP weights of a small GPT are ``EmulatedFloat8Tensor`` parameters (TransformerEngine's
``Float8Tensor`` needs CUDA; both go through the same engine path). Oracles:

- training: one process running every rank's microbatches on the same FP8 model, SGD on fp32 masters,
  each FP8 weight re-quantised as a whole tensor (scale from its own amax) after every step; ODC with
  DP=2 and uneven microbatch counts (1 and 3) must give the same losses and weights;
- checkpoints: the saving model's own values. A bf16-free fp32 ODC model loading the FP8 checkpoint gets
  the dequantised FP8 values exactly; an FP8 model loading it re-quantises them to the same bytes; an FP8
  resume continues exactly like the uninterrupted run.

Also: ``select_fp8_codec`` picks the codec from the parameters' type, and refuses a mix.
"""

from __future__ import annotations

import pytest
import torch

from megatron_odc.mcore.config import ODCConfig
from tests._dist import run_ranks
from tests._megatron import SMALL_GPT

FP8_WEIGHTS = ("linear_fc1", "linear_fc2")
COUNTS = [1, 3]
STEPS = 3
LR = 0.05


def _cfg():
    from megatron_odc.mcore.model import GPTConfig

    return GPTConfig(**SMALL_GPT)


def _batches(cfg, step: int) -> list[list[dict[str, torch.Tensor]]]:
    """Per DP rank, its microbatches of ``step`` (uneven counts)."""
    from tests._megatron import make_batch

    out, seed = [], 1000 * step
    for count in COUNTS:
        out.append([make_batch(cfg, 1, seed=seed + i) for i in range(count)])
        seed += count
    return out


def _fp8_model(cfg, seed: int, device: str = "cpu"):
    from megatron_odc.mcore.fp8_te import emulate_fp8_weights
    from megatron_odc.mcore.model import build_gpt_model

    model = build_gpt_model(cfg, seed=seed).to(device)  # FP8 weights are made where they live
    names = emulate_fp8_weights(model, FP8_WEIGHTS)
    assert len(names) == 2 * cfg.num_layers, names
    return model


def _build(model, *, with_fp8: bool):
    from megatron.core.optimizer import OptimizerConfig

    from megatron_odc.mcore.backends import build_backend

    opt_config = OptimizerConfig(
        optimizer="sgd", lr=LR, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0
    )
    wrapped, optimizer = build_backend(
        "odc", model, opt_config, odc_config=ODCConfig(bucket_size=1500)
    )
    assert bool(wrapped.engine.fp8_names) == with_fp8
    return wrapped, optimizer


def _odc_step(model, optimizer, cfg, step: int) -> float:
    import torch.distributed as dist

    from megatron_odc.mcore.step import train_step
    from tests._megatron import _forward_step

    batches = _batches(cfg, step)[dist.get_rank()]
    out = train_step(model, optimizer, _forward_step, batches, seq_length=cfg.seq_length)
    totals = torch.stack([r["lm loss"] for r in out["losses"]]).sum(dim=0).double()
    dist.all_reduce(totals)
    return float(totals[0] / totals[1])


def _oracle(cfg, seed: int, device: str = "cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, every rank's microbatches, SGD on fp32 masters, whole-tensor re-quantisation.

    Also the oracle of ``benchmarks/gpu_check.py``'s FP8 check (``device="cuda"``).
    """
    from megatron_odc.core.fp8 import EmulatedFloat8Tensor
    from tests._megatron import gpt_loss

    model = _fp8_model(cfg, seed, device)
    params = dict(model.named_parameters())
    masters = {
        n: (p.dequantize() if isinstance(p, EmulatedFloat8Tensor) else p.detach()).float().clone()
        for n, p in params.items()
    }
    losses = []
    for step in range(STEPS):
        model.zero_grad()
        total, tokens = 0.0, 0
        for batch in (b for rank_batches in _batches(cfg, step) for b in rank_batches):
            loss_sum, num_tokens = gpt_loss(model, {k: v.to(device) for k, v in batch.items()})
            loss_sum.backward()
            total += float(loss_sum)
            tokens += num_tokens
        losses.append(total / tokens)
        with torch.no_grad():
            for name, p in params.items():
                masters[name].sub_(LR * p.grad / tokens)
                p.copy_(masters[name])  # an FP8 weight: re-quantised as a whole tensor
    values = {
        n: (p.dequantize() if isinstance(p, EmulatedFloat8Tensor) else p.detach()).cpu().clone()
        for n, p in params.items()
    }
    return losses, values


def _run(rank: int, world_size: int, root: str) -> dict:
    import multiprocessing

    from megatron.core.utils import unwrap_model

    from megatron_odc.mcore.model import build_gpt_model
    from megatron_odc.runner.checkpoint import load_checkpoint, save_checkpoint
    from tests._megatron import init_megatron, teardown_megatron

    multiprocessing.current_process()._config["daemon"] = False  # torch_dist's writer processes
    cfg = _cfg()
    init_megatron(tp=1, seed=3)
    out: dict = {}
    try:
        model, optimizer = _build(_fp8_model(cfg, seed=3), with_fp8=True)
        out["losses"] = [_odc_step(model, optimizer, cfg, step) for step in range(STEPS - 1)]
        save_checkpoint(root, STEPS - 1, model, optimizer, extra_state={})
        out["saved_values"] = model.engine.full_parameters()
        out["losses"].append(_odc_step(model, optimizer, cfg, STEPS - 1))
        out["values"] = model.engine.full_parameters()
        gpt = unwrap_model(model)
        out["scale_inv"] = {
            n: float(p._scale_inv) for n, p in gpt.named_parameters() if hasattr(p, "_scale_inv")
        }
        model.close()

        # Exact FP8 resume: fresh FP8 model (another seed), full load, the last step again.
        resumed, resumed_opt = _build(_fp8_model(cfg, seed=9), with_fp8=True)
        load_checkpoint(root, resumed, resumed_opt)
        out["resumed_loss"] = _odc_step(resumed, resumed_opt, cfg, STEPS - 1)
        out["resumed_values"] = resumed.engine.full_parameters()
        resumed.close()

        # The FP8 checkpoint holds values: an fp32 model and a fresh FP8 model load them (weights only).
        plain, plain_opt = _build(build_gpt_model(cfg, seed=9), with_fp8=False)
        load_checkpoint(root, plain, plain_opt, finetune=True)
        out["plain_loaded"] = plain.engine.full_parameters()
        plain.close()
        fp8_again, fp8_opt = _build(_fp8_model(cfg, seed=9), with_fp8=True)
        load_checkpoint(root, fp8_again, fp8_opt, finetune=True)
        out["fp8_loaded"] = fp8_again.engine.full_parameters()
        fp8_again.close()
        # What the checkpoint was saved from (iteration STEPS - 1): a third FP8 model, trained anew.
        if rank == 0:
            out["oracle"] = _oracle(cfg, seed=3)
    finally:
        teardown_megatron()
    return out


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fp8ckpt"))
    return run_ranks(_run, 2, root, timeout_s=300)


def _assert_close(got: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    err = float((got.double() - expected.double()).abs().max())
    scale = float(expected.abs().max()) or 1.0
    assert err <= rel * scale, f"{what}: max abs error {err:.3e} > {rel} x {scale:.3e}"


def test_fp8_odc_trains_like_one_process(fp8_run) -> None:
    from megatron_odc.core.fp8 import quantization_error_bound

    oracle_losses, oracle_values = fp8_run[0]["oracle"]
    for res in fp8_run:
        for got, want in zip(res["losses"], oracle_losses, strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (res["losses"], oracle_losses)
        assert res["scale_inv"] == fp8_run[0]["scale_inv"], "DP ranks disagree on an FP8 scale"
        for name, want in oracle_values.items():
            got = res["values"][name].view(want.shape)
            if name not in res["scale_inv"]:  # not an FP8 parameter
                _assert_close(got, want, 1e-5, name)
                continue
            bound = quantization_error_bound(want, 1 / res["scale_inv"][name]) * 2.000001
            assert bool(((got - want).abs() <= bound).all()), name
            same = float(((got - want).abs() <= 1e-5 * want.abs()).float().mean())
            assert same >= 0.995, f"{name}: {same:.4f} of the FP8 values match the oracle"


def test_fp8_resume_and_checkpoint_interop(fp8_run) -> None:
    for res in fp8_run:
        assert abs(res["resumed_loss"] - res["losses"][-1]) <= 1e-6 * abs(res["losses"][-1])
        for name, want in res["values"].items():
            _assert_close(res["resumed_values"][name], want, 1e-6, f"resumed {name}")
    # The checkpoint (saved after STEPS - 1 steps) holds values; both kinds of model load them.
    for res in fp8_run:
        for name, plain in res["plain_loaded"].items():
            torch.testing.assert_close(plain, res["saved_values"][name], rtol=0, atol=0)
            fp8 = res["fp8_loaded"][name]
            if name in res["scale_inv"]:
                # Re-quantising the dequantised values with their own amax gives the same bytes.
                torch.testing.assert_close(fp8, plain, rtol=1e-6, atol=0)
            else:
                torch.testing.assert_close(fp8, plain, rtol=0, atol=0)


def test_select_fp8_codec() -> None:
    from megatron_odc.core.fp8 import EmulatedFloat8Codec, EmulatedFloat8Tensor
    from megatron_odc.mcore.fp8_te import select_fp8_codec

    plain = [("a", torch.nn.Parameter(torch.zeros(3)))]
    assert select_fp8_codec(plain) is None
    fp8 = torch.nn.Parameter(EmulatedFloat8Tensor.from_float(torch.ones(4)), requires_grad=True)
    assert isinstance(select_fp8_codec([*plain, ("w", fp8)]), EmulatedFloat8Codec)
