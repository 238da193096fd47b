"""``OdcDataParallel``: the ODC backend behind megatron-core's data-parallel wrapper contract.

It subclasses megatron-core's ``DistributedDataParallel`` (so ``unwrap_model``, Megatron-LM's isinstance
checks and checkpoint key names accept it) but runs ``_BaseDataParallel.__init__`` and overrides every
public method of DDP: gradients leave through one-sided pushes after each unit's backward, so
``no_sync`` has nothing to defer, ``start_grad_sync`` nothing to start, and ``finish_grad_sync`` is the
minibatch fence (plus the TP all-reduce of TP-replicated parameters' owned gradient slices).
``zero_grad_buffer`` begins a minibatch: it zeroes the owned accumulators and fences, so the parameters
written by the last step are visible. ``finalize_model_grads`` and the schedules of megatron-core work
unchanged; a rank with zero microbatches calls ``finalize_model_grads`` directly.

Units: every ``TransformerLayer`` is fetched and released on its own; all other parameters (embeddings,
final norm, output layer, a tied embedding used at both ends) form the root unit, fetched for the whole
forward and backward of a microbatch.

FP8 parameters (TransformerEngine ``Float8Tensor`` under ``--fp8-param-gather``, or
``EmulatedFloat8Tensor``) are sharded and fetched as FP8 bytes and re-quantised from the owners' fp32
masters after each step (``megatron_odc.fp8_params``). TE layers' fused wgrad accumulation writes into the
``main_grad`` the engine binds for each backward and sets ``grad_added_to_main_grad``, which the engine
honours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import unwrap_model

from megatron_odc.core.engine import ODCEngine
from megatron_odc.core.fp8 import check_fp8_recipe
from megatron_odc.core.hooks import ODCHooks
from megatron_odc.core.telemetry import format_line, reduce_across
from megatron_odc.mcore.fp8_te import select_fp8_codec
from megatron_odc.transport import build_transport
from megatron_odc.transport.devices import all_reduce_on_group_device

logger = logging.getLogger(__name__)

ROOT_UNIT = "root"


@dataclasses.dataclass
class OdcConfig(DistributedDataParallelConfig):
    """``DistributedDataParallelConfig`` plus ODC's own fields (Megatron-LM fills same-named args)."""

    odc_transport: str = "auto"
    """One-sided transport: ``shm`` (CPU, one host), ``cuda`` (PyTorch symmetric memory, the GPUs of one
    node), ``collective`` (lockstep all-gather / reduce-scatter: the FSDP baseline) or ``auto``
    (``cuda`` for a model on a GPU, else ``shm``)."""

    odc_cuda_accumulate: str = "atomic"
    """``cuda`` transport only: ``atomic`` (Triton peer atomics) or ``deterministic`` (staging slots and
    a fixed-order owner reduce at the fence: bitwise reproducible, one extra shard per source)."""

    odc_pushes_in_flight: int = 1
    """Unsharded gradient buffers whose push may still run while compute goes on (GPU overlap)."""

    odc_bucket_size: int = 40_000_000
    """Bucket size in elements; a parameter larger than this is split across buckets."""

    odc_alignment: int = 64
    """Element alignment of parameter starts and shards."""

    odc_prefetch: bool = True
    """Fetch the next unit (forward) or previous unit (backward) one step early."""

    odc_timeout_s: float = 300.0
    """How long a fence waits for a peer before naming it and failing."""

    odc_check_params_equal: bool = True
    """Check at construction that every DP rank holds the same weights."""


def _validate(config: TransformerConfig, ddp_config: DistributedDataParallelConfig) -> None:
    # Delayed scaling's per-microbatch DP amax reduction would deadlock; FP8 params need a per-tensor recipe.
    check_fp8_recipe(config)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(
            "--dp-backend odc does not support pipeline parallelism "
            "(--pipeline-model-parallel-size must be 1)"
        )
    if parallel_state.get_context_parallel_world_size() > 1:
        raise ValueError("--dp-backend odc does not support --context-parallel-size > 1 yet")
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        raise ValueError("--dp-backend odc does not support expert parallelism yet")
    if ddp_config.use_distributed_optimizer:
        raise ValueError(
            "--use-distributed-optimizer does not combine with --dp-backend odc: ODC already shards "
            "parameters, gradients and optimizer state"
        )
    if ddp_config.use_megatron_fsdp or ddp_config.overlap_param_gather:
        raise ValueError(
            "--use-megatron-fsdp / --overlap-param-gather do not combine with --dp-backend odc"
        )
    if getattr(config, "delay_wgrad_compute", False):
        raise ValueError("--delay-wgrad-compute does not combine with --dp-backend odc")


def resolve_transport(name: str, module: torch.nn.Module) -> str:
    """``auto`` -> ``cuda`` when the model's parameters are on a GPU, else ``shm``; others unchanged."""
    if name != "auto":
        return name
    first = next(module.parameters(), None)
    return "cuda" if first is not None and first.device.type == "cuda" else "shm"


def _units(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    units = []
    for name, sub in module.named_modules():
        if isinstance(sub, TransformerLayer) and not any(
            name.startswith(u + ".") for u, _ in units
        ):
            units.append((name, sub))
    return units


class OdcDataParallel(DistributedDataParallel):
    """ODC data parallelism for one megatron-core model chunk.

    Args:
        config: the model's ``TransformerConfig``.
        ddp_config: a ``DistributedDataParallelConfig``; an ``OdcConfig`` carries ODC's own options.
        module: the model (a ``GPTModel``, possibly inside ``Float16Module``); every DP rank must hold the
            same weights.
        disable_bucketing: accepted for signature compatibility; ODC buckets by unit and size.
        pg_collection: optional process groups (``dp`` and ``tp`` are used).
    """

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        pg_collection=None,
        **kwargs,
    ) -> None:
        _BaseDataParallel.__init__(self, config=config, module=module)
        _validate(config, ddp_config)
        odc = ddp_config if isinstance(ddp_config, OdcConfig) else OdcConfig()
        self.ddp_config = ddp_config
        if pg_collection is not None:
            self.dp_group = pg_collection.dp
            self.tp_group = pg_collection.tp
        else:
            self.dp_group = parallel_state.get_data_parallel_group()
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        # Attributes megatron-core and Megatron-LM read off a DDP wrapper.
        self.buffers = []
        self.expert_parallel_buffers = []
        self.bucket_groups = []
        self.expert_parallel_bucket_groups = []
        self.param_to_bucket_group = {}
        self.force_all_reduce = False
        self.use_forward_hook = False
        self.overlap_param_gather_with_optimizer_step = False

        units = _units(module)
        unit_of = {}
        for unit, sub in units:
            for pname, _ in sub.named_parameters(prefix=unit):
                unit_of[pname] = unit
        named = [(n, p, unit_of.get(n, ROOT_UNIT)) for n, p in module.named_parameters()]
        has_root = any(u == ROOT_UNIT for _, _, u in named)
        order = {ROOT_UNIT: -1, **{u: i for i, (u, _) in enumerate(units)}}
        named.sort(key=lambda t: order[t[2]])  # root first, then layers in forward order (stable)

        fp8_codec = select_fp8_codec((n, p) for n, p, _ in named)
        transport_name = resolve_transport(odc.odc_transport, module)
        options = {"timeout_s": odc.odc_timeout_s}
        if transport_name == "cuda":
            options["accumulate_mode"] = odc.odc_cuda_accumulate
        transport = build_transport(transport_name, self.dp_group, **options)
        self.transport_name = transport_name
        grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else config.params_dtype
        try:
            self.engine = ODCEngine(
                named,
                transport,
                self.dp_group,
                bucket_numel=odc.odc_bucket_size,
                alignment=odc.odc_alignment,
                grad_dtype=grad_dtype,
                check_params_equal=odc.odc_check_params_equal,
                max_pushes_in_flight=odc.odc_pushes_in_flight,
                fp8_codec=fp8_codec,
            )
        except BaseException:
            transport.close()  # a refused model (e.g. weights differ across DP) leaks no files or fds
            raise
        self.hooks = ODCHooks(
            self.engine,
            module,
            units,
            ROOT_UNIT if has_root else None,
            prefetch=odc.odc_prefetch,
        )
        # TP-replicated parameters: partial gradients (sequence parallel, q/k layernorm) are summed over
        # TP; the others hold the same gradient on every TP rank up to the order in which peers' pushes
        # were added, so they are averaged to keep the replicas bitwise identical.
        self._tp_sum_names = {
            n
            for n, p, _ in named
            if (config.sequence_parallel and getattr(p, "sequence_parallel", False))
            or (config.qk_layernorm and ("q_layernorm" in n or "k_layernorm" in n))
        }
        self._tp_avg_names = {
            n
            for n, p, _ in named
            if n not in self._tp_sum_names and not getattr(p, "tensor_model_parallel", False)
        }
        self._last_telemetry: dict | None = None
        # Parameter names as the unwrapped model (inside Float16Module) calls them, by engine name.
        inner_names = {id(p): n for n, p in unwrap_model(module).named_parameters()}
        self._state_key = {n: inner_names.get(id(p), n) for n, p, _ in named}

    # ------------------------------------------------------------------ grad sync contract

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Nothing to defer: every microbatch pushes, and the owners accumulate."""
        yield

    def start_grad_sync(self, *unused) -> None:
        """Nothing to start: pushes already left during backward."""

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """The minibatch fence: after it every owner holds the full gradient sums of its shards."""
        self.engine.finish_minibatch()
        self._allreduce_tp_replicated_grads()

    def _allreduce_tp_replicated_grads(self) -> None:
        """Sum (partial grads) or average (replicated grads) owned gradient slices over the TP group.

        Every TP rank of this DP rank owns the same slices (the layouts are identical across TP).
        """
        tp_size = dist.get_world_size(self.tp_group)
        if tp_size <= 1:
            return
        for names, average in ((self._tp_sum_names, False), (self._tp_avg_names, True)):
            slices = self._owned_grad_slices(names)
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

    def _owned_grad_slices(self, names: set[str]) -> list[torch.Tensor]:
        engine = self.engine
        return [
            engine.grad_shard(p.bucket_index)[p.shard_lo : p.shard_hi]
            for p in engine.owned_pieces()
            if p.name in names
        ]

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
            for key in (prefix + self._state_key[name], prefix + name):
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
            for key in (self._state_key[name], name):  # the inner model's names, or the engine's
                if key in state_dict:
                    values[name] = state_dict[key]
                    break
        missing = [self._state_key[n] for n in params if n not in values]
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
        self._last_telemetry = reduced
        return reduced

    def close(self) -> None:
        """Remove the hooks and release the transport."""
        self.hooks.remove()
        self.engine.close()
