"""NCCL_DEBUG=INFO topology lines: the per-GPU path list NCCL computed.

``GPU/50000 :GPU/0-4e000 (4/24.0/PHB) ... CPU/0-0 (2/24.0/PHB)`` gives, per source GPU, each
target's hop count, bandwidth (GB/s) and path type. When P2P is off NCCL routes GPU pairs
through the receiver's CPU, so a same-switch pair shows PHB instead of PIX: comparing these
paths with ``topo -m`` reveals a driver that refuses P2P.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import parse_error
from .model import UNKNOWN_CLASS, Gpu, NumaNode, P2PStatus, Topology, class_rank
from .text import body_lines

_LINE = re.compile(r"\bGPU/([0-9A-Fa-f]+)\s*:(.*)$")
_PATH = re.compile(r"(GPU|CPU|NET|NIC|NVS|PCI)/([0-9A-Fa-f-]+)\s+\((\d+)/([\d.]+)/([A-Z]+)\)")


def _bus(text: str) -> str:
    """NCCL's bus ids ('0-4e000', '4E000') as one lower-case form: '4e000'."""
    return text.split("-")[-1].lower()


def parse_nccl_paths(
    text: str, source: str = "<text>"
) -> dict[tuple[str, str], tuple[int, float, str]]:
    """{(from GPU bus, to GPU bus): (hops, GB/s, type)} from NCCL INFO path lines. Lines cut
    short in the log keep the entries they have."""
    out: dict[tuple[str, str], tuple[int, float, str]] = {}
    for _, line in body_lines(text):
        m = _LINE.search(line)
        if not m:
            continue
        src = _bus(m.group(1))
        for kind, bus, hops, bw, typ in _PATH.findall(m.group(2)):
            if kind == "GPU":
                out[(src, _bus(bus))] = (int(hops), float(bw), typ)
    if not out:
        raise parse_error(
            source,
            None,
            "no NCCL path lines found (expected 'GPU/<busid> :GPU/<busid> (hops/bw/type) ...')",
        )
    return out


def parse_nccl_tests(text: str, source: str = "<text>") -> list[tuple[int, float, float, float]]:
    """(bytes, time µs, algbw GB/s, busbw GB/s) of the out-of-place columns of nccl-tests
    output (all_reduce_perf, alltoall_perf, ...). Used to calibrate the small-message floor
    (~24.5 µs for all_reduce on 8x RTX 5090 with P2P)."""
    rows = []
    for lineno, line in body_lines(text):
        f = line.split()
        if len(f) < 9 or not f[0].isdigit() or not f[1].isdigit():
            continue
        try:
            rows.append((int(f[0]), float(f[5]), float(f[6]), float(f[7])))
        except ValueError:
            raise parse_error(
                source, lineno, f"nccl-tests row {f[0]}: expected time, algbw, busbw numbers"
            ) from None
    if not rows:
        raise parse_error(
            source,
            None,
            "no nccl-tests result rows found (size count type redop root time algbw busbw ...)",
        )
    return rows


# ---- topologies from NCCL logs and nccl-tests output ------------------------------------

# NCCL's path types (graph/topo.h topoPathTypeStr) and what each means between two GPUs.
# NVL/NVB become NV<n> below; the rest say nothing about the PCIe class of the pair.
_PCIE_TYPES = {"PIX", "PXB", "PHB", "NODE", "SYS"}
_OTHER_TYPES = {"LOC", "NVL", "NVB", "C2C", "PXN", "P2C", "NET", "DIS"}
# GB/s NCCL assigns to one NVLink (SM80/SM90 figure): the link count of an NVL path.
_NCCL_NVLINK_GBPS = 20.0
_RANK_OF = re.compile(r"\bGPU/([0-9A-Fa-f-]+)\s+\((\d+)\)\s*$")
_CHANNEL = re.compile(
    r"\b(\d+)\[([0-9A-Fa-f]+)\]\s*->\s*(\d+)\[([0-9A-Fa-f]+)\](?:\[\d+\])?\s+via\s+([A-Z]+)"
)
_DEVICE = re.compile(
    r"^#?\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+(\d+)\s+"
    r"\[([^\]]+)\]\s+(.+?)\s*$"
)


def nccl_bus_id(text: str) -> str:
    """NCCL's int64 bus id ('0-4e000' -> '4e000': domain, bus, device, function packed in hex
    digits) as '0000:4e:00.0'."""
    v = int(_bus(text), 16)
    return f"{v >> 20:04x}:{(v >> 12) & 0xFF:02x}:{(v >> 4) & 0xFF:02x}.{v & 0xF:x}"


def _pci_bus_id(text: str) -> str | None:
    """nccl-tests' device bus id ('0x01' from old versions, '0000:01:00') as '0000:01:00.0'."""
    t = text.strip().lower()
    m = re.fullmatch(r"0x([0-9a-f]+)", t)
    if m:
        return f"0000:{int(m.group(1), 16):02x}:00.0"
    m = re.fullmatch(r"(?:([0-9a-f]+):)?([0-9a-f]+):([0-9a-f]+)(?:\.([0-9a-f]))?", t)
    if not m:
        return None
    dom, bus, dev, fn = m.groups()
    return f"{int(dom or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn or '0'}"


@dataclass(frozen=True)
class TestDevice:
    rank: int
    host: str
    device: int
    bus_id: str | None
    name: str


def parse_test_devices(text: str, source: str = "<text>") -> list[TestDevice]:
    """The '# Using devices' list of nccl-tests output: one entry per rank, in rank order."""
    out: dict[int, TestDevice] = {}
    for lineno, line in body_lines(text):
        m = _DEVICE.match(line.strip())
        if not m:
            continue
        rank = int(m.group(1))
        if rank in out:
            raise parse_error(
                source, lineno, f"rank {rank} listed twice; expected one line per rank"
            )
        out[rank] = TestDevice(
            rank, m.group(2), int(m.group(3)), _pci_bus_id(m.group(4)), m.group(5)
        )
    if sorted(out) != list(range(len(out))):
        raise parse_error(
            source, None, f"nccl-tests device list has ranks {sorted(out)}; expected 0..n-1"
        )
    return [out[r] for r in sorted(out)]


def _nccl_class(typ: str, bw: float, source: str, line: int) -> str:
    if typ in _PCIE_TYPES:
        return typ
    if typ in ("NVL", "NVB"):
        return f"NV{max(1, round(bw / _NCCL_NVLINK_GBPS))}"
    if typ in _OTHER_TYPES:
        return UNKNOWN_CLASS
    raise parse_error(
        source,
        line,
        f"path type {typ!r} is not one of NCCL's ({', '.join(sorted(_PCIE_TYPES | _OTHER_TYPES))})",
    )


def topology_from_nccl_paths(text: str, source: str = "<text>") -> Topology:
    """A Topology from NCCL_DEBUG=INFO lines: GPUs and bus ids, the path type NCCL computed
    for each GPU pair, each GPU's nearest CPU (its NUMA node) and, where the log has channel
    lines, NCCL's P2P/SHM choice. No PCIe tree is inferred."""
    parse_nccl_paths(text, source)  # raises, naming the file, when there are no path lines
    types: dict[tuple[str, str], str] = {}
    numa: dict[str, tuple[int, int]] = {}  # bus -> (hops, CPU id) of the nearest CPU
    ranks: dict[str, int] = {}
    via: dict[tuple[str, str], str] = {}
    buses: set[str] = set()
    for lineno, line in body_lines(text):
        r = _RANK_OF.search(line)
        if r and "NCCL INFO" in line:
            ranks[_bus(r.group(1))] = int(r.group(2))
            buses.add(_bus(r.group(1)))
        c = _CHANNEL.search(line)
        if c and "NCCL INFO" in line:
            via[(_bus(c.group(2)), _bus(c.group(4)))] = c.group(5)
        m = _LINE.search(line)
        if not m:
            continue
        src = _bus(m.group(1))
        buses.add(src)
        for kind, bus, hops, bw, typ in _PATH.findall(m.group(2)):
            if kind == "GPU":
                buses.add(_bus(bus))
                if _bus(bus) != src:
                    types[(src, _bus(bus))] = _nccl_class(typ, float(bw), source, lineno)
            elif kind == "CPU":
                near = numa.get(src)
                if near is None or int(hops) < near[0]:
                    numa[src] = (int(hops), int(_bus(bus), 16))
    order = sorted(buses, key=lambda b: int(b, 16))
    notes: list[str] = []
    wrong = [b for b in order if b in ranks and ranks[b] != order.index(b)]
    if wrong:
        notes.append(
            "GPUs are numbered in bus id order; NCCL's ranks differ for "
            + ", ".join(f"{nccl_bus_id(b)} (rank {ranks[b]})" for b in wrong)
        )
    n = len(order)
    classes = [[UNKNOWN_CLASS] * n for _ in range(n)]
    for i in range(n):
        classes[i][i] = "X"
    asym = []
    for i, a in enumerate(order):
        for j, b in enumerate(order):
            if i >= j:
                continue
            ab, ba = types.get((a, b)), types.get((b, a))
            known = [t for t in (ab, ba) if t is not None and t != UNKNOWN_CLASS]
            if not known:
                continue
            # NCCL computes each direction on its own; the farther one is what both can rely on.
            cls = max(known, key=class_rank)
            if len(known) == 2 and known[0] != known[1]:
                asym.append(f"GPU{i}-GPU{j} {ab}/{ba}")
            classes[i][j] = classes[j][i] = cls
    missing = sum(classes[i][j] == UNKNOWN_CLASS for i in range(n) for j in range(i + 1, n))
    node: list[int | None] = [numa[b][1] if b in numa else None for b in order]
    for i in range(n):
        if node[i] is None:
            # Closer than SYS means under the same CPU.
            peers = [
                node[j]
                for j in range(n)
                if node[j] is not None and classes[i][j] not in ("X", "SYS", UNKNOWN_CLASS)
            ]
            node[i] = peers[0] if peers else None
    p2p = [[P2PStatus.UNKNOWN] * n for _ in range(n)]
    idx = {b: k for k, b in enumerate(order)}
    shm = []
    for (a, b), how in sorted(via.items()):
        if a in idx and b in idx and a != b:
            i, j = idx[a], idx[b]
            if how == "P2P":
                p2p[i][j] = P2PStatus.SUPPORTED
            elif how == "SHM":
                shm.append(f"{i}->{j}")
    notes.append(
        "NCCL log: path types are NCCL's computed routes; when NCCL cannot use P2P it routes a "
        "GPU pair through the CPU, so PHB or SYS here can hide a closer PCIe path. No PCIe tree "
        "is inferred"
    )
    if missing:
        notes.append(
            f"{missing} GPU pairs have no path line in the log: their class is ? (unknown)"
        )
    if asym:
        notes.append("NCCL's two directions differ, the farther is kept: " + ", ".join(asym))
    if via:
        notes.append("P2P status from NCCL's channel lines ('via P2P' = supported)")
        if shm:
            notes.append(
                "NCCL used host shared memory (SHM) for " + " ".join(shm) + ": P2P was "
                "unavailable or outside NCCL_P2P_LEVEL there, the log does not say which"
            )
    else:
        notes.append("the log has no channel lines (via P2P/SHM): P2P status unknown")
    if any(x is None for x in node):
        notes.append("some GPUs have no CPU in the log: their NUMA node is unknown")
    notes.append("sockets are not in NCCL's log: each NUMA node is taken as its own socket")
    return Topology(
        gpus=tuple(
            Gpu(index=i, bus_id=nccl_bus_id(b), numa_node=node[i]) for i, b in enumerate(order)
        ),
        classes=tuple(tuple(r) for r in classes),
        p2p=tuple(tuple(r) for r in p2p),
        numa_nodes=tuple(
            NumaNode(id=x, socket=x) for x in sorted({x for x in node if x is not None})
        ),
        source=source,
        notes=tuple(notes),
    )


def topology_from_nccl_tests(text: str, source: str = "<text>") -> Topology:
    """nccl-tests output lists the ranks' devices and the measured bus bandwidths, but no
    topology: GPUs (by rank) with every path class and P2P status unknown."""
    rows = parse_nccl_tests(text, source)
    devices = parse_test_devices(text, source)
    if not devices:
        raise parse_error(
            source,
            None,
            "no '# Using devices' list (' Rank 0 Group 0 Pid .. on HOST device 0 [BUS] NAME')",
        )
    n = len(devices)
    test = next(
        (
            m.group(1)
            for _, line in body_lines(text)
            if (m := re.search(r"Collective test starting:\s*(\S+)", line))
        ),
        "nccl-tests",
    )
    best = max(rows, key=lambda r: r[3])
    notes = [
        "nccl-tests output lists the devices and bus bandwidths but no topology: every path "
        "class and P2P status is unknown (?); give `nvidia-smi topo -m` or measure (--probe, "
        "--probe-file) for a real plan",
        f"{test}: busbw peaks at {best[3]:g} GB/s ({best[0]} B), smallest time {min(r[1] for r in rows):g} us",
    ]
    hosts = sorted({d.host for d in devices})
    if len(hosts) > 1:
        notes.append(
            f"ranks run on {len(hosts)} hosts ({', '.join(hosts)}); GPUs are numbered by rank"
        )
    # Settings only as the file states them: the command line that ran the test.
    for _, line in body_lines(text):
        if "_perf" in line and not line.lstrip().startswith("#"):
            for var in re.findall(r"\b(NCCL_\w+=\S+)", line):
                notes.append(f"the test's command line sets {var}")
    return Topology(
        gpus=tuple(Gpu(index=d.rank, bus_id=d.bus_id, name=d.name) for d in devices),
        classes=tuple(tuple("X" if i == j else UNKNOWN_CLASS for j in range(n)) for i in range(n)),
        p2p=tuple(tuple(P2PStatus.UNKNOWN for _ in range(n)) for _ in range(n)),
        source=source,
        notes=tuple(notes),
    )
