"""Packing over the island tree (step 2 of :mod:`.algorithm`): an island's copies of its
experts are shared out among its children, top down, with the loads the nearest-replica
rule will produce."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


# ---- the island tree ------------------------------------------------------------------------
@dataclass
class _Node:
    ranks: list[int]
    children: list[_Node]

    @property
    def rank(self) -> int | None:
        return self.ranks[0] if not self.children else None


def island_tree(paths: Sequence[Sequence[str]]) -> _Node:
    """Trie of the rank paths; a node with one child is that child."""

    def build(ranks: list[int], depth: int) -> _Node:
        if len(ranks) == 1:
            return _Node(ranks, [])
        groups: dict[str, list[int]] = {}
        leaves = []
        for r in ranks:
            if depth < len(paths[r]):
                groups.setdefault(paths[r][depth], []).append(r)
            else:
                leaves.append(r)
        kids = [build(g, depth + 1) for g in groups.values()] + [_Node([r], []) for r in leaves]
        return kids[0] if len(kids) == 1 else _Node(sorted(ranks), kids)

    return build(list(range(len(paths))), 0)


# ---- packing ---------------------------------------------------------------------------------
class Packer:
    def __init__(self, src, counts, n_slots, scale, cost, prev_ranks, move_us):
        self.src = src  # [W, E] assignments from each source over the window
        self.counts = counts
        self.n = n_slots
        self.scale = scale
        self.cost = cost
        self.prev = prev_ranks  # list of sets: ranks that held expert e, or None
        self.move_us = move_us
        self.out: list[list[int]] = [[] for _ in range(src.shape[0])]

    def place(self, node: _Node, items: list[tuple[int, int, float]]) -> None:
        if node.rank is not None:
            self.out[node.rank].extend(e for e, _, _ in items)
            return
        kids = node.children
        k = len(kids)
        cap = np.array([self.n * len(c.ranks) for c in kids], dtype=np.float64)
        max_c = np.array([len(c.ranks) for c in kids])
        own = np.stack([self.src[c.ranks].sum(axis=0) for c in kids])  # [k, E]
        free = cap.copy()
        time = np.zeros(k)
        sub: list[list[tuple[int, int, float]]] = [[] for _ in range(k)]

        def per_replica(item):
            e, m, ext = item
            return (own[:, e].sum() + m * ext) / m

        # replicated experts first (their copies must land on distinct ranks), then by size
        for e, m, ext in sorted(items, key=lambda it: (it[1] < 2, -per_replica(it), it[0])):
            size = self.cost.expected(per_replica((e, m, ext)) * self.scale)
            cnt = np.zeros(k, dtype=np.int64)
            for _ in range(m):
                ok = (free - cnt >= 1) & (cnt < max_c)
                if not ok.any():
                    raise RuntimeError("balance: packing ran out of room (a bug)")
                low = ok & (cnt == cnt[ok].min())  # spread over children first
                score = (time + size * (cnt + 1)) / cap
                if self.prev is not None:
                    had = np.array([bool(self.prev[e] & set(c.ranks)) for c in kids])
                    score = score + np.where(had, 0.0, self.move_us / cap * cap.mean())
                cnt[int(np.flatnonzero(low)[np.argmin(score[low])])] += 1
            served = cnt > 0
            ext2 = ext + own[~served, e].sum() / m
            for i in np.flatnonzero(served):
                load = own[i, e] + cnt[i] * ext2
                time[i] += cnt[i] * self.cost.expected(load / cnt[i] * self.scale)
                free[i] -= cnt[i]
                sub[i].append((e, int(cnt[i]), ext2))
        for i, c in enumerate(kids):
            self.place(c, sub[i])
