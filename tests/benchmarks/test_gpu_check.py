"""``benchmarks/gpu_check.py`` on CPU: the dry run, a whole rehearsal of its checks, and its judgements
(``benchmarks/gpu_check_lib/checks.py``).

The GPU check runs only when a GPU is lent, with minutes to spare; these tests make sure the harness itself
is right before then. The rehearsal (``--cpu-rehearsal``) runs every check's rank bodies and comparisons
on CPU (megatron-core's CPU patches; ``tests/_fake_cuda.py`` as the GPU, with NVSHMEM as host copies; the
deterministic accumulate mode only, since the atomic one needs Triton on a GPU). The judgement tests feed each check doctored rank
results and show that a result outside its target fails the check and the script's exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from importlib import metadata
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu_check_lib import checks, world
from megatron_odc.transport.nvshmem import nvshmem_unavailable_reason
from tests._dist import SHM_ROOT_ENV

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def test_gpu_check_dry_run() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The probe's verdict: a CPU build of torch has no NVSHMEM; PyPI's CUDA build has it, GPU or not.
    verdict = nvshmem_unavailable_reason() or "available"
    if torch.version.cuda is None:
        assert "has no NVSHMEM" in verdict
    # The dry run lists every check it would run, with the world sizes of the correctness runs.
    for needle in (
        "correctness w=2",
        "correctness w=4",
        "nvshmem w=2",
        f"nvshmem: {verdict}\n",
        "bandwidth",
        "parity",
        "fp8 emulated",
        "te fp8",
        "thd sft",
        # every name the rank bodies import resolves, in whichever megatron-core is installed
        f"megatron-core: importable ({metadata.version('megatron-core')})",
    ):
        assert needle in result.stdout, result.stdout
    wrapper = subprocess.run(
        ["bash", "-n", str(REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True
    )
    assert wrapper.returncode == 0, wrapper.stderr


def test_cpu_rehearsal_runs_every_check_and_passes(tmp_path: Path) -> None:
    checks = [
        "correctness w=2",
        "nvshmem w=2",
        "bandwidth w=2",
        "parity w=2 odc vs ddp",
        "fp8 emulated w=2",
        "thd sft w=2",
    ]
    out = tmp_path / "numbers.json"
    shm_root = Path("/dev/shm") / f"odc-rehearsal-{uuid.uuid4().hex[:12]}"  # this run's only
    shm_root.mkdir()
    argv = [sys.executable, str(SCRIPT), "--cpu-rehearsal", "--repeats", "2", "--json", str(out)]
    try:
        result = subprocess.run(
            [*argv, "--only", *checks],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
            env={**os.environ, SHM_ROOT_ENV: str(shm_root)},
        )
        left_behind = sorted(p.name for p in shm_root.iterdir())
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    table = result.stdout.splitlines()
    assert "CPU rehearsal (not a GPU result)" in table[0]
    # the megatron-core release it ran on (whichever the machine has)
    assert f"megatron-core {metadata.version('megatron-core')}," in table[0]
    width = max(len(check) for check in checks)
    rows = {line[:width].strip(): line for line in table[2:]}
    assert sorted(rows) == sorted(checks), result.stdout
    assert all(" PASS " in row for row in rows.values()), result.stdout
    numbers = json.loads(out.read_text())
    parity = numbers["parity w=2 odc vs ddp"]["extra"]
    # On CPU the losses are bitwise megatron-core DDP's. The bf16 parameters may differ in a few
    # elements: oneDNN chooses GEMM kernels by buffer alignment, and ODC's unsharded buffers are not
    # DDP's, so a few sums round differently (seen on one of two machines: 12 of 51k elements, tensor
    # norms within 1.1e-3). A real error (a lost push, a wrong scale) changes nearly every element.
    assert parity["odc_losses"] == parity["ddp_losses"]
    assert parity["det_losses"] == parity["ddp_losses"]
    for prefix in ("", "det_"):
        assert parity[f"{prefix}param_frac_differing"] < 1e-3, parity
        assert parity[f"{prefix}param_rel_err"] < 1e-2, parity
    assert parity["det_bitwise_repeat"] is True
    assert parity["fused_model_rel_err"] < 1e-2, parity
    assert len(parity["ddp_losses"]) == 3
    correctness = numbers["correctness w=2"]["extra"]["results"]
    assert [sorted(k for k in r if k != "features") for r in correctness] == [["deterministic"]] * 2
    nvshmem = numbers["nvshmem w=2"]["extra"]["results"]
    # remote_peers="all": the peer through (faked) NVSHMEM get / put; "auto": one host, load / store.
    assert [(r["all"]["remote"], r["auto"]["remote"]) for r in nvshmem] == [([1], []), ([0], [])]
    assert numbers["bandwidth w=2"]["extra"]["acc_det_gbps"] > 0
    thd = numbers["thd sft w=2"]["extra"]
    assert thd["odc_counts"] == [3, 2]  # uneven (LB-Mini) against
    assert thd["ddp_counts"] == [2, 2]  # LB-Micro's equal counts of the same records
    assert max(abs(a - b) / b for a, b in zip(thd["odc_losses"], thd["ddp_losses"])) < 1e-3
    assert not left_behind, f"the rehearsal left its host 'symmetric memory' behind: {left_behind}"


@pytest.fixture
def on_gpu(monkeypatch) -> None:
    """Judge as on the GPU; ``main --cpu-rehearsal`` switches the rehearsal on, undone after the test."""
    monkeypatch.setattr(world, "_REHEARSAL", False)


def _args(*argv: str):
    return gpu_check._parse(list(argv))


def test_bandwidth_targets_are_judged(on_gpu, monkeypatch) -> None:
    def measured(get_vs_copy: float, acc_vs_add: float) -> dict:
        return {
            "copy_gbps": 100.0,
            "get_gbps": 100.0 * get_vs_copy,
            "add_gbps": 50.0,
            "acc_atomic_gbps": 50.0 * acc_vs_add,
            "acc_det_gbps": 10.0,
            "get_vs_copy": get_vs_copy,
            "acc_vs_add": acc_vs_add,
            "acc_det_vs_add": 0.2,
        }

    args = _args()
    for (get, acc), expected in {(0.9, 0.6): True, (0.7, 0.6): False, (0.9, 0.4): False}.items():
        res = measured(get, acc)
        monkeypatch.setattr(checks, "run_world", lambda *a, _r=res, **k: [_r, {}])
        ok, detail, _ = checks._check_bandwidth(args)
        assert ok is expected, (get, acc, detail)
        assert f"({get:.2f}x)" in detail


def test_parity_tolerances_are_judged(on_gpu, monkeypatch) -> None:
    def result(odc_loss: float, param_err: float, bitwise: bool, fused: tuple) -> dict:
        return {
            "ddp_losses": [5.0, 4.0, 3.0],
            "odc_losses": [5.0, 4.0, odc_loss],
            "det_losses": [5.0, 4.0, 3.0],
            "param_rel_err": param_err,
            "det_param_rel_err": 0.0,
            "det_bitwise_repeat": bitwise,
            "fused_losses": [5.0, 4.0, fused[0]],
            "fused_model_rel_err": fused[1],
        }

    args = _args()
    good = (3.0, 1e-4)
    cases = {
        (3.03, 1e-3, True, good): True,
        (3.1, 1e-3, True, good): False,
        (3.0, 0.05, True, good): False,
        (3.0, 0.0, False, good): False,  # deterministic mode that does not repeat bitwise fails
        (3.0, 0.0, True, (3.1, 1e-4)): False,  # the fused-kernel run's loss
        (3.0, 0.0, True, (3.0, 0.05)): False,  # the fused-kernel run's parameters as a whole
    }
    for (loss, err, bitwise, fused), expected in cases.items():
        res = result(loss, err, bitwise, fused)
        monkeypatch.setattr(checks, "run_world", lambda *a, _r=res, **k: [_r, _r])
        ok, detail, _ = checks._check_parity(args)
        assert ok is expected, (loss, err, bitwise, fused, detail)


def test_correctness_failures_are_reported_per_rank(on_gpu, monkeypatch) -> None:
    clean = {m: {"failures": [], "max_abs_err": 1e-7} for m in ("atomic", "deterministic")}
    broken = {**clean, "atomic": {"failures": ["atomic: lost 3 element(s)"], "max_abs_err": 2.0}}
    monkeypatch.setattr(checks, "run_world", lambda *a, **k: [clean, broken])
    ok, detail, _ = checks._check_correctness(_args(), 2)
    assert not ok
    assert "rank 1: atomic: lost 3 element(s)" in detail
    monkeypatch.setattr(checks, "run_world", lambda *a, **k: [clean, clean])
    assert checks._check_correctness(_args(), 2)[0]


def test_nvshmem_is_skipped_with_the_reason_or_judged_per_rank(on_gpu, monkeypatch) -> None:
    import megatron_odc.transport.nvshmem as nvshmem

    monkeypatch.setattr(nvshmem, "nvshmem_unavailable_reason", lambda: "PyTorch 9.9 lacks it")
    ok, detail, extra = checks._check_nvshmem(_args())
    assert (ok, extra) == (True, {"skipped": True})
    assert detail == "NVSHMEM unavailable: PyTorch 9.9 lacks it"
    monkeypatch.setattr(nvshmem, "nvshmem_unavailable_reason", lambda: None)
    monkeypatch.setattr(nvshmem, "load_device_ops", lambda: None)
    clean = {m: {"failures": [], "max_abs_err": 1e-7, "remote": []} for m in ("all", "auto")}
    broken = {**clean, "all": {**clean["all"], "failures": ["nvshmem all: lost 2 element(s)"]}}
    monkeypatch.setattr(checks, "run_world", lambda *a, **k: [clean, broken])
    ok, detail, _ = checks._check_nvshmem(_args())
    assert not ok
    assert "rank 1: nvshmem all: lost 2 element(s)" in detail
    monkeypatch.setattr(checks, "run_world", lambda *a, **k: [clean, clean])
    assert checks._check_nvshmem(_args())[0]


def test_thd_sft_is_skipped_with_the_reason_without_transformer_engine(on_gpu) -> None:
    from megatron_odc.core.fp8 import transformer_engine_available

    if transformer_engine_available():
        pytest.skip("TransformerEngine is importable here: the check would run")
    ok, detail, extra = checks.CHECKS["thd sft w=2"](_args())
    assert ok
    assert extra == {"skipped": True}
    assert "TransformerEngine not importable" in detail


def test_a_failing_or_raising_check_fails_the_run(on_gpu, monkeypatch, tmp_path, capsys) -> None:
    def raises(args):
        raise RuntimeError("rank 1 hung (killed after 150 s)")

    stubs = {
        "good": lambda args: (True, "fine", {"x": 1}),
        "absent": lambda args: (True, "TransformerEngine not importable here", {"skipped": True}),
        "bad": lambda args: (False, "param rel err 0.5", {}),
        "raises": raises,
    }
    monkeypatch.setattr(gpu_check, "CHECKS", stubs)
    out = tmp_path / "numbers.json"
    assert gpu_check.main(["--cpu-rehearsal", "--json", str(out)]) == 1
    table = capsys.readouterr().out
    assert "good    PASS    fine" in table
    assert "absent  SKIP    TransformerEngine" in table
    assert "bad     FAIL    param rel err 0.5" in table
    assert "raises  FAIL    RuntimeError: rank 1 hung" in table
    numbers = json.loads(out.read_text())
    assert [numbers[name]["ok"] for name in stubs] == [True, True, False, False]
    # A SKIP (a missing optional library) does not fail the run; a check left out for time does.
    monkeypatch.setattr(gpu_check, "CHECKS", {k: stubs[k] for k in ("good", "absent")})
    assert gpu_check.main(["--cpu-rehearsal"]) == 0
    assert gpu_check.main(["--cpu-rehearsal", "--budget-s", "-1"]) == 1
    assert "NOT RUN" in capsys.readouterr().out
