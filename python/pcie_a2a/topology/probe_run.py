"""Running the calibration probe: a known-answer gate, then timing, within a time budget.

:func:`run_probe` drives a :class:`ProbeBackend` (the compiled ``pcie_a2a._probe`` module on
a GPU machine, :class:`NativeBackend`; a simulated one in the tests) through:

1. the **correctness gate**: for every ordered pair and every way bytes can move (kernel
   store, kernel load, copy engine from either side, host-staged), a known pattern is
   moved and compared byte for byte; any wrong byte raises :class:`ProbeGateError` naming
   the pair, the way, the offset and the values, and nothing is timed;
2. per unordered pair and mode, both directions at once (the all-to-all case), ``reps``
   times; per ordered pair, the latencies;
3. the concurrent patterns of :func:`.calibration.concurrent_patterns`.

Budget (``settings.budget_s``, 60 s by default for 8 GPUs): after the gate, the time of
the first pair projects the pair phase; the transfer size is halved (down to 4 MiB) until
the projection fits half the budget; patterns that would start past the budget are skipped
and listed in the record's settings.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from . import probe_cache
from .calibration import concurrent_patterns, derive
from .model import Topology, normalise_bus_id
from .probe import MODES, GpuIdentity, Probe, ProbeGateError, ProbeUnavailable

LATENCY_MODES = ("store", "load", "ce", "staged")
MIN_PAIR_BYTES = 4 << 20


@dataclass(frozen=True)
class ProbeSettings:
    pair_bytes: int = 32 << 20  # per flow, per pair measurement
    pattern_bytes: int = 8 << 20  # per flow, per concurrent pattern
    gate_bytes: int = (1 << 20) + 4096 + 37  # an odd size: the kernels' tail path runs too
    reps: int = 3
    latency_iters: int = 200
    budget_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("pair_bytes", "pattern_bytes", "gate_bytes", "reps", "latency_iters"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: got {v!r}, expected a positive integer")
        if not self.budget_s > 0:
            raise ValueError(f"budget_s: got {self.budget_s!r}, expected seconds > 0")


class ProbeBackend(Protocol):
    """What the probe needs from the machine. Device indices are the backend's own."""

    def devices(self) -> list[GpuIdentity]: ...
    def driver(self) -> str | None: ...
    def can_access(self, src: int, dst: int) -> bool: ...

    def known_answer(
        self, src: int, dst: int, mode: str, nbytes: int, seed: int
    ) -> tuple[int, int, int] | None:
        """Move a pattern of `nbytes` from src to dst by `mode`, compare exactly; None when
        every byte is right, else (offset, got, expected) of the first wrong byte."""
        ...

    def known_answer_flows(
        self, flows: Sequence[tuple[int, int]], mode: str, nbytes: int, seed: int
    ) -> list[tuple[int, int, int] | None]:
        """known_answer for flows run together (source s sends the pattern of seed + s)."""
        ...

    def run_flows(self, flows: Sequence[tuple[int, int]], mode: str, nbytes: int) -> list[float]:
        """Start every flow at once, each moving `nbytes`; seconds per flow."""
        ...

    def latency_us(self, src: int, dst: int, mode: str, iters: int) -> float: ...
    def clock(self) -> float: ...


def gate_seed(src: int, dst: int, mode: str) -> int:
    """A different pattern for every transfer, so bytes landing in the wrong place show."""
    return (0x9E3779B1 * (1 + 64 * src + dst) + 0x85EBCA77 * (1 + MODES.index(mode))) & 0xFFFFFFFF


def _modes(possible: bool) -> tuple[str, ...]:
    return MODES if possible else ("staged",)


def run_gate(backend: ProbeBackend, n: int, possible: list[list[bool]], nbytes: int) -> int:
    """The known-answer exchange over every ordered pair and mode, one transfer at a time,
    then every P2P pair at once in each kernel and copy-engine mode (several flows per
    kernel, as the transport runs them); returns the number of transfers checked, raises
    ProbeGateError listing every wrong one."""
    wrong, checked = [], 0

    def note(s: int, d: int, mode: str, r: tuple[int, int, int] | None, what: str = "") -> None:
        if r is not None:
            off, got, want = r
            wrong.append(
                f"GPU{s}->GPU{d} ({mode}{what}): byte {off} of {nbytes} is {got:#04x}, "
                f"expected {want:#04x}"
            )

    for s in range(n):
        for d in range(n):
            if s == d:
                continue
            for mode in _modes(possible[s][d]):
                checked += 1
                note(s, d, mode, backend.known_answer(s, d, mode, nbytes, gate_seed(s, d, mode)))
    flows = [(s, d) for s in range(n) for d in range(n) if s != d and possible[s][d]]
    if flows:
        for k, mode in enumerate(("store", "load", "ce", "ce_read")):
            results = backend.known_answer_flows(flows, mode, nbytes, 0x5EED0000 + 0x100 * k)
            checked += len(flows)
            for (s, d), r in zip(flows, results, strict=True):
                note(s, d, mode, r, ", all pairs at once")
    if wrong:
        more = f"; and {len(wrong) - 8} more" if len(wrong) > 8 else ""
        raise ProbeGateError(
            f"known-answer exchange failed for {len(wrong)} of {checked} transfers: "
            + "; ".join(wrong[:8])
            + more
            + ". No timing was run: these pairs corrupt data (check IOMMU/ACS settings, "
            "set PCIE_A2A_P2P=0 or PCIE_A2A_PAIRS=SRC-DST:staged for them)"
        )
    return checked


def _device_map(topo: Topology | None, devs: list[GpuIdentity]) -> dict[int, int] | None:
    """Topology GPU -> backend device, by bus id (None when they cannot be matched)."""
    if topo is None or topo.num_gpus != len(devs):
        return None
    by_bus = {normalise_bus_id(d.bus_id): d.index for d in devs if d.bus_id}
    if len(by_bus) == len(devs) and all(g.bus_id for g in topo.gpus):
        try:
            return {g.index: by_bus[normalise_bus_id(g.bus_id or "")] for g in topo.gpus}
        except KeyError:
            return None
    return {g: g for g in range(len(devs))}


def run_probe(
    backend: ProbeBackend,
    topology: Topology | None = None,
    settings: ProbeSettings | None = None,
    progress: Callable[[str], None] | None = None,
) -> Probe:
    """Measure the machine behind `backend` (see the module comment). `topology` (the same
    machine's, for the concurrent patterns) is matched to the devices by bus id. Returns
    the probe record in the backend's device indices, without decisions or diagnosis
    (:func:`finish` adds them)."""
    cfg = settings or ProbeSettings()
    say = progress or (lambda _msg: None)
    t0 = backend.clock()
    devs = backend.devices()
    n = len(devs)
    if n < 2:
        raise ProbeUnavailable(f"the probe needs at least 2 GPUs, this machine shows {n}")
    possible = [[s == d or bool(backend.can_access(s, d)) for d in range(n)] for s in range(n)]
    say(f"gate: known-answer exchange over {n * (n - 1)} ordered pairs")
    checked = run_gate(backend, n, possible, cfg.gate_bytes)
    pair_bytes, skipped = cfg.pair_bytes, []
    pair_rows: list[dict[str, Any]] = []
    unordered = [(s, d) for s in range(n) for d in range(s + 1, n)]
    for k, (s, d) in enumerate(unordered):
        t_pair = backend.clock()
        for mode in _modes(possible[s][d] and possible[d][s]):
            reps = [backend.run_flows([(s, d), (d, s)], mode, pair_bytes) for _ in range(cfg.reps)]
            for j, key in enumerate(((s, d), (d, s))):
                pair_rows.append(
                    {"src": key[0], "dst": key[1], "mode": mode, "bytes": pair_bytes,
                     "seconds": [r[j] for r in reps]}
                )  # fmt: skip
        if k == 0:
            spent = backend.clock() - t_pair
            while spent * len(unordered) > cfg.budget_s / 2 and pair_bytes > MIN_PAIR_BYTES:
                pair_bytes //= 2
                spent /= 2
            if pair_bytes != cfg.pair_bytes:
                say(f"budget: pair transfers cut to {pair_bytes >> 20} MiB")
    # The first pair may have run at the larger size: keep one size in the record.
    if pair_bytes != cfg.pair_bytes:
        first = unordered[0]
        pair_rows = [r for r in pair_rows if (r["src"], r["dst"]) not in (first, first[::-1])]
        for mode in _modes(possible[first[0]][first[1]] and possible[first[1]][first[0]]):
            reps = [
                backend.run_flows([first, first[::-1]], mode, pair_bytes) for _ in range(cfg.reps)
            ]
            for j, key in enumerate((first, first[::-1])):
                pair_rows.append(
                    {"src": key[0], "dst": key[1], "mode": mode, "bytes": pair_bytes,
                     "seconds": [r[j] for r in reps]}
                )  # fmt: skip
    for row in pair_rows:
        row.pop("bytes")
    say("latency")
    latency = []
    for s in range(n):
        for d in range(n):
            if s == d:
                continue
            for mode in LATENCY_MODES if possible[s][d] else ("staged",):
                us = [backend.latency_us(s, d, mode, cfg.latency_iters) for _ in range(cfg.reps)]
                latency.append({"src": s, "dst": d, "mode": mode, "us": us})
    mapping = _device_map(topology, devs)
    pattern_rows = []
    specs = concurrent_patterns(topology) if mapping is not None and topology else []
    if not specs:
        all_pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
        specs = [
            {"name": f"all to all {m}", "kind": "all_to_all", "mode": m, "flows": all_pairs}
            for m in ("store", "load")
        ]
        mapping = {g: g for g in range(n)}
    say(f"patterns: {len(specs)}")
    for spec in specs:
        flows = [(mapping[a], mapping[b]) for a, b in spec["flows"]]
        if any(not possible[a][b] for a, b in flows):
            skipped.append(f"{spec['name']}: a pair without P2P")
            continue
        if backend.clock() - t0 > cfg.budget_s:
            skipped.append(f"{spec['name']}: over the {cfg.budget_s:g} s budget")
            continue
        reps = [backend.run_flows(flows, spec["mode"], cfg.pattern_bytes) for _ in range(cfg.reps)]
        pattern_rows.append({**spec, "flows": [list(f) for f in flows], "seconds": reps})
    samples = {
        "pair_bytes": pair_bytes,
        "pattern_bytes": cfg.pattern_bytes,
        "p2p_possible": possible,
        "pairs": pair_rows,
        "latency": latency,
        "patterns": pattern_rows,
    }
    pairs, patterns = derive(samples)
    driver = backend.driver()
    record = {
        **dataclasses.asdict(cfg),
        "pair_bytes_used": pair_bytes,
        "gate_transfers": checked,
        "skipped": skipped,
    }
    return Probe(
        pairs=pairs,
        source="pcie-a2a probe",
        patterns=patterns,
        gpus=tuple(devs),
        driver=driver,
        fingerprint=probe_cache.fingerprint(devs, driver),
        samples=samples,
        settings=record,
        elapsed_s=backend.clock() - t0,
    )


def finish(
    probe: Probe, topology: Topology, diagnosis: Sequence[str] = (), options: Any = None
) -> Probe:
    """The probe with the plan's decisions made from it (options: a TransferOptions whose probe
    is replaced; default TransferOptions.from_env()), the diagnosis lines and the topology."""
    from .planner import TransferOptions, decisions_dict, plan_transfers

    opt = dataclasses.replace(options or TransferOptions.from_env(), probe=probe)
    p = plan_transfers(topology, options=opt)
    return dataclasses.replace(
        probe,
        decisions=decisions_dict(p),
        diagnosis=tuple(diagnosis),
        topology=topology.to_dict(),
    )


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class NativeBackend:  # pragma: no cover - needs GPUs and the compiled probe
    """The compiled probe (``pcie_a2a._probe``): kernels and copies on this machine's GPUs,
    all devices in one process with peer access enabled where CUDA allows it."""

    def __init__(self, slot_bytes: int, numa_of_bus: dict[str, int] | None = None) -> None:
        try:
            from pcie_a2a import _probe
        except ImportError as exc:
            if _cuda_devices() == 0:
                raise ProbeUnavailable(
                    "the probe needs CUDA GPUs and none is visible (torch.cuda.device_count() is 0)"
                ) from None
            raise ProbeUnavailable(
                f"the probe needs the CUDA build of pcie_a2a ({exc}); build with "
                "PCIE_A2A_WITH_CUDA=1"
            ) from None
        count, why = _probe.device_count()
        if count < 2:
            raise ProbeUnavailable(
                f"the probe needs CUDA GPUs and this machine shows {count}"
                + (f" ({why})" if why else "")
            )
        self._mod = _probe
        # Each device's staging slot on its own NUMA node (the receiver's, as the transport).
        where = numa_of_bus or {}
        numa = [where.get(normalise_bus_id(b), -1) for b, _, _ in _probe.identities()]
        self._session = _probe.Session(list(range(count)), slot_bytes, numa)

    def devices(self) -> list[GpuIdentity]:
        return [
            GpuIdentity(index=i, bus_id=b, uuid=u, name=nm)
            for i, (b, u, nm) in enumerate(self._session.identities())
        ]

    def driver(self) -> str | None:
        from .live import driver_version

        return driver_version() or self._session.driver_version()

    def can_access(self, src: int, dst: int) -> bool:
        return self._session.can_access(src, dst)

    def known_answer(self, src, dst, mode, nbytes, seed):
        r = self._session.known_answer(src, dst, MODES.index(mode), nbytes, seed)
        return None if r[0] < 0 else (int(r[0]), int(r[1]), int(r[2]))

    def known_answer_flows(self, flows, mode, nbytes, seed):
        rs = self._session.known_answer_flows(
            [tuple(f) for f in flows], MODES.index(mode), nbytes, seed
        )
        return [None if r[0] < 0 else (int(r[0]), int(r[1]), int(r[2])) for r in rs]

    def run_flows(self, flows, mode, nbytes):
        return list(self._session.run_flows([tuple(f) for f in flows], MODES.index(mode), nbytes))

    def latency_us(self, src, dst, mode, iters):
        return float(self._session.latency_us(src, dst, MODES.index(mode), iters))

    def clock(self) -> float:
        return time.monotonic()

    def close(self) -> None:
        self._session.close()


def measure(
    topology: Topology | None = None, settings: ProbeSettings | None = None
) -> Probe:  # pragma: no cover - needs GPUs
    """Probe this machine (``pcie-a2a probe`` and ``topo --probe``): run, then add the
    decisions and the diagnosis."""
    from .diagnosis import diagnose, platform_facts
    from .live import discover

    cfg = settings or ProbeSettings()
    topo = topology if topology is not None else discover()
    numa = {
        normalise_bus_id(g.bus_id): g.numa_node
        for g in topo.gpus
        if g.bus_id and g.numa_node is not None
    }
    backend = NativeBackend(max(cfg.pair_bytes, cfg.pattern_bytes, cfg.gate_bytes), numa)
    try:
        probe = run_probe(backend, topo, cfg)
    finally:
        backend.close()
    aligned = probe.aligned_to([g.bus_id for g in topo.gpus])
    facts = platform_facts(bus_ids=[g.bus_id for g in topo.gpus if g.bus_id])
    return finish(probe, topo, diagnose(topo, aligned, facts))
