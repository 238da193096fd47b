"""Sample-length profiles for offline planning: the shipped profile file and plain length lists.

Owns where the profile file is found (``--profiles-file``, else env ``MEGATRON_ODC_PROFILES``, else the file
shipped in this package, ``length_profiles.json``, written by ``python -m megatron_odc.tools.length_profiles``)
and how lengths are read. A profile file is a JSON object
``{name: {"lengths": [int, ...], ...}}``. Entry points: :func:`load_profile_lengths`, :func:`load_lengths_file`.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

__all__ = [
    "PROFILES_ENV",
    "SHIPPED_PROFILES_PATH",
    "default_profiles_path",
    "load_lengths_file",
    "load_profile_lengths",
    "load_profiles",
]

PROFILES_ENV = "MEGATRON_ODC_PROFILES"

SHIPPED_PROFILES_PATH = Path(__file__).with_name("length_profiles.json")
"""The profiles shipped with the package (longalign, swe_smith, rl_aime, short, uniform, agent_rl)."""


def default_profiles_path() -> Path:
    """Returns ``$MEGATRON_ODC_PROFILES`` if set, else :data:`SHIPPED_PROFILES_PATH`."""
    env = os.environ.get(PROFILES_ENV)
    return Path(env) if env else SHIPPED_PROFILES_PATH


def _check_lengths(lengths: object, where: str, lines: list[int] | None = None) -> list[int]:
    """``lengths`` if it is a non-empty list of non-negative ints, else a ValueError.

    A bad entry is named by ``where`` and its 1-based item number, or ``where:line`` when ``lines``
    (the line of each entry in a text file) is given.
    """
    if not isinstance(lengths, list) or not lengths:
        raise ValueError(f"{where}: expected a non-empty list of lengths")
    for i, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            at = f"{where}:{lines[i]}" if lines is not None else f"{where}: item {i + 1}"
            raise ValueError(
                f"{at}: length {length!r} is not allowed; lengths must be non-negative integers"
            )
    return list(lengths)


def _parse_json(text: str, file: Path, expected: str) -> object:
    """``json.loads(text)``, with a decoding error naming ``file`` and its line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{file}:{err.lineno}: not valid JSON ({err.msg}, line {err.lineno} column "
            f"{err.colno}); expected {expected}"
        ) from None


def load_profiles(path: str | os.PathLike | None = None) -> dict[str, dict]:
    """Reads a profile file.

    Args:
        path: the file; ``None`` means :func:`default_profiles_path`.

    Returns:
        Profile name -> profile dict (with at least ``"lengths"``).

    Raises:
        ValueError: the file is missing or malformed.
    """
    file = Path(path) if path is not None else default_profiles_path()
    if not file.is_file():
        raise ValueError(
            f"length profile file {file} not found; pass --profiles-file or set {PROFILES_ENV}"
        )
    data = _parse_json(file.read_text(), file, 'a JSON object {name: {"lengths": [...]}}')
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object of profiles")
    for name, profile in data.items():
        if not isinstance(profile, dict) or "lengths" not in profile:
            raise ValueError(f"{file}: profile {name!r} has no 'lengths'")
    return data


def load_profile_lengths(name: str, path: str | os.PathLike | None = None) -> list[int]:
    """Returns the sample lengths of profile ``name`` (see :func:`load_profiles` for ``path``)."""
    file = Path(path) if path is not None else default_profiles_path()
    profiles = load_profiles(file)
    if name not in profiles:
        raise ValueError(f"unknown profile {name!r}; the file has {sorted(profiles)}")
    return _check_lengths(profiles[name]["lengths"], f"{file}: profile {name!r}")


def load_lengths_file(path: str | os.PathLike) -> list[int]:
    """Reads lengths from a JSON list or from a text file with one integer per line (blank lines ignored)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"lengths file {file} not found")
    text = file.read_text()
    if text.lstrip().startswith("["):
        expected = "a JSON list of lengths, or one integer per line"
        return _check_lengths(_parse_json(text, file, expected), str(file))
    lengths, lines = [], []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            lengths.append(int(line.strip()))
        except ValueError:
            raise ValueError(f"{file}:{line_no}: not an integer length: {line.strip()!r}") from None
        lines.append(line_no)
    return _check_lengths(lengths, str(file), lines)


def minibatch_sample_ids(
    num_samples: int, global_batch: int, num_minibatches: int, seed: int
) -> list[list[int]]:
    """Consecutive minibatches of sample ids from one ``random.Random(seed).shuffle`` of the pool.

    Raises:
        ValueError: the pool holds fewer than ``global_batch * num_minibatches`` samples.
    """
    if global_batch * num_minibatches > num_samples:
        raise ValueError(
            f"--num-minibatches {num_minibatches} x global minibatch {global_batch} needs "
            f"{global_batch * num_minibatches} samples, the pool has {num_samples}"
        )
    order = list(range(num_samples))
    random.Random(seed).shuffle(order)
    return [order[k * global_batch : (k + 1) * global_batch] for k in range(num_minibatches)]
