"""The plugin's checkpoint directories: iterations, the tracker, atomic saves, per-rank extra state.

- ``save_dir/iter_{iteration:07d}/``: a torch_dist checkpoint of ``{"model": ..., "optimizer": ...,
  "iteration": ...}`` (built for every backend by ``mcore/dist_ckpt/state.py``), plus
  ``extra_state_rank{r}.pt`` per rank (sampler, RNG, scheduler: whatever the caller hands in) and
  ``odc_world_size.txt``;
- ``save_dir/latest_checkpointed_iteration.txt``: the tracker, Megatron-LM's name and format.

Atomicity: every rank writes into ``iter_x.tmp-<uuid>/``; once every rank has written, rank 0 renames
it to ``iter_x/`` and then replaces the tracker file (write a temporary file, ``os.replace``). A crash
at any point before the rename leaves the previous checkpoint and tracker untouched.

One job per directory: a save runs while its process holds the directory's lock (the entry holds it
for the whole job, ``save_lock.hold``; any other caller for the save), and only the holder removes the
incomplete ``iter_*.tmp-*`` directories of earlier, dead jobs ([Note: save directory lock]).

Failures are one ``ValueError`` per job ([Note: checkpoint failures]).

[Note: checkpoint failures]
A save that fails (disk full, a file system turned read-only, no permission) raises
:class:`CheckpointSaveError` on every rank with the same one-line message: ``--save``, the iteration, the
file and the OS error by name, the partial ``iter_x.tmp-*`` removed, and the last good iteration. The
ranks agree after each phase (rank 0's preparation, the torch_dist write, each rank's extra state,
rank 0's rename and tracker) through one gather; a write that fails on one rank inside megatron-core's
collective save (``common.pt``, ``metadata.json``) raises on that rank alone, which ends the job
(``runner/errors.py``). torch's zip writer reports a full disk as "unexpected pos"; the file system is
then asked (``statvfs``) whether it is full or read-only.

A checkpoint that cannot be loaded is one ``ValueError`` too, found before reading where the layout
shows it (an empty iteration directory, a missing ``.metadata`` / ``common.pt`` / ``metadata.json`` /
``extra_state_rank{r}.pt``, Megatron-LM's legacy ``mp_rank_*`` torch format, with how to convert it),
else named after the read fails (a file that does not unpickle). Megatron-LM's ``release`` checkpoints
(tracker ``release``, directory ``release/``) load as Megatron-LM loads them: weights only, iteration 0.

Entry points: :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`latest_checkpoint`, and the
training state kept beside the weights (:func:`training_state`, :func:`restore_training_state`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import logging
import os
import pickle
import re
import shutil
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_odc.mcore import rng
from megatron_odc.mcore.dist_ckpt import layout as dist_ckpt_layout
from megatron_odc.mcore.dist_ckpt import state as dist_ckpt
from megatron_odc.runner import save_lock

logger = logging.getLogger(__name__)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
"""Megatron-LM's tracker file: the latest complete iteration, as a decimal integer, or ``release``."""
RELEASE = "release"
"""What Megatron-LM's tracker holds for a release checkpoint, and that checkpoint's directory name."""

_CHECKPOINT_VERSION = 1


class CheckpointSaveError(ValueError):
    """A save failed (see [Note: checkpoint failures]); every rank raises the same message."""


@dataclasses.dataclass(frozen=True)
class TrackedCheckpoint:
    """The checkpoint a tracker file names.

    Attributes:
        iteration: its iteration (0 for a release checkpoint, as Megatron-LM counts it).
        directory: ``iter_{iteration:07d}/``, or ``release/``.
        release: whether the tracker holds ``release`` (Megatron-LM: weights only, no optimizer,
            training state or RNG are loaded).
    """

    iteration: int
    directory: Path
    release: bool


def iteration_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    """``save_dir/iter_{iteration:07d}``, Megatron-LM's directory name."""
    return Path(save_dir) / f"iter_{iteration:07d}"


def latest_checkpoint(load_dir: str | os.PathLike) -> TrackedCheckpoint | None:
    """The checkpoint the tracker file of ``load_dir`` names, or None when there is no tracker.

    Raises:
        ValueError: the tracker file holds neither an iteration number nor ``release`` (the message
            names the directory and the file).
    """
    tracker = Path(load_dir) / TRACKER_FILENAME
    if not tracker.is_file():
        return None
    iteration, held = _read_count(tracker)
    if iteration is not None:
        return TrackedCheckpoint(iteration, iteration_dir(load_dir, iteration), release=False)
    if held == repr(RELEASE):
        return TrackedCheckpoint(0, Path(load_dir) / RELEASE, release=True)
    raise ValueError(
        f"{load_dir} is not a checkpoint directory written by megatron_odc or Megatron-LM: its "
        f"{TRACKER_FILENAME} holds {held}, not an iteration number nor {RELEASE!r}; point --load "
        "at the --save directory of a run"
    )


def latest_iteration(load_dir: str | os.PathLike) -> int | None:
    """The iteration named by the tracker file of ``load_dir`` (0 for a Megatron-LM release
    checkpoint), or None when there is none.

    Raises:
        ValueError: the tracker file exists but does not hold an iteration number or ``release``.
    """
    tracked = latest_checkpoint(load_dir)
    return None if tracked is None else tracked.iteration


def is_release(load_dir: str | os.PathLike) -> bool:
    """Whether the tracker of ``load_dir`` names a Megatron-LM release checkpoint."""
    tracked = latest_checkpoint(load_dir)
    return tracked is not None and tracked.release


def _read_count(path: Path) -> tuple[int | None, str]:
    """The non-negative integer a small text file holds, or None and what it holds instead (for a
    message)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"{len(raw)} bytes that are not UTF-8 text"
    if text.isascii() and text.isdigit():
        return int(text), text
    return None, repr(text if len(text) <= 40 else text[:40] + "...")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _broadcast_object(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value if _rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_checkpoint(
    save_dir: str | os.PathLike,
    iteration: int,
    model: torch.nn.Module,
    optimizer: Any,
    *,
    extra_state: dict,
) -> None:
    """Save model, optimizer and per-rank ``extra_state`` as ``save_dir/iter_{iteration:07d}``.

    Collective over every rank. The tracker ``latest_checkpointed_iteration.txt`` is replaced only after
    every rank has finished writing and the directory has been renamed into place, so a crash mid-save
    leaves the previous checkpoint loadable. The save runs under the directory's lock: the job's when
    this process holds it (``save_lock.hold``), else taken for this save.

    Args:
        save_dir: checkpoint root (created if missing).
        iteration: the iteration number to record.
        model: the DP-wrapped model chunk (``ODCDataParallel`` or megatron-core
            ``DistributedDataParallel``).
        optimizer: ``ODCOptimizer`` or a megatron-core optimizer; None saves weights only.
        extra_state: per-rank state (sampler, RNG, scheduler) of tensors and plain Python values
            (dicts, lists, tuples, numbers, strings, None): it is loaded with ``weights_only=True``,
            which unpickles nothing else; returned by load on the same rank.

    Raises:
        CheckpointSaveError: a write failed (every rank raises the same one-line message; see
            [Note: checkpoint failures]); the partial directory is removed.
        save_lock.SaveDirBusyError: another live job holds ``save_dir``.
    """
    _check_writer_dependencies()
    save_dir = Path(save_dir)
    rank = _rank()
    token, job_holds_lock = _broadcast_object(
        (uuid.uuid4().hex[:12], rank == 0 and save_lock.held_by_this_process(save_dir))
    )
    final_dir = iteration_dir(save_dir, iteration)
    tmp_dir = final_dir.with_name(f"{final_dir.name}.tmp-{token}")
    save = _SaveAttempt(save_dir, iteration, tmp_dir)
    with contextlib.nullcontext() if job_holds_lock else save_lock.hold(save_dir):
        save.agree(save.run(_prepare_save_dir, save_dir, tmp_dir) if rank == 0 else None)
        state: dict[str, Any] = {
            "iteration": int(iteration),
            "checkpoint_version": _CHECKPOINT_VERSION,
            **dist_ckpt.build_save_state(model, optimizer),
        }
        try:
            with _errors_reported_once():
                _save_sharded(state, tmp_dir, model)
        except CheckpointException as exc:  # raised on every rank; rank 0 holds every rank's error
            save.agree(_shard_write_failure(exc, save_dir, tmp_dir) if rank == 0 else None)
            raise
        except (OSError, RuntimeError) as exc:  # a write of this rank alone (common.pt, ...)
            save.fail_alone(exc)
        extra_path = tmp_dir / f"extra_state_rank{rank}.pt"
        save.agree(save.run(_write_extra_state, extra_state, extra_path, file=extra_path))
        save.agree(
            save.run(_publish, save_dir, tmp_dir, final_dir, iteration) if rank == 0 else None
        )
    if rank == 0:
        logger.info("saved checkpoint iteration %d to %s", iteration, final_dir)


_WRITER_ERROR_LINES = (
    "Local process ",  # megatron-core 0.16-0.18
    "Local worker ",  # 0.19
    "An error is caught while starting worker ",  # 0.19
)
"""How megatron-core's checkpoint writer logs a failed write, in each release."""


class _WriterErrorFilter(logging.Filter):
    """Drops megatron-core's writer error lines (:data:`_WRITER_ERROR_LINES`): the error reaches the
    save as an exception and is named in its one message."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_WRITER_ERROR_LINES)


@contextlib.contextmanager
def _errors_reported_once() -> Iterator[None]:
    writer_log = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")
    drop = _WriterErrorFilter()
    writer_log.addFilter(drop)
    try:
        yield
    finally:
        writer_log.removeFilter(drop)


def _prepare_save_dir(save_dir: Path, tmp_dir: Path) -> None:
    """Rank 0, under the directory's lock: remove dead jobs' incomplete saves, make ``tmp_dir``."""
    save_dir.mkdir(parents=True, exist_ok=True)
    for stale in save_dir.glob("iter_*.tmp-*"):
        if stale != tmp_dir:
            logger.warning("removing an incomplete checkpoint directory %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
    tmp_dir.mkdir()


def _write_extra_state(extra_state: dict, path: Path) -> None:
    """torch.save into memory, then plain writes: an OS error keeps its errno (torch's zip writer
    reports a full disk as "unexpected pos")."""
    buffer = io.BytesIO()
    torch.save(extra_state, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())
        f.flush()
        os.fsync(f.fileno())


def _publish(save_dir: Path, tmp_dir: Path, final_dir: Path, iteration: int) -> None:
    """Rank 0, once every rank has written: the directory into place, then the tracker."""
    (tmp_dir / "odc_world_size.txt").write_text(f"{_world_size()}\n")
    _fsync_dir(tmp_dir)
    if final_dir.exists():
        old = final_dir.with_name(f"{final_dir.name}.tmp-old-{tmp_dir.name.rsplit('-', 1)[1]}")
        os.replace(final_dir, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp_dir, final_dir)
    _fsync_dir(save_dir)
    tracker_tmp = save_dir / f"{TRACKER_FILENAME}.tmp-{tmp_dir.name.rsplit('-', 1)[1]}"
    try:
        with open(tracker_tmp, "w") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, save_dir / TRACKER_FILENAME)
    except OSError:
        # The iteration is complete in place; the tracker still names the previous one.
        with contextlib.suppress(OSError):
            tracker_tmp.unlink()
        raise
    _fsync_dir(save_dir)


_OS_ERRORS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^\n]*)")
_TORCH_WRITE_ERRORS = (
    "iostream error",
    "unexpected pos",
    "file write failed",
    "StreamWriter failed",
)
"""How torch's zip writer words a failed write (it keeps no errno)."""
_LOW_SPACE_BYTES = 1 << 20
"""Below this much free space a write error without an errno is taken for a full disk."""


def _os_error_text(code: int, strerror: str) -> str:
    name = errno.errorcode.get(code, f"errno {code}")
    what = _OS_ERRORS.get(code)
    return f"{what} ({name}: {strerror})" if what else f"{name}: {strerror}"


def _errno_of(exc: BaseException) -> tuple[int, str] | None:
    """The OS error behind ``exc``: an ``OSError`` in its chain, or ``[Errno N] text`` in its message
    (megatron-core's writer processes send their error's text across processes)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current.errno, current.strerror or os.strerror(current.errno)
        match = _ERRNO_TEXT.search(str(current))
        if match:
            return int(match[1]), match[2].strip()
        current = current.__cause__ or current.__context__
    return None


def _file_system_state(path: Path) -> tuple[int, str] | None:
    """What the file system of ``path`` says when a write failed without an errno: read-only, or
    (nearly) full."""
    for candidate in (path, *path.parents):
        try:
            stat = os.statvfs(candidate)
        except OSError:
            continue
        if stat.f_flag & os.ST_RDONLY:
            return errno.EROFS, os.strerror(errno.EROFS)
        free = stat.f_bavail * stat.f_frsize
        if free < _LOW_SPACE_BYTES or stat.f_favail == 0:
            return errno.ENOSPC, f"{free // 1024} KiB left on the file system"
        return None
    return None


def _torch_save_target(exc: BaseException) -> str | None:
    """The file ``torch.save`` was writing when it raised ``exc`` (its ``f`` argument)."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if (
            frame.f_code.co_name == "save"
            and frame.f_globals.get("__name__") == "torch.serialization"
        ):
            target = frame.f_locals.get("f")
            if isinstance(target, (str, os.PathLike)):
                return os.fspath(target)
        tb = tb.tb_next
    return None


def _describe_write_error(exc: BaseException, where: Path, file: str | None) -> str | None:
    """``<file>: <OS error by name>`` for a failed write, or None when ``exc`` is not a file system
    error (a bug: it keeps its traceback)."""
    found = _errno_of(exc)
    if found is None and isinstance(exc, OSError):
        found = (0, str(exc))
    if found is None:
        found = _file_system_state(where)
    if found is None:
        if not any(marker in str(exc) for marker in _TORCH_WRITE_ERRORS):
            return None
        found = (0, _first_line(exc))
    filename = file or getattr(exc, "filename", None) or _torch_save_target(exc)
    reason = _os_error_text(*found) if found[0] else found[1]
    return f"{filename or where}: {reason}"


def _shard_write_failure(
    exc: CheckpointException, save_dir: Path, tmp_dir: Path
) -> list[tuple[int, str]]:
    """Rank 0's description of torch_dist's write failures: (rank, its shard files: OS error)."""
    failures = sorted(exc.failures.items())
    if not failures:
        return [(0, f"{tmp_dir}: {_first_line(exc)}")]
    found = []
    for rank, (error, _) in failures:
        shards = tmp_dir / f"__{rank}_*.distcp"
        described = _describe_write_error(error, save_dir, str(shards))
        found.append((rank, described or f"{shards}: {_first_line(error)}"))
    return found


@dataclasses.dataclass
class _SaveAttempt:
    """One save's failure handling (see [Note: checkpoint failures])."""

    save_dir: Path
    iteration: int
    tmp_dir: Path

    def run(self, step: Callable[..., None], *args: Any, file: Path | None = None) -> str | None:
        """``step(*args)``; what failed (``file``, or the file the error names: the OS error) or
        None. An error that is not the file system's is raised."""
        try:
            step(*args)
        except (OSError, RuntimeError) as exc:
            described = _describe_write_error(
                exc, self.save_dir, None if file is None else str(file)
            )
            if described is None:
                raise
            return described
        return None

    def agree(self, problem: str | list[tuple[int, str]] | None) -> None:
        """Collective: when any rank has a problem (what this rank failed to write, or a list of
        (rank, what) found for several), every rank raises rank 0's one message."""
        problems: list[Any] = [problem]
        if dist.is_initialized() and dist.get_world_size() > 1:
            problems = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
        failed: list[tuple[int, str]] = []
        for rank, found in enumerate(problems):
            if isinstance(found, list):
                failed.extend(found)
            elif found is not None:
                failed.append((rank, found))
        if not failed:
            return
        message = self._message(failed) if _rank() == 0 else None
        raise CheckpointSaveError(_broadcast_object(message)) from None

    def fail_alone(self, exc: BaseException) -> None:
        """This rank alone failed inside the collective write: remove the partial directory and
        raise (the other ranks stop when this one leaves)."""
        described = _describe_write_error(exc, self.save_dir, None)
        if described is None:
            raise exc
        raise CheckpointSaveError(self._message([(_rank(), described)])) from None

    def _message(self, failed: list[tuple[int, str]]) -> str:
        existed = self.tmp_dir.exists()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        if self.tmp_dir.exists():
            removed = f"the partial {self.tmp_dir.name} could not be removed (the next save will)"
        elif existed:
            removed = f"the partial {self.tmp_dir.name} was removed"
        else:
            removed = "nothing was written"
        try:
            last = latest_checkpoint(self.save_dir)
        except (OSError, ValueError):
            last = None
        last_good = (
            f"the last good checkpoint in --save is iteration {last.iteration}"
            if last is not None and last.directory.is_dir()
            else "--save holds no complete checkpoint"
        )
        where = "; ".join(
            f"rank {rank} writing {what}" if _world_size() > 1 else f"writing {what}"
            for rank, what in failed[:2]
        )
        more = f" (and {len(failed) - 2} more ranks)" if len(failed) > 2 else ""
        codes = " ".join(failed_text for _, failed_text in failed)
        if "ENOSPC" in codes or "EDQUOT" in codes:
            advice = "free space there or point --save at another directory"
        elif any(name in codes for name in ("EROFS", "EACCES", "EPERM")):
            advice = "make --save writable or point --save at another directory"
        else:
            advice = "check --save"
        resume = f", then resume with --load {self.save_dir}" if last is not None else ""
        return (
            f"--save {self.save_dir}: saving iteration {self.iteration} failed, {where}{more}; "
            f"{removed}; {last_good}; {advice}{resume}"
        )


def _check_writer_dependencies() -> None:
    """megatron's torch_dist writer processes need psutil; without it a save hangs, so fail first."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "saving a torch_dist checkpoint needs the psutil package (megatron-core's writer "
            "processes import it and a save would hang without it): pip install psutil"
        ) from None


def _save_sharded(state: dict[str, Any], checkpoint_dir: Path, model: torch.nn.Module) -> None:
    """Write the torch_dist state (a separate function so tests can interrupt a save here)."""
    dist_ckpt.write(state, checkpoint_dir, model)


def load_checkpoint(
    load_dir: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any,
    *,
    finetune: bool = False,
    train_iters: int | None = None,
) -> tuple[int, dict]:
    """Load the latest checkpoint of ``load_dir`` into ``model`` (and ``optimizer``).

    Collective over every rank. With ``finetune=True``, or for a Megatron-LM release checkpoint (as
    Megatron-LM loads one), only the weights are loaded, the optimizer's main parameters are refreshed
    from them (``reload_model_params``), and ``(0, {})`` is returned.

    Args:
        load_dir: the ``--load`` directory.
        model: the DP-wrapped model chunk.
        optimizer: its optimizer, or None (weights only).
        finetune: load the weights only.
        train_iters: where the run ends (``--train-iters``): a resume from beyond it is refused, one
            from exactly there trains nothing (logged).

    Returns:
        ``(iteration, extra_state)``: the saved iteration and this rank's ``extra_state``. When the
        world size differs from the saving run's, rank 0's extra state is returned on every rank (the
        sampler and scheduler state are global; per-rank RNG states then come from rank 0).

    Raises:
        ValueError: no checkpoint in ``load_dir``, a damaged, incomplete or foreign one (the file is
            named; a legacy Megatron-LM torch checkpoint with how to convert it), one that does not fit
            the model (a tensor is missing or has another shape; the message names it), or a resume
            beyond ``train_iters``.
    """
    tracked = latest_checkpoint(load_dir)
    if tracked is None:
        raise ValueError(f"no checkpoint in {load_dir}: {TRACKER_FILENAME} is missing")
    checkpoint_dir = tracked.directory
    named = f"{RELEASE!r}" if tracked.release else f"iteration {tracked.iteration}"
    if not checkpoint_dir.is_dir():
        raise ValueError(
            f"{TRACKER_FILENAME} in {load_dir} names {named}, but {checkpoint_dir} does not exist"
        )
    weights_only = finetune or tracked.release
    if train_iters is not None and not weights_only:
        _check_train_iters(load_dir, tracked.iteration, train_iters)
    if tracked.release and _rank() == 0:
        logger.info(
            "--load %s holds a release checkpoint: loading its weights only, from iteration 0 "
            "(as Megatron-LM does)",
            load_dir,
        )
    try:
        dist_ckpt.load(
            checkpoint_dir,
            model,
            optimizer,
            load_optimizer=optimizer is not None and not weights_only,
        )
    except CheckpointException as exc:  # a read failed on some rank; every rank gets the same
        raise ValueError(
            f"--load {load_dir}: {named} cannot be read ("
            + "; ".join(
                f"rank {rank}: {_first_line(error)}"
                for rank, (error, _) in sorted(exc.failures.items())
            )
            + f"): files in {checkpoint_dir} are damaged or incomplete; load another iteration "
            f"(the number in {TRACKER_FILENAME}) or save again"
        ) from None
    except dist_ckpt_layout.CheckpointLayoutError as exc:
        again = (
            "save again"
            if tracked.release
            else f"load another iteration (the number in {TRACKER_FILENAME}) or save again"
        )
        raise ValueError(f"--load {load_dir}: {named} ({checkpoint_dir}) {exc}; {again}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--load {load_dir}: a JSON file of {checkpoint_dir} (metadata.json) does not parse "
            f"({exc}); the checkpoint is damaged"
        ) from None
    except (
        OSError,
        EOFError,
        pickle.UnpicklingError,
        RuntimeError,
        dist_ckpt.CheckpointingException,
    ) as exc:
        damaged = _damaged_file(checkpoint_dir)
        if damaged is None and isinstance(exc, RuntimeError):
            raise  # not a file that cannot be read: a bug keeps its traceback
        raise ValueError(
            f"--load {load_dir}: {named} ({checkpoint_dir}) cannot be read: "
            f"{damaged or _first_line(exc)}; the checkpoint is damaged: load another iteration "
            f"(the number in {TRACKER_FILENAME}) or save again"
        ) from None
    if weights_only:
        return 0, {}
    _check_training_state(f"--load {load_dir}: {named}", checkpoint_dir)
    return tracked.iteration, _load_extra_state(checkpoint_dir)


def _check_train_iters(load_dir: str | os.PathLike, iteration: int, train_iters: int) -> None:
    """A resume past ``--train-iters`` is refused; one at it trains nothing (Megatron-LM exits 0 with
    no word in both cases)."""
    if iteration > train_iters:
        raise ValueError(
            f"--train-iters {train_iters} is below iteration {iteration} of the checkpoint in --load "
            f"{load_dir}, so a resume would train nothing: raise --train-iters above {iteration} to "
            "train on, or pass --finetune to train its weights on a new schedule"
        )
    if iteration == train_iters and _rank() == 0:
        logger.warning(
            "--load %s is at iteration %d, which is --train-iters: nothing left to train",
            load_dir,
            iteration,
        )


def _check_training_state(what: str, directory: Path) -> None:
    """Refuse a checkpoint whose extra state (sampler, scheduler, RNG) a resume needs is missing, for
    every rank at once (each rank reads its own file: a rank alone refusing would print its own line).

    Raises:
        ValueError: naming the missing ``extra_state_rank{r}.pt``.
    """
    names = {entry.name for entry in directory.iterdir()}
    world_size = _saved_world_size(directory)
    if world_size is None and "extra_state_rank0.pt" not in names:
        raise ValueError(
            f"{what} ({directory}) holds no training state of megatron_odc (extra_state_rank0.pt: "
            "sampler, scheduler, RNG): it was not saved by python -m megatron_odc.train; pass "
            "--finetune to train from its weights"
        )
    for rank in range(world_size if world_size == _world_size() else 1):
        name = f"extra_state_rank{rank}.pt"
        if name not in names:
            raise ValueError(
                f"{what} ({directory}) is incomplete: {name} (the training state of rank {rank}: "
                "sampler, scheduler, RNG) is missing; load another iteration (the number in "
                f"{TRACKER_FILENAME}), or pass --finetune to train from its weights"
            )


def _damaged_file(directory: Path) -> str | None:
    """After a failed read: which of the checkpoint's small files does not parse (for the message)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:  # UnpicklingError, EOFError, ...: whatever a damaged pickle raises
        return f".metadata ({_first_line(exc)})"
    common = directory / "common.pt"  # absent from megatron-core 0.19's checkpoints
    if common.is_file() and not zipfile.is_zipfile(common):
        return "common.pt (not a torch file: truncated or overwritten)"
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _saved_world_size(checkpoint_dir: Path) -> int | None:
    saved_world = checkpoint_dir / "odc_world_size.txt"
    if not saved_world.is_file():
        return None
    world_size, held = _read_count(saved_world)
    if world_size is None:
        raise ValueError(
            f"--load: {saved_world} holds {held}, not a world size; the checkpoint directory is "
            "damaged"
        )
    return world_size


def _load_extra_state(checkpoint_dir: Path) -> dict:
    world_size = _saved_world_size(checkpoint_dir)
    rank = _rank()
    same_world = world_size == _world_size()
    path = checkpoint_dir / f"extra_state_rank{rank if same_world else 0}.pt"
    if not same_world and rank == 0:
        logger.warning(
            "checkpoint %s was saved by %s ranks, loading on %d: every rank gets rank 0's extra state",
            checkpoint_dir,
            world_size,
            _world_size(),
        )
    return load_extra_state_file(path)


def load_extra_state_file(path: Path) -> dict:
    """One rank's extra state, unpickling only tensors and plain Python values (``weights_only``).

    Raises:
        ValueError: the file is not a torch file of such values (damaged, or not written by
            :func:`save_checkpoint`); the message names it.
    """
    if not path.is_file():
        raise ValueError(
            f"--load: the training state {path} is missing; the checkpoint is incomplete"
        )
    try:
        extra = torch.load(path, weights_only=True)
    except Exception as exc:  # UnpicklingError (garbage, or an object weights_only refuses), ...
        raise ValueError(
            f"--load: cannot read the training state {path} ({type(exc).__name__}: it holds "
            "something other than tensors and plain Python values); the checkpoint is damaged or "
            "was not written by megatron_odc"
        ) from None
    if not isinstance(extra, dict):
        raise ValueError(f"--load: {path} holds a {type(extra).__name__}, not a training state")
    return extra


# ---------------------------------------------------------------------------------------- training state


def training_state(sampler: Any, scheduler: Any, iteration: int, global_batch_size: int) -> dict:
    """The non-tensor training state of a checkpoint: sampler, scheduler, consumed samples and every
    rank's RNG states (collective: the RNG states are gathered, so any rank can restore them)."""
    rng_states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rng_states, rng.rng_state())
    return {
        "sampler": sampler.state_dict(),
        "scheduler": scheduler.state_dict(),
        "consumed_samples": iteration * global_batch_size,
        "world_size": dist.get_world_size(),
        "rng_states": rng_states,
    }


def restore_training_state(extra: dict[str, Any], sampler: Any, scheduler: Any) -> None:
    """Restore what :func:`training_state` saved (RNG states only when the world size is the same).

    Raises:
        ValueError: the checkpoint's extra state lacks an entry.
    """
    for key in ("sampler", "scheduler", "rng_states", "world_size"):
        if key not in extra:
            raise ValueError(f"--load: the checkpoint's extra state has no {key!r} entry")
    sampler.load_state_dict(extra["sampler"])
    scheduler.load_state_dict(extra["scheduler"])
    if extra["world_size"] == dist.get_world_size():
        rng.set_rng_state(extra["rng_states"][dist.get_rank()])
    else:
        logger.warning(
            "checkpoint saved with %d ranks, loading on %d: RNG states are not restored, so "
            "dropout draws differ from the uninterrupted run",
            extra["world_size"],
            dist.get_world_size(),
        )
