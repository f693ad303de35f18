"""Moving a MoE layer's experts to a new placement, collectively over its process group.

Protocol (every rank of the group calls :func:`move_experts` with the same placement):

1. **Agree** (``all_gather_object``): the same new placement, experts of the same kind and
   shapes, and no call in flight on any rank. A rank only gets here after its last forward
   returned, and a forward returns only after its combine received every peer's rows; so
   once every rank has agreed, no rank is still inside a call of the old placement and no
   peer can send one. Any disagreement raises on every rank, nothing changed.
2. **Move**: each new (rank, local index) takes its weights from its own old copy when the
   rank already held the expert, otherwise from one old replica (chosen by expert id, so
   sends spread over the replicas); point-to-point sends and receives of one packed byte
   buffer per expert, in one global order (a pair's messages match in order). Through the
   CPU for a gloo group.
3. **Report** (``all_gather_object``): a rank that failed to unpack says so and every rank
   raises; otherwise each returns its new experts, built without touching the old ones.
   The caller switches to them and to a Buffer of the new placement only then.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from pcie_a2a.placement import Placement

from .experts import Experts


def placement_digest(p: Placement) -> str:
    return hashlib.sha256(json.dumps(p.to_dict(), sort_keys=True).encode()).hexdigest()


def _signature(experts: Experts) -> list:
    return [type(experts).__name__] + [
        (str(t.dtype), tuple(t.shape[1:])) for t in experts.expert_tensors()
    ]


def _pack(tensors: list[torch.Tensor], local: int, device: torch.device) -> torch.Tensor:
    parts = [t[local].contiguous().view(torch.uint8).reshape(-1) for t in tensors]
    return torch.cat(parts).to(device)


def _unpack(buf: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in like:
        n = t[0].numel() * t.element_size()
        out.append(buf[at : at + n].view(t.dtype).reshape(t.shape[1:]))
        at += n
    return out


def move_experts(
    experts: Experts,
    old: Placement,
    new: Placement,
    rank: int,
    group: dist.ProcessGroup | None,
    busy: str | None = None,
) -> Experts:
    """This rank's experts under ``new`` (collective; see the module docstring). ``busy``:
    why this rank cannot rebalance now (a call in flight), or None."""
    world = dist.get_world_size(group)
    tensors = experts.expert_tensors()
    mine = (placement_digest(new), _signature(experts), busy)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    problems = []
    if len({g[0] for g in gathered}) > 1:
        problems.append("the new placement differs between ranks; every rank must pass the same")
    if len({json.dumps(g[1]) for g in gathered}) > 1:
        problems.append("the ranks' experts differ in kind or shape")
    problems += [f"rank {r}: {g[2]}" for r, g in enumerate(gathered) if g[2]]
    if problems:
        raise ValueError("MoE.rebalance: " + "; ".join(problems) + " (nothing was changed)")

    gloo = dist.get_backend(group) == "gloo"
    dev = tensors[0].device
    wire = torch.device("cpu") if gloo else dev
    plan = []  # (src rank, src local, dst rank, dst local) in one global order
    for dst in range(world):
        for dst_local, e in enumerate(new.local_experts(dst)):
            held = [(r, l) for r, l in old.replicas[e]]
            own = [l for r, l in held if r == dst]
            src, src_local = (dst, own[0]) if own else held[e % len(held)]
            plan.append((src, src_local, dst, dst_local))

    def peer(r: int) -> int:  # P2POp takes global ranks
        return r if group is None else dist.get_global_rank(group, r)

    ops, recv = [], {}
    for src, src_local, dst, dst_local in plan:
        if src == dst:
            continue
        if src == rank:
            ops.append(dist.P2POp(dist.isend, _pack(tensors, src_local, wire), peer(dst), group))
        elif dst == rank:
            n = sum(t[0].numel() * t.element_size() for t in tensors)
            recv[dst_local] = torch.empty(n, dtype=torch.uint8, device=wire)
            ops.append(dist.P2POp(dist.irecv, recv[dst_local], peer(src), group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    error = None
    out = None
    try:
        per_local = []
        for src, src_local, dst, dst_local in plan:
            if dst != rank:
                continue
            if src == rank:
                per_local.append([t[src_local] for t in tensors])
            else:
                per_local.append([p.to(dev) for p in _unpack(recv[dst_local], tensors)])
        stacked = [torch.stack([p[i] for p in per_local]) for i in range(len(tensors))]
        out = experts.with_expert_tensors(stacked)
    except Exception as exc:  # reported to every rank below
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    errors: list = [None] * world
    dist.all_gather_object(errors, error, group=group)
    failed = [e for e in errors if e]
    if failed:
        raise RuntimeError("MoE.rebalance failed, the old placement stays: " + "; ".join(failed))
    return out
