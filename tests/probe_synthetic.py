"""A simulated machine for the probe (no GPU): a :class:`SyntheticBackend` that answers the
probe's questions from a box model, so :func:`pcie_a2a.topology.probe_run.run_probe` runs
end to end on the CPU (gate, pair timing, latency, patterns, budget) and can be fed faults.

The box model: per-pair rates by mode (GB/s per direction with both directions busy),
latencies, and link capacities; concurrent flows share links max-min fairly (water
filling), pushing flows from a switch into two or more root complexes get the switch's
collapsed capacity, and the patterns the field reports (``overrides``: all-to-all write /
read, a switch into k root complexes) are pinned to the reported aggregates. Times carry
a small seeded jitter so medians have something to do.

The known-answer gate really moves bytes (numpy) with the same pattern as
csrc/cuda/probe/pattern.h (:func:`gate_pattern`; the emulation test checks the two agree)
and compares them exactly; ``faults`` corrupts chosen transfers.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import random
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pcie_a2a.topology import roots
from pcie_a2a.topology.model import Topology
from pcie_a2a.topology.planner import TransferOptions, plan_transfers
from pcie_a2a.topology.probe import GpuIdentity

M32 = 0xFFFFFFFF


def gate_pattern(seed: int, nbytes: int) -> bytes:
    """The known-answer bytes of csrc/cuda/probe/pattern.h: word k of the buffer is a
    32-bit mix of (seed, k), little endian."""
    k = np.arange((nbytes + 3) // 4, dtype=np.uint64)
    x = (np.uint64(seed) ^ (k * np.uint64(0x9E3779B9))) & np.uint64(M32)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x85EBCA6B)) & np.uint64(M32)
    x ^= x >> np.uint64(13)
    x = (x * np.uint64(0xC2B2AE35)) & np.uint64(M32)
    x ^= x >> np.uint64(16)
    return x.astype("<u4").tobytes()[:nbytes]


@dataclass
class BoxModel:
    topo: Topology
    rates: dict[str, dict[tuple[int, int], float]]  # mode -> pair -> GB/s
    latency: dict[str, dict[tuple[int, int], float]]  # mode -> pair -> us
    capacity: dict[str, float]  # link id -> GB/s (both modes)
    read_capacity: dict[str, float] = field(default_factory=dict)  # link id -> GB/s for loads
    collapsed: dict[str, float] = field(default_factory=dict)  # switch -> uplink GB/s collapsed
    overrides: dict[tuple, float] = field(default_factory=dict)  # pattern key -> aggregate
    devices: tuple[GpuIdentity, ...] = ()
    driver: str = "580.95.05"
    p2p: bool = True


class SyntheticBackend:
    def __init__(self, box: BoxModel, seed: int = 0, faults: dict | None = None) -> None:
        self.box = box
        self.rng = random.Random(seed)
        self.faults = faults or {}  # (src, dst, mode) -> byte offset to corrupt
        self.now = 0.0
        self.calls: list[str] = []
        forced = plan_transfers(box.topo, options=TransferOptions(p2p=True, default_link_gen=5))
        self.links = {(q.src, q.dst): q.links for q in forced.pairs}

    # ---- the ProbeBackend protocol ---------------------------------------------------
    def devices(self) -> list[GpuIdentity]:
        return list(self.box.devices)

    def driver(self) -> str:
        return self.box.driver

    def can_access(self, src: int, dst: int) -> bool:
        return self.box.p2p

    def clock(self) -> float:
        return self.now

    def known_answer(self, src, dst, mode, nbytes, seed):
        self.calls.append(f"gate {src}->{dst} {mode}")
        sent = np.frombuffer(gate_pattern(seed, nbytes), dtype=np.uint8)
        got = sent.copy()
        if (src, dst, mode) in self.faults:
            got[self.faults[(src, dst, mode)]] ^= 0x40
        self.now += nbytes / (self.rate(src, dst, mode) * 1e9) + 20e-6
        bad = np.flatnonzero(got != sent)
        return None if bad.size == 0 else (int(bad[0]), int(got[bad[0]]), int(sent[bad[0]]))

    def known_answer_flows(self, flows, mode, nbytes, seed):
        return [self.known_answer(s, d, mode, nbytes, (seed + s) & M32) for s, d in flows]

    def latency_us(self, src, dst, mode, iters):
        self.calls.append(f"latency {src}->{dst} {mode}")
        us = float(f"{self.box.latency[mode][(src, dst)] * self._jitter():.5g}")
        self.now += iters * us * 1e-6
        return us

    def run_flows(self, flows: Sequence[tuple[int, int]], mode: str, nbytes: int) -> list[float]:
        self.calls.append(f"flows {len(flows)} {mode}")
        rates = self.flow_rates([tuple(f) for f in flows], mode)
        times = [float(f"{nbytes / (r * 1e9) * self._jitter():.6g}") for r in rates]
        self.now += max(times) + 50e-6
        return times

    # ---- the model -------------------------------------------------------------------
    def _jitter(self) -> float:
        return 1.0 + self.rng.uniform(-0.02, 0.02)

    def rate(self, a: int, b: int, mode: str) -> float:
        return self.box.rates[mode][(a, b)]

    def pattern_key(self, flows: list[tuple[int, int]], mode: str) -> tuple | None:
        n = self.box.topo.num_gpus
        if len(flows) == n * (n - 1):
            return ("all_to_all", mode)
        srcs = {a for a, _ in flows}
        for sw, below in roots.shared_switches(self.box.topo).items():
            if srcs == set(below) and len(flows) == len(below):
                k = len({roots.root_complex(self.box.topo, b) for _, b in flows})
                return ("switch", sw, k, mode)
        return None

    def flow_rates(self, flows: list[tuple[int, int]], mode: str) -> list[float]:
        key = self.pattern_key(flows, mode)
        if key in self.box.overrides:
            # Pinned to the reported aggregate (total bytes / slowest flow): every flow that
            # leaves its switch runs at aggregate / flows, the rest at their fair share.
            slow = self.box.overrides[key] / len(flows)
            fair = self._water_fill(flows, mode)
            topo = self.box.topo
            return [
                slow
                if roots.leaves_switch(topo, a, b) or topo.classes[a][b] == "SYS"
                else max(slow, r)
                for (a, b), r in zip(flows, fair, strict=True)
            ]
        return self._water_fill(flows, mode)

    def _capacity(self, lid: str, mode: str, collapsing: set[str]) -> float:
        sw = lid[:-1]
        if lid.endswith("^") and sw in collapsing:
            return self.box.collapsed[sw]
        if mode in ("load", "ce_read") and lid in self.box.read_capacity:
            return self.box.read_capacity[lid]
        return self.box.capacity.get(lid, 1e9)

    def _water_fill(self, flows: list[tuple[int, int]], mode: str) -> list[float]:
        topo = self.box.topo
        collapsing = set()
        if mode == "store":
            seen: dict[str, set] = {}
            for a, b in flows:
                sw = roots.trigger_switch(topo, a, b)
                if sw is not None:
                    seen.setdefault(sw, set()).add(roots.root_complex(topo, b))
            collapsing = {
                sw for sw, rcs in seen.items() if len(rcs) >= 2 and sw in self.box.collapsed
            }
        cap = {f: self.rate(*f, mode) for f in flows}
        links = {f: self.links[f] for f in flows}
        rate = dict.fromkeys(flows, 0.0)
        active = set(flows)
        left = {lid: self._capacity(lid, mode, collapsing) for f in flows for lid in links[f]}
        while active:
            # the largest equal increment every active flow can take
            inc = min(cap[f] - rate[f] for f in active)
            for lid, c in left.items():
                users = [f for f in active if lid in links[f]]
                if users:
                    inc = min(inc, c / len(users))
            for f in active:
                rate[f] += inc
                for lid in links[f]:
                    left[lid] -= inc
            done = {f for f in active if rate[f] >= cap[f] - 1e-9}
            done |= {f for f in active for lid in links[f] if left[lid] <= 1e-9}
            active -= done
        return [rate[f] for f in flows]


def with_bus_ids(topo: Topology, bus_ids: list[str]) -> Topology:
    return dataclasses.replace(
        topo,
        gpus=tuple(
            dataclasses.replace(g, bus_id=b) for g, b in zip(topo.gpus, bus_ids, strict=True)
        ),
    )


# ---- the fixture boxes ------------------------------------------------------------------
def _by_class(topo: Topology, table: dict[str, float]) -> dict[tuple[int, int], float]:
    n = topo.num_gpus
    return {(a, b): table[topo.classes[a][b]] for a in range(n) for b in range(n) if a != b}


def _links(topo: Topology, gpu: float, uplink: float, socket: float) -> dict[str, float]:
    cap = {}
    for g in range(topo.num_gpus):
        cap[f"GPU{g}^"] = cap[f"GPU{g}v"] = gpu
    for sw in topo.switches:
        cap[f"{sw.id}^"], cap[f"{sw.id}v"] = uplink, gpu  # posted writes up into the host
    for a in (0, 1):
        for b in (0, 1):
            cap[f"socket{a}->{b}"] = socket
    return cap


def _load_fixture(fixtures, name: str):
    """The fixture's topology, its source named relative to shared/ so that the committed
    records do not depend on where the checkout lives."""
    from pcie_a2a.topology import load

    return dataclasses.replace(load(fixtures / name), source=f"shared/fixtures/topology/{name}")


def broadcom_box(fixtures) -> BoxModel:
    """ASUS ESC8000A-E13P: 8x RTX PRO 6000, 2x EPYC 9575F, 4 partitioned Broadcom PEX890xx
    switches of 2 GPUs (shared/fixtures/topology/8x-rtxpro6000-dual-epyc9575f-broadcom-
    pex890xx.*). Pair rates: half the published bidirectional P2P (102-104 same socket,
    93-96 across) and its latencies (0.71-0.74, 1.27-1.36 us); loads a few percent below
    stores. Patterns: a switch writing into one root complex 36.8 GB/s, into two 2.7,
    reading 51.1; the 56-flow all-to-all writing 36.5, reading 53.9 (field_2026 s4).
    Kernel-issued and copy-engine rates agree (no driver staging on switch boxes)."""
    name = "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt"
    topo = roots.with_vendor_hints(_load_fixture(fixtures, name), cpu="amd", switch="broadcom")
    buses = ["0000:11:00.0", "0000:12:00.0", "0000:71:00.0", "0000:72:00.0",
             "0000:81:00.0", "0000:82:00.0", "0000:f1:00.0", "0000:f2:00.0"]  # fmt: skip
    topo = with_bus_ids(topo, buses)
    cls = {"PIX": 51.5, "NODE": 51.5, "SYS": 47.0}
    rates = {
        "store": _by_class(topo, cls),
        "load": _by_class(topo, {"PIX": 50.0, "NODE": 49.5, "SYS": 45.0}),
        "ce": _by_class(topo, {k: v + 0.5 for k, v in cls.items()}),
        "ce_read": _by_class(topo, {"PIX": 51.0, "NODE": 50.5, "SYS": 46.0}),
        "staged": _by_class(topo, {"PIX": 25.0, "NODE": 25.0, "SYS": 23.0}),
    }
    latency = {
        "store": _by_class(topo, {"PIX": 0.73, "NODE": 0.73, "SYS": 1.33}),
        "load": _by_class(topo, {"PIX": 1.9, "NODE": 1.9, "SYS": 3.1}),
        "ce": _by_class(topo, {"PIX": 8.0, "NODE": 8.0, "SYS": 8.6}),
        "staged": _by_class(topo, {"PIX": 14.0, "NODE": 14.0, "SYS": 14.4}),
    }
    cap = _links(topo, 53.0, 36.8, 50.0)
    return BoxModel(
        topo=topo,
        rates=rates,
        latency=latency,
        capacity=cap,
        read_capacity={f"{sw.id}^": 51.1 for sw in topo.switches},
        collapsed={sw.id: 2.7 for sw in topo.switches},
        overrides={("all_to_all", "store"): 36.5, ("all_to_all", "load"): 53.9},
        devices=tuple(
            GpuIdentity(
                index=i,
                bus_id=b,
                uuid=f"GPU-synthetic-broadcom-{i}",
                name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
            )
            for i, b in enumerate(buses)
        ),
    )


def direct_attach_box(fixtures) -> BoxModel:
    """Gigabyte G493-ZB0: 8x RTX PRO 6000, 2x EPYC 9124, every GPU on its own root port
    (8x-rtxpro6000-dual-epyc9124-direct.*), as the probe would see it with a driver that
    routes kernel-issued P2P through system memory (no ForceP2P module option;
    field_2026 s5: ~15x slower than the copy engine). Copy-engine rates: half the published
    bidirectional figures (112.3 same socket, 75-88 across); kernel stores/loads 1/15 of
    them; latencies through system memory."""
    topo = roots.with_vendor_hints(
        _load_fixture(fixtures, "8x-rtxpro6000-dual-epyc9124-direct.topo.txt"), cpu="amd"
    )
    buses = [f"0000:{b}:00.0" for b in ("01", "21", "41", "61", "81", "a1", "c1", "e1")]
    topo = with_bus_ids(topo, buses)
    ce = {"NODE": 56.1, "SYS": 40.7}
    kernel = {k: round(v / 15, 2) for k, v in ce.items()}
    rates = {
        "store": _by_class(topo, kernel),
        "load": _by_class(topo, {k: round(v * 0.9, 2) for k, v in kernel.items()}),
        "ce": _by_class(topo, ce),
        "ce_read": _by_class(topo, {k: v - 1.0 for k, v in ce.items()}),
        "staged": _by_class(topo, {"NODE": 26.0, "SYS": 22.0}),
    }
    latency = {
        "store": _by_class(topo, {"NODE": 2.6, "SYS": 3.4}),
        "load": _by_class(topo, {"NODE": 4.1, "SYS": 5.0}),
        "ce": _by_class(topo, {"NODE": 7.5, "SYS": 8.1}),
        "staged": _by_class(topo, {"NODE": 13.8, "SYS": 14.2}),
    }
    return BoxModel(
        topo=topo,
        rates=rates,
        latency=latency,
        capacity=_links(topo, 56.5, 56.5, 52.0),
        devices=tuple(
            GpuIdentity(
                index=i,
                bus_id=b,
                uuid=f"GPU-synthetic-direct-{i}",
                name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
            )
            for i, b in enumerate(buses)
        ),
    )


BOXES = {
    "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx": broadcom_box,
    "8x-rtxpro6000-dual-epyc9124-direct": direct_attach_box,
}


def synthetic_record(name: str, fixtures) -> str:
    """The probe record of box ``name``: the real probe pipeline run on the box model (seed 0,
    a clean environment), as JSON. Made at test time, never committed: the tests check its
    properties against the published numbers the box model is built from, not a copy of it."""
    from pcie_a2a.topology.diagnosis import diagnose
    from pcie_a2a.topology.probe_run import ProbeSettings, finish, run_probe

    box = BOXES[name](fixtures)
    # A small gate keeps the CPU test quick (the pattern is made in numpy); the GPU runs
    # the default 1 MiB + 4133 bytes.
    probe = run_probe(SyntheticBackend(box, seed=0), box.topo, ProbeSettings(gate_bytes=4133))
    probe = dataclasses.replace(probe, source=f"synthetic: {name} (tests/probe_synthetic.py)")
    aligned = probe.aligned_to([g.bus_id for g in box.topo.gpus])
    probe = finish(
        probe, box.topo, diagnose(box.topo, aligned), TransferOptions(default_link_gen=5)
    )
    return probe.to_json()


_RECORD_DIR: list[Path] = []


@functools.cache
def synthetic_probe_file(name: str, fixtures) -> Path:
    """``synthetic_record(name)`` written once per process to a temporary directory (removed
    at exit), for the code paths that take a probe file (``PCIE_A2A_PROBE_FILE``,
    ``--probe-file``, ``load_probe``)."""
    if not _RECORD_DIR:
        _RECORD_DIR.append(Path(tempfile.mkdtemp(prefix="pcie_a2a-synthetic-probe-")))
        atexit.register(shutil.rmtree, _RECORD_DIR[0], True)
    path = _RECORD_DIR[0] / f"{name}.synthetic-probe.json"
    path.write_text(synthetic_record(name, fixtures))
    return path
