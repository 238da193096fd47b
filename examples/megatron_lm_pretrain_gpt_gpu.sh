#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py with --dp-backend odc on the GPUs of one node, next to Megatron-LM's DDP
# Shows: python -m megatron_odc.launch running Megatron-LM core_v0.16.1's pretrain_gpt.py on mock data over every local GPU (one DP rank each, CUDA transport), once with ODC and once with Megatron-LM's own DDP: the same losses
# Needs: gpu megatron-lm
# Takes: about 60 s on 2 GPUs, not measured here: no GPU (EXAMPLE_TINY=1: about 45 s)
set -euo pipefail
source "$(dirname "$0")/_common.sh"

# MEGATRON_LM_PATH: a Megatron-LM core_v0.16.1 tree, with `pip install -e .[megatron-lm]` done here.
# EXAMPLE_TINY=1: 3 iterations instead of 8. NPROC: GPUs to use (default: all of this node's).
iters=8
if [[ "${EXAMPLE_TINY}" == 1 ]]; then iters=3; fi
nproc=${NPROC:-$(nvidia-smi -L | wc -l)}

# Megatron-LM's defaults on GPUs (nccl, fused kernels); --transformer-impl local keeps TransformerEngine
# optional (drop it to run TE layers when TE is installed).
for backend in odc ddp; do
    pretrain_gpt "${nproc}" "${backend}.log" --global-batch-size $((2 * nproc)) \
        --train-iters "${iters}" --transformer-impl local --dp-backend "${backend}"
done
echo "logs: ${EXAMPLE_DIR}/odc.log ${EXAMPLE_DIR}/ddp.log"
# GPU kernels reduce in other orders than the CPU's: equal to 1e-4 here.
same_losses "${iters}" odc.log ddp.log 1e-4
