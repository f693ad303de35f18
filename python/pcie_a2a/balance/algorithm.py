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
rebalance), in the packing's choices and in the refinement (a row taken off the slowest
rank is weighed as a compute-bound row's GEMM time against it); when its copy counts still
fit, the previous placement itself is refined too and kept unless the new one is better
by ``keep_margin``. Packing: :mod:`.pack`; refinement: :mod:`.refine`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..placement import Placement
from .islands import Islands
from .layout import check_slots, to_placement
from .options import Options
from .pack import Packer, island_tree
from .refine import Refiner


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
    packer = Packer(src, counts, n, scale, options.cost, prev_ranks, options.move_us)
    packer.place(island_tree(islands.paths), [(e, int(counts[e]), 0.0) for e in range(e_n)])
    near = islands.nearness()
    starts = [np.array([sorted(row) for row in packer.out], dtype=np.int64)]
    if previous is not None and np.array_equal(
        np.bincount(prev.reshape(-1), minlength=e_n), counts
    ):
        starts.insert(0, prev.copy())  # the current placement, if its copies are still right
    best = None
    for slots in starts:
        ref = Refiner(slots, src, counts, near, islands, options, scale, prev_ranks)
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
