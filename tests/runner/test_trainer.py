"""The training entry ``python -m megatron_odc.train``: it trains, backends agree, resume is exact, bad flags fail.

Three layers, cheapest first:

- flag checks in-process (:func:`megatron_odc.runner.arguments.validate_args`, no model built) and one
  ``python -m megatron_odc.train`` subprocess that must exit with status 2 and name the flag before
  training;
- rank bodies (``tests/_dist.py::run_ranks``) calling :func:`megatron_odc.train.run` several times in
  one spawned world: every backend and plan must give the same per-iteration losses as ODC with LB-Mini
  (the per-token loss makes each update the exact global mean, whatever the split), in SFT mode and in
  pretraining mode on a Megatron indexed dataset;
- the README's main command under ``torch.distributed.run`` with 2 CPU ranks (shortened with
  ``--train-iters``): the loss starts near ``ln(vocab)`` (a fresh model predicts nearly uniformly) and
  falls, the learning rate follows the warmup, the Megatron-style log lines are there; and the same
  command interrupted after 5 iterations (``--save --exit-interval 5``) and resumed in new processes
  (``--load``) must log the uninterrupted run's losses (torchrun, not run_ranks: the torch_dist
  checkpoint writer starts a multiprocessing manager, which a daemonic run_ranks child may not).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from megatron_odc.core.fp8 import transformer_engine_available
from megatron_odc.data.preprocess import preprocess
from megatron_odc.runner.arguments import build_parser, validate_args
from tests._dist import run_ranks, torchrun_command
from tests._mpi import mpi_env, mpiexec_command, requires_mpi

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--log-interval", "1", "--global-batch-size", "8", "--synthetic-num-samples", "64"]
"""A smaller minibatch and data set than the default, for the rank bodies."""


def _validated(argv: list[str], world_size: int = 2):
    return validate_args(build_parser().parse_args(argv), world_size=world_size)


# Flags #


BAD_FLAGS = [
    (["--pipeline-model-parallel-size", "2", "--num-layers", "3"], "--num-layers 3"),
    (["--pipeline-model-parallel-size", "4"], "--pipeline-model-parallel-size 4"),  # world 2
    (["--num-layers-per-virtual-pipeline-stage", "1"], "--num-layers-per-virtual-pipeline-stage"),
    (["--balance", "lb_mini", "--dp-backend", "fsdp"], "--balance"),
    (["--balance", "local_sort", "--dp-backend", "fsdp"], "--balance"),
    (["--dp-backend", "fsdp", "--odc-transport", "shm"], "--odc-transport"),
    (["--odc-transport", "mpi"], "--odc-transport mpi"),  # not under mpiexec
    (["--micro-batch-size", "2"], "--micro-batch-size"),
    (["--no-calculate-per-token-loss"], "--no-calculate-per-token-loss"),
    (["--tensor-model-parallel-size", "4"], "--tensor-model-parallel-size"),
    (["--num-attention-heads", "3"], "--num-attention-heads"),
    (["--sequence-parallel"], "--sequence-parallel"),
    (["--max-tokens-per-microbatch", "200"], "--max-tokens-per-microbatch"),
    (["--data-path", "/nonexistent/prefix"], "--data-path"),
    (["--sft", "--data-path", "/nonexistent/file.jsonl"], "--data-path"),
    (["--bf16", "--fp16"], "--bf16"),
    (["--sft"], "--sft"),
    (["--data-path", "/nonexistent/prefix", "--max-tokens-per-microbatch", "64"], "--data-path"),
    (["--min-lr", "1.0"], "--min-lr"),
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--init-method-std", "-1"], "--init-method-std must be a finite number >= 0"),
    (["--adam-beta1", "1.5"], "--adam-beta1 must be a finite number in [0, 1)"),
    (["--adam-beta2", "-0.1"], "--adam-beta2 must be a finite number in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps must be a finite number > 0"),
    (["--fp16", "--loss-scale", "-4"], "--loss-scale must be a finite number > 0"),
    (["--clip-grad", "inf"], "--clip-grad must be a finite number >= 0"),
    (["--save", "/dev/null/ckpt"], "--save '/dev/null/ckpt' cannot be made: '/dev/null' is a file"),
    (["--tensorboard-dir", "/dev/null"], "--tensorboard-dir '/dev/null' is an existing file"),
    (["--finetune"], "--finetune"),
    (["--fp8-param-gather"], "--fp8-param-gather"),
    (
        ["--fp8-format", "hybrid", "--fp8-param-gather", "--fp8-recipe", "mxfp8"],
        "--fp8-param-gather",
    ),
]
TE_BAD_FLAGS = [
    (["--fp8-format", "hybrid"], "--fp8-format"),
    (["--transformer-impl", "transformer_engine"], "--transformer-impl"),
]


@pytest.mark.parametrize(("argv", "flag"), BAD_FLAGS + TE_BAD_FLAGS)
def test_bad_flags_are_refused_naming_the_flag(argv, flag):
    if (argv, flag) in TE_BAD_FLAGS and transformer_engine_available():
        pytest.skip("TransformerEngine is installed: the flag is valid here")
    with pytest.raises(ValueError, match=re.escape(flag)):
        _validated(argv)


def test_an_output_directory_that_refuses_new_entries_is_refused(tmp_path, monkeypatch):
    from megatron_odc.runner import arguments

    def read_only(*args, **kwargs):  # as on a read-only mount (root ignores chmod)
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(arguments.tempfile, "mkdtemp", read_only)
    for flag in ("--save", "--tensorboard-dir"):
        target = tmp_path / "new" / "dir"
        with pytest.raises(ValueError, match=rf"{flag} '{target}' cannot be written: '{tmp_path}'"):
            _validated([flag, str(target)])
    monkeypatch.undo()
    assert _validated(["--save", str(tmp_path / "new" / "dir")]).save  # writable: accepted
    assert not (tmp_path / "new").exists()  # and nothing was left by the check


def test_defaults_are_filled_per_backend():
    odc = _validated([])
    assert (odc.balance, odc.odc_transport, odc.sft) == ("lb_mini", "auto", True)
    assert odc.max_tokens_per_microbatch == odc.seq_length == odc.max_position_embeddings
    assert odc.lr_decay_iters == odc.train_iters
    assert odc.lr_warmup_iters < odc.lr_decay_iters
    fsdp = _validated(["--dp-backend", "fsdp"])
    assert (fsdp.balance, fsdp.odc_transport) == ("lb_micro", "collective")
    assert _validated(["--dp-backend", "ddp"]).balance == "lb_mini"
    assert _validated(["--train-iters", "2"]).lr_warmup_iters == 1
    assert odc.min_lr == pytest.approx(3e-4)
    assert _validated(["--lr", "1e-5"]).min_lr == pytest.approx(1e-6)  # the README's SFT recipe


def _clean_env(shm_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", MEGATRON_ODC_SHM_DIR=str(shm_dir))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def test_cli_exits_before_training_on_a_bad_flag(tmp_path, shm_dir):
    argv = ["--dp-backend", "odc", "--pipeline-model-parallel-size", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_odc.train", *argv],
        cwd=tmp_path,
        env=_clean_env(shm_dir),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--pipeline-model-parallel-size" in proc.stderr
    assert "iteration" not in proc.stdout
    assert not (tmp_path / "runs").exists(), "the data set was generated before the flag check"


# The main command #


ITERATION_LINE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \| .*learning rate: (\S+) \| "
    r".*lm loss: (\S+) \| grad norm: (\S+) \| tokens/s: \d+ \| num microbatches min/max: (\d+)/(\d+)"
    r" \| number of skipped iterations: +\d+ \| plan ahead/wait max \(ms\): ([\d.]+)/([\d.]+)"
    r" \| odc compute imbalance: \S+x \| fetch/push/fence wait .* \| ETA \d+:\d\d:\d\d"
)
SUMMARY_LINE = re.compile(r"training finished .*first lm loss: (\S+) \| final lm loss: (\S+)")


def _torchrun_command(module: str, argv: list[str], nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` of ``module`` on ``nproc`` CPU ranks
    (``tests._dist.torchrun_command``)."""
    return [*torchrun_command(nproc), "-m", module, *argv]


def _torchrun_status(
    argv: list[str], cwd: Path, shm: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Runs the entry on 2 CPU ranks (``env``: default ``_clean_env(shm)``); returns the process."""
    return subprocess.run(
        ["timeout", "150", *_torchrun_command("megatron_odc.train", argv)],
        cwd=cwd,
        env=_clean_env(shm) if env is None else env,
        capture_output=True,
        text=True,
        timeout=170,
    )


def _torchrun(argv: list[str], cwd: Path, shm: Path) -> str:
    """Runs the entry on 2 CPU ranks; returns its stdout (asserting exit status 0)."""
    proc = _torchrun_status(argv, cwd, shm)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def _logged_losses(stdout: str) -> dict[int, float]:
    return {int(m[0]): float(m[4]) for m in ITERATION_LINE.findall(stdout)}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The README's main command, shortened to 10 iterations and logging every iteration."""
    workdir = tmp_path_factory.mktemp("default_run")
    shm = Path("/dev/shm") / f"megatron_odc_test_train_{uuid.uuid4().hex[:12]}"
    shm.mkdir()
    try:
        stdout = _torchrun(["--train-iters", "10", "--log-interval", "1"], workdir, shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return workdir, stdout


def test_default_command_trains_on_two_cpu_ranks(default_run):
    workdir, stdout = default_run
    lines = ITERATION_LINE.findall(stdout)
    assert [int(m[0]) for m in lines] == list(range(1, 11)), stdout[-3000:]
    assert all(int(m[1]) == 10 for m in lines)
    assert [int(m[2]) for m in lines] == [16 * i for i in range(1, 11)]  # default global batch 16
    assert all(1 <= int(m[6]) <= int(m[7]) for m in lines)
    # Warmup from 0 over 3 iterations (Megatron's scheduler, stepped after each update), then decay.
    lrs = [float(m[3]) for m in lines]
    assert lrs[:4] == pytest.approx([0.0, 1e-3, 2e-3, 3e-3])
    assert lrs[3:] == sorted(lrs[3:], reverse=True)
    summary = SUMMARY_LINE.search(stdout)
    assert summary is not None, stdout[-3000:]
    first, final = float(summary.group(1)), float(summary.group(2))
    losses = _logged_losses(stdout)
    assert (first, final) == (losses[1], losses[10])
    # A fresh model (init std 0.02) predicts almost uniformly over the padded byte vocabulary (384).
    assert abs(first - math.log(384)) < 0.3, first
    assert final < first - 1.0, (first, final)
    # Rank 1 logs no training lines; the data set was generated under the working directory.
    assert stdout.count("training finished") == 1
    assert list((workdir / "runs" / "cpu-default").glob("synthetic_sft_*.jsonl"))


def test_resume_repeats_the_uninterrupted_losses(default_run, tmp_path, shm_dir):
    _, straight_stdout = default_run
    straight = _logged_losses(straight_stdout)
    ckpt = str(tmp_path / "ckpt")
    common = ["--train-iters", "10", "--log-interval", "1", "--save", ckpt]
    first_half = _logged_losses(_torchrun([*common, "--exit-interval", "5"], tmp_path, shm_dir))
    assert sorted(first_half) == [1, 2, 3, 4, 5]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    # Megatron-LM users pass --save and --load together; no --save here spares a second save (~8 s).
    resumed = _torchrun([*common[:-2], "--load", ckpt], tmp_path, shm_dir)
    assert "resumed from" in resumed
    second_half = _logged_losses(resumed)
    assert sorted(second_half) == [6, 7, 8, 9, 10]
    for it, loss in {**first_half, **second_half}.items():
        assert loss == pytest.approx(straight[it], rel=1e-6, abs=0.0), it


@requires_mpi
@pytest.mark.parametrize("transport", ["mpi", "auto"])
def test_the_main_command_under_mpiexec_repeats_the_torchrun_losses(
    default_run, tmp_path, transport
):
    # Under mpiexec torch's launch variables come from MPI's (runner/launch_env.py) whatever the
    # transport (auto: shm, the ranks share this host); the same fp32 model, data and plan as the
    # torchrun run over shm, so the same losses up to summation order.
    _, straight_stdout = default_run
    straight = _logged_losses(straight_stdout)
    argv = ["-m", "megatron_odc.train", "--odc-transport", transport]
    argv += ["--train-iters", "10", "--log-interval", "1"]
    proc = subprocess.run(
        ["timeout", "150", *mpiexec_command(2, argv)],
        cwd=tmp_path,
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    losses = _logged_losses(proc.stdout)
    assert sorted(losses) == list(range(1, 11)), proc.stdout[-3000:]
    for it, loss in losses.items():
        assert loss == pytest.approx(straight[it], rel=1e-5, abs=0.0), it
    assert proc.stdout.count("training finished") == 1


# Rank bodies #


def _train_losses(argv: list[str]) -> dict[int, float]:
    from megatron_odc.train import run

    args = validate_args(build_parser().parse_args(argv), world_size=2)
    return run(args).losses


def _write_indexed_dataset(prefix: str, num_docs: int) -> None:
    """Megatron indexed dataset of byte-tokenised word salad, one EOD-terminated document each."""
    import random

    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_odc.data import ByteTokenizer

    tokenizer, rng = ByteTokenizer(), random.Random(0)
    words = ["the", "model", "reads", "a", "long", "document", "and", "answers", "questions"]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for _ in range(num_docs):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 40)))
        ids = [*tokenizer.encode(text), tokenizer.eos_id]
        builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(prefix + ".idx")


def _run_backends(rank: int, world_size: int, workdir: str) -> dict[str, dict[int, float]]:
    import torch.distributed as dist

    del world_size
    os.chdir(workdir)
    common = [*SMALL, "--train-iters", "6"]
    runs = {
        "odc lb_mini": [],
        "odc round_robin": ["--balance", "round_robin"],
        "odc lb_mini keep-all": ["--odc-unsharded-budget", "all"],
        "fsdp lb_micro": ["--dp-backend", "fsdp"],
        "fsdp lb_micro keep-some": ["--dp-backend", "fsdp", "--odc-unsharded-budget", "100KiB"],
        "ddp lb_mini": ["--dp-backend", "ddp"],
        "distopt local_sort": ["--dp-backend", "distopt", "--balance", "local_sort"],
    }
    results = {name: _train_losses([*common, *extra]) for name, extra in runs.items()}
    # The same JSONL preprocessed once (python -m megatron_odc.data.preprocess): the same samples.
    (jsonl,) = Path(workdir, "runs", "cpu-default").glob("synthetic_sft_*.jsonl")
    sft_prefix = os.path.join(workdir, "sft")
    if rank == 0:
        preprocess(str(jsonl), sft_prefix, workers=0, progress=False)
    dist.barrier()
    results["odc lb_mini preprocessed"] = _train_losses([*common, "--data-path", sft_prefix])
    prefix = os.path.join(workdir, "docs")
    if rank == 0:
        _write_indexed_dataset(prefix, num_docs=60)
    dist.barrier()
    pretrain = [*SMALL, "--train-iters", "5", "--seq-length", "64", "--data-path", prefix]
    results["pretrain odc"] = _train_losses(pretrain)
    results["pretrain ddp"] = _train_losses([*pretrain, "--dp-backend", "ddp"])
    return results


def _run_pipeline(rank: int, world_size: int, workdir: str) -> dict[str, object]:
    """PP=2 x DP=2 through the entry: ODC (also with every unit kept unsharded), the lockstep fsdp
    baseline (LB-Micro's equal counts) and megatron-core DDP (the same init: the same layout)."""
    del rank, world_size
    os.chdir(workdir)
    common = [*SMALL, "--train-iters", "4", "--num-layers", "4", "--pipeline-model-parallel-size"]
    common += ["2", "--distributed-timeout-minutes", "2"]
    from megatron_odc.train import run

    out: dict[str, object] = {}
    runs = {
        "odc": [],
        "odc keep-all": ["--odc-unsharded-budget", "all"],
        "fsdp": ["--dp-backend", "fsdp"],
        "ddp": ["--dp-backend", "ddp"],
    }
    for name, extra in runs.items():
        args = validate_args(build_parser().parse_args([*common, *extra]), world_size=4)
        result = run(args)
        out[name] = result.losses
        out[f"{name} norms"] = result.grad_norms
    import torch

    from megatron_odc.runner.data_pipeline import DataPipeline

    data = DataPipeline(args, dp_rank=0, dp_size=2, device=torch.device("cpu"))
    out["counts"] = [data.sampler.assignment(0, i).num_microbatches_per_rank for i in range(4)]
    data.close()
    return out


def test_pipeline_stages_train_through_the_entry(tmp_path):
    """Every rank (both stages) logs the pipeline's loss; ODC equals megatron-core DDP, with the
    pipeline-aware plan's uneven counts per replica."""
    results = run_ranks(_run_pipeline, 4, str(tmp_path), timeout_s=240)
    assert any(len(set(c)) > 1 for c in results[0]["counts"]), results[0]["counts"]
    odc, ddp = results[0]["odc"], results[0]["ddp"]
    assert sorted(odc) == sorted(ddp) == [1, 2, 3, 4]
    assert abs(odc[1] - math.log(384)) < 0.3, odc
    for res in results:  # the first stage's ranks log what the last stage computed
        assert res["odc"] == odc
        assert res["odc norms"] == results[0]["odc norms"]
    for name in ("odc", "odc keep-all", "fsdp"):
        for it, loss in results[0][name].items():
            assert loss == pytest.approx(ddp[it], rel=1e-5), (name, it)
            norm = results[0][f"{name} norms"][it]
            assert norm == pytest.approx(results[0]["ddp norms"][it], rel=1e-5), (name, it)


def test_backends_and_plans_train_the_same_model(tmp_path):
    results = run_ranks(_run_backends, 2, str(tmp_path), timeout_s=150)
    assert results[0] == results[1], "ranks disagree on the global loss"
    # Preprocessed data trains on exactly the samples of its JSONL file (shm accumulates in arrival order,
    # so two runs agree to fp32 rounding, not bitwise).
    preprocessed, jsonl = results[0]["odc lb_mini preprocessed"], results[0]["odc lb_mini"]
    assert sorted(preprocessed) == sorted(jsonl)
    for it, loss in jsonl.items():
        assert preprocessed[it] == pytest.approx(loss, rel=1e-6, abs=0.0), it
    for reference_name, pretraining in (("odc lb_mini", False), ("pretrain odc", True)):
        reference = results[0][reference_name]
        # A fresh model predicts almost uniformly over the padded byte vocabulary (384).
        assert abs(reference[1] - math.log(384)) < 0.3, reference
        assert reference[max(reference)] < reference[1] - 0.5, reference
        for name, losses in results[0].items():
            if name.startswith("pretrain ") != pretraining:
                continue
            assert sorted(losses) == sorted(reference), name
            for it, loss in losses.items():
                # Iteration 1 sees identical weights: only fp32 summation order differs.
                assert loss == pytest.approx(reference[it], rel=1e-4), (name, it)
    assert sorted(results[0]["odc lb_mini"]) == list(range(1, 7))
    assert sorted(results[0]["pretrain odc"]) == list(range(1, 6))


# Resume and skipped steps (issue 37, items 2 and 3) #


def _logged_lrs(stdout: str) -> dict[int, float]:
    return {int(m[0]): float(m[3]) for m in ITERATION_LINE.findall(stdout)}


def _cosine_lr(num_samples: int, *, max_lr: float, warmup: int, decay: int) -> float:
    """Megatron's cosine schedule after warmup, min_lr the entry's default (--lr / 10)."""
    min_lr = max_lr / 10
    ratio = (num_samples - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def test_a_resume_that_changes_the_schedule_needs_a_flag_saying_which_wins(tmp_path, shm_dir):
    """Megatron-LM's rule: new --lr / --train-iters on --load are refused in one line naming them;
    --override-opt_param-scheduler applies the new schedule from the checkpoint's iteration on,
    --use-checkpoint-opt_param-scheduler keeps the saved one. Before, the checkpoint's schedule won
    silently (a longer run kept the old minimum LR for every new iteration)."""
    ckpt = str(tmp_path / "ckpt")
    tiny = ["--num-layers", "1", "--hidden-size", "32", "--seq-length", "64"]
    tiny += ["--global-batch-size", "8", "--synthetic-num-samples", "64", "--log-interval", "1"]
    _torchrun(
        [*tiny, "--train-iters", "6", "--save", ckpt, "--exit-interval", "3"], tmp_path, shm_dir
    )
    changed = [*tiny, "--train-iters", "8", "--lr", "1e-3", "--load", ckpt, "--exit-interval", "5"]

    refused = _torchrun_status(changed, tmp_path, shm_dir)
    assert refused.returncode != 0, refused.stdout[-2000:] + refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if "megatron_odc.train: error:" in line]
    assert len(errors) == 1, refused.stderr[-3000:]
    assert "--lr: 0.001 (checkpoint: 0.003)" in errors[0], errors
    assert "--lr-decay-iters, default --train-iters (in samples): 64 (checkpoint: 48)" in errors[0]
    assert "--override-opt_param-scheduler" in errors[0]
    assert "--use-checkpoint-opt_param-scheduler" in errors[0]
    assert "iteration" not in "".join(ITERATION_LINE.findall(refused.stdout))

    # Iteration 5 updates with the LR after 4 x 8 samples: warmup (3 x 8) done, cosine decay.
    flags_win = _logged_lrs(
        _torchrun([*changed, "--override-opt_param-scheduler"], tmp_path, shm_dir)
    )
    assert sorted(flags_win) == [4, 5]
    assert flags_win[4] == pytest.approx(1e-3, rel=1e-6)  # the end of warmup at the new peak
    assert flags_win[5] == pytest.approx(_cosine_lr(32, max_lr=1e-3, warmup=24, decay=64), rel=1e-6)
    saved_wins = _logged_lrs(
        _torchrun([*changed, "--use-checkpoint-opt_param-scheduler"], tmp_path, shm_dir)
    )
    assert saved_wins[5] == pytest.approx(
        _cosine_lr(32, max_lr=3e-3, warmup=24, decay=48), rel=1e-6
    )


def test_a_run_whose_every_step_was_skipped_does_not_exit_0(tmp_path, shm_dir):
    """fp16 with a loss scale that overflows every step: each line says every step of its interval
    was skipped and shows the loss scale; the run ends with one error, exit status 2 on each rank
    (it trained nothing). Before: loss flat, 'training finished', exit 0."""
    argv = ["--num-layers", "1", "--hidden-size", "32", "--seq-length", "64"]
    argv += ["--global-batch-size", "8", "--synthetic-num-samples", "64", "--log-interval", "1"]
    argv += ["--fp16", "--loss-scale", "1e30", "--train-iters", "3"]
    proc = _torchrun_status(argv, tmp_path, shm_dir)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-3000:]  # torchrun: 1
    lines = [line for line in proc.stdout.splitlines() if "number of skipped iterations" in line]
    assert len(lines) == 3, proc.stdout[-3000:]
    for line in lines:
        assert "number of skipped iterations:   1 (every step of the interval)" in line, line
        scale = re.search(r"loss scale: ([\d.]+)", line)
        assert scale is not None, line
        assert float(scale.group(1)) == pytest.approx(1e30, rel=1e-6), line
        assert "learning rate: 0.000000E+00" in line, line  # a skipped step keeps the schedule
    errors = [line for line in proc.stderr.splitlines() if "megatron_odc.train: error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "every optimizer step of this run was skipped (iterations 1-3" in errors[0]
    assert "training finished" not in proc.stdout
