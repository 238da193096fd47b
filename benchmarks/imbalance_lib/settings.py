"""The imbalance benchmark's fixed settings: configurations, the GPT, the optimizer and the cost model."""

from __future__ import annotations

import torch

WORLD_SIZE = 2
PROFILES = ("longalign", "swe_smith", "rl_aime", "uniform")
MINIBATCHES = (1, 2, 4, 8)
FULL = {"profiles": ",".join(PROFILES), "minibatches": ",".join(map(str, MINIBATCHES))}
QUICK = {"profiles": "longalign", "minibatches": "4"}
"""``--profiles`` / ``--minibatches`` when not given, without and with ``--quick``."""
CONFIGS = (
    ("fsdp", "lb_micro"),
    ("fsdp", "local_sort"),
    ("odc", "lb_micro"),
    ("odc", "lb_mini"),
    ("odc-all", "lb_mini"),
    ("ddp", "lb_mini"),
    ("fsdp2", "lb_micro"),
    ("fsdp2-noreshard", "lb_micro"),
)
EXTRA_CONFIGS = (("odc-loop", "lb_mini"),)
"""Configurations ``--configs`` accepts that the default list leaves out."""
BASELINE = "fsdp+lb_micro"
FSDP2_BACKENDS = {"fsdp2": True, "fsdp2-noreshard": False}
"""PyTorch FSDP2 backends and their ``reshard_after_forward``."""
LOCKSTEP_BACKENDS = ("fsdp", *FSDP2_BACKENDS)
"""Backends whose plan bubble is the lockstep one."""
#: megatron's OptimizerConfig of every row (Adam = torch AdamW, betas 0.9/0.999, eps 1e-8 by default).
OPTIMIZER = {"lr": 1e-4, "weight_decay": 0.01, "clip_grad": 1.0}
ODC_VARIANTS = {"odc-all": {"unsharded_budget": "all"}}
"""Benchmark backends that are ``odc`` with other ODCConfig options (``--odc-unsharded-budget all``:
every unit fetched once and pushed once per minibatch)."""
PER_TENSOR_OPTIMIZER_BACKENDS = ("odc-loop",)
"""Benchmark backends that are ``odc`` with its optimizer on torch's per-tensor Adam loop (``fused=False,
foreach=False``), the kernel ODC's optimizer ran before the fused multi-tensor one: the "before" of the
optimizer step's share of the step."""
PAPER_CAP_TOKENS = 65536
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_LENGTH_SCALE = 16

#: The GPT trained (megatron_odc.mcore.model.GPTConfig fields).
MODEL = {
    "num_layers": 8,
    "hidden_size": 128,
    "num_attention_heads": 2,
    "ffn_hidden_size": 1024,
    "vocab_size": 512,
}

#: Per-sample cost a*s^2 + b*s in seconds of fwd+bwd on one core (``--calibrate``, bf16, two fits on
#: the shared machine averaged; only a/b matters to the balancer, so fp32 runs plan with it too).
CPU_COST = {"a": 4.7e-8, "b": 1.28e-4}


def config_name(backend: str, plan: str) -> str:
    """Returns ``backend+plan``."""
    return f"{backend}+{plan}"
