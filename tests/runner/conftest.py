"""Fixtures of the runner tests."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest


@pytest.fixture
def shm_dir():
    """A private shared-memory directory for one torchrun job (``MEGATRON_ODC_SHM_DIR``), removed after."""
    path = Path("/dev/shm") / f"megatron_odc_test_train_{uuid.uuid4().hex[:12]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
