"""``ODCDataParallel``: the ODC engine behind megatron-core's data-parallel wrapper contract.

It subclasses megatron-core's ``DistributedDataParallel`` (so ``unwrap_model``, Megatron-LM's isinstance
checks and checkpoint key names accept it) but runs only ``_BaseDataParallel.__init__`` and overrides
every public method of DDP: gradients leave through one-sided pushes after each unit's backward, so
``no_sync`` has nothing to defer, ``start_grad_sync`` nothing to start, and ``finish_grad_sync`` is the
minibatch fence (plus the TP all-reduce of TP-replicated parameters' owned gradient slices).
``zero_grad_buffer`` begins a minibatch. ``finalize_model_grads`` and megatron-core's schedules work
unchanged; a rank with zero microbatches calls ``finalize_model_grads`` directly (``step.py``).

With pipeline parallelism each stage's chunk is wrapped over its stage's DP group, and
``finish_grad_sync`` also sums the tied embedding's owned gradient slices over the embedding group
([Note: ODC with pipeline stages] in ``pipeline.py``).

What is a unit and which parameters are TP-replicated: ``units.py``. FP8 parameters (TransformerEngine
``Float8Tensor`` under ``--fp8-param-gather``, or ``EmulatedFloat8Tensor``) go through the codec of
``fp8_te.py``; TE layers' fused wgrad writes into the ``main_grad`` the engine binds for each backward and
sets ``grad_added_to_main_grad``, which the engine honours.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import unwrap_model

from megatron_odc.core.engine import ODCEngine
from megatron_odc.core.fp8 import check_fp8_recipe
from megatron_odc.core.groups import build_topology
from megatron_odc.core.hooks import ODCHooks
from megatron_odc.core.state import BucketState
from megatron_odc.core.telemetry import format_line, reduce_across
from megatron_odc.mcore.config import LOCKSTEP_TRANSPORT, ODCConfig, refuse_unsupported
from megatron_odc.mcore.fp8_te import select_fp8_codec
from megatron_odc.mcore.pipeline import TiedEmbedding, shared_embedding_names
from megatron_odc.mcore.releases import current_release
from megatron_odc.mcore.units import (
    ROOT_UNIT,
    model_units,
    refuse_unmarked_tp_weights,
    tp_replicated,
)
from megatron_odc.transport import build_transport, resolve_transport_name
from megatron_odc.transport.devices import all_reduce_on_group_device

logger = logging.getLogger(__name__)


def check_supported(
    config: TransformerConfig, ddp_config: DistributedDataParallelConfig, odc_config: ODCConfig
) -> None:
    """Every refusal of the wrapper, before anything is built.

    Raises:
        ValueError: FP8 settings that would deadlock uneven ranks, or a Megatron feature the backend
            does not combine with (``config.UNSUPPORTED``), named.
    """
    check_fp8_recipe(config)
    # The wrapper over the lockstep transport is the fsdp backend: name it as the user did.
    backend = "fsdp" if odc_config.transport == LOCKSTEP_TRANSPORT else "odc"
    refuse_unsupported(
        backend,
        virtual_pipeline_model_parallel_size=(
            parallel_state.get_virtual_pipeline_model_parallel_world_size()
        ),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
        use_megatron_fsdp=ddp_config.use_megatron_fsdp,
        overlap_param_gather=ddp_config.overlap_param_gather,
        delay_wgrad_compute=getattr(config, "delay_wgrad_compute", False),
        cuda_graph=getattr(config, "cuda_graph_impl", "none") != "none"
        or getattr(config, "enable_cuda_graph", False)
        or getattr(config, "external_cuda_graph", False),
    )


class ODCDataParallel(DistributedDataParallel):
    """ODC data parallelism for one megatron-core model chunk.

    Args:
        config: the model's ``TransformerConfig``.
        ddp_config: megatron-core's ``DistributedDataParallelConfig`` (``grad_reduce_in_fp32`` is
            read; the options ODC cannot honour are refused).
        module: the model (a ``GPTModel``, possibly inside ``Float16Module``); every DP rank must hold the
            same weights.
        disable_bucketing: accepted for signature compatibility; ODC buckets by unit and size.
        pg_collection: optional process groups (``dp``, ``tp`` and ``embd`` are used).
        full_param_layout: megatron-core 0.18+'s precomputed DDP buffer layout (Megatron-LM passes one
            only for its distributed and layer-wise optimizers); refused unless None.
        odc_config: ODC's own options (default ``ODCConfig()``); ``shard_group_size`` splits the DP
            group into shard groups x replica groups (``core/groups.py``).
        frozen: a model that is never trained (an RL reference model, ``rl/reference.py``): no
            gradient accumulators, no pushes; every parameter must have ``requires_grad=False``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        pg_collection=None,
        full_param_layout=None,
        *,
        odc_config: ODCConfig | None = None,
        frozen: bool = False,
    ) -> None:
        current_release()  # refuses a megatron-core outside the supported range, in one line
        _BaseDataParallel.__init__(self, config=config, module=module)
        odc_config = odc_config or ODCConfig()
        check_supported(config, ddp_config, odc_config)
        if full_param_layout is not None:
            raise ValueError(
                "ODCDataParallel: full_param_layout is megatron-core's precomputed layout of its own "
                "grad buffers (built for --use-distributed-optimizer and the layer-wise optimizer); "
                "ODC lays out its own buckets: leave it None"
            )
        if frozen:
            trainable = [n for n, p in module.named_parameters() if p.requires_grad]
            if trainable:
                raise ValueError(
                    f"a frozen ODC model has parameters that require gradients ({trainable[0]!r} "
                    f"and {len(trainable) - 1} more); set requires_grad=False on every parameter"
                )
        self.ddp_config = ddp_config
        self.odc_config = odc_config
        if pg_collection is not None:
            self.dp_group = pg_collection.dp
            self.tp_group = pg_collection.tp
            embedding_group = getattr(pg_collection, "embd", None)
        else:
            self.dp_group = parallel_state.get_data_parallel_group()
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
            embedding_group = parallel_state.get_embedding_group(check_initialized=False)
        refuse_unmarked_tp_weights(module, dist.get_world_size(self.tp_group))
        # Attributes megatron-core and Megatron-LM read off a DDP wrapper.
        self.buffers = []
        self.expert_parallel_buffers = []
        self.bucket_groups = []
        self.expert_parallel_bucket_groups = []
        self.param_to_bucket_group = {}
        self.force_all_reduce = False
        self.use_forward_hook = False
        self.overlap_param_gather_with_optimizer_step = False

        units = model_units(module)
        self.tied_embedding = TiedEmbedding.of_stage(units.named_params, embedding_group)
        first = next(module.parameters(), None)
        # Hybrid sharding: the transport and the layout span the shard group, the replica group
        # sums the owned accumulators once per minibatch ([Note: hybrid sharding] in core/groups.py).
        self.topology = build_topology(self.dp_group, odc_config.shard_group_size)
        self.transport_name = resolve_transport_name(
            odc_config.transport,
            first.device if first is not None else torch.device("cpu"),
            spans_hosts=len(set(self.topology.shard_hosts)) > 1,
        )
        self.topology.check_transport(self.transport_name)
        self.shard_group = self.topology.shard_group
        if self.topology.hybrid and dist.get_rank() == 0:
            logger.info(
                "ODC hybrid sharding: %d shard groups of %d ranks (rank 0's on host %s); each "
                "gradient shard summed over its %d replicas once per minibatch",
                self.topology.replica_size,
                self.topology.shard_size,
                ", ".join(sorted(set(self.topology.shard_hosts))),
                self.topology.replica_size,
            )
        options = {"timeout_s": odc_config.timeout_s}
        if self.transport_name == "shm":
            options["accumulate_mode"] = "deterministic" if odc_config.deterministic else "locked"
        elif self.transport_name == "mpi":
            options["accumulate_mode"] = "deterministic" if odc_config.deterministic else "atomic"
        elif self.transport_name == "cuda":
            options["accumulate_mode"] = (
                "deterministic" if odc_config.deterministic else odc_config.cuda_accumulate
            )
        self.transport_options = options
        """The transport's build options (a transport is rebuilt with them after an offload)."""
        transport = build_transport(self.transport_name, self.shard_group, **options)
        try:
            self.engine = ODCEngine(
                units.named_params,
                transport,
                self.dp_group,
                bucket_numel=odc_config.bucket_size,
                alignment=odc_config.alignment,
                grad_dtype=torch.float32 if ddp_config.grad_reduce_in_fp32 else config.params_dtype,
                check_params_equal=odc_config.check_params_equal,
                max_pushes_in_flight=odc_config.pushes_in_flight,
                fp8_codec=select_fp8_codec((n, p) for n, p, _ in units.named_params),
                unsharded_budget=odc_config.unsharded_budget,
                root_unit=ROOT_UNIT if units.has_root else None,
                replica_group=self.topology.replica_group,
                own_buckets=shared_embedding_names(units.named_params),
                gradients=not frozen,
            )
            if self.tied_embedding is not None:
                self.tied_embedding.check_owned_ranges(self.engine)
        except BaseException:
            transport.close()  # a refused model (e.g. weights differ across DP) leaks no files or fds
            raise
        self.hooks = ODCHooks(
            self.engine,
            module,
            units.modules,
            ROOT_UNIT if units.has_root else None,
            prefetch=odc_config.prefetch,
        )
        self._tp_replicated = tp_replicated(units.named_params, config)
        # Parameter names as the unwrapped model (inside Float16Module) calls them, by engine name.
        inner_names = {id(p): n for n, p in unwrap_model(module).named_parameters()}
        self.state_key = {n: inner_names.get(id(p), n) for n, p, _ in units.named_params}
        """Engine parameter name -> the unwrapped module's name of it (they differ under Float16Module)."""

    # ------------------------------------------------------------------ grad sync contract

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Nothing to defer: every microbatch pushes (kept units: the last one), and the owners
        accumulate."""
        yield

    def start_grad_sync(self, *unused) -> None:
        """Nothing to start: pushes already left during backward."""

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """The minibatch fence: after it every owner holds the full gradient sums of its shards (TP-
        replicated parameters summed over TP, a tied embedding over the first and last stage).

        Without the per-token contract (``calculate_per_token_loss=False``: each rank's loss already
        carries its own normalisation, as verl's and NeMo-RL's do) the sums are divided by the DP size,
        as megatron-core's DDP averages over DP (docs/rl.md)."""
        self.engine.finish_minibatch()
        if not self.config.calculate_per_token_loss:
            self.engine.scale_gradients(1.0 / dist.get_world_size(self.dp_group))
        self._allreduce_tp_replicated_grads()
        if self.tied_embedding is not None:
            self.tied_embedding.allreduce_grads(self.engine)

    def _allreduce_tp_replicated_grads(self) -> None:
        """Sum (partial grads) or average (replicated grads) owned gradient slices over the TP group.

        Every TP rank of this DP rank owns the same slices (the layouts are identical across TP).
        """
        tp_size = dist.get_world_size(self.tp_group)
        if tp_size <= 1:
            return
        replicated = self._tp_replicated
        for names, average in ((replicated.summed, False), (replicated.averaged, True)):
            slices = self.engine.owned.grads_of(names)
            if not slices:
                continue
            flat = torch.cat(slices)
            all_reduce_on_group_device(flat, group=self.tp_group)  # gloo has no AVG: sum, divide
            if average:
                flat.div_(tp_size)
            offset = 0
            for s in slices:
                s.copy_(flat[offset : offset + s.numel()])
                offset += s.numel()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Scale the owned fp32 accumulators (``finalize_model_grads`` passes 1/num_tokens)."""
        self.engine.scale_gradients(float(scaling_factor))

    def zero_grad_buffer(self) -> None:
        """Begin a minibatch: zero the owned accumulators and fence (last step's params visible)."""
        self.engine.begin_minibatch()

    def broadcast_params(self) -> None:
        """Nothing to do: each parameter element has exactly one owner copy that every rank fetches."""

    # ------------------------------------------------------------------ param sync contract (no-ops)

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False):
        """Parameters are fetched on demand by the hooks; there is no separate param sync."""

    def reset_param_sync_dispatch_state(self) -> None:
        """(megatron-core 0.19) Nothing to reset: there is no dispatched param sync (megatron-core's
        distributed optimizer, its only caller, is refused)."""

    def free_overlap_buffers(self) -> None:
        """(megatron-core 0.17+; Megatron-LM calls it on every chunk before a save) Free the fetched
        parameter copies this rank holds, ODC's counterpart of DDP's param-gather buffers.

        Between minibatches the engine holds none (the fence released every unit), so there it frees
        nothing. Inside a minibatch, units in backward and kept units (their gradients accumulate
        locally until the fence) stay; any other fetched unit is released and fetched again at its
        next use.
        """
        engine = self.engine
        for unit in engine.layout.units:
            if engine.unit_state(unit) is not BucketState.PUSHING:
                engine.release(unit)

    def finish_param_sync(self, *unused) -> None:
        """See ``start_param_sync``."""

    def enable_forward_pre_hook(self) -> None:
        """ODC's hooks are always on."""

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """ODC's hooks are always on."""

    def offload_grad_buffers(self, synchronize: bool = True, empty_cache: bool = True) -> None:
        """Unsharded gradient buffers exist only during a unit's backward; nothing to offload."""

    def restore_grad_buffers(self, synchronize: bool = True) -> None:
        """See ``offload_grad_buffers``."""

    # ------------------------------------------------------------------ state

    def state_dict(self, prefix: str = "", keep_vars: bool = False, destination=None):
        """The full model's state dict, gathered from the owners on demand (copies)."""
        full = self.engine.full_parameters()
        state = self.module.state_dict(prefix=prefix, keep_vars=False, destination=destination)
        for name, value in full.items():
            # Float16Module's state dict uses the inner model's names; the engine's carry "module.".
            for key in (prefix + self.state_key[name], prefix + name):
                if key in state:
                    state[key] = value
        return state

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """Same as ``state_dict``: full tensors gathered from the owners."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Write this rank's owned slices of every parameter from full tensors (collective: fences)."""
        params = dict(self.engine.parameters())
        values = {}
        for name in params:
            for key in (self.state_key[name], name):  # the inner model's names, or the engine's
                if key in state_dict:
                    values[name] = state_dict[key]
                    break
        missing = [self.state_key[n] for n in params if n not in values]
        if strict and missing:
            raise ValueError(f"load_state_dict: missing parameters {missing[:5]}")
        for name, value in values.items():
            if tuple(value.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"load_state_dict: parameter {name!r} has shape {tuple(value.shape)} in the "
                    f"state dict, {tuple(params[name].shape)} in the model"
                )

        def owned_values(piece):
            value = values.get(piece.name)
            if value is None:
                return None
            return value.detach().reshape(-1)[piece.param_start : piece.param_start + piece.numel]

        self.engine.begin_shard_writes()  # peers may still be reading the current shards
        self.engine.write_owned(owned_values)  # FP8 parameters: re-quantised (collective)
        self.engine.transport.fence()
        return torch.nn.modules.module._IncompatibleKeys([], [])

    # ------------------------------------------------------------------ telemetry

    def telemetry(self) -> dict:
        """This rank's figures for the current or last minibatch."""
        return self.engine.telemetry.snapshot()

    def log_telemetry(self) -> dict:
        """Reduce the last minibatch's figures over DP (a collective: call after the step) and log."""
        reduced = reduce_across(self.engine.telemetry.snapshot(), self.dp_group)
        if dist.get_rank() == 0:
            logger.info(format_line(reduced))
        return reduced

    def close(self) -> None:
        """Remove the hooks and release the transport."""
        self.hooks.remove()
        self.engine.close()
