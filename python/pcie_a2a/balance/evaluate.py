"""What a placement does to one layer's step: rank loads, the expert GEMM time per rank, the
rows and bytes on every link, and the predicted time of dispatch + experts + combine.

Two ways in:

* :func:`expected` from loads alone (``[E]`` token counts over a window, optionally each
  source rank's share): rows per replica follow the wire layer's split; a token from source
  ``s`` reaches rank ``d`` unless none of its experts is sent there, estimated as
  ``1 - prod_e (1 - p(s, e) f(s, e, d))`` with ``p`` the chance a token picks ``e`` and ``f``
  the share of ``e``'s tokens that ``s`` sends to ``d`` (experts taken as independent; a
  token's experts are distinct, so it reaches slightly more ranks than that: on Zipf(1.0)
  Kimi-K2-shaped routing the estimate is ~3% low in rows);
* :func:`simulate` on routed tokens (``topk_ids`` per step and source), applying the exact
  replica rule of csrc/core/routing.h token by token: rank counts and rows are counted, not
  estimated.

Times: each rank's GEMM is the sum of :class:`~.cost.GemmCost` over its replicas (Poisson
rows for :func:`expected`, the counted rows for :func:`simulate`); dispatch and combine are
the transfer planner's prediction for the resulting traffic matrices (its per-pair paths,
bandwidths and send rounds), or, for islands without a plan, the busiest link's bytes at its
capacity. Step = dispatch + slowest rank's GEMM + combine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..placement import Placement
from ..topology.planner import Traffic, with_reports
from .cost import GemmCost, RowBytes
from .islands import Islands, is_socket_link, is_switch_uplink
from .layout import placement_fractions


@dataclass(frozen=True)
class Workload:
    """One layer's routing statistics and the step they are judged at."""

    loads: np.ndarray  # [E] token-expert assignments over a window
    share: np.ndarray | None = None  # [W, E] each source's share of an expert (None: equal)
    tokens_per_step: int = 128  # tokens per rank in one step (decode batch per rank)
    top_k: int = 8

    def source_loads(self, world: int) -> np.ndarray:
        """``[W, E]`` assignments from each source."""
        loads = np.asarray(self.loads, dtype=np.float64)
        if self.share is None:
            return np.broadcast_to(loads / world, (world, loads.size)).copy()
        return np.asarray(self.share, dtype=np.float64) * loads[None]

    def per_step(self, world: int) -> float:
        """Assignments per step over the window's assignments."""
        total = float(np.asarray(self.loads).sum())
        return world * self.tokens_per_step * self.top_k / total if total > 0 else 0.0


@dataclass(frozen=True)
class Metrics:
    rank_load: np.ndarray  # [W] assignments per step
    rank_gemm_us: np.ndarray  # [W]
    rows: np.ndarray  # [W, W] dispatch rows per step (s -> d)
    link_bytes: dict[str, float]  # per step, dispatch + combine
    dispatch_us: float
    combine_us: float
    time_source: str  # "planner" or "bottleneck link"

    @property
    def max_mean(self) -> float:
        mean = float(self.rank_load.mean())
        return float(self.rank_load.max()) / mean if mean > 0 else 1.0

    @property
    def gemm_us(self) -> float:
        return float(self.rank_gemm_us.max())

    @property
    def step_us(self) -> float:
        return self.dispatch_us + self.gemm_us + self.combine_us

    @property
    def socket_bytes(self) -> float:
        return sum(v for k, v in self.link_bytes.items() if is_socket_link(k))

    @property
    def uplink_bytes(self) -> float:
        return sum(v for k, v in self.link_bytes.items() if is_switch_uplink(k))


def _exchange(
    rows: np.ndarray, islands: Islands, row_bytes: RowBytes
) -> tuple[dict[str, float], float, float, str]:
    w = islands.world
    rows = rows * (1 - np.eye(w))
    lm = islands.link_matrix()
    ids = islands.link_ids()
    per = row_bytes.dispatch * np.einsum("sd,sdl->l", rows, lm) + row_bytes.combine * np.einsum(
        "sd,dsl->l", rows, lm
    )
    link_bytes = {k: float(per[i]) for i, k in enumerate(ids)}
    if islands.plan is not None:
        n = islands.plan.num_gpus
        disp, comb = np.zeros((n, n)), np.zeros((n, n))
        for s in range(w):
            for d in range(w):
                gs, gd = islands.gpus[s], islands.gpus[d]
                if gs != gd:
                    disp[gs, gd] += rows[s, d] * row_bytes.dispatch
                    comb[gd, gs] += rows[s, d] * row_bytes.combine
        rep = with_reports(
            islands.plan,
            [
                Traffic("dispatch", tuple(map(tuple, disp))),
                Traffic("combine", tuple(map(tuple, comb))),
            ],
        ).reports
        return link_bytes, rep[0].predicted_us, rep[1].predicted_us, "planner"
    caps = dict(islands.link_gbps)
    d_us = c_us = 0.0
    for i, k in enumerate(ids):
        d_b = row_bytes.dispatch * float(np.einsum("sd,sd->", rows, lm[:, :, i]))
        c_b = row_bytes.combine * float(np.einsum("sd,ds->", rows, lm[:, :, i]))
        d_us = max(d_us, d_b / (caps[k] * 1e3))
        c_us = max(c_us, c_b / (caps[k] * 1e3))
    return link_bytes, d_us, c_us, "bottleneck link"


def _rank_sum(rank: np.ndarray, values: np.ndarray, world: int) -> np.ndarray:
    valid = rank >= 0
    return np.bincount(rank[valid], weights=values[valid], minlength=world)


def expected(
    placement: Placement,
    work: Workload,
    islands: Islands,
    cost: GemmCost,
    row_bytes: RowBytes,
) -> Metrics:
    """Metrics from loads (see the module docstring)."""
    w = placement.world
    if islands.world != w:
        raise ValueError(f"islands have {islands.world} ranks, the placement {w}")
    rank, frac = placement_fractions(placement)
    src = work.source_loads(w)  # [W, E]
    scale = work.per_step(w)
    rep = np.einsum("se,ser->er", src, frac) * scale  # rows per step per replica
    rank_load = _rank_sum(rank, rep, w)
    rank_gemm = _rank_sum(rank, cost.expected(rep), w)
    # p[s, e]: chance a token of s picks e; f[s, e, d]: share of those sent to d
    p = np.minimum(src * scale / max(work.tokens_per_step, 1), 1.0)
    onehot = (rank[..., None] == np.arange(w)).astype(np.float64)  # [E, R, W]
    f = np.einsum("ser,erd->sed", frac, onehot)
    miss = np.log1p(-np.minimum(p[..., None] * f, 1 - 1e-12)).sum(axis=1)  # [W, W]
    rows = work.tokens_per_step * (1 - np.exp(miss))
    link_bytes, d_us, c_us, how = _exchange(rows, islands, row_bytes)
    return Metrics(rank_load, rank_gemm, rows, link_bytes, d_us, c_us, how)


def simulate(
    placement: Placement,
    steps: Sequence[Sequence[np.ndarray]],
    max_tokens: int,
    islands: Islands,
    cost: GemmCost,
    row_bytes: RowBytes,
) -> Metrics:
    """Metrics averaged over ``steps[i][s]`` = source ``s``'s ``topk_ids [T, K]`` (-1 =
    none) in step ``i``, routed exactly as the wire layer routes them."""
    w, e_n = placement.world, placement.num_experts
    if not steps:
        raise ValueError("steps: got none; allowed: at least one step of routed tokens")
    offset = np.cumsum([0] + [len(r) for r in placement.replicas])
    rank_of = np.array([r for reps in placement.replicas for r, _ in reps])
    cands = []  # per source: candidate replica indices [E, C] and their count [E]
    for s in range(w):
        lists = (
            [list(range(offset[e], offset[e + 1])) for e in range(e_n)]
            if placement.choice is None
            else [[offset[e] + j for j in placement.choice[s][e]] for e in range(e_n)]
        )
        c_max = max(len(c) for c in lists)
        arr = np.zeros((e_n, c_max), dtype=np.int64)
        for e, c in enumerate(lists):
            arr[e, : len(c)] = c
        cands.append((arr, np.array([len(c) for c in lists])))
    n_rep = int(offset[-1])
    rank_load = np.zeros(w)
    gemm = np.zeros(w)
    rows = np.zeros((w, w))
    for step in steps:
        if len(step) != w:
            raise ValueError(f"steps: a step has {len(step)} sources, the placement {w} ranks")
        rep_rows = np.zeros(n_rep)
        for s, ids in enumerate(step):
            ids = np.asarray(ids, dtype=np.int64).reshape(len(ids), -1)
            if ids.shape[0] > max_tokens:
                raise ValueError(f"steps: source {s} has {ids.shape[0]} > max_tokens tokens")
            arr, n = cands[s]
            g = (s * max_tokens + np.arange(ids.shape[0]))[:, None]
            e = np.maximum(ids, 0)
            chosen = arr[e, g % n[e]]
            valid = ids >= 0
            np.add.at(rep_rows, chosen[valid], 1.0)
            dest = np.where(valid, rank_of[chosen], -1)
            hit = (dest[..., None] == np.arange(w)).any(axis=1)  # [T, W]
            rows[s] += hit.sum(axis=0)
        rank_load += np.bincount(rank_of, weights=rep_rows, minlength=w)
        gemm += np.bincount(rank_of, weights=cost(rep_rows), minlength=w)
    k = len(steps)
    rows /= k
    link_bytes, d_us, c_us, how = _exchange(rows, islands, row_bytes)
    return Metrics(rank_load / k, gemm / k, rows, link_bytes, d_us, c_us, how)
