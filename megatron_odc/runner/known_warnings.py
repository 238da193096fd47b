"""Third-party warnings that tell a user nothing to act on, filtered once per process at start-up.

A quick-start run printed two thirds of its output as warnings from megatron-core and torch, once per
rank and again in every checkpoint-writer process. :data:`KNOWN_HARMLESS` lists each one with why it can
be ignored; :func:`filter_known_warnings` (called by the entry points before megatron-core is imported)
hides exactly those (``warnings`` filters, and ``logging`` filters on the loggers that emit the rest). ``MEGATRON_ODC_SHOW_WARNINGS=1`` shows them all. docs/reliability.md says what
every line a run still prints means.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import warnings
from collections.abc import Mapping

SHOW_WARNINGS_ENV = "MEGATRON_ODC_SHOW_WARNINGS"
"""Set to 1 to see every warning, the known-harmless ones included."""


@dataclasses.dataclass(frozen=True)
class KnownWarning:
    """One warning that is filtered: a ``warnings`` warning, or a record of a ``logging`` logger.

    Attributes:
        message: a regular expression matched at the start of the warning's text.
        category: its class (``warnings``), or None for a log record.
        why: why it needs no action (shown nowhere; the reason it is on the list).
        cpu_only: filtered only where there is no CUDA.
        logger: the ``logging`` logger that emits it (None: the ``warnings`` module).
    """

    message: str
    category: type[Warning] | None
    why: str
    cpu_only: bool = False
    logger: str | None = None


class _DropRecords(logging.Filter):
    """Drops a logger's records whose message matches one of ``patterns`` (at its start)."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.patterns = [re.compile(pattern) for pattern in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(pattern.match(text) for pattern in self.patterns)


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
    KnownWarning(
        r"No CUDA runtime is found, using CUDA_HOME",
        None,
        "torch's CUDA build (Python 3.12's torch from PyPI) on a machine without a GPU, where it "
        "runs on CPU; printed when megatron-core imports torch.utils.cpp_extension",
        logger="torch.utils.cpp_extension",
    ),
    KnownWarning(
        r"MCore's async save is deprecated",
        None,
        "megatron-core 0.19's notice about its own default save strategy; the plugin saves "
        "synchronously through it and sets no async strategy",
        logger="megatron.core.dist_checkpointing.strategies.torch",
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
    by_logger: dict[str, list[str]] = {}
    for known in KNOWN_HARMLESS:  # loggers first: torch logs one of them while it is imported
        if known.logger is not None:
            by_logger.setdefault(known.logger, []).append(known.message)
    for name, patterns in by_logger.items():
        logging.getLogger(name).addFilter(_DropRecords(patterns))
    cpu = not _has_cuda()
    count = sum(len(patterns) for patterns in by_logger.values())
    for known in KNOWN_HARMLESS:
        if known.logger is not None or (known.cpu_only and not cpu):
            continue
        warnings.filterwarnings("ignore", message=known.message, category=known.category)
        count += 1
    return count


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
