"""A frozen reference model under ODC (``mcore/rl/reference.py``) next to a trained policy, 2 CPU ranks.

The reference (the small GPT, fp32, sharded over DP=2) runs forward only, 3 microbatches on rank 0 and
none on rank 1 (directly and through the external loop's forward-only schedule call), while the policy (same weights, ODC + Adam) trains a step in the same processes: its
logits equal the unwrapped model's bit for bit, it registers no gradient accumulator, installs no
gradient hook, pushes nothing, holds nothing unsharded after a forward, and its bytes on the device are
the parameter shards only (measured against the policy's shards + optimizer); offloaded it holds none,
and onloaded it computes the same logits. A frozen wrapper of a
parameter that still requires grad is refused in one line, and so is a training schedule call
(``forward_only=False``) on the reference.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests._dist import run_ranks
from tests._megatron import SMALL_GPT

FORWARDS = [3, 0]


def _run(rank: int, world_size: int) -> dict:
    from megatron.core.optimizer import OptimizerConfig

    from megatron_odc.mcore.backends import build_backend
    from megatron_odc.mcore.config import ODCConfig
    from megatron_odc.mcore.data_parallel import ODCDataParallel
    from megatron_odc.mcore.model import GPTConfig, build_gpt_model
    from megatron_odc.mcore.rl.reference import build_reference
    from megatron_odc.mcore.step import gpt_forward_step, train_step
    from tests._megatron import init_megatron, make_batch, teardown_megatron

    init_megatron(1, seed=5)
    try:
        cfg = GPTConfig(**SMALL_GPT)
        odc = ODCConfig(bucket_size=3000)
        bare = build_gpt_model(cfg, seed=11)
        policy, optimizer = build_backend(
            "odc",
            build_gpt_model(cfg, seed=11),
            OptimizerConfig(optimizer="adam", lr=3e-3),
            odc_config=odc,
        )
        reference = build_reference(build_gpt_model(cfg, seed=11), odc_config=odc)
        training_modules = sum(m.training for m in reference.modules())
        batches = [make_batch(cfg, 1, seed=50 + 10 * rank + i) for i in range(2)]
        train_step(policy, optimizer, gpt_forward_step, batches, seq_length=cfg.seq_length)
        equal = []
        with torch.no_grad():
            for i in range(FORWARDS[rank]):
                batch = make_batch(cfg, 1, seed=90 + i)
                args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
                equal.append(torch.equal(reference(*args), bare(*args)))
        # The same forwards through the external loop's schedule call (forward-only, 0 on rank 1).
        from megatron_odc.mcore.rl.loop import get_forward_backward_func

        def logits_step(data_iterator, model):
            batch = next(data_iterator)
            output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
            return output, lambda out: (out.sum(), {"logits": out.detach()})

        with torch.no_grad():
            scheduled = get_forward_backward_func()(
                forward_step_func=logits_step,
                data_iterator=iter(
                    [make_batch(cfg, 1, seed=90 + i) for i in range(FORWARDS[rank])]
                ),
                model=[reference],
                num_microbatches=FORWARDS[rank],
                seq_length=cfg.seq_length,
                micro_batch_size=1,
                forward_only=True,
            )
        with torch.no_grad():
            expected = [
                bare(b["tokens"], b["position_ids"], b["attention_mask"])
                for b in (make_batch(cfg, 1, seed=90 + i) for i in range(FORWARDS[rank]))
            ]
        equal_scheduled = [
            torch.equal(report["logits"], want) for report, want in zip(scheduled, expected)
        ]
        # Offload the reference between phases (no optimizer) and bring it back: same logits.
        from megatron_odc.mcore.rl.offload import device_nbytes, offload, onload

        moved = offload([reference])
        offloaded_bytes = device_nbytes([reference]).total
        onload(moved)
        with torch.no_grad():
            batch = make_batch(cfg, 1, seed=90)
            args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
            equal_after_onload = torch.equal(reference(*args), bare(*args))
        engine = reference.engine
        out = {
            "training_modules": training_modules,
            "offloaded_bytes": offloaded_bytes,
            "equal_after_onload": equal_after_onload,
            "scheduled_equal": equal_scheduled,
            "scheduled_count": len(scheduled),
            "logits_equal": equal,
            "grad_buffers": [n for n in engine.transport.buffer_names if ".grad." in n],
            "pushes": engine.telemetry.num_pushes,
            "grad_hooks": sum(
                len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
                for p in reference.module.parameters()
            ),
            "unsharded_after": engine.unsharded_nbytes(),
            "reference_bytes": engine.persistent_nbytes(),
            "policy_bytes": policy.engine.persistent_nbytes() + optimizer.persistent_nbytes(),
            "model_bytes": sum(p.numel() * p.element_size() for p in bare.parameters()),
        }
        try:
            ODCDataParallel(
                bare.config, reference.ddp_config, build_gpt_model(cfg, seed=11), frozen=True
            )
            out["refusal"] = "not refused"
        except ValueError as error:
            out["refusal"] = str(error)
        try:  # a training schedule call on the reference: it ran a backward nothing kept
            get_forward_backward_func()(
                forward_step_func=logits_step,
                data_iterator=iter([make_batch(cfg, 1, seed=90)]),
                model=[reference],
                num_microbatches=1,
                seq_length=cfg.seq_length,
                micro_batch_size=1,
                forward_only=False,
            )
            out["training_call"] = "not refused"
        except ValueError as error:
            out["training_call"] = str(error)
        reference.close()
        policy.close()
        return out
    finally:
        teardown_megatron()


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_ranks(_run, 2, timeout_s=300, pg_timeout_s=60)


def test_reference_forward_equals_the_unwrapped_model_with_uneven_counts(world) -> None:
    for rank, res in enumerate(world):
        assert res["logits_equal"] == [True] * FORWARDS[rank], rank
        # through get_forward_backward_func(forward_only=True): 0 microbatches return no outputs
        assert res["scheduled_count"] == FORWARDS[rank], rank
        assert res["scheduled_equal"] == [True] * FORWARDS[rank], rank


def test_reference_has_no_gradients_pushes_or_optimizer_and_holds_its_shards_only(world) -> None:
    for rank, res in enumerate(world):
        assert res["grad_buffers"] == [], rank
        assert res["training_modules"] == 0, rank  # eval mode: dropout off
        assert res["pushes"] == 0, rank
        assert res["grad_hooks"] == 0, rank
        assert res["unsharded_after"] == 0, rank
        # fp32 parameter shards only: about P x 4 / N bytes (padding aside), well under the policy's.
        assert res["reference_bytes"] <= 1.2 * res["model_bytes"] / 2, (rank, res)
        assert res["reference_bytes"] < res["policy_bytes"] / 3, (rank, res)
        assert "set requires_grad=False on every parameter" in res["refusal"], res["refusal"]
        assert "is a frozen ODC model" in res["training_call"], res["training_call"]
        assert "forward_only=True" in res["training_call"], res["training_call"]
        assert res["offloaded_bytes"] == 0, rank
        assert res["equal_after_onload"], rank
    res = world[0]
    logging.getLogger(__name__).info(
        "DP=2 rank 0: reference %d B on the device (parameter shards), policy %d B (shards, "
        "accumulators, main + Adam), unwrapped fp32 model %d B",
        res["reference_bytes"],
        res["policy_bytes"],
        res["model_bytes"],
    )
