"""Measured per-pair numbers that replace the planner's table: the probe record.

A :class:`Probe` holds, per ordered GPU pair (:class:`PairMeasurement`), what was measured,
and the concurrent patterns (:class:`PatternMeasurement`). Bandwidths are GB/s (1e9 B/s) per
direction *with both directions of the pair busy* (the all-to-all case; half of a
bidirectional figure); latencies are microseconds, one way.

Per pair (fields that a source does not give stay None):

* ``store_gbps`` / ``store_us``: kernel-issued stores by the sender into the receiver's
  memory (push), and the one-way latency of a flag written that way (ping-pong / 2);
* ``load_gbps`` / ``load_us``: kernel-issued loads by the receiver from the sender's memory
  (pull), and one dependent load's round trip;
* ``ce_gbps`` / ``ce_us``: the copy engine, stream on the sender (``cudaMemcpyPeerAsync``);
  ``ce_read_gbps``: the same with the stream on the receiver;
* ``staged_gbps`` / ``staged_us``: through pinned host memory on the receiver's NUMA node,
  sender's copy engine then receiver's (the two legs one after the other, as the transport
  runs them);
* ``a2a_store_gbps`` / ``a2a_load_gbps``: this pair's rate inside the full all-to-all
  (every GPU storing to, or loading from, every other at once);
* ``p2p_gbps`` / ``p2p_us``: direct P2P as p2pBandwidthLatencyTest reports it (copy engine
  writes); for our own records, the best push figure;
* ``p2p_possible``: cudaDeviceCanAccessPeer.

Sources: our JSON (``pcie_a2a.probe``: version 1, pairs only; version 2, written by
``pcie-a2a probe``, adds the patterns, the raw samples they were derived from, the
machine's identity and fingerprint, the plan's decisions and the diagnosis) and
p2pBandwidthLatencyTest output (:mod:`.p2p_bandwidth`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .errors import TopologyError, parse_error
from .model import normalise_bus_id

FORMAT = "pcie_a2a.probe"
VERSION = 2
READABLE_VERSIONS = (1, 2)
MODES = ("store", "load", "ce", "ce_read", "staged")  # how a flow moves its bytes


def switch_pattern_name(switch: str, roots: int, mode: str) -> str:
    """The name of the pattern in which the GPUs below `switch` move to GPUs behind
    `roots` root complexes at once."""
    return f"switch {switch} to {roots} root complex{'es' if roots != 1 else ''} {mode}"


@dataclass(frozen=True)
class PairMeasurement:
    p2p_gbps: float | None = None
    p2p_us: float | None = None
    staged_gbps: float | None = None
    staged_us: float | None = None
    p2p_possible: bool | None = None  # cudaDeviceCanAccessPeer
    store_gbps: float | None = None
    store_us: float | None = None
    load_gbps: float | None = None
    load_us: float | None = None
    ce_gbps: float | None = None
    ce_us: float | None = None
    ce_read_gbps: float | None = None
    a2a_store_gbps: float | None = None
    a2a_load_gbps: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class PatternMeasurement:
    """A set of flows run at once. ``kind``: ``all_to_all``, ``switch_roots`` (the GPUs
    behind one switch writing to (reading from) GPUs behind ``roots`` root complexes),
    ``socket`` (all-to-all inside one socket) or ``cross_socket`` (every pair across)."""

    name: str
    kind: str
    mode: str  # one of MODES
    flows: tuple[tuple[int, int], ...]
    flow_gbps: tuple[float, ...]  # per flow, same order
    aggregate_gbps: float  # all bytes over the time the slowest flow took
    switch: str | None = None
    roots: int | None = None
    socket: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["flows"] = [list(f) for f in self.flows]
        d["flow_gbps"] = list(self.flow_gbps)
        return {k: v for k, v in d.items() if v is not None}


@dataclass(frozen=True)
class GpuIdentity:
    index: int  # the device index in the probing process
    bus_id: str | None = None
    uuid: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class Probe:
    pairs: dict[tuple[int, int], PairMeasurement] = field(default_factory=dict)
    source: str = ""
    patterns: tuple[PatternMeasurement, ...] = ()
    gpus: tuple[GpuIdentity, ...] = ()
    driver: str | None = None
    fingerprint: str | None = None
    samples: dict[str, Any] | None = None  # raw samples (JSON), see calibration.derive
    settings: dict[str, Any] | None = None
    decisions: dict[str, Any] | None = None  # planner.decisions_dict of the plan made with it
    diagnosis: tuple[str, ...] = ()
    elapsed_s: float | None = None
    topology: dict[str, Any] | None = None  # the machine's topology JSON, to plan offline

    def get(self, src: int, dst: int) -> PairMeasurement | None:
        return self.pairs.get((src, dst))

    def pattern(self, name: str) -> PatternMeasurement | None:
        return next((p for p in self.patterns if p.name == name), None)

    def pattern_rate(self, name: str, src: int, dst: int) -> float | None:
        """The rate of flow src->dst inside pattern `name`, None when not measured."""
        p = self.pattern(name)
        if p is None:
            return None
        for f, r in zip(p.flows, p.flow_gbps, strict=True):
            if f == (src, dst):
                return r
        return None

    # ---- JSON -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format": FORMAT, "version": VERSION, "source": self.source}
        if self.fingerprint is not None or self.gpus or self.driver is not None:
            d["machine"] = {
                "fingerprint": self.fingerprint,
                "driver": self.driver,
                "gpus": [dataclasses.asdict(g) for g in self.gpus],
            }
        if self.settings is not None:
            d["settings"] = self.settings
        if self.elapsed_s is not None:
            d["elapsed_s"] = round(self.elapsed_s, 3)
        d["pairs"] = [
            {"src": s, "dst": t, **m.to_dict()} for (s, t), m in sorted(self.pairs.items())
        ]
        d["patterns"] = [p.to_dict() for p in self.patterns]
        if self.decisions is not None:
            d["decisions"] = self.decisions
        d["diagnosis"] = list(self.diagnosis)
        if self.topology is not None:
            d["topology"] = self.topology
        if self.samples is not None:
            d["samples"] = self.samples
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @staticmethod
    def from_json(text: str, source: str = "<json>") -> Probe:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise parse_error(
                source, exc.lineno, f"invalid JSON ({exc.msg}); expected a {FORMAT} document"
            ) from None
        return Probe.from_dict(d, source)

    @staticmethod
    def from_dict(d: Any, source: str = "<json>") -> Probe:
        if (
            not isinstance(d, dict)
            or d.get("format") != FORMAT
            or d.get("version") not in READABLE_VERSIONS
        ):
            got = (d.get("format"), d.get("version")) if isinstance(d, dict) else type(d).__name__
            raise parse_error(
                source, None, f"got {got!r}; expected format={FORMAT!r} version 1 or 2"
            )
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
        patterns = []
        for k, row in enumerate(d.get("patterns", [])):
            try:
                row = dict(row)
                row["flows"] = tuple((int(a), int(b)) for a, b in row["flows"])
                row["flow_gbps"] = tuple(float(x) for x in row["flow_gbps"])
                if len(row["flows"]) != len(row["flow_gbps"]):
                    raise ValueError("flows and flow_gbps differ in length")
                if row["mode"] not in MODES:
                    raise ValueError(f"mode {row['mode']!r} is not one of {MODES}")
                patterns.append(PatternMeasurement(**row))
            except (KeyError, TypeError, ValueError) as exc:
                raise parse_error(
                    source,
                    None,
                    f"patterns[{k}]: {exc}; expected name, kind, mode, flows, "
                    "flow_gbps and aggregate_gbps",
                ) from None
        machine = d.get("machine") or {}
        try:
            gpus = tuple(GpuIdentity(**g) for g in machine.get("gpus", []))
        except TypeError as exc:
            raise parse_error(source, None, f"machine.gpus: {exc}") from None
        return Probe(
            pairs=pairs,
            source=d.get("source", source),
            patterns=tuple(patterns),
            gpus=gpus,
            driver=machine.get("driver"),
            fingerprint=machine.get("fingerprint"),
            samples=d.get("samples"),
            settings=d.get("settings"),
            decisions=d.get("decisions"),
            diagnosis=tuple(d.get("diagnosis", ())),
            elapsed_s=d.get("elapsed_s"),
            topology=d.get("topology"),
        )

    # ---- matching the probing process's devices to a topology's GPUs ------------------
    def aligned_to(self, bus_ids: list[str | None]) -> Probe:
        """This probe with its device indices replaced by topology GPU indices (given the
        topology's bus ids, in GPU order). Matched by PCI bus id when both sides have
        them (the probing process saw CUDA's order, which CUDA_DEVICE_ORDER and
        CUDA_VISIBLE_DEVICES change); otherwise index i is GPU i. Raises TopologyError when
        the probe measured a GPU the topology does not have."""
        ids = [g.bus_id for g in self.gpus]
        if not self.gpus or None in ids or None in bus_ids:
            n = len(bus_ids)
            bad = sorted({i for key in self.pairs for i in key if i >= n})
            if bad:
                raise TopologyError(
                    f"{self.source}: measures GPU {bad[0]} but the topology has {n} GPUs"
                )
            return self
        where = {normalise_bus_id(b): k for k, b in enumerate(bus_ids) if b}
        mapping = {}
        for g in self.gpus:
            b = normalise_bus_id(g.bus_id or "")
            if b not in where:
                raise TopologyError(
                    f"{self.source}: probed GPU {g.index} ({g.bus_id}) is not in the topology "
                    f"({', '.join(sorted(where))})"
                )
            mapping[g.index] = where[b]
        if all(k == v for k, v in mapping.items()):
            return self

        def pair(k: tuple[int, int]) -> tuple[int, int]:
            return (mapping[k[0]], mapping[k[1]])

        return dataclasses.replace(
            self,
            pairs={pair(k): m for k, m in self.pairs.items()},
            patterns=tuple(
                dataclasses.replace(p, flows=tuple(pair(f) for f in p.flows)) for p in self.patterns
            ),
            gpus=tuple(dataclasses.replace(g, index=mapping[g.index]) for g in self.gpus),
        )


class ProbeUnavailable(RuntimeError):
    """Measuring needs CUDA GPUs (and the compiled probe); raised instead of inventing
    numbers."""


class ProbeGateError(RuntimeError):
    """The known-answer exchange returned a wrong byte: the message names the pair, the way
    the bytes moved, the first wrong offset and the values. No timing is run after it."""
