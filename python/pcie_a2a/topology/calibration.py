"""From the probe's raw samples to per-pair numbers, and which concurrent patterns to run.

Raw samples (the ``samples`` of a version-2 probe record, plain JSON):

``{"pair_bytes": B, "pattern_bytes": P,
   "pairs": [{"src", "dst", "mode", "seconds": [...]}],     # one per ordered pair and mode
   "latency": [{"src", "dst", "mode", "us": [...]}],
   "patterns": [{"name", "kind", "mode", "flows": [[s, d], ..], "seconds": [[..], ..],
                 "switch"?, "roots"?, "socket"?}],          # seconds[rep][flow]
   "p2p_possible": [[bool, ..], ..]}``

A pair sample is the time to move B bytes src -> dst *while dst -> src moves B bytes the
same way* (both directions busy, as in an all-to-all); a pattern sample is each flow's
time with every flow of the pattern started together. Derived numbers are medians:
GB/s = bytes / median seconds; a pattern's aggregate is all its bytes over the median of
its slowest flow's time. Medians, not means or minima: one descheduled repetition must
not move the number, and the plan wants the typical case.
"""

from __future__ import annotations

import statistics
from typing import Any

from .model import Topology
from .probe import MODES, PairMeasurement, PatternMeasurement, switch_pattern_name
from .roots import destination_roots, shared_switches

_GBPS = {"store": "store_gbps", "load": "load_gbps", "ce": "ce_gbps", "ce_read": "ce_read_gbps"}
_GBPS["staged"] = "staged_gbps"
_US = {"store": "store_us", "load": "load_us", "ce": "ce_us", "staged": "staged_us"}


def _median(values: list[float], what: str) -> float:
    good = [float(v) for v in values]
    if not good or any(not v > 0 for v in good):
        raise ValueError(f"{what}: got {values!r}, expected positive samples")
    return statistics.median(good)


def derive(
    samples: dict[str, Any],
) -> tuple[dict[tuple[int, int], PairMeasurement], tuple[PatternMeasurement, ...]]:
    """Per-pair numbers and pattern results from raw samples (see the module comment)."""
    pair_bytes = float(samples["pair_bytes"])
    pattern_bytes = float(samples.get("pattern_bytes", pair_bytes))
    fields: dict[tuple[int, int], dict[str, Any]] = {}
    possible = samples.get("p2p_possible")
    if possible is not None:
        for s, row in enumerate(possible):
            for d, ok in enumerate(row):
                if s != d:
                    fields.setdefault((s, d), {})["p2p_possible"] = bool(ok)
    for row in samples.get("pairs", []):
        key, mode = (int(row["src"]), int(row["dst"])), row["mode"]
        if mode not in MODES:
            raise ValueError(f"pairs: mode {mode!r} is not one of {MODES}")
        t = _median(row["seconds"], f"pair {key[0]}->{key[1]} {mode}")
        fields.setdefault(key, {})[_GBPS[mode]] = round(pair_bytes / t / 1e9, 3)
    for row in samples.get("latency", []):
        key, mode = (int(row["src"]), int(row["dst"])), row["mode"]
        if mode not in _US:
            raise ValueError(f"latency: mode {mode!r} is not one of {tuple(_US)}")
        fields.setdefault(key, {})[_US[mode]] = round(
            _median(row["us"], f"latency {key[0]}->{key[1]} {mode}"), 3
        )
    patterns = []
    for row in samples.get("patterns", []):
        flows = tuple((int(a), int(b)) for a, b in row["flows"])
        reps = row["seconds"]
        if not reps or any(len(r) != len(flows) for r in reps):
            raise ValueError(f"pattern {row['name']!r}: expected one time per flow per repetition")
        per_flow = tuple(
            round(pattern_bytes / _median([r[k] for r in reps], row["name"]) / 1e9, 3)
            for k in range(len(flows))
        )
        slowest = _median([max(r) for r in reps], row["name"])
        patterns.append(
            PatternMeasurement(
                name=row["name"],
                kind=row["kind"],
                mode=row["mode"],
                flows=flows,
                flow_gbps=per_flow,
                aggregate_gbps=round(pattern_bytes * len(flows) / slowest / 1e9, 3),
                switch=row.get("switch"),
                roots=row.get("roots"),
                socket=row.get("socket"),
            )
        )
    for p in patterns:
        if p.kind == "all_to_all" and p.mode in ("store", "load"):
            for f, r in zip(p.flows, p.flow_gbps, strict=True):
                fields.setdefault(f, {})[f"a2a_{p.mode}_gbps"] = r
    pairs = {}
    for key, f in fields.items():
        if f.get("p2p_possible") is not False:
            # The planner's generic P2P figure: the better push engine, the flag latency.
            push = [f[k] for k in ("store_gbps", "ce_gbps") if k in f]
            if push:
                f["p2p_gbps"] = max(push)
            if "store_us" in f or "ce_us" in f:
                f["p2p_us"] = f.get("store_us", f.get("ce_us"))
        pairs[key] = PairMeasurement(**f)
    return pairs, tuple(patterns)


def concurrent_patterns(topo: Topology) -> list[dict[str, Any]]:
    """The concurrent patterns to run on `topo` (flows in its GPU indices), each in store
    and load mode:

    * ``all to all``: every ordered pair at once;
    * per shared switch with GPUs that can reach two or more root complexes: its GPUs
      moving to GPUs behind k = 1, 2, .. root complexes at once (GPU i of the switch to
      root complex i mod k), the pattern that shows the posted-write collapse;
    * with two or more sockets: all-to-all inside each socket, and every pair across.
    """
    n = topo.num_gpus
    out: list[dict[str, Any]] = []

    def both(name: str, kind: str, flows: list[tuple[int, int]], **extra: Any) -> None:
        if flows:
            for mode in ("store", "load"):
                out.append(
                    {"name": f"{name} {mode}", "kind": kind, "mode": mode, "flows": flows, **extra}
                )

    both("all to all", "all_to_all", [(a, b) for a in range(n) for b in range(n) if a != b])
    for sw, below in sorted(shared_switches(topo).items()):
        rcs = list(destination_roots(topo, sw).values())
        for k in range(1, min(len(below), len(rcs)) + 1):
            flows = [(g, rcs[i % k][(i // k) % len(rcs[i % k])]) for i, g in enumerate(below)]
            for mode in ("store", "load"):
                out.append(
                    {
                        "name": switch_pattern_name(sw, k, mode),
                        "kind": "switch_roots",
                        "mode": mode,
                        "flows": flows,
                        "switch": sw,
                        "roots": k,
                    }
                )
    sockets = [topo.socket_of_node(g.numa_node) for g in topo.gpus]
    known = sorted({s for s in sockets if s is not None})
    if len(known) >= 2 and None not in sockets:
        for sock in known:
            members = [g for g in range(n) if sockets[g] == sock]
            pairs = [(a, b) for a in members for b in members if a != b]
            both(f"socket {sock} all to all", "socket", pairs, socket=sock)
        across = [(a, b) for a in range(n) for b in range(n) if sockets[a] != sockets[b]]
        both("cross socket", "cross_socket", across)
    return out
