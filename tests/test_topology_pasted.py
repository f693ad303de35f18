"""``topo --from`` on matrices as people paste them into web pages and chat logs: every
``nvidia-smi topo -m`` fixture mangled (stray table pipes, markdown tables, collapsed blanks,
rows cut off, N/A cells and columns) must give the same path classes as the original."""

from __future__ import annotations

import re

import pytest

from pcie_a2a.topology import TopologyError, parse_topo
from topology_fixtures import FIXTURES

TOPO_FILES = sorted(p.name for p in FIXTURES.glob("*.topo*.txt"))
_ROW = re.compile(r"^\s*(GPU|NIC)\d+\b")


def split(text: str) -> tuple[list[str], list[str]]:
    lines = text.splitlines()
    k = 0
    while k < len(lines) and (lines[k].startswith("# ") or lines[k] == "#"):
        k += 1
    return lines[:k], lines[k:]


def matrix_line(line: str) -> bool:
    return bool(_ROW.match(line.replace("|", " "))) or "GPU0" in line


def stray_pipes(text: str) -> str:
    """Pipes around (some) matrix lines, as a forum's table markup leaves them."""
    head, body = split(text)
    out = [f"| {ln} |" if matrix_line(ln) and k % 3 else ln for k, ln in enumerate(body)]
    return "\n".join(head + out)


def markdown(text: str) -> str:
    """A markdown table with a separator row (tab-separated sources: the cells are exact)."""
    head, body = split(text)
    out = []
    for ln in body:
        if matrix_line(ln) and "\t" in ln:
            cells = ln.split("\t")
            out.append("| " + " | ".join(c.strip() for c in cells) + " |")
            if "GPU0" in ln and not _ROW.match(ln):
                out.append("|" + "---|" * len(cells))
        else:
            out.append(ln)
    return "\n".join(head + out)


def collapsed(text: str) -> str:
    """Every run of blanks and tabs one space (chat clients do it)."""
    head, body = split(text)
    return "\n".join(head + [re.sub(r"[ \t]+", " ", ln).strip() for ln in body])


def cut(text: str) -> str:
    """Row GPUi keeps only its cells up to the diagonal (the rest, and the affinity
    columns, cut off): the upper triangle survives only in the other rows."""
    head, body = split(text)
    out = []
    for ln in body:
        m = re.match(r"^[\s|]*GPU(\d+)\b", ln)
        if m and not re.match(r"^[\s|]*GPU0[\s|]+GPU1", ln):
            toks = ln.replace("|", " ").split()
            ln = " ".join(toks[: 2 + int(m.group(1))])
        out.append(ln)
    return "\n".join(head + out)


def na_cells(text: str) -> str:
    """N/A in place of upper-triangle class cells of GPU0's row (its mirror stays)."""
    head, body = split(text)
    out = []
    for ln in body:
        if re.match(r"^\s*GPU0\s", ln) and not re.match(r"^\s*GPU0\s+GPU1", ln):
            parts = re.split(r"(\s+)", ln.strip())
            cells = parts[::2]
            for k in range(3, min(len(cells), 6)):
                if re.fullmatch(r"PIX|PXB|PHB|NODE|SYS|NV\d+|SOC", cells[k]):
                    cells[k] = "N/A"
            parts[::2] = cells
            ln = "".join(parts)
        out.append(ln)
    return "\n".join(head + out)


MANGLERS = {
    "stray pipes": stray_pipes,
    "markdown": markdown,
    "collapsed": collapsed,
    "cut": cut,
    "n/a cells": na_cells,
    "pipes+collapsed+cut": lambda t: cut(collapsed(stray_pipes(t))),
}


@pytest.mark.parametrize("mangle", sorted(MANGLERS))
@pytest.mark.parametrize("name", TOPO_FILES)
def test_pasted_matrix_reads_as_the_original(name, mangle):
    text = (FIXTURES / name).read_text()
    ref = parse_topo(text, name)
    got = parse_topo(MANGLERS[mangle](text), name)
    assert got.classes == ref.classes
    assert got.p2p == ref.p2p
    if mangle in ("stray pipes", "markdown", "collapsed", "n/a cells"):
        assert [g.numa_node for g in got.gpus] == [g.numa_node for g in ref.gpus]
    if mangle == "cut" and ref.num_gpus > 2:
        assert any(n.startswith("rows cut off: GPU0 (1 of") for n in got.notes), got.notes


def test_collapsed_header_keeps_multi_word_columns():
    text = (
        "GPU0 GPU1 CPU Affinity NUMA Affinity GPU NUMA ID\n"
        "GPU0 X PIX 0-15 0 N/A\nGPU1 PIX X 16-31 1 N/A\n"
    )
    t = parse_topo(text, "chat")
    assert [g.numa_node for g in t.gpus] == [0, 1]
    assert t.numa_nodes[0].cpus == "0-15"


def test_cells_missing_on_both_sides_are_unknown_and_said():
    text = "\tGPU0\tGPU1\tGPU2\nGPU0\t X \tPIX\nGPU1\tPIX\t X \nGPU2\tSYS\tN/A\t X \n"
    t = parse_topo(text, "cut.txt")
    assert t.classes[0][2] == "SYS" and t.classes[1][2] == "?" == t.classes[2][1]
    assert any("no class for GPU1/GPU2, GPU2/GPU1" in n for n in t.notes)


def test_a_pasted_garbled_cell_still_names_file_line_and_cell():
    with pytest.raises(TopologyError, match=r"x.txt:4: GPU1/GPU0: 'PIZ' is not a path class"):
        parse_topo(
            "| | GPU0 | GPU1 |\n|---|---|---|\n| GPU0 | X | PIX |\n| GPU1 | PIZ | X |\n", "x.txt"
        )
