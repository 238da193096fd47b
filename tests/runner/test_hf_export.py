"""``--load-hf`` / ``--save-hf`` on the command line and ``python -m megatron_odc.hf export``.

The README's walkthrough, shortened: a tiny random Llama (``tests/mcore/_hf_models.py``) fine-tuned by
``python -m megatron_odc.train --load-hf ... --dp-backend odc --save ... --save-hf ...`` on 2 CPU ranks,
then the saved checkpoint exported by ``python -m megatron_odc.hf export``: both exports hold the same
tensors, bit for bit, and transformers loads them. Slow (two interpreters start megatron-core,
transformers and mbridge, and a torch_dist save): ``--runslow``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_odc.hf import main as hf_main
from tests.mcore._hf_models import write_sft_jsonl, write_tiny_model
from tests.runner.test_trainer import _clean_env, _torchrun_command

pytest.importorskip("mbridge")


@pytest.mark.slow
def test_train_save_hf_and_export_cli_write_the_same_model(tmp_path, shm_dir):
    import torch
    import transformers
    from safetensors.torch import load_file

    hf_dir = write_tiny_model(tmp_path / "llama", "llama")
    data = write_sft_jsonl(tmp_path / "sft.jsonl", 32)
    argv = [
        *["--load-hf", str(hf_dir), "--dp-backend", "odc", "--sft", "--data-path", str(data)],
        *["--train-iters", "2", "--global-batch-size", "8", "--seq-length", "64"],
        *["--save", str(tmp_path / "ckpt"), "--save-hf", str(tmp_path / "trained")],
    ]
    env = _clean_env(shm_dir)
    train = subprocess.run(
        ["timeout", "200", *_torchrun_command("megatron_odc.train", argv)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-5000:]
    assert "saved the Hugging Face model at iteration 2" in train.stdout + train.stderr
    export = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_odc.hf",
            "export",
            str(tmp_path / "ckpt"),
            str(tmp_path / "exported"),
            "--hf-config",
            str(hf_dir),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert export.returncode == 0, export.stderr[-5000:]
    assert "exported iteration 2" in export.stdout
    trained = load_file(tmp_path / "trained" / "model.safetensors")
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    assert trained.keys() == exported.keys()
    for name, tensor in trained.items():
        assert torch.equal(tensor, exported[name]), name
    start = load_file(hf_dir / "model.safetensors")
    assert not torch.equal(start["lm_head.weight"], trained["lm_head.weight"])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert model.config.num_hidden_layers == 2
    assert tokenizer.eos_token == "</s>"


def test_export_without_a_checkpoint_fails_naming_the_directory(tmp_path, capsys):
    hf_dir = write_tiny_model(tmp_path / "llama", "llama")
    missing = tmp_path / "no_ckpt"
    status = hf_main(["export", str(missing), str(tmp_path / "out"), "--hf-config", str(hf_dir)])
    assert status == 2
    assert f"no checkpoint in {missing}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_names_its_own_flag_for_a_bad_hf_config(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert (
        hf_main(
            ["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--hf-config", str(missing)]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"--hf-config '{missing}' is not a directory" in err, err
    assert "--load-hf" not in err, err  # the training flag, which the user did not pass
