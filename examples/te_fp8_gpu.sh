#!/usr/bin/env bash
# FP8 training with TransformerEngine layers on the GPUs of one node
# Shows: --transformer-impl transformer_engine --fp8-format hybrid under ODC (amax reduced over TP only)
# Needs: gpu te
# Takes: about 60 s on 8 GPUs (EXAMPLE_TINY=1: about 30 s)
set -euo pipefail
# Not run here (no GPU, no TransformerEngine): tests/test_examples.py checks its syntax and that every
# flag below is one python -m megatron_odc.train knows. The times above are estimates.
source "$(dirname "$0")/_common.sh"

# The GPUs this node shows torch (one rank per GPU); TP=2 when there are 4 or more.
nproc="${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count())')}"
tp=1
if ((nproc >= 4)); then tp=2; fi
# FP8 GEMMs want dimensions divisible by 16; bf16 outside them.
flags=(--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048
    --global-batch-size 64 --train-iters 50 --log-interval 10)
if [[ "${EXAMPLE_TINY}" == 1 ]]; then
    flags=(--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 256
        --global-batch-size 16 --synthetic-num-samples 128 --train-iters 6 --log-interval 2)
fi
train "${nproc}" fp8.log "${flags[@]}" --dp-backend odc --tensor-model-parallel-size "${tp}" \
    --bf16 --transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe delayed

echo "te_fp8: ${nproc} GPUs, TP=${tp}, first lm loss $(first_loss fp8.log)," \
    "final lm loss $(final_loss fp8.log)"
