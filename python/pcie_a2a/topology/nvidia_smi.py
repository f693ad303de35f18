"""Parsers for ``nvidia-smi topo -m`` and ``nvidia-smi topo -p2p r|w|n|a|p`` text.

Accepted layouts, all seen in published dumps (see tests/fixtures/topology):
tab-separated (nvidia-smi's own output, with its extra empty field before ``GPU NUMA ID``),
space-aligned (fixed 8-character columns, where an empty ``CPU Affinity`` cell under a
cgroup shows up only as blank space, so tail columns are cut at the header's offsets),
condensed author tables (no affinity columns, or a trailing ``NUMA n`` column with no
header), markdown tables (``|`` separated), NIC rows and columns, the legends, and the old
class name ``SOC`` (nvidia-smi before 2017) for what is now ``SYS``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from .errors import parse_error
from .model import Gpu as GpuModel
from .model import (
    Nic,
    NumaNode,
    P2PStatus,
    Topology,
    class_rank,
    empty_p2p,
    infer_numa,
    infer_tree,
    is_nvlink,
)
from .text import body_lines

_DEVICE = re.compile(r"^(GPU|NIC)(\d+)$")
_CLASS_ALIASES = {"SOC": "SYS"}
# nvmlGpuP2PStatus_t letters as printed by `nvidia-smi topo -p2p`.
# GNS ("GPU not supported") is what stock drivers report for GeForce boards whose hardware
# does P2P fine (patched open modules flip the same boards to OK), so it is a driver policy:
# DISABLED. DR is the regkey switch: DISABLED. CNS/TNS/NS are the chipset, the topology or
# the hardware: UNSUPPORTED.
P2P_LETTERS = {
    "OK": P2PStatus.SUPPORTED,
    "CNS": P2PStatus.UNSUPPORTED,
    "GNS": P2PStatus.DISABLED,
    "TNS": P2PStatus.UNSUPPORTED,
    "NS": P2PStatus.UNSUPPORTED,
    "DR": P2PStatus.DISABLED,
    "U": P2PStatus.UNKNOWN,
}


@dataclass
class _Matrix:
    kind: str  # "class" or "p2p"
    columns: list[str]  # device column names
    rows: dict[str, list[str]] = field(default_factory=dict)
    tail: dict[str, dict[str, str]] = field(default_factory=dict)  # row -> {column: value}
    lines: dict[str, int] = field(default_factory=dict)


def _split(line: str, mode: str) -> list[str]:
    if mode == "md":
        return [c.strip() for c in line.split("|")]
    if mode == "tab":
        return [c.strip() for c in line.split("\t")]
    return [c for c in re.split(r"\s{2,}", line.strip()) if c]


def _is_header(line: str) -> bool:
    if "GPU0" not in line:
        return False
    first = line.strip().split()[0].strip("|")
    return first in ("", "GPU0") and not re.match(r"^\s*GPU0\s*[|\t ]\s*X\b", line)


def _header(line: str) -> tuple[str, list[str], list[str]]:
    mode = "md" if "|" in line else "tab" if "\t" in line else "space"
    cells = _split(line, mode)
    if mode != "space" and cells and cells[0] == "":
        cells = cells[1:]
    cells = [c for c in cells if c != ""] if mode != "space" else cells
    devices = [c for c in cells if _DEVICE.match(c)]
    tail = [c for c in cells if not _DEVICE.match(c)]
    return mode, devices, tail


def _parse_matrices(text: str, source: str) -> tuple[list[_Matrix], dict[int, str]]:
    matrices: list[_Matrix] = []
    nic_names: dict[int, str] = {}
    lines = body_lines(text)
    i = 0
    while i < len(lines):
        lineno, line = lines[i]
        m = re.match(r"^\s*NIC(\d+):\s*(\S+)\s*$", line)
        if m:
            nic_names[int(m.group(1))] = m.group(2)
        if not _is_header(line):
            i += 1
            continue
        mode, devices, tail = _header(line)
        mat = _Matrix(kind="", columns=devices)
        i += 1
        while i < len(lines):
            lineno, line = lines[i]
            if mode == "md" and re.fullmatch(r"[\s\-|:]+", line):
                i += 1
                continue
            cells = _split(line, mode)
            if mode == "tab" and cells and cells[0] == "":
                cells = cells[1:]
            if mode == "md" and cells and cells[0] == "":
                cells = cells[1:]
            if not cells or not _DEVICE.match(cells[0]):
                break
            label = cells[0]
            if mode == "space":
                tokens = list(re.finditer(r"\S+", line))
                values = [t.group() for t in tokens[1 : 1 + len(devices)]]
                rest = [t.group() for t in tokens[1 + len(devices) :]]
            else:
                values = cells[1 : 1 + len(devices)]
                rest = cells[1 + len(devices) :]
            if len(values) != len(devices) and label.startswith("GPU"):
                raise parse_error(
                    source,
                    lineno,
                    f"row {label} has {len(values)} cells, expected {len(devices)} "
                    f"(one per column {' '.join(devices)})",
                )
            if label in mat.rows:
                raise parse_error(source, lineno, f"row {label} appears twice")
            mat.rows[label] = [v.strip() for v in values]
            mat.lines[label] = lineno
            row_tail: dict[str, str] = {}
            if tail and mode == "space":
                # Space-aligned dumps are often tab-expanded copies, so an empty CPU Affinity
                # cell (cgroup-restricted job) leaves no trace but blank space: when a cell is
                # missing and the first one is not a CPU list, it is the CPU Affinity.
                names = list(tail)
                if (len(rest) < len(names) and "CPU Affinity" in names) and (
                    not rest or not re.search(r"[-,]", rest[0])
                ):
                    names.remove("CPU Affinity")
                # Extra trailing cells (nvidia-smi's empty field before GPU NUMA ID) are
                # ignored: zip stops at the shorter list on purpose.
                row_tail = dict(zip(names, rest, strict=False))
            elif tail:
                row_tail = dict(zip(tail, rest, strict=False))
            else:
                m2 = re.search(r"\bNUMA\s+(\d+)\s*$", " ".join(rest))
                if m2:  # author-added trailing "NUMA n" column without a header
                    row_tail["NUMA Affinity"] = m2.group(1)
            mat.tail[label] = row_tail
            i += 1
        gpu_cells = [v for r, vs in mat.rows.items() if r.startswith("GPU") for v in vs]
        mat.kind = (
            "p2p" if gpu_cells and all(v in P2P_LETTERS or v == "X" for v in gpu_cells) else "class"
        )
        matrices.append(mat)
    return matrices, nic_names


def _class_cell(value: str, source: str, line: int, row: str, col: str) -> str:
    v = _CLASS_ALIASES.get(value, value)
    if v == "X":
        return v
    try:
        class_rank(v)
    except ValueError:
        raise parse_error(
            source,
            line,
            f"{row}/{col}: {value!r} is not a path class; expected X, NV<n>, PIX, PXB, PHB, "
            "NODE, SYS (or the old SOC)",
        ) from None
    return v


def _numa_value(value: str, source: str, line: int, row: str) -> int | None:
    if value in ("", "N/A"):
        return None
    m = re.fullmatch(r"(\d+)(?:[-,]\d+)*", value)
    if not m:
        raise parse_error(
            source, line, f"{row}: NUMA Affinity {value!r}: expected a node number or N/A"
        )
    return int(m.group(1))


def _gpu_labels(mat: _Matrix, source: str) -> list[str]:
    labels = [r for r in mat.rows if r.startswith("GPU")]
    for k, label in enumerate(labels):
        if label != f"GPU{k}":
            raise parse_error(
                source, mat.lines[label], f"row {label} out of order, expected GPU{k}"
            )
    return labels


def parse_p2p_matrix(text: str, source: str = "<text>") -> list[list[P2PStatus]]:
    """The status matrix of an ``nvidia-smi topo -p2p`` block (the first one in `text`)."""
    matrices, _ = _parse_matrices(text, source)
    for mat in matrices:
        if mat.kind == "p2p":
            return _p2p_rows(mat, source)
    raise parse_error(
        source, None, "no `nvidia-smi topo -p2p` matrix found (rows of OK/CNS/GNS/TNS/NS/DR/U)"
    )


def _p2p_rows(mat: _Matrix, source: str) -> list[list[P2PStatus]]:
    labels = _gpu_labels(mat, source)
    n = len(labels)
    out = []
    for i, label in enumerate(labels):
        row = []
        for j in range(n):
            v = mat.rows[label][mat.columns.index(f"GPU{j}")]
            row.append(P2PStatus.UNKNOWN if i == j else P2P_LETTERS[v])
        out.append(row)
    return out


def parse_topo(text: str, source: str = "<text>") -> Topology:
    """A Topology from ``nvidia-smi topo -m`` text, plus the P2P status of a following
    ``topo -p2p`` block when the text has one (else every pair is UNKNOWN)."""
    matrices, nic_names = _parse_matrices(text, source)
    classes_m = [m for m in matrices if m.kind == "class"]
    if not classes_m:
        raise parse_error(
            source,
            None,
            "no `nvidia-smi topo -m` matrix found: expected a header line naming GPU0.. and "
            "one row per GPU",
        )
    mat = classes_m[0]
    labels = _gpu_labels(mat, source)
    n = len(labels)
    if n == 0:
        raise parse_error(source, None, "the topo -m matrix has no GPU rows")
    notes: list[str] = []
    missing = [c for c in mat.columns if c.startswith("GPU") and c not in mat.rows]
    if missing:
        notes.append(
            f"rows for {', '.join(missing)} are missing in the source; kept GPU0..GPU{n - 1}"
        )
    classes = [
        [
            _class_cell(
                mat.rows[lab][mat.columns.index(f"GPU{j}")], source, mat.lines[lab], lab, f"GPU{j}"
            )
            for j in range(n)
        ]
        for lab in labels
    ]
    for i in range(n):
        if classes[i][i] != "X":
            raise parse_error(source, mat.lines[labels[i]], f"GPU{i}/GPU{i}: expected X")

    numa: list[int | None] = []
    cpus: list[str | None] = []
    for lab in labels:
        t = mat.tail.get(lab, {})
        numa.append(_numa_value(t.get("NUMA Affinity", ""), source, mat.lines[lab], lab))
        cpus.append(t.get("CPU Affinity") or None)
    numa_final = _fill_numa(classes, numa, cpus, notes)

    nic_cols = [c for c in mat.columns if c.startswith("NIC")]
    nic_classes = tuple(
        tuple(
            _class_cell(
                mat.rows[labels[g]][mat.columns.index(c)],
                source,
                mat.lines[labels[g]],
                labels[g],
                c,
            )
            for g in range(n)
        )
        for c in nic_cols
    )
    nics = []
    for k, c in enumerate(nic_cols):
        near = [g for g in range(n) if class_rank(nic_classes[k][g]) <= class_rank("NODE")]
        nics.append(
            Nic(
                index=int(c[3:]),
                name=nic_names.get(int(c[3:])),
                numa_node=numa_final[near[0]] if near else None,
            )
        )

    parent, ports, switches = infer_tree(classes, numa_final)
    gpus = tuple(GpuModel(index=i, numa_node=numa_final[i], parent=parent[i]) for i in range(n))
    nodes = tuple(
        NumaNode(
            id=node,
            socket=node,
            cpus=next((cpus[g] for g in range(n) if numa_final[g] == node and cpus[g]), None),
        )
        for node in sorted(set(numa_final))
    )
    p2p = empty_p2p(n)
    p2p_m = [m for m in matrices if m.kind == "p2p"]
    if p2p_m:
        rows = _p2p_rows(p2p_m[0], source)
        if len(rows) != n:
            raise parse_error(
                source, None, f"the topo -p2p matrix has {len(rows)} GPUs, topo -m has {n}"
            )
        p2p = tuple(tuple(r) for r in rows)
    topo = Topology(
        gpus=gpus,
        classes=tuple(tuple(r) for r in classes),
        p2p=p2p,
        switches=switches,
        root_ports=ports,
        numa_nodes=nodes,
        nics=tuple(nics),
        nic_classes=nic_classes,
        source=source,
        notes=(),
    )
    odd = [
        f"GPU{i}-GPU{j} {classes[i][j]} (tree: {topo.tree_class(i, j)})"
        for i in range(n)
        for j in range(i + 1, n)
        if not is_nvlink(classes[i][j]) and classes[i][j] != topo.tree_class(i, j)
    ]
    if odd:
        more = f" and {len(odd) - 3} more" if len(odd) > 3 else ""
        notes.append(
            f"{len(odd)} published classes do not fit one PCIe tree with these NUMA nodes "
            f"({', '.join(odd[:3])}{more}); the published classes are kept"
        )
    notes.append("sockets are not shown by topo -m: each NUMA node is taken as its own socket")
    return dataclasses.replace(topo, notes=tuple(notes))


def _fill_numa(
    classes: list[list[str]], numa: list[int | None], cpus: list[str | None], notes: list[str]
) -> list[int]:
    n = len(classes)
    if all(x is not None for x in numa):
        return [int(x) for x in numa]  # type: ignore[arg-type]
    if all(x is None for x in numa) and all(c is not None for c in cpus):
        # Old format: only CPU Affinity. GPUs with the same CPU set share a node; nodes are
        # numbered by their lowest CPU, which is how the kernel numbers them.
        def first_cpu(s: str) -> int:
            return int(re.match(r"\d+", s).group()) if re.match(r"\d+", s) else 0  # type: ignore[union-attr]

        sets = sorted(set(cpus), key=lambda s: first_cpu(s or ""))  # type: ignore[arg-type]
        notes.append("no NUMA Affinity column: nodes inferred from identical CPU Affinity sets")
        return [sets.index(c) for c in cpus]
    inferred = infer_numa(classes)
    if all(x is None for x in numa):
        notes.append("no NUMA affinity in the source: nodes inferred from SYS boundaries")
        return inferred
    out = list(numa)
    for g in range(n):
        if out[g] is None:
            peers = [h for h in range(n) if inferred[h] == inferred[g] and numa[h] is not None]
            out[g] = numa[peers[0]] if peers else max(x for x in numa if x is not None) + 1
            notes.append(f"GPU{g}: NUMA Affinity N/A, taken as node {out[g]}")
    return [int(x) for x in out]  # type: ignore[arg-type]
