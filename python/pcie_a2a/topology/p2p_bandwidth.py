"""Reading CUDA samples' ``p2pBandwidthLatencyTest`` output (and the author tables derived
from it) into a :class:`~.probe.Probe` and a path-less :class:`~.model.Topology`.

Accepted: heading lines with P2P=Enabled/Disabled, ``D\\D`` / ``GPU`` / ``Src->`` / ``Dst->``
column headers, ``-`` or an em dash on the diagonal, truncated rows, stray table pipes
(``| 0 | 102 | ...`` as pasted from web pages), the ``P2P Connectivity Matrix`` and the
``Device=i CAN Access Peer Device=j`` lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .errors import parse_error
from .model import UNKNOWN_CLASS, Gpu, P2PStatus, Topology
from .nccl_log import parse_test_devices
from .probe import PairMeasurement, Probe
from .text import body_lines

_DASHES = {"-", "\u2014", "\u2013", "--"}
_PEER = re.compile(r"Device\s*=\s*(\d+)\s+(CAN|CANNOT)\s+Access\s+Peer\s+Device\s*=\s*(\d+)")
# "Device: 0, NVIDIA GeForce RTX 3090, pciBusID: 1b, pciDeviceID: 0, pciDomainID:0"
_DEVICE = re.compile(
    r"^\s*Device:\s*(\d+),\s*(.+?),\s*pciBusID:\s*([0-9a-fA-F]+),\s*pciDeviceID:\s*"
    r"([0-9a-fA-F]+),\s*pciDomainID:\s*([0-9a-fA-F]+)"
)


def _unpipe(line: str) -> str:
    """A matrix line without table pipes (markdown or chat pastes): cells become blanks."""
    return line.replace("|", " ").replace("\t", " ") if "|" in line else line.replace("\t", " ")


@dataclass
class _Block:
    heading: str
    line: int
    cols: list[int]
    rows_are_dst: bool = False
    values: dict[tuple[int, int], float] = field(default_factory=dict)


def _kind(heading: str) -> tuple[str, str, str] | None:
    """(quantity, transport, direction) of a matrix heading, None for other matrices."""
    h = heading.lower()
    if "connectivity" in h:
        return ("connectivity", "", "")
    if h.strip() == "cpu":
        return None
    transport = "staged" if "p2p=disabled" in h else "p2p"
    if "latency" in h:
        return ("latency", transport, "")
    if "bandwidth" in h or "gb/s" in h or "matrix" in h:
        return ("bandwidth", transport, "bidir" if "bidirectional" in h else "uni")
    return None


def _num(tok: str) -> float | None:
    if tok in _DASHES:
        return None
    try:
        return float(tok)
    except ValueError:
        return None


def _scan(text: str, source: str) -> list[_Block]:
    """The measurement blocks of p2pBandwidthLatencyTest output (at least one)."""
    blocks: list[_Block] = []
    heading, heading_line = "", 0
    current: _Block | None = None
    for lineno, line in body_lines(text):
        if "|" in line and re.fullmatch(r"[\s|:\-]+", line):
            continue  # a markdown separator row (|---|---|) inside a pasted table
        toks = _unpipe(line).split()
        if not toks:
            current = None
            continue
        head = re.match(
            r"^\s*(D\\D|GPU|CPU|Src->|Dst->)\s+((?:GPU\s*)?\d+(?:\s+(?:GPU\s*)?\d+)*)\s*$",
            _unpipe(line),
        )
        if head:
            if head.group(1) == "CPU":  # host-side latency of the same copies: not ours
                current = None
                continue
            cols = [int(c) for c in re.findall(r"\d+", head.group(2))]
            current = _Block(heading, heading_line, cols, rows_are_dst=head.group(1) == "Src->")
            if _kind(heading) is not None:
                blocks.append(current)
            continue
        row = re.match(r"^\s*(?:GPU\s*)?(\d+):?\s+(.*)$", _unpipe(line))
        if current is not None and row:
            r = int(row.group(1))
            for k, tok in enumerate(row.group(2).split()[: len(current.cols)]):
                v = _num(tok)
                if v is None and tok not in _DASHES:
                    if k == 0:
                        raise parse_error(
                            source,
                            lineno,
                            f"row {r}: {tok!r} is not a number; expected one value per column",
                        )
                    break  # trailing author comment after a partial row
                if v is not None:
                    c = current.cols[k]
                    current.values[(c, r) if current.rows_are_dst else (r, c)] = v
            continue
        current = None
        heading, heading_line = line.strip(), lineno
    if not blocks:
        raise parse_error(
            source,
            None,
            "no p2pBandwidthLatencyTest matrix found (a heading, a 'D\\D 0 1 ..' header, rows)",
        )
    return blocks


def _peer_lines(text: str) -> dict[tuple[int, int], bool]:
    """'Device=0 CAN Access Peer Device=1' / 'CANNOT' lines: cudaDeviceCanAccessPeer."""
    out = {}
    for _, line in body_lines(text):
        m = _PEER.search(line)
        if m:
            out[(int(m.group(1)), int(m.group(3)))] = m.group(2) == "CAN"
    return out


def parse_p2p_test(text: str, source: str = "<text>") -> Probe:
    """Measurements from p2pBandwidthLatencyTest output (or author tables of it)."""
    blocks = _scan(text, source)
    acc: dict[tuple[int, int], dict[str, Any]] = {}
    for b in blocks:
        kind = _kind(b.heading)
        assert kind is not None
        qty, transport, direction = kind
        for (s, d), v in b.values.items():
            if s == d:
                continue
            m = acc.setdefault((s, d), {})
            if qty == "connectivity":
                m["p2p_possible"] = v != 0
            elif qty == "latency":
                m.setdefault(f"{transport}_us", v)
            else:
                m.setdefault(f"{transport}_{direction}", v)  # the first block of a kind wins
    for key, ok in _peer_lines(text).items():
        if key[0] != key[1]:
            acc.setdefault(key, {}).setdefault("p2p_possible", ok)
    pairs = {}
    for key, m in acc.items():
        fields: dict[str, Any] = {
            k: m[k] for k in ("p2p_us", "staged_us", "p2p_possible") if k in m
        }
        for t in ("p2p", "staged"):
            # Both directions busy is the all-to-all case: half a bidirectional figure is
            # the number to plan with; a unidirectional one is the fallback.
            if f"{t}_bidir" in m:
                fields[f"{t}_gbps"] = m[f"{t}_bidir"] / 2
            elif f"{t}_uni" in m:
                fields[f"{t}_gbps"] = m[f"{t}_uni"]
        if fields.get("p2p_possible") is False:
            # cudaDeviceCanAccessPeer said no: the "P2P=Enabled" runs fell back to staging.
            for name in ("gbps", "us"):
                if f"p2p_{name}" in fields:
                    fields.setdefault(f"staged_{name}", fields.pop(f"p2p_{name}"))
                    fields.pop(f"p2p_{name}", None)
        pairs[key] = PairMeasurement(**fields)
    return Probe(pairs=pairs, source=source)


def p2p_test_topology(text: str, source: str = "<text>") -> tuple[Topology, Probe]:
    """The GPUs of p2pBandwidthLatencyTest output, each pair's P2P status from the P2P
    Connectivity Matrix (cudaDeviceCanAccessPeer), and the measurements as a probe. The
    output shows no path, so every class is ? (unknown) and no PCIe tree is made up."""
    blocks = _scan(text, source)
    probe = parse_p2p_test(text, source)
    found: dict[int, tuple[str, str]] = {}  # device -> (name, bus id)
    for lineno, line in body_lines(text):
        m = _DEVICE.match(line)
        if m:
            dev, name, bus, slot, dom = m.groups()
            if int(dev) in found:
                raise parse_error(source, lineno, f"device {dev} listed twice")
            found[int(dev)] = (name, f"{int(dom, 16):04x}:{int(bus, 16):02x}:{int(slot, 16):02x}.0")
    seen = {i for b in blocks for key in b.values for i in key} | set(found)
    seen |= {i for key in _peer_lines(text) for i in key}
    n = max(seen) + 1
    notes = [
        "p2pBandwidthLatencyTest output shows no PCIe tree, NUMA node or path class: every "
        "class is ? (unknown) and decisions rest on the P2P status and the measured numbers"
    ]
    if not found:
        # Author pages sometimes add an nccl-tests run of the same box: its device list
        # names the GPUs when it covers exactly the matrix's devices.
        try:
            devs = parse_test_devices(text, source)
        except ValueError:
            devs = []
        if devs and sorted(d.device for d in devs) == list(range(n)):
            found = {d.device: (d.name, d.bus_id or "") for d in devs}
            notes.append("GPU names and bus ids from the nccl-tests device list in the file")
    conn = {k: m.p2p_possible for k, m in probe.pairs.items() if m.p2p_possible is not None}
    p2p = [
        [
            P2PStatus.UNKNOWN
            if i == j or (i, j) not in conn
            else (P2PStatus.SUPPORTED if conn[(i, j)] else P2PStatus.UNSUPPORTED)
            for j in range(n)
        ]
        for i in range(n)
    ]
    if conn:
        notes.append(
            "P2P status from the P2P Connectivity Matrix (cudaDeviceCanAccessPeer; 0 does not "
            "say whether hardware or driver policy refuses, it is shown as unsupported)"
        )
    else:
        notes.append(
            "no P2P Connectivity Matrix in the file: P2P status unknown; 'P2P=Enabled' numbers "
            "are taken as P2P measurements"
        )
    notes.append("the file's measurements are the probe (--probe / --probe-file replace them)")
    gpus = tuple(
        Gpu(
            index=i,
            name=found[i][0] if i in found else None,
            bus_id=(found[i][1] or None) if i in found else None,
        )
        for i in range(n)
    )
    topo = Topology(
        gpus=gpus,
        classes=tuple(tuple("X" if i == j else UNKNOWN_CLASS for j in range(n)) for i in range(n)),
        p2p=tuple(tuple(r) for r in p2p),
        source=source,
        notes=tuple(notes),
    )
    return topo, probe
