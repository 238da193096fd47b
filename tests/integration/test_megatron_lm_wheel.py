"""The Megatron-LM integration on the megatron-core wheel's own ``megatron/training`` (0.17 and later).

No checkout needed: ``tests/integration/standin_pretrain_gpt.py`` (this project's stand-in for
``pretrain_gpt.py``) runs through ``python -m megatron_odc.launch`` on 2 CPU ranks, so the real
``megatron.training`` of the installed release is patched at its own patch points (on 0.19 the model is
built by ``models.dist_utils._ddp_wrap``, not ``training.get_model``). ``--dp-backend odc`` prints
``--dp-backend ddp``'s losses; refusals end the launcher with one line. Skipped where the wheel has no
``megatron/training`` (megatron-core 0.16) or its imports fail (``pip install -e .[megatron-lm]``).
``.ci/run`` runs this file in its Python 3.12 environment.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests._megatron_lm import MODEL_ARGS, _env, pretrain_gpt_losses

STANDIN = Path(__file__).with_name("standin_pretrain_gpt.py")


def _skip_reason() -> str | None:
    import megatron.core

    wheel_training = Path(megatron.core.__file__).parent.parent / "training"
    if not (wheel_training / "training.py").is_file():
        return f"megatron-core {megatron.core.__version__}'s wheel ships no megatron/training"
    for module in ("six", "regex", "yaml", "pydantic"):
        if importlib.util.find_spec(module) is None:
            return f"megatron.training needs {module}: pip install -e .[megatron-lm]"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def _launch(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """One process of the launcher (no torchrun): refusals happen before process groups exist."""
    cmd = [sys.executable, "-m", "megatron_odc.launch", str(STANDIN), *args]
    run_env = {k: v for k, v in {**_env(), **(env or {})}.items() if k != "MEGATRON_LM_PATH"}
    return subprocess.run(cmd, cwd=cwd, env=run_env, capture_output=True, text=True, timeout=300)


@pytest.mark.timeout(600)
def test_wheel_megatron_training_odc_equals_ddp(tmp_path, monkeypatch) -> None:
    """The wheel's megatron/training, patched: every chunk ODC-wrapped, Megatron's losses to 1e-5."""
    monkeypatch.delenv("MEGATRON_LM_PATH", raising=False)
    import megatron.core

    training = (Path(megatron.core.__file__).parent.parent / "training").resolve()
    holds = (
        f"megatron/training from {training}",
        "wrapped in ODCDataParallel by",
        "BalancedPretrainingLoader",
    )
    iters = ("--train-iters", "4")
    run = {"iterations": range(1, 5), "launch": str(STANDIN)}
    odc = pretrain_gpt_losses("odc", tmp_path, *iters, log_holds=holds, **run)
    ddp = pretrain_gpt_losses("ddp", tmp_path, *iters, **run)
    for it, loss in ddp.items():
        assert odc[it] == pytest.approx(loss, rel=1e-5), (it, odc, ddp)
    assert ddp[1] != ddp[4]  # training moved


@pytest.mark.timeout(600)
def test_wheel_megatron_training_sft_odc_lb_mini_equals_ddp(tmp_path, monkeypatch) -> None:
    """``--sft`` on the wheel's megatron/training: SFTDataset's records of real lengths packed by
    the balanced loader, LB-Mini's uneven counts (3 and 2: ``test_megatron_lm_sft_e2e.py``'s data) on
    the CPU runtime's THD attention, and Megatron-LM DDP's per-token losses (one padded record per
    microbatch) to 1e-5."""
    monkeypatch.delenv("MEGATRON_LM_PATH", raising=False)
    pytest.importorskip(
        "datasets", reason="SFTDataset needs datasets: pip install -e .[megatron-lm]"
    )
    from megatron_odc.integration.megatron_lm.sft_example import (
        write_chats_of_lengths,
        write_tokenizer,
    )

    write_tokenizer(tmp_path / "tokenizer")
    write_chats_of_lengths(tmp_path / "chats.jsonl", [70, 70, 70, 50, 50, 50, 50, 10] * 4)
    model = [a for a in MODEL_ARGS if a != "--mock-data"]
    for flag, value in (
        ("--seq-length", "128"),
        ("--max-position-embeddings", "128"),
        ("--global-batch-size", "8"),
        ("--tokenizer-type", "SFTTokenizer"),
        ("--split", "100,0,0"),
        ("--eval-iters", "0"),
    ):
        model[model.index(flag) + 1] = value
    model = [a for a in model if a not in ("--vocab-size", "1024")]
    sft = (
        "--sft",
        "--data-path",
        str(tmp_path / "chats.jsonl"),
        "--tokenizer-model",
        str(tmp_path / "tokenizer"),
        "--train-iters",
        "3",
    )
    run = {"iterations": range(1, 4), "launch": str(STANDIN), "args": tuple(model)}
    holds = ("records with real lengths", "num microbatches min/max: 2/3")
    odc = pretrain_gpt_losses("odc", tmp_path, *sft, log_holds=holds, **run)
    ddp = pretrain_gpt_losses("ddp", tmp_path, *sft, "--calculate-per-token-loss", **run)
    for it, loss in ddp.items():
        assert odc[it] == pytest.approx(loss, rel=1e-5), (it, odc, ddp)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--optimizer", "muon"), "--dp-backend odc does not combine with --optimizer muon"),
        (  # local: a choice of every release from 0.17 (0.18 adds full_iteration)
            ("--cuda-graph-impl", "local"),
            "--dp-backend odc does not combine with --cuda-graph-impl local",
        ),
    ],
)
def test_refusals_are_one_line_before_training(tmp_path, flags, says) -> None:
    proc = _launch(tmp_path, *MODEL_ARGS, "--dp-backend", "odc", *flags)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [text for text in proc.stderr.splitlines() if text.startswith("megatron_odc:")]
    assert says in line
    assert "Traceback" not in proc.stderr


def test_untested_checkout_is_refused_in_one_line(tmp_path) -> None:
    """A checkout of no supported tag (its package_info says 0.15) is refused before anything runs,
    naming the supported tags; the launcher put it first, so its megatron/training is the one named."""
    checkout = tmp_path / "Megatron-LM"
    (checkout / "megatron" / "training").mkdir(parents=True)
    (checkout / "megatron" / "training" / "__init__.py").write_text("")
    (checkout / "megatron" / "core").mkdir()
    (checkout / "megatron" / "core" / "package_info.py").write_text(
        "MAJOR = 0\nMINOR = 15\nPATCH = 0\nPRE_RELEASE = ''\n"
    )
    (checkout / "pretrain_gpt.py").write_text("raise SystemExit('must not run')\n")
    cmd = [sys.executable, "-m", "megatron_odc.launch", "pretrain_gpt.py", "--dp-backend", "odc"]
    env = {**_env(), "MEGATRON_LM_PATH": str(checkout)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [text for text in proc.stderr.splitlines() if text.startswith("megatron_odc:")]
    assert (
        f"megatron/training at {checkout.resolve() / 'megatron' / 'training'} is version 0.15.0"
        in line
    )
    for tag in ("core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0"):
        assert tag in line
    assert "must not run" not in proc.stderr
