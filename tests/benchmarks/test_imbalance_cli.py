"""``benchmarks/imbalance.py``'s flags: ``--quick`` fills only what is not given; bad entries are named.

Before, ``--quick`` replaced ``--configs`` with every configuration and capped ``--repeats`` at 5 without a
word, so ``--quick --configs odc+lb_mini,fsdp2+lb_micro`` ran all eight.
"""

from __future__ import annotations

import pytest

from tests.test_imbalance_fsdp2 import _load_imbalance


def _settings(*argv: str) -> dict:
    bench = _load_imbalance()
    return bench.settings_from_args(bench.build_parser().parse_args(list(argv)))


def test_quick_fills_only_the_flags_not_given() -> None:
    bench = _load_imbalance()
    quick = _settings("--quick")
    assert quick["profiles"] == ["longalign"]
    assert quick["minibatches"] == [4]
    assert quick["configs"] == list(bench.CONFIGS)
    assert quick["repeats"] == 5
    given = _settings(
        "--quick",
        "--configs",
        "odc+lb_mini,fsdp2+lb_micro",
        "--repeats",
        "20",
        "--profiles",
        "uniform",
    )
    assert given["configs"] == [("odc", "lb_mini"), ("fsdp2", "lb_micro")]
    assert given["repeats"] == 20
    assert given["profiles"] == ["uniform"]
    assert given["minibatches"] == [4]
    full = _settings()
    assert full["profiles"] == list(bench.PROFILES)
    assert full["minibatches"] == list(bench.MINIBATCHES)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--profiles", "longalign,nope"], "--profiles entry 'nope'"),
        (["--minibatches", "4,x"], "--minibatches entry 'x'"),
        (["--minibatches", "0"], "--minibatches entry '0'"),
        (["--repeats", "0"], "--repeats 0"),
        (["--configs", "odc+lb_nope"], "--configs entry 'odc+lb_nope'"),
    ],
)
def test_a_bad_entry_is_named(argv: list[str], named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("+", r"\+")):
        _settings(*argv)
