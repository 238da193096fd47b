#!/usr/bin/env bash
# Quick start: ODC on 2 CPU ranks, then megatron-core DDP on the same samples
# Shows: the README's quick start; --dp-backend odc and ddp train the same model (same losses)
# Needs: cpu
# Takes: about 25 s on 2 CPU cores (EXAMPLE_TINY=1: about 20 s)
set -euo pipefail
source "$(dirname "$0")/_common.sh"

# The README's command (the built-in tiny GPT on a generated SFT set), logging every iteration.
flags=(--log-interval 1)
if [[ "${EXAMPLE_TINY}" == 1 ]]; then
    flags+=("${TINY_MODEL[@]}" --train-iters 4)
fi
train 2 odc.log "${flags[@]}"
# The same samples (the same plan: --balance lb_mini) through megatron-core's own DDP.
train 2 ddp.log "${flags[@]}" --dp-backend ddp

# Every iteration's global lm loss, side by side.
paste <(lm_losses odc.log) <(lm_losses ddp.log) | awk '
    BEGIN { print "iteration  odc lm loss   ddp lm loss"; max = 0 }
    $1 != $3 { print "the two runs logged different iterations"; exit 1 }
    { d = $2 - $4; d = d < 0 ? -d : d; if (d > max) max = d; printf "%9d  %s  %s\n", $1, $2, $4 }
    END { printf "quickstart: %d iterations, odc final lm loss %s, ddp final lm loss %s, max |difference| %.3g\n", NR, $2, $4, max }'
