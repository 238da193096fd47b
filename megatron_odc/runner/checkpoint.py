"""The plugin's checkpoint directories: iterations, the tracker, atomic saves, per-rank extra state.

- ``save_dir/iter_{iteration:07d}/``: a torch_dist checkpoint of ``{"model": ..., "optimizer": ...,
  "iteration": ...}`` (built for every backend by ``mcore/dist_ckpt/state.py``), plus
  ``extra_state_rank{r}.pt`` per rank (sampler, RNG, scheduler: whatever the caller hands in) and
  ``odc_world_size.txt``;
- ``save_dir/latest_checkpointed_iteration.txt``: the tracker, Megatron-LM's name and format.

Atomicity: every rank writes into ``iter_x.tmp-<uuid>/``; after a barrier rank 0 renames it to
``iter_x/`` and then replaces the tracker file (write a temporary file, ``os.replace``). A crash at any
point before the rename leaves the previous checkpoint and tracker untouched.

Entry points: :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`latest_iteration`, and the
training state kept beside the weights (:func:`training_state`, :func:`restore_training_state`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_odc.mcore import rng
from megatron_odc.mcore.dist_ckpt import state as dist_ckpt

logger = logging.getLogger(__name__)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
"""Megatron-LM's tracker file: the latest complete iteration, as a decimal integer."""

_CHECKPOINT_VERSION = 1


def iteration_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    """``save_dir/iter_{iteration:07d}``, Megatron-LM's directory name."""
    return Path(save_dir) / f"iter_{iteration:07d}"


def latest_iteration(load_dir: str | os.PathLike) -> int | None:
    """The iteration named by the tracker file of ``load_dir``, or None when there is none.

    Raises:
        ValueError: the tracker file exists but does not hold an iteration number (the message names
            the directory and the file).
    """
    tracker = Path(load_dir) / TRACKER_FILENAME
    if not tracker.is_file():
        return None
    iteration, held = _read_count(tracker)
    if iteration is not None:
        return iteration
    raise ValueError(
        f"{load_dir} is not a checkpoint directory written by megatron_odc or Megatron-LM: its "
        f"{TRACKER_FILENAME} holds {held}, not an iteration number; point --load at the --save "
        "directory of a run"
    )


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


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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
    leaves the previous checkpoint loadable.

    Args:
        save_dir: checkpoint root (created if missing).
        iteration: the iteration number to record.
        model: the DP-wrapped model chunk (``ODCDataParallel`` or megatron-core
            ``DistributedDataParallel``).
        optimizer: ``ODCOptimizer`` or a megatron-core optimizer; None saves weights only.
        extra_state: per-rank state (sampler, RNG, scheduler) of tensors and plain Python values
            (dicts, lists, tuples, numbers, strings, None): it is loaded with ``weights_only=True``,
            which unpickles nothing else; returned by load on the same rank.
    """
    _check_writer_dependencies()
    save_dir = Path(save_dir)
    rank = _rank()
    token = _broadcast_object(uuid.uuid4().hex[:12])
    final_dir = iteration_dir(save_dir, iteration)
    tmp_dir = final_dir.with_name(f"{final_dir.name}.tmp-{token}")
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        for stale in save_dir.glob("iter_*.tmp-*"):
            logger.warning("removing an incomplete checkpoint directory %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp_dir.mkdir()
    _barrier()

    state: dict[str, Any] = {
        "iteration": int(iteration),
        "checkpoint_version": _CHECKPOINT_VERSION,
        **dist_ckpt.build_save_state(model, optimizer),
    }
    _save_sharded(state, tmp_dir, model)
    torch.save(extra_state, tmp_dir / f"extra_state_rank{rank}.pt")
    _barrier()
    if rank == 0:
        (tmp_dir / "odc_world_size.txt").write_text(f"{_world_size()}\n")
        _fsync_dir(tmp_dir)
        if final_dir.exists():
            old = final_dir.with_name(f"{final_dir.name}.tmp-old-{token}")
            os.replace(final_dir, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp_dir, final_dir)
        _fsync_dir(save_dir)
        tracker_tmp = save_dir / f"{TRACKER_FILENAME}.tmp-{token}"
        with open(tracker_tmp, "w") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, save_dir / TRACKER_FILENAME)
        _fsync_dir(save_dir)
        logger.info("saved checkpoint iteration %d to %s", iteration, final_dir)
    _barrier()


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
) -> tuple[int, dict]:
    """Load the latest checkpoint of ``load_dir`` into ``model`` (and ``optimizer``).

    Collective over every rank. With ``finetune=True`` only the weights are loaded, the optimizer's main
    parameters are refreshed from them (``reload_model_params``), and ``(0, {})`` is returned.

    Returns:
        ``(iteration, extra_state)``: the saved iteration and this rank's ``extra_state``. When the
        world size differs from the saving run's, rank 0's extra state is returned on every rank (the
        sampler and scheduler state are global; per-rank RNG states then come from rank 0).

    Raises:
        ValueError: no checkpoint in ``load_dir``, a damaged one (a file that cannot be read: each
            rank's error is named), or one that does not fit the model (a tensor is missing or has
            another shape; the message names it).
    """
    iteration = latest_iteration(load_dir)
    if iteration is None:
        raise ValueError(f"no checkpoint in {load_dir}: {TRACKER_FILENAME} is missing")
    checkpoint_dir = iteration_dir(load_dir, iteration)
    if not checkpoint_dir.is_dir():
        raise ValueError(
            f"{TRACKER_FILENAME} in {load_dir} names iteration {iteration}, but {checkpoint_dir} "
            "does not exist"
        )
    try:
        dist_ckpt.load(
            checkpoint_dir, model, optimizer, load_optimizer=optimizer is not None and not finetune
        )
    except CheckpointException as exc:  # a read failed on some rank; every rank gets the same
        raise ValueError(
            f"--load {load_dir}: iteration {iteration} cannot be read ("
            + "; ".join(
                f"rank {rank}: {_first_line(error)}"
                for rank, (error, _) in sorted(exc.failures.items())
            )
            + f"): files in {checkpoint_dir} are damaged or incomplete; load another iteration "
            f"(the number in {TRACKER_FILENAME}) or save again"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--load {load_dir}: a JSON file of {checkpoint_dir} (metadata.json) does not parse "
            f"({exc}); the checkpoint is damaged"
        ) from None
    if finetune:
        return 0, {}
    return iteration, _load_extra_state(checkpoint_dir)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _load_extra_state(checkpoint_dir: Path) -> dict:
    saved_world = checkpoint_dir / "odc_world_size.txt"
    world_size = None
    if saved_world.is_file():
        world_size, held = _read_count(saved_world)
        if world_size is None:
            raise ValueError(
                f"--load: {saved_world} holds {held}, not a world size; the checkpoint "
                "directory is damaged"
            )
    rank = _rank()
    same_world = world_size == _world_size()
    path = checkpoint_dir / f"extra_state_rank{rank if same_world else 0}.pt"
    if not path.is_file():
        return {}
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
