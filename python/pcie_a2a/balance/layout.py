"""Array form of one layer's placement, as the balancer works on it, and the conversions.

``slots [W, n]`` holds the logical expert of every physical slot: rank ``r``'s local index
``l`` is physical expert ``r * n + l``, SGLang's numbering (``physical_to_logical_map`` is
``slots.reshape(-1)``). Every rank has the same number of slots, as SGLang and DeepSeek's
EPLB require.

``frac [W, E, R]``: the share of source ``s``'s tokens for expert ``e`` that go to ``e``'s
``j``-th replica (replicas in ascending physical order), as the wire layer splits them: the
modulo rule gives every replica the same share; a choice table gives each listed candidate
its multiplicity over the list's length.
"""

from __future__ import annotations

import numpy as np

from ..placement import Placement


def check_slots(slots: np.ndarray, num_experts: int) -> np.ndarray:
    s = np.asarray(slots)
    if s.ndim != 2 or s.shape[1] < 1:
        raise ValueError(f"slots: got shape {s.shape}; allowed: [world, slots per rank]")
    if s.size and (s.min() < 0 or s.max() >= num_experts):
        raise ValueError(f"slots: expert ids must be in [0, {num_experts})")
    missing = np.setdiff1d(np.arange(num_experts), s.reshape(-1))
    if missing.size:
        raise ValueError(f"slots: experts {missing[:8].tolist()} have no replica")
    return s.astype(np.int64)


def replica_table(slots: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(rank [E, R], physical id [E, R]) of each expert's replicas, -1 padded, ascending."""
    n = slots.shape[1]
    flat = slots.reshape(-1)
    count = np.bincount(flat, minlength=num_experts)
    r_max = int(count.max())
    order = np.argsort(flat, kind="stable")  # physical ids grouped by expert, ascending
    start = np.concatenate(([0], np.cumsum(count)[:-1]))
    pos = np.arange(flat.size) - np.repeat(start, count)
    phys = np.full((num_experts, r_max), -1, dtype=np.int64)
    phys[flat[order], pos] = order
    rank = np.where(phys >= 0, phys // n, -1)
    return rank, phys


def nearest_fractions(rank: np.ndarray, near: np.ndarray) -> np.ndarray:
    """``frac [W, E, R]`` of the nearest-replica rule: each source splits an expert's tokens
    equally over the replicas nearest to it (``near[s, d]``: larger is nearer)."""
    valid = rank >= 0
    nr = np.where(valid[None], near[:, np.maximum(rank, 0)], -1)  # [W, E, R]
    best = nr.max(axis=2, keepdims=True)
    mask = (nr == best) & valid[None]
    return mask / mask.sum(axis=2, keepdims=True)


def uniform_fractions(rank: np.ndarray, world: int) -> np.ndarray:
    valid = rank >= 0
    f = valid / valid.sum(axis=1, keepdims=True)
    return np.broadcast_to(f, (world, *rank.shape)).copy()


def to_placement(slots: np.ndarray, num_experts: int, near: np.ndarray | None) -> Placement:
    """A :class:`Placement` (replicas in physical order) with the nearest-replica choice
    table (``near`` given) or the modulo rule (``near`` None)."""
    slots = check_slots(slots, num_experts)
    w, n = slots.shape
    rank, phys = replica_table(slots, num_experts)
    replicas = [[(int(p // n), int(p % n)) for p in phys[e] if p >= 0] for e in range(num_experts)]
    if near is None:
        return Placement(replicas, w)
    frac = nearest_fractions(rank, near)
    choice = [
        [np.flatnonzero(frac[s, e] > 0).tolist() for e in range(num_experts)] for s in range(w)
    ]
    return Placement(replicas, w, choice)


def from_placement(p: Placement) -> np.ndarray:
    """``slots [W, n]`` of a placement whose ranks hold the same number of experts."""
    counts = {p.num_local_experts(r) for r in range(p.world)}
    if len(counts) != 1:
        raise ValueError(
            f"placement: ranks hold {sorted(counts)} experts; allowed: the same number on "
            "every rank (SGLang's physical expert layout)"
        )
    return np.array([p.local_experts(r) for r in range(p.world)], dtype=np.int64)


def placement_fractions(p: Placement) -> tuple[np.ndarray, np.ndarray]:
    """(rank [E, R], frac [W, E, R]) of any placement, as the wire layer splits tokens."""
    e_n, w = p.num_experts, p.world
    r_max = max(len(r) for r in p.replicas)
    rank = np.full((e_n, r_max), -1, dtype=np.int64)
    for e, reps in enumerate(p.replicas):
        rank[e, : len(reps)] = [r for r, _ in reps]
    if p.choice is None:
        return rank, uniform_fractions(rank, w)
    frac = np.zeros((w, e_n, r_max))
    for s in range(w):
        for e, cand in enumerate(p.choice[s]):
            np.add.at(frac[s, e], cand, 1.0 / len(cand))
    return rank, frac
