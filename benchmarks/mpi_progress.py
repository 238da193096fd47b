"""Does MPI passive-target RMA progress while the target computes? (the mpi transport's [Note: MPI progress])

Run with 2 ranks: ``mpiexec -n 2 python benchmarks/mpi_progress.py``. Rank 0 spins in pure Python (no MPI
call) for ``BUSY_S`` seconds; meanwhile rank 1 does one ``MPI_Get`` and one ``MPI_Accumulate(SUM)`` of 4 MiB
from / into rank 0's window (``Lock_all`` epoch, each completed by ``Win.Flush``) and prints how long each
took. A time near ``BUSY_S`` means the operation waited for the target's next MPI call. Compare:

- ``mpiexec -n 2 ...``: MPICH's shared-memory path (ranks of one host);
- ``MPIR_CVAR_NOLOCAL=1 mpiexec -n 2 ...``: MPICH's network module, as between hosts;
- either with ``MPIR_CVAR_ASYNC_PROGRESS=1``: MPICH's progress thread.
"""

from __future__ import annotations

import os
import time

import numpy as np
from mpi4py import MPI

BUSY_S = 3.0
NUMEL = 1 << 20


def main() -> None:
    comm = MPI.COMM_WORLD
    assert comm.Get_size() == 2, "run with mpiexec -n 2"
    win = MPI.Win.Allocate(NUMEL * 4, 4, comm=comm)
    np.frombuffer(win.tomemory(), dtype=np.float32)[:] = comm.Get_rank()
    win.Lock_all()
    comm.Barrier()
    if comm.Get_rank() == 0:
        start = time.monotonic()
        while time.monotonic() - start < BUSY_S:
            pass
    else:
        time.sleep(0.2)  # rank 0 is busy by now
        out = np.empty(NUMEL, np.float32)
        start = time.monotonic()
        win.Get(out, 0)
        win.Flush(0)
        get_s = time.monotonic() - start
        ones = np.ones(NUMEL, np.float32)  # must outlive the Flush: the netmod reads it late
        start = time.monotonic()
        win.Accumulate(ones, 0, op=MPI.SUM)
        win.Flush(0)
        accumulate_s = time.monotonic() - start
        cvars = {k: v for k, v in os.environ.items() if k.startswith("MPIR_CVAR_")}
        print(
            f"{cvars or 'default'}: get {get_s:.3f} s, accumulate {accumulate_s:.3f} s "
            f"(target busy {BUSY_S:g} s)",
            flush=True,
        )
    comm.Barrier()
    win.Unlock_all()
    win.Free()


if __name__ == "__main__":
    main()
