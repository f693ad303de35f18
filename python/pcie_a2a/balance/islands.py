"""The box as data for the balancer: where each rank sits on the PCIe tree, which links a
transfer between two ranks crosses, and what those links carry.

A rank's *path* lists the islands above its GPU from the top down: socket, NUMA node, host
bridge, root port, then the PCIe switches. Two ranks are nearer the longer the common
prefix of their paths; "nearest replica" means: the same rank, then the longest common
prefix (same switch before same root port before same socket), then the rest. Levels that
hold a single child change no distance and are harmless.

``pair_links[s][d]`` names the links a row from rank ``s`` to rank ``d`` crosses and
``link_gbps`` their per-direction capacity. From a :class:`~pcie_a2a.topology.Topology` they
are the transfer planner's own (so the balancer counts bytes on exactly the links the plan
uses, staged pairs through the host included) and the plan is kept for predicting the
exchange time; built from paths alone, each pair crosses the uplink of every switch on its
way and the socket link when the sockets differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..topology.estimates import LINK_X16_GBPS, SOCKET_LINK_GBPS
from ..topology.model import RootPort, Topology
from ..topology.planner import TransferOptions, TransferPlan, plan_transfers

SOCKET_LINK = "socket"  # prefix of socket-link ids (the planner's "socket{a}->{b}")
_UPLINK_GBPS = LINK_X16_GBPS[5]  # a Gen5 x16 switch uplink, per direction


def is_socket_link(link_id: str) -> bool:
    return link_id.startswith(SOCKET_LINK)


def is_switch_uplink(link_id: str) -> bool:
    """A shared switch uplink (the planner's ``<switch id>^`` / ``v``), not a GPU's own link."""
    return not link_id.startswith(("GPU", SOCKET_LINK)) and link_id[-1:] in ("^", "v")


@dataclass(frozen=True)
class Islands:
    """Ranks on a PCIe tree. Build with :meth:`from_topology`, :meth:`from_paths` or
    :meth:`flat`."""

    paths: tuple[tuple[str, ...], ...]  # per rank, island ids from the top (socket) down
    pair_links: tuple[tuple[tuple[str, ...], ...], ...]  # [src][dst] link ids
    link_gbps: tuple[tuple[str, float], ...]  # (link id, GB/s per direction)
    name: str = ""
    plan: TransferPlan | None = field(default=None, compare=False, repr=False)
    gpus: tuple[int, ...] = ()  # topology GPU of each rank (from_topology)

    def __post_init__(self) -> None:
        w = len(self.paths)
        if w < 1:
            raise ValueError("islands: no ranks")
        if len(self.pair_links) != w or any(len(r) != w for r in self.pair_links):
            raise ValueError(f"islands: pair_links is not {w}x{w}")
        known = {k for k, _ in self.link_gbps}
        for s in range(w):
            for d in range(w):
                for lk in self.pair_links[s][d]:
                    if lk not in known:
                        raise ValueError(f"islands: pair {s}->{d} crosses unknown link {lk!r}")
        if any(not v > 0 for _, v in self.link_gbps):
            raise ValueError("islands: link capacities must be > 0 GB/s")

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def from_paths(paths: Sequence[Sequence[str]], name: str = "") -> Islands:
        """Islands from paths alone; ids starting with ``socket`` are sockets, ids starting
        with ``sw`` are switches (their uplinks are counted)."""
        ps = tuple(tuple(str(x) for x in p) for p in paths)
        w = len(ps)
        links: dict[str, float] = {}
        rows = []
        for s in range(w):
            row = []
            for d in range(w):
                if s == d:
                    row.append(())
                    continue
                c = _common(ps[s], ps[d])
                ups = [f"{x}^" for x in reversed(ps[s][c:]) if x.startswith("sw")]
                downs = [f"{x}v" for x in ps[d][c:] if x.startswith("sw")]
                sock = []
                if c == 0 and ps[s] and ps[d] and ps[s][0] != ps[d][0]:
                    sock = [f"{SOCKET_LINK}:{ps[s][0]}->{ps[d][0]}"]
                for lk in ups + downs:
                    links[lk] = _UPLINK_GBPS
                for lk in sock:
                    links[lk] = SOCKET_LINK_GBPS
                row.append(tuple(ups + sock + downs))
            rows.append(tuple(row))
        return Islands(ps, tuple(rows), tuple(sorted(links.items())), name)

    @staticmethod
    def flat(world: int) -> Islands:
        """No topology: every rank its own island, all others equally far."""
        return Islands.from_paths([[f"gpu{r}"] for r in range(world)], name=f"flat x{world}")

    @staticmethod
    def from_topology(
        topo: Topology,
        ranks: Sequence[int] | None = None,
        options: TransferOptions | None = None,
        the_plan: TransferPlan | None = None,
    ) -> Islands:
        """Islands of ``topo`` with rank ``i`` on GPU ``ranks[i]`` (default GPU ``i``), the
        links of the transfer plan (``the_plan``, else planned here with ``options``)."""
        gpus = tuple(range(topo.num_gpus)) if ranks is None else tuple(int(g) for g in ranks)
        for g in gpus:
            if not 0 <= g < topo.num_gpus:
                raise ValueError(f"ranks: GPU {g} is not in the topology (0..{topo.num_gpus - 1})")
        p = (
            the_plan
            if the_plan is not None
            else plan_transfers(topo, (), options or TransferOptions())
        )
        paths = []
        for g in gpus:
            gpu = topo.gpus[g]
            port, switches = topo.ancestry(g)
            path = [f"socket{topo.socket_of_node(gpu.numa_node)}", f"numa{gpu.numa_node}"]
            if isinstance(port, RootPort):
                path += [f"hb:{port.host_bridge}", f"rp:{port.id}"]
            path += [f"sw:{s.id}" for s in switches]
            paths.append(tuple(path))
        w = len(gpus)
        rows = tuple(
            tuple(() if gpus[s] == gpus[d] else p.pair(gpus[s], gpus[d]).links for d in range(w))
            for s in range(w)
        )
        used = {lk for r in rows for links in r for lk in links}
        caps = tuple((lk.id, lk.capacity_gbps) for lk in p.links if lk.id in used)
        return Islands(tuple(paths), rows, caps, topo.source, p, gpus)

    # ---- queries ------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return len(self.paths)

    def nearness(self) -> np.ndarray:
        """``[W, W]`` int: how near rank d is to source s; larger is nearer, the rank
        itself is nearest of all."""
        w = self.world
        out = np.zeros((w, w), dtype=np.int64)
        top = max(len(p) for p in self.paths) + 1
        for s in range(w):
            for d in range(w):
                out[s, d] = top if s == d else _common(self.paths[s], self.paths[d])
        return out

    def sockets(self) -> list[str]:
        return [p[0] if p else "" for p in self.paths]

    def link_ids(self) -> list[str]:
        return [k for k, _ in self.link_gbps]

    def link_matrix(self) -> np.ndarray:
        """``[W, W, L]`` 0/1: pair (s, d) crosses link l (order of :meth:`link_ids`)."""
        ids = {k: i for i, k in enumerate(self.link_ids())}
        w = self.world
        m = np.zeros((w, w, max(len(ids), 1)), dtype=np.float64)
        for s in range(w):
            for d in range(w):
                for lk in self.pair_links[s][d]:
                    m[s, d, ids[lk]] = 1.0
        return m

    def describe(self) -> str:
        return f"{self.name or 'islands'}: " + "; ".join(
            f"rank {r}: {'/'.join(p)}" for r, p in enumerate(self.paths)
        )


def _common(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
