"""Every rank's heartbeat and phase, the watchdog that ends a rank stuck without a limit, and the
diagnosis that names the ranks a failed rank was waiting for.

[Note: rank health]
- Each rank runs a daemon thread that writes its record (pid, host, iteration, phase, wall time) into
  the job's ``torch.distributed`` store every :data:`HEARTBEAT_PERIOD_S` and whenever the training loop
  enters a phase (:meth:`HealthMonitor.phase` hands the record to the thread and waits at most
  :data:`PUBLISH_WAIT_S` for it to be written: the training thread itself never writes to the store,
  so a store that is gone, with its launcher, cannot stall it). The store outlives
  any one rank under torchrun (the agent hosts it), so a stopped (SIGSTOP) or killed rank leaves its
  last record behind.
- The same thread ends the rank when its launcher is gone: the process that started it (torchrun's
  agent, ``mpiexec``'s proxy, the test harness) is no longer its parent. Left alone, orphaned ranks
  trained on without their agent, wrote into a dead store and saved into a ``--save`` directory that a
  requeued job was using. It logs one line and exits with :data:`EXIT_LAUNCHER_GONE` within a heartbeat.
- When a rank fails with a collective's error (a gloo timeout, "connection reset by peer", the ODC
  fence's timeout), :meth:`HealthMonitor.diagnose` reads every record and names the peers that died or
  are stopped (their ``/proc`` state, same host) or fell silent (no heartbeat for
  :data:`SILENT_AFTER_S`), with what each was doing.
  :meth:`HealthMonitor.failure` turns that into a :class:`PeerFailureError` naming them; a failure with
  no dead or silent peer is left as it was (it is this rank's own).
- Timeouts bound every wait: ``--distributed-timeout-minutes`` is the timeout of every process group
  (the default one, megatron-core's) and of the ODC fence. The watchdog is the backstop for a wait that
  ignores them: when this rank has been in one phase for longer than the timeout plus
  :data:`WATCHDOG_SLACK_S` *and* a peer is dead or silent, it logs the diagnosis and ends the process
  with :data:`EXIT_PEER_FAILURE` (a thread cannot interrupt a blocked collective). A rank that is merely
  slow keeps its heartbeat, so a long phase elsewhere never trips it. Saving and loading are exempt
  (their length scales with the model, and their collectives carry the timeout).

Clocks: records carry wall time (``time.time``); hosts of one job are assumed synchronised to well under
:data:`SILENT_AFTER_S` (NTP).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

logger = logging.getLogger(__name__)

HEARTBEAT_PERIOD_S = 1.0
"""Seconds between two heartbeats of a rank."""
SILENT_AFTER_S = 5.0
"""A rank whose record is older than this is named as having stopped responding."""
WATCHDOG_SLACK_S = 15.0
"""How long past the timeout the watchdog lets a phase run before ending a rank whose peer is gone."""
DIAGNOSIS_WAIT_S = SILENT_AFTER_S + 2 * HEARTBEAT_PERIOD_S
"""How long a failed rank waits for its peers' records to show which of them is gone."""
EXIT_PEER_FAILURE = 3
"""The exit status of a rank the watchdog ends."""
EXIT_LAUNCHER_GONE = 4
"""The exit status of a rank whose launcher died."""
PUBLISH_WAIT_S = 0.5
"""How long entering a phase waits for the heartbeat thread to write the record (a peer that dies
right after must find this rank's phase in the store)."""
UNWATCHED_PHASES = ("save", "load")
"""Phases the watchdog never cuts short (their length scales with the model)."""
_KEY_PREFIX = "megatron_odc/health/"


class PeerFailureError(RuntimeError):
    """This rank failed because other ranks died or stopped responding; the message names them."""


@dataclasses.dataclass(frozen=True)
class RankRecord:
    """A rank's last heartbeat."""

    rank: int
    pid: int
    host: str
    iteration: int
    phase: str
    time: float

    def state(self, now: float) -> str | None:
        """``died``, ``is stopped`` (SIGSTOP), ``stopped responding`` (silent), or None (alive)."""
        if self.phase == "finished":
            return None
        if self.host == socket.gethostname():
            process = _process_state(self.pid)
            if process is not None:
                return process
        return "stopped responding" if now - self.time > SILENT_AFTER_S else None

    def describe(self, state: str, now: float) -> str:
        """This rank named with its ``state`` (what :meth:`state` returned) and where it was."""
        how = state
        if state == "stopped responding":
            how = f"stopped responding {now - self.time:.0f} s ago"
        return (
            f"rank {self.rank} (pid {self.pid} on {self.host}) {how} "
            f"(last seen in {self.phase}, iteration {self.iteration})"
        )


def _process_state(pid: int) -> str | None:
    """``died`` (gone or a zombie), ``is stopped`` (SIGSTOP), or None (running) for a pid of this host."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "died"
    except OSError:
        return None
    state = stat.rsplit(")", 1)[-1].split()[0]  # the field after the command name
    if state in ("Z", "X", "x"):
        return "died"
    if state in ("T", "t"):
        return "is stopped"
    return None


_PF_EXITING = 0x4
"""The kernel's per-task flag (``/proc/<pid>/stat`` field 9) set when a process starts to exit."""


def _is_exiting(pid: int) -> bool:
    """Whether ``pid`` (this host) has started to exit or is gone.

    A killed launcher closes its sockets (the store's) while it exits, before its children are
    reparented: under load that window was long enough for a heartbeat to write into the closed store
    (a C++ ``Connection reset by peer`` trace). The exit flag is set before the sockets close.
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return True
    return fields[0] in ("Z", "X", "x") or bool(int(fields[6]) & _PF_EXITING)


class HealthMonitor:
    """This rank's heartbeat, phase and watchdog over the job's store (see [Note: rank health]).

    Args:
        store: the job's ``torch.distributed`` store (records go under ``megatron_odc/health/``).
        rank: this rank in the default group.
        world_size: ranks in the default group.
        timeout_s: the job's collective timeout (``--distributed-timeout-minutes`` in seconds).
        period_s: seconds between heartbeats.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout_s: float,
        *,
        period_s: float = HEARTBEAT_PERIOD_S,
    ) -> None:
        self._store = dist.PrefixStore(_KEY_PREFIX, store)
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.period_s = float(period_s)
        self._iteration = 0
        self._phase = "start-up"
        self._phase_since = time.monotonic()
        self._lock = threading.Lock()  # the store client is shared by this thread and the main one
        self._launcher_pid = os.getppid()
        self._stop = threading.Event()
        self._wake = threading.Event()  # a phase changed: publish now
        self._published = threading.Condition()
        self._requested_seq = (
            0  # records asked for by phase changes, and written (under the condition)
        )
        self._published_seq = 0
        self._thread = threading.Thread(
            target=self._beat, name=f"megatron_odc-health-rank{rank}", daemon=True
        )

    def start(self) -> HealthMonitor:
        self._publish()
        self._thread.start()
        return self

    def stop(self, *, finished: bool) -> None:
        """Stop the heartbeat after its last record; ``finished`` records that this rank ended normally."""
        if finished:
            self._phase = "finished"
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5 * self.period_s)

    @contextlib.contextmanager
    def phase(self, name: str, iteration: int | None = None) -> Iterator[None]:
        """Record that this rank does ``name`` (at ``iteration``) for the block."""
        previous = self._phase
        self._set_phase(name, self._iteration if iteration is None else iteration)
        yield  # an exception leaves the phase as it was, for the failure's message
        self._set_phase(previous, self._iteration)

    def _set_phase(self, name: str, iteration: int) -> None:
        self._phase, self._iteration = name, iteration
        self._phase_since = time.monotonic()
        # The heartbeat thread writes it; wait a little for that (see [Note: rank health]).
        with self._published:
            self._requested_seq += 1
            wanted = self._requested_seq
            self._wake.set()
            if self._thread.is_alive():
                self._published.wait_for(
                    lambda: self._published_seq >= wanted, timeout=PUBLISH_WAIT_S
                )

    # ------------------------------------------------------------------ store

    def _publish(self) -> None:
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "iteration": self._iteration,
            "phase": self._phase,
            "time": time.time(),
        }
        try:
            with self._lock:
                self.end_if_launcher_gone()  # again right before: the store dies with the launcher
                self._store.set(f"rank{self.rank}", json.dumps(record))
        except Exception as exc:  # the store may be gone with the job; never fail a rank for it
            logger.debug("rank %d: heartbeat not written: %s", self.rank, exc)

    def records(self) -> list[RankRecord]:
        """The last record of every other rank that wrote one."""
        found = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            key = f"rank{rank}"
            try:
                with self._lock:
                    if not self._store.check([key]):
                        continue
                    raw = self._store.get(key)
            except Exception as exc:
                logger.debug("rank %d: record of rank %d unreadable: %s", self.rank, rank, exc)
                continue
            found.append(RankRecord(rank=rank, **json.loads(raw)))
        return found

    # ------------------------------------------------------------------ diagnosis

    def diagnose(self) -> str | None:
        """One sentence naming the dead, stopped or silent peers, or None when every peer is alive."""
        now = time.time()
        states = [(record, record.state(now)) for record in self.records()]
        gone = [record.describe(state, now) for record, state in states if state is not None]
        return "; ".join(gone) if gone else None

    def failure(self, error: BaseException) -> BaseException:
        """``error`` as a :class:`PeerFailureError` naming the gone peers, or ``error`` itself if none.

        A collective can fail before the peer's silence shows (a connection reset by a peer on another
        host), so this waits up to :data:`DIAGNOSIS_WAIT_S` for a gone peer to appear.
        """
        deadline = time.monotonic() + DIAGNOSIS_WAIT_S
        diagnosis = self.diagnose()
        while diagnosis is None and time.monotonic() < deadline:
            time.sleep(self.period_s / 2)
            diagnosis = self.diagnose()
        if diagnosis is None:
            return error
        summary = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return PeerFailureError(
            f"rank {self.rank} failed in {self._phase} at iteration {self._iteration} because "
            f"{diagnosis} ({type(error).__name__}: {summary})"
        )

    # ------------------------------------------------------------------ thread

    def _beat(self) -> None:
        while True:
            self._wake.wait(self.period_s)
            self._wake.clear()
            self.end_if_launcher_gone()
            with self._published:
                wanted = self._requested_seq
            self._publish()
            with self._published:
                self._published_seq = wanted
                self._published.notify_all()
            if self._stop.is_set():
                return
            stuck_s = time.monotonic() - self._phase_since
            if self._phase in UNWATCHED_PHASES or stuck_s <= self.timeout_s + WATCHDOG_SLACK_S:
                continue
            diagnosis = self.diagnose()
            if diagnosis is None:
                continue  # every peer is alive: this rank is slow, not stuck on a gone peer
            logger.error(
                "rank %d: stuck in %s at iteration %d for %.0f s (timeout %.0f s) because %s; "
                "ending this rank",
                self.rank,
                self._phase,
                self._iteration,
                stuck_s,
                self.timeout_s,
                diagnosis,
            )
            logging.shutdown()
            os._exit(EXIT_PEER_FAILURE)

    def end_if_launcher_gone(self) -> None:
        """End this rank, with one line, when its launcher is gone (see [Note: rank health]).

        Also called first when the training thread fails: a peer that ended for the same reason
        breaks this rank's collectives, and the failure's diagnosis would read the dead store.
        """
        parent = os.getppid()
        if parent == self._launcher_pid:
            if not _is_exiting(parent):
                return
            how = "it is exiting"
        else:
            how = f"the parent is now pid {parent}"
        logger.error(
            "rank %d: its launcher (pid %d) is gone (%s); ending this rank at iteration %d (%s) "
            "instead of training on without it",
            self.rank,
            self._launcher_pid,
            how,
            self._iteration,
            self._phase,
        )
        logging.shutdown()
        os._exit(EXIT_LAUNCHER_GONE)


def default_store() -> dist.Store:
    """The default process group's store (torchrun's agent store, or the test harness's file store)."""
    return dist.distributed_c10d._get_default_store()
