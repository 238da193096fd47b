"""One layer per folder, imports pointing down only, no import circle, megatron only where it belongs.

Static checks over the source of every module of ``megatron_odc`` (``ast``: every ``import`` counts,
inside function bodies and ``TYPE_CHECKING`` blocks too), then one runtime check that the lower
layers import without megatron (and, for the pure planners, without torch). ``LAYERS`` is the one
written statement of the architecture (docs/architecture.md draws it); the checker's own tests build
small packages that break each rule, so a rule that stopped biting would fail here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "megatron_odc"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

LAYERS: dict[str, tuple[str, ...]] = {
    "transport": (),
    "core": ("transport",),
    "balance": (),
    "data": ("balance",),
    "tools": ("balance",),
    "mcore": ("core", "transport"),
    "runner": ("mcore", "core", "transport", "data", "balance"),
    "integration": ("runner", "mcore", "core", "transport", "data", "balance"),
}
"""Folder -> the folders its modules may import (besides its own). The package's root modules
(``__init__``, ``train``, ``launch``, ``simulate``) and every ``__main__`` are entry points: they may
import any layer, and nothing may import them."""

THIRD_PARTY: dict[str, tuple[str, ...]] = {
    "megatron.training": ("integration",),
    # Optional metrics sinks of the training entry (--tensorboard-dir, --wandb-project).
    "torch.utils.tensorboard": ("runner",),
    "tensorboard": ("runner",),
    "wandb": ("runner",),
    # A file format (numpy memory maps; no process group, no model): preprocessed SFT data in data/.
    "megatron.core.datasets.indexed_dataset": ("data", "mcore", "integration"),
    "megatron.core": ("mcore", "integration"),
    # Hugging Face models in and out (mcore/hf_bridge.py); data/tokenizer.py loads HF tokenizers.
    "mbridge": ("mcore",),
    "safetensors": ("mcore",),
    "transformers": ("mcore", "data"),
    "megatron": ("mcore", "integration"),
    # MPI-3 RMA: the mpi transport (imported lazily there; runner/launch_env.py goes through it).
    "mpi4py": ("transport",),
}
"""Third-party packages only some layers may import (the first matching prefix decides)."""

PURE_LAYERS = {"balance": ("megatron", "torch"), "tools": ("megatron", "torch")}
"""Layers whose import must not load these packages at all (checked by importing them)."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str, known: set[str]) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import statement in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(node.lineno, alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # ``from pkg import submodule`` imports the submodule
                candidate = f"{base}.{alias.name}"
                out.add((node.lineno, candidate if candidate in known else base))
    return sorted(out)


def _layer(relative: Path) -> str | None:
    """The folder a module (its path inside the package) belongs to; None for entry points."""
    if len(relative.parts) == 1 or relative.name == "__main__.py":
        return None
    return relative.parts[0]


def check_package(root: Path, layers: dict[str, tuple[str, ...]] = LAYERS) -> list[str]:
    """Every violation of the layering rules in the package at ``root``, one line each."""
    paths = sorted(root.rglob("*.py"))
    modules = {_module_name(p, root): p for p in paths}
    layer_of = {m: _layer(p.relative_to(root)) for m, p in modules.items()}
    package = root.name
    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        layer = layer_of[module]
        where = f"{path.relative_to(root.parent)}"
        if layer is not None and layer not in layers:
            problems.append(f"{where}: folder {layer!r} is not a layer (add it to LAYERS)")
            continue
        for line, target in _imports(path, module, set(modules)):
            if target == package or target.startswith(package + "."):
                if target not in modules:
                    continue
                graph[module].add(target)
                # Importing a.b.c runs a/b/__init__ first: an edge to every package above the
                # target that is not already above the importer (those ran before it).
                parts = target.split(".")
                for depth in range(2, len(parts)):
                    ancestor = ".".join(parts[:depth])
                    if ancestor in modules and not module.startswith(ancestor + "."):
                        graph[module].add(ancestor)
                target_layer = layer_of[target]
                if target_layer is None:
                    problems.append(
                        f"{where}:{line}: imports the entry point {target} (entry points import "
                        "layers, never the other way round)"
                    )
                elif layer not in (None, target_layer) and target_layer not in layers[layer]:
                    problems.append(
                        f"{where}:{line}: {layer}/ imports {target_layer}/ ({target}); "
                        f"{layer}/ may import {', '.join(layers[layer]) or 'no other layer'}"
                    )
                continue
            for prefix, allowed in THIRD_PARTY.items():
                if target == prefix or target.startswith(prefix + "."):
                    if layer is not None and layer not in allowed:
                        problems.append(
                            f"{where}:{line}: {layer}/ imports {target}; only "
                            f"{', '.join(a + '/' for a in allowed)} may"
                        )
                    break
    problems += [f"import circle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles = []
    for component in components:
        members = set(component)
        start = min(component)
        path, seen, node = [start], {start}, start
        while True:  # walk inside the component until a module repeats
            node = min(n for n in graph[node] if n in members)
            path.append(node)
            if node in seen:
                break
            seen.add(node)
        cycles.append(path[path.index(node) :])
    return cycles


def test_package_follows_the_layers() -> None:
    problems = check_package(PACKAGE_DIR)
    assert not problems, "\n".join(problems)


def test_every_folder_is_a_layer() -> None:
    folders = {p.parent.name for p in PACKAGE_DIR.glob("*/__init__.py")}
    assert folders == set(LAYERS)


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_checker_catches_an_upward_import_inside_a_function(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/engine.py": "def f():\n    from pkg.mcore.adapter import g\n",
            "mcore/__init__.py": "",
            "mcore/adapter.py": "from pkg.core import engine\n",
        },
    )
    problems = check_package(pkg, {"core": (), "mcore": ("core",)})
    assert any("core/engine.py:2: core/ imports mcore/" in p for p in problems), problems
    assert any(p.startswith("import circle") for p in problems), problems


def test_checker_catches_a_circle_within_a_layer_and_megatron_below_mcore(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "train.py": "from pkg.core import a\n",
            "core/__init__.py": "",
            "core/a.py": "from pkg.core.b import x\nimport megatron.core\n",
            "core/b.py": "def x():\n    from . import a\n",
        },
    )
    problems = check_package(pkg, {"core": ()})
    assert "import circle: pkg.core.a -> pkg.core.b -> pkg.core.a" in problems, problems
    assert any("core/a.py:2: core/ imports megatron.core" in p for p in problems), problems
    assert not any("train.py" in p for p in problems), problems


def test_checker_refuses_imports_of_entry_points(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "train.py": "",
            "core/__init__.py": "",
            "core/a.py": "import pkg.train\n",
        },
    )
    problems = check_package(pkg, {"core": ()})
    assert any("imports the entry point pkg.train" in p for p in problems), problems


@pytest.mark.parametrize("layer", sorted(set(LAYERS) - {"mcore", "runner", "integration"}))
def test_lower_layer_imports_without_megatron(layer: str) -> None:
    blocked = PURE_LAYERS.get(layer, ("megatron",))
    modules = sorted(
        _module_name(p, PACKAGE_DIR)
        for p in (PACKAGE_DIR / layer).rglob("*.py")
        if p.name != "__main__.py"
    )
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
        + "".join(f"import {m}\n" for m in modules)
        + f"loaded = [m for m in sys.modules if sys.modules[m] is not None and m.split('.')[0] in {blocked!r}]\n"
        + "assert not loaded, loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{layer}/ needs {blocked}:\n{result.stderr[-3000:]}"
