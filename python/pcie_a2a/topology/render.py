"""Text views of a topology and a plan (what ``pcie-a2a topo`` prints).

The plan view is computed from the TransferPlan alone, so a plan reloaded from JSON prints the
same text as the plan that was saved.
"""

from __future__ import annotations

import re

from .directions import COPY_ENGINE, PULL, SM
from .model import UNKNOWN_CLASS, Topology
from .planner import STAGED, TransferPlan

_STATUS = {"supported": "S", "unsupported": "U", "disabled": "D", "unknown": "?"}
_ENGINE = {SM: "s", COPY_ENGINE: "c"}


def _transport_letter(transport: str, direction: str) -> str:
    """P P2P push, L P2P pull (the receiver loads), H host-staged."""
    if transport == STAGED:
        return "H"
    return "L" if direction == PULL else "P"


def _link_text(gen: int | None, width: int | None) -> str:
    if gen is None and width is None:
        return "Gen? x?"
    return f"Gen{gen if gen is not None else '?'} x{width if width is not None else '?'}"


def format_tree(topo: Topology) -> str:
    out = [f"topology: {topo.source}"]
    sockets = sorted({n.socket for n in topo.numa_nodes})
    out.append(
        f"  {topo.num_gpus} GPUs, {len(topo.numa_nodes)} NUMA nodes, {len(sockets)} sockets, "
        f"{len(topo.root_ports)} root ports, {len(topo.switches)} switches, {len(topo.nics)} NICs"
    )
    if not topo.gpus:
        out.append("  no NVIDIA GPU found")
    children: dict[str | None, list[str]] = {}
    for s in topo.switches:
        children.setdefault(s.parent, []).append(s.id)
    gpus_under: dict[str | None, list[int]] = {}
    for g in topo.gpus:
        gpus_under.setdefault(g.parent, []).append(g.index)

    def below(ident: str, depth: int) -> None:
        pad = "  " * depth
        for g in gpus_under.get(ident, []):
            gpu = topo.gpus[g]
            extra = " ".join(x for x in (gpu.bus_id, gpu.name) if x)
            link = _link_text(gpu.link_gen, gpu.link_width)
            out.append(f"{pad}GPU{g}  {link}{'  ' + extra if extra else ''}")
        for sid in children.get(ident, []):
            sw = next(s for s in topo.switches if s.id == sid)
            out.append(f"{pad}switch {sid}  uplink {_link_text(sw.link_gen, sw.link_width)}")
            below(sid, depth + 1)

    for sock in sockets:
        out.append(f"  socket {sock}")
        for node in (n for n in topo.numa_nodes if n.socket == sock):
            out.append(f"    NUMA node {node.id}" + (f"  CPUs {node.cpus}" if node.cpus else ""))
            for hb in sorted({r.host_bridge for r in topo.root_ports if r.numa_node == node.id}):
                out.append(f"      host bridge {hb}")
                for rp in (
                    r for r in topo.root_ports if r.host_bridge == hb and r.numa_node == node.id
                ):
                    out.append(f"        root port {rp.id}")
                    below(rp.id, 5)
    loose = [g for g in topo.gpus if g.parent is None]
    if loose:
        # Sources without a PCIe tree (p2pBandwidthLatencyTest, NCCL logs, nccl-tests): the
        # GPUs are still listed, with what the source tells about them.
        out.append("  GPUs (no PCIe tree in the source)")
        for gpu in loose:
            extra = " ".join(x for x in (gpu.bus_id, gpu.name) if x)
            node = f"NUMA node {gpu.numa_node}" if gpu.numa_node is not None else "NUMA node ?"
            out.append(f"    GPU{gpu.index}  {node}{'  ' + extra if extra else ''}")
    orphans = [
        r
        for r in topo.root_ports
        if r.numa_node is None or r.numa_node not in {n.id for n in topo.numa_nodes}
    ]
    for rp in orphans:
        out.append(f"  root port {rp.id} (NUMA node unknown)")
        below(rp.id, 2)
    for nic in topo.nics:
        where = f"NUMA node {nic.numa_node}" if nic.numa_node is not None else "NUMA node ?"
        out.append(
            f"  NIC{nic.index} {nic.name or ''} {nic.bus_id or ''} {where}".replace("  ", " ")
        )
    return "\n".join(out)


def _pairs_text(pairs: list[tuple[int, int]], limit: int = 6) -> str:
    shown = " ".join(f"{a}->{b}" for a, b in pairs[:limit])
    return shown + (f" (+{len(pairs) - limit} more)" if len(pairs) > limit else "")


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _ranges(pattern: str, reasons: list[str]) -> str:
    values = [[float(x) for x in _NUMBER.findall(r)] for r in reasons]
    parts = pattern.split("#")
    out = parts[0]
    for k, rest in enumerate(parts[1:]):
        lo, hi = min(v[k] for v in values), max(v[k] for v in values)
        text = _NUMBER.findall(reasons[0])[k] if lo == hi else f"{lo:g}-{hi:g}"
        out += text + rest
    return out


def _decision_groups(out: list[str], title: str, items: list[tuple[str, str, int, int]]) -> None:
    """Reasons that differ only in their measured numbers form one line with ranges."""
    out.append("")
    out.append(title)
    groups: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
    for choice, reason, a, b in items:
        groups.setdefault((choice, _NUMBER.sub("#", reason)), []).append((a, b, reason))
    if not items:
        out.append("  none")
    for (choice, pattern), members in groups.items():
        prs = [(a, b) for a, b, _ in members]
        out.append(
            f"  {choice:<6} {len(prs):3d} pairs: {_ranges(pattern, [r for _, _, r in members])}"
        )
        out.append(f"                    {_pairs_text(prs)}")


def format_plan(plan: TransferPlan, traffic_note: str = "") -> str:
    n = plan.num_gpus
    out: list[str] = []
    if n == 0:
        return "no GPUs: nothing to plan"
    out.append(
        "pairs (row sends to column): path class, P2P status, transport, engine, expected GB/s"
    )
    if any(p.path_class == UNKNOWN_CLASS for p in plan.pairs):
        out.append("  path class ? unknown: the source does not show the path between the GPUs;")
    out.append("  status S supported, U unsupported, D disabled by driver, ? unknown;")
    out.append(
        "  transport P P2P push, L P2P pull (receiver loads), H host-staged; engine s SM, c copy"
    )
    out.append("  engine; GB/s per direction with both directions busy")
    width = 15
    out.append(("      " + "".join(f"GPU{j}".ljust(width) for j in range(n))).rstrip())
    for i in range(n):
        cells = []
        for j in range(n):
            if i == j:
                cells.append("X".ljust(width))
                continue
            p = plan.pair(i, j)
            letters = _STATUS[p.p2p_status] + _transport_letter(p.transport, p.direction)
            letters += _ENGINE.get(p.engine, "?")
            cells.append(f"{p.path_class:<4} {letters} {p.gbps:5.1f}".ljust(width))
        out.append(f"GPU{i}".ljust(6) + "".join(cells).rstrip())

    _decision_groups(
        out, "decisions: path", [(p.transport, p.reason, p.src, p.dst) for p in plan.pairs]
    )
    p2p = [p for p in plan.pairs if p.transport != STAGED]
    _decision_groups(
        out,
        "decisions: direction (P2P pairs)"
        if len(p2p) < len(plan.pairs)
        else "decisions: direction",
        [(p.direction, p.direction_reason or "-", p.src, p.dst) for p in p2p],
    )
    _decision_groups(
        out,
        "decisions: engine",
        [(p.engine, p.engine_reason or "-", p.src, p.dst) for p in plan.pairs],
    )

    out.append("")
    out.append("host staging (pinned memory on the receiver's NUMA node)")
    staged = [p for p in plan.pairs if p.transport == STAGED]
    if not staged:
        out.append("  none: every pair uses direct P2P")
    for dst in range(n):
        srcs = [p for p in staged if p.dst == dst]
        if srcs:
            node = srcs[0].staging_node
            where = f"NUMA node {node}" if node is not None else "NUMA node unknown (first touch)"
            out.append(f"  GPU{dst} <- {' '.join(f'GPU{p.src}' for p in srcs)}: {where}")

    out.append("")
    out.append(
        f"send schedule: {len(plan.rounds)} rounds, each rank sends to one peer per round; "
        f"most flows on one shared link in any round: {plan.max_shared_load}"
    )
    if plan.schedule_reason:
        out.append(f"  {plan.schedule_reason}")
    if plan.phased:
        out.append(
            "  phased: rounds must not overlap for pushing pairs (a sender starts round r+1 "
            "after its round r rows are out)"
        )
    for sw, factor, basis in plan.collapse_factors:
        out.append(
            f"  switch {sw}: pushing into 2+ root complexes keeps {factor:.2f} of the rate ({basis})"
        )
    for r, (rnd, loads) in enumerate(zip(plan.rounds, plan.round_loads, strict=True)):
        busy = ", ".join(f"{lid} {c}" for lid, c in loads) or "no shared link"
        out.append(f"  round {r + 1}: {' '.join(f'{a}->{b}' for a, b in enumerate(rnd))}  | {busy}")
    shared = [lk for lk in plan.links if lk.shared]
    if shared:
        out.append(
            "  shared links: "
            + "; ".join(f"{lk.id} = {lk.label} ({lk.capacity_gbps:g} GB/s)" for lk in shared)
        )

    if plan.reports and traffic_note:
        out.append("")
        out.append(traffic_note)
    for rep in plan.reports:
        out.append("")
        out.append(f"{rep.name}: {rep.total_bytes / 1e6:.2f} MB on the wire")
        if rep.bottleneck:
            lk = plan.link(rep.bottleneck)
            out.append(
                f"  bottleneck: {lk.label} ({lk.id}) carries {rep.bottleneck_bytes / 1e6:.2f} MB, "
                f"{rep.bottleneck_us:.1f} us at {lk.capacity_gbps:g} GB/s"
            )
        rounds = " ".join(f"{t:.1f}" for t in rep.round_us)
        out.append(f"  predicted: {rep.predicted_us:.1f} us (rounds: {rounds} us)")
    if len(plan.reports) > 1:
        total = sum(r.predicted_us for r in plan.reports)
        out.append("")
        out.append(f"predicted total for the {len(plan.reports)} exchanges: {total:.1f} us")
    if plan.notes:
        out.append("")
        out.append("notes")
        out.extend(f"  - {note}" for note in plan.notes)
    return "\n".join(out)
