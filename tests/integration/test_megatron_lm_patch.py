"""``patches/megatron_lm_<tag>_odc.patch`` (one per supported tag) stays the launcher's runtime patches,
as source hooks.

Without Megatron-LM: each tag's patch adds exactly one hook line at every patch point of the tag's row
(``releases.py``; in that name's module), the CPU hook at the start of ``CPU_HOOK``'s function and the
hook imports, and nothing else (no copy of the logic); each hook returns the launcher's own wrapper; the
CPU flags the launcher and the hook add; docs/megatron_lm.md lists the same patch points and counts.
With ``MEGATRON_LM_PATH`` (one tag per run): that tag's patch equals a fresh generation from the tree
(``patches/make_megatron_lm_patch.py``), applies with ``git apply`` to a copy, and that copy's own
``pretrain_gpt.py`` (no launcher) prints the launcher's losses.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron_odc.integration.megatron_lm.flags import CPU_FLAGS, with_cpu_flags
from megatron_odc.integration.megatron_lm.patching import PATCH_POINTS, patch_points_of
from megatron_odc.integration.megatron_lm.releases import MEGATRON_LM_RELEASES, MegatronLmRelease
from megatron_odc.integration.megatron_lm.source_hooks import (
    CPU_HOOK,
    hook_import_line,
    odc_patch_point,
    patch_point_line,
)
from tests._megatron_lm import MODEL_ARGS, REPO_ROOT, pretrain_gpt_losses, sft_args

CPU_HOOK_CALL = "cpu_runtime()"


def _generator():
    sys.path.insert(0, str(REPO_ROOT / "patches"))
    try:
        import make_megatron_lm_patch
    finally:
        sys.path.remove(str(REPO_ROOT / "patches"))
    return make_megatron_lm_patch


def _patch_file(release: MegatronLmRelease) -> Path:
    return REPO_ROOT / "patches" / _generator().patch_name(release)


_TAGS = [pytest.param(r, id=r.tag) for r in MEGATRON_LM_RELEASES]


def _module_file(module: str) -> str:
    return module.replace(".", "/") + ".py"


def _parse_patch(text: str) -> dict[str, list[tuple[str, list[str]]]]:
    """``{file: [(added line, context lines above it in its hunk)]}``; asserts nothing is removed."""
    files: dict[str, list[tuple[str, list[str]]]] = {}
    current: list[tuple[str, list[str]]] = []
    above: list[str] = []
    for line in text.splitlines():
        if line.startswith("+++ b/"):
            current = files.setdefault(line[len("+++ b/") :], [])
        elif line.startswith("@@"):
            above = []
        elif line.startswith("-") and not line.startswith("---"):
            raise AssertionError(f"the patch removes a line: {line!r}")
        elif line.startswith("+") and not line.startswith("+++"):
            current.append((line[1:], list(above)))
        elif line.startswith(" "):
            above.append(line[1:])
    return files


def test_one_patch_per_supported_tag_and_no_other() -> None:
    patches = sorted(p.name for p in (REPO_ROOT / "patches").glob("*.patch"))
    assert patches == sorted(_patch_file(r).name for r in MEGATRON_LM_RELEASES)


@pytest.mark.parametrize("release", _TAGS)
def test_patch_hooks_every_patch_point_and_nothing_else(release) -> None:
    points = patch_points_of(release)
    files = _parse_patch(_patch_file(release).read_text())
    modules = {point.module for point in points} | {CPU_HOOK[0]}
    assert sorted(files) == sorted(_module_file(m) for m in modules)
    for module in modules:
        added = files[_module_file(module)]
        expected = [hook_import_line(module)]
        expected += [patch_point_line(p.attr) for p in points if p.module == module]
        if module == CPU_HOOK[0]:
            expected.append(CPU_HOOK_CALL)
        # every patch point reached once, and no line that is not a hook (no logic copied)
        assert sorted(line.strip() for line, _ in added) == sorted(expected), module
    # the CPU hook is a statement of CPU_HOOK's function, right below its signature and docstring
    ((line, above),) = [
        (line, above)
        for line, above in files[_module_file(CPU_HOOK[0])]
        if line.strip() == CPU_HOOK_CALL
    ]
    assert line.startswith("    "), line
    last_def = max(i for i, text in enumerate(above) if text.startswith("def "))
    assert re.match(rf"def {CPU_HOOK[1]}\(", above[last_def]), above
    assert all(text.startswith((" ", ")")) for text in above[last_def + 1 :]), above


def test_hooks_wrap_with_the_launchers_wrappers(monkeypatch) -> None:
    for point in PATCH_POINTS:
        if point.module not in sys.modules:
            monkeypatch.setitem(sys.modules, point.module, types.ModuleType(point.module))

        def original(*args, **kwargs):
            return None

        wrapped = odc_patch_point(point.module, point.attr, original)
        assert wrapped is not original, point.name
        assert wrapped.__megatron_odc_original__ is original, point.name
        # the wrapper of the launcher's patch point: same code object
        launcher = point.wrap(original, sys.modules[point.module])
        assert wrapped.__code__ is launcher.__code__, point.name
        # a binding imported from a hooked module (initialize's parse_args) is not wrapped twice
        assert odc_patch_point(point.module, point.attr, wrapped) is wrapped
    # and the launcher's version guard checks every patch point's signature, in every tag's row
    catalogue = {point.name for point in PATCH_POINTS}
    for release in MEGATRON_LM_RELEASES:
        assert set(release.patch_points) <= catalogue, release.tag
        assert set(release.patch_points) <= set(release.signatures), release.tag
    assert catalogue == {name for r in MEGATRON_LM_RELEASES for name in r.patch_points}
    with pytest.raises(ValueError, match="not an ODC patch point"):
        odc_patch_point("megatron.training.training", "evaluate", lambda: None)


def test_cpu_flags_added_only_where_unset_and_only_without_cuda(caplog) -> None:
    every = [word for flag in CPU_FLAGS for word in flag]
    caplog.set_level(logging.INFO, logger="megatron_odc.integration.megatron_lm.flags")
    assert with_cpu_flags(["--seed", "1"], cuda=False) == ["--seed", "1", *every]
    (record,) = caplog.records
    assert record.getMessage() == "no CUDA: added Megatron-LM's CPU flags " + " ".join(every)
    caplog.clear()
    user = [
        "--transformer-impl=transformer_engine",
        "--num-workers",
        "3",
        "--no-persist-layer-norm",
    ]
    got = with_cpu_flags(user, cuda=False)
    assert got[: len(user)] == user
    assert "local" not in got
    assert got.count("--num-workers") == 1
    assert got.count("--no-persist-layer-norm") == 1
    assert "--distributed-backend" in got
    assert "--use-cpu-initialization" in got
    caplog.clear()
    assert with_cpu_flags(["--seed", "1"], cuda=True) == ["--seed", "1"]  # nothing on GPU
    assert with_cpu_flags(every, cuda=False) == every
    assert not caplog.records  # nothing added, nothing logged


def test_docs_list_the_code_s_patch_points_and_count() -> None:
    from megatron_odc.mcore.cpu_optimizers import unfused_distopt_patches

    docs = (REPO_ROOT / "docs" / "megatron_lm.md").read_text()
    listed = re.findall(r"^- `(megatron\.training\.[\w.]+)`", docs, flags=re.MULTILINE)
    assert listed == [point.name for point in PATCH_POINTS]
    distopt = len(unfused_distopt_patches())
    for release in MEGATRON_LM_RELEASES:
        points, shims = len(release.patch_points), len(release.cpu_shims)
        counts = f"| {points} | {shims} | {points + shims + distopt} |"
        row = re.compile(rf"^\| `{release.tag}` \|.*{re.escape(counts)}$", re.MULTILINE)
        assert row.search(docs), (release.tag, counts)


# ----------------------------------------------------------------------------- with Megatron-LM


def _tree_patch(megatron_lm_path: Path) -> Path:
    return _patch_file(_generator().release_of_tree(megatron_lm_path))


def test_patch_equals_a_fresh_generation(megatron_lm_path) -> None:
    assert _generator().make_patch(megatron_lm_path) == _tree_patch(megatron_lm_path).read_text(), (
        "regenerate: python patches/make_megatron_lm_patch.py $MEGATRON_LM_PATH"
    )


def _patched_copy(megatron_lm_path: Path, dest: Path) -> Path:
    """A copy of the tree with the patch applied; ``megatron/core`` stays the installed wheel's (the
    CPU runtime skips compiling the tree's dataset helpers, and the wheel's are built)."""

    def ignore(folder: str, names: list[str]) -> list[str]:
        skip = {"__pycache__", "tests", "docs", "examples", "images"}
        if Path(folder).name == "megatron":
            skip.add("core")
        return [n for n in names if n in skip]

    shutil.copytree(megatron_lm_path, dest, ignore=ignore)
    patch = _tree_patch(megatron_lm_path)
    subprocess.run(["git", "apply", str(patch)], cwd=dest, check=True, timeout=60)
    return dest


@pytest.mark.timeout(600)
def test_patched_pretrain_gpt_equals_the_launcher(megatron_lm_path, tmp_path) -> None:
    """No CPU flags given: the launcher and the patched tree each add them (one list)."""
    fork = _patched_copy(megatron_lm_path, tmp_path / "megatron-lm")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    patched = pretrain_gpt_losses("odc", run_dir, args=MODEL_ARGS, script=fork / "pretrain_gpt.py")
    launcher = pretrain_gpt_losses("odc", run_dir, args=MODEL_ARGS)
    for it, loss in launcher.items():
        assert patched[it] == pytest.approx(loss, rel=1e-5), (it, patched, launcher)
    assert launcher[1] != launcher[6]  # training moved


@pytest.mark.timeout(600)
def test_patched_pretrain_gpt_sft_equals_the_launcher(megatron_lm_path, tmp_path) -> None:
    """``--sft`` through the patched tree, where no launcher adapts ``core_v0.16.1``'s
    ``SFTTokenizer`` to transformers 5: ``--sft``'s argument handling does."""
    fork = _patched_copy(megatron_lm_path, tmp_path / "megatron-lm")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = sft_args(tmp_path / "data")
    iterations = range(1, 5)
    patched = pretrain_gpt_losses(
        "odc", run_dir, args=args, script=fork / "pretrain_gpt.py", iterations=iterations
    )
    launcher = pretrain_gpt_losses("odc", run_dir, args=args, iterations=iterations)
    assert patched == launcher
    assert launcher[1] != launcher[4]  # training moved
