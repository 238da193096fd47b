"""CPU runtime for megatron-core: explicit, reversible patches so its CUDA-only code runs under gloo.

megatron-core assumes a CUDA device in a handful of places that have nothing to do with the maths. This
module replaces exactly those places, only when :func:`apply_cpu_patches` is called (never on import),
and puts every replaced attribute back on :meth:`CpuPatches.revert`. With the patches applied, a
``GPTModel`` built from ``get_gpt_layer_local_spec()`` with ``use_cpu_initialization=True`` trains with
tensor and sequence parallelism, megatron-core's own ``DistributedDataParallel`` (with or without the
distributed optimizer), ``get_megatron_optimizer`` (torch Adam fallback),
``forward_backward_no_pipelining`` and ``finalize_model_grads`` on CPU ranks joined by gloo.

What each patch is for (the facts behind them: docs/architecture.md, section 3):

1. ``torch.cuda.current_device`` -> ``"cpu"``. Used as a ``device=`` argument by the TP mappings and
   layers (``tensor_parallel.mappings`` / ``layers``: all-gather and reduce-scatter outputs), by
   ``tensor_parallel.utils`` and by ``distributed.param_and_grad_buffer`` (the flat param/grad buffers).
2. RNG: ``torch.cuda.manual_seed`` / ``get_rng_state`` / ``set_rng_state`` and
   ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` -> the CPU
   generator. ``model_parallel_cuda_manual_seed`` and ``CudaRNGStatesTracker.add`` / ``fork`` (entered by
   the local attention for dropout and by CPU weight init of the TP layers) need them. The two private
   names are bound only in ``tensor_parallel.random`` itself (Megatron-FSDP keeps its own copies, which
   this runtime does not use), so that is the only module patched for them. Because CPU and "CUDA"
   RNG are now the same generator, ``fork()`` may log "CPU RNG state changed within GPU RNG context";
   that message is harmless here. ``torch.cuda.manual_seed_all`` is left alone: megatron-core does not
   call it, ``torch.manual_seed`` does (so a replacement that seeds the CPU would recurse), and on a
   CPU build the original only queues a lazy no-op.
3. A device-remap ``torch.overrides.TorchFunctionMode`` (:class:`DeviceRemapMode`) that rewrites
   ``device="cuda..."`` (a string, a ``torch.device`` or, as a keyword, an int index) to ``"cpu"`` in
   any torch call, drops ``pin_memory=True`` and makes ``Tensor.pin_memory()`` an identity. It covers
   literal ``"cuda"`` allocations that no attribute patch can reach: ``schedules.
   forward_backward_no_pipelining`` (``total_num_tokens``), ``MixedPrecisionOptimizer`` /
   ``FP32Optimizer`` (``found_inf``, ``_scale``), the grad scalers, ``optimizer.clip_grads``,
   ``utils.local_multi_tensor_l2_norm``, ``transformer.utils.get_default_causal_mask`` and
   ``param_and_grad_buffer``'s warm-up tensor. See 9. Packed (THD) sequences on the local spec, always applied: ``DotProductAttention.forward`` asserts
   ``packed_seq_params is None`` ("use TEDotProductAttention"), so Megatron-LM's ``--sft`` (whose
   samples always carry ``cu_seqlens``) cannot run on CPU with either backend. It is replaced by
   :func:`packed_attention_forward`, which for ``qkv_format="thd"`` runs the original, causal, on
   each segment of ``cu_seqlens`` of the packed ``[t, heads, dim]`` query, key and value alone (as a
   ``[s, 1, heads, dim]`` batch) and concatenates the outputs to ``[t, heads * dim]``, as TE returns:
   the block-diagonal causal attention TransformerEngine's THD kernels compute, at their cost
   (``sum(s_i**2)``, not the ``t**2`` of a dense block-diagonal mask). In fp32 without attention
   dropout, window or softmax offset, each segment runs as one fused ``scaled_dot_product_attention``
   instead of the original (the same maths; it never holds the ``s x s`` scores, so a 2,000-token
   segment takes about a quarter of the time on CPU, 2 cores, and costs about its FLOPs). Without packed
   parameters the original runs unchanged.

[Note: device-remap mode is per thread].
4. ``torch.Tensor.cuda`` / ``torch.nn.Module.cuda`` -> identity (return ``self``): ``tensor_parallel.
   data.broadcast_data``, ``DistributedOptimizer`` state gathering, optimizer state reloads.
5. ``torch.cuda.synchronize`` / ``empty_cache`` -> no-ops: ``parallel_state`` (timeouts), DDP grad-buffer
   offload, checkpoint save paths.
8. (0.17 and later) ``torch.cuda.current_stream`` -> a stream stand-in whose ``wait_event`` /
   ``wait_stream`` / ``synchronize`` / ``record_event`` do nothing (CPU work is ordered already):
   0.19's ``_ParamAndGradBucketGroup.start_grad_sync`` asks for it on every call (to wait for CUDA-graph
   wgrad events), 0.17 / 0.18 under ``overlap_grad_reduce``.

Which of them a release needs is its row's ``cpu_shims`` in ``mcore/releases.py`` (names of
:data:`CPU_SHIMS`); a shim whose megatron-core target is missing (an untested release under
``MEGATRON_ODC_SKIP_VERSION_CHECK=1``) is skipped with a warning and named in ``CpuPatches.skipped``.
6. (Not a patch of this module) megatron-core's own optimizers check ``param.type()`` names: the
   adapter scopes ``cuda_type_names`` (``mcore/cpu_optimizers.py``) around them whenever the model is
   on CPU, whether these patches are applied or not.
7. Sequence parallelism on the local spec: ``WrappedTorchNorm`` (the torch norm every local-spec
   LayerNorm/RMSNorm is built from when apex is absent) asserts ``not config.sequence_parallel``.
   ``megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__`` is replaced by
   :func:`sequence_parallel_norm_new`, which builds the same torch norm and, under sequence
   parallelism, marks its parameters ``sequence_parallel=True`` (as apex's ``FusedLayerNorm`` does), so
   ``finalize_model_grads`` all-reduces their grads over TP. Patching the class itself covers every
   binding (``models.backends.LNImpl``, ``models.gpt.gpt_layer_specs.LNImpl``,
   ``transformer_block.LayerNormImpl``, and the RMSNorm path that rebinds ``backends.LNImpl``).

Verified by removing one patch at a time from a TP=2 + SP + distributed-optimizer train step: without
1, the ``get_rng_state`` patches, ``_get_cuda_rng_state``, 3 or 7 it fails ("Torch not compiled with
CUDA enabled" / the SP assert). The others are not reached by that step but are kept on purpose:
``torch.cuda.manual_seed`` makes ``model_parallel_cuda_manual_seed(seed)`` seed the generator CPU code
draws from; ``torch.cuda.set_rng_state`` and ``_set_cuda_rng_state`` otherwise queue a lazy call that
silently never runs on a CPU build (so ``fork()`` would not switch streams and RNG restores would be
no-ops); 4 and 5 are reached by ``broadcast_data``, Megatron-LM's ``model.cuda()``, checkpointing and
buffer offload, where the originals raise.

[Note: device-remap mode is per thread]
``TorchFunctionMode`` lives on a per-thread stack. :func:`apply_cpu_patches` pushes the mode on the
*calling thread's* stack without a ``with`` block, so it stays active until :meth:`CpuPatches.revert`,
across function returns; the autograd engine propagates the thread-local mode stack into backward.
Work that megatron runs on a thread of its own (e.g. an async checkpoint writer) does not see the mode:
enter :class:`DeviceRemapMode` there yourself. Revert from the thread that applied the patches.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_odc.mcore.releases import SKIP_VERSION_CHECK_ENV, Release, current_release

__all__ = [
    "CPU_SHIMS",
    "SKIP_VERSION_CHECK_ENV",
    "CpuPatches",
    "DeviceRemapMode",
    "active_cpu_patches",
    "apply_cpu_patches",
    "check_megatron_version",
    "cpu_runtime",
]

logger = logging.getLogger(__name__)

_ACTIVE_HANDLE_ATTR = "_megatron_odc_cpu_patches"
_MISSING = object()


_DEVICE_ARGUMENT_TYPES = (str, torch.device)
"""The positional argument types that can name a device (``t.to("cuda")``)."""


def _is_cuda_device(device: Any, *, allow_int: bool) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return allow_int and isinstance(device, int) and not isinstance(device, bool)


class DeviceRemapMode(TorchFunctionMode):
    """Rewrite CUDA ``device`` arguments of torch calls to CPU and drop pinned memory.

    A ``device=`` keyword that names CUDA (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda", 0)`` or an int
    index) becomes ``"cpu"``; positional string / ``torch.device`` CUDA arguments (``t.to("cuda")``) too;
    ``pin_memory=True`` is dropped and ``Tensor.pin_memory()`` returns the tensor itself.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of the step passes through here (thousands per microbatch), so the common
        # case, tensors and numbers only, takes one isinstance per argument and nothing else.
        if func is torch.Tensor.pin_memory:
            return args[0]
        if kwargs:
            if "device" in kwargs and _is_cuda_device(kwargs["device"], allow_int=True):
                kwargs = {**kwargs, "device": "cpu"}
            if kwargs.get("pin_memory"):
                kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory"}
        else:
            kwargs = {}
        for arg in args:
            if isinstance(arg, _DEVICE_ARGUMENT_TYPES) and _is_cuda_device(arg, allow_int=False):
                args = tuple("cpu" if _is_cuda_device(a, allow_int=False) else a for a in args)
                break
        return func(*args, **kwargs)


def sequence_parallel_norm_new(
    cls: type,
    config: Any,
    hidden_size: int,
    eps: float = 1e-5,
    persist_layer_norm: bool = False,
    zero_centered_gamma: bool = False,
    normalization: str = "LayerNorm",
) -> torch.nn.Module:
    """Replacement for ``WrappedTorchNorm.__new__`` that supports sequence parallelism (shim 7).

    Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` from ``config.normalization`` like the original,
    and when ``config.sequence_parallel`` is set marks the weight and bias ``sequence_parallel=True`` so
    ``finalize_model_grads`` sums their gradients over the TP group.

    Raises:
        ValueError: a norm option torch's norms do not support (zero-centered gamma, persistent or
            memory-efficient layer norm, a normalization other than LayerNorm / RMSNorm).
    """
    del (
        cls,
        persist_layer_norm,
        zero_centered_gamma,
        normalization,
    )  # read from config, like the original
    for flag in (
        "layernorm_zero_centered_gamma",
        "persist_layer_norm",
        "memory_efficient_layer_norm",
    ):
        if getattr(config, flag, False):
            raise ValueError(f"TransformerConfig.{flag}=True is not supported by the torch norm")
    if config.normalization == "LayerNorm":
        norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
    elif config.normalization == "RMSNorm":
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
    else:
        raise ValueError(
            f"TransformerConfig.normalization={config.normalization!r}: the CPU runtime supports "
            "'LayerNorm' and 'RMSNorm'"
        )
    if config.sequence_parallel:
        for param in norm.parameters():
            param.sequence_parallel = True
    return norm


def _identity(self, *args: Any, **kwargs: Any) -> Any:
    return self


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, which stays unpatched.
    torch.default_generator.manual_seed(seed)


def _cpu_get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


class _CpuStream:
    """``torch.cuda.current_stream()`` on CPU (shim 8): CPU work is already in order, so every wait,
    record and synchronize is a no-op and ``query`` is always done."""

    device = torch.device("cpu")

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_current_stream(*args: Any, **kwargs: Any) -> _CpuStream:
    return _CpuStream()


def check_megatron_version() -> str:
    """Return the installed megatron-core version; refuse one outside the supported range.

    Raises:
        ValueError: megatron-core is outside ``mcore/releases.py``'s ``SUPPORTED_RANGE`` and
            ``MEGATRON_ODC_SKIP_VERSION_CHECK=1`` is not set (one line naming the range).
    """
    from megatron_odc.mcore.releases import installed_version

    current_release()
    return installed_version()


class CpuPatches:
    """Handle on the applied CPU patches; also a context manager that reverts on exit.

    Attributes:
        patched: ``"module.attr"`` names of every replaced attribute, in the order they were patched.
        skipped: megatron-core names a shim of the release's row would have patched but that are
            missing (only under ``MEGATRON_ODC_SKIP_VERSION_CHECK=1``, with an untested release).
        mode: the device-remap mode pushed on the applying thread's torch-function mode stack.
    """

    def __init__(self) -> None:
        self.patched: list[str] = []
        self.skipped: list[str] = []
        self.mode = DeviceRemapMode()
        # (owner, attr, qualified name, value in owner.__dict__ before, or _MISSING)
        self._saved: list[tuple[Any, str, str, Any]] = []
        self._active = False

    @property
    def active(self) -> bool:
        """Whether the patches are currently applied."""
        return self._active

    def _patch(self, owner: Any, attr: str, qualname: str, value: Any) -> None:
        self._saved.append((owner, attr, qualname, owner.__dict__.get(attr, _MISSING)))
        setattr(owner, attr, value)
        self.patched.append(qualname)

    def _patch_target(self, module: str, attr: str, value: Any) -> None:
        """Patch ``module.attr`` (a megatron-core name); skip it with a warning where it is missing."""
        qualname = f"{module}.{attr}"
        owner: Any
        try:
            owner = importlib.import_module(module)
        except ImportError as exc:
            owner, reason = None, f"{module} does not import ({exc})"
        else:
            reason = f"{module} has no {attr}"
        if owner is None or not hasattr(owner, attr):
            logger.warning("CPU runtime: %s is not patched: %s", qualname, reason)
            self.skipped.append(qualname)
            return
        self._patch(owner, attr, qualname, value)

    def _apply(self, release: Release) -> None:
        for name in release.cpu_shims:
            CPU_SHIMS[name](self)
        _shim_packed_attention(self)  # 9, every release
        self.mode.__enter__()
        self._active = True

    def revert(self) -> None:
        """Put every patched attribute back exactly and pop the device-remap mode; idempotent.

        Raises:
            RuntimeError: called from a thread whose mode stack does not hold this handle's mode.
        """
        if not self._active:
            return
        _remove_mode_from_stack(self.mode)
        try:
            for owner, attr, _, before in reversed(self._saved):
                if before is not _MISSING:
                    setattr(owner, attr, before)
                elif attr in vars(owner):
                    delattr(owner, attr)
        finally:
            self._saved.clear()
            self._active = False
        logger.debug("reverted %d CPU patches", len(self.patched))

    def __enter__(self) -> CpuPatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.revert()


def _sdpa_segments_apply(attention: Any, query: torch.Tensor, attention_bias: Any) -> bool:
    """Whether a packed segment may run as one ``scaled_dot_product_attention`` call instead of the
    local attention's unfused baddbmm / masked softmax / bmm (shim 9): the same maths when the
    inputs are fp32 (no fp16 / bf16 softmax-in-fp32 rule to follow), with no attention dropout in
    training (its mask comes from Megatron's RNG tracker), no sliding window, no softmax offset
    and no bias. On CPU the fused kernel never holds the ``s x s`` scores, so a segment costs about
    its FLOPs and no per-call mask building ([Note: measured cost model] in ``balance/cost.py``)."""
    dropout = attention.attention_dropout.p if attention.training else 0.0
    return (
        query.dtype == torch.float32
        and dropout == 0.0
        and attention_bias is None
        and getattr(attention, "softmax_offset", None) is None
        and getattr(getattr(attention, "scale_mask_softmax", None), "window_size", None) is None
    )


def _causal_sdpa(
    attention: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
    """Causal attention of one segment, ``[s, 1, heads, dim]`` in, ``[s, 1, heads * dim]`` out, as
    ``DotProductAttention.forward`` computes it (grouped keys repeated, its softmax scale)."""
    groups = attention.num_attention_heads_per_partition // attention.num_query_groups_per_partition
    if groups > 1:
        key = key.repeat_interleave(groups, dim=2)
        value = value.repeat_interleave(groups, dim=2)
    scale = attention.softmax_scale
    if getattr(attention.config, "apply_query_key_layer_scaling", False):
        scale *= attention.layer_number  # the local softmax multiplies its coefficient back
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [1, heads, s, dim]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], 1, -1)


def packed_attention_forward(original: Callable) -> Callable:
    """``DotProductAttention.forward`` that also takes THD packed sequences (shim 9)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(
                f"packed sequences in qkv_format {packed_seq_params.qkv_format!r} on CPU: the local "
                "attention takes 'thd' (cu_seqlens) only"
            )
        cu_q = packed_seq_params.cu_seqlens_q_padded
        cu_q = packed_seq_params.cu_seqlens_q if cu_q is None else cu_q
        cu_kv = packed_seq_params.cu_seqlens_kv_padded
        cu_kv = packed_seq_params.cu_seqlens_kv if cu_kv is None else cu_kv
        if not torch.equal(cu_q.reshape(-1), cu_kv.reshape(-1)):
            raise ValueError(
                "packed sequences on CPU need the same cu_seqlens for queries and keys"
            )
        bounds = cu_q.reshape(-1).tolist()
        if bounds[-1] != query.shape[0]:
            raise ValueError(
                f"cu_seqlens cover {bounds[-1]} tokens, the packed query has {query.shape[0]}"
            )
        fast = _sdpa_segments_apply(self, query, attention_bias)
        outs = []
        for start, end in itertools.pairwise(bounds):
            if end > start:  # repeated boundaries (right-padded cu_seqlens) are empty segments
                q, k, v = (x[start:end].unsqueeze(1) for x in (query, key, value))
                if fast:
                    out = _causal_sdpa(self, q, k, v)
                else:
                    out = original(self, q, k, v, None, attn_mask_type, attention_bias)
                outs.append(out.reshape(end - start, -1))
        return torch.cat(outs)

    forward.__megatron_odc_original__ = original
    return forward


def _shim_packed_attention(handle: CpuPatches) -> None:
    qualname = "megatron.core.transformer.dot_product_attention.DotProductAttention.forward"
    try:
        from megatron.core.transformer.dot_product_attention import DotProductAttention
    except ImportError as exc:
        logger.warning("CPU runtime: %s is not patched: %s", qualname, exc)
        handle.skipped.append(qualname)
        return
    original = DotProductAttention.__dict__["forward"]
    handle._patch(DotProductAttention, "forward", qualname, packed_attention_forward(original))


def _make_current_device(handle: CpuPatches) -> Callable[[], str]:
    def current_device() -> str:
        return "cpu"

    # The active handle is found through the patched function itself: process-wide, no module state.
    setattr(current_device, _ACTIVE_HANDLE_ATTR, handle)
    return current_device


def _shim_current_device(handle: CpuPatches) -> None:
    handle._patch(
        torch.cuda, "current_device", "torch.cuda.current_device", _make_current_device(handle)
    )


def _shim_cuda_rng(handle: CpuPatches) -> None:
    cuda = torch.cuda
    handle._patch(cuda, "manual_seed", "torch.cuda.manual_seed", _cpu_manual_seed)
    handle._patch(cuda, "get_rng_state", "torch.cuda.get_rng_state", _cpu_get_rng_state)
    handle._patch(cuda, "set_rng_state", "torch.cuda.set_rng_state", _cpu_set_rng_state)


def _shim_megatron_rng(handle: CpuPatches) -> None:
    module = "megatron.core.tensor_parallel.random"
    handle._patch_target(module, "_get_cuda_rng_state", _cpu_get_rng_state)
    handle._patch_target(module, "_set_cuda_rng_state", _cpu_set_rng_state)


def _shim_cuda_no_ops(handle: CpuPatches) -> None:
    handle._patch(torch.cuda, "synchronize", "torch.cuda.synchronize", _noop)
    handle._patch(torch.cuda, "empty_cache", "torch.cuda.empty_cache", _noop)


def _shim_cuda_moves_are_identity(handle: CpuPatches) -> None:
    handle._patch(torch.Tensor, "cuda", "torch.Tensor.cuda", _identity)
    handle._patch(torch.nn.Module, "cuda", "torch.nn.Module.cuda", _identity)


def _shim_sequence_parallel_norm(handle: CpuPatches) -> None:
    qualname = "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__"
    try:
        from megatron.core.transformer import torch_norm

        owner = torch_norm.WrappedTorchNorm
    except (ImportError, AttributeError) as exc:
        logger.warning("CPU runtime: %s is not patched: %s", qualname, exc)
        handle.skipped.append(qualname)
        return
    handle._patch(owner, "__new__", qualname, staticmethod(sequence_parallel_norm_new))


def _shim_current_stream(handle: CpuPatches) -> None:
    handle._patch(torch.cuda, "current_stream", "torch.cuda.current_stream", _cpu_current_stream)


CPU_SHIMS: dict[str, Callable[[CpuPatches], None]] = {
    "current_device": _shim_current_device,  # 1
    "cuda_rng": _shim_cuda_rng,  # 2: torch.cuda's generator calls
    "megatron_rng": _shim_megatron_rng,  # 2: tensor_parallel.random's private ones
    "cuda_no_ops": _shim_cuda_no_ops,  # 5
    "cuda_moves_are_identity": _shim_cuda_moves_are_identity,  # 4
    "sequence_parallel_norm": _shim_sequence_parallel_norm,  # 7
    "current_stream": _shim_current_stream,  # 8
}
"""Every CPU shim by the name a release's row (``mcore/releases.py``, ``cpu_shims``) lists it under,
numbered as in the module docstring; the device-remap mode (3) is always on."""


def _remove_mode_from_stack(mode: TorchFunctionMode) -> None:
    """Pop ``mode`` off this thread's torch-function mode stack, keeping any modes pushed above it."""
    stack_len = torch._C._len_torch_function_stack()
    stack = [torch._C._get_function_stack_at(i) for i in range(stack_len)]
    if not any(m is mode for m in stack):
        raise RuntimeError(
            "the CPU patches' device-remap mode is not on this thread's torch-function mode stack: "
            "revert from the thread that called apply_cpu_patches()"
        )
    if stack[-1] is mode:
        mode.__exit__(None, None, None)
        return
    logger.warning("device-remap mode is not on top of the mode stack; removing it from below")
    above: list[TorchFunctionMode] = []
    while (top := torch._C._pop_torch_function_stack()) is not mode:
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


def active_cpu_patches() -> CpuPatches | None:
    """Return the handle of the CPU patches applied in this process, or None."""
    return getattr(torch.cuda.current_device, _ACTIVE_HANDLE_ATTR, None)


def apply_cpu_patches() -> CpuPatches:
    """Apply the CPU patches (see the module docstring) and return their handle.

    Idempotent per process: while patches are active a second call returns the active handle (whose
    ``revert`` then undoes them for every caller). Usable as ``with apply_cpu_patches(): ...``.

    Raises:
        ValueError: megatron-core is outside the supported range (see :func:`check_megatron_version`).
    """
    active = active_cpu_patches()
    if active is not None and active.active:
        return active
    release = current_release()
    handle = CpuPatches()
    handle._apply(release)
    logger.debug("applied %d CPU patches for megatron-core %s", len(handle.patched), release.name)
    return handle


@contextlib.contextmanager
def cpu_runtime() -> Iterator[CpuPatches | None]:
    """The CPU patches for the block on a machine without CUDA; nothing on a GPU machine.

    Patches someone else applied stay applied (and are yielded); patches applied here are reverted on
    exit. A megatron-core outside the supported range is refused first, with or without CUDA. The
    entry points (``python -m megatron_odc.train``) run training inside it.
    """
    current_release()  # an unsupported megatron-core is refused here, on GPUs too
    if torch.cuda.is_available():
        yield None
        return
    active = active_cpu_patches()
    if active is not None and active.active:
        yield active
        return
    handle = apply_cpu_patches()
    try:
        yield handle
    finally:
        handle.revert()
