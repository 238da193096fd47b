#!/usr/bin/env bash
# Watch an ODC run in TensorBoard
# Shows: --tensorboard-dir: Megatron's scalars (lm loss, learning-rate, grad-norm, ...) and ODC's (odc/...)
# Needs: cpu
# Takes: about 15 s on 2 CPU cores (EXAMPLE_TINY=1: about 12 s)
set -euo pipefail
source "$(dirname "$0")/_common.sh"

flags=(--train-iters 40 --log-interval 5)
if [[ "${EXAMPLE_TINY}" == 1 ]]; then
    flags=("${TINY_MODEL[@]}" --train-iters 4 --log-interval 2)
fi
rm -rf tensorboard  # one run's event file
train 2 train.log "${flags[@]}" --tensorboard-dir tensorboard

# Read the event file back, as TensorBoard does.
python - tensorboard <<'PY'
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

events = EventAccumulator(sys.argv[1])
events.Reload()
tags = events.Tags()["scalars"]
print(f"{len(tags)} scalar tags: {', '.join(tags)}")
loss = events.Scalars("lm loss")
imbalance = events.Scalars("odc/compute-imbalance")
print(
    f"tensorboard: lm loss at {len(loss)} iterations, first {loss[0].value:.6E} at iteration "
    f"{loss[0].step}, last {loss[-1].value:.6E} at iteration {loss[-1].step}; "
    f"odc/compute-imbalance last {imbalance[-1].value:.2f}"
)
PY
echo "text log: first lm loss $(first_loss train.log), final lm loss $(final_loss train.log)"
echo "to watch it: tensorboard --logdir ${EXAMPLE_DIR}/tensorboard  (then open http://localhost:6006)"
