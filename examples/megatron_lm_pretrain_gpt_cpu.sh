#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py with --dp-backend odc on 2 CPU ranks, next to Megatron-LM's DDP
# Shows: python -m megatron_odc.launch running Megatron-LM core_v0.16.1's pretrain_gpt.py on mock data, once with ODC and once with Megatron-LM's own DDP: the same losses
# Needs: cpu megatron-lm
# Takes: about 75 s on 2 CPU cores (EXAMPLE_TINY=1: about 50 s)
set -euo pipefail

# MEGATRON_LM_PATH: a Megatron-LM core_v0.16.1 tree, with `pip install -e .[megatron-lm]` done here.
# EXAMPLE_DIR: where the two runs' logs go (default: a new temporary folder).
# EXAMPLE_TINY=1: 3 iterations instead of 8.
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 tree (git clone --branch core_v0.16.1 --depth 1 https://github.com/NVIDIA/Megatron-LM)}"
export MEGATRON_LM_PATH
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
out=${EXAMPLE_DIR:-$(mktemp -d)}
mkdir -p "$out"
iters=8
if [[ "${EXAMPLE_TINY:-0}" == 1 ]]; then iters=3; fi

# No CPU flags here: without CUDA the launcher adds Megatron-LM's CPU flags itself and logs them.
run() {
  local backend=$1
  (cd "$out" && torchrun --standalone --nproc-per-node 2 -m megatron_odc.launch pretrain_gpt.py \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
    --max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 4 --train-iters "$iters" \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.01 \
    --clip-grad 1.0 --seed 1234 --hidden-dropout 0 --attention-dropout 0 \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --split 99,1,0 \
    --eval-iters 1 --eval-interval 1000 --log-interval 1 --dp-backend "$backend") \
    >"$out/$backend.log" 2>&1 || { tail -n 40 "$out/$backend.log"; echo "$backend run failed: $out/$backend.log"; exit 1; }
}
losses() {
  sed -nE 's/.*iteration +([0-9]+)\/.*\| lm loss: ([0-9.E+-]+) .*/\1 \2/p' "$out/$1.log"
}

run odc
run ddp
echo "logs: $out/odc.log $out/ddp.log"
paste -d ' ' <(losses odc) <(losses ddp) | awk -v n="$iters" '
  { printf "iteration %s: odc lm loss %s | ddp lm loss %s\n", $1, $2, $4
    d = $2 - $4; if (d < 0) d = -d; if (d > 1e-5 * $4) bad = 1; rows++ }
  END { if (rows != n || bad) { print "the losses differ"; exit 1 }
        print "odc and ddp printed the same losses (to 1e-5)" }'
