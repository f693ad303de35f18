"""The baselines the balancer is compared with: contiguous blocks, and DeepSeek's EPLB as its
public description (deepseek-ai/EPLB README) states it. Written from that description;
no code is taken from it.

EPLB, global policy: replicate (each extra physical expert goes to the logical expert with
the highest load per replica), then pack the physical experts onto the GPUs by balanced
packing (heaviest first, each to the lightest GPU that still has a free slot; every GPU
gets the same number). Hierarchical policy (``num_groups % num_nodes == 0``): pack the
expert groups onto the nodes the same way (equal groups per node), replicate within each
node, then pack each node's physical experts onto its GPUs. It balances token counts only
and splits an expert's tokens equally over its replicas (the modulo rule here; SGLang's
static dispatch assigns each rank one replica instead, preferring one on its own GPU).

"Islands as nodes": on one PCIe box the nodes given to the hierarchical policy are the
children of the island tree's first branching level (the sockets of a dual-socket box, the
root switches of a one-socket switch box), which is as much of the topology as EPLB can be
told.
"""

from __future__ import annotations

import numpy as np

from .islands import Islands
from .pack import island_tree


def contiguous(num_experts: int, world: int) -> np.ndarray:
    """``slots [W, E / W]``: expert blocks, no replicas."""
    if num_experts % world:
        raise ValueError(f"{num_experts} experts do not split evenly over {world} ranks")
    return np.arange(num_experts).reshape(world, -1)


def balanced_packing(weights: np.ndarray, packs: int) -> np.ndarray:
    """Pack index of each item: heaviest first into the lightest pack with room, every
    pack taking ``len(weights) / packs`` items."""
    n = len(weights)
    if n % packs:
        raise ValueError(f"{n} items do not split evenly into {packs} packs")
    per = n // packs
    load = np.zeros(packs)
    fill = np.zeros(packs, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    for i in sorted(range(n), key=lambda i: (-weights[i], i)):
        open_ = np.flatnonzero(fill < per)
        p = int(open_[np.argmin(load[open_])])
        out[i] = p
        load[p] += weights[i]
        fill[p] += 1
    return out


def replicate(weights: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray]:
    """(logical expert of each physical expert, replica count per logical expert)."""
    e_n = len(weights)
    phys = list(range(e_n))
    count = np.ones(e_n, dtype=np.int64)
    for _ in range(num_physical - e_n):
        e = int(np.argmax(weights / count))
        phys.append(e)
        count[e] += 1
    return np.array(phys), count


def _pack(weights: np.ndarray, experts: np.ndarray, num_physical: int, gpus: list[int], out):
    phys, count = replicate(weights[experts], num_physical)
    per_replica = weights[experts][phys] / count[phys]
    pack = balanced_packing(per_replica, len(gpus))
    for p, g in zip(experts[phys], pack):
        out[gpus[g]].append(int(p))


def eplb(
    loads: np.ndarray,
    world: int,
    redundant: int,
    num_groups: int | None = None,
    nodes: list[list[int]] | None = None,
) -> np.ndarray:
    """``slots [W, (E + redundant) / W]``. ``nodes`` (lists of ranks) with ``num_groups``
    divisible by their number select the hierarchical policy; otherwise global."""
    loads = np.asarray(loads, dtype=np.float64)
    e_n = loads.size
    total = e_n + redundant
    if total % world:
        raise ValueError(f"{total} physical experts do not split evenly over {world} ranks")
    out: list[list[int]] = [[] for _ in range(world)]
    hier = nodes is not None and num_groups is not None and num_groups % len(nodes) == 0
    if not hier:
        _pack(loads, np.arange(e_n), total, list(range(world)), out)
    else:
        if e_n % num_groups or total % len(nodes) or any(len(n) != len(nodes[0]) for n in nodes):
            raise ValueError("hierarchical EPLB needs equal groups, nodes and GPUs per node")
        size = e_n // num_groups
        group_load = loads.reshape(num_groups, size).sum(axis=1)
        node_of = balanced_packing(group_load, len(nodes))
        for k, ranks in enumerate(nodes):
            groups = np.flatnonzero(node_of == k)
            experts = (groups[:, None] * size + np.arange(size)[None]).reshape(-1)
            _pack(loads, experts, total // len(nodes), list(ranks), out)
    return np.array([sorted(r) for r in out], dtype=np.int64)


def island_nodes(islands: Islands) -> list[list[int]]:
    """The ranks under each child of the island tree's first branching level."""
    tree = island_tree(islands.paths)
    return [c.ranks for c in tree.children] if tree.children else [tree.ranks]
