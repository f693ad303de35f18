"""Measured per-pair numbers that replace the planner's table.

A probe holds, per ordered GPU pair, what was measured for direct P2P and for host-staged
copies: bandwidth per direction *with both directions busy* (the all-to-all case; half of a
bidirectional figure, or the unidirectional figure when that is all there is) and latency.

Sources: our JSON (``pcie_a2a.probe`` version 1), CUDA samples'
``p2pBandwidthLatencyTest`` output and the author tables derived from it (heading lines
with P2P=Enabled/Disabled, ``D\\D`` / ``GPU`` / ``Src->`` / ``Dst->`` column headers, ``-``
or an em dash on the diagonal, truncated rows), and a live measurement with torch when
GPUs are present (:func:`measure`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import parse_error
from .text import body_lines

FORMAT = "pcie_a2a.probe"
VERSION = 1
_DASHES = {"-", "\u2014", "\u2013", "--"}


@dataclass(frozen=True)
class PairMeasurement:
    p2p_gbps: float | None = None
    p2p_us: float | None = None
    staged_gbps: float | None = None
    staged_us: float | None = None
    p2p_possible: bool | None = None  # the "P2P Connectivity Matrix" (cudaDeviceCanAccessPeer)


@dataclass(frozen=True)
class Probe:
    pairs: dict[tuple[int, int], PairMeasurement] = field(default_factory=dict)
    source: str = ""

    def get(self, src: int, dst: int) -> PairMeasurement | None:
        return self.pairs.get((src, dst))

    def to_json(self) -> str:
        rows = [
            {"src": s, "dst": d, **{k: v for k, v in m.__dict__.items() if v is not None}}
            for (s, d), m in sorted(self.pairs.items())
        ]
        return (
            json.dumps(
                {"format": FORMAT, "version": VERSION, "source": self.source, "pairs": rows},
                indent=1,
            )
            + "\n"
        )

    @staticmethod
    def from_json(text: str, source: str = "<json>") -> Probe:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise parse_error(
                source, exc.lineno, f"invalid JSON ({exc.msg}); expected a {FORMAT} document"
            ) from None
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != VERSION:
            raise parse_error(source, None, f"expected format={FORMAT!r} version={VERSION}")
        pairs = {}
        for k, row in enumerate(d.get("pairs", [])):
            try:
                row = dict(row)
                key = (int(row.pop("src")), int(row.pop("dst")))
                pairs[key] = PairMeasurement(**row)
            except (KeyError, TypeError, ValueError) as exc:
                raise parse_error(
                    source, None, f"pairs[{k}]: {exc}; expected src, dst and measurement fields"
                ) from None
        return Probe(pairs=pairs, source=d.get("source", source))


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


def parse_p2p_test(text: str, source: str = "<text>") -> Probe:
    """Measurements from p2pBandwidthLatencyTest output (or author tables of it)."""
    blocks: list[_Block] = []
    heading, heading_line = "", 0
    current: _Block | None = None
    for lineno, line in body_lines(text):
        toks = line.replace("\t", " ").split()
        if not toks:
            current = None
            continue
        head = re.match(
            r"^\s*(D\\D|GPU|CPU|Src->|Dst->)\s+((?:GPU\s*)?\d+(?:\s+(?:GPU\s*)?\d+)*)\s*$",
            line.replace("\t", " "),
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
        row = re.match(r"^\s*(?:GPU\s*)?(\d+):?\s+(.*)$", line.replace("\t", " "))
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


def load_probe(path: str) -> Probe:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("{"):
        return Probe.from_json(text, path)
    return parse_p2p_test(text, path)


class ProbeUnavailable(RuntimeError):
    """Measuring needs CUDA GPUs; raised instead of inventing numbers."""


def measure(nbytes: int = 64 << 20, iters: int = 5) -> Probe:  # pragma: no cover - needs GPUs
    """Measure every ordered pair with torch: a device-to-device copy (P2P when the driver
    allows it) and a copy staged through pinned host memory. Needs at least two GPUs."""
    try:
        import torch
    except ImportError:
        raise ProbeUnavailable("--probe needs torch with CUDA; torch is not installed") from None
    if not torch.cuda.is_available():
        raise ProbeUnavailable(
            "--probe needs CUDA GPUs and none is visible (torch.cuda.is_available() is False)"
        )
    n = torch.cuda.device_count()
    if n < 2:
        raise ProbeUnavailable(f"--probe needs at least 2 GPUs, this machine shows {n}")

    def timed(fn, dev: int) -> float:
        fn()
        torch.cuda.synchronize(dev)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(dev):
            start.record()
            for _ in range(iters):
                fn()
            stop.record()
        torch.cuda.synchronize(dev)
        return start.elapsed_time(stop) / iters * 1e-3

    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
    small = [torch.empty(4, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_small = torch.empty(4, dtype=torch.uint8, pin_memory=True)
    pairs = {}
    for s in range(n):
        for d in range(n):
            if s == d:
                continue
            ok = torch.cuda.can_device_access_peer(s, d)
            p2p_t = timed(lambda s=s, d=d: bufs[d].copy_(bufs[s], non_blocking=True), s)
            p2p_lat = timed(lambda s=s, d=d: small[d].copy_(small[s], non_blocking=True), s)

            def staged(s=s, d=d, big=True):
                src, dst, h = (bufs[s], bufs[d], host) if big else (small[s], small[d], host_small)
                h.copy_(src, non_blocking=True)
                torch.cuda.synchronize(s)
                dst.copy_(h, non_blocking=True)

            st_t = timed(staged, d)
            st_lat = timed(lambda: staged(big=False), d)
            pairs[(s, d)] = PairMeasurement(
                p2p_gbps=nbytes / p2p_t / 1e9 if ok else None,
                p2p_us=p2p_lat * 1e6 if ok else None,
                staged_gbps=nbytes / st_t / 1e9,
                staged_us=st_lat * 1e6,
                p2p_possible=ok,
            )
    return Probe(pairs=pairs, source="measured (unidirectional, one pair at a time)")
