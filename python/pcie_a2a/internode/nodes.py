"""Which node each rank of a group is on: from the ranks' host names, or, with
``PCIE_A2A_LOCAL_WORLD_SIZE=L``, nodes of L consecutive ranks of one host (simulated nodes).

The inter-node path pairs rank ``l`` of every node on a "rail" (the ranks with the same local
index), so every node must hold the same number of ranks."""

from __future__ import annotations

import socket
from dataclasses import dataclass

ENV = "PCIE_A2A_LOCAL_WORLD_SIZE"


@dataclass(frozen=True)
class NodeLayout:
    """``ranks[n]``: the group ranks on node ``n`` (local index = position), nodes numbered in
    the order of their first rank; ``hosts[n]``: the host node ``n`` is on."""

    ranks: tuple[tuple[int, ...], ...]
    hosts: tuple[str, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.ranks)

    @property
    def local_size(self) -> int:
        return len(self.ranks[0])

    @property
    def world(self) -> int:
        return self.num_nodes * self.local_size

    def node_of(self, rank: int) -> int:
        for n, members in enumerate(self.ranks):
            if rank in members:
                return n
        raise ValueError(f"rank: got {rank}; allowed: [0, {self.world})")

    def local_index(self, rank: int) -> int:
        return self.ranks[self.node_of(rank)].index(rank)

    def rail(self, local: int) -> tuple[int, ...]:
        """The group ranks with local index ``local``, one per node, in node order."""
        return tuple(members[local] for members in self.ranks)

    def describe(self, rank: int) -> str:
        """``rank 3 (node 1 on host h, local rank 1)``: how errors name a rank."""
        n = self.node_of(rank)
        return (
            f"rank {rank} (node {n} on host {self.hosts[n]}, local rank {self.local_index(rank)})"
        )


def find_nodes(hosts: list[str], local_world_size: int | None = None) -> NodeLayout:
    """Nodes from each rank's host name (``hosts[r]``: rank r's).

    ``local_world_size`` (``PCIE_A2A_LOCAL_WORLD_SIZE``) splits each host's ranks, in rank
    order, into nodes of that many ranks; it must divide the world and each host's count.
    """
    world = len(hosts)
    if world < 1:
        raise ValueError("hosts: got an empty list; allowed: one host name per rank")
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    if local_world_size is not None:
        lws = local_world_size
        if isinstance(lws, bool) or not isinstance(lws, int) or lws < 1 or world % lws:
            raise ValueError(
                f"{ENV}: got {lws!r}; allowed: a positive divisor of the group size {world}"
            )
        for h, members in by_host.items():
            if len(members) % lws:
                raise ValueError(
                    f"{ENV}: got {lws}; allowed: a divisor of every host's rank count "
                    f"(host {h} has {len(members)} ranks of the {world})"
                )
    ranks: list[tuple[int, ...]] = []
    node_hosts: list[str] = []
    for h, members in by_host.items():
        size = local_world_size or len(members)
        for i in range(0, len(members), size):
            ranks.append(tuple(members[i : i + size]))
            node_hosts.append(h)
    order = sorted(range(len(ranks)), key=lambda n: ranks[n][0])
    ranks = [ranks[n] for n in order]
    node_hosts = [node_hosts[n] for n in order]
    sizes = {len(m) for m in ranks}
    if len(sizes) > 1:
        shown = ", ".join(f"{h}: {len(m)}" for h, m in zip(node_hosts, ranks))
        raise ValueError(
            f"nodes: got nodes of different sizes ({shown} ranks); allowed: the same number of "
            f"ranks on every node (the inter-node path pairs equal local ranks), or set {ENV}"
        )
    return NodeLayout(tuple(ranks), tuple(node_hosts))


def nodes_of_group(group) -> NodeLayout:
    """Collective over ``group``: gathers every rank's host name and applies
    ``PCIE_A2A_LOCAL_WORLD_SIZE``."""
    import torch.distributed as dist

    from pcie_a2a import env

    world = dist.get_world_size(group)
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return find_nodes(hosts, env.local_world_size())
