"""Test-session setup: gpu and slow markers, a check that no test leaves ODC shared memory behind, and a
session temporary directory for the launchers the tests start."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)


_CREATOR = re.compile(r"^megatron_odc-p(\d+)-")
"""The creator's pid in an shm transport's file name (``transport/shm.py``)."""


def _odc_shm_entries() -> set[str]:
    # The harness's private per-run directories (megatron_odc_test_*) are removed by the harness itself
    # and may belong to a concurrent test session; transports writing straight to /dev/shm must not leak.
    root = Path("/dev/shm")
    if not root.exists():
        return set()
    return {p.name for p in root.iterdir() if p.name.startswith("megatron_odc-")}


def _of_another_session(name: str) -> bool:
    """Whether ``name`` was made by a live process outside this session's process tree (a concurrent
    test run on the same machine); an entry whose creator is gone is this session's to account for."""
    import psutil

    match = _CREATOR.match(name)
    if match is None:
        return False
    try:
        creator = psutil.Process(int(match.group(1)))
        ancestors = {p.pid for p in creator.parents()}
    except psutil.Error:
        return False
    return os.getpid() != creator.pid and os.getpid() not in ancestors


@pytest.fixture(autouse=True)
def _no_shm_left_behind():
    before = _odc_shm_entries()
    yield
    left = {n for n in _odc_shm_entries() - before if not _of_another_session(n)}
    assert not left, f"test left shared-memory entries behind: {sorted(left)}"


@pytest.fixture(autouse=True, scope="session")
def _launchers_write_their_temporary_files_under_pytest(tmp_path_factory):
    """torchrun makes a ``torchelastic_*`` log directory in ``$TMPDIR`` per launch and never removes it
    (about 130 per suite run were left in /tmp): launched processes get a ``TMPDIR`` under pytest's
    base directory, which pytest rotates."""
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("launchers"))
    yield
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
