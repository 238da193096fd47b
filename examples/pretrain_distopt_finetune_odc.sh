#!/usr/bin/env bash
# Pretrain with Megatron's distributed optimizer, finetune with ODC at another TP x DP
# Shows: a torch_dist checkpoint saved by distopt (TP=1 x DP=2) loaded by ODC (TP=2 x DP=2, --finetune)
# Needs: cpu
# Takes: about 60 s on 2 CPU cores (EXAMPLE_TINY=1: about 45 s)
set -euo pipefail
source "$(dirname "$0")/_common.sh"

pretrain=(--train-iters 20)
finetune=(--train-iters 10 --save ckpt/finetune)
if [[ "${EXAMPLE_TINY}" == 1 ]]; then  # a tiny model learning fast; no second save (~10 s)
    pretrain=("${TINY_MODEL[@]}" --train-iters 8 --lr-warmup-iters 1 --lr 1e-2)
    finetune=("${TINY_MODEL[@]}" --train-iters 2)
fi
rm -rf ckpt  # --save into a fresh directory: the finetune must load this run's weights
# 1. "pretrain": megatron-core DDP + distributed optimizer, TP=1 x DP=2, save a torch_dist checkpoint.
train 2 pretrain.log --dp-backend distopt "${pretrain[@]}" --save ckpt/pretrain
# 2. finetune: ODC with TP=2 x DP=2 (4 ranks) from those weights (--finetune: weights only, iteration 0).
train 4 finetune.log --dp-backend odc --tensor-model-parallel-size 2 "${finetune[@]}" \
    --load ckpt/pretrain --finetune --lr 1e-3

echo "pretrain_finetune: pretrain first lm loss $(first_loss pretrain.log)," \
    "pretrain last lm loss $(final_loss pretrain.log)," \
    "finetune first lm loss $(first_loss finetune.log)," \
    "finetune last lm loss $(final_loss finetune.log)"
