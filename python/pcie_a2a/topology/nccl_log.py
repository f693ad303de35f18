"""NCCL_DEBUG=INFO topology lines: the per-GPU path list NCCL computed.

``GPU/50000 :GPU/0-4e000 (4/24.0/PHB) ... CPU/0-0 (2/24.0/PHB)`` gives, per source GPU, each
target's hop count, bandwidth (GB/s) and path type. When P2P is off NCCL routes GPU pairs
through the receiver's CPU, so a same-switch pair shows PHB instead of PIX: comparing these
paths with ``topo -m`` reveals a driver that refuses P2P.
"""

from __future__ import annotations

import re

from .errors import parse_error
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
