"""Every ``megatron_odc.train`` command in the README and docs/ passes the entry's flag checks as written.

The commands are read from the fenced shell blocks of ``README.md``, ``docs/*.md`` and
``examples/README.md`` (continuation lines joined; ``&&``, ``;`` and ``|`` end a command), with the
world size the launcher gives (``--nproc-per-node`` x ``--nnodes``, ``mpiexec -n``), and run through
``build_parser`` and ``validate_args``, which check flags against each other without a GPU or a process
group. The files a command names are made first, in a scratch directory: a tiny Hugging Face Llama for
``--load-hf``, a JSONL file or a preprocessed prefix for ``--data-path``; absolute paths move under the
scratch directory. A recipe the parser rejects (as the SFT recipe's ``--lr 1e-5`` did while ``--min-lr``
defaulted to 3e-4) fails here naming the file and line.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "examples" / "README.md"]
ENTRY = "megatron_odc.train"
SHELL_FENCE = re.compile(r"^```(bash|sh|shell|console)?\s*$")
SEPARATORS = {"&&", ";", "|", "||"}
PATH_FLAGS = ("--data-path", "--load-hf", "--load", "--save", "--save-hf", "--tensorboard-dir")
MPI_ENV = {"PMI_RANK": "0", "PMI_SIZE": "1"}


def _shell_lines(path: Path):
    """(line number, command line) for each command in ``path``'s shell blocks."""
    in_block, pending, start = False, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_block = not in_block and bool(SHELL_FENCE.match(line))
            continue
        if not in_block:
            continue
        if not pending:
            start = number
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def _launch(tokens: list[str]) -> tuple[int, bool]:
    """The world size and whether MPI launches, from the tokens before ``-m megatron_odc.train``."""

    def value(*flags: str, default: int = 1) -> int:
        for flag in flags:
            if flag in tokens:
                return int(tokens[tokens.index(flag) + 1])
        return default

    if "mpiexec" in tokens or "mpirun" in tokens:
        return value("-n", "-np"), True
    return value("--nproc-per-node", "--nproc_per_node") * value("--nnodes"), False


def documented_commands() -> list[tuple[str, list[str], int, bool]]:
    """(where, argv, world size, under MPI) for each entry command in the docs."""
    found = []
    for path in DOCS:
        for number, line in _shell_lines(path):
            if ENTRY not in line:
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            segment: list[str] = []
            for token in [*lexer, ";"]:
                if token not in SEPARATORS:
                    segment.append(token)
                    continue
                if ENTRY in segment and segment[segment.index(ENTRY) - 1] == "-m":
                    cut = segment.index(ENTRY)
                    world, mpi = _launch(segment[:cut])
                    where = f"{path.relative_to(REPO)}:{number}"
                    found.append((where, segment[cut + 1 :], world, mpi))
                segment = []
    return found


COMMANDS = documented_commands()


def test_the_docs_hold_the_main_recipes():
    """The reader finds the recipes where the README promises them (the scan itself can fail)."""
    readme = [c for c in COMMANDS if c[0].startswith("README.md")]
    assert len(readme) >= 8, readme
    assert any("--load-hf" in argv for _, argv, _, _ in readme)
    assert any(mpi for _, _, _, mpi in readme)
    assert any(world == 16 for _, _, world, _ in readme)


def _materialise(argv: list[str], workdir: Path) -> list[str]:
    """``argv`` with absolute paths moved under ``workdir`` and the inputs it names created."""
    out = list(argv)
    for i, token in enumerate(out[:-1]):
        if token in PATH_FLAGS and os.path.isabs(out[i + 1]):
            out[i + 1] = str(workdir / out[i + 1].lstrip("/"))
    for i, token in enumerate(out[:-1]):
        target = Path(out[i + 1]) if os.path.isabs(out[i + 1]) else workdir / out[i + 1]
        if token == "--load-hf" and not target.exists():
            from tests.mcore._hf_models import write_tiny_model

            target.parent.mkdir(parents=True, exist_ok=True)
            write_tiny_model(target, "llama")
        elif token == "--data-path" and not target.exists():
            from tests.mcore._hf_models import write_sft_jsonl

            target.parent.mkdir(parents=True, exist_ok=True)
            if target.suffix == ".jsonl":
                write_sft_jsonl(target, 4)
            else:
                from megatron_odc.data.preprocess import preprocess

                source = write_sft_jsonl(workdir / "source.jsonl", 4)
                preprocess(str(source), str(target), workers=0, progress=False)
    return out


@pytest.mark.parametrize(("where", "argv", "world", "mpi"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_documented_command_passes_the_flag_checks(
    where, argv, world, mpi, tmp_path, monkeypatch
):
    from megatron_odc.runner.arguments import build_parser, validate_args

    monkeypatch.chdir(tmp_path)
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var, value in (MPI_ENV if mpi else {}).items():
        monkeypatch.setenv(var, value)
    argv = _materialise(argv, tmp_path)
    try:
        validate_args(build_parser().parse_args(argv), world_size=world)
    except SystemExit as exc:  # argparse: an unknown flag or choice (its message is on stderr)
        pytest.fail(f"{where}: the entry's parser rejects {shlex.join(argv)} (exit {exc.code})")
    except ValueError as exc:
        pytest.fail(f"{where}: {shlex.join(argv)} is refused: {exc}")
