"""The topology model: GPUs, the PCIe tree above them, NUMA nodes, sockets, NICs, and for
every GPU pair a path class and a P2P status.

Path classes are nvidia-smi's (``nvidia-smi topo -m`` legend):

* ``NV#``  a bonded set of # NVLinks;
* ``PIX``  at most one PCIe switch between the two GPUs;
* ``PXB``  several switches, but not the CPU's host bridge;
* ``PHB``  through a PCIe host bridge (the CPU root complex);
* ``NODE`` between host bridges of one NUMA node;
* ``SYS``  across the SMP interconnect between NUMA nodes (UPI/xGMI, or the fabric between
  the NUMA nodes of one socket in NPS2/NPS4/SNC modes).

The tree is normalised to socket -> NUMA node -> host bridge -> root port -> switch(es) ->
GPU. A switch here is the whole chip (its upstream port plus its downstream ports): the
links the planner cares about are the GPU's own x16 link and the switch's uplink, and the
ports in between are a crossbar. Sources that do not show the tree (``topo -m``) get one
inferred from the class matrix (see :func:`infer_tree`).

Everything is frozen and made of tuples, so equal topologies compare equal and the JSON form
round-trips exactly.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .errors import TopologyError

CLASS_ORDER = ("NV", "PIX", "PXB", "PHB", "NODE", "SYS")
# The class of a pair whose path the source does not show (p2pBandwidthLatencyTest and
# nccl-tests output, pairs cut from an NCCL log). It has no rank: class_rank() refuses it,
# so every rule that compares classes has to decide what an unknown path means.
UNKNOWN_CLASS = "?"
FORMAT = "pcie_a2a.topology"
VERSION = 1


class P2PStatus(str, Enum):
    SUPPORTED = "supported"
    UNSUPPORTED = "unsupported"  # chipset, topology or hardware cannot do it
    DISABLED = "disabled"  # the driver could, but refuses (regkey, GeForce SKU policy)
    UNKNOWN = "unknown"  # the source does not say


def is_nvlink(cls: str) -> bool:
    return cls.startswith("NV") and cls[2:].isdigit()


def normalise_bus_id(bus_id: str) -> str:
    """``0000:41:00.0`` form, lower case (torch and NVML print 8-digit domains)."""
    text = bus_id.strip().lower()
    parts = text.split(":")
    if len(parts) == 3:
        domain = parts[0][-4:].rjust(4, "0")
        return f"{domain}:{parts[1]}:{parts[2]}"
    if len(parts) == 2:
        return f"0000:{parts[0]}:{parts[1]}"
    return text


def class_rank(cls: str) -> int:
    """0 (NVLink) .. 5 (SYS): larger is farther apart."""
    if is_nvlink(cls):
        return 0
    try:
        return CLASS_ORDER.index(cls)
    except ValueError:
        raise ValueError(
            f"path class {cls!r}: expected NV<n> or one of {CLASS_ORDER[1:]}"
        ) from None


@dataclass(frozen=True)
class Gpu:
    index: int
    bus_id: str | None = None  # "0000:41:00.0", lower case
    name: str | None = None
    numa_node: int | None = None
    parent: str | None = None  # id of a Switch or RootPort
    link_gen: int | None = None  # maximum the link trains to (idle GPUs drop to Gen1)
    link_width: int | None = None
    current_link_gen: int | None = None
    current_link_width: int | None = None


@dataclass(frozen=True)
class Switch:
    id: str
    parent: str  # id of a Switch or RootPort
    link_gen: int | None = None  # of the uplink
    link_width: int | None = None
    vendor: str | None = None


@dataclass(frozen=True)
class RootPort:
    id: str
    host_bridge: str
    numa_node: int | None = None
    link_gen: int | None = None
    link_width: int | None = None
    vendor: str | None = (
        None  # PCI vendor id of the root port: the CPU's (0x1022 AMD, 0x8086 Intel)
    )


@dataclass(frozen=True)
class NumaNode:
    id: int
    socket: int
    cpus: str | None = None
    distances: tuple[int, ...] | None = None  # SLIT row, indexed by node position


@dataclass(frozen=True)
class Nic:
    index: int
    name: str | None = None
    bus_id: str | None = None
    numa_node: int | None = None


@dataclass(frozen=True)
class Topology:
    gpus: tuple[Gpu, ...]
    classes: tuple[tuple[str, ...], ...]  # [i][j], "X" on the diagonal
    p2p: tuple[tuple[P2PStatus, ...], ...]  # [i][j]; diagonal UNKNOWN, never used
    switches: tuple[Switch, ...] = ()
    root_ports: tuple[RootPort, ...] = ()
    numa_nodes: tuple[NumaNode, ...] = ()
    nics: tuple[Nic, ...] = ()
    nic_classes: tuple[tuple[str, ...], ...] = ()  # [nic][gpu]
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        n = len(self.gpus)
        for i, g in enumerate(self.gpus):
            if g.index != i:
                raise TopologyError(f"{self.source}: GPU at position {i} has index {g.index}")
        if len(self.classes) != n or any(len(r) != n for r in self.classes):
            raise TopologyError(f"{self.source}: class matrix is not {n}x{n}")
        if len(self.p2p) != n or any(len(r) != n for r in self.p2p):
            raise TopologyError(f"{self.source}: P2P matrix is not {n}x{n}")
        for i in range(n):
            for j in range(n):
                c = self.classes[i][j]
                if i == j:
                    if c != "X":
                        raise TopologyError(f"{self.source}: class[{i}][{i}]={c!r}, expected 'X'")
                    continue
                if c != UNKNOWN_CLASS:
                    class_rank(c)
                if c != self.classes[j][i]:
                    raise TopologyError(
                        f"{self.source}: class GPU{i}->GPU{j}={c!r} but "
                        f"GPU{j}->GPU{i}={self.classes[j][i]!r}; a path class is symmetric"
                    )
        ids = [s.id for s in self.switches] + [r.id for r in self.root_ports]
        if len(set(ids)) != len(ids):
            raise TopologyError(f"{self.source}: duplicate switch/root-port ids")
        known = set(ids)
        for g in self.gpus:
            if g.parent is not None and g.parent not in known:
                raise TopologyError(f"{self.source}: GPU{g.index} parent {g.parent!r} is unknown")
        for s in self.switches:
            if s.parent not in known:
                raise TopologyError(f"{self.source}: switch {s.id} parent {s.parent!r} is unknown")

    # ---- queries ------------------------------------------------------------------------
    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def path_class(self, a: int, b: int) -> str:
        return self.classes[a][b]

    def p2p_status(self, a: int, b: int) -> P2PStatus:
        return self.p2p[a][b]

    def socket_of_node(self, node: int | None) -> int | None:
        for n in self.numa_nodes:
            if n.id == node:
                return n.socket
        return node

    def _node(self, ident: str) -> Switch | RootPort:
        for s in self.switches:
            if s.id == ident:
                return s
        for r in self.root_ports:
            if r.id == ident:
                return r
        raise KeyError(ident)

    def ancestry(self, gpu: int) -> tuple[RootPort | None, tuple[Switch, ...]]:
        """(root port, switches from the top down) above a GPU."""
        chain: list[Switch] = []
        ident = self.gpus[gpu].parent
        while ident is not None:
            node = self._node(ident)
            if isinstance(node, RootPort):
                return node, tuple(reversed(chain))
            chain.append(node)
            ident = node.parent
        return None, tuple(reversed(chain))

    def tree_class(self, a: int, b: int) -> str:
        """The PCIe class implied by the tree alone (NVLink is not part of the tree)."""
        if a == b:
            return "X"
        na, nb = self.gpus[a].numa_node, self.gpus[b].numa_node
        if na is not None and nb is not None and na != nb:
            return "SYS"
        (ra, sa), (rb, sb) = self.ancestry(a), self.ancestry(b)
        if ra is None or rb is None:
            return "SYS" if na is None or nb is None else "NODE"
        if ra.host_bridge != rb.host_bridge:
            return "NODE"
        if ra.id != rb.id:
            return "PHB"
        common = 0
        while common < min(len(sa), len(sb)) and sa[common].id == sb[common].id:
            common += 1
        if common == 0:
            return "PIX" if not sa and not sb else "PXB"
        switches_on_path = len(sa) + len(sb) - 2 * common + 1
        return "PIX" if switches_on_path == 1 else "PXB"

    def with_p2p(self, status: P2PStatus, pairs: list[tuple[int, int]] | None = None) -> Topology:
        """A copy with the P2P status of `pairs` (default: every pair) replaced."""
        n = self.num_gpus
        todo = set(pairs) if pairs is not None else {(i, j) for i in range(n) for j in range(n)}
        rows = [
            tuple(status if (i, j) in todo and i != j else self.p2p[i][j] for j in range(n))
            for i in range(n)
        ]
        return dataclasses.replace(self, p2p=tuple(rows))

    # ---- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def obj(x: Any) -> dict[str, Any]:
            d = dataclasses.asdict(x)
            return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}

        return {
            "format": FORMAT,
            "version": VERSION,
            "source": self.source,
            "gpus": [obj(g) for g in self.gpus],
            "switches": [obj(s) for s in self.switches],
            "root_ports": [obj(r) for r in self.root_ports],
            "numa_nodes": [obj(n) for n in self.numa_nodes],
            "nics": [obj(n) for n in self.nics],
            "classes": [list(r) for r in self.classes],
            "p2p": [[s.value for s in r] for r in self.p2p],
            "nic_classes": [list(r) for r in self.nic_classes],
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @staticmethod
    def from_dict(d: dict[str, Any], source: str = "<json>") -> Topology:
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise TopologyError(
                f"{source}: format={d.get('format')!r} version={d.get('version')!r}, "
                f"expected format={FORMAT!r} version={VERSION}"
            )
        try:
            numa = []
            for n in d["numa_nodes"]:
                dist = n.get("distances")
                numa.append(NumaNode(**{**n, "distances": None if dist is None else tuple(dist)}))
            return Topology(
                gpus=tuple(Gpu(**g) for g in d["gpus"]),
                classes=tuple(tuple(r) for r in d["classes"]),
                p2p=tuple(tuple(P2PStatus(s) for s in r) for r in d["p2p"]),
                switches=tuple(Switch(**s) for s in d["switches"]),
                root_ports=tuple(RootPort(**r) for r in d["root_ports"]),
                numa_nodes=tuple(numa),
                nics=tuple(Nic(**n) for n in d["nics"]),
                nic_classes=tuple(tuple(r) for r in d["nic_classes"]),
                source=d["source"],
                notes=tuple(d["notes"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TopologyError(f"{source}: not a valid {FORMAT} document: {exc}") from None

    @staticmethod
    def from_json(text: str, source: str = "<json>") -> Topology:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TopologyError(
                f"{source}:{exc.lineno}: invalid JSON ({exc.msg}); expected a {FORMAT} document"
            ) from None
        return Topology.from_dict(d, source)


def empty_p2p(n: int) -> tuple[tuple[P2PStatus, ...], ...]:
    return tuple(tuple(P2PStatus.UNKNOWN for _ in range(n)) for _ in range(n))


def _components(members: list[int], linked) -> list[list[int]]:
    """Connected components of `members` under the symmetric relation `linked(a, b)`."""
    seen: set[int] = set()
    out = []
    for m in members:
        if m in seen:
            continue
        comp, stack = [], [m]
        seen.add(m)
        while stack:
            x = stack.pop()
            comp.append(x)
            for y in members:
                if y not in seen and linked(x, y):
                    seen.add(y)
                    stack.append(y)
        out.append(sorted(comp))
    return out


def infer_numa(classes: list[list[str]]) -> list[int]:
    """NUMA node per GPU when the source has no affinity column: GPUs joined by anything
    closer than SYS share a node; nodes are numbered in order of their lowest GPU."""
    n = len(classes)
    comps = _components(
        list(range(n)), lambda a, b: classes[a][b] not in ("SYS", "X", UNKNOWN_CLASS)
    )
    node = [0] * n
    for k, comp in enumerate(comps):
        for g in comp:
            node[g] = k
    return node


def infer_tree(
    classes: list[list[str]], numa: list[int]
) -> tuple[list[str], tuple[RootPort, ...], tuple[Switch, ...]]:
    """A PCIe tree that reproduces a ``topo -m`` class matrix: (parent of each GPU, root
    ports, switches). Host bridges are the PHB-or-closer components of a NUMA node, root
    ports the PXB-or-closer components; a root port with several GPUs gets a switch, and
    when its GPUs are not all PIX to each other every PIX group gets a leaf switch below it.
    NVLink cells say nothing about PCIe and are ignored here."""
    n = len(classes)
    parent = [""] * n
    ports: list[RootPort] = []
    switches: list[Switch] = []

    def within(limit: str):
        return lambda a, b: (
            not is_nvlink(classes[a][b])
            and classes[a][b] not in ("X", UNKNOWN_CLASS)
            and class_rank(classes[a][b]) <= class_rank(limit)
        )

    for node in sorted(set(numa)):
        members = [g for g in range(n) if numa[g] == node]
        for hb in _components(members, within("PHB")):
            hb_id = f"hb{len({p.host_bridge for p in ports})}"
            for rp_members in _components(hb, within("PXB")):
                rp = RootPort(id=f"rp{len(ports)}", host_bridge=hb_id, numa_node=node)
                ports.append(rp)
                if len(rp_members) == 1:
                    parent[rp_members[0]] = rp.id
                    continue
                top = Switch(id=f"sw{len(switches)}", parent=rp.id)
                switches.append(top)
                leaves = _components(rp_members, within("PIX"))
                for leaf in leaves:
                    host = top.id
                    if len(leaves) > 1:
                        sw = Switch(id=f"sw{len(switches)}", parent=top.id)
                        switches.append(sw)
                        host = sw.id
                    for g in leaf:
                        parent[g] = host
    return parent, tuple(ports), tuple(switches)


_GTS_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


def gen_from_speed(text: str | None) -> int | None:
    """PCIe generation from a link speed string ("32.0 GT/s PCIe", "16 GT/s", "8.0 GT/s");
    None for empty or unknown strings (VMs report ``""`` or "Unknown")."""
    if not text:
        return None
    head = text.strip().split()[0] if text.strip() else ""
    try:
        return _GTS_TO_GEN.get(float(head))
    except ValueError:
        return None
