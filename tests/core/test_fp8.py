"""FP8 maths and the emulated FP8 parameter path: rounding against an enumerated E4M3 grid, round-trip
bounds, ``EmulatedFloat8Tensor`` as a module parameter (values, gradients, shared bytes), the codec's
re-quantisation of owned shards with a DP-wide amax (equal scales on every rank, one all_reduce, bytes
equal to quantising the whole parameter), the recipe rules, and the TransformerEngine-missing errors.
"""

from __future__ import annotations

import enum
import types

import pytest
import torch
import torch.distributed as dist

from megatron_odc.core import fp8
from megatron_odc.core.fp8 import (
    EmulatedFloat8Codec,
    EmulatedFloat8Tensor,
    FP8ShardSlices,
    check_fp8_recipe,
    check_te_request,
    compute_scale,
    dequantize,
    quantization_error_bound,
    quantize,
)
from tests._dist import run_ranks

HAVE_TE = fp8.transformer_engine_available()
HAVE_FP8_DTYPE = hasattr(torch, "float8_e4m3fn")


def _e4m3_grid() -> torch.Tensor:
    """Every finite E4M3FN magnitude, from its definition (bias 7, 3 mantissa bits, max 448)."""
    values = [m / 8 * 2.0**-6 for m in range(8)]  # subnormals (and zero)
    for e in range(1, 16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN encoding
            values.append((1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(sorted(values), dtype=torch.float64)


@pytest.mark.skipif(not HAVE_FP8_DTYPE, reason="torch without float8 dtypes uses the int8 grid")
def test_quantize_rounds_to_the_nearest_e4m3_value() -> None:
    grid = _e4m3_grid()
    assert float(grid.max()) == fp8.FP8_MAX["e4m3"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=gen) * torch.logspace(-4, 2, 4000).float()
    scale = 4.0  # a power of two: the dequantised value times the scale is exact
    got = dequantize(quantize(x, scale), 1 / scale).double() * scale
    scaled = (x.double() * scale).clamp(-448, 448)
    nearest = grid[(scaled.abs().unsqueeze(1) - grid).abs().argmin(dim=1)] * scaled.sign()
    torch.testing.assert_close(got, nearest, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_round_trip_within_the_bound_and_not_lossless(fmt: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5000, generator=gen) * 0.02
    scale = compute_scale(x.abs().max(), fmt)
    data = quantize(x, scale, fmt)
    assert data.dtype == torch.uint8
    assert data.numel() == x.numel()
    back = dequantize(data, 1 / scale, fmt)
    err = (back - x).abs()
    assert bool((err <= quantization_error_bound(x, scale, fmt) * (1 + 1e-6)).all())
    assert float(err.max()) > 0, "a real FP8 quantiser loses precision"
    rel = float((err / x.abs().clamp_min(1e-3)).max())
    assert rel < 2.0 ** -(fp8.FP8_MANTISSA_BITS[fmt]) + 0.05


def test_saturation_and_scale_rules() -> None:
    amax = torch.tensor([2.0, 0.0, float("inf"), 0.5])
    torch.testing.assert_close(compute_scale(amax), torch.tensor([224.0, 1.0, 1.0, 896.0]))
    torch.testing.assert_close(compute_scale(torch.tensor([2.0]), margin=1), torch.tensor([112.0]))
    x = torch.tensor([10.0, -10.0])  # beyond amax 2 -> saturates at +-448 / scale
    back = dequantize(quantize(x, 224.0), 1 / 224.0)
    torch.testing.assert_close(back, torch.tensor([2.0, -2.0]))


def test_format_and_dtype_errors() -> None:
    with pytest.raises(ValueError, match="format 'e3m4'"):
        quantize(torch.ones(2), 1.0, "e3m4")
    with pytest.raises(ValueError, match=r"torch\.uint8"):
        dequantize(torch.ones(2), 1.0)
    with pytest.raises(ValueError, match=r"torch\.uint8"):
        EmulatedFloat8Tensor(torch.zeros(2), torch.ones(1), torch.float32)
    codec = EmulatedFloat8Codec()
    w = EmulatedFloat8Tensor.from_float(torch.ones(4))
    with pytest.raises(ValueError, match="1 params, 2 main slices"):
        codec.quantize_shards(FP8ShardSlices([w], [None, None], [None], [None]), None)
    with pytest.raises(ValueError, match="4 owned master elements but 3 shard bytes"):
        codec.quantize_shards(
            FP8ShardSlices([w], [torch.ones(4)], [0], [torch.zeros(3, dtype=torch.uint8)]), None
        )


# ---------------------------------------------------------------------- the emulated FP8 weight


def test_emulated_float8_weight_in_a_module() -> None:
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(5, 7, generator=gen) * 0.1
    weight = EmulatedFloat8Tensor.from_float(full)
    values = weight.dequantize()
    scale = compute_scale(full.abs().max())
    assert torch.equal(weight._data, quantize(full, scale))  # the bytes of the whole tensor's scale
    assert bool(((values - full).abs() <= quantization_error_bound(full, scale) * 1.000001).all())
    assert not torch.equal(values, full)

    linear = torch.nn.Linear(7, 5, bias=False)
    linear.weight = torch.nn.Parameter(weight, requires_grad=True)
    assert isinstance(linear.weight, EmulatedFloat8Tensor)
    assert isinstance(linear.weight, torch.nn.Parameter)
    x = torch.randn(3, 7, generator=gen)
    seen = []
    linear.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    out = linear(x)
    torch.testing.assert_close(out, x @ values.t(), rtol=0, atol=0)  # ops see the FP8 values
    out.square().sum().backward()
    expected = (2 * (x @ values.t())).t() @ x
    torch.testing.assert_close(seen[0], expected, rtol=1e-6, atol=1e-6)
    assert type(seen[0]) is torch.Tensor  # the gradient is an ordinary tensor
    # detach shares the bytes: rewriting them changes what every alias reads.
    alias = linear.weight.detach()
    new = torch.randn(5, 7, generator=gen)
    with torch.no_grad():
        linear.weight.copy_(new)  # re-quantised with the new values' own scale
    assert torch.equal(alias._data, quantize(new, compute_scale(new.abs().max())))
    torch.testing.assert_close(alias._scale_inv, 1 / compute_scale(new.abs().max().reshape(1)))
    with pytest.raises(ValueError, match="in place"), torch.no_grad():
        linear.weight.add_(1.0)


# ---------------------------------------------------------------------- DP-wide re-quantisation

PARAM_NUMELS = {"a": 37, "b": 20, "c": 9}  # "c" is owned by rank 0 only: rank 1 contributes nothing


def _full_params(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    # Different magnitudes per parameter so that a wrong (shared) scale would show.
    return {
        name: torch.randn(n, generator=gen) * (0.01 * 10**i) * (1 + step)
        for i, (name, n) in enumerate(PARAM_NUMELS.items())
    }


def _owned_ranges(world_size: int) -> dict[int, dict[str, tuple[int, int]]]:
    """Each parameter split into contiguous owned ranges; "c" lives on rank 0 only."""
    ranges: dict[int, dict[str, tuple[int, int]]] = {r: {} for r in range(world_size)}
    for name, n in PARAM_NUMELS.items():
        owners = [0] if name == "c" else list(range(world_size))
        bounds = [round(i * n / len(owners)) for i in range(len(owners) + 1)]
        for i, r in enumerate(owners):
            ranges[r][name] = (bounds[i], bounds[i + 1])
    return ranges


def _run_requantize(rank: int, world_size: int) -> dict:
    mine = _owned_ranges(world_size)[rank]
    codec = EmulatedFloat8Codec()
    params = [EmulatedFloat8Tensor.from_float(torch.zeros(n)) for n in PARAM_NUMELS.values()]
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(kwargs.get("op"))
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    out = {"scale_inv": [], "bytes": [], "calls": []}
    try:
        for step in range(2):  # step 1 = after an optimizer step changed the masters
            full = _full_params(step)
            mains, offsets, shards = [], [], []
            for name in PARAM_NUMELS:
                lo, hi = mine.get(name, (None, None))
                mains.append(None if lo is None else full[name][lo:hi])
                offsets.append(lo)
                shards.append(None if lo is None else torch.zeros(hi - lo, dtype=torch.uint8))
            calls.clear()
            codec.quantize_shards(FP8ShardSlices(params, mains, offsets, shards), None)
            out["calls"].append(list(calls))
            out["scale_inv"].append(torch.cat([p._scale_inv for p in params]).clone())
            out["bytes"].append({n: s for n, s in zip(PARAM_NUMELS, shards) if s is not None})
    finally:
        dist.all_reduce = real_all_reduce
    return out


def test_dp_amax_gives_every_rank_the_same_scales_and_the_whole_tensors_bytes() -> None:
    world_size = 2
    results = run_ranks(_run_requantize, world_size, timeout_s=90)
    ranges = _owned_ranges(world_size)
    for step in range(2):
        full = _full_params(step)
        # Oracle: one process quantising each whole parameter with the scale of its own amax.
        scales = {n: compute_scale(full[n].abs().max().reshape(1)) for n in full}
        expected_scale_inv = torch.cat([1 / scales[n] for n in full])
        for rank in range(world_size):
            torch.testing.assert_close(
                results[rank]["scale_inv"][step], expected_scale_inv, rtol=0, atol=0
            )
            assert results[rank]["calls"][step] == [dist.ReduceOp.MAX], "one MAX all_reduce"
        for name in PARAM_NUMELS:
            data = torch.cat(
                [results[r]["bytes"][step][name] for r in range(world_size) if name in ranges[r]]
            )
            assert torch.equal(data, quantize(full[name], scales[name])), (step, name)
    # The step changed the masters, so the re-quantised scales changed too.
    assert not torch.equal(results[0]["scale_inv"][0], results[0]["scale_inv"][1])


# ---------------------------------------------------------------------- config rules


class _Recipe(str, enum.Enum):
    delayed = "delayed"
    tensorwise = "tensorwise"


def _cfg(**kw) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{"fp8": "hybrid", "fp8_recipe": "delayed", **kw})


def test_tp_only_amax_red_rule() -> None:
    with pytest.raises(ValueError, match="--tp-only-amax-red"):
        check_fp8_recipe(_cfg())
    with pytest.raises(ValueError, match="--tp-only-amax-red"):
        check_fp8_recipe(_cfg(fp8_recipe=_Recipe.delayed))
    check_fp8_recipe(_cfg(tp_only_amax_red=True))
    check_fp8_recipe(_cfg(fp8_recipe=_Recipe.tensorwise))
    check_fp8_recipe(_cfg(fp8_recipe="mxfp8"))
    check_fp8_recipe(_cfg(fp8=None))  # no FP8: nothing to check
    with pytest.raises(ValueError, match="'custom' is not supported"):
        check_fp8_recipe(_cfg(fp8_recipe="custom", tp_only_amax_red=True))


def test_fp8_params_need_fp8_and_a_per_tensor_recipe() -> None:
    with pytest.raises(ValueError, match="--fp8-param-gather needs --fp8-format"):
        check_fp8_recipe(_cfg(fp8=None, fp8_param=True))
    with pytest.raises(ValueError, match=r"--fp8-recipe mxfp8.*per-tensor recipe"):
        check_fp8_recipe(_cfg(fp8_recipe="mxfp8", fp8_param=True))
    check_fp8_recipe(_cfg(fp8_recipe="tensorwise", fp8_param=True))
    check_fp8_recipe(_cfg(tp_only_amax_red=True, fp8_param=True))
    with pytest.raises(ValueError, match="--fp8-param-gather needs --fp8-format"):
        check_te_request(fp8_param=True)


@pytest.mark.skipif(HAVE_TE, reason="checks the TransformerEngine-missing errors")
def test_te_missing_errors_are_clear() -> None:
    from megatron_odc.mcore.fp8_te import TEFloat8Codec

    with pytest.raises(
        ValueError, match=r"--transformer-impl transformer_engine.*TransformerEngine"
    ):
        check_te_request(transformer_impl="transformer_engine")
    with pytest.raises(ValueError, match=r"--fp8-format hybrid needs TransformerEngine.*local"):
        check_te_request(transformer_impl="local", fp8="hybrid")
    with pytest.raises(
        ValueError, match=r"FP8 parameters \(--fp8-param-gather\) needs Transformer"
    ):
        TEFloat8Codec()
    check_te_request(transformer_impl="local")  # nothing TE-specific requested: fine


def test_odc_wrapper_refuses_fp8_settings_that_would_deadlock() -> None:
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_odc.mcore.config import ODCConfig
    from megatron_odc.mcore.data_parallel import check_supported

    delayed = SimpleNamespace(fp8="hybrid", fp8_recipe="delayed", tp_only_amax_red=False)
    with pytest.raises(ValueError, match="tp-only-amax-red"):
        check_supported(delayed, DistributedDataParallelConfig(), ODCConfig())
    blockwise_params = SimpleNamespace(fp8="hybrid", fp8_recipe="blockwise", fp8_param=True)
    with pytest.raises(ValueError, match="per-tensor recipe"):
        check_supported(blockwise_params, DistributedDataParallelConfig(), ODCConfig())


def test_emulated_float8_weight_moves_devices_as_fp8() -> None:
    linear = torch.nn.Linear(3, 2, bias=False)
    weight = EmulatedFloat8Tensor.from_float(linear.weight.detach(), fmt="e5m2")
    linear.weight = torch.nn.Parameter(weight, requires_grad=True)
    with pytest.raises(ValueError, match="moves between devices in its own dtype"):
        linear.to("meta", torch.bfloat16)  # would swap the FP8 weight for a plain bf16 copy
    assert isinstance(linear.weight, EmulatedFloat8Tensor)
    assert linear.weight.device.type == "cpu"
    assert linear.weight.float().dtype == torch.float32  # a dtype conversion reads the values
    linear.to("meta")  # Module.to(device): still FP8, bytes and scale moved with it
    moved = linear.weight
    assert isinstance(moved, EmulatedFloat8Tensor)
    assert isinstance(moved, torch.nn.Parameter)
    assert (moved.device.type, moved._data.device.type, moved._scale_inv.device.type) == (
        "meta",
    ) * 3
    assert (moved.dtype, moved._data.dtype, moved.fmt, moved.requires_grad) == (
        torch.float32,
        torch.uint8,
        "e5m2",
        True,
    )
    assert moved._data.shape == weight._data.shape
    again = moved.to("meta")  # no move: the tensor itself
    assert again is moved
