"""The data-parallel topology of ODC: shard groups x replica groups (hybrid sharding, HSDP-style).

[Note: hybrid sharding]
A DP group of N ranks splits into N / G *shard groups* of G consecutive DP ranks and G *replica groups*
(the ranks holding the same shard index in every shard group). Parameters, gradient accumulators and
optimizer state are sharded over the shard group only (each rank holds 1/G of them: 18 P / G bytes for
bf16 with Adam); fetches and pushes stay one-sided inside the shard group, on the node's transport. Once
per minibatch, after the push fence, every owner's fp32 accumulator shards are summed over its replica
group (one ``torch.distributed`` all-reduce per bucket, issued back to back: one round), and every
replica then runs the same optimizer step on the same shard. With G = N (one host, the default there)
there are no replicas and nothing changes; with G = 1 every rank holds everything (plain DDP over ODC's
buffers).

The default G is the number of the DP group's ranks on one host (``transport/hosts.py``), so
``torchrun --nnodes M`` is hybrid across nodes and fully sharded inside each. The DP group's ranks must
then lie host by host (megatron's rank order does that); ``--odc-shard-group-size`` sets G explicitly.

:func:`build_topology` is collective over the whole world: ``torch.distributed`` creates every subgroup
on every rank, so the DP groups of all TP ranks are enumerated first. No megatron import.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from megatron_odc.transport.hosts import hosts_of_group

SHARD_GROUP_SIZE_FLAG = "--odc-shard-group-size"
"""The flag that sets G (``ODCConfig.shard_group_size``); named by every refusal here."""

ONE_HOST_TRANSPORTS = ("shm", "cuda")
"""Transports whose memory is shared only between the ranks of one host."""


@dataclasses.dataclass(frozen=True)
class DPTopology:
    """This rank's place in one DP group split into shard groups x replica groups.

    Attributes:
        dp_group: the whole DP group (layout and weight checks, the global token count, FP8 amax).
        shard_group: the G ranks this rank shares its shards with (the transport's group).
        replica_group: the N / G ranks holding the same shard index (``None`` when N == G).
        shard_size: G.
        replica_size: N / G.
        shard_rank: this rank's index in its shard group (which shard it owns).
        replica_rank: this rank's index in its replica group (which copy of the shard it holds).
        shard_hosts: the host of every rank of this shard group, in shard-rank order.
    """

    dp_group: dist.ProcessGroup | None
    shard_group: dist.ProcessGroup | None
    replica_group: dist.ProcessGroup | None
    shard_size: int
    replica_size: int
    shard_rank: int
    replica_rank: int
    shard_hosts: tuple[str, ...]

    @property
    def hybrid(self) -> bool:
        """Whether shards are replicated (more than one shard group)."""
        return self.replica_size > 1

    def check_transport(self, transport: str) -> None:
        """Refuse a one-host transport over a shard group that spans hosts.

        Raises:
            ValueError: naming ``--odc-transport`` and ``--odc-shard-group-size``.
        """
        hosts = sorted(set(self.shard_hosts))
        if transport in ONE_HOST_TRANSPORTS and len(hosts) > 1:
            raise ValueError(
                f"--odc-transport {transport} joins the ranks of one host, but the shard group of "
                f"{SHARD_GROUP_SIZE_FLAG} {self.shard_size} spans {len(hosts)} hosts ({', '.join(hosts)}); "
                f"leave {SHARD_GROUP_SIZE_FLAG} unset (the ranks of one host: hybrid sharding across "
                "hosts), or for full sharding across hosts --odc-transport nvshmem (GPUs) or mpi (CPU "
                "ranks, launched with mpiexec)"
            )


def default_shard_group_size(hosts: list[str]) -> int:
    """G by default: the DP ranks per host, when the DP group lies host by host in equal blocks.

    Args:
        hosts: the host of every DP rank, in DP-rank order.

    Raises:
        ValueError: the hosts hold different numbers of DP ranks, or their ranks interleave.
    """
    blocks: list[list[str]] = []
    for host in hosts:
        if blocks and blocks[-1][0] == host:
            blocks[-1].append(host)
        else:
            blocks.append([host])
    sizes = {len(b) for b in blocks}
    if len(sizes) != 1 or len(blocks) != len(set(hosts)):
        per_host = {h: hosts.count(h) for h in dict.fromkeys(hosts)}
        raise ValueError(
            f"the DP group's ranks do not lie host by host in equal blocks (ranks per host, in DP "
            f"order: {per_host}); set {SHARD_GROUP_SIZE_FLAG} to the ranks each parameter is sharded "
            "over"
        )
    return sizes.pop()


def check_shard_group_size(shard_size: int, dp_size: int) -> None:
    """Raise unless ``shard_size`` divides ``dp_size``.

    Raises:
        ValueError: naming ``--odc-shard-group-size``.
    """
    if shard_size < 1 or dp_size % shard_size:
        divisors = [d for d in range(1, dp_size + 1) if dp_size % d == 0]
        raise ValueError(
            f"{SHARD_GROUP_SIZE_FLAG} {shard_size} does not divide the data-parallel size {dp_size}; "
            f"choose one of {divisors}"
        )


def shard_and_replica_ranks(
    dp_ranks: list[int], shard_size: int
) -> tuple[list[list[int]], list[list[int]]]:
    """The shard groups (consecutive DP ranks) and replica groups (strided) of one DP group.

    Args:
        dp_ranks: the DP group's global ranks, in DP-rank order.
        shard_size: G, a divisor of ``len(dp_ranks)``.

    Returns:
        ``(shard groups, replica groups)`` as lists of global ranks.
    """
    shards = [dp_ranks[i : i + shard_size] for i in range(0, len(dp_ranks), shard_size)]
    replicas = [dp_ranks[i::shard_size] for i in range(shard_size)]
    return shards, replicas


def _my_subgroup(lists: list[list[int]]) -> dist.ProcessGroup:
    """Create every group of ``lists`` (a partition of the world; collective) and return this rank's."""
    mine, _ = dist.new_subgroups_by_enumeration(lists)
    assert mine is not None, lists
    return mine


def build_topology(dp_group: dist.ProcessGroup | None, shard_group_size: int = 0) -> DPTopology:
    """Split ``dp_group`` into shard groups of ``shard_group_size`` (0: the DP ranks of one host).

    Collective over the whole world when shards are replicated (every rank creates every subgroup);
    otherwise over ``dp_group`` only.

    Raises:
        ValueError: ``shard_group_size`` does not divide the DP size, or the default cannot be
            derived from the hosts (each naming ``--odc-shard-group-size``).
    """
    if not dist.is_initialized():
        return DPTopology(None, None, None, 1, 1, 0, 0, tuple(hosts_of_group(None)))
    dp_ranks = dist.get_process_group_ranks(dp_group) if dp_group is not None else None
    if dp_ranks is None:
        dp_ranks = list(range(dist.get_world_size()))
    dp_size, dp_rank = len(dp_ranks), dp_ranks.index(dist.get_rank())
    hosts = hosts_of_group(dp_group)
    shard_size = shard_group_size or default_shard_group_size(hosts)
    check_shard_group_size(shard_size, dp_size)
    first = dp_rank - dp_rank % shard_size
    shard_hosts = tuple(hosts[first : first + shard_size])
    if shard_size == dp_size:
        return DPTopology(dp_group, dp_group, None, dp_size, 1, dp_rank, 0, shard_hosts)
    # Every DP group of the world (one per TP rank), so that every rank creates the same subgroups.
    all_dp: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(all_dp, tuple(dp_ranks))
    shard_lists: list[list[int]] = []
    replica_lists: list[list[int]] = []
    for ranks in sorted(set(all_dp)):
        shards, replicas = shard_and_replica_ranks(list(ranks), shard_size)
        shard_lists += shards
        replica_lists += replicas
    shard_group = _my_subgroup(shard_lists)
    replica_group = _my_subgroup(replica_lists)
    return DPTopology(
        dp_group,
        shard_group,
        replica_group,
        shard_size,
        dp_size // shard_size,
        dp_rank % shard_size,
        dp_rank // shard_size,
        shard_hosts,
    )
