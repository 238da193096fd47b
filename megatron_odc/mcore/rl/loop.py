"""The API an external training loop drives ODC through: build, loss contract, schedule call.

verl's Megatron engine and NeMo-RL call megatron-core themselves: they wrap the model in
``DistributedDataParallel``, build ``get_megatron_optimizer``, run ``get_forward_backward_func()(...,
num_microbatches=n)``, let the schedule call ``config.finalize_model_grads_func``, then
``optimizer.step()``. :func:`build_rl_backend` builds ODC (or any backend of ``backends.py``) for that
loop after checking the loss contract the caller declares; :func:`get_forward_backward_func` replaces
megatron-core's function of that name: its schedule accepts this rank's own count, 0 included
(``step.forward_backward``), and checks at the first microbatch that the loss function returns what
the declared contract means.

[Note: loss contracts under uneven counts]
With ``n_r`` microbatches on DP rank ``r`` and ``G`` loss tokens in the whole step, a contract is exact
when the gradient equals that of one process running every microbatch with the token-mean loss, for any
split of the microbatches over the ranks:

- ``per_token`` (Megatron's ``calculate_per_token_loss=True``): the loss function returns ``(token-loss
  sum, token count, report)``; the schedule sums the counts, ``finalize_model_grads`` all-reduces them
  over DP and divides the summed gradients by ``G``. No rank needs ``G`` in advance.
- ``global_tokens`` (verl, NeMo-RL since PR 1940; ``calculate_per_token_loss=False``): the caller
  all-reduces ``G`` before the schedule and its loss function returns ``(token-loss sum x n_r x D / G,
  report)`` (:func:`global_tokens_scale`), ``D`` the DP size; the schedule divides by the rank-local
  ``n_r``, the backend averages over DP (megatron-core's DDP before its all-reduce, ODC after its fence),
  leaving ``sum / G``. Exact as long as ``n_r`` is this rank's own count.

Not exact under uneven counts, refused: ``per_rank_mean`` (each rank's loss is its own token mean, as
AMD Primus' ODC port ships: ranks with fewer tokens weigh more) and ``microbatch_mean`` (Megatron's
3-tuple loss without ``calculate_per_token_loss``: each microbatch's token mean, then the mean over
microbatches and ranks, which weighs a microbatch by ``1 / (n_r x its tokens)``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig
from megatron.core.utils import get_model_config

from megatron_odc.mcore.backends import build_backend
from megatron_odc.mcore.config import (
    LOCKSTEP_TRANSPORT,
    ODC_ENGINE_BACKENDS,
    ODCConfig,
    moe_auxiliary_losses_on,
)
from megatron_odc.mcore.optimizer import check_optimizer_config
from megatron_odc.mcore.step import forward_backward
from megatron_odc.transport.devices import every_rank_int


@dataclasses.dataclass(frozen=True)
class LossContract:
    """How a loss is normalised, and what megatron-core must be told for it.

    Attributes:
        calculate_per_token_loss: the ``TransformerConfig`` flag the contract needs.
        loss_outputs: how many values the loss function returns (3: Megatron's per-token tuple).
        description: what the loss function returns, for the errors.
    """

    calculate_per_token_loss: bool
    loss_outputs: int
    description: str


LOSS_CONTRACTS: dict[str, LossContract] = {
    "per_token": LossContract(
        True,
        3,
        "loss function returns (token-loss sum, token count, report); finalize divides by G",
    ),
    "global_tokens": LossContract(
        False,
        2,
        "loss function returns (token-loss sum x local num_microbatches x DP size / global tokens, "
        "report) (verl, NeMo-RL)",
    ),
}
"""The contracts exact under uneven microbatch counts ([Note: loss contracts under uneven counts])."""

INEXACT_CONTRACTS: dict[str, str] = {
    "per_rank_mean": "each rank's mean over its own tokens weighs a rank with fewer tokens more",
    "microbatch_mean": "a mean over each rank's own microbatches weighs a microbatch by 1 / (local "
    "count x its tokens)",
}
"""Contracts that are not exact under uneven counts, with why (refused by :func:`check_loss_contract`)."""

_USE_INSTEAD = (
    "declare 'per_token' (Megatron's per-token loss) or 'global_tokens' (verl's contract)"
)


def check_loss_contract(name: str, config: Any) -> LossContract:
    """The contract ``name``, checked against the model's ``TransformerConfig``.

    Raises:
        ValueError: a contract not exact under uneven counts (why, and what to declare instead), an
            unknown name, or a config whose ``calculate_per_token_loss`` means another contract.
    """
    if name in INEXACT_CONTRACTS:
        raise ValueError(
            f"loss contract {name!r} is not exact when ranks run different numbers of microbatches "
            f"({INEXACT_CONTRACTS[name]}); {_USE_INSTEAD}"
        )
    if name not in LOSS_CONTRACTS:
        raise ValueError(f"unknown loss contract {name!r}; {_USE_INSTEAD}")
    contract = LOSS_CONTRACTS[name]
    if bool(config.calculate_per_token_loss) != contract.calculate_per_token_loss:
        raise ValueError(
            f"loss contract {name!r} ({contract.description}) needs TransformerConfig."
            f"calculate_per_token_loss={contract.calculate_per_token_loss}, the model has "
            f"{config.calculate_per_token_loss}"
        )
    auxiliary = _count_scaled_auxiliary_losses(config)
    if auxiliary and not contract.calculate_per_token_loss:
        raise ValueError(
            f"loss contract {name!r} with {' and '.join(auxiliary)}: without "
            "calculate_per_token_loss megatron-core scales those losses by 1 / the rank's own "
            "microbatch count, which weighs a rank with fewer microbatches more when counts differ; "
            "declare 'per_token' (calculate_per_token_loss=True)"
        )
    return contract


def _count_scaled_auxiliary_losses(config: Any) -> list[str]:
    """The auxiliary losses of ``config`` that megatron-core's schedule scales by the local
    microbatch count unless ``calculate_per_token_loss`` (MoE load-balancing / z-loss, MTP)."""
    found = []
    if moe_auxiliary_losses_on(
        getattr(config, "num_moe_experts", None),
        getattr(config, "moe_aux_loss_coeff", 0.0),
        getattr(config, "moe_z_loss_coeff", None),
    ):
        found.append("MoE auxiliary losses (moe_aux_loss_coeff / moe_z_loss_coeff)")
    if getattr(config, "mtp_num_layers", None):
        found.append("multi-token prediction (mtp_num_layers)")
    return found


def contract_of(config: Any) -> tuple[str, LossContract]:
    """The exact contract a ``TransformerConfig`` means (by ``calculate_per_token_loss``)."""
    for name, contract in LOSS_CONTRACTS.items():
        if contract.calculate_per_token_loss == bool(config.calculate_per_token_loss):
            return name, contract
    raise AssertionError("every value of calculate_per_token_loss has a contract")


def global_tokens_scale(num_microbatches: int, global_num_tokens: int, dp_size: int) -> float:
    """The factor of the ``global_tokens`` contract: a microbatch's token-loss sum times it is its loss.

    ``num_microbatches`` is this rank's own count (not a maximum over ranks), ``global_num_tokens`` the
    loss tokens of the whole step over every DP rank (the caller all-reduces it before the schedule).
    """
    return num_microbatches * dp_size / max(int(global_num_tokens), 1)


def build_rl_backend(
    name: str,
    model: torch.nn.Module,
    optimizer_config: OptimizerConfig,
    *,
    loss_contract: str,
    odc_config: ODCConfig | None = None,
    grad_reduce_in_fp32: bool = True,
) -> tuple[torch.nn.Module, Any]:
    """Wrap ``model`` and build its optimizer for an external loop (``backends.build_backend``), after
    the refusals that need no communication: the loss contract against the model's config, and for
    ``odc`` / ``fsdp`` an optimizer that cannot be sharded element-wise.

    Wires ``config.finalize_model_grads_func`` and ``config.grad_scale_func`` as Megatron-LM does; the
    caller may overwrite ``no_sync_func`` / ``grad_sync_func`` with the wrapper's (ODC's are no-ops).

    Returns:
        ``(wrapped_model, optimizer)``.

    Raises:
        ValueError: see :func:`check_loss_contract`, ``optimizer.check_optimizer_config`` and
            ``build_backend``.
    """
    check_loss_contract(loss_contract, model.config)
    if name in ODC_ENGINE_BACKENDS:
        check_optimizer_config(optimizer_config)
    return build_backend(
        name,
        model,
        optimizer_config,
        odc_config=odc_config,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
    )


def checked_forward_step(forward_step_func: Callable, contract_name: str) -> Callable:
    """``forward_step_func`` whose loss function's outputs are checked against the contract.

    Raises (from the loss function, at the first microbatch):
        ValueError: a loss function returning the other contract's tuple (e.g. Megatron's 3-tuple
            without ``calculate_per_token_loss``: a per-microbatch token mean).
    """
    expected = LOSS_CONTRACTS[contract_name].loss_outputs

    def check(loss_func: Callable, *args: Any, **kwargs: Any) -> Any:
        outputs = loss_func(*args, **kwargs)
        if kwargs.get("non_loss_data", False) or len(outputs) == expected:
            return outputs
        if contract_name == "global_tokens":
            raise ValueError(
                "the loss function returned (sum, num_tokens, report) but the model has "
                "calculate_per_token_loss=False: megatron-core then takes each microbatch's token "
                f"mean, not exact under uneven counts ({INEXACT_CONTRACTS['microbatch_mean']}); set "
                "calculate_per_token_loss=True or return (sum x local n x DP size / global tokens, "
                "report)"
            )
        raise ValueError(
            f"the loss function returned {len(outputs)} values but the model has "
            "calculate_per_token_loss=True: return (token-loss sum, token count, report)"
        )

    @functools.wraps(forward_step_func)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        output, loss_func = forward_step_func(*args, **kwargs)
        return output, functools.partial(check, loss_func)

    return forward_step


def check_lockstep_counts(model: Any, num_microbatches: Any) -> None:
    """On the lockstep ``fsdp`` backend, every DP rank must run the same number of microbatches: each
    bucket's all-gather / reduce-scatter is a collective, so a rank with fewer would leave the others
    waiting in one until the process group's timeout. Collective over DP (one small all-reduce per
    schedule call) on that backend only; ODC and megatron-core's DDP take any counts.

    Raises:
        ValueError: naming each DP rank's count and what to do instead.
    """
    odc_config = getattr(model, "odc_config", None)
    if odc_config is None or odc_config.transport != LOCKSTEP_TRANSPORT:
        return
    counts = every_rank_int(int(num_microbatches or 0), model.dp_group)
    if len(set(counts)) > 1:
        listed = ", ".join(f"DP rank {r}: {c}" for r, c in enumerate(counts))
        raise ValueError(
            f"the fsdp backend runs every bucket as a collective, so every DP rank must run the same "
            f"number of microbatches; got {listed}. Use the odc backend (any count per rank, 0 "
            "included) or pad every rank to the largest count with empty microbatches"
        )


def refuse_training_a_frozen_model(chunks: list) -> None:
    """A training schedule call on a frozen ODC model (``reference.build_reference``: no gradient
    accumulators, no optimizer) would compute a backward that nothing keeps.

    Raises:
        ValueError: naming the chunk and the call to make instead.
    """
    for index, chunk in enumerate(chunks):
        engine = getattr(chunk, "engine", None)
        if engine is not None and not engine.gradients:
            raise ValueError(
                f"model chunk {index} is a frozen ODC model (built by build_reference: no gradients, "
                "no optimizer); it runs forward only, so call the schedule with forward_only=True"
            )


def get_forward_backward_func(*args: Any, **kwargs: Any) -> Callable:
    """Drop-in for megatron-core's ``get_forward_backward_func`` (the arguments are ignored: the
    schedule follows megatron-core's parallel state, as its own does when called without them).

    The function it returns takes the same keyword arguments; ``num_microbatches`` is this rank's own
    count, 0 included (``step.forward_backward``), the same on every stage of one pipeline and, on the
    lockstep ``fsdp`` backend, on every DP rank (each refused in one line otherwise), and a training
    call's loss function is checked against the model's contract
    (:func:`checked_forward_step`).
    """

    def schedule(*, forward_step_func: Callable, model: Any, **call: Any) -> list:
        chunks = model if isinstance(model, list) else [model]
        check_lockstep_counts(chunks[0], call.get("num_microbatches"))
        if not call.get("forward_only", False):  # a forward-only loss trains nothing: any tuple
            refuse_training_a_frozen_model(chunks)
            name, _ = contract_of(get_model_config(chunks[0]))
            forward_step_func = checked_forward_step(forward_step_func, name)
        return forward_backward(forward_step_func=forward_step_func, model=model, **call)

    return schedule
