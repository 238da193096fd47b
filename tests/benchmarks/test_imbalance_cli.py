"""``benchmarks/imbalance.py``'s flags: ``--quick`` fills only what is not given; bad entries are named.

Before, ``--quick`` replaced ``--configs`` with every configuration and capped ``--repeats`` at 5 without a
word, so ``--quick --configs odc+lb_mini,fsdp2+lb_micro`` ran all eight.
"""

from __future__ import annotations

import pytest

from benchmarks import imbalance
from benchmarks.imbalance_lib.report import event_shares, format_shares, paired_bound, paired_ratio
from benchmarks.imbalance_lib.settings import CONFIGS, EXTRA_CONFIGS, MINIBATCHES, PROFILES


def _settings(*argv: str) -> dict:
    return imbalance.settings_from_args(imbalance.build_parser().parse_args(list(argv)))


def test_quick_fills_only_the_flags_not_given() -> None:
    quick = _settings("--quick")
    assert quick["profiles"] == ["longalign"]
    assert quick["minibatches"] == [4]
    assert quick["configs"] == list(CONFIGS)
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
    assert full["profiles"] == list(PROFILES)
    assert full["minibatches"] == list(MINIBATCHES)
    assert not set(EXTRA_CONFIGS) & set(full["configs"])
    extra = _settings("--configs", "odc+lb_mini,odc-loop+lb_mini")
    assert extra["configs"] == [("odc", "lb_mini"), ("odc-loop", "lb_mini")]


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


def _ranks(*wall_idle: tuple[float, float]) -> list[dict]:
    return [{"wall_s": wall, "idle_s": idle} for wall, idle in wall_idle]


def test_the_bound_divides_the_peer_by_the_evenly_split_busy_time() -> None:
    steps = {
        "fsdp2+lb_micro": [_ranks((12.0, 3.0), (11.0, 1.0)), _ranks((6.0, 0.0), (6.0, 0.0))],
        # rank 0 waits 2 s at the fence for rank 1: busy 8 and 10, evenly split 9
        "odc+lb_mini": [_ranks((10.0, 2.0), (10.0, 0.0)), _ranks((5.0, 0.5), (5.0, 0.5))],
    }
    ratio = paired_ratio(steps, "fsdp2+lb_micro", "odc+lb_mini")
    bound = paired_bound(steps, "fsdp2+lb_micro", "odc+lb_mini")
    assert ratio == pytest.approx((12 / 10 + 6 / 5) / 2)
    assert bound == pytest.approx((12 / 9 + 6 / 4.5) / 2)
    assert bound > ratio
    assert paired_bound(steps, "fsdp2-noreshard+lb_micro", "odc+lb_mini") is None


def test_event_shares_count_nested_events_of_a_kind_once() -> None:
    records = [
        {
            "wall_s": 10.0,
            # a push nested in another push (FSDP2's finalize_backward calling post_backward)
            "events": [("push", 1.0, 3.0), ("push", 2.0, 2.5), ("optimizer", 9.0, 10.0)],
        },
        {"wall_s": 20.0, "events": [("push", 0.0, 1.0), ("push", 4.0, 5.0)]},
    ]
    shares = event_shares(records)
    assert shares == pytest.approx({"push": 0.15, "optimizer": 0.05})  # medians of 0.2/0.1, 0.1/0
    row = {
        "profile": "longalign",
        "minibatch_per_rank": 4,
        "config": "odc+lb_mini",
        "event_share_per_rank": [shares, shares],
    }
    line = format_shares([row]).splitlines()[1]
    assert "15.0/15.0" in line
    assert "5.0/5.0" in line
    assert line.split()[-1] == "80.0/80.0"
