"""Hugging Face models in and out (``mcore/hf_bridge.py``, ``--load-hf`` / ``--save-hf``), against transformers.

Tiny random Llama (untied embeddings), Qwen2 (tied embeddings, QKV bias) and Qwen3 (QK norms, a head
width that is not hidden / heads) models made offline (``_hf_models.py``), fp32, on 2 spawned CPU ranks:

- loaded at TP=1 and TP=2 (the vocabulary padded from 61 to 62), the megatron GPT's logits equal
  transformers' forward to 1e-5; exported at that TP size, transformers reloads the export and its
  logits equal megatron's to 1e-5;
- a few ODC SFT iterations through the training entry (``--load-hf ... --dp-backend odc --save-hf``;
  Llama at DP=2, Qwen2 at TP=2) have finite, falling losses; the export at the end holds trained
  weights (not the start's), and transformers' logits of it equal those of megatron loading it;
- flags that disagree with the HF config are refused naming the flag.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron_odc.runner.arguments import build_parser, validate_args
from tests._dist import run_ranks
from tests.mcore._hf_models import VOCAB_SIZE, write_sft_jsonl, write_tiny_model

pytest.importorskip("mbridge")
pytest.importorskip("transformers")

TOLERANCE = 1e-5
TOKENS = [[5, 9, 17, 33, 2, 40, 12, 60, 7, 21, 30, 11, 44, 18, 9]]
"""One uneven-length sequence of ids (the last, 60, is beyond the tokenizer's words: any id works)."""


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {arch: write_tiny_model(root / arch, arch) for arch in ("llama", "qwen2", "qwen3")}


def _hf_logits(hf_dir: str):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits


def _megatron_logits(hf_dir: str, tp: int, export_dir: str | None = None):
    """Full-vocabulary logits of the GPT that ``--load-hf hf_dir`` builds at TP=``tp`` (collective);
    with ``export_dir`` the model is exported there too."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_odc.mcore.hf_bridge import export_hf, load_hf_weights
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from megatron_odc.mcore.parallel import model_parallel

    args = validate_args(
        build_parser().parse_args(["--load-hf", hf_dir, "--tensor-model-parallel-size", str(tp)]),
        world_size=dist.get_world_size(),
    )
    with model_parallel(tp):
        gpt = build_gpt_model(GPTConfig.from_args(args, vocab_size=args.vocab_size), seed=7)
        load_hf_weights(gpt, hf_dir)
        tokens = torch.tensor(TOKENS)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        with torch.no_grad():
            local = gpt(tokens, positions, attention_mask=None)
        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        if export_dir is not None:
            export_hf(gpt, export_dir, hf_dir)
    return torch.cat(parts, dim=-1)[..., :VOCAB_SIZE]


def _max_diff(a, b) -> float:
    return float((a - b).abs().max())


def _round_trips(
    rank: int, world_size: int, models: dict[str, str], data: str, workdir: str
) -> dict:
    from megatron_odc.integration.cpu import cpu_runtime
    from megatron_odc.train import run

    out: dict = {}
    with cpu_runtime():
        for arch, hf_dir in models.items():
            reference = _hf_logits(hf_dir)
            for tp in (1, 2):
                export = f"{workdir}/{arch}-tp{tp}"
                logits = _megatron_logits(hf_dir, tp, export)
                out[arch, tp, "load"] = _max_diff(logits, reference)
                out[arch, tp, "export"] = _max_diff(_hf_logits(export), logits)
        for arch, tp in (("llama", 1), ("qwen2", 2)):
            trained = f"{workdir}/{arch}-trained"
            argv = [
                *["--load-hf", models[arch], "--save-hf", trained, "--dp-backend", "odc"],
                *["--sft", "--data-path", data, "--train-iters", "4", "--global-batch-size", "8"],
                *[
                    "--seq-length",
                    "64",
                    "--lr",
                    "3e-3",
                    "--lr-warmup-iters",
                    "0",
                    "--log-interval",
                    "1",
                ],
                *["--tensor-model-parallel-size", str(tp)],
            ]
            out[arch, "losses"] = run(
                validate_args(build_parser().parse_args(argv), world_size=2)
            ).losses
            logits = _megatron_logits(trained, tp)
            out[arch, "trained export"] = _max_diff(_hf_logits(trained), logits)
            out[arch, "trained vs start"] = _max_diff(logits, _hf_logits(models[arch]))
    return out


def test_hf_models_round_trip_through_megatron_and_odc_training(hf_models, tmp_path):
    models = {arch: str(path) for arch, path in hf_models.items()}
    data = str(write_sft_jsonl(tmp_path / "sft.jsonl", 32))
    results = run_ranks(_round_trips, 2, models, data, str(tmp_path), timeout_s=240)
    out = results[0]
    for arch in models:
        for tp in (1, 2):
            assert out[arch, tp, "load"] < TOLERANCE, (arch, tp, out[arch, tp, "load"])
            assert out[arch, tp, "export"] < TOLERANCE, (arch, tp, out[arch, tp, "export"])
    for arch in ("llama", "qwen2"):
        losses = [out[arch, "losses"][it] for it in sorted(out[arch, "losses"])]
        assert len(losses) == 4, losses
        assert all(math.isfinite(x) for x in losses), losses
        assert losses[-1] < losses[0], (arch, losses)
        assert out[arch, "trained export"] < TOLERANCE, (arch, out[arch, "trained export"])
        assert out[arch, "trained vs start"] > 1e-3, "the export holds the start's weights"
    assert results[1][("llama", "losses")] == out["llama", "losses"]
    written = sorted(p.name for p in (tmp_path / "llama-trained").iterdir())
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(written), written


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--num-layers", "3"], "--num-layers 3 conflicts"),
        (["--hidden-size", "64"], "--hidden-size 64 conflicts"),
        (["--normalization", "LayerNorm"], "--normalization LayerNorm conflicts"),
        (["--vocab-size", "32"], "--vocab-size 32 is smaller"),
        (["--tensor-model-parallel-size", "3"], "--num-query-groups 2 is not divisible"),
    ],
)
def test_flags_that_disagree_with_the_hf_config_are_refused(hf_models, flags, named):
    argv = ["--load-hf", str(hf_models["llama"]), *flags]
    with pytest.raises(ValueError, match=named):
        validate_args(build_parser().parse_args(argv), world_size=6)


def test_load_hf_fills_the_model_flags_and_the_tokenizer(hf_models):
    hf_dir = str(hf_models["qwen2"])
    args = validate_args(
        build_parser().parse_args(["--load-hf", hf_dir, "--num-layers", "2"]), world_size=2
    )
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (2, 48, 80)
    assert (args.group_query_attention, args.num_query_groups) == (True, 2)
    assert (args.normalization, args.swiglu, args.add_qkv_bias) == ("RMSNorm", True, True)
    assert not args.untie_embeddings_and_output_weights
    assert (args.rotary_base, args.norm_epsilon, args.vocab_size) == (5000.0, 1e-6, VOCAB_SIZE)
    assert (args.tokenizer_type, args.tokenizer_model) == ("HuggingFaceTokenizer", hf_dir)


def test_save_hf_needs_another_directory_than_load_hf(hf_models, tmp_path):
    with pytest.raises(ValueError, match="--save-hf needs --load-hf"):
        validate_args(build_parser().parse_args(["--save-hf", str(tmp_path)]), world_size=1)
    same = ["--load-hf", str(hf_models["llama"]), "--save-hf", str(hf_models["llama"])]
    with pytest.raises(ValueError, match="is the --load-hf directory"):
        validate_args(build_parser().parse_args(same), world_size=1)


def test_a_config_json_that_does_not_parse_or_means_nonsense_is_named(hf_models, tmp_path):
    import json
    import shutil

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{bad")
    with pytest.raises(ValueError, match=r"config.json cannot be read as a Hugging Face config"):
        validate_args(build_parser().parse_args(["--load-hf", str(broken)]), world_size=2)
    negative = tmp_path / "negative"
    shutil.copytree(hf_models["llama"], negative)
    config = json.loads((negative / "config.json").read_text())
    config["hidden_size"] = -48
    (negative / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"config.json means --hidden-size -48, which must be >= 1"
    ):
        validate_args(build_parser().parse_args(["--load-hf", str(negative)]), world_size=2)
