"""ODC's flags (``runner/odc_flags.py``), built once from ODCConfig for both entries, and their rules."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_odc.mcore.config import ODCConfig
from megatron_odc.runner.arguments import build_parser
from megatron_odc.runner.odc_flags import add_odc_arguments, odc_flag, resolve_odc_args


def _megatron_lm_style(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_odc_arguments(
        parser, dp_backend_default=None, balance_choices=("lb_mini", "lb_micro", "none")
    )
    return parser.parse_args(argv)


def test_one_flag_per_config_field_in_both_entries() -> None:
    plugin = build_parser()
    plugin_flags = {s for a in plugin._actions for s in a.option_strings}
    megatron_lm = argparse.ArgumentParser()
    add_odc_arguments(megatron_lm, dp_backend_default=None)
    megatron_lm_flags = {s for a in megatron_lm._actions for s in a.option_strings}
    for field in dataclasses.fields(ODCConfig):
        assert odc_flag(field) in plugin_flags, field.name
        assert odc_flag(field) in megatron_lm_flags, field.name
    assert "--no-odc-prefetch" in plugin_flags
    assert "--odc-prefetch" not in plugin_flags


def test_help_says_what_a_switch_does_and_the_default_that_applies() -> None:
    helps = {a.option_strings[0]: a.help for a in build_parser()._actions if a.option_strings}
    assert helps["--no-odc-prefetch"].endswith("(on by default; this flag turns it off)")
    assert helps["--odc-deterministic"].endswith("(off by default)")
    # the entry fills the fence timeout from --distributed-timeout-minutes, not the field's 600 s
    assert helps["--odc-timeout-s"].endswith("(default --distributed-timeout-minutes x 60)")
    args = resolve_odc_args(build_parser().parse_args(["--distributed-timeout-minutes", "2"]))
    assert ODCConfig.from_args(args).timeout_s == 120.0
    assert helps["--odc-bucket-size"].endswith(f"(default {ODCConfig().bucket_size})")


def test_flags_reach_the_config() -> None:
    args = build_parser().parse_args(
        ["--odc-pushes-in-flight", "3", "--odc-timeout-s", "12.5", "--no-odc-prefetch"]
    )
    args = resolve_odc_args(args)
    assert ODCConfig.from_args(args) == ODCConfig(
        pushes_in_flight=3, timeout_s=12.5, prefetch=False
    )
    with pytest.raises(SystemExit):  # argparse refuses a choice outside the field's choices
        build_parser().parse_args(["--odc-cuda-accumulate", "fast"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dp-backend", "fsdp", "--balance", "lb_mini"], "--balance lb_mini gives DP ranks"),
        (["--dp-backend", "fsdp", "--odc-transport", "shm"], "--odc-transport shm does not apply"),
        (["--dp-backend", "ddp", "--odc-bucket-size", "9"], "--odc-bucket-size applies to"),
        (["--dp-backend", "distopt", "--no-odc-prefetch"], "--no-odc-prefetch applies to"),
        (["--dp-backend", "odc", "--odc-alignment", "0"], "--odc-alignment must be"),
    ],
)
def test_rules_refuse_naming_the_flag(argv, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_odc_args(_megatron_lm_style(argv))


def test_defaults_per_backend() -> None:
    odc = resolve_odc_args(_megatron_lm_style(["--dp-backend", "odc"]))
    assert (odc.balance, odc.odc_transport) == ("lb_mini", "auto")
    fsdp = resolve_odc_args(_megatron_lm_style(["--dp-backend", "fsdp"]))
    assert (fsdp.balance, fsdp.odc_transport) == ("lb_micro", "collective")
    kept = resolve_odc_args(_megatron_lm_style(["--dp-backend", "fsdp", "--balance", "none"]))
    assert kept.balance == "none"  # Megatron-LM's own sampler: equal counts
    ddp = resolve_odc_args(_megatron_lm_style(["--dp-backend", "ddp"]))
    assert (ddp.balance, ddp.odc_transport) == ("lb_mini", None)
