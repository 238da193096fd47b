# Sourced by the examples (not an example itself): where outputs go, how big a run is, how to read a log.
#   EXAMPLE_DIR   outputs (logs, checkpoints, data, event files); default ./example_out
#   EXAMPLE_TINY  1: a tiny model and a few iterations (what tests/test_examples.py runs)
# The examples run from a clone without installing it: the clone goes first on PYTHONPATH.

EXAMPLE_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${EXAMPLE_REPO}${PYTHONPATH:+:${PYTHONPATH}}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
EXAMPLE_TINY="${EXAMPLE_TINY:-0}"
mkdir -p "${EXAMPLE_DIR:-./example_out}"
EXAMPLE_DIR="$(cd "${EXAMPLE_DIR:-./example_out}" && pwd)"
cd "${EXAMPLE_DIR}"  # the generated data set goes under the working directory

# The tiny model of EXAMPLE_TINY=1 (flags of python -m megatron_odc.train).
TINY_MODEL=(--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 64
    --global-batch-size 8 --synthetic-num-samples 64)

# train NPROC LOG FLAGS...: python -m megatron_odc.train on NPROC local ranks (a free port), its
# output shown and kept in LOG.
train() {
    local nproc="$1" log="$2"
    shift 2
    torchrun --standalone --nproc-per-node "${nproc}" -m megatron_odc.train "$@" 2>&1 | tee "${log}"
}

# lm_losses LOG: "ITERATION LOSS" per log line of LOG.
lm_losses() {
    sed -n 's/.*iteration *\([0-9]*\)\/.*| lm loss: \([^ ]*\) |.*/\1 \2/p' "$1"
}

# first_loss LOG / final_loss LOG: the training summary's first and final lm loss.
first_loss() { sed -n 's/.*training finished .*first lm loss: \([^ ]*\) |.*/\1/p' "$1"; }
final_loss() { sed -n 's/.*training finished .*final lm loss: \([^ ]*\) |.*/\1/p' "$1"; }

# same_losses ITERS A.log B.log [TOLERANCE]: both logs' lm losses side by side, one line per iteration,
# then "A and B printed the same losses (to TOLERANCE)"; fails unless both logged ITERS iterations and
# every pair agrees to TOLERANCE (relative; default 1e-5). A and B: the logs' names without ".log".
same_losses() {
    local iters="$1" a="$2" b="$3" tol="${4:-1e-5}"
    paste -d ' ' <(lm_losses "${a}") <(lm_losses "${b}") | awk -v n="${iters}" -v tol="${tol}" \
        -v a="${a%.log}" -v b="${b%.log}" '
        { printf "iteration %s: %s lm loss %s | %s lm loss %s\n", $1, a, $2, b, $4
          d = $2 - $4; if (d < 0) d = -d; if ($1 != $3 || d > tol * $4) bad = 1; rows++ }
        END { if (rows != n || bad) { print "the losses differ"; exit 1 }
              printf "%s and %s printed the same losses (to %s)\n", a, b, tol }'
}

# free_port: a free TCP port of this machine (the rendezvous port of a launch).
free_port() {
    python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

# Megatron-LM's pretrain_gpt.py: a tiny GPT on mock data, dropout off, logging every iteration.
MEGATRON_LM_GPT=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
    --max-position-embeddings 64 --micro-batch-size 1 --lr 1e-3 --min-lr 1e-4
    --lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.01 --clip-grad 1.0 --seed 1234
    --hidden-dropout 0 --attention-dropout 0 --mock-data --tokenizer-type NullTokenizer
    --vocab-size 1024 --split 99,1,0 --eval-iters 1 --eval-interval 1000 --log-interval 1)

# pretrain_gpt NPROC LOG FLAGS...: Megatron-LM's pretrain_gpt.py ($MEGATRON_LM_PATH) through
# python -m megatron_odc.launch on NPROC local ranks with MEGATRON_LM_GPT and FLAGS; its output goes to
# LOG (the last 40 lines are shown if it fails).
pretrain_gpt() {
    local nproc="$1" log="$2"
    shift 2
    : "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 tree (git clone --branch core_v0.16.1 --depth 1 https://github.com/NVIDIA/Megatron-LM)}"
    export MEGATRON_LM_PATH CUDA_DEVICE_MAX_CONNECTIONS=1
    torchrun --standalone --nproc-per-node "${nproc}" -m megatron_odc.launch pretrain_gpt.py \
        "${MEGATRON_LM_GPT[@]}" "$@" >"${log}" 2>&1 \
        || { tail -n 40 "${log}"; echo "run failed: ${EXAMPLE_DIR}/${log}"; return 1; }
}
