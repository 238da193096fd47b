"""Write ``megatron_lm_<tag>_odc.patch`` from a Megatron-LM tree of a supported tag, with git.

    python patches/make_megatron_lm_patch.py /path/to/Megatron-LM [OUT]

The tag is the row of ``megatron_odc/integration/megatron_lm/releases.py`` of the tree's series (read
from its ``megatron/core/package_info.py``). Copies ``megatron/training`` into a temporary git
repository, commits it, adds one hook line at each of that row's patch points (after the ``def`` or the
``from ... import`` that binds the name) and
the ``cpu_runtime()`` call at the start of ``CPU_HOOK``'s function, and writes ``git diff``. The hooks are
those of ``megatron_odc/integration/megatron_lm/source_hooks.py``; the patch is derived from the same
list as the launcher, so regenerating it is how the two stay equal (the test compares the two).
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_odc.integration.megatron_lm.patching import PatchPoint, patch_points_of
from megatron_odc.integration.megatron_lm.releases import (
    MegatronLmRelease,
    checkout_version,
    release_for_series,
    supported_tags_text,
)
from megatron_odc.integration.megatron_lm.source_hooks import (
    CPU_HOOK,
    hook_import_line,
    patch_point_line,
)

CPU_HOOK_LINE = "cpu_runtime()"


def patch_name(release: MegatronLmRelease) -> str:
    """The file name of ``release``'s patch in ``patches/``."""
    return f"megatron_lm_{release.tag}_odc.patch"


def release_of_tree(megatron_lm: Path) -> MegatronLmRelease:
    """The row of the tree at ``megatron_lm``.

    Raises:
        ValueError: no version in the tree, or no supported tag of its series.
    """
    version = checkout_version(megatron_lm / "megatron" / "training")
    release = None
    if version is not None:
        major, minor = (int(part) for part in version.split(".")[:2])
        release = release_for_series((major, minor))
    if release is None:
        raise ValueError(
            f"{megatron_lm} is Megatron-LM {version or '(no megatron/core/package_info.py)'}; "
            f"patches are made for {supported_tags_text()}"
        )
    return release


def _module_file(module: str) -> str:
    return module.replace(".", "/") + ".py"


def _binding_end(tree: ast.Module, attr: str) -> int:
    """Line number (1-based) of the last line of the top-level statement that binds ``attr``."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == attr:
            return node.end_lineno
        if isinstance(node, ast.ImportFrom) and any(
            (alias.asname or alias.name) == attr for alias in node.names
        ):
            return node.end_lineno
    raise ValueError(f"no top-level def or import of {attr!r}")


def _torch_import(tree: ast.Module) -> int:
    for node in tree.body:
        if isinstance(node, ast.Import) and any(alias.name == "torch" for alias in node.names):
            return node.end_lineno
    raise ValueError("no top-level 'import torch'")


def _function_start(tree: ast.Module, name: str) -> tuple[int, str]:
    """Line number of the first statement after ``name``'s docstring, and its indentation."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            first = node.body[1] if ast.get_docstring(node) is not None else node.body[0]
            return first.lineno, " " * first.col_offset
    raise ValueError(f"no top-level def {name!r}")


def edit_tree(root: Path, points: tuple[PatchPoint, ...]) -> None:
    """Add the hook lines of ``points`` to the Megatron-LM files under ``root``."""
    modules = {point.module for point in points} | {CPU_HOOK[0]}
    for module in sorted(modules):
        path = root / _module_file(module)
        lines = path.read_text().splitlines(keepends=True)
        tree = ast.parse("".join(lines))
        inserts: list[tuple[int, str]] = []  # (insert after this many lines, text)
        for point in points:
            if point.module == module:
                inserts.append((_binding_end(tree, point.attr), patch_point_line(point.attr)))
        if module == CPU_HOOK[0]:
            lineno, indent = _function_start(tree, CPU_HOOK[1])
            inserts.append((lineno - 1, indent + CPU_HOOK_LINE))
        inserts.append((_torch_import(tree), hook_import_line(module)))
        # Bottom up, so earlier line numbers stay valid; at one line, in list order.
        order = sorted(range(len(inserts)), key=lambda i: (inserts[i][0], i), reverse=True)
        for after, text in (inserts[i] for i in order):
            lines.insert(after, text + "\n")
        path.write_text("".join(lines))


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=megatron-odc", "-c", "user.email=none", *args]
    return subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True).stdout


def make_patch(megatron_lm: Path) -> str:
    """The patch text for the Megatron-LM tree at ``megatron_lm`` (left unchanged)."""
    release = release_of_tree(megatron_lm)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        shutil.copytree(
            megatron_lm / "megatron" / "training",
            repo / "megatron" / "training",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        _git(repo, "init", "-q")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", f"Megatron-LM {release.tag}")
        edit_tree(repo, patch_points_of(release))
        return _git(repo, "diff", "--no-color", "--no-ext-diff")


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("megatron_lm", type=Path, help="a Megatron-LM tree of a supported tag")
    parser.add_argument("out", type=Path, nargs="?", help="default: patches/<its name>")
    args = parser.parse_args(argv)
    out = args.out or Path(__file__).parent / patch_name(release_of_tree(args.megatron_lm))
    out.write_text(make_patch(args.megatron_lm))
    sys.stdout.write(f"wrote {out}\n")


if __name__ == "__main__":
    main()
