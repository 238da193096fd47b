"""The sharded mixed-precision optimizer over ODC's owned shards, with Megatron's optimizer surface.

``ODCOptimizer`` keeps, for every bucket, an fp32 *main* shard of the elements this DP rank owns and the
inner optimizer's state (Adam: two more fp32 tensors) for those elements only. Each owned piece of a
parameter becomes one optimizer tensor (a view into the main shard) whose ``.grad`` is a view into the
bucket's fp32 gradient accumulator, so the param groups of megatron-core's ``_get_param_groups`` (weight
decay and lr multipliers, what ``OptimizerParamScheduler`` reads) apply per parameter as in Megatron.

``step()`` = unscale and check for inf/nan (fp16; every rank agrees through one all-reduce), global grad
norm over the owned pieces summed over DP and TP without double-counting TP-duplicated or shared params
(or, with hybrid sharding, the replicas of a shard: only replica 0 counts),
clipping, the inner step, then writing the compute-dtype shard that peers fetch next minibatch (FP8
parameters: the engine's codec re-quantises the owned bytes, with one DP-wide amax reduction). It returns
``(success, grad_norm, num_zeros)`` like ``MegatronOptimizer.step``. Gradients are read where the owners
accumulated them; nothing is copied per parameter. Everything lives on the engines' device; the scalar
reductions run on the process group's device.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides
from megatron.core.optimizer import _get_param_groups as megatron_param_groups
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes

from megatron_odc.core.engine import ODCEngine
from megatron_odc.core.storage import OwnedPiece
from megatron_odc.mcore.config import refuse_unsupported
from megatron_odc.mcore.dist_ckpt import optimizer_state
from megatron_odc.transport.devices import all_reduce_on_group_device

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OptimizerPiece:
    """One owned run of a parameter, as the inner optimizer sees it.

    Attributes:
        main: the optimizer's tensor: a view of the fp32 main shard over ``owned``; its ``.grad`` is a
            view of the engine's gradient accumulator over the same run.
        engine: the engine that owns the run.
        owned: the run.
        counted_in_norm: whether its gradient counts in the global norm on this rank.
        norm_group: the parameter's separate gradient-norm group (megatron-core 0.19 tags multi-token
            prediction's parameters ``grad_norm_group="mtp"``: norm and clipping of their own), or
            None for the main norm.
    """

    main: torch.nn.Parameter
    engine: ODCEngine
    owned: OwnedPiece
    counted_in_norm: bool
    norm_group: str | None = None


def _param_is_counted_in_norm(param: torch.nn.Parameter, tp_rank: int, replica_rank: int) -> bool:
    """Whether a parameter's gradient counts in the global norm on this rank (Megatron's filters;
    with hybrid sharding only the first replica of each shard counts)."""
    if getattr(param, "shared", False) or replica_rank != 0:
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


_GRAD_NORM_GROUP_ATTR = "grad_norm_group"
"""The parameter attribute megatron-core 0.19 tags separate gradient-norm groups with (MTP: ``"mtp"``)."""


def _norm_groups_of(model_chunks: list, group: dist.ProcessGroup) -> tuple[str, ...]:
    """The separate gradient-norm groups of any rank's parameters (with pipeline stages only some
    stages hold them): one object all-gather, so every rank reduces the same norms at each step."""
    local = {
        getattr(p, _GRAD_NORM_GROUP_ATTR, None)
        for chunk in model_chunks
        for p in chunk.parameters()
    } - {None}
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sorted(local), group=group)
    return tuple(sorted(set().union(*map(set, gathered))))


def fused_multi_tensor(
    optimizer_cls: type[torch.optim.Optimizer], param_groups: list[dict], **options
) -> tuple[torch.optim.Optimizer, str]:
    """``optimizer_cls`` with torch's fused multi-tensor kernel where it runs, else ``foreach``.

    torch's ``fused=True`` Adam/AdamW/SGD is one kernel over all tensors on CUDA and on CPU (torch >=
    2.4); the per-tensor loop torch picks by default on CPU was 6x slower on this machine (8 x 1M
    elements: 31 ms vs 5 ms per step). megatron-core prefers TransformerEngine's or apex's FusedAdam on
    GPUs; torch's fused kernel is kept there too because the checkpoint code (``dist_ckpt/``, the
    interop with megatron-core's distributed optimizer) reads torch's per-parameter state layout.

    Returns:
        The optimizer and a name of the implementation for the log.
    """
    try:
        return optimizer_cls(param_groups, fused=True, **options), f"{optimizer_cls.__name__} fused"
    except (RuntimeError, TypeError, ValueError) as error:  # no fused kernel for these tensors
        logger.debug("fused %s unavailable (%s); using foreach", optimizer_cls.__name__, error)
        optimizer = optimizer_cls(param_groups, foreach=True, **options)
        return optimizer, f"{optimizer_cls.__name__} foreach"


def check_optimizer_config(config: OptimizerConfig) -> None:
    """Every refusal of the ODC optimizer, before anything is built (no communication).

    Raises:
        ValueError: an optimizer it cannot shard element-wise (only adam and sgd), or an option it
            does not combine with (``config.UNSUPPORTED``), named.
    """
    if config.optimizer not in ("adam", "sgd"):
        raise ValueError(
            f"--optimizer {config.optimizer!r} is not supported by the ODC optimizer (adam, sgd)"
        )
    refuse_unsupported(
        "odc",
        use_distributed_optimizer=config.use_distributed_optimizer,
        use_precision_aware_optimizer=config.use_precision_aware_optimizer,
        optimizer_cuda_graph=getattr(config, "optimizer_cuda_graph", None),  # 0.17+ field
    )


def _onloaded(method: Callable) -> Callable:
    """``method`` refused in one line while the engines' shards are offloaded (``rl/offload.py``):
    the optimizer's tensors are freed then, and reading them would crash the process."""

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        for engine in self.engines:
            engine.check_open()
        return method(self, *args, **kwargs)

    return checked


class ODCOptimizer(MegatronOptimizer):
    """Adam (or SGD) over the owned shards of every ODC-wrapped model chunk.

    Args:
        config: megatron-core ``OptimizerConfig`` (optimizer, lr, weight decay, Adam betas/eps, clip_grad,
            fp16/bf16 and loss-scale fields, ``log_num_zeros_in_grad``).
        model_chunks: ``ODCDataParallel`` instances (they expose ``engine``).
        config_overrides: per-parameter overrides, as for ``get_megatron_optimizer``.
        grad_stats_group: group over which grad norms, zero counts and inf flags are reduced; default
            the whole world (each element is owned by exactly one DP rank of each TP rank).
    """

    def __init__(
        self,
        config: OptimizerConfig,
        model_chunks: list,
        config_overrides: dict | None = None,
        grad_stats_group: dist.ProcessGroup | None = None,
    ) -> None:
        check_optimizer_config(config)
        self.model_chunks = list(model_chunks)
        self.engines: list[ODCEngine] = [chunk.engine for chunk in self.model_chunks]
        self.grad_stats_parallel_group = grad_stats_group or dist.group.WORLD
        self.tp_rank = (
            parallel_state.get_tensor_model_parallel_rank()
            if parallel_state.model_parallel_is_initialized()
            else 0
        )
        if config_overrides is None:
            # get_megatron_optimizer's default (no weight decay on biases and 1-D params, decoupled
            # lr): megatron-core 0.16/0.17 apply it inside _get_param_groups, 0.18+ only there.
            config_overrides = get_standard_config_overrides(config)
        groups = megatron_param_groups(self.model_chunks, config, config_overrides)
        group_of_param = {id(p): i for i, g in enumerate(groups) for p in g["params"]}

        # fp32 main shards (one flat tensor per bucket) and the optimizer's per-piece views.
        self._main_shards: list[list[torch.Tensor]] = []
        self.pieces: list[OptimizerPiece] = []
        """Every owned run of every trainable parameter, in the engines' layout order."""
        pieces_by_group: list[list[torch.nn.Parameter]] = [[] for _ in groups]
        for engine in self.engines:
            params = dict(engine.parameters())
            mains = []
            for bucket in engine.layout.buckets:
                shard = engine.param_shard(bucket.index)
                if bucket.dtype == torch.uint8:  # FP8 bytes: the master starts from their values
                    mains.append(
                        torch.zeros(shard.numel(), dtype=torch.float32, device=shard.device)
                    )
                else:
                    mains.append(shard.detach().to(torch.float32).clone())
            for owned in engine.owned_pieces():
                model_param = params[owned.name]
                main = mains[owned.bucket_index][owned.shard_lo : owned.shard_hi]
                if owned.name in engine.fp8_names:
                    main.copy_(
                        engine.fp8_codec.master_values(
                            model_param, owned.param_start, engine.owned.piece_param(owned)
                        )
                    )
                if not model_param.requires_grad:
                    continue
                piece = torch.nn.Parameter(main)
                piece.grad = engine.owned.piece_grad(owned)
                copy_tensor_model_parallel_attributes(piece, model_param)
                if getattr(model_param, "shared", False):
                    piece.shared = True
                pieces_by_group[group_of_param[id(model_param)]].append(piece)
                self.pieces.append(
                    OptimizerPiece(
                        piece,
                        engine,
                        owned,
                        _param_is_counted_in_norm(model_param, self.tp_rank, engine.replica_rank),
                        getattr(model_param, _GRAD_NORM_GROUP_ATTR, None),
                    )
                )
            self._main_shards.append(mains)

        inner_groups = []
        for group, pieces in zip(groups, pieces_by_group):
            inner = {k: v for k, v in group.items() if k != "params"}
            inner["params"] = pieces
            inner_groups.append(inner)
        if config.optimizer == "adam":
            adam_cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
            inner_opt, self.implementation = fused_multi_tensor(
                adam_cls,
                inner_groups,
                lr=config.lr,
                weight_decay=config.weight_decay,
                betas=(config.adam_beta1, config.adam_beta2),
                eps=config.adam_eps,
            )
        else:
            inner_opt, self.implementation = fused_multi_tensor(
                torch.optim.SGD,
                inner_groups,
                lr=config.lr,
                weight_decay=config.weight_decay,
                momentum=config.sgd_momentum,
            )
        logger.info("ODC optimizer on the owned shards: %s", self.implementation)
        super().__init__(inner_opt, config)
        self.is_stub_optimizer = False

        if config.fp16:
            if config.loss_scale:
                self.grad_scaler = ConstantGradScaler(config.loss_scale)
            else:
                self.grad_scaler = DynamicGradScaler(
                    initial_scale=config.initial_loss_scale,
                    min_scale=config.min_loss_scale,
                    growth_factor=2.0,
                    backoff_factor=0.5,
                    growth_interval=config.loss_scale_window,
                    hysteresis=config.hysteresis,
                )
        elif config.bf16 and config.loss_scale:
            self.grad_scaler = ConstantGradScaler(config.loss_scale)
        else:
            self.grad_scaler = None
        self.device = self.engines[0].device if self.engines else torch.device("cpu")
        self._scale_one = torch.ones(1, dtype=torch.float32, device=self.device)
        self.norm_groups = _norm_groups_of(self.model_chunks, self.grad_stats_parallel_group)
        """The separate gradient-norm groups of the model, the same on every rank."""
        self.grad_norms_by_group: dict[str, float] = {}
        self._mains_follow_model = False
        """Whether the model's shards were loaded after the main shards last were (see
        :meth:`model_params_loaded`): the mains are refreshed from them before they are next read."""

    # ------------------------------------------------------------------ Megatron surface

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale (1.0 without a scaler)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else self._scale_one

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the accumulators are zeroed when the next minibatch begins."""

    def _owned_grads(self) -> list[torch.Tensor]:
        return [piece.main.grad for piece in self.pieces]

    @_onloaded
    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Unscale the owned gradients (fp16); return whether any rank found inf/nan."""
        if self.grad_scaler is None:
            return False
        found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        inv_scale = self.grad_scaler.inv_scale.to(device=self.device, dtype=torch.float32)
        for grad in self._owned_grads():
            grad.mul_(inv_scale)
            found_inf = torch.maximum(found_inf, (~torch.isfinite(grad)).any().float())
        all_reduce_on_group_device(found_inf, dist.ReduceOp.MAX, self.grad_stats_parallel_group)
        found = bool(found_inf.item() > 0)
        self.grad_scaler.update(found)
        if found:
            self._end_step()  # the step is skipped, but the minibatch still ends with its fence
        return found

    def _sum_over_model(
        self,
        per_grad: Callable[[torch.Tensor], torch.Tensor],
        grads: list[torch.Tensor] | None = None,
    ) -> float:
        """``per_grad`` summed over every gradient element of the model once (over DP and TP), or over
        ``grads`` (this rank's share of one norm group, from :meth:`get_grads_for_grad_norm`)."""
        if grads is None:
            grads = [piece.main.grad for piece in self.pieces if piece.counted_in_norm]
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for grad in grads:
            total += per_grad(grad)
        all_reduce_on_group_device(total, group=self.grad_stats_parallel_group)
        return float(total)

    def get_grads_for_grad_norm(self, grad_norm_group: str | None = None) -> list[torch.Tensor]:
        """(megatron-core 0.19) This rank's gradients that count in a norm: the owned pieces counted
        on this rank (not TP-duplicated, not shared, replica 0 of a hybrid shard) of the main norm
        (``None``) or of one separate group (``"mtp"``)."""
        return [
            piece.main.grad
            for piece in self.pieces
            if piece.counted_in_norm and piece.norm_group == grad_norm_group
        ]

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        """(megatron-core 0.16-0.18) The main norm's gradients: :meth:`get_grads_for_grad_norm`."""
        return self.get_grads_for_grad_norm()

    def has_grad_norm_group(self, grad_norm_group: str) -> bool:
        """(megatron-core 0.19) Whether any rank holds parameters of the group (no collective: the
        groups were agreed once at construction)."""
        return grad_norm_group in self.norm_groups

    def prepare_model_params_for_param_sync(self) -> None:
        """(megatron-core 0.19) Nothing to stage: every step already wrote the owned compute-dtype
        shards that the other ranks fetch."""

    def _norm(self, grad_norm_group: str | None = None) -> float:
        grads = self.get_grads_for_grad_norm(grad_norm_group)
        return math.sqrt(self._sum_over_model(lambda g: g.double().pow(2).sum(), grads))

    @_onloaded
    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """L2 norm of the model's gradient (each element once, over DP and TP), without the
        parameters of a separate norm group (as megatron-core 0.19's main norm)."""
        return self._norm()

    @_onloaded
    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        """Compute the main grad norm and scale its owned gradients down to ``clip_grad``; each
        separate norm group (``grad_norms_by_group``) is clipped by its own norm. Returns the main
        norm."""
        grad_norm = self.get_grad_norm()
        self.grad_norms_by_group = {group: self._norm(group) for group in self.norm_groups}
        norms = {None: grad_norm, **self.grad_norms_by_group}
        for group, norm in norms.items():
            clip_coeff = clip_grad / (norm + 1.0e-6)
            if clip_coeff < 1.0:
                for piece in self.pieces:
                    if piece.norm_group == group:
                        piece.main.grad.mul_(clip_coeff)
        return grad_norm

    @_onloaded
    @torch.no_grad()
    def count_zeros(self) -> float:
        """Number of zero gradient elements over the whole model."""
        return self._sum_over_model(lambda g: (g == 0).sum())

    @_onloaded
    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Inner optimizer step, then write the compute-dtype shards peers will fetch."""
        self._settle_main_params()
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        self._end_step()
        return True

    def _end_step(self) -> None:
        """Zero the accumulators and fence: the new shards are visible before anyone fetches them."""
        for engine in self.engines:
            engine.end_step()

    @_onloaded
    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, float | None]:
        """One optimizer step; returns ``(update_successful, grad_norm, num_zeros_in_grad)``."""
        if self.prepare_grads():
            return False, None, None
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        else:
            grad_norm = self.get_grad_norm()
        if not math.isfinite(grad_norm):
            logger.warning("ODC optimizer: non-finite grad norm %s; the step still runs", grad_norm)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else 0
        # megatron-core 0.18+ OptimizerConfig field (ChainedOptimizer.step's meaning); absent: off.
        skip_above = getattr(self.config, "grad_norm_skip_threshold", math.inf)
        if math.isfinite(skip_above) and grad_norm > skip_above:
            logger.info(
                "ODC optimizer: grad norm %s is above grad_norm_skip_threshold %s; update skipped",
                grad_norm,
                skip_above,
            )
            self._end_step()  # no update, but the minibatch still ends with its fence
            return False, grad_norm, num_zeros
        success = self.step_with_ready_grads()
        return success, grad_norm, num_zeros

    def _copy_main_params_to_model_params(self) -> None:
        for engine, mains in zip(self.engines, self._main_shards):
            for bucket, main in zip(engine.layout.buckets, mains):
                if bucket.dtype != torch.uint8:
                    engine.param_shard(bucket.index).copy_(main)
            if engine.fp8_names:  # re-quantise the owned FP8 bytes (collective over DP)
                fp8 = engine.fp8_names
                engine.write_owned(
                    lambda p, mains=mains, fp8=fp8: (
                        mains[p.bucket_index][p.shard_lo : p.shard_hi] if p.name in fp8 else None
                    )
                )

    def _copy_model_params_to_main_params(self, state_dict=None) -> None:
        for engine, mains in zip(self.engines, self._main_shards):
            for bucket, main in zip(engine.layout.buckets, mains):
                if bucket.dtype != torch.uint8:
                    main.copy_(engine.param_shard(bucket.index))
            for piece in engine.owned_pieces():
                if piece.name in engine.fp8_names:  # the values the owned FP8 bytes stand for
                    main = mains[piece.bucket_index][piece.shard_lo : piece.shard_hi]
                    main.copy_(engine.owned.piece_values(piece))

    @_onloaded
    def reload_model_params(self, state_dict=None) -> None:
        """Refresh the fp32 main shards from the model's (compute-dtype) shards, e.g. after a load."""
        self._copy_model_params_to_main_params(state_dict)
        self._mains_follow_model = False

    def model_params_loaded(self) -> None:
        """The model's shards were just loaded from a checkpoint, outside this optimizer.

        The main shards are refreshed from them before they are next read (a step or a save), unless
        an optimizer load or :meth:`reload_model_params` comes first. Deferred, not done here: Megatron-LM's
        ``load_checkpoint`` loads the optimizer's main shards in place, *then* calls the model's
        ``load_state_dict``, then the optimizer's; refreshing here would overwrite the loaded fp32
        masters with the compute-dtype weights (issue 37: bf16 / fp16 resumes drifted). A weights-only
        load (``--finetune``, ``--no-load-optim``) has no optimizer load after it, and Megatron-LM
        reloads only in bf16 / fp16: the deferred refresh covers fp32 too.
        """
        self._mains_follow_model = True

    def _settle_main_params(self) -> None:
        if self._mains_follow_model:
            self.reload_model_params()

    # ------------------------------------------------------------------ offload between phases

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors this optimizer keeps on the engines' device: the fp32 main shards and the
        inner optimizer's state (the pieces are views of the main shards)."""
        tensors = [m for mains in self._main_shards for m in mains]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return [t for t in tensors if t.device == self.device]

    def unbind_grads(self) -> None:
        """Drop each piece's gradient view into the engine's accumulators (before they are freed)."""
        for piece in self.pieces:
            piece.main.grad = None

    def bind_grads(self) -> None:
        """Point each piece's gradient at the engine's current accumulators (after they moved)."""
        for piece in self.pieces:
            piece.main.grad = piece.engine.owned.piece_grad(piece.owned)

    # ------------------------------------------------------------------ state

    def persistent_nbytes(self) -> int:
        """Bytes of the fp32 main shards and the inner optimizer's state."""
        total = sum(m.nbytes for mains in self._main_shards for m in mains)
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    total += value.nbytes
        return total

    @_onloaded
    def state_dict(self) -> dict:
        """Inner optimizer state (owned pieces only), loss scaler and fp32 main shards."""
        self._settle_main_params()
        return {
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "main_shards": [[m.clone() for m in mains] for mains in self._main_shards],
        }

    @_onloaded
    def load_state_dict(self, state_dict: dict) -> None:
        """Load what ``state_dict()`` returned on the same DP layout, or a dist-checkpoint load.

        A dict with ``param_state`` is what ``dist_checkpointing.load`` returned for
        :meth:`sharded_state_dict` (Megatron-LM's ``load_checkpoint``). Either way the loaded fp32 main
        shards are then written into the model's shards (collective: fences).
        """
        if "param_state" in state_dict:
            optimizer_state.load_odc_optimizer_state(self, state_dict)
        else:
            self.optimizer.load_state_dict(state_dict["optimizer"])
            if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
                self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
            for mains, saved in zip(self._main_shards, state_dict["main_shards"]):
                for main, value in zip(mains, saved):
                    main.copy_(value)
        self._mains_follow_model = False
        self.write_loaded_main_params()

    def write_loaded_main_params(self) -> None:
        """Write the fp32 main shards into the model's shards outside a step (after a load).

        Collective: stale unsharded copies are released, peers still reading the current shards are
        waited for, and a final fence makes the loaded shards visible to every rank.
        """
        for engine in self.engines:
            engine.release_all()
            engine.begin_shard_writes()
        self._copy_main_params_to_model_params()
        self._end_step()

    @_onloaded
    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """The optimizer's torch_dist state: owned-slice boxes under DistOpt's fully-reshardable keys.

        See ``dist_ckpt/optimizer_state.py``; ``model_sharded_state_dict`` and ``kwargs`` (e.g.
        Megatron-LM's ``metadata``) are not needed. Collective when saving.
        """
        if not is_loading:
            self._settle_main_params()
        return optimizer_state.odc_optimizer_sharded_state_dict(self, is_loading=is_loading)
