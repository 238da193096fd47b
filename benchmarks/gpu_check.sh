#!/usr/bin/env bash
# The GPU check in one call on a lent GPU machine (see docs/benchmarks.md, "GPU check").
#
# The GPU image has PyTorch and Triton but not megatron-core; carry its wheel in .whl/ (fetched on a
# machine with PyPI access, never committed) and this installs it under /tmp/site, offline, before running
# benchmarks/gpu_check.py. Results: the table on stdout, every number in $OUT/gpu_check.json (or
# ./gpu_check.json when OUT is unset).
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' || true
exec python3 benchmarks/gpu_check.py --json "${OUT:-.}/gpu_check.json" "$@"
