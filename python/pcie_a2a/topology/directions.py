"""Per pair: push or pull, and kernel (SM) or copy engine, each with its reason.

Push: the sender's SMs store rows into the receiver's memory (posted writes). Pull: the
sender publishes a ready flag into the receiver's memory and the receiver loads the rows
from the sender's memory (non-posted reads), then writes a consumed flag back. Both poll
only local memory (DESIGN.md principle 1). Which is faster is a property of the box and
the pair, not a law (research/field_2026.md sections 4 and 5):

Direction, in order (the first rule that applies decides):

1. host-staged pairs push (the sender writes into pinned memory on the receiver's node;
   no override changes that); 2. ``PCIE_A2A_PAIRS`` entry for the pair;
3. ``PCIE_A2A_DIRECTION=push|pull``; 4. NVLink pairs push;
5. a probe with both numbers for the pair decides: its rate inside the full all-to-all
   (every GPU storing to / loading from every peer at once, the transport's own load),
   else the pair alone (the copy engine's, from either side, when kernel P2P is so slow
   that both directions would use it); pull only when it is at least ``PULL_MARGIN``
   faster (pull costs a flag round trip more and a read round trip per row batch);
6. without numbers, by topology class: a flow that leaves a shared switch whose GPUs can
   write to two or more root complexes (:mod:`.roots`) pulls when the switch is a
   Broadcom/PLX or Microchip part writing into AMD root complexes (the class with the
   reported collapse: 36.8 -> 2.7 GB/s for two flows, reads 51.1, on the ASUS
   ESC8000A-E13P; 13.5 vs 52 GB/s on the c-payne PM50100 16-GPU box; b12x moved all
   phases to pull after ~2.6 vs ~52 GB/s); pushes (in the collapse-avoiding schedule) when
   the vendors are unknown or another class; every other pair pushes.

Engine, in order: ``PCIE_A2A_PAIRS``; ``PCIE_A2A_ENGINE``; a probe with the kernel rate
and the copy-engine rate of the chosen direction: the copy engine when kernel loads/stores
run below ``CE_MARGIN`` of it (the driver routing kernel-issued P2P through system memory
on direct-attach boxes, ~15x slower while cudaMemcpy is fine, section 5), else SM; without
numbers, SM (kernel-issued) with a caution on direct-attach pairs. ``sm`` leaves the
transport its own size rule (PCIE_A2A_COPY_ENGINE_MIN_BYTES for large normal-mode pairs);
``copy_engine`` asks for the copy engine whatever the size.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import Topology, is_nvlink
from .probe import PairMeasurement, Probe, switch_pattern_name
from .roots import collapse_class, trigger_switch

PUSH, PULL = "push", "pull"
SM, COPY_ENGINE = "sm", "copy_engine"
PULL_MARGIN = 1.15  # pull must be this much faster to win
CE_MARGIN = 0.5  # kernel P2P below this fraction of the copy engine: use the copy engine

# The collapse as reported (field_2026.md section 4): the rate two pushing flows keep when
# they write from one switch into two root complexes, relative to writing into one.
REPORTED_COLLAPSE = 2.7 / 36.8


@dataclass(frozen=True)
class PairOverride:
    """One ``PCIE_A2A_PAIRS`` entry (None: any GPU / this choice not set)."""

    src: int | None = None
    dst: int | None = None
    path: str | None = None
    direction: str | None = None
    engine: str | None = None

    def matches(self, a: int, b: int) -> bool:
        return (self.src is None or self.src == a) and (self.dst is None or self.dst == b)


def override_for(overrides: tuple[PairOverride, ...], a: int, b: int, what: str) -> str | None:
    """The last matching override's choice for `what` (path, direction or engine)."""
    value = None
    for o in overrides:
        if o.matches(a, b) and getattr(o, what) is not None:
            value = getattr(o, what)
    return value


def _kernel_behind_ce(kernel: float | None, ce: float | None) -> bool:
    return kernel is not None and ce is not None and kernel < CE_MARGIN * ce


def _rates(m: PairMeasurement | None) -> tuple[float | None, float | None, str]:
    """(push rate, pull rate, which measurement) for the direction rule."""
    if m is None:
        return None, None, ""
    if _kernel_behind_ce(m.store_gbps, m.ce_gbps) and _kernel_behind_ce(
        m.load_gbps, m.ce_read_gbps
    ):
        # Both directions will move with the copy engine (see decide_engine): compare those.
        return m.ce_gbps, m.ce_read_gbps, "copy engine, pair alone"
    if m.a2a_store_gbps is not None and m.a2a_load_gbps is not None:
        return m.a2a_store_gbps, m.a2a_load_gbps, "in the all-to-all"
    push = m.store_gbps if m.store_gbps is not None else m.p2p_gbps
    return push, m.load_gbps, "pair alone"


def decide_direction(
    topo: Topology,
    a: int,
    b: int,
    transport: str,
    probe: Probe | None,
    forced: str | None,
    overrides: tuple[PairOverride, ...],
) -> tuple[str, str]:
    """(push or pull, reason) for pair a -> b; see the module comment for the rules."""
    if transport != "p2p":  # no override can make a host-staged pair pull
        return PUSH, "host-staged: the sender writes into pinned memory on the receiver's node"
    o = override_for(overrides, a, b, "direction")
    if o is not None:
        return o, f"PCIE_A2A_PAIRS sets {o}"
    if forced is not None:
        return forced, f"PCIE_A2A_DIRECTION={forced}"
    if is_nvlink(topo.classes[a][b]):
        return PUSH, "NVLink: stores"
    push, pull, where = _rates(probe.get(a, b) if probe else None)
    if push is not None and pull is not None:
        if pull >= PULL_MARGIN * push:
            return PULL, f"measured loads {pull:.1f} GB/s > stores {push:.1f} ({where})"
        return PUSH, f"measured stores {push:.1f} GB/s, loads {pull:.1f} ({where})"
    sw = trigger_switch(topo, a, b)
    if sw is None:
        return PUSH, "posted writes: no shared switch uplink into two or more root complexes"
    prone, words = collapse_class(topo, sw)
    if prone:
        return PULL, (
            f"leaves switch {sw} ({words}): concurrent writes from one switch into two or "
            "more root complexes collapse on this class (36.8 -> 2.7 GB/s, reads 51.1; "
            "field_2026 s4); pull until measured"
        )
    if prone is None:
        return PUSH, (
            f"leaves switch {sw}, {words}: push in phases, one destination root complex per "
            "switch at a time (pcie-a2a probe measures whether pull is faster)"
        )
    return PUSH, f"leaves switch {sw} ({words}): no collapse reported for this class"


def decide_engine(
    topo: Topology,
    a: int,
    b: int,
    transport: str,
    direction: str,
    probe: Probe | None,
    forced: str | None,
    overrides: tuple[PairOverride, ...],
) -> tuple[str, str]:
    """(sm or copy_engine, reason) for pair a -> b moving in `direction`."""
    o = override_for(overrides, a, b, "engine")
    if o is not None:
        return o, f"PCIE_A2A_PAIRS sets {o}"
    if forced is not None:
        return forced, f"PCIE_A2A_ENGINE={forced}"
    if transport != "p2p":
        return SM, "host-staged: kernel stores into pinned memory (size rule of the transport)"
    m = probe.get(a, b) if probe else None
    verb = "stores" if direction == PUSH else "loads"
    if m is not None:
        kernel = m.store_gbps if direction == PUSH else m.load_gbps
        ce = m.ce_gbps if direction == PUSH else m.ce_read_gbps
        ce = ce if ce is not None else (m.ce_gbps or m.ce_read_gbps)
        if kernel is not None and ce is not None:
            if kernel < CE_MARGIN * ce:
                return COPY_ENGINE, (
                    f"measured kernel {verb} {kernel:.1f} GB/s < half the copy engine's "
                    f"{ce:.1f}: kernel P2P goes through system memory (see the diagnosis)"
                )
            return SM, f"measured kernel {verb} {kernel:.1f} GB/s, copy engine {ce:.1f}"
    cls = topo.classes[a][b]
    if cls in ("NODE", "PHB", "SYS") and not topo.switches:
        return SM, (
            f"kernel {verb}, not measured: on direct-attach {cls} pairs the driver may route "
            "kernel P2P through system memory (pcie-a2a probe checks)"
        )
    return SM, f"kernel {verb} (no probe)"


def collapse_factor(topo: Topology, switch: str, probe: Probe | None) -> tuple[float, str]:
    """What a pushing flow keeps of its rate in a round where `switch` writes into two or
    more root complexes: measured (switch pattern, 2+ roots vs 1), else the reported
    collapse for the prone class, else 1 (not known to collapse)."""
    if probe is not None:
        one = probe.pattern(switch_pattern_name(switch, 1, "store"))
        many = [
            p
            for p in probe.patterns
            if p.kind == "switch_roots"
            and p.switch == switch
            and p.mode == "store"
            and (p.roots or 0) >= 2
        ]
        if one is not None and many and one.aggregate_gbps > 0:
            worst = min(many, key=lambda p: p.aggregate_gbps)
            return min(1.0, worst.aggregate_gbps / one.aggregate_gbps), "measured"
    prone, _ = collapse_class(topo, switch)
    if prone:
        return REPORTED_COLLAPSE, "reported for this class"
    return 1.0, "not known to collapse"
