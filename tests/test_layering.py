"""Imports point down only: the lower layers import no megatron module."""

from __future__ import annotations

import subprocess
import sys

import pytest

LOWER_LAYERS = [
    "megatron_odc.layout",
    "megatron_odc.devices",
    "megatron_odc.fp8",
    "megatron_odc.transport",
    "megatron_odc.transport.base",
    "megatron_odc.transport.shm",
    "megatron_odc.transport.collective",
    "megatron_odc.transport.cuda",
    "megatron_odc.transport.streams",
    "megatron_odc.engine",
    "megatron_odc.hooks",
    "megatron_odc.telemetry",
    "megatron_odc.balance",
    "megatron_odc.balance.plan",
    "megatron_odc.data",
    "megatron_odc.simulate",
    "megatron_odc.patches",
]


@pytest.mark.parametrize("module", LOWER_LAYERS)
def test_lower_layer_imports_without_megatron(module: str) -> None:
    code = (
        "import sys\n"
        "sys.modules['megatron'] = None\n"
        "sys.modules['megatron.core'] = None\n"
        f"import {module}\n"
        "assert not any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules"
        " if sys.modules[m] is not None)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{module} imports megatron:\n{result.stderr}"
