"""A refusal checked whole: one ``ValueError`` of one line, and nothing half-built left behind."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import pytest


def one_line_refusal(call: Callable[[], object], what: str, monkeypatch) -> str:
    """The message of the ``ValueError`` that ``call()`` raises; fails when it raises none, when the
    message spans lines, or when an object it half built complains once collected (megatron-core's
    datasets do, from ``__del__``). ``what`` names the input in the failure."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    try:
        call()
    except ValueError as exc:
        message = str(exc)
    else:
        pytest.fail(f"{what} accepted")
    gc.collect()  # the traceback is gone: a half-built megatron-core object would complain now
    assert not unraisable, [u.exc_value for u in unraisable]
    assert "\n" not in message, message
    return message
