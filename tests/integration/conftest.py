"""The ``megatron_lm_path`` fixture: the real Megatron-LM tree, or a skip that says what is missing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._megatron_lm import MEGATRON_LM_PATH_ENV, megatron_lm_skip_reason


@pytest.fixture
def megatron_lm_path() -> Path:
    """``$MEGATRON_LM_PATH``; skips the test when Megatron-LM or one of its dependencies is missing."""
    reason = megatron_lm_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return Path(os.environ[MEGATRON_LM_PATH_ENV])
