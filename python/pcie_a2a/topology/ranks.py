"""From the planner's per-GPU plan to what the CUDA transport of each rank needs.

The planner (:mod:`.planner`) speaks of topology GPUs; a transport speaks of ranks, which
are processes, each on one CUDA device, several possibly on one GPU. This module maps one
to the other and returns, per rank pair, P2P or staged; per sender, the destinations in
the planner's round order; per receiver, the NUMA node of its staging memory.

Which GPU a rank is on: by PCI bus id when the topology has bus ids (live discovery,
NCCL XML, our JSON); otherwise (``nvidia-smi topo -m`` text names GPUs only by nvidia-smi
index, which enumerates in PCI bus order) the i-th smallest bus id among the ranks' GPUs
is GPU i, which holds when the ranks use every GPU of the box. Anything else gives no
mapping: the caller keeps its default plan and says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .model import Topology, normalise_bus_id
from .planner import P2P, TransferPlan


@dataclass(frozen=True)
class RankTransfers:
    """What a transport reads, per rank pair ``[src][dst]`` (sender first; the diagonal is
    a rank to itself: p2p, push, sm, phase -1).

    ``pair_direction``: "push" (the sender stores rows into the receiver's memory) or "pull"
    (the sender release-stores a ready flag into the receiver's memory, the receiver loads
    the rows and writes a consumed flag back). ``pair_engine``: "sm" (kernel loads/stores;
    the transport may still use the copy engine for large normal-mode pairs) or
    "copy_engine" (whatever the size). ``pair_phase``: the round in which src sends to dst
    (the rounds are ``send_order``); when ``phased`` the rounds must not overlap for pushing
    pairs: a sender starts round r + 1 only after its round r rows are out (the collapse
    trigger, :mod:`.roots`). ``reasons[src][dst]``: "path; direction; engine" for logs."""

    gpus: tuple[int, ...]  # topology GPU of each rank
    pair_transport: tuple[tuple[str, ...], ...]  # [src][dst]: "p2p" or "staged"
    send_order: tuple[tuple[int, ...], ...]  # per sender: every rank once, itself last
    staging_numa: tuple[int | None, ...]  # per receiver: NUMA node of its staging memory
    how: str  # how ranks were matched to GPUs (for logs)
    pair_direction: tuple[tuple[str, ...], ...] = ()  # [src][dst]: "push" or "pull"
    pair_engine: tuple[tuple[str, ...], ...] = ()  # [src][dst]: "sm" or "copy_engine"
    pair_phase: tuple[tuple[int, ...], ...] = ()  # [src][dst]: round, -1 for oneself
    phased: bool = False
    reasons: tuple[tuple[str, ...], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The decisions as plain data (what ``Buffer.stats()`` records)."""
        world = len(self.gpus)
        return {
            "how": self.how,
            "gpus": list(self.gpus),
            "phased": self.phased,
            "send_order": [list(o) for o in self.send_order],
            "staging_numa": list(self.staging_numa),
            "pairs": [
                {
                    "src": s,
                    "dst": d,
                    "path": self.pair_transport[s][d],
                    "direction": self.pair_direction[s][d] if self.pair_direction else "push",
                    "engine": self.pair_engine[s][d] if self.pair_engine else "sm",
                    "phase": self.pair_phase[s][d] if self.pair_phase else -1,
                    "reason": self.reasons[s][d] if self.reasons else "",
                }
                for s in range(world)
                for d in range(world)
                if s != d
            ],
        }


def match_ranks(topology: Topology, rank_bus_ids: Sequence[str]) -> tuple[list[int], str]:
    """Topology GPU of each rank, and how they were matched. Raises ValueError saying why
    when they cannot be."""
    ids = [normalise_bus_id(b) for b in rank_bus_ids]
    by_bus = {normalise_bus_id(g.bus_id): g.index for g in topology.gpus if g.bus_id}
    if by_bus:
        missing = sorted({b for b in ids if b not in by_bus})
        if missing:
            raise ValueError(
                f"GPUs {', '.join(missing)} of the ranks are not in the topology "
                f"({topology.source}: {', '.join(sorted(by_bus))})"
            )
        return [by_bus[b] for b in ids], "by PCI bus id"
    distinct = sorted(set(ids))
    if len(distinct) != topology.num_gpus:
        raise ValueError(
            f"{topology.source} names GPUs by index only and has {topology.num_gpus}, but the "
            f"ranks use {len(distinct)}: cannot tell which GPU each rank is on"
        )
    order = {b: i for i, b in enumerate(distinct)}
    return [order[b] for b in ids], "by PCI bus order (nvidia-smi index)"


def default_send_order(world: int) -> list[tuple[int, ...]]:
    """``rank + 1, rank + 2, ..., rank`` per sender: ranks do not all start at rank 0."""
    return [tuple((s + i) % world for i in range(1, world + 1)) for s in range(world)]


def _rank_order(rank: int, gpus: list[int], plan: TransferPlan) -> tuple[int, ...] | None:
    """The planner's rounds as rank destinations when ranks and GPUs are one to one."""
    if len(set(gpus)) != len(gpus) or len(gpus) != plan.num_gpus:
        return None
    rank_of = {g: r for r, g in enumerate(gpus)}
    return (*(rank_of[rnd[gpus[rank]]] for rnd in plan.rounds), rank)


def rank_transfers(
    topology: Topology, plan: TransferPlan, rank_bus_ids: Sequence[str]
) -> RankTransfers:
    """The transport plan of every rank (see the module comment). Ranks on one GPU reach
    each other through CUDA IPC on that device (P2P). The send order follows the
    planner's rounds when every rank has its own GPU of the topology, else the default
    ``rank + 1, rank + 2, ..., rank``."""
    if plan.num_gpus != topology.num_gpus:
        raise ValueError(
            f"the plan has {plan.num_gpus} GPUs, the topology {topology.num_gpus}: "
            "plan this topology"
        )
    gpus, how = match_ranks(topology, rank_bus_ids)
    world = len(gpus)

    def table(field: str, same: Any) -> tuple[tuple[Any, ...], ...]:
        return tuple(
            tuple(
                same if gpus[s] == gpus[d] else getattr(plan.pair(gpus[s], gpus[d]), field)
                for d in range(world)
            )
            for s in range(world)
        )

    pairs = table("transport", P2P)
    default = default_send_order(world)
    orders = tuple(_rank_order(s, gpus, plan) or default[s] for s in range(world))
    one_to_one = all(_rank_order(s, gpus, plan) is not None for s in range(world))
    # Phases are the planner's rounds only when every rank has its own GPU; otherwise a
    # rank's position in the default order.
    phases = (
        table("phase", -1)
        if one_to_one
        else tuple(
            tuple(-1 if s == d else orders[s].index(d) for d in range(world)) for s in range(world)
        )
    )
    reasons = tuple(
        tuple(
            "same GPU (CUDA IPC)"
            if gpus[s] == gpus[d]
            else "; ".join(
                (
                    q.reason,
                    q.direction_reason or q.direction,
                    q.engine_reason or q.engine,
                )
            )
            for d in range(world)
            for q in [None if gpus[s] == gpus[d] else plan.pair(gpus[s], gpus[d])]
        )
        for s in range(world)
    )
    numa = tuple(topology.gpus[g].numa_node for g in gpus)
    return RankTransfers(
        tuple(gpus),
        pairs,
        orders,
        numa,
        how,
        pair_direction=table("direction", "push"),
        pair_engine=table("engine", "sm"),
        pair_phase=phases,
        phased=plan.phased and one_to_one,
        reasons=reasons,
    )
