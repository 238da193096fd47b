"""Offload / onload between phases (``mcore/rl/offload.py``) on a real megatron-core GPT, 2 CPU ranks.

For the CUDA transport on the faked GPU (``tests/_fake_cuda.py``: symmetric memory as shared host
memory) and for the shm transport, both with deterministic accumulation: 2 steps, offload (shards,
optimizer state, unsharded buffers), onload, 2 more steps equal an uninterrupted 4-step run bit for bit
(per-step loss, grad norm, final parameters), with uneven counts including 0. The device bytes are
measured from the live tensors before the offload, while offloaded (none left) and after the onload
(the same as before); a fetch while offloaded is refused in one line, and so are an offload of
offloaded shards, an offload inside a step and a weight-sync iterator resumed after a step, each
without disturbing the run (they read or freed the optimizer's memory).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests._dist import run_ranks
from tests._megatron import SMALL_GPT

COUNTS = [[1, 3], [2, 0], [0, 2], [3, 1]]
OFFLOAD_AFTER = 2


def _train(transport: str, offload_after: int | None) -> dict:
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig

    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.config import ODCConfig
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from megatron_odc.mcore.rl.offload import device_nbytes, offload, onload
    from megatron_odc.mcore.step import gpt_forward_step, train_step
    from tests._megatron import make_batch

    cfg = GPTConfig(**SMALL_GPT)
    model, optimizer = build_backend(
        "odc",
        build_gpt_model(cfg, seed=11),
        OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.1, clip_grad=0.05),
        odc_config=ODCConfig(transport=transport, deterministic=True, bucket_size=3000),
    )
    rank = dist.get_rank()
    out: dict = {"losses": [], "norms": [], "bytes": {}}
    for step, counts in enumerate(COUNTS):
        if step == offload_after:
            out["bytes"]["before"] = device_nbytes([model], optimizer)
            transport = model.engine.transport
            out["bytes"]["expected_shards"] = sum(
                transport.local(name).nbytes
                # deterministic mode: each fp32 accumulate buffer has one shard-sized slot per source
                * (1 + (dist.get_world_size() if transport.spec(name).accumulate else 0))
                for name in transport.buffer_names
            )
            try:  # a model that trains, offloaded without its optimizer: refused, nothing moved
                offload([model])
                out["model_only"] = "not refused"
            except ValueError as error:
                out["model_only"] = str(error)
            moved = offload([model], optimizer)
            out["bytes"]["offloaded"] = device_nbytes([model], optimizer)
            try:  # refused before the optimizer's (freed) tensors are read: it crashed (SIGSEGV)
                offload([model], optimizer)
                out["offload_twice"] = "not refused"
            except RuntimeError as error:
                out["offload_twice"] = str(error)
            try:
                model.state_dict()
                out["fetch_while_offloaded"] = "not refused"
            except RuntimeError as error:
                out["fetch_while_offloaded"] = str(error)
            # the optimizer's tensors are freed: reading them would crash the process (it did:
            # SIGSEGV in state_dict's clone of a main shard), so each is refused in one line
            out["optimizer_while_offloaded"] = {}
            for name, call in (("step", optimizer.step), ("state_dict", optimizer.state_dict)):
                try:
                    call()
                    out["optimizer_while_offloaded"][name] = "not refused"
                except RuntimeError as error:
                    out["optimizer_while_offloaded"][name] = str(error)
            onload(moved)
            out["bytes"]["onloaded"] = device_nbytes([model], optimizer)
        batches = [make_batch(cfg, 1, seed=100 * step + 10 * rank + i) for i in range(counts[rank])]
        if offload_after is not None and step == offload_after - 1:
            report = _step_refusing_offload(model, optimizer, batches, cfg.seq_length, out)
        else:
            report = train_step(
                model, optimizer, gpt_forward_step, batches, seq_length=cfg.seq_length
            )
        loss = torch.zeros(2)
        for item in report["losses"]:
            loss += item["lm loss"]
        out["losses"].append(loss.tolist())
        out["norms"].append(float(report["grad_norm"]))
    out["params"] = model.engine.full_parameters()
    out["transport"] = type(model.engine.transport).__name__
    model.close()
    return out


def _step_refusing_offload(model, optimizer, batches, seq_length: int, out: dict) -> dict:
    """``train_step`` with what must not disturb it: a weight-sync iterator paused across the step
    (resumed after it: refused, where it read freed memory), and an offload after the schedule,
    before the optimizer step (through ``train_step``'s ``phase`` hook; refused before anything
    moves, where it freed the optimizer's tensors first). The run stays bitwise the plain one."""
    import contextlib

    from megatron_odc.mcore.rl.offload import offload
    from megatron_odc.mcore.rl.weight_sync import iter_full_weights
    from megatron_odc.mcore.step import gpt_forward_step, train_step

    def phase(name: str):
        if name == "optimizer step":
            try:
                offload([model], optimizer)
                out["offload_mid_step"] = "not refused"
            except RuntimeError as error:
                out["offload_mid_step"] = str(error)
        return contextlib.nullcontext()

    paused = iter_full_weights(model)
    next(paused)
    report = train_step(
        model, optimizer, gpt_forward_step, batches, seq_length=seq_length, phase=phase
    )
    try:
        next(paused)
        out["resumed_iterator"] = "not refused"
    except RuntimeError as error:
        out["resumed_iterator"] = str(error)
    return report


def _run(rank: int, world_size: int) -> dict:
    from tests._fake_cuda import install_fake_cuda
    from tests._megatron import init_megatron, teardown_megatron

    init_megatron(1, seed=5)
    out = {}
    try:
        out["shm"] = (_train("shm", None), _train("shm", OFFLOAD_AFTER))
        fake = install_fake_cuda()
        try:
            out["cuda"] = (_train("cuda", None), _train("cuda", OFFLOAD_AFTER))
        finally:
            fake.revert()
    finally:
        teardown_megatron()
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_ranks(_run, 2, timeout_s=300, pg_timeout_s=60)


@pytest.mark.parametrize("transport", ["cuda", "shm"])
def test_offload_onload_mid_training_is_bitwise_a_run_without_it(world, transport) -> None:
    for rank, res in enumerate(world):
        plain, offloaded = res[transport]
        assert offloaded["losses"] == plain["losses"], rank
        assert offloaded["norms"] == plain["norms"], rank
        assert sorted(offloaded["params"]) == sorted(plain["params"])
        for name, value in plain["params"].items():
            assert torch.equal(offloaded["params"][name], value), (rank, name)
    assert world[0]["cuda"][0]["transport"] == "CudaSymmTransport"


@pytest.mark.parametrize("transport", ["cuda", "shm"])
def test_offload_frees_every_device_byte_and_onload_restores_them(world, transport) -> None:
    for rank, res in enumerate(world):
        _, run = res[transport]
        before, offloaded, onloaded = (run["bytes"][k] for k in ("before", "offloaded", "onloaded"))
        assert before.shards > 0, (rank, before)
        assert before.shards == run["bytes"]["expected_shards"], (rank, before, run["bytes"])
        assert before.optimizer > 0, (rank, before)
        assert before.unsharded == 0, (rank, before)
        assert offloaded.total == 0, (rank, offloaded)
        assert onloaded == before, (rank, onloaded, before)
        assert "offloaded; onload them first" in run["fetch_while_offloaded"]
        for name, message in run["optimizer_while_offloaded"].items():
            assert "offloaded; onload them first" in message, (rank, name, message)
        assert "chunk 0 trains" in run["model_only"], run["model_only"]
        assert run["offload_twice"].endswith("the owned shards are already offloaded"), run
        assert "offload between steps, not in minibatch phase" in run["offload_mid_step"], run
        assert "iterator was resumed after the parameters changed" in run["resumed_iterator"]
        assert "offload(model_chunks, optimizer)" in run["model_only"]
    before = world[0][transport][1]["bytes"]["before"]
    logging.getLogger(__name__).info(
        "%s transport, rank 0: device bytes before offload %s (total %d), offloaded 0, onloaded equal",
        transport,
        before,
        before.total,
    )
