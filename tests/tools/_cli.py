"""The refusal of a tools command line, shared by the CLI tests of ``tools/``."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def cli_error(capsys, main: Callable[[list[str]], object], argv: list[str]) -> str:
    """The one ``error:`` line of a refused command line (exit code 2, no traceback)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]
