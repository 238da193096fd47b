#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py with --dp-backend odc on 2 CPU ranks, next to Megatron-LM's DDP
# Shows: python -m megatron_odc.launch running Megatron-LM core_v0.16.1's pretrain_gpt.py on mock data, once with ODC and once with Megatron-LM's own DDP: the same losses
# Needs: cpu megatron-lm
# Takes: about 75 s on 2 CPU cores (EXAMPLE_TINY=1: about 50 s)
set -euo pipefail
source "$(dirname "$0")/_common.sh"

# MEGATRON_LM_PATH: a Megatron-LM core_v0.16.1 tree, with `pip install -e .[megatron-lm]` done here.
# EXAMPLE_TINY=1: 3 iterations instead of 8.
iters=8
if [[ "${EXAMPLE_TINY}" == 1 ]]; then iters=3; fi

# No CPU flags here: without CUDA the launcher adds Megatron-LM's CPU flags itself and logs them.
for backend in odc ddp; do
    pretrain_gpt 2 "${backend}.log" --global-batch-size 4 --train-iters "${iters}" \
        --dp-backend "${backend}"
done
echo "logs: ${EXAMPLE_DIR}/odc.log ${EXAMPLE_DIR}/ddp.log"
same_losses "${iters}" odc.log ddp.log
