"""The transfer planner: per ordered GPU pair, direct P2P or host-staged and why; where the
staging memory lives; what to expect; and the send schedule of an all-to-all.

Rules (NCCL's are the baseline; research/topology_numa.md section 1.6):

1. The driver has the last word: P2P reported unsupported or disabled (nvidia-smi
   CNS/TNS/NS, GNS, DR; cudaDeviceCanAccessPeer = 0) is never used, whatever the overrides.
2. ``PCIE_A2A_P2P=0|1`` forces every other pair off or on.
3. NVLink pairs use P2P.
4. ``PCIE_A2A_P2P_LEVEL=<class>`` allows P2P up to that path class (NCCL_P2P_LEVEL's meaning).
5. A measured probe decides where it has both numbers (or a P2P number and the table's
   staged one): P2P only when it is at least as fast as staging. This catches the early-2023
   RTX 4090 driver, whose "P2P" ran at 10 GB/s against 22 staged (NVIDIA/nccl#814).
6. Otherwise P2P up to NODE, staged for SYS. NCCL stops at PXB by default, but every
   public Gen5 measurement shows NODE/PHB P2P at or above switch P2P (56 vs 52 GB/s) and far
   above staging (28.5 GB/s, 14 µs), so stopping at PXB would throw bandwidth away. Across
   the socket link P2P ranges from good (47 GB/s, Broadcom Turin) to worse than staging
   under all-to-all load (tinygrad/open-gpu-kernel-modules#17), so it needs a measurement.

Staging memory always sits on the receiver's NUMA node (NCCL_SHM_LOCALITY=2): the far leg is
then a posted write, and the receiving GPU's read stays on its own root complex.

:func:`plan` is pure: the environment is read only by :meth:`PlanOptions.from_env`.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .. import env
from . import estimates as est
from .errors import TopologyError
from .model import UNKNOWN_CLASS, P2PStatus, RootPort, Topology, class_rank, is_nvlink
from .probe import PairMeasurement, Probe

FORMAT = "pcie_a2a.plan"
VERSION = 1
P2P = "p2p"
STAGED = "staged"


@dataclass(frozen=True)
class PlanOptions:
    p2p: bool | None = None  # force P2P on/off for every pair the driver allows
    p2p_level: str | None = None  # farthest class allowed for P2P (NV, PIX, PXB, PHB, NODE, SYS)
    default_link_gen: int = 4  # PCIe generation assumed where the source does not say
    probe: Probe | None = None

    def __post_init__(self) -> None:
        if self.p2p_level is not None:
            level = self.p2p_level.upper()
            if level != "NV":
                class_rank(level)
            object.__setattr__(self, "p2p_level", level)
        if self.default_link_gen not in (1, 2, 3, 4, 5, 6):
            raise ValueError(f"default_link_gen={self.default_link_gen}: expected 1..6")

    @staticmethod
    def from_env(probe: Probe | None = None, default_link_gen: int = 4) -> PlanOptions:
        """Options with PCIE_A2A_P2P and PCIE_A2A_P2P_LEVEL applied."""
        return PlanOptions(
            p2p=env.p2p(), p2p_level=env.p2p_level(), default_link_gen=default_link_gen, probe=probe
        )


@dataclass(frozen=True)
class Traffic:
    """Bytes each rank sends to each other rank in one exchange ([src][dst])."""

    name: str
    bytes: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.bytes)
        if any(len(r) != n for r in self.bytes):
            raise ValueError(f"traffic {self.name!r}: matrix is not square ({n} rows)")
        if any(v < 0 or not math.isfinite(v) for r in self.bytes for v in r):
            raise ValueError(f"traffic {self.name!r}: bytes must be finite and >= 0")


def expected_distinct_ranks(ranks: int, experts: int, topk: int) -> float:
    """E[number of ranks a token goes to] for uniform top-k routing over contiguous expert
    blocks: a rank is missed when all k distinct experts fall outside its E/R experts."""
    per_rank = experts // ranks
    miss = math.comb(experts - per_rank, topk) / math.comb(experts, topk)
    return ranks * (1 - miss)


def kimi_k2_decode(ranks: int, tokens_per_rank: int = 128) -> tuple[Traffic, Traffic]:
    """Dispatch and combine of one Kimi K2 decode step with uniform routing: hidden 7168,
    384 experts, top-8; dispatch rows fp8 + one fp32 scale per 128 channels (7168 + 224 B),
    combine rows bf16 (14336 B). Each token goes once to each rank holding one of its
    experts, so a given other rank receives it with probability E[distinct ranks] / R."""
    if ranks < 1 or 384 % ranks:
        raise ValueError(f"ranks={ranks}: Kimi K2's 384 experts must split evenly over the ranks")
    p_hit = expected_distinct_ranks(ranks, 384, 8) / ranks
    rows = tokens_per_rank * p_hit

    def matrix(row_bytes: int) -> tuple[tuple[float, ...], ...]:
        return tuple(
            tuple(0.0 if s == d else rows * row_bytes for d in range(ranks)) for s in range(ranks)
        )

    return (
        Traffic(f"Kimi K2 decode dispatch ({tokens_per_rank} tok/rank, fp8)", matrix(7168 + 224)),
        Traffic(f"Kimi K2 decode combine ({tokens_per_rank} tok/rank, bf16)", matrix(14336)),
    )


@dataclass(frozen=True)
class PairPlan:
    src: int
    dst: int
    path_class: str
    p2p_status: str
    transport: str  # "p2p" or "staged"
    reason: str
    staging_node: int | None  # receiver's NUMA node for staged pairs
    gbps: float
    latency_us: float
    estimate: str  # where gbps/latency come from
    links: tuple[str, ...]  # link ids the transfer crosses


@dataclass(frozen=True)
class Link:
    id: str
    label: str
    capacity_gbps: float
    shared: bool  # can carry several ranks' flows at once (switch uplink, socket link)


@dataclass(frozen=True)
class TrafficReport:
    name: str
    total_bytes: float
    bottleneck: str  # link id
    bottleneck_bytes: float
    bottleneck_us: float  # that link's bytes at its capacity: a lower bound for the exchange
    round_us: tuple[float, ...]
    predicted_us: float  # rounds run one after another, each as slow as its slowest flow


@dataclass(frozen=True)
class Plan:
    source: str
    num_gpus: int
    pairs: tuple[PairPlan, ...]  # every ordered pair, row-major
    links: tuple[Link, ...]
    rounds: tuple[tuple[int, ...], ...]  # rounds[r][src] = dst
    round_loads: tuple[tuple[tuple[str, int], ...], ...]  # busiest shared links per round
    max_shared_load: int
    reports: tuple[TrafficReport, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def pair(self, src: int, dst: int) -> PairPlan:
        n = self.num_gpus
        if not (0 <= src < n and 0 <= dst < n) or src == dst:
            raise ValueError(f"pair ({src}, {dst}): expected two different GPUs in 0..{n - 1}")
        return self.pairs[src * (n - 1) + (dst if dst < src else dst - 1)]

    def link(self, link_id: str) -> Link:
        return next(lk for lk in self.links if lk.id == link_id)

    def to_json(self) -> str:
        d: dict[str, Any] = {"format": FORMAT, "version": VERSION}
        for f in self.__dataclass_fields__:
            d[f] = _plain(getattr(self, f))
        return json.dumps(d, indent=1) + "\n"

    @staticmethod
    def from_json(text: str, source: str = "<plan>") -> Plan:
        try:
            d = json.loads(text)
            if d.pop("format") != FORMAT or d.pop("version") != VERSION:
                raise ValueError(f"expected format {FORMAT!r} version {VERSION}")
            return Plan(
                source=d["source"],
                num_gpus=d["num_gpus"],
                pairs=tuple(PairPlan(**{**p, "links": tuple(p["links"])}) for p in d["pairs"]),
                links=tuple(Link(**lk) for lk in d["links"]),
                rounds=tuple(tuple(r) for r in d["rounds"]),
                round_loads=tuple(tuple((a, b) for a, b in r) for r in d["round_loads"]),
                max_shared_load=d["max_shared_load"],
                reports=tuple(
                    TrafficReport(**{**r, "round_us": tuple(r["round_us"])}) for r in d["reports"]
                ),
                notes=tuple(d["notes"]),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise TopologyError(f"{source}: not a {FORMAT} document: {exc}") from None


def _plain(x: Any) -> Any:
    if hasattr(x, "__dataclass_fields__"):
        return {f: _plain(getattr(x, f)) for f in x.__dataclass_fields__}
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    return x


# ---- fabric: which links a transfer crosses ---------------------------------------------


class _Fabric:
    def __init__(self, topo: Topology, default_gen: int) -> None:
        self.topo = topo
        self.gen = default_gen
        self.links: dict[str, Link] = {}
        self.chains = [self._chain(g) for g in range(topo.num_gpus)]

    def _add(self, lid: str, label: str, cap: float, shared: bool) -> str:
        self.links.setdefault(lid, Link(lid, label, cap, shared))
        return lid

    def _chain(self, g: int) -> list[tuple[str, str | None, str | None]]:
        """(node id, up link id, down link id) from the GPU to its socket."""
        topo, gpu = self.topo, self.topo.gpus[g]
        cap = est.link_capacity(gpu.link_gen or self.gen, gpu.link_width)
        out = [
            (
                f"gpu{g}",
                self._add(f"GPU{g}^", f"GPU{g} link, up", cap, False),
                self._add(f"GPU{g}v", f"GPU{g} link, down", cap, False),
            )
        ]
        port, switches = topo.ancestry(g)
        for sw in reversed(switches):
            under = sum(
                1 for h in range(topo.num_gpus) if any(s.id == sw.id for s in topo.ancestry(h)[1])
            )
            cap = est.link_capacity(sw.link_gen or self.gen, sw.link_width)
            up = self._add(f"{sw.id}^", f"switch {sw.id} uplink, up", cap, under > 1)
            down = self._add(f"{sw.id}v", f"switch {sw.id} uplink, down", cap, under > 1)
            out.append((f"sw:{sw.id}", up, down))
        if isinstance(port, RootPort):
            out.append((f"rp:{port.id}", None, None))
            out.append((f"hb:{port.host_bridge}", None, None))
        out.append((f"numa:{gpu.numa_node}", None, None))
        out.append((f"socket:{self.socket(g)}", None, None))
        return out

    def socket(self, g: int) -> int | None:
        return self.topo.socket_of_node(self.topo.gpus[g].numa_node)

    def _socket_link(self, a: int | None, b: int | None) -> list[str]:
        if a == b:
            return []
        return [self._add(f"socket{a}->{b}", f"socket link {a}->{b}", est.SOCKET_LINK_GBPS, True)]

    def path(self, a: int, b: int, transport: str) -> tuple[str, ...]:
        if transport == P2P and is_nvlink(self.topo.classes[a][b]):
            return ()
        ca, cb = self.chains[a], self.chains[b]
        ids_b = [n for n, _, _ in cb]
        if transport == P2P:
            for k, (node, _, _) in enumerate(ca):
                if node in ids_b:
                    kb = ids_b.index(node)
                    ups = [u for _, u, _ in ca[:k] if u]
                    downs = [d for _, _, d in cb[:kb] if d]
                    return tuple(ups + list(reversed(downs)))
        # Different sockets, or staged: all the way up to the CPU, across to the receiver's
        # socket (staging memory is on its node), all the way down.
        ups = [u for _, u, _ in ca if u]
        downs = [d for _, _, d in cb if d]
        return tuple(
            ups + self._socket_link(self.socket(a), self.socket(b)) + list(reversed(downs))
        )


# ---- per-pair decision ------------------------------------------------------------------


def _decide(topo: Topology, a: int, b: int, opt: PlanOptions, gen: int) -> tuple[str, str]:
    cls, st = topo.classes[a][b], topo.p2p[a][b]
    m = opt.probe.get(a, b) if opt.probe else None
    if st in (P2PStatus.UNSUPPORTED, P2PStatus.DISABLED):
        why = f"driver reports P2P {st.value}"
        return STAGED, why + ("; PCIE_A2A_P2P=1 cannot override the driver" if opt.p2p else "")
    if m is not None and m.p2p_possible is False:
        return STAGED, "probe: cudaDeviceCanAccessPeer is 0"
    if opt.p2p is False:
        return STAGED, "P2P forced off (PCIE_A2A_P2P=0)"
    if opt.p2p is True:
        return P2P, "P2P forced on (PCIE_A2A_P2P=1)"
    if is_nvlink(cls):
        return P2P, f"NVLink ({cls})"
    if cls == UNKNOWN_CLASS:
        return _decide_unknown_path(st, m, opt, gen)
    unknown = (
        "; P2P status unknown here, checked when the transport connects"
        if st == P2PStatus.UNKNOWN
        else ""
    )
    if opt.p2p_level is not None:
        if opt.p2p_level != "NV" and class_rank(cls) <= class_rank(opt.p2p_level):
            return P2P, f"PCIE_A2A_P2P_LEVEL={opt.p2p_level} allows {cls}{unknown}"
        return STAGED, f"PCIE_A2A_P2P_LEVEL={opt.p2p_level} excludes {cls}"
    if m is not None and m.p2p_gbps is not None:
        staged = m.staged_gbps if m.staged_gbps is not None else est.staged_estimate(gen)[0]
        kind = "measured" if m.staged_gbps is not None else "table"
        if m.p2p_gbps >= staged:
            return P2P, f"measured P2P {m.p2p_gbps:.1f} GB/s >= staged {staged:.1f} ({kind})"
        return STAGED, f"measured P2P {m.p2p_gbps:.1f} GB/s < staged {staged:.1f} ({kind})"
    if cls == "SYS":
        return (
            STAGED,
            "SYS crosses the socket link: P2P needs a measurement (probe) or PCIE_A2A_P2P_LEVEL=SYS",
        )
    return P2P, f"{cls} path{unknown}"


def _decide_unknown_path(
    st: P2PStatus, m: PairMeasurement | None, opt: PlanOptions, gen: int
) -> tuple[str, str]:
    """Rules 4-6 for a pair whose path class the source does not show: only the P2P status
    and the measurements are left to decide on, and the reason says so."""
    if opt.p2p_level is not None:
        if opt.p2p_level == "SYS":  # SYS admits every path, so the class does not matter
            return P2P, "PCIE_A2A_P2P_LEVEL=SYS allows any path (path class unknown)"
        return STAGED, f"PCIE_A2A_P2P_LEVEL={opt.p2p_level} cannot be checked: path class unknown"
    if m is not None and m.p2p_gbps is not None:
        staged = m.staged_gbps if m.staged_gbps is not None else est.staged_estimate(gen)[0]
        kind = "measured" if m.staged_gbps is not None else "table"
        cmp = ">=" if m.p2p_gbps >= staged else "<"
        return (
            P2P if m.p2p_gbps >= staged else STAGED,
            f"path class unknown; measured P2P {m.p2p_gbps:.1f} GB/s {cmp} staged {staged:.1f} ({kind})",
        )
    if st == P2PStatus.SUPPORTED:
        # The driver allows it and nothing measured says staging is faster. Unlike a known
        # SYS pair there is no evidence the path crosses the socket link.
        return P2P, "path class unknown; P2P status supported, no P2P measurement"
    # Could be a SYS pair, where P2P can lose to staging: stay safe until measured.
    return STAGED, "path class and P2P status unknown, no P2P measurement (use --probe)"


def _estimate(
    topo: Topology, a: int, b: int, transport: str, opt: PlanOptions, gen: int
) -> tuple[float, float, str]:
    m = opt.probe.get(a, b) if opt.probe else None
    cls = topo.classes[a][b]
    if transport == P2P:
        if cls == UNKNOWN_CLASS:
            # Unknown path: the farthest PCIe class's figure, the one that cannot overpromise.
            gbps, us = est.p2p_estimate(gen, "SYS")
            src = f"table Gen{gen} SYS P2P (path class unknown)"
        else:
            gbps, us = est.p2p_estimate(gen, cls)
            src = f"table Gen{gen} {cls} P2P"
        if m is not None and m.p2p_gbps is not None:
            gbps, src = m.p2p_gbps, "probe"
        if m is not None and m.p2p_us is not None:
            us = m.p2p_us
        return gbps, us, src
    gbps, us = est.staged_estimate(gen)
    src = f"table Gen{gen} staged"
    if m is not None and m.staged_gbps is not None:
        gbps, src = m.staged_gbps, "probe"
    if m is not None and m.staged_us is not None:
        us = m.staged_us
    return gbps, us, src


# ---- schedule ---------------------------------------------------------------------------


def _candidates(n: int) -> tuple[np.ndarray, int]:
    """Relabelings pi with pi(0) = 0 (rotating or XOR-translating the labels gives the same
    rounds, so nothing is lost); all of them up to 8 GPUs, a fixed random sample beyond."""
    if n <= 8:
        perms = np.array([(0, *p) for p in itertools.permutations(range(1, n))], dtype=np.int64)
    else:
        rng = np.random.default_rng(0)
        perms = np.array(
            [np.arange(n)]
            + [np.concatenate(([0], 1 + rng.permutation(n - 1))) for _ in range(4999)]
        )
    return perms, len(perms)


def _schedule(n: int, pair_links: dict[tuple[int, int], tuple[str, ...]], shared: list[str]):
    """Rounds in which every rank sends to one peer and receives from one, covering every
    ordered pair once, chosen to minimise (largest number of flows on one shared link in any
    round, sum over rounds of each round's largest, sum of squares). Candidates are the
    shift schedule (i -> i + r) and, for powers of two, the XOR schedule (i -> i ^ r), under
    every relabeling of the GPUs."""
    if n < 2:
        return (), ()
    idx = {lid: k for k, lid in enumerate(shared)}
    inc = np.zeros((n, n, max(len(shared), 1)), dtype=np.int64)
    for (a, b), links in pair_links.items():
        for lid in links:
            if lid in idx:
                inc[a, b, idx[lid]] += 1
    perms, count = _candidates(n)
    inv = np.argsort(perms, axis=1)
    families = [lambda pos, r: (pos + r) % n]
    if n & (n - 1) == 0:
        families.append(lambda pos, r: pos ^ r)
    best = None
    for fam_id, step in enumerate(families):
        loads = np.zeros((count, n - 1, inc.shape[2]), dtype=np.int64)
        for r in range(1, n):
            dst = np.take_along_axis(inv, step(perms, r), axis=1)
            loads[:, r - 1, :] = inc[np.arange(n)[None, :], dst].sum(axis=1)
        per_round = loads.max(axis=2)
        keys = (per_round.max(axis=1), per_round.sum(axis=1), (loads**2).sum(axis=(1, 2)))
        k = int(np.lexsort((np.arange(count), keys[2], keys[1], keys[0]))[0])
        cost = (int(keys[0][k]), int(keys[1][k]), int(keys[2][k]), fam_id)
        if best is None or cost < best[0]:
            pi, pinv = perms[k], inv[k]
            rounds = tuple(tuple(int(pinv[step(pi[i], r)]) for i in range(n)) for r in range(1, n))
            best = (cost, rounds, loads[k])
    assert best is not None
    _, rounds, loads = best
    round_loads = tuple(
        tuple(
            sorted(
                ((shared[j], int(v)) for j, v in enumerate(row) if v > 0 and shared),
                key=lambda t: (-t[1], t[0]),
            )[:3]
        )
        for row in loads
    )
    return rounds, round_loads


# ---- prediction -------------------------------------------------------------------------


def _report(
    traffic: Traffic, pairs: dict[tuple[int, int], PairPlan], links: dict[str, Link], rounds
) -> TrafficReport:
    link_bytes: dict[str, float] = {}
    for (a, b), p in pairs.items():
        for lid in p.links:
            link_bytes[lid] = link_bytes.get(lid, 0.0) + traffic.bytes[a][b]
    if link_bytes:
        bott = max(link_bytes, key=lambda lid: (link_bytes[lid] / links[lid].capacity_gbps, lid))
        bott_bytes = link_bytes[bott]
        bott_us = bott_bytes / (links[bott].capacity_gbps * 1e3)
    else:
        bott, bott_bytes, bott_us = "", 0.0, 0.0
    times = []
    for rnd in rounds:
        flows = [(a, b) for a, b in enumerate(rnd) if traffic.bytes[a][b] > 0]
        count: dict[str, int] = {}
        for a, b in flows:
            for lid in pairs[(a, b)].links:
                count[lid] = count.get(lid, 0) + 1
        t = 0.0
        for a, b in flows:
            p = pairs[(a, b)]
            bw = min([p.gbps] + [links[lid].capacity_gbps / count[lid] for lid in p.links])
            t = max(t, p.latency_us + traffic.bytes[a][b] / (bw * 1e3))
        times.append(t)
    total = float(sum(sum(r) for r in traffic.bytes))
    return TrafficReport(
        traffic.name, total, bott, bott_bytes, bott_us, tuple(times), float(sum(times))
    )


def plan(
    topology: Topology,
    traffic: Traffic | Sequence[Traffic] | None = None,
    options: PlanOptions | None = None,
) -> Plan:
    """Plan every ordered pair of `topology`, the send schedule, and (for each traffic
    matrix given) the bottleneck link and predicted exchange time. Pure: same inputs, same
    plan; the environment is not read (use PlanOptions.from_env())."""
    opt = options or PlanOptions()
    topo = topology
    n = topo.num_gpus
    gens = [g.link_gen or opt.default_link_gen for g in topo.gpus]
    fabric = _Fabric(topo, opt.default_link_gen)
    pairs: dict[tuple[int, int], PairPlan] = {}
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            gen = min(gens[a], gens[b])
            transport, reason = _decide(topo, a, b, opt, gen)
            gbps, us, src = _estimate(topo, a, b, transport, opt, gen)
            node = topo.gpus[b].numa_node if transport == STAGED else None
            pairs[(a, b)] = PairPlan(
                a,
                b,
                topo.classes[a][b],
                topo.p2p[a][b].value,
                transport,
                reason,
                node,
                gbps,
                us,
                src,
                fabric.path(a, b, transport),
            )
    links = fabric.links
    shared = sorted(lid for lid, lk in links.items() if lk.shared)
    rounds, round_loads = _schedule(n, {k: p.links for k, p in pairs.items()}, shared)
    max_load = max((load for r in round_loads for _, load in r), default=0)
    items = [traffic] if isinstance(traffic, Traffic) else list(traffic or [])
    for t in items:
        if len(t.bytes) != n:
            raise ValueError(
                f"traffic {t.name!r} is {len(t.bytes)}x{len(t.bytes)}, the topology has {n} GPUs"
            )
    notes = list(topo.notes)
    if any(g.link_gen is None for g in topo.gpus):
        notes.append(f"PCIe generation not in the source: Gen{opt.default_link_gen} x16 assumed")
    if any(p.transport == STAGED and p.staging_node is None for p in pairs.values()):
        notes.append(
            "some receivers have no known NUMA node: their staging memory is left to first touch"
        )
    return Plan(
        source=topo.source,
        num_gpus=n,
        pairs=tuple(pairs[(a, b)] for a in range(n) for b in range(n) if a != b),
        links=tuple(links[k] for k in sorted(links)),
        rounds=rounds,
        round_loads=round_loads,
        max_shared_load=max_load,
        reports=tuple(_report(t, pairs, links, rounds) for t in items),
        notes=tuple(notes),
    )


def with_reports(p: Plan, traffic: Sequence[Traffic]) -> Plan:
    """A plan with the traffic reports recomputed for other traffic matrices."""
    pairs = {(q.src, q.dst): q for q in p.pairs}
    links = {lk.id: lk for lk in p.links}
    return replace(p, reports=tuple(_report(t, pairs, links, p.rounds) for t in traffic))
