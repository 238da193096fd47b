"""What a torch_dist checkpoint directory must hold before it is read, checked from its file names.

megatron-core reads a missing ``common.pt`` into an ``AttributeError`` of its own, a missing
``.metadata`` into a ``FileNotFoundError`` and an empty or foreign directory into "is not a
distributed checkpoint", each after a traceback per rank; :func:`check` names the problem first. Every
rank sees the same files, so every rank raises the same message.
"""

from __future__ import annotations

from pathlib import Path

from megatron_odc.mcore.releases import current_release, installed_version

LEGACY_HINT = (
    "convert it with Megatron-LM first (pretrain_gpt.py with the model's flags and --load {load} "
    "--ckpt-format torch --ckpt-convert-format torch_dist --ckpt-convert-save OUT saves it as "
    "OUT/torch_dist and exits), then pass --load OUT/torch_dist"
)
"""How to turn Megatron-LM's legacy torch checkpoint into torch_dist (Megatron-LM's own flags)."""

REQUIRED = (
    ("metadata.json", "the format record megatron-core writes last"),
    (".metadata", "torch_dist's index of every tensor"),
    ("common.pt", "the state every rank shares"),
)
"""The files of every torch_dist checkpoint, and what each holds (for the message)."""


class CheckpointLayoutError(ValueError):
    """A checkpoint directory that cannot be a loadable torch_dist checkpoint; the message says what
    the directory is or lacks (the caller prefixes which checkpoint)."""


def check(checkpoint_dir: Path) -> None:
    """Refuse a directory that is empty, Megatron-LM's legacy torch format, or lacks a torch_dist file.

    Raises:
        CheckpointLayoutError: naming the missing file, or the format with how to convert it.
    """
    names = {entry.name for entry in checkpoint_dir.iterdir()}
    if not names:
        raise CheckpointLayoutError(
            "is an empty directory: a save that never finished, or its files were deleted"
        )
    legacy = sorted(n for n in names if n.startswith("mp_rank_"))
    if legacy and ".metadata" not in names:
        raise CheckpointLayoutError(
            f"is a Megatron-LM checkpoint in the legacy torch format ({legacy[0]}/"
            "model_optim_rng.pt), which megatron_odc does not read: "
            + LEGACY_HINT.format(load=checkpoint_dir.parent)
        )
    release = current_release()
    for name, role in REQUIRED:
        if name == "common.pt" and release.common_state_file is None:
            continue  # this release also reads the common state from inside the torch_dist files
        if name not in names:
            if name == "common.pt" and _holds_common_state(checkpoint_dir):
                raise CheckpointLayoutError(
                    "was saved by megatron-core 0.19 or later, which keeps the state every rank "
                    "shares inside the torch_dist files; the installed megatron-core "
                    f"{installed_version()} reads it only from common.pt. Resume it with megatron-core "
                    ">= 0.19 (Python 3.12; README: Supported releases)"
                )
            raise CheckpointLayoutError(f"is incomplete: {name} ({role}) is missing")


def _holds_common_state(checkpoint_dir: Path) -> bool:
    """Whether torch_dist's index names the ``common_state`` object of megatron-core >= 0.19."""
    try:
        return b"common_state" in (checkpoint_dir / ".metadata").read_bytes()
    except OSError:
        return False
