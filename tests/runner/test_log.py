"""``runner/log.py``'s handler: rank 0 prints the job's warnings, every rank its own ones and errors."""

from __future__ import annotations

import io
import logging

import pytest

from megatron_odc.runner import log


@pytest.fixture
def captured():
    """The package handler of ``setup_logging``, writing to a buffer; removed afterwards."""
    package = logging.getLogger("megatron_odc")
    saved = (package.level, package.propagate, list(package.handlers))
    for handler in list(package.handlers):
        package.removeHandler(handler)
    buffer = io.StringIO()
    yield package, buffer
    for handler in list(package.handlers):
        package.removeHandler(handler)
    package.setLevel(saved[0])
    package.propagate = saved[1]
    for handler in saved[2]:
        package.addHandler(handler)


def _lines(captured, rank: int) -> list[str]:
    package, buffer = captured
    log.setup_logging(rank)
    next(h for h in package.handlers if h.name == log.HANDLER_NAME).setStream(buffer)
    logging.getLogger("megatron_odc.data.sft").warning("job: samples truncated")
    logging.getLogger("megatron_odc.runner.trainer").info("job: iteration line")
    logging.getLogger("megatron_odc.transport.shm").warning("own: could not clean")
    logging.getLogger("megatron_odc.runner.health").warning("own: watchdog")
    logging.getLogger("megatron_odc.mcore.optimizer").error("own: an error")
    return [line.split("] ", 1)[1] for line in buffer.getvalue().splitlines()]


def test_rank_0_prints_everything(captured):
    assert _lines(captured, 0) == [
        "job: samples truncated",
        "job: iteration line",
        "own: could not clean",
        "own: watchdog",
        "own: an error",
    ]


def test_other_ranks_print_only_their_own_warnings_and_errors(captured):
    assert _lines(captured, 1) == ["own: could not clean", "own: watchdog", "own: an error"]


def test_a_second_setup_as_rank_0_drops_the_filter(captured):
    _lines(captured, 1)
    captured[1].seek(0)
    captured[1].truncate()
    assert "job: samples truncated" in _lines(captured, 0)


def test_under_megatron_lms_logging_only_rank_0_prints_the_jobs_info(caplog):
    """The launcher's lines (the flags it set, the loader it built) went out once per rank under
    Megatron-LM's root logging; ranks other than 0 now keep only warnings and errors."""
    from megatron_odc.runner.launch_env import launch_rank

    assert launch_rank({"RANK": "3"}) == 3
    assert launch_rank({"OMPI_COMM_WORLD_RANK": "2"}) == 2
    assert launch_rank({}) == 0
    package = logging.getLogger("megatron_odc")
    saved = package.level
    try:
        for rank in (0, 1):
            package.setLevel(logging.NOTSET)
            caplog.clear()
            log.job_info_on_rank_zero(rank)
            with caplog.at_level(logging.INFO):  # the root's level, as Megatron-LM sets it
                logging.getLogger("megatron_odc.integration.megatron_lm.flags").info("job line")
                logging.getLogger("megatron_odc.integration.megatron_lm.data").warning("warned")
            got = [r.getMessage() for r in caplog.records]
            assert got == (["job line", "warned"] if rank == 0 else ["warned"]), (rank, got)
    finally:
        package.setLevel(saved)
