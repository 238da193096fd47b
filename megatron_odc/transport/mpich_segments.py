"""MPICH's named shared-memory segment: its name removed once every rank of the host has mapped it.

[Note: MPICH's named segment]
MPICH (5.0, the ``mpich`` wheel of requirements.txt) creates one POSIX shared-memory segment per host in
``MPI_Init`` (``/dev/shm/mpich_shm_<id>_<n>``, about 2 MiB) and removes its name only in
``MPI_Finalize``; window memory and UCX's segments are unlinked as soon as they are mapped. A rank that
dies without ``MPI_Finalize`` makes the launcher (hydra) kill the others, so nobody finalizes and the
segment stays in ``/dev/shm`` until the host reboots (measured with ``tests/transport/test_mpi.py``'s
dead peer: one segment left per run). Removing the name once every rank of the host has mapped the
segment keeps the mapping (POSIX: the memory lives until the last unmap) and leaves nothing behind
whatever happens later; MPICH's own removal at ``MPI_Finalize`` then finds no name and says nothing
(measured: exit code 0, no output, two ranks with and without windows).

:func:`unlink_mapped_mpich_segments` does it for the segments this process has mapped (read from
``/proc/self/maps``), so it never touches another job's segments on the same host. Call it after a
collective over ``COMM_WORLD`` that follows ``MPI_Init``: every rank of the host has mapped the segment
by then. Other MPI libraries' names do not match and are left alone; without ``/proc`` it does nothing.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

MPICH_SEGMENT_PREFIX = "/dev/shm/mpich_shm_"
"""Path prefix of MPICH's named init-time shared-memory segments."""

_MAPS = "/proc/self/maps"


def mapped_mpich_segments(maps_path: str = _MAPS) -> list[str]:
    """The MPICH segments this process has mapped whose names still exist, sorted."""
    try:
        with open(maps_path) as maps:
            lines = maps.readlines()
    except OSError:  # no /proc (not Linux)
        return []
    paths = set()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6:
            path = fields[5].strip()
            if path.startswith(MPICH_SEGMENT_PREFIX) and not path.endswith("(deleted)"):
                paths.add(path)
    return sorted(paths)


def unlink_mapped_mpich_segments(maps_path: str = _MAPS) -> list[str]:
    """Remove the names of the MPICH segments this process has mapped; returns those it removed.

    See [Note: MPICH's named segment]. Another rank of the host may have removed a name first: that
    is not an error.
    """
    removed = []
    for path in mapped_mpich_segments(maps_path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    if removed:
        logger.debug("removed the names of MPICH's shared-memory segments %s", removed)
    return removed
