"""Checkpoint directories under faults (issue 37): one job per ``--save``, save and load failures one line.

Three layers, cheapest first:

- no process group: ``runner/save_lock.py`` (a live holder refused, a dead one's lock taken over, with
  and without ``flock``), and how an OS error is named;
- 2 spawned CPU ranks running ``python -m megatron_odc.train``'s ``main`` (``tests/_dist.py``), several
  runs per world: a ``--save`` held by another job is refused before training and the other job's
  temporary directory survives; saves that hit a full disk (a shard or extra-state file pointed at
  ``/dev/full``, which fails every write with ``ENOSPC``; with root, a real 1 MB tmpfs) or a
  directory turned read-only (an injected ``EROFS``) print one line and leave no partial directory;
  damaged, incomplete and foreign checkpoints print one line; a Megatron-LM release checkpoint loads.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from megatron_odc.mcore.releases import current_release
from tests._dist import run_ranks

TINY = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
    "--seq-length", "64", "--global-batch-size", "4", "--log-interval", "1",
]  # fmt: skip
PREFIX = "python -m megatron_odc.train: error: "
LOSS = re.compile(r"iteration\s+1/.*?lm loss: (\S+)")


# Layer 1: the lock and the error names, no process group #


def test_a_live_holder_is_refused_naming_it_and_release_frees_the_directory(tmp_path):
    from megatron_odc.runner import save_lock

    lock = save_lock.acquire(tmp_path)
    record = json.loads((tmp_path / save_lock.LOCK_FILENAME).read_text())
    assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
    assert save_lock.held_by_this_process(tmp_path)
    with pytest.raises(save_lock.SaveDirBusyError) as refused:
        save_lock.acquire(tmp_path)  # another open file: flock excludes it as it would a job
    message = str(refused.value)
    assert "\n" not in message
    for fragment in (f"--save {tmp_path} is in use", f"pid {os.getpid()}", socket.gethostname()):
        assert fragment in message, message
    assert "holding it since 20" in message
    assert "point --save at another directory" in message
    lock.release()
    assert not (tmp_path / save_lock.LOCK_FILENAME).exists()
    assert not save_lock.held_by_this_process(tmp_path)
    save_lock.acquire(tmp_path).release()


_HOLDER = """
import sys, time
from megatron_odc.runner import save_lock
lock = save_lock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_dead_holder_s_lock_is_taken_over_at_once(tmp_path, how):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        from megatron_odc.runner import save_lock

        with pytest.raises(save_lock.SaveDirBusyError, match=f"pid {holder.pid} "):
            save_lock.acquire(tmp_path)
        holder.send_signal(getattr(signal, how))
        holder.wait(timeout=30)
        save_lock.acquire(tmp_path).release()  # no wait: the kernel dropped the dead one's flock
    finally:
        holder.kill()
        holder.wait()


def test_without_flock_the_record_decides(tmp_path, monkeypatch):
    """NFS without a lock manager, Lustre ``noflock``: flock fails with ENOLCK and the record (pid on
    this host, heartbeat age on another) decides."""
    import fcntl

    from megatron_odc.runner import save_lock

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    path = tmp_path / save_lock.LOCK_FILENAME

    def write(record, age_s=0.0):
        path.write_text(json.dumps(record))
        stamp = time.time() - age_s
        os.utime(path, (stamp, stamp))

    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    me["pid_start"] = save_lock._pid_start_time(os.getpid())
    write(me)
    with pytest.raises(save_lock.SaveDirBusyError, match=f"pid {os.getpid()} on host"):
        save_lock.acquire(tmp_path)  # a live pid on this host
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    write({**me, "pid": int(dead.stdout), "pid_start": "1"})
    lock = save_lock.acquire(tmp_path)  # that pid is gone
    assert not lock.locked
    lock.release()
    other = {"host": "another-host", "pid": 1, "since": time.time()}
    write(other, age_s=5)
    with pytest.raises(save_lock.SaveDirBusyError, match="pid 1 on host another-host"):
        save_lock.acquire(tmp_path)  # a fresh heartbeat elsewhere
    write(other, age_s=save_lock.STALE_AFTER_S + 1)
    save_lock.acquire(tmp_path).release()  # a silent one is taken for dead


def test_os_errors_are_named(tmp_path, monkeypatch):
    from megatron_odc.runner import checkpoint

    def named(exc, file=None):
        return checkpoint._describe_write_error(exc, tmp_path, file)

    assert named(OSError(errno.ENOSPC, "No space left on device"), "f.pt") == (
        "f.pt: disk full (ENOSPC: No space left on device)"
    )
    assert named(OSError(errno.EROFS, "Read-only file system", "/x/iter")) == (
        "/x/iter: read-only file system (EROFS: Read-only file system)"
    )
    assert "permission denied (EACCES" in named(PermissionError(errno.EACCES, "Permission denied"))
    worker = RuntimeError("Worker failure: [Errno 122] Disk quota exceeded")  # across processes
    assert named(worker, "s").startswith("s: disk quota exceeded (EDQUOT")
    # torch's zip writer on a full disk: no errno; the file system is asked.
    zip_error = RuntimeError(
        "[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598"
    )
    assert named(RuntimeError("a bug")) is None  # plenty of space, no torch write error: a bug
    # common.pt onto /dev/full under torchrun (measured): named with torch's words
    stream = RuntimeError("basic_ios::clear: iostream error")
    assert named(stream, "common.pt") == "common.pt: RuntimeError: basic_ios::clear: iostream error"

    class Full:
        f_flag, f_bavail, f_frsize, f_favail = 0, 3, 4096, 100

    monkeypatch.setattr(os, "statvfs", lambda path: Full)
    assert (
        named(zip_error, "common.pt")
        == "common.pt: disk full (ENOSPC: 12 KiB left on the file system)"
    )


# Layer 2: 2 ranks through the entry #


def _main_calls(rank: int, world_size: int, workdir: str, calls: list[tuple[str, list[str]]]):
    """Runs ``main(argv)`` for each call in turn; returns {name: (status, stdout, stderr)}. Before each
    call, the rank applies the patch the name asks for (``_patch_<name>`` when defined)."""
    del world_size
    import multiprocessing

    import torch.distributed as dist

    from megatron_odc.runner.health import default_store
    from megatron_odc.train import main

    multiprocessing.current_process()._config["daemon"] = False  # torch_dist's writer processes
    os.chdir(workdir)
    warnings.simplefilter("ignore")
    out = {}
    for name, argv in calls:
        undo = globals().get(f"_patch_{name}", lambda rank: None)(rank)
        _log_to_the_current_stdout()
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                status: int | str = main([*TINY, *argv])
            except BaseException as exc:  # a bug: the test names it
                status = f"raised {type(exc).__name__}: {exc}"
        if undo is not None:
            undo()
        out[name] = (status, stdout.getvalue(), stderr.getvalue())
        dist.barrier()  # the next run's one-error rule must not see this run's message
        default_store().delete_key(f"megatron_odc/user_error/{rank}")
        dist.barrier()
    return out


def _log_to_the_current_stdout() -> None:
    """The entry's log handler holds the ``sys.stdout`` of the first run in this process: drop it, so
    that the next run makes one on its own captured stdout."""
    import logging

    from megatron_odc.runner.log import HANDLER_NAME

    package = logging.getLogger("megatron_odc")
    for handler in [h for h in package.handlers if h.name == HANDLER_NAME]:
        package.removeHandler(handler)


def _one_error(result, *fragments: str) -> str:
    """Both ranks returned 2; rank 0 alone printed one line holding ``fragments``."""
    (status0, _, err0), (status1, _, err1) = result
    assert (status0, status1) == (2, 2), result
    assert err0.startswith(PREFIX), err0
    assert err0.count("\n") == 1, err0
    assert err1 == "", err1
    for fragment in fragments:
        assert fragment in err0, err0
    return err0.removeprefix(PREFIX).strip()


def _by_name(results) -> dict[str, tuple]:
    return {name: (results[0][name], results[1][name]) for name in results[0]}


def test_a_save_directory_held_by_a_live_job_is_refused_and_its_temp_dir_survives(tmp_path):
    """Before: the second job trained, and its first save removed the first job's live
    ``iter_*.tmp-*`` (which then died with a FileNotFoundError)."""
    from megatron_odc.runner import save_lock

    held, free = tmp_path / "held", tmp_path / "free"
    live = held / "iter_0000001.tmp-livejob"
    live.mkdir(parents=True)
    (free / "iter_0000007.tmp-deadjob").mkdir(parents=True)  # a dead job's leftover
    lock = save_lock.acquire(held)  # this process stands for the live job
    try:
        train = ["--train-iters", "2", "--save-interval", "1"]
        results = run_ranks(
            _main_calls,
            2,
            str(tmp_path),
            [("held", [*train, "--save", str(held)]), ("free", [*train, "--save", str(free)])],
            timeout_s=240,
        )
    finally:
        lock.release()
    runs = _by_name(results)
    message = _one_error(runs["held"], f"--save {held} is in use by another job")
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
    assert "iteration" not in runs["held"][0][1], "trained before refusing"
    assert live.is_dir()
    assert [r[0] for r in runs["free"]] == [0, 0], runs["free"]
    assert sorted(p.name for p in free.glob("iter_*")) == ["iter_0000001", "iter_0000002"]
    assert not (free / save_lock.LOCK_FILENAME).exists()  # released at the end


def _only_at_iteration_2(path: Path) -> bool:
    return path.name.startswith("iter_0000002.tmp-")


def _patch_shard_full(rank):
    """Rank 1's torch_dist shard of iteration 2 goes to /dev/full (every write: ENOSPC); the writer
    processes it forks inherit the patched ``open``."""
    if rank != 1:
        return None
    import builtins

    real_open = builtins.open

    def to_dev_full(file, mode="r", *args, **kwargs):
        name = os.fspath(file) if isinstance(file, (str, os.PathLike)) else ""
        if (
            "w" in mode
            and name.endswith("__1_0.distcp")
            and _only_at_iteration_2(Path(name).parent)
        ):
            file = "/dev/full"
        return real_open(file, mode, *args, **kwargs)

    builtins.open = to_dev_full
    return lambda: setattr(builtins, "open", real_open)


def _patch_extra_full(rank):
    """Rank 1's extra state of iteration 2 goes to /dev/full."""
    if rank != 1:
        return None
    from megatron_odc.runner import checkpoint

    original = checkpoint._save_sharded

    def to_dev_full(state, checkpoint_dir, model):
        original(state, checkpoint_dir, model)
        if _only_at_iteration_2(checkpoint_dir):
            os.symlink("/dev/full", checkpoint_dir / "extra_state_rank1.pt")

    checkpoint._save_sharded = to_dev_full
    return lambda: setattr(checkpoint, "_save_sharded", original)


def _patch_read_only(rank):
    """From iteration 2 on, --save refuses new entries as a read-only mount does (root ignores chmod)."""
    if rank != 0:
        return None
    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if _only_at_iteration_2(Path(path)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    os.mkdir = read_only
    return lambda: setattr(os, "mkdir", real_mkdir)


def _small_tmpfs(path: Path) -> bool:
    """A 1 MB tmpfs at ``path`` (data + one checkpoint of the tiny model fit, two do not); False
    where mounting is not allowed."""
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    mount = ["mount", "-t", "tmpfs", "-o", "size=1000k", "tmpfs", str(path)]
    return subprocess.run(mount, capture_output=True).returncode == 0


def test_save_failures_are_one_line_naming_save_iteration_file_and_error(tmp_path):
    """Before: ~45 traceback lines per rank (``CheckpointException``; "unexpected pos 704 vs 598"
    from torch's zip writer; a raw ``OSError`` for a read-only directory), the partial directory left."""
    train = ["--train-iters", "2", "--save-interval", "1"]
    tmpfs = tmp_path / "tmpfs"
    mounted = _small_tmpfs(tmpfs)
    cases = {
        # The OS error is checked below: megatron-core 0.19's writer drops it.
        "shard_full": (["rank 1 writing", "__1_*.distcp: "], ""),
        "extra_full": (["extra_state_rank1.pt: disk full (ENOSPC"], "free space"),
        "read_only": (
            ["read-only file system (EROFS", "nothing was written"],
            "make --save writable",
        ),
    }
    calls = [(name, [*train, "--save", str(tmp_path / name)]) for name in cases]
    if mounted:
        calls.append(("tmpfs", [*train, "--save", str(tmpfs / "ck")]))
    try:
        results = _by_name(run_ranks(_main_calls, 2, str(tmp_path), calls, timeout_s=300))
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(tmpfs)], check=False)
    for name, (fragments, advice) in cases.items():
        save = tmp_path / name
        message = _one_error(
            results[name],
            f"--save {save}: saving iteration 2 failed",
            *fragments,
            "the last good checkpoint in --save is iteration 1",
            advice,
            f"then resume with --load {save}",
        )
        assert "Traceback" not in results[name][0][2] + results[name][1][2]
        assert not list(save.glob("iter_*.tmp-*")), message
        assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        if name != "read_only":
            assert "was removed" in message, message
        if name == "shard_full":
            # megatron-core 0.16-0.18 pass the writer's OSError text on; 0.19 reports only its
            # class ("Worker failure: ... error: <class 'OSError'>"), and /dev/full leaves the file
            # system with free space to find ENOSPC by. A real full disk is named on every
            # release (the tmpfs case).
            named = "disk full (ENOSPC" in message and "free space" in message
            assert named or "<class 'OSError'>" in message, message
    if mounted:  # the real thing: whichever file the disk filled on
        _one_error(
            results["tmpfs"], f"--save {tmpfs / 'ck'}: saving iteration", "disk full (ENOSPC"
        )


_DAMAGES = {
    "no_metadata": "no .metadata",
    "no_common": "no common.pt",
    "truncated_metadata": "half a .metadata",
    "empty": "an empty iteration directory",
    "no_metadata_json": "no metadata.json",
    "no_extra_state_rank1": "no extra_state_rank1.pt",
    "legacy": "Megatron-LM's torch format",
    "legacy_release": "Megatron-LM's torch format, a release",
    "release": "a Megatron-LM release checkpoint",
}


def _damaged_copy(good: Path, dest: Path, damage: str) -> None:
    import torch

    shutil.copytree(good, dest)
    it = dest / "iter_0000002"
    if damage == "no_metadata":
        (it / ".metadata").unlink()
    elif damage == "no_common":
        (it / "common.pt").unlink()
    elif damage == "truncated_metadata":
        data = (it / ".metadata").read_bytes()
        (it / ".metadata").write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        shutil.rmtree(it)
        it.mkdir()
    elif damage == "no_metadata_json":
        (it / "metadata.json").unlink()
    elif damage == "no_extra_state_rank1":
        (it / "extra_state_rank1.pt").unlink()
    elif damage.startswith("legacy"):
        shutil.rmtree(it)
        if damage == "legacy_release":
            it = dest / "release"
            (dest / "latest_checkpointed_iteration.txt").write_text("release")
        (it / "mp_rank_00").mkdir(parents=True)
        torch.save({"iteration": 2, "model": {}}, it / "mp_rank_00" / "model_optim_rng.pt")
    elif damage == "release":  # Megatron-LM's name for a checkpoint to start from
        it.rename(dest / "release")
        (dest / "latest_checkpointed_iteration.txt").write_text("release")


def _loads(rank: int, world_size: int, workdir: str):
    """Saves a checkpoint, then loads damaged copies of it (made by rank 0) and the good one."""
    import torch.distributed as dist

    root = Path(workdir)
    good = root / "good"
    results = _main_calls(
        rank, world_size, workdir, [("save", ["--train-iters", "2", "--save", str(good)])]
    )
    # megatron-core 0.19 writes no common.pt (its common state is inside the torch_dist files).
    damages = [
        d for d in _DAMAGES if d != "no_common" or (good / "iter_0000002" / "common.pt").exists()
    ]
    if rank == 0:
        for damage in damages:
            _damaged_copy(good, root / damage, damage)
    dist.barrier()
    calls = [(d, ["--load", str(root / d), "--train-iters", "3"]) for d in damages]
    calls += [
        ("release_finetune", ["--load", str(root / "release"), "--finetune", "--train-iters", "1"]),
        ("good_finetune", ["--load", str(good), "--finetune", "--train-iters", "1"]),
        ("below", ["--load", str(good), "--train-iters", "1"]),
        ("at", ["--load", str(good), "--train-iters", "2"]),
    ]
    results.update(_main_calls(rank, world_size, workdir, calls))
    return results


def test_damaged_and_foreign_checkpoints_are_one_line_and_a_release_loads(tmp_path):
    """Before: 60-110 traceback lines per rank (FileNotFoundError, AttributeError inside
    megatron-core for a missing common.pt, UnpicklingError, CheckpointingException "is not a
    distributed checkpoint"); a missing extra_state_rank1.pt was "no 'sampler' entry" from rank 1
    alone; a release checkpoint was refused as "not a checkpoint directory"; --train-iters below the
    checkpoint's iteration exited 0 with no word."""
    runs = _by_name(run_ranks(_loads, 2, str(tmp_path), timeout_s=300))
    assert [r[0] for r in runs["save"]] == [0, 0], runs["save"]

    def load_error(damage, *fragments):
        return _one_error(runs[damage], f"--load {tmp_path / damage}: ", *fragments)

    for damage, missing in (
        ("no_metadata", ".metadata"),
        ("no_common", "common.pt"),
        ("no_metadata_json", "metadata.json"),
        ("no_extra_state_rank1", "extra_state_rank1.pt"),
    ):
        if damage not in runs:  # no common.pt to remove (megatron-core >= 0.19)
            assert damage == "no_common"
            assert current_release().common_state_file is None
            continue
        load_error(damage, "iteration 2", f"is incomplete: {missing} (", "is missing")
    load_error("truncated_metadata", "cannot be read: .metadata (UnpicklingError")
    load_error("empty", "is an empty directory")
    for damage in ("legacy", "legacy_release"):
        message = load_error(damage, "legacy torch format (mp_rank_00/model_optim_rng.pt)")
        assert "--ckpt-convert-format torch_dist --ckpt-convert-save OUT" in message
        assert "--ckpt-format torch" in message
    for name in ("release", "release_finetune", "good_finetune"):
        assert [r[0] for r in runs[name]] == [0, 0], runs[name]
    assert "(a release checkpoint)" in runs["release"][0][1]
    # Weights only, from iteration 0, as --finetune of the same weights: the same first loss.
    first = {
        name: LOSS.search(runs[name][0][1])[1]
        for name in ("release", "release_finetune", "good_finetune")
    }
    assert len(set(first.values())) == 1, first
    assert "iterations 0-3 of 3" in runs["release"][0][1]
    _one_error(runs["below"], "--train-iters 1 is below iteration 2", "--finetune")
    assert [r[0] for r in runs["at"]] == [0, 0], runs["at"]
    assert "nothing left to train" in runs["at"][0][1]
