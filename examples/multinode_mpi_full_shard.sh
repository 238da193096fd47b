#!/usr/bin/env bash
# Full sharding across hosts over MPI: mpiexec -hosts with --odc-transport mpi
# Shows: mpiexec -n N -hosts H1,H2 python -m megatron_odc.train --odc-transport mpi: every parameter, gradient and optimizer state sharded over all N ranks, one-sided MPI-3 RMA gets and accumulates between any two of them (rank, world and rendezvous taken from MPI); here N=2 on localhost, next to megatron-core DDP under torchrun on the same samples: the same losses
# Needs: cpu mpi
# Takes: about 35 s on 2 CPU cores (EXAMPLE_TINY=1: about 30 s)
set -euo pipefail
source "$(dirname "$0")/_common.sh"

# HOSTS: the hosts, comma-separated (default localhost); NP: the ranks, spread over HOSTS by mpiexec
# (default 2). On a cluster the clone, its venv and EXAMPLE_DIR must have the same path on every host,
# and mpiexec must reach them (ssh); add GPU flags such as --bf16 to `flags`. mpi4py and mpiexec come
# with requirements.txt (the MPICH wheel puts mpiexec in the venv's bin).
hosts=${HOSTS:-localhost}
np=${NP:-2}
flags=(--log-interval 1 --train-iters 10)
if [[ "${EXAMPLE_TINY}" == 1 ]]; then
    flags=("${TINY_MODEL[@]}" --log-interval 1 --train-iters 4)
fi

mpiexec -n "${np}" -hosts "${hosts}" python -m megatron_odc.train "${flags[@]}" --dp-backend odc \
    --odc-transport mpi >odc.log 2>&1 \
    || { tail -n 40 odc.log; echo "the mpiexec run failed: ${EXAMPLE_DIR}/odc.log"; exit 1; }
grep -h "ODC: " odc.log  # what rank 0 logged: --odc-transport mpi, sharded over NP ranks
if [[ "${hosts}" == localhost ]]; then  # the reference: megatron-core DDP on this machine
    train "${np}" ddp.log "${flags[@]}" --dp-backend ddp >/dev/null
    same_losses "${flags[-1]}" odc.log ddp.log
else
    tail -n 1 odc.log
fi
