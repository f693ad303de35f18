"""Which algorithm a call of a given size takes: one-shot, two-shot, or the hand-over to NCCL
(gloo on the CPU), and where those thresholds come from.

Order (the first that applies decides; :class:`Thresholds.source` says which):

1. explicit ``AllReduce(..., handover_bytes=, one_shot_max_bytes=)`` arguments;
2. ``PCIE_A2A_ALLREDUCE_MAX_BYTES`` (the hand-over size; one-shot below the default's
   one-shot limit, clipped to it);
3. ``PCIE_A2A_ALLREDUCE_TABLE``: the crossover a ``pcie-a2a bench --op allreduce`` run
   measured for the same backend, world and dtype (the smallest size at which the fallback
   beat ours, so ours hands over just below it);
4. the per-pair latency and bandwidth the topology plan has *measured* (a probe record)
   set the split between one-shot and two-shot (a model of our own two algorithms, below);
   the hand-over keeps rule 5's value: whether NCCL is faster on a box needs NCCL timed
   on it, which is what the bench (rule 3) does;
5. defaults per topology class, from the public numbers in
   ``shared/research/field_2026.md`` sections 2-3 (table :data:`DEFAULTS`).

The model (4), for S bytes per rank, W ranks, one-way flag latency L (worst pair) and link
rate G (worst pair), with each rank's sends sharing its own link: one-shot sends (W - 1) S
after one flag hop, ``L + (W-1) S / G``; two-shot sends 2 (W - 1) S / W after two hops,
``2 L + 2 (W-1) S / (W G)``. One-shot is used up to the largest power-of-two size at which
it is predicted no slower.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from pcie_a2a import env

KB = 1024


@dataclass(frozen=True)
class Thresholds:
    one_shot_max: int  # bytes per rank: one-shot up to here, two-shot above
    handover: int  # bytes per rank: ours up to here, NCCL/gloo above
    source: str  # where the numbers come from (printed and in stats())

    def route(self, nbytes: int) -> str:
        if nbytes > self.handover:
            return "fallback"
        return "one_shot" if nbytes <= self.one_shot_max else "two_shot"


# Topology classes of a group (:func:`topology_class`) -> (one_shot_max, handover), with
# the evidence. Per world: "small" is up to 4 ranks, "large" more.
DEFAULTS: dict[tuple[str, str], tuple[int, int, str]] = {
    # 4x RTX PRO 6000 on one NUMA node, one-shot vs NCCL: 16 KB 7.7/14.7 us, 256 KB
    # 28.7/40.9, 1 MB 95.6/85.2 (NCCL wins): one-shot to 256 KB, hand over between.
    ("single_root", "small"): (256 * KB, 512 * KB, "4x RTX PRO 6000 one NUMA node (field s3)"),
    # 8 GPUs dual socket: crossover 48 KB; fused one-stage 14 KB 11.8 vs NCCL+add 56.2 us,
    # 458 KB 147 vs NCCL 93 (field s3). No public two-shot number: none by default.
    ("cross_socket", "large"): (48 * KB, 48 * KB, "8 GPUs dual socket crossover 48 KB (field s3)"),
    ("cross_socket", "small"): (48 * KB, 48 * KB, "dual-socket crossover 48 KB (field s3)"),
    ("single_root", "large"): (48 * KB, 48 * KB, "8-GPU crossover 48 KB (field s3)"),
    # GPUs behind PCIe switches only (PIX/PXB): treated as one root complex.
    ("switch", "small"): (256 * KB, 512 * KB, "as one NUMA node (field s3)"),
    ("switch", "large"): (48 * KB, 48 * KB, "8-GPU crossover 48 KB (field s3)"),
    # Unknown topology: the most conservative GPU numbers.
    ("unknown", "small"): (48 * KB, 48 * KB, "unknown topology: 8-GPU crossover 48 KB"),
    ("unknown", "large"): (48 * KB, 48 * KB, "unknown topology: 8-GPU crossover 48 KB"),
    # CPU ranks on shared memory: one-shot reads W vectors per element, two-shot 2; gloo
    # (TCP loopback) is slower at every size measured (docs/allreduce.md): never hand over.
    ("cpu", "small"): (64 * KB, 1 << 40, "CPU shared memory (measured: docs/allreduce.md)"),
    ("cpu", "large"): (32 * KB, 1 << 40, "CPU shared memory (measured: docs/allreduce.md)"),
}


def topology_class(path_classes: Sequence[str]) -> str:
    """The class of a GPU group from its pairs' path classes (nvidia-smi topo letters)."""
    if not path_classes:
        return "unknown"
    if any(c == "SYS" for c in path_classes):
        return "cross_socket"
    if all(c in ("PIX", "PXB") for c in path_classes):
        return "switch"
    if all(c in ("PIX", "PXB", "PHB", "NODE") for c in path_classes):
        return "single_root"
    return "unknown"


def defaults(cls: str, world: int) -> Thresholds:
    size = "small" if world <= 4 else "large"
    one, hand, why = DEFAULTS.get((cls, size), DEFAULTS[("unknown", size)])
    return Thresholds(one, hand, f"defaults for {cls}, world {world}: {why}")


def _sizes(limit: int) -> list[int]:
    out, s = [], KB
    while s <= limit:
        out.append(s)
        s *= 2
    return out


def one_shot_limit(
    world: int, latency_us: Sequence[float], gbps: Sequence[float], limit: int
) -> tuple[int, str]:
    """Largest power-of-two size (bytes) at which the model of the module comment predicts
    one-shot no slower than two-shot, from the one-way latency (µs) and link rate (GB/s) of
    every ordered pair of the group; and a line saying so."""
    if world < 2 or not latency_us or not gbps or min(gbps) <= 0:
        raise ValueError("one_shot_limit needs world >= 2 and positive per-pair numbers")
    lat, bw = max(latency_us), min(gbps) * 1e3  # bytes per µs
    best = 0
    for s in _sizes(limit):
        one = lat + (world - 1) * s / bw
        two = 2 * lat + 2 * (world - 1) * s / (world * bw)
        if one <= two:
            best = s
    why = f"one-shot/two-shot split modelled from measured pairs (worst one-way {lat:.2f} us, worst link {bw / 1e3:.1f} GB/s)"
    return best, why


def from_table(path: str, backend: str, world: int, dtype: str) -> Thresholds | None:
    """The crossover a bench JSON recorded for (backend, world, dtype), or None."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"PCIE_A2A_ALLREDUCE_TABLE={path!r}: cannot read it: {exc}") from None
    if doc.get("op") != "allreduce":
        raise ValueError(f"PCIE_A2A_ALLREDUCE_TABLE={path!r}: not a `bench --op allreduce` JSON")
    for row in doc.get("crossover", []):
        if (row.get("backend"), row.get("world"), row.get("dtype"), row.get("fused")) == (
            backend,
            world,
            dtype,
            False,
        ):
            hand = row.get("ours_up_to_bytes")
            one = row.get("one_shot_up_to_bytes", hand)
            if isinstance(hand, int) and hand >= 0:
                one = one if isinstance(one, int) else hand
                return Thresholds(min(one, hand), hand, f"measured by the bench ({path})")
    return None


def choose(
    backend: str,
    world: int,
    dtype: str,
    cls: str,
    measured: tuple[Sequence[float], Sequence[float]] | None,
    limit: int,
    handover_bytes: int | None = None,
    one_shot_max_bytes: int | None = None,
) -> Thresholds:
    """The thresholds of a communicator (module comment, rules 1-5). ``limit``: its
    max_bytes (nothing above it can be ours)."""
    base = defaults(cls, world)
    if handover_bytes is not None or one_shot_max_bytes is not None:
        hand = base.handover if handover_bytes is None else handover_bytes
        one = min(base.one_shot_max, hand) if one_shot_max_bytes is None else one_shot_max_bytes
        t = Thresholds(one, hand, "explicit arguments")
    elif (forced := env.allreduce_max_bytes()) is not None:
        t = Thresholds(min(base.one_shot_max, forced), forced, "PCIE_A2A_ALLREDUCE_MAX_BYTES")
    elif (table := env.allreduce_table()) and (
        got := from_table(table, backend, world, dtype)
    ) is not None:
        t = got
    elif measured is not None and world >= 2:
        one, why = one_shot_limit(world, measured[0], measured[1], limit)
        t = Thresholds(min(one, base.handover), base.handover, f"{why}; hand-over: {base.source}")
    else:
        t = base
    return Thresholds(min(t.one_shot_max, limit), min(t.handover, limit), t.source)
