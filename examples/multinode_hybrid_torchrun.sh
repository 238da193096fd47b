#!/usr/bin/env bash
# Hybrid sharding across nodes: torchrun --nnodes, sharded inside each node, replicated across nodes
# Shows: torchrun --nnodes 2 --node-rank --rdzv-endpoint with --dp-backend odc: each node's ranks form a shard group (one-sided fetches and pushes inside it), each gradient shard is summed over the nodes once per minibatch; here both nodes run on this machine as 2 pretend hosts x 2 ranks, next to megatron-core DDP on the same samples: the same losses
# Needs: cpu
# Takes: about 50 s on 2 CPU cores (EXAMPLE_TINY=1: about 40 s)
set -euo pipefail
source "$(dirname "$0")/_common.sh"

# On a cluster, run this script on every node with NODE_RANK (0 .. NNODES-1) and MASTER_ADDR (node 0's
# address) set: it starts that node's torchrun, nothing else (NNODES default 2, NPROC_PER_NODE default 2;
# add GPU flags such as --bf16 to `flags`). Without NODE_RANK, both nodes run here: ranks 0-1 and 2-3 are
# declared two hosts with MEGATRON_ODC_LOCAL_WORLD_SIZE (a test-only override: real hosts are told apart
# by their host names), and megatron-core DDP trains on the same samples for comparison.
nnodes=${NNODES:-2}
nproc=${NPROC_PER_NODE:-2}
flags=(--log-interval 1 --train-iters 10)
if [[ "${EXAMPLE_TINY}" == 1 ]]; then
    flags=("${TINY_MODEL[@]}" --log-interval 1 --train-iters 4)
fi

# node RANK LOG FLAGS...: what each node runs (the README's multi-node command), output in LOG.
node() {
    local rank="$1" log="$2"
    shift 2
    torchrun --nnodes "${nnodes}" --nproc-per-node "${nproc}" --node-rank "${rank}" \
        --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT}" -m megatron_odc.train "$@" >"${log}" 2>&1
}

if [[ -n "${NODE_RANK:-}" ]]; then  # on a cluster: this node only
    : "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
    MASTER_PORT=${MASTER_PORT:-29500}
    node "${NODE_RANK}" "node${NODE_RANK}.log" "${flags[@]}" --dp-backend odc
    tail -n 1 "node${NODE_RANK}.log"
    exit 0
fi

# Here: both nodes as background processes, for ODC (hybrid) and then for DDP.
export MEGATRON_ODC_LOCAL_WORLD_SIZE="${nproc}" MASTER_ADDR=127.0.0.1
for backend in odc ddp; do
    MASTER_PORT=$(free_port)
    pids=()
    for ((rank = 1; rank < nnodes; rank++)); do
        node "${rank}" "${backend}_node${rank}.log" "${flags[@]}" --dp-backend "${backend}" &
        pids+=($!)
    done
    node 0 "${backend}.log" "${flags[@]}" --dp-backend "${backend}" \
        || { tail -n 40 "${backend}.log"; echo "node 0 failed: ${EXAMPLE_DIR}/${backend}.log"; exit 1; }
    for pid in "${pids[@]}"; do wait "${pid}"; done
done
grep -h "ODC: " odc.log  # what rank 0 logged: sharded over 2 ranks x 2 replicas (hybrid sharding)
same_losses "${flags[-1]}" odc.log ddp.log
