"""The transfer planner: per ordered GPU pair, direct P2P or host-staged and why; where the
staging memory lives; what to expect; and the send schedule of an all-to-all.

Path rules (NCCL's are the baseline; research/topology_numa.md section 1.6):

1. The driver has the last word: P2P reported unsupported or disabled (nvidia-smi
   CNS/TNS/NS, GNS, DR; cudaDeviceCanAccessPeer = 0) is never used, whatever the overrides.
2. A ``PCIE_A2A_PAIRS`` entry (``0-4:staged``) decides its pairs; ``PCIE_A2A_P2P=0|1``
   forces every other pair off or on.
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

Then per pair the direction (push or pull) and the engine (SM or copy engine):
:mod:`.directions`. The schedule (:func:`_schedule`) first keeps every shared switch's
pushing flows on one destination root complex per round (the posted-write collapse
trigger, :mod:`.roots`), then spreads the load on shared links.

:func:`plan_transfers` is pure: the environment is read only by :meth:`TransferOptions.from_env`.
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
from ..buffer_memory import row_bytes
from . import estimates as est
from . import roots
from .directions import (
    COPY_ENGINE,
    PULL,
    PUSH,
    SM,
    PairOverride,
    collapse_factor,
    decide_direction,
    decide_engine,
    override_for,
)
from .errors import TopologyError
from .model import UNKNOWN_CLASS, P2PStatus, RootPort, Topology, class_rank, is_nvlink
from .probe import PairMeasurement, Probe

FORMAT = "pcie_a2a.plan"
VERSION = 2
READABLE_VERSIONS = (1, 2)
P2P = "p2p"
STAGED = "staged"
SPREAD = "spread"  # TransferOptions.schedule: ignore the collapse trigger


@dataclass(frozen=True)
class TransferOptions:
    p2p: bool | None = None  # force P2P on/off for every pair the driver allows
    p2p_level: str | None = None  # farthest class allowed for P2P (NV, PIX, PXB, PHB, NODE, SYS)
    default_link_gen: int = 4  # PCIe generation assumed where the source does not say
    probe: Probe | None = None
    direction: str | None = None  # force push or pull for every P2P pair (None: decide)
    engine: str | None = None  # force sm or copy_engine for every pair (None: decide)
    schedule: str | None = None  # None: avoid the collapse trigger first; "spread": do not
    pair_overrides: tuple[PairOverride, ...] = ()  # PCIE_A2A_PAIRS entries, later win

    def __post_init__(self) -> None:
        if self.p2p_level is not None:
            level = self.p2p_level.upper()
            if level != "NV":
                class_rank(level)
            object.__setattr__(self, "p2p_level", level)
        if self.default_link_gen not in (1, 2, 3, 4, 5, 6):
            raise ValueError(f"default_link_gen={self.default_link_gen}: expected 1..6")
        for name, allowed in (
            ("direction", (PUSH, PULL)),
            ("engine", (SM, COPY_ENGINE)),
            ("schedule", (SPREAD,)),
        ):
            v = getattr(self, name)
            if v is not None and v not in allowed:
                raise ValueError(f"{name}={v!r}: expected None or one of {', '.join(allowed)}")

    @staticmethod
    def from_env(probe: Probe | None = None, default_link_gen: int = 4) -> TransferOptions:
        """Options with PCIE_A2A_P2P, PCIE_A2A_P2P_LEVEL, PCIE_A2A_DIRECTION,
        PCIE_A2A_ENGINE, PCIE_A2A_SCHEDULE and PCIE_A2A_PAIRS applied."""
        return TransferOptions(
            p2p=env.p2p(),
            p2p_level=env.p2p_level(),
            default_link_gen=default_link_gen,
            probe=probe,
            direction=env.direction(),
            engine=env.engine(),
            schedule=env.schedule(),
            pair_overrides=tuple(PairOverride(**o) for o in env.pair_overrides()),  # type: ignore[arg-type]
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


KIMI_HIDDEN = 7168
KIMI_TOPK = 8
DECODE_PAYLOADS = ("fp8", "bf16")


def kimi_k2_decode(
    ranks: int, tokens_per_rank: int = 128, payload: str = "fp8"
) -> tuple[Traffic, Traffic]:
    """Dispatch and combine of one Kimi K2 decode step with uniform routing: hidden 7168,
    384 experts, top-8; rows as the wire format stores them (:func:`pcie_a2a.buffer_memory.row_bytes`:
    a 16 B header, 8 expert ids and weights, then fp8 + one fp32 scale per 128 channels,
    7472 B, or bf16, 14416 B, by `payload`), combine rows bf16 (14336 B). Each token goes
    once to each rank holding one of its experts, so a given other rank receives it with
    probability E[distinct ranks] / R."""
    if ranks < 1 or 384 % ranks:
        raise ValueError(f"ranks={ranks}: Kimi K2's 384 experts must split evenly over the ranks")
    if payload not in DECODE_PAYLOADS:
        raise ValueError(f"payload={payload!r}: expected one of {', '.join(DECODE_PAYLOADS)}")
    dispatch_bytes, combine_bytes = row_bytes(KIMI_HIDDEN, KIMI_TOPK, payload)
    p_hit = expected_distinct_ranks(ranks, 384, 8) / ranks
    rows = tokens_per_rank * p_hit

    def matrix(row_bytes: int) -> tuple[tuple[float, ...], ...]:
        return tuple(
            tuple(0.0 if s == d else rows * row_bytes for d in range(ranks)) for s in range(ranks)
        )

    return (
        Traffic(
            f"Kimi K2 decode dispatch ({tokens_per_rank} tok/rank, {payload})",
            matrix(dispatch_bytes),
        ),
        Traffic(
            f"Kimi K2 decode combine ({tokens_per_rank} tok/rank, bf16)", matrix(combine_bytes)
        ),
    )


@dataclass(frozen=True)
class PairRoute:
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
    direction: str = PUSH  # "push" (sender stores) or "pull" (receiver loads)
    direction_reason: str = ""
    engine: str = SM  # "sm" (kernel loads/stores) or "copy_engine"
    engine_reason: str = ""
    phase: int = -1  # the round (0-based) in which src sends to dst
    trigger_switch: str | None = None  # shared switch whose collapse trigger a push can hit
    trigger_root: str | None = None  # the destination root complex of that flow


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
class TransferPlan:
    source: str
    num_gpus: int
    pairs: tuple[PairRoute, ...]  # every ordered pair, row-major
    links: tuple[Link, ...]
    rounds: tuple[tuple[int, ...], ...]  # rounds[r][src] = dst
    round_loads: tuple[tuple[tuple[str, int], ...], ...]  # busiest shared links per round
    max_shared_load: int
    reports: tuple[TrafficReport, ...] = ()
    notes: tuple[str, ...] = field(default=())
    # Rounds must not overlap: some pushing flow leaves a switch whose GPUs could write into
    # two or more root complexes at once if senders drifted into the next round.
    phased: bool = False
    collapse_violations: int = 0  # (switch, round) cases pushing into 2+ root complexes
    schedule_reason: str = ""
    collapse_factors: tuple[tuple[str, float, str], ...] = ()  # (switch, factor, basis)

    def pair(self, src: int, dst: int) -> PairRoute:
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
    def from_json(text: str, source: str = "<plan>") -> TransferPlan:
        try:
            d = json.loads(text)
            if d.pop("format") != FORMAT or d.pop("version") not in READABLE_VERSIONS:
                raise ValueError(f"expected format {FORMAT!r} version 1 or 2")
            return TransferPlan(
                source=d["source"],
                num_gpus=d["num_gpus"],
                pairs=tuple(PairRoute(**{**p, "links": tuple(p["links"])}) for p in d["pairs"]),
                links=tuple(Link(**lk) for lk in d["links"]),
                rounds=tuple(tuple(r) for r in d["rounds"]),
                round_loads=tuple(tuple((a, b) for a, b in r) for r in d["round_loads"]),
                max_shared_load=d["max_shared_load"],
                reports=tuple(
                    TrafficReport(**{**r, "round_us": tuple(r["round_us"])}) for r in d["reports"]
                ),
                notes=tuple(d["notes"]),
                phased=d.get("phased", False),
                collapse_violations=d.get("collapse_violations", 0),
                schedule_reason=d.get("schedule_reason", ""),
                collapse_factors=tuple(tuple(c) for c in d.get("collapse_factors", ())),  # type: ignore[misc]
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


def _decide(topo: Topology, a: int, b: int, opt: TransferOptions, gen: int) -> tuple[str, str]:
    cls, st = topo.classes[a][b], topo.p2p[a][b]
    m = opt.probe.get(a, b) if opt.probe else None
    forced = override_for(opt.pair_overrides, a, b, "path")
    if st in (P2PStatus.UNSUPPORTED, P2PStatus.DISABLED):
        why = f"driver reports P2P {st.value}"
        if opt.p2p:
            why += "; PCIE_A2A_P2P=1 cannot override the driver"
        elif forced == P2P:
            why += "; PCIE_A2A_PAIRS cannot override the driver"
        return STAGED, why
    if m is not None and m.p2p_possible is False:
        return STAGED, "probe: cudaDeviceCanAccessPeer is 0"
    if forced is not None:
        return forced, f"PCIE_A2A_PAIRS sets {forced}"
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
    st: P2PStatus, m: PairMeasurement | None, opt: TransferOptions, gen: int
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
    topo: Topology,
    a: int,
    b: int,
    transport: str,
    direction: str,
    engine: str,
    opt: TransferOptions,
    gen: int,
) -> tuple[float, float, str]:
    """(GB/s, µs, where from) for pair a -> b moved as decided. A pull's latency is the
    sender's ready flag (a store) plus one read round trip before the rows arrive."""
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
        read_us = us
        if m is not None:
            rates = {
                (PUSH, SM): (m.store_gbps, "kernel stores"),
                (PUSH, COPY_ENGINE): (m.ce_gbps, "copy engine"),
                (PULL, SM): (m.load_gbps, "kernel loads"),
                (PULL, COPY_ENGINE): (
                    m.ce_read_gbps if m.ce_read_gbps is not None else m.ce_gbps,
                    "copy engine read",
                ),
            }
            rate, what = rates[(direction, engine)]
            if rate is not None:
                gbps, src = rate, f"probe ({what})"
            elif m.p2p_gbps is not None:
                gbps, src = m.p2p_gbps, "probe"
            flag = m.store_us if m.store_us is not None else m.p2p_us
            if flag is not None:
                us = flag
            if m.load_us is not None:
                read_us = m.load_us
        return gbps, (us + read_us if direction == PULL else us), src
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


def _schedule(
    n: int,
    pair_links: dict[tuple[int, int], tuple[str, ...]],
    shared: list[str],
    triggers: dict[tuple[int, int], tuple[str, str]],
    avoid_trigger: bool = True,
):
    """Rounds in which every rank sends to one peer and receives from one, covering every
    ordered pair once. `triggers` maps each pushing flow that leaves a trigger-capable
    switch to (switch, destination root complex). Chosen to minimise, in order: the
    (switch, round) cases in which a switch pushes into two or more root complexes (the
    collapse trigger; skipped with ``avoid_trigger=False``), the largest number of flows on
    one shared link in any round, the sum over rounds of each round's largest, the sum of
    squares. Candidates are the shift schedule (i -> i + r) and, for powers of two, the
    XOR schedule (i -> i ^ r), under every relabeling of the GPUs. Returns (rounds, the
    busiest shared links per round, violations)."""
    if n < 2:
        return (), (), 0
    idx = {lid: k for k, lid in enumerate(shared)}
    inc = np.zeros((n, n, max(len(shared), 1)), dtype=np.int64)
    for (a, b), links in pair_links.items():
        for lid in links:
            if lid in idx:
                inc[a, b, idx[lid]] += 1
    switches = sorted({sw for sw, _ in triggers.values()})
    rcs = sorted({rc for _, rc in triggers.values()})
    trig = np.zeros((n, n, max(len(switches), 1), max(len(rcs), 1)), dtype=np.int64)
    for (a, b), (sw, rc) in triggers.items():
        trig[a, b, switches.index(sw), rcs.index(rc)] = 1
    perms, count = _candidates(n)
    inv = np.argsort(perms, axis=1)
    families = [lambda pos, r: (pos + r) % n]
    if n & (n - 1) == 0:
        families.append(lambda pos, r: pos ^ r)
    best = None
    rows = np.arange(n)[None, :]
    for fam_id, step in enumerate(families):
        loads = np.zeros((count, n - 1, inc.shape[2]), dtype=np.int64)
        viol = np.zeros((count,), dtype=np.int64)
        for r in range(1, n):
            dst = np.take_along_axis(inv, step(perms, r), axis=1)
            loads[:, r - 1, :] = inc[rows, dst].sum(axis=1)
            if triggers:
                hit = trig[rows, dst].sum(axis=1) > 0  # [count, switch, rc]
                viol += np.maximum(hit.sum(axis=2) - 1, 0).sum(axis=1)
        per_round = loads.max(axis=2)
        keys = (per_round.max(axis=1), per_round.sum(axis=1), (loads**2).sum(axis=(1, 2)))
        first = viol if avoid_trigger else np.zeros_like(viol)
        k = int(np.lexsort((np.arange(count), keys[2], keys[1], keys[0], first))[0])
        cost = (int(first[k]), int(keys[0][k]), int(keys[1][k]), int(keys[2][k]), fam_id)
        if best is None or cost < best[0]:
            pi, pinv = perms[k], inv[k]
            rounds = tuple(tuple(int(pinv[step(pi[i], r)]) for i in range(n)) for r in range(1, n))
            best = (cost, rounds, loads[k], int(viol[k]))
    assert best is not None
    _, rounds, loads, violations = best
    round_loads = tuple(
        tuple(
            sorted(
                ((shared[j], int(v)) for j, v in enumerate(row) if v > 0 and shared),
                key=lambda t: (-t[1], t[0]),
            )[:3]
        )
        for row in loads
    )
    return rounds, round_loads, violations


def _round_trigger_switches(
    rnd: tuple[int, ...], triggers: dict[tuple[int, int], tuple[str, str]]
) -> set[str]:
    """Switches that push into two or more root complexes in this round."""
    seen: dict[str, set[str]] = {}
    for a, b in enumerate(rnd):
        if (a, b) in triggers:
            sw, rc = triggers[(a, b)]
            seen.setdefault(sw, set()).add(rc)
    return {sw for sw, rcs in seen.items() if len(rcs) >= 2}


# ---- prediction -------------------------------------------------------------------------


def _push_triggers(
    pairs: dict[tuple[int, int], PairRoute],
) -> dict[tuple[int, int], tuple[str, str]]:
    return {
        k: (p.trigger_switch, p.trigger_root)
        for k, p in pairs.items()
        if p.transport == P2P
        and p.direction == PUSH
        and p.trigger_switch is not None
        and p.trigger_root is not None
    }


def _report(
    traffic: Traffic,
    pairs: dict[tuple[int, int], PairRoute],
    links: dict[str, Link],
    rounds,
    collapse: dict[str, float],
) -> TrafficReport:
    """Rounds one after another, each as slow as its slowest flow: a flow's latency plus its
    bytes at the smaller of its pair's rate and each link's capacity shared among the
    round's flows; a pushing flow from a switch that writes into two or more root complexes
    in that round keeps only that switch's collapse factor of its rate."""
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
    triggers = _push_triggers(pairs)
    times = []
    for rnd in rounds:
        flows = [(a, b) for a, b in enumerate(rnd) if traffic.bytes[a][b] > 0]
        collapsing = _round_trigger_switches(rnd, triggers)
        count: dict[str, int] = {}
        for a, b in flows:
            for lid in pairs[(a, b)].links:
                count[lid] = count.get(lid, 0) + 1
        t = 0.0
        for a, b in flows:
            p = pairs[(a, b)]
            bw = min([p.gbps] + [links[lid].capacity_gbps / count[lid] for lid in p.links])
            if (a, b) in triggers and triggers[(a, b)][0] in collapsing:
                bw *= collapse.get(triggers[(a, b)][0], 1.0)
            t = max(t, p.latency_us + traffic.bytes[a][b] / (bw * 1e3))
        times.append(t)
    total = float(sum(sum(r) for r in traffic.bytes))
    return TrafficReport(
        traffic.name, total, bott, bott_bytes, bott_us, tuple(times), float(sum(times))
    )


def plan_transfers(
    topology: Topology,
    traffic: Traffic | Sequence[Traffic] | None = None,
    options: TransferOptions | None = None,
) -> TransferPlan:
    """Plan every ordered pair of `topology` (path, direction, engine, each with its
    reason), the send schedule, and (for each traffic matrix given) the bottleneck link and
    predicted exchange time. Pure: same inputs, same plan; the environment is not read (use
    TransferOptions.from_env()). A probe is matched to the topology's GPUs by bus id
    (:meth:`Probe.aligned_to`)."""
    opt = options or TransferOptions()
    topo = topology
    if opt.probe is not None:
        opt = replace(opt, probe=opt.probe.aligned_to([g.bus_id for g in topo.gpus]))
    n = topo.num_gpus
    gens = [g.link_gen or opt.default_link_gen for g in topo.gpus]
    fabric = _Fabric(topo, opt.default_link_gen)
    pairs: dict[tuple[int, int], PairRoute] = {}
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            gen = min(gens[a], gens[b])
            transport, reason = _decide(topo, a, b, opt, gen)
            direction, why_dir = decide_direction(
                topo, a, b, transport, opt.probe, opt.direction, opt.pair_overrides
            )
            engine, why_eng = decide_engine(
                topo, a, b, transport, direction, opt.probe, opt.engine, opt.pair_overrides
            )
            gbps, us, src = _estimate(topo, a, b, transport, direction, engine, opt, gen)
            node = topo.gpus[b].numa_node if transport == STAGED else None
            sw = roots.trigger_switch(topo, a, b) if transport == P2P else None
            pairs[(a, b)] = PairRoute(
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
                direction=direction,
                direction_reason=why_dir,
                engine=engine,
                engine_reason=why_eng,
                trigger_switch=sw,
                trigger_root=roots.root_complex(topo, b) if sw is not None else None,
            )
    links = fabric.links
    if opt.probe is not None:
        links = _measured_links(links, opt.probe, pairs)
    shared = sorted(lid for lid, lk in links.items() if lk.shared)
    triggers = _push_triggers(pairs)
    avoid = opt.schedule != SPREAD
    rounds, round_loads, violations = _schedule(
        n, {k: p.links for k, p in pairs.items()}, shared, triggers, avoid
    )
    phase = {(a, b): r for r, rnd in enumerate(rounds) for a, b in enumerate(rnd)}
    pairs = {k: replace(p, phase=phase.get(k, -1)) for k, p in pairs.items()}
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
    trigger_switches = sorted({sw for sw, _ in triggers.values()})
    factors = tuple((sw, *collapse_factor(topo, sw, opt.probe)) for sw in trigger_switches)
    if not triggers:
        why = (
            "no pushing flow can take part in the collapse trigger: rounds spread shared-link load"
        )
    elif not avoid:
        why = "PCIE_A2A_SCHEDULE=spread: rounds spread shared-link load; collapse trigger ignored"
    elif violations == 0:
        why = (
            f"switches {', '.join(trigger_switches)} push into one destination root complex "
            "per round (collapse trigger avoided), then shared-link load spread"
        )
    else:
        why = (
            f"no candidate schedule keeps every switch on one destination root complex per "
            f"round: {violations} (switch, round) cases remain"
        )
    return TransferPlan(
        source=topo.source,
        num_gpus=n,
        pairs=tuple(pairs[(a, b)] for a in range(n) for b in range(n) if a != b),
        links=tuple(links[k] for k in sorted(links)),
        rounds=rounds,
        round_loads=round_loads,
        max_shared_load=max_load,
        reports=tuple(
            _report(t, pairs, links, rounds, {sw: f for sw, f, _ in factors}) for t in items
        ),
        notes=tuple(notes),
        phased=bool(triggers) and avoid,
        collapse_violations=violations,
        schedule_reason=why,
        collapse_factors=factors,
    )


def _measured_links(
    links: dict[str, Link], probe: Probe, pairs: dict[tuple[int, int], PairRoute]
) -> dict[str, Link]:
    """Links raised to what the probe showed they carry: a GPU's own link to its fastest
    measured pair (the table's generation may be a guess), the socket links to the rate
    the cross-socket pattern reached (per direction: both directions were equally
    loaded)."""
    out = dict(links)
    for (a, b), p in pairs.items():
        if not p.estimate.startswith("probe"):
            continue
        for lid in (f"GPU{a}^", f"GPU{b}v"):
            if lid in out and out[lid].capacity_gbps < p.gbps:
                out[lid] = replace(out[lid], capacity_gbps=p.gbps)
    # A link carries at least what went through it; a pattern held back elsewhere (the
    # collapse at a switch, kernel P2P through system memory) says nothing about the link,
    # so the socket links only ever rise to the faster cross-socket pattern.
    cross = [q.aggregate_gbps / 2 for q in probe.patterns if q.kind == "cross_socket"]
    if cross:
        for lid, lk in links.items():
            if lid.startswith("socket") and max(cross) > lk.capacity_gbps:
                out[lid] = replace(
                    lk, capacity_gbps=round(max(cross), 2), label=lk.label + " (measured)"
                )
    return out


def with_reports(p: TransferPlan, traffic: Sequence[Traffic]) -> TransferPlan:
    """A plan with the traffic reports recomputed for other traffic matrices."""
    pairs = {(q.src, q.dst): q for q in p.pairs}
    links = {lk.id: lk for lk in p.links}
    collapse = {sw: f for sw, f, _ in p.collapse_factors}
    return replace(p, reports=tuple(_report(t, pairs, links, p.rounds, collapse) for t in traffic))


def decisions_dict(p: TransferPlan) -> dict[str, Any]:
    """The plan's decisions as plain data (for a probe record, ``Buffer.stats()`` and
    tools): per pair path, direction, engine, phase and the reasons; the schedule."""
    return {
        "source": p.source,
        "num_gpus": p.num_gpus,
        "phased": p.phased,
        "schedule_reason": p.schedule_reason,
        "collapse_violations": p.collapse_violations,
        "rounds": [list(r) for r in p.rounds],
        "pairs": [
            {
                "src": q.src,
                "dst": q.dst,
                "path": q.transport,
                "direction": q.direction,
                "engine": q.engine,
                "phase": q.phase,
                "gbps": round(q.gbps, 3),
                "latency_us": round(q.latency_us, 3),
                "path_reason": q.reason,
                "direction_reason": q.direction_reason,
                "engine_reason": q.engine_reason,
            }
            for q in p.pairs
        ],
    }
