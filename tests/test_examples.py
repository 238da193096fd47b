"""The scripts in ``examples/``: each has its header, and each CPU example runs and says what it shows.

- Every ``examples/*.sh`` (``_*.sh`` are sourced helpers) is executable, passes ``bash -n`` and opens
  with the header ``examples/README.md`` describes (title, Shows, Needs, Takes, ``set -euo pipefail``).
- Every example whose ``Needs`` is ``cpu`` (and ``mpi``: it launches with ``mpiexec``) runs at its tiny size (``EXAMPLE_TINY=1``, outputs
  under a temporary ``EXAMPLE_DIR``) and its verification line is checked against its own logs:
  the quick start's ODC and DDP losses agree to 1e-5 at every iteration; the finetune starts from the
  pretrained weights (its first loss is near the pretrain's last, far below a fresh model's); the
  TensorBoard example's event file holds the text log's first and final losses. Examples without
  a check of their own must exit 0 and end with a line holding a number.
- The multi-node examples run both launches on this machine: hybrid sharding over 2 pretend hosts x 2
  ranks (``torchrun --nnodes 2``, two node processes) and full sharding under ``mpiexec`` with
  ``--odc-transport mpi``; each equals megatron-core DDP and its log names the topology it ran.
- Examples that need ``mpiexec`` (``mpi``) are skipped without mpi4py / mpiexec.
- Examples that need Megatron-LM run only when ``MEGATRON_LM_PATH`` is set; GPU / TransformerEngine
  examples cannot run here, so every ``--flag`` they pass to ``python -m megatron_odc.train`` must be
  one its parser (``runner/arguments.py``) knows.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_odc.runner.arguments import build_parser
from tests._mpi import MPIEXEC
from tests.runner.test_trainer import SUMMARY_LINE

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(p for p in EXAMPLES.glob("*.sh") if not p.name.startswith("_"))
NEEDS = {"cpu", "gpu", "te", "megatron-lm", "mpi"}
HEADER = [
    re.compile(r"#!/usr/bin/env bash$"),
    re.compile(r"# (?P<title>\S.*)$"),
    re.compile(r"# Shows: (?P<shows>\S.*)$"),
    re.compile(r"# Needs: (?P<needs>[a-z -]+?)\s*$"),
    re.compile(
        r"# Takes: about (?P<full>\d+) s on \S.* \(EXAMPLE_TINY=1: about (?P<tiny>\d+) s\)$"
    ),
    re.compile(r"set -euo pipefail$"),
]
"""The first six lines of every example, in order."""
TORCHRUN_FLAGS = {"--standalone", "--nproc-per-node", "--nnodes", "--node-rank", "--master-port"}
TIMEOUT_S = 300
"""Per example at its tiny size; a loaded 2-core machine takes a few times the header's figure."""


def _header(script: Path) -> dict[str, str]:
    lines = script.read_text().splitlines()[: len(HEADER)]
    fields: dict[str, str] = {}
    for n, (pattern, line) in enumerate(zip(HEADER, lines), start=1):
        match = pattern.match(line)
        assert match, f"{script.name}:{n}: {line!r} does not match {pattern.pattern!r}"
        fields.update(match.groupdict())
    assert len(lines) == len(HEADER), f"{script.name}: shorter than its header"
    return fields


def _needs(script: Path) -> set[str]:
    """The words of the ``# Needs:`` line (none when it is missing: ``test_header_and_syntax`` says so)."""
    match = re.search(r"^# Needs: (.*)$", script.read_text(), re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def _ids(scripts: list[Path]) -> list[str]:
    return [s.stem for s in scripts]


@pytest.mark.parametrize("script", SCRIPTS, ids=_ids(SCRIPTS))
def test_header_and_syntax(script):
    fields = _header(script)
    needs = set(fields["needs"].split())
    assert needs, f"{script.name}: Needs is empty"
    assert needs <= NEEDS, f"{script.name}: Needs {fields['needs']!r}; words from {sorted(NEEDS)}"
    assert int(fields["tiny"]) <= int(fields["full"]), script.name
    assert os.access(script, os.X_OK), f"{script.name} is not executable (chmod +x)"
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_every_example_is_in_the_table():
    assert SCRIPTS, "no examples found"
    table = (EXAMPLES / "README.md").read_text()
    missing = [s.name for s in SCRIPTS if f"`{s.name}`" not in table]
    assert not missing, f"examples/README.md does not list {missing}"


def _entry_flags(script: Path) -> set[str]:
    """Every ``--flag`` outside comments (the flags a GPU example hands to the training entry)."""
    flags: set[str] = set()
    for line in script.read_text().splitlines():
        code = line.split("#", 1)[0]
        flags |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", code))
    return flags - TORCHRUN_FLAGS


GPU_SCRIPTS = [s for s in SCRIPTS if _needs(s) & {"gpu", "te"} and "megatron-lm" not in _needs(s)]


@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=_ids(GPU_SCRIPTS))
def test_gpu_examples_pass_only_known_flags(script):
    known = set(build_parser()._option_string_actions)
    flags = _entry_flags(script)
    assert flags, f"{script.name} passes no flags: the check would prove nothing"
    unknown = sorted(flags - known)
    assert not unknown, (
        f"{script.name} passes flags python -m megatron_odc.train does not know: {unknown}"
    )


def _run(script: Path, tmp_path: Path, command: list[str] | None = None) -> str:
    """Runs ``script`` at its tiny size (``command``: how, default ``bash script``); returns its
    output (asserting exit status 0)."""
    shm = Path("/dev/shm") / f"megatron_odc_test_examples_{uuid.uuid4().hex[:12]}"
    shm.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        EXAMPLE_TINY="1",
        EXAMPLE_DIR=str(tmp_path / "out"),
        OMP_NUM_THREADS="1",
        MEGATRON_ODC_SHM_DIR=str(shm),
        # torchrun and python of this interpreter's environment
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    proc = subprocess.Popen(
        command or ["bash", str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its torchrun and ranks end with it on a timeout
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{script.name} ran past {TIMEOUT_S} s:\n{out[-3000:]}")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}:\n{out[-5000:]}"
    return out


def _verification(out: str, prefix: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith(prefix)]
    assert lines, f"no line starting {prefix!r}:\n{out[-3000:]}"
    return lines[-1]


def _number(line: str, label: str) -> float:
    match = re.search(re.escape(label) + r" (\S+?),?(?:\s|$)", line)
    assert match, f"{label!r} not in {line!r}"
    return float(match.group(1))


def _logged_losses(log: Path) -> dict[int, float]:
    pattern = re.compile(r"iteration\s+(\d+)/.*\| lm loss: (\S+) \|")
    return {int(m[0]): float(m[1]) for m in pattern.findall(log.read_text())}


def _summary_losses(log: Path) -> tuple[float, float]:
    """The training summary's first and final lm loss."""
    match = SUMMARY_LINE.search(log.read_text())
    assert match, f"no training summary in {log}"
    return float(match.group(1)), float(match.group(2))


def _check_quickstart(out: str, outdir: Path) -> None:
    odc, ddp = _logged_losses(outdir / "odc.log"), _logged_losses(outdir / "ddp.log")
    assert sorted(odc) == sorted(ddp) == [1, 2, 3, 4], (odc, ddp)
    for it in odc:
        assert odc[it] == pytest.approx(ddp[it], abs=1e-5), (it, odc[it], ddp[it])
    line = _verification(out, "quickstart:")
    assert _number(line, "odc final lm loss") == odc[4]
    assert _number(line, "ddp final lm loss") == ddp[4]
    assert _number(line, "max |difference|") <= 1e-5


def _check_pretrain_finetune(out: str, outdir: Path) -> None:
    line = _verification(out, "pretrain_finetune:")
    pretrain_first = _number(line, "pretrain first lm loss")
    pretrain_last = _number(line, "pretrain last lm loss")
    finetune_first = _number(line, "finetune first lm loss")
    assert (pretrain_first, pretrain_last) == _summary_losses(outdir / "pretrain.log")
    assert finetune_first == _summary_losses(outdir / "finetune.log")[0]
    learned = pretrain_first - pretrain_last
    assert learned > 0.5, f"the pretrain did not learn: {line}"
    # Loaded weights (resharded from DP=2 to TP=2 x DP=2): the finetune starts where the pretrain
    # ended, within a tenth of what it learned (fresh weights would start near pretrain_first).
    assert finetune_first < pretrain_last + 0.1 * learned, line
    assert "loaded the weights of iteration 8" in (outdir / "finetune.log").read_text()


def _check_tensorboard(out: str, outdir: Path) -> None:
    line = _verification(out, "tensorboard:")
    text = _verification(out, "text log:")
    # TensorBoard keeps float32, the text log the float64 loss; both are printed to 7 significant
    # digits, so they may differ by one unit in the last place (5.930884 against 5.930885).
    for board_label, text_label in (("first", "first lm loss"), ("last", "final lm loss")):
        board, logged = _number(line, board_label), _number(text, text_label)
        assert board == pytest.approx(logged, abs=1.5e-6), (line, text)
    assert "lm loss at 4 iterations" in line
    assert list((outdir / "tensorboard").glob("events.out.tfevents.*"))


def _check_hf_roundtrip(out: str, outdir: Path) -> None:
    del outdir
    line = _verification(out, "round trip OK:")
    assert _number(line, "differ by") < 1e-5, line
    assert _number(line, "moved the logits by") > 1e-3, line


def _check_odc_equals_ddp(out: str, outdir: Path, *odc_log_holds: str) -> None:
    """odc.log and ddp.log hold the same losses, the closing line says so, and odc.log holds each of
    ``odc_log_holds``."""
    odc, ddp = _logged_losses(outdir / "odc.log"), _logged_losses(outdir / "ddp.log")
    assert odc, f"no lm loss in {outdir / 'odc.log'}"
    assert sorted(odc) == sorted(ddp), (odc, ddp)
    for it in odc:
        assert odc[it] == pytest.approx(ddp[it], rel=1e-5), (it, odc[it], ddp[it])
    _verification(out, "odc and ddp printed the same losses")
    log = (outdir / "odc.log").read_text()
    for text in odc_log_holds:
        assert text in log, f"{text!r} not in odc.log:\n{log[-3000:]}"


def _check_hybrid(out: str, outdir: Path) -> None:
    hybrid = "ODC: --odc-transport shm | sharded over 2 ranks x 2 replicas (hybrid sharding)"
    _check_odc_equals_ddp(out, outdir, hybrid)


def _check_mpi(out: str, outdir: Path) -> None:
    _check_odc_equals_ddp(out, outdir, "ODC: --odc-transport mpi | sharded over 2 ranks\n")


CHECKS: dict[str, Callable[[str, Path], None]] = {
    "quickstart_cpu": _check_quickstart,
    "pretrain_distopt_finetune_odc": _check_pretrain_finetune,
    "tensorboard_cpu": _check_tensorboard,
    "hf_sft_roundtrip": _check_hf_roundtrip,
    "megatron_lm_pretrain_gpt_cpu": _check_odc_equals_ddp,
    "multinode_hybrid_torchrun": _check_hybrid,
    "multinode_mpi_full_shard": _check_mpi,
}
"""Example -> the check of its verification line and logs (``out``, ``EXAMPLE_DIR``)."""
SLOW = {
    "pretrain_distopt_finetune_odc",
    "hf_sft_roundtrip",
    "multinode_hybrid_torchrun",
    "multinode_mpi_full_shard",
}
"""Examples longer than 30 s at their tiny size (a torch_dist save, 4 ranks on 2 cores; the HF round
trip, whose parts tests/mcore/test_hf_bridge.py covers in CI; the multi-node launches, whose paths
tests/mcore/test_hybrid.py and tests/runner/test_trainer.py's mpiexec run cover in CI): --runslow."""


def _check_generic(out: str, outdir: Path) -> None:
    del outdir
    last = out.rstrip().splitlines()[-1] if out.strip() else ""
    assert re.search(r"\d", last), f"the last line says nothing verifiable: {last!r}"


def _runnable(script: Path):
    needs = _needs(script)
    marks = []
    if script.stem in SLOW:
        marks.append(pytest.mark.slow)
    if "mpi" in needs:
        marks.append(
            pytest.mark.skipif(
                MPIEXEC is None, reason="needs mpi4py and mpiexec (requirements.txt)"
            )
        )
    if "megatron-lm" in needs:
        marks.append(
            pytest.mark.skipif(
                not os.environ.get("MEGATRON_LM_PATH"),
                reason="needs Megatron-LM: set MEGATRON_LM_PATH to a checkout of a supported tag",
            )
        )
    return pytest.param(script, id=script.stem, marks=marks)


CPU_SCRIPTS = [
    _runnable(s)
    for s in SCRIPTS
    if "cpu" in _needs(s) and _needs(s) <= {"cpu", "megatron-lm", "mpi"}
]


@pytest.mark.parametrize("script", CPU_SCRIPTS)
def test_cpu_example_runs_and_verifies(script, tmp_path):
    out = _run(script, tmp_path)
    CHECKS.get(script.stem, _check_generic)(out, tmp_path / "out")


GRPO_STEP = re.compile(
    r"^(?P<backend>ODC\+LB-Mini|DDP padded|FSDP2 LB-Micro|DDP LB-Mini) +step (?P<step>\d+): loss (?P<loss>\S+) "
    r"grad norm (?P<norm>\S+) step time (?P<time>\S+) s microbatches per rank \[(?P<counts>[\d, ]+)\]$"
)


@pytest.mark.parametrize(("budget", "length_scale"), [("all", None), ("none", 128)])
def test_grpo_cpu_example_runs_tiny_and_the_three_backends_make_the_same_updates(
    tmp_path, budget, length_scale
):
    """``examples/grpo_cpu.py --tiny`` (a Python example, docs/rl.md), with ODC's units kept for the
    step (FSDP2 not resharding after forward) and fetched per use (FSDP2 resharding): every backend
    prints every step; the same rollouts give the same per-step loss and grad norm under ODC +
    LB-Mini (uneven counts), padded megatron-core DDP, FSDP2 and the diagnostic row (DDP on ODC's
    plan: its counts; 1e-4: the plans sum in different orders); padded DDP's and FSDP2's counts are
    equal across ranks; the plans' cost model was measured first; the last line holds the measured
    and predicted ratios; ``--length-scale`` sets the rollouts' scale (``--tiny``'s: 256)."""
    script = EXAMPLES / "grpo_cpu.py"
    scale = [] if length_scale is None else ["--length-scale", str(length_scale)]
    out = _run(
        script,
        tmp_path,
        [
            sys.executable,
            str(script),
            "--tiny",
            "--with-ddp-lb-mini",
            "--odc-unsharded-budget",
            budget,
            *scale,
        ],
    )
    assert f"profile agent_rl / {length_scale or 256}," in out, out[-3000:]
    rows: dict = {}
    for line in out.splitlines():
        match = GRPO_STEP.match(line)
        if match:
            counts = [int(c) for c in match["counts"].split(",")]
            rows.setdefault(match["backend"], []).append(
                (float(match["loss"]), float(match["norm"]), float(match["time"]), counts)
            )
    assert sorted(rows) == ["DDP LB-Mini", "DDP padded", "FSDP2 LB-Micro", "ODC+LB-Mini"], out[
        -3000:
    ]
    steps = {len(r) for r in rows.values()}
    assert len(steps) == 1, rows
    assert steps.pop() >= 2, rows
    for backend in ("DDP padded", "FSDP2 LB-Micro", "DDP LB-Mini"):
        for (loss, norm, _, counts), (odc_loss, odc_norm, _, odc_counts) in zip(
            rows[backend], rows["ODC+LB-Mini"], strict=True
        ):
            assert abs(loss - odc_loss) <= 1e-4 * max(1.0, abs(odc_loss)), (backend, rows)
            assert abs(norm - odc_norm) <= 1e-4 * odc_norm, (backend, rows)
            if backend == "DDP LB-Mini":  # the diagnostic row runs ODC's own plan
                assert counts == odc_counts, (counts, odc_counts)
            else:
                assert len(set(counts)) == 1, (backend, counts)
    assert "diagnostic: DDP on LB-Mini's plan" in out, out[-3000:]
    last = out.rstrip().splitlines()[-1]
    ratios = re.findall(r"(\d+\.\d+)x", last)
    assert last.startswith("measured ODC+LB-Mini speedup (timed steps' total)"), last
    assert "cost model measured on this machine: a=" in out, out[-3000:]
    assert len(ratios) == 4, last
