"""The torch.distributed environment of an ``mpiexec`` launch (any ``--odc-transport``).

torchrun hands every process ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``; ``mpiexec`` does not. :func:`apply_launch_env` fills them from MPI
(``COMM_WORLD``'s rank and size, the local rank among the ranks sharing this host's memory, and rank 0's
host name and a free port of rank 0, broadcast over MPI; a ``MASTER_ADDR`` / ``MASTER_PORT`` already set
wins), so that ``torch.distributed`` still rendezvous (gloo on CPU, NCCL on GPUs) for tensor parallelism
and the model's own collectives, with torch's ranks equal to MPI's, which the ``mpi`` transport checks.

Under ``mpiexec`` this happens whatever the transport, so ``--odc-transport auto`` also launches there (it
picks ``mpi`` for a shard group spanning hosts and the node's transport inside one host).
``--odc-transport mpi`` without an MPI launch (under torchrun, or a bare ``python``) is refused here,
before anything is trained, naming the flag and the launch line. The one place that reads the
launchers' variables; it imports mpi4py only under an MPI launcher. Once every rank has initialised
MPI it removes the name of MPICH's shared-memory segment, so that a rank that dies leaves nothing in
``/dev/shm`` ([Note: MPICH's named segment] in ``transport/mpich_segments.py``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping

from megatron_odc.transport.mpi import LAUNCH_HINT, import_mpi
from megatron_odc.transport.mpich_segments import unlink_mapped_mpich_segments

MPI_TRANSPORT = "mpi"
"""The ``--odc-transport`` value that needs an MPI launch."""

MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
"""Set by MPI launchers (MPICH's hydra, Open MPI, PMIx-based ones such as ``srun --mpi=pmix``)."""

TORCHRUN_VAR = "TORCHELASTIC_RUN_ID"
"""Set by torchrun in every process it starts."""

TORCH_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""What torch.distributed's ``env://`` rendezvous and the trainer read."""


LOCAL_RANK_VARS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_LOCAL_RANK")
"""This process's rank on its host, as torchrun, MPICH's hydra, Open MPI and PMIx launchers name it."""


def launch_local_rank(environ: Mapping[str, str]) -> int | None:
    """This process's rank on its host from the launcher's variables (``None``: no launcher says)."""
    for var in LOCAL_RANK_VARS:
        value = environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def launch_rank(environ: Mapping[str, str]) -> int:
    """This process's global rank from the launcher's variables (torchrun's ``RANK``, an MPI
    launcher's); 0 where no launcher says."""
    for var in ("RANK", *MPI_RANK_VARS):
        value = environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def launched(environ: Mapping[str, str]) -> bool:
    """Whether a launcher (torchrun, an MPI launcher or a script setting ``RANK``) started this process."""
    return "RANK" in environ or TORCHRUN_VAR in environ or launched_by_mpi(environ)


def launched_by_mpi(environ: Mapping[str, str]) -> bool:
    """Whether this process was started by an MPI launcher (and not by torchrun)."""
    return TORCHRUN_VAR not in environ and any(var in environ for var in MPI_RANK_VARS)


def check_mpi_launch(transport: str | None, environ: Mapping[str, str]) -> None:
    """Refuse ``--odc-transport mpi`` outside an MPI launch.

    Raises:
        ValueError: naming the flag and the launch line.
    """
    if transport != MPI_TRANSPORT or launched_by_mpi(environ):
        return
    how = "under torchrun" if TORCHRUN_VAR in environ else "without an MPI launcher"
    raise ValueError(
        f"--odc-transport mpi was started {how}, so there is no MPI job to join; {LAUNCH_HINT} "
        "(or pick another --odc-transport for torchrun)"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def mpi_torch_env(environ: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's launch variables for this MPI process (collective over ``COMM_WORLD``).

    Raises:
        ValueError: mpi4py is not installed.
    """
    mpi = import_mpi()
    world = mpi.COMM_WORLD
    host = world.Split_type(mpi.COMM_TYPE_SHARED)
    try:
        local_rank, local_size = host.Get_rank(), host.Get_size()
    finally:
        host.Free()
    master = None
    if world.Get_rank() == 0:
        master = (
            environ.get("MASTER_ADDR") or socket.gethostname(),
            environ.get("MASTER_PORT") or str(_free_port()),
        )
    master_addr, master_port = world.bcast(master, root=0)
    # Every rank has passed MPI_Init (Split_type needed them all): MPICH's segment is mapped everywhere.
    unlink_mapped_mpich_segments()
    return {
        "RANK": str(world.Get_rank()),
        "WORLD_SIZE": str(world.Get_size()),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
    }


def apply_launch_env(
    transport: str | None, environ: MutableMapping[str, str] | None = None
) -> None:
    """Check the launch for ``transport``; under an MPI launcher, set torch's launch variables from
    MPI's (any transport; for one other than ``mpi`` only where ``RANK`` is not set already). Under
    torchrun: nothing (torchrun set them).

    Raises:
        ValueError: ``mpi`` outside an MPI launch, or mpi4py missing under an MPI launcher; the
            message names the flag or the launcher.
    """
    environ = os.environ if environ is None else environ
    check_mpi_launch(transport, environ)
    if not launched_by_mpi(environ):
        return
    if transport != MPI_TRANSPORT and "RANK" in environ:
        return  # a launch script set torch's variables itself (e.g. from SLURM_PROCID): kept
    try:
        launch = mpi_torch_env(environ)
    except ValueError as exc:
        if transport == MPI_TRANSPORT:
            raise
        var = next(var for var in MPI_RANK_VARS if var in environ)
        raise ValueError(
            f"this process was started by an MPI launcher ({var} is set), whose ranks torch.distributed "
            "learns through mpi4py, which is missing: pip install mpi4py mpich, or launch with torchrun"
        ) from exc
    environ.update(launch)
