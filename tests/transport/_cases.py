"""Inputs shared by the transport tests."""

from __future__ import annotations

import torch


def mismatched_registrations(rank: int, world_size: int) -> list[tuple[str, str, int, torch.dtype]]:
    """``(field, name, numel, dtype)`` per case: the last rank registers something else in ``field``."""
    last = world_size - 1
    return [
        ("name", "mm_other" if rank == last else "mm", 64, torch.float32),
        ("numel", "mm", 65 if rank == last else 64, torch.float32),
        ("dtype", "mm", 64, torch.float16 if rank == last else torch.float32),
    ]
