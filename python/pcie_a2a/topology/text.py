"""Line handling shared by the text parsers."""

from __future__ import annotations


def body_lines(text: str) -> list[tuple[int, str]]:
    """(1-based line number, line) for every line after the leading run of ``# `` header
    lines (our fixture convention); later lines starting with ``#`` are kept, since the
    body itself may contain them (nccl-tests output)."""
    lines = text.splitlines()
    start = 0
    while start < len(lines) and (lines[start].startswith("# ") or lines[start] == "#"):
        start += 1
    return [(i + 1, lines[i].rstrip("\r")) for i in range(start, len(lines))]
