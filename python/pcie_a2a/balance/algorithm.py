"""The balancer: replicate, pack over the PCIe tree, refine, choose replicas.

1. **Replicate.** Every expert gets one replica; each of the ``R`` extra slots goes to the
   expert with the highest load per replica (DeepSeek's rule), at most one replica per rank.
2. **Pack, top down over the island tree** (sockets, then host bridges / switches, then
   GPUs). At each island the replicas of its experts are shared out among its children,
   heaviest first (per-replica time), with two rules: an expert's replicas go to different
   children before any child gets a second (so a hot expert has a copy in every socket, then
   behind every switch), and otherwise to the child whose time per slot stays lowest. A
   child's time is the GEMM cost curve summed over its replicas at the rows each receives
   under the nearest-replica rule: sources in a child holding a copy use it; sources in a
   child without one are split over the island's copies; load arriving from outside the
   island is shared by all of its copies. So the loads the packer balances are the loads
   the wire layer will produce.
3. **Refine** on the ranks, by swaps of single-replica experts between the rank that sets
   the measure and any other: first the largest token count (the GEMM time breaks ties),
   then ``slowest rank's GEMM time + busiest link's time + move penalty`` while the largest
   count stays within ``count_slack`` of what the first phase reached. Counts first: the
   cost curve is an estimate until measured, counts are not, and in the compute-bound
   regime they are the time.
4. **Choose**: each source sends an expert's tokens to its nearest replicas (same GPU, same
   switch, same socket, then all), split equally (:func:`~.layout.nearest_fractions`).

A previous placement makes keeping an expert where it is worth ``move_us`` per step (its
weights cross PCIe to move: bytes / move bandwidth, amortised over the steps until the next
rebalance), in the packing's choices and in the refinement.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..placement import Placement
from .cost import KIMI_K2, GemmCost, RowBytes
from .islands import Islands
from .layout import check_slots, nearest_fractions, replica_table, to_placement


def _default_cost() -> GemmCost:
    return GemmCost.roofline()


@dataclass(frozen=True)
class Options:
    """How to balance. ``redundant`` extra replicas in all (``W * slots_per_rank - E``)."""

    redundant: int = 0
    tokens_per_step: int = 128  # tokens per rank per step: turns window counts into rows
    top_k: int = 8
    cost: GemmCost = field(default_factory=_default_cost)
    row_bytes: RowBytes = field(default_factory=RowBytes.for_model)
    expert_bytes: int = KIMI_K2.weight_bytes
    move_gbps: float = 25.0  # what moving weights gets over PCIe
    steps_between_rebalances: int = 1000
    count_slack: float = 0.0  # phase 2 may raise the largest token count by this fraction
    keep_margin: float = 0.002  # a new placement must beat the current one by this fraction
    max_swaps: int = 4000

    def __post_init__(self) -> None:
        for name in ("redundant",):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}: got {v!r}; allowed: an int >= 0")
        for name in ("tokens_per_step", "top_k", "steps_between_rebalances"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: got {v!r}; allowed: an int >= 1")
        if not self.move_gbps > 0:
            raise ValueError(f"move_gbps: got {self.move_gbps!r}; allowed: > 0")

    @property
    def move_us(self) -> float:
        """Per-step worth of not moving one expert."""
        return self.expert_bytes / (self.move_gbps * 1e3) / self.steps_between_rebalances


@dataclass(frozen=True)
class LayerResult:
    slots: np.ndarray  # [W, n] logical expert per physical slot
    placement: Placement  # with the nearest-replica choice table
    moved: int  # (rank, expert) pairs not held before (0 without a previous placement)


def slots_per_rank(num_experts: int, world: int, redundant: int) -> int:
    total = num_experts + redundant
    if total % world:
        raise ValueError(
            f"redundant: got {redundant}; {num_experts} experts + {redundant} redundant = "
            f"{total} slots do not split evenly over {world} ranks; allowed: a multiple of "
            f"{world} minus {num_experts % world or world} (e.g. "
            f"{(-num_experts) % world + world * ((redundant + world - 1) // world)})"
        )
    return total // world


def replicate(loads: np.ndarray, num_physical: int, max_per_expert: int) -> np.ndarray:
    """Replica count per expert: extra replicas one at a time to the highest load per
    replica (ties: lower expert id), at most ``max_per_expert`` each."""
    loads = np.asarray(loads, dtype=np.float64)
    e_n = loads.size
    if num_physical < e_n or num_physical > e_n * max_per_expert:
        raise ValueError(
            f"{num_physical} physical experts for {e_n} experts with at most "
            f"{max_per_expert} replicas each: allowed {e_n}..{e_n * max_per_expert}"
        )
    count = np.ones(e_n, dtype=np.int64)
    heap = [(-loads[e], e) for e in range(e_n)]
    heapq.heapify(heap)
    for _ in range(num_physical - e_n):
        while True:
            _, e = heapq.heappop(heap)
            if count[e] < max_per_expert:
                break
        count[e] += 1
        if count[e] < max_per_expert:
            heapq.heappush(heap, (-loads[e] / count[e], e))
    return count


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
class _Packer:
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


# ---- refinement ------------------------------------------------------------------------------
class _Refiner:
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

    def _candidates(self, key: np.ndarray, with_links: bool):
        """Every swap of a single on the rank with the largest ``key`` with a single on
        another rank: (a, xs, ob, oj, step objective or None, largest count) after each."""
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

        c_pair, c_new = after(self.rows.sum(axis=1), self.rows)
        t_pair, t_new = after(self.cost.sum(axis=1), self.cost)
        out = [a, xs, ob, oj, c_pair, c_new, t_pair, t_new]
        if not with_links:
            d_pen = self.pen[ex, b] + self.pen[ey, a] - self.pen[ex, a] - self.pen[ey, b]
            return [*out, None, d_pen]
        # only links near the busiest can become the busiest after one swap
        util = self.links / self.caps
        hot = np.flatnonzero(util >= 0.9 * util.max())
        v = self.v[:, :, hot]
        d_links = v[ex, b] + v[ey, a] - v[ex, a] - v[ey, b]
        link_t = ((self.links[hot] + d_links) / self.caps[hot]).max(axis=2)
        rest = np.delete(util, hot).max(initial=0.0)
        d_pen = self.pen[ex, b] + self.pen[ey, a] - self.pen[ex, a] - self.pen[ey, b]
        pen_now = self.total() - self.cost.sum(axis=1).max() - util.max()
        return [*out, t_new + np.maximum(link_t, rest) + pen_now + d_pen, d_pen]

    def _apply(self, a: int, x: int, b: int, y: int) -> None:
        s = self.slots
        ex, ey = s[a, x], s[b, y]
        self.links = self.links + self.v[ex, b] + self.v[ey, a] - self.v[ex, a] - self.v[ey, b]
        s[a, x], s[b, y] = ey, ex
        for arr in (self.rows, self.cost):
            arr[a, x], arr[b, y] = arr[b, y], arr[a, x]

    def _take(self, c, score: np.ndarray) -> None:
        i = np.unravel_index(int(np.argmin(score)), score.shape)
        a, xs, ob, oj = c[:4]
        self._apply(a, int(xs[i[0]]), int(ob[i[1]]), int(oj[i[1]]))

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
            a, c_pair, c_new = c[0], c[4], c[5]
            ok = (c_pair < counts[a] * (1 - 1e-9)) & (c_new <= counts.max())
            if self.prev:  # a row off the slowest rank is worth a compute-bound row's time
                ok &= (counts[a] - c_pair) * self.us_per_row > c[9] + 1e-12
            if not ok.any():
                break
            self._take(c, np.where(ok, c_pair + 1e-6 * c[7], np.inf))
            swaps += 1
        bound = self.rows.sum(axis=1).max() * (1 + self.opt.count_slack)
        current = self.total()
        while swaps < self.opt.max_swaps:
            times = self.cost.sum(axis=1)
            c = self._candidates(times, True)
            if c is None:
                break
            a, c_new, t_pair, j_new = c[0], c[5], c[6], c[8]
            ok = (c_new <= bound) & (j_new <= current + 1e-9) & (t_pair < times[a] - 1e-6)
            ok |= (c_new <= bound) & (j_new < current * (1 - 1e-5))
            if not ok.any():
                break
            self._take(c, np.where(ok, j_new, np.inf))
            current = self.total()
            swaps += 1
        return swaps


def _distinct_ranks(top_k: int, world: int, e_n: int) -> float:
    """E[distinct ranks per token] under uniform routing (the dedup of rows)."""
    from math import comb

    per = max(e_n // world, 1)
    if e_n - per < top_k:
        return float(min(world, top_k))
    return world * (1 - comb(e_n - per, top_k) / comb(e_n, top_k))


# ---- one layer -------------------------------------------------------------------------------
def balance_layer(
    loads: np.ndarray,
    islands: Islands,
    options: Options,
    previous: np.ndarray | None = None,
    share: np.ndarray | None = None,
) -> LayerResult:
    """Balances one layer (``loads [E]``, optional ``share [W, E]`` per source)."""
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 1 or loads.size < 1 or not np.all(np.isfinite(loads)) or loads.min() < 0:
        raise ValueError("loads: allowed: a 1-D array of finite counts >= 0 per expert")
    w, e_n = islands.world, loads.size
    n = slots_per_rank(e_n, w, options.redundant)
    if share is None:
        share = np.full((w, e_n), 1.0 / w)
    share = np.asarray(share, dtype=np.float64)
    if share.shape != (w, e_n) or not np.allclose(share.sum(axis=0), 1.0):
        raise ValueError(f"share: allowed: [{w}, {e_n}] fractions summing to 1 per expert")
    src = share * loads[None]
    total = float(loads.sum())
    scale = w * options.tokens_per_step * options.top_k / total if total > 0 else 0.0
    counts = replicate(loads, w * n, w)
    prev_ranks = None
    if previous is not None:
        prev = check_slots(previous, e_n)
        if prev.shape != (w, n):
            raise ValueError(f"previous: got shape {prev.shape}; allowed: {(w, n)}")
        prev_ranks = [set() for _ in range(e_n)]
        for r in range(w):
            for e in prev[r]:
                prev_ranks[e].add(r)
    packer = _Packer(src, counts, n, scale, options.cost, prev_ranks, options.move_us)
    packer.place(island_tree(islands.paths), [(e, int(counts[e]), 0.0) for e in range(e_n)])
    near = islands.nearness()
    starts = [np.array([sorted(row) for row in packer.out], dtype=np.int64)]
    if previous is not None and np.array_equal(
        np.bincount(prev.reshape(-1), minlength=e_n), counts
    ):
        starts.insert(0, prev.copy())  # the current placement, if its copies are still right
    best = None
    for slots in starts:
        ref = _Refiner(slots, src, counts, near, islands, options, scale, prev_ranks)
        ref.run()
        score = ref.total()
        # keep the current placement unless the other is better by keep_margin
        if best is None or score < best[0] * (1 - options.keep_margin):
            best = (score, slots)
    slots = best[1]
    moved = 0
    if previous is not None:
        slots, moved = _keep_local_order(slots, prev)
    else:
        slots = np.sort(slots, axis=1)
    return LayerResult(slots, to_placement(slots, e_n, near), moved)


def _keep_local_order(slots: np.ndarray, prev: np.ndarray) -> tuple[np.ndarray, int]:
    """Each rank's experts, those it already held at their old local index."""
    out = np.full_like(slots, -1)
    moved = 0
    for r in range(slots.shape[0]):
        new = list(slots[r])
        for j, e in enumerate(prev[r]):
            if e in new:
                out[r, j] = e
                new.remove(e)
        moved += len(new)
        free = [j for j in range(slots.shape[1]) if out[r, j] < 0]
        for j, e in zip(free, sorted(new)):
            out[r, j] = e
    return out, moved


def balance(
    loads: np.ndarray,
    islands: Islands,
    options: Options,
    previous: Sequence[np.ndarray] | None = None,
    share: np.ndarray | None = None,
) -> list[LayerResult]:
    """Balances every layer of ``loads [layers, E]`` (``share [layers, W, E]`` optional)."""
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2:
        raise ValueError(f"loads: got shape {loads.shape}; allowed: [layers, experts]")
    if previous is not None and len(previous) != loads.shape[0]:
        raise ValueError(f"previous: got {len(previous)} layers; allowed: {loads.shape[0]}")
    return [
        balance_layer(
            loads[i],
            islands,
            options,
            None if previous is None else previous[i],
            None if share is None else share[i],
        )
        for i in range(loads.shape[0])
    ]
