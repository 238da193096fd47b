"""Imports point down only: the lower layers import no megatron module."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

LOWER_LAYERS = [
    "megatron_odc.layout",
    "megatron_odc.transport",
    "megatron_odc.transport.base",
    "megatron_odc.transport.shm",
    "megatron_odc.transport.collective",
    "megatron_odc.engine",
    "megatron_odc.telemetry",
    "megatron_odc.balance",
    "megatron_odc.balance.plan",
    "megatron_odc.data",
    "megatron_odc.simulate",
]


@pytest.mark.parametrize("module", LOWER_LAYERS)
def test_lower_layer_imports_without_megatron(module: str) -> None:
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip("package not installed")
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        pytest.skip(f"{module} does not exist yet")
    code = (
        "import sys\n"
        "sys.modules['megatron'] = None\n"
        "sys.modules['megatron.core'] = None\n"
        f"import {module}\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{module} imports megatron:\n{result.stderr}"
