"""Tests of ``megatron_odc.core.groups`` and ``megatron_odc.transport.hosts`` without a process group.

The arithmetic of shard groups x replica groups, the default shard group size from the hosts, the
refusals (each naming ``--odc-shard-group-size`` or ``--odc-transport``), and the test-only pretend
hosts. The spawned 4-rank cases (parity with megatron-core DDP, the recorded promise, memory,
checkpoints) are in ``tests/mcore/test_hybrid.py``.
"""

from __future__ import annotations

import socket

import pytest

from megatron_odc.core.groups import (
    SHARD_GROUP_SIZE_FLAG,
    DPTopology,
    check_shard_group_size,
    default_shard_group_size,
    shard_and_replica_ranks,
)
from megatron_odc.transport.hosts import LOCAL_WORLD_SIZE_ENV, host_id, host_namespace


def test_shard_and_replica_groups_partition_the_dp_group() -> None:
    dp_ranks = [1, 3, 5, 7, 9, 11]  # the DP group of one TP rank at TP=2
    shards, replicas = shard_and_replica_ranks(dp_ranks, 2)
    assert shards == [[1, 3], [5, 7], [9, 11]]
    assert replicas == [[1, 5, 9], [3, 7, 11]]
    # Every rank is in exactly one shard group and one replica group; a shard group and a replica
    # group meet in exactly one rank.
    for groups in (shards, replicas):
        assert sorted(r for g in groups for r in g) == dp_ranks
    assert all(len(set(s) & set(r)) == 1 for s in shards for r in replicas)
    assert shard_and_replica_ranks(dp_ranks, 6) == ([dp_ranks], [[r] for r in dp_ranks])


def test_default_shard_group_size_is_the_ranks_of_one_host() -> None:
    assert default_shard_group_size(["a", "a", "b", "b"]) == 2
    assert default_shard_group_size(["a"] * 4) == 4
    assert default_shard_group_size(["a", "b", "c"]) == 1  # TP fills each host: shard 1 x replica 3
    for hosts in (["a", "b", "a", "b"], ["a", "a", "a", "b"]):
        with pytest.raises(ValueError, match=SHARD_GROUP_SIZE_FLAG):
            default_shard_group_size(hosts)


def test_shard_group_size_must_divide_the_dp_size() -> None:
    check_shard_group_size(2, 4)
    with pytest.raises(ValueError, match=f"{SHARD_GROUP_SIZE_FLAG} 3 does not divide .* 4"):
        check_shard_group_size(3, 4)


def test_one_host_transports_refuse_a_shard_group_across_hosts() -> None:
    across = DPTopology(None, None, None, 4, 1, 0, 0, ("a", "a", "b", "b"))
    for name in ("shm", "cuda"):
        with pytest.raises(ValueError, match=f"--odc-transport {name} .* spans 2 hosts"):
            across.check_transport(name)
    across.check_transport("collective")
    DPTopology(None, None, None, 2, 2, 0, 1, ("a", "a")).check_transport("shm")


def test_pretend_hosts_are_test_only_and_checked(monkeypatch) -> None:
    monkeypatch.delenv(LOCAL_WORLD_SIZE_ENV, raising=False)
    assert host_id() == socket.gethostname()
    assert host_namespace() == ""
    monkeypatch.setenv(LOCAL_WORLD_SIZE_ENV, "2")
    assert host_id() == f"{socket.gethostname()}/pretend-host-0"  # rank 0 without a process group
    assert host_namespace() == "h0-"
    monkeypatch.setenv(LOCAL_WORLD_SIZE_ENV, "0")
    with pytest.raises(ValueError, match=LOCAL_WORLD_SIZE_ENV):
        host_id()
