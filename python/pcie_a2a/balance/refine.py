"""Refinement on the ranks (step 3 of :mod:`.algorithm`): swaps of single-replica experts
between the rank that sets the measure and any other."""

from __future__ import annotations

from math import comb
from typing import NamedTuple

import numpy as np

from .islands import Islands
from .layout import nearest_fractions, replica_table
from .options import Options


class _Swaps(NamedTuple):
    """Candidate swaps of single ``xs[i]`` on rank ``a`` with single ``oj[j]`` on rank
    ``ob[j]``; each array is ``[len(xs), len(ob)]``."""

    a: int
    xs: np.ndarray
    ob: np.ndarray
    oj: np.ndarray
    count_pair: np.ndarray  # the larger count of the two ranks after the swap
    count_max: np.ndarray  # the largest count over all ranks after the swap
    time_pair: np.ndarray  # the larger GEMM time of the two ranks after the swap
    step: np.ndarray | None  # the step objective after the swap (with links)
    d_pen: np.ndarray  # change of the move penalty


class Refiner:
    """Swaps of single-replica experts between ranks (see the module docstring). A single
    replica serves every source wherever it is, so its rows and GEMM time move with it;
    its link bytes depend on the rank (``v``)."""

    def __init__(self, slots, src, counts, near, islands: Islands, opt: Options, scale, prev):
        self.slots, self.opt = slots, opt
        w, n = slots.shape
        e_n = counts.size
        rank, _ = replica_table(slots, e_n)
        frac = nearest_fractions(rank, near)
        per_src = src * scale  # [W, E] assignments per step from each source
        rep_rows = np.einsum("se,ser->er", per_src, frac)
        j_of = np.array(
            [[int(np.flatnonzero(rank[e] == r)[0]) for e in slots[r]] for r in range(w)]
        )
        self.rows = rep_rows[slots, j_of]  # [W, n] rows per step of each slot's replica
        self.cost = opt.cost.expected(self.rows)
        self.single = counts[slots] == 1
        lm = islands.link_matrix()  # [W, W, L]
        self.caps = np.array([c for _, c in islands.link_gbps] or [1.0]) * 1e3  # bytes / µs
        rb = opt.row_bytes
        # bytes per step if every assignment were a row, scaled to rows by the dedup of
        # uniform routing (a token sends one row per rank, not per expert)
        dedup = opt.top_k / max(_distinct_ranks(opt.top_k, w, e_n), 1.0)
        self.v = (
            rb.dispatch * np.einsum("se,sdl->edl", per_src, lm)
            + rb.combine * np.einsum("se,dsl->edl", per_src, lm)
        ) / dedup  # [E, W, L]: a single replica of e on rank d
        links = np.zeros(lm.shape[2])
        for r in range(w):
            for j in range(n):
                e = slots[r, j]
                if self.single[r, j]:
                    links += self.v[e, r]
                else:
                    f = per_src[:, e] * frac[:, e, j_of[r, j]]
                    links += (rb.dispatch * f @ lm[:, r] + rb.combine * f @ lm[r]) / dedup
        self.links = links
        self.pen = np.zeros((e_n, w))
        self.prev = prev is not None
        big = opt.cost.rows[-1]
        self.us_per_row = float(opt.cost(big) - opt.cost(big / 2)) / (big / 2)
        if prev is not None:
            for e in range(e_n):
                self.pen[e, [r for r in range(w) if r not in prev[e]]] = opt.move_us

    def total(self) -> float:
        """max rank GEMM time + busiest link time + move penalty (µs per step)."""
        t = self.cost.sum(axis=1).max()
        pen = self.pen[self.slots, np.arange(self.slots.shape[0])[:, None]].sum()
        return float(t + (self.links / self.caps).max() + pen)

    def _candidates(self, key: np.ndarray, with_links: bool) -> _Swaps | None:
        """Every swap of a single on the rank with the largest ``key`` with a single on
        another rank, and what each would make of the counts, times and step objective."""
        s, w = self.slots, self.slots.shape[0]
        a = int(np.argmax(key))
        xs = np.flatnonzero(self.single[a])
        ob, oj = np.nonzero(self.single)
        keep = ob != a
        ob, oj = ob[keep], oj[keep]
        if not xs.size or not ob.size:
            return None
        ex, ey, b = s[a, xs][:, None], s[ob, oj][None, :], ob[None, :]

        def after(per_rank, val):
            """(new value of the larger of the two ranks, new largest over all ranks)."""
            vx, vy = val[a, xs][:, None], val[ob, oj][None, :]
            rest = np.array([np.delete(per_rank, [a, r]).max(initial=0.0) for r in range(w)])
            pair = np.maximum(per_rank[a] - vx + vy, per_rank[ob][None] - vy + vx)
            return pair, np.maximum(pair, rest[ob][None])

        c_pair, c_max = after(self.rows.sum(axis=1), self.rows)
        t_pair, t_max = after(self.cost.sum(axis=1), self.cost)
        d_pen = self.pen[ex, b] + self.pen[ey, a] - self.pen[ex, a] - self.pen[ey, b]
        step = None
        if with_links:  # only links near the busiest can become the busiest after one swap
            util = self.links / self.caps
            hot = np.flatnonzero(util >= 0.9 * util.max())
            v = self.v[:, :, hot]
            d_links = v[ex, b] + v[ey, a] - v[ex, a] - v[ey, b]
            link_t = ((self.links[hot] + d_links) / self.caps[hot]).max(axis=2)
            rest = np.delete(util, hot).max(initial=0.0)
            pen_now = self.total() - self.cost.sum(axis=1).max() - util.max()
            step = t_max + np.maximum(link_t, rest) + pen_now + d_pen
        return _Swaps(a, xs, ob, oj, c_pair, c_max, t_pair, step, d_pen)

    def _apply(self, a: int, x: int, b: int, y: int) -> None:
        s = self.slots
        ex, ey = s[a, x], s[b, y]
        self.links = self.links + self.v[ex, b] + self.v[ey, a] - self.v[ex, a] - self.v[ey, b]
        s[a, x], s[b, y] = ey, ex
        for arr in (self.rows, self.cost):
            arr[a, x], arr[b, y] = arr[b, y], arr[a, x]

    def _take(self, c: _Swaps, score: np.ndarray) -> None:
        i = np.unravel_index(int(np.argmin(score)), score.shape)
        self._apply(c.a, int(c.xs[i[0]]), int(c.ob[i[1]]), int(c.oj[i[1]]))

    def run(self) -> int:
        """Phase 1: the largest token count (GEMM time breaks ties). Phase 2: the step
        objective, the largest count staying within ``count_slack`` of phase 1's. A swap
        is taken when it lowers the pair's larger value below the measured rank's and
        raises no other: ties at the top then go down one rank at a time."""
        swaps = 0
        while swaps < self.opt.max_swaps:
            counts = self.rows.sum(axis=1)
            c = self._candidates(counts, False)
            if c is None:
                break
            ok = (c.count_pair < counts[c.a] * (1 - 1e-9)) & (c.count_max <= counts.max())
            if self.prev:  # a row off the slowest rank is worth a compute-bound row's time
                ok &= (counts[c.a] - c.count_pair) * self.us_per_row > c.d_pen + 1e-12
            if not ok.any():
                break
            self._take(c, np.where(ok, c.count_pair + 1e-6 * c.time_pair, np.inf))
            swaps += 1
        bound = self.rows.sum(axis=1).max() * (1 + self.opt.count_slack)
        current = self.total()
        while swaps < self.opt.max_swaps:
            times = self.cost.sum(axis=1)
            c = self._candidates(times, True)
            if c is None:
                break
            fits = c.count_max <= bound
            ok = fits & (c.step <= current + 1e-9) & (c.time_pair < times[c.a] - 1e-6)
            ok |= fits & (c.step < current * (1 - 1e-5))
            if not ok.any():
                break
            self._take(c, np.where(ok, c.step, np.inf))
            current = self.total()
            swaps += 1
        return swaps


def _distinct_ranks(top_k: int, world: int, e_n: int) -> float:
    """E[distinct ranks per token] under uniform routing (the dedup of rows)."""
    per = max(e_n // world, 1)
    if e_n - per < top_k:
        return float(min(world, top_k))
    return world * (1 - comb(e_n - per, top_k) / comb(e_n, top_k))
