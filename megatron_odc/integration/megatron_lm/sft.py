"""Megatron-LM's ``--sft`` path in the plugin's environment: the flags it needs and the transformers-5
adapter of its ``SFTTokenizer``.

- :func:`apply_sft_args` (run by the patched ``parse_args``, before ``validate_args``): ``--sft`` reads
  its tokenizer through Megatron-LM's legacy tokenizer system where the tag has one (``core_v0.16.1``'s
  ``--tokenizer-type SFTTokenizer`` is built only there: without ``--legacy-tokenizer`` the run stops on
  a bare ``AssertionError: Tokenizer path must be specified``), and ``SFTDataset`` asserts that no
  attention mask is built in the data loader (its samples carry ``cu_seqlens``). Both are set, with
  one log line, when ``--sft`` is given.
- :func:`sft_tokenizer_adapter`: the ``SFTTokenizer`` of ``core_v0.16.1`` (``megatron.training``) and
  of megatron-core 0.17 indexes ``apply_chat_template(..., return_tensors="np")[0]`` and takes
  ``len()`` of the per-turn result, which is transformers 4's token-id array / list; transformers 5
  returns a ``BatchEncoding`` by default (``'tokenizers.Encoding' object has no attribute 'copy'``).
  The adapter wraps the tokenizer's Hugging Face tokenizer so that ``apply_chat_template`` defaults to
  ``return_dict=False`` (the transformers 4 result; a caller's explicit ``return_dict`` wins). The
  release row names the module (``MegatronLmRelease.sft_tokenizer``); from ``core_v0.18.2`` the
  tokenizer reads both results itself (no adapter). The launcher applies it with its patches;
  a patched Megatron-LM source (``patches/``, no launcher) gets it from :func:`apply_sft_args`
  (:func:`adapt_sft_tokenizer`, for the rest of the process), on every device.
- :func:`apply_sft_args` also has a JSONL the SFT reader fails on named, file and line
  (``sft_data.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import logging
from collections.abc import Iterator
from typing import Any

from megatron_odc.integration.megatron_lm.sft_data import name_bad_sft_data
from megatron_odc.runner.log import info_once

logger = logging.getLogger(__name__)


def apply_sft_args(args: argparse.Namespace) -> argparse.Namespace:
    """With ``--sft``: ``--legacy-tokenizer`` (where the tag has it) and
    ``--no-create-attention-mask-in-dataloader``, logged once, and :func:`adapt_sft_tokenizer`
    (nothing new where the launcher's adapter is on); nothing otherwise."""
    if not getattr(args, "sft", False):
        return args
    from megatron_odc.integration.megatron_lm.version import installed_megatron_lm_release

    adapt_sft_tokenizer(installed_megatron_lm_release().sft_tokenizer)
    name_bad_sft_data()
    changed = []
    if hasattr(args, "legacy_tokenizer") and not args.legacy_tokenizer:
        args.legacy_tokenizer = True
        changed.append("--legacy-tokenizer (this tag builds its SFTTokenizer there only)")
    if getattr(args, "create_attention_mask_in_dataloader", False):
        args.create_attention_mask_in_dataloader = False
        changed.append(
            "--no-create-attention-mask-in-dataloader (SFTDataset's samples carry cu_seqlens)"
        )
    if changed:
        info_once(logger, "--sft: set %s", ", ".join(changed))
    return args


class ChatTemplateIds:
    """A Hugging Face tokenizer whose ``apply_chat_template`` returns token ids (transformers 4's
    default) unless the caller asks for ``return_dict``; everything else is the tokenizer's."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("return_dict", False)
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def _wrap_init(original: Any) -> Any:
    @functools.wraps(original)
    def init(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not isinstance(self._tokenizer, ChatTemplateIds):
            self._tokenizer = ChatTemplateIds(self._tokenizer)
            logger.info(
                "SFTTokenizer: apply_chat_template returns token ids (return_dict=False), as "
                "Megatron-LM's SFTTokenizer expects under transformers 5"
            )

    init.__megatron_odc_original__ = original
    return init


def _sft_tokenizer_class(module_name: str | None) -> type | None:
    """``module_name.SFTTokenizer``, or None where there is no module to adapt."""
    if module_name is None:
        return None
    try:
        return importlib.import_module(module_name).SFTTokenizer
    except ImportError:
        return None


def _adapt(cls: type) -> None:
    """Wraps ``cls.__init__`` with :func:`_wrap_init` unless it is wrapped already."""
    if not hasattr(cls.__dict__["__init__"], "__megatron_odc_original__"):
        cls.__init__ = _wrap_init(cls.__dict__["__init__"])


def adapt_sft_tokenizer(module_name: str | None) -> bool:
    """``module_name.SFTTokenizer.__init__`` wraps its tokenizer in :class:`ChatTemplateIds` for the
    rest of the process (a patched Megatron-LM source has no launcher handle to revert it); returns
    whether there is such a class. Applying it again, or inside :func:`sft_tokenizer_adapter`,
    changes nothing."""
    cls = _sft_tokenizer_class(module_name)
    if cls is None:
        return False
    _adapt(cls)
    return True


@contextlib.contextmanager
def sft_tokenizer_adapter(module_name: str | None) -> Iterator[bool]:
    """:func:`adapt_sft_tokenizer` inside the block only (the launcher's patches); yields whether
    there is a class to adapt (where an enclosing block already adapted it, it stays adapted)."""
    cls = _sft_tokenizer_class(module_name)
    if cls is None:
        yield False
        return
    original = cls.__dict__["__init__"]
    _adapt(cls)
    try:
        yield True
    finally:
        cls.__init__ = original
