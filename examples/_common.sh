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
