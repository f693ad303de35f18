"""Parsers for ``nvidia-smi topo -m`` and ``nvidia-smi topo -p2p r|w|n|a|p`` text.

Accepted layouts, all seen in published dumps (kept as topology fixtures):
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
from .model import (
    UNKNOWN_CLASS,
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
from .model import Gpu as GpuModel
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


# Multi-word column names of topo -m's tail, kept whole when blanks are collapsed.
_TAIL_NAMES = re.compile(r"CPU\s+Affinity|NUMA\s+Affinity|GPU\s+NUMA\s+ID|\S+")
MISSING = ("", "N/A", "n/a", "NA", "-")  # a cell that says nothing (cut off, N/A, blank)


def _pipe_cells(line: str) -> list[str]:
    """Cells of a line with table pipes; the empty cells before a leading and after a
    trailing pipe are not cells."""
    cells = [c.strip() for c in line.split("|")]
    if cells and cells[0] == "":
        cells = cells[1:]
    if cells and cells[-1] == "":
        cells = cells[:-1]
    return cells


def _is_header(line: str) -> bool:
    if "GPU0" not in line:
        return False
    first = line.replace("|", " ").split()[0]
    return first == "GPU0" and not re.match(r"^[\s|]*GPU0[\s|]+X\b", line)


def _header_tokens(cell: str) -> list[str]:
    if "\t" in cell:
        return [c.strip() for c in cell.split("\t")]
    return [re.sub(r"\s+", " ", m.group()) for m in _TAIL_NAMES.finditer(cell)]


def _header(line: str) -> tuple[str, list[str], list[str]]:
    """(mode, device columns, tail columns). The mode says how the rows are laid out: ``md``
    (pipes), ``tab`` (nvidia-smi's own output) or ``space`` (aligned, or collapsed blanks,
    as pasted into chats)."""
    if "|" in line:
        # A piped cell may hold several columns (pipes around a tab or blank aligned line)
        mode, cells = "md", [t for c in _pipe_cells(line) for t in _header_tokens(c) if t]
    elif "\t" in line:
        mode, cells = "tab", [c.strip() for c in line.split("\t") if c.strip()]
    else:
        mode = "space"
        cells = [re.sub(r"\s+", " ", m.group()) for m in _TAIL_NAMES.finditer(line)]
    devices = [c for c in cells if _DEVICE.match(c)]
    tail = [c for c in cells if not _DEVICE.match(c)]
    return mode, devices, tail


def _row(line: str, mode: str, ndev: int) -> tuple[str, list[str], list[str], bool]:
    """(label, class cells, the cells after them, whether those are positional). A row is
    read by its own layout (pasted tables mix piped and plain lines); a row cut off short
    gives fewer class cells."""
    if "|" in line:
        cells = _pipe_cells(line)
        blanks = any(re.search(r"\s", c.strip()) for c in cells)
        if cells and not (blanks and len(cells) < 1 + ndev):
            return cells[0], cells[1 : 1 + ndev], cells[1 + ndev :], True
        # Pipes around (or inside) a tab or blank aligned row: read it without them.
        line = line.replace("|", " ")
    if mode == "tab" and "\t" in line:
        cells = [c.strip() for c in line.split("\t")]
        if cells and cells[0] == "":
            cells = cells[1:]
        if cells and cells[-1] == "" and len(cells) > 1 + ndev:
            cells = cells[:-1]
        return (cells[0] if cells else ""), cells[1 : 1 + ndev], cells[1 + ndev :], True
    tokens = line.replace("|", " ").split()
    return (tokens[0] if tokens else ""), tokens[1 : 1 + ndev], tokens[1 + ndev :], False


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
            if "|" in line and re.fullmatch(r"[\s\-|:]+", line):
                i += 1  # markdown separator row
                continue
            label, values, rest, positional = _row(line, mode, len(devices))
            if not _DEVICE.match(label):
                break
            if label in mat.rows:
                raise parse_error(source, lineno, f"row {label} appears twice")
            mat.rows[label] = [v.strip() for v in values]
            mat.lines[label] = lineno
            row_tail: dict[str, str] = {}
            if tail and not positional:
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
        gpu_cells = [
            v for r, vs in mat.rows.items() if r.startswith("GPU") for v in vs if v not in MISSING
        ]
        mat.kind = (
            "p2p" if gpu_cells and all(v in P2P_LETTERS or v == "X" for v in gpu_cells) else "class"
        )
        matrices.append(mat)
    return matrices, nic_names


def _cell(mat: _Matrix, row: str, col: str) -> str | None:
    """The cell at (row, col), else its mirror (col, row) when that row has it (classes and
    P2P status are symmetric in topo output), else None."""
    for r, c in ((row, col), (col, row)):
        vals = mat.rows.get(r)
        if vals is not None and c in mat.columns:
            k = mat.columns.index(c)
            if k < len(vals) and vals[k] not in MISSING:
                return vals[k]
    return None


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
    for i in range(n):
        row = []
        for j in range(n):
            v = _cell(mat, f"GPU{i}", f"GPU{j}")
            row.append(P2PStatus.UNKNOWN if i == j or v is None else P2P_LETTERS[v])
        out.append(row)
    return out


def _cut_rows_note(mat: _Matrix, labels: list[str], notes: list[str]) -> None:
    ncols = len(mat.columns)
    cut = [lab for lab in labels if len(mat.rows[lab]) < ncols]
    if cut:
        shown = ", ".join(f"{lab} ({len(mat.rows[lab])} of {ncols})" for lab in cut[:4])
        more = f" and {len(cut) - 4} more" if len(cut) > 4 else ""
        notes.append(
            f"rows cut off: {shown}{more} cells; the rest taken from the other rows "
            "(topo classes are symmetric)"
        )


def _classes(mat: _Matrix, labels: list[str], source: str, notes: list[str]) -> list[list[str]]:
    """The class matrix; a cell missing on both sides (cut off, N/A) is ? (unknown)."""
    n = len(labels)
    out = [["X"] * n for _ in range(n)]
    unknown = []
    for i in range(n):
        for j in range(n):
            v = _cell(mat, f"GPU{i}", f"GPU{j}")
            if v is None:
                if i != j:
                    unknown.append(f"GPU{i}/GPU{j}")
                    out[i][j] = UNKNOWN_CLASS
                continue
            out[i][j] = _class_cell(v, source, mat.lines[labels[i]], labels[i], f"GPU{j}")
        if out[i][i] != "X":
            raise parse_error(source, mat.lines[labels[i]], f"GPU{i}/GPU{i}: expected X")
    if unknown:
        more = f" and {len(unknown) - 6} more" if len(unknown) > 6 else ""
        notes.append(
            f"no class for {', '.join(unknown[:6])}{more} (cut off or N/A on both sides): "
            "path class ? (unknown)"
        )
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
    _cut_rows_note(mat, labels, notes)
    classes = _classes(mat, labels, source, notes)

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
            UNKNOWN_CLASS
            if (v := _cell(mat, labels[g], c)) is None
            else _class_cell(v, source, mat.lines[labels[g]], labels[g], c)
            for g in range(n)
        )
        for c in nic_cols
    )
    nics = []
    for k, c in enumerate(nic_cols):
        near = [
            g
            for g in range(n)
            if nic_classes[k][g] != UNKNOWN_CLASS
            and class_rank(nic_classes[k][g]) <= class_rank("NODE")
        ]
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
        if not is_nvlink(classes[i][j])
        and classes[i][j] != UNKNOWN_CLASS
        and classes[i][j] != topo.tree_class(i, j)
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
