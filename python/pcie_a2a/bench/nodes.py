"""``pcie-a2a bench --nodes N``: the pcie_a2a arm through the multi-node Buffer
(:class:`pcie_a2a.internode.buffer.InternodeBuffer`) next to the flat per-expert
all-to-all (``a2a``), in the same loop.

Spawned ranks are one host split into N nodes of R/N consecutive ranks
(``PCIE_A2A_LOCAL_WORLD_SIZE``): simulated nodes, whose "inter-node" links are the same
loopback and shared memory as the rest, so the times say what the protocol costs on one
box, not what a NIC would give. What carries over to real nodes are the inter-node bytes:
pcie_a2a's are measured (``Buffer.stats()["last_internode_bytes"]``), the flat
all-to-all's are counted from the routing (every (token, expert) row whose expert's rank is
on another node, bf16, both ways; its small counts exchange is left out).
"""

from __future__ import annotations

ENV = "PCIE_A2A_LOCAL_WORLD_SIZE"
FLAT = "a2a"


def why_not(nodes: int, world: int, backend: str) -> str | None:
    """Why ``--nodes`` cannot run (an error text naming the option), or None."""
    if nodes < 1:
        return f"--nodes: got {nodes}; allowed: a positive int"
    if world % nodes:
        return f"--nodes: got {nodes}; allowed: a divisor of the world size ({world})"
    if nodes > 1 and backend != "cpu":
        return (
            f"--nodes: got {nodes} with --backend {backend}; allowed: 1 (the CUDA inter-node "
            "stage, NCCL between nodes and per-node packing kernels, is not built; "
            "use --backend cpu)"
        )
    return None


def local_world(cfg: dict, world: int) -> int | None:
    """Ranks per node for the spawned ranks, or None with one node."""
    nodes = cfg.get("nodes", 1)
    return world // nodes if nodes > 1 else None


def flat_bytes(ids, num_experts: int, world: int, rank: int, per_node: int, hidden: int):
    """(dispatch, combine) bytes the flat per-expert all-to-all sends from ``rank`` to
    ranks on other nodes: one bf16 row per slot whose expert lives there, each way."""
    ids = ids[ids >= 0]
    dest = ids // (num_experts // world)
    rows = int((dest // per_node != rank // per_node).sum())
    return rows * 2 * hidden, rows * 2 * hidden


def lines(summary: list[dict], cfg: dict, world: int, torchrun: bool) -> list[str]:
    """What --nodes adds to the report: the layout, then per config both arms' p50s, the
    ratio and the inter-node bytes per rank per call."""
    nodes = cfg["nodes"]
    where = (
        "torchrun's hosts, split by PCIE_A2A_LOCAL_WORLD_SIZE"
        if torchrun
        else "SIMULATED on one host (PCIE_A2A_LOCAL_WORLD_SIZE); the links between "
        "nodes are this host's, so times are not a NIC's; the bytes carry over"
    )
    out = [f"nodes: {nodes} x {world // nodes} ranks, {where}"]
    for res in summary:
        inter = res.get("internode")
        if not inter or "methods" not in res:
            continue
        ours = res["methods"]["pcie_a2a"]["phases"]["disp+comb"]["p50_us"]
        head = (
            f"tokens={res['tokens']:<5} payload={res['payload']:<4} "
            f"routing={res['routing']:<7}: pcie_a2a ({nodes} nodes) dispatch+combine p50 "
            f"{ours:.0f} µs"
        )
        flat = res["methods"].get(FLAT, {})
        if "phases" in flat:
            base = flat["phases"]["disp+comb"]["p50_us"]
            head += f", flat a2a {base:.0f} µs = {base / max(ours, 1e-9):.3f}x"
        out.append(head)
        for name, label in (("pcie_a2a", "measured"), (FLAT, "rows to other nodes x 2H")):
            d, c = inter[name]
            out.append(
                f"  inter-node bytes/rank/call {name:<8} dispatch {d:.0f} + combine "
                f"{c:.0f} = {d + c:.0f} ({label})"
            )
    return out
