"""Third-party warnings that tell a user nothing to act on, filtered once per process at start-up.

A quick-start run printed two thirds of its output as warnings from megatron-core and torch, once per
rank and again in every checkpoint-writer process. :data:`KNOWN_HARMLESS` lists each one with why it can
be ignored; :func:`filter_known_warnings` (called by the entry points before megatron-core is imported)
hides exactly those. ``MEGATRON_ODC_SHOW_WARNINGS=1`` shows them all. docs/reliability.md says what
every line a run still prints means.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping

SHOW_WARNINGS_ENV = "MEGATRON_ODC_SHOW_WARNINGS"
"""Set to 1 to see every warning, the known-harmless ones included."""


@dataclasses.dataclass(frozen=True)
class KnownWarning:
    """One warning that is filtered.

    Attributes:
        message: a regular expression matched at the start of the warning's text.
        category: its class.
        why: why it needs no action (shown nowhere; the reason it is on the list).
        cpu_only: filtered only where there is no CUDA.
    """

    message: str
    category: type[Warning]
    why: str
    cpu_only: bool = False


KNOWN_HARMLESS: tuple[KnownWarning, ...] = (
    KnownWarning(
        r"(Transformer Engine and Apex are|Apex is) not installed",
        UserWarning,
        "megatron-core announces its torch fallbacks at import; features that need TransformerEngine "
        "(--transformer-impl transformer_engine, FP8) are refused before training when it is missing",
    ),
    KnownWarning(
        r"full scope is deprecated",
        UserWarning,
        "megatron-core 0.16's own TransformerConfig default (cuda_graph_scope); no CUDA graph is used",
    ),
    KnownWarning(
        r"When using async grad allreduce it is recommended to set the environment variable "
        r"CUDA_DEVICE_MAX_CONNECTIONS",
        UserWarning,
        "a GPU stream-ordering hint from megatron-core's TP layers; there are no CUDA streams on CPU",
        cpu_only=True,
    ),
    KnownWarning(
        r"`(load|save)_state_dict` is deprecated",
        FutureWarning,
        "torch.distributed.checkpoint's rename, called inside megatron-core's checkpoint code",
    ),
)
"""Every filtered warning, with the reason."""


def filter_known_warnings(environ: Mapping[str, str] = os.environ) -> int:
    """Install a filter for each of :data:`KNOWN_HARMLESS` (unless ``MEGATRON_ODC_SHOW_WARNINGS=1``).

    Returns:
        How many filters were installed.
    """
    if environ.get(SHOW_WARNINGS_ENV) == "1":
        return 0
    cpu = not _has_cuda()
    count = 0
    for known in KNOWN_HARMLESS:
        if known.cpu_only and not cpu:
            continue
        warnings.filterwarnings("ignore", message=known.message, category=known.category)
        count += 1
    return count


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
