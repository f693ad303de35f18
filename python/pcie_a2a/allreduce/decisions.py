"""Per rank pair: how the all-reduce moves data (push or pull) and whether P2P works at all,
read from the topology planner's decisions through one function, :func:`from_rank_transfers`.

The planner (:mod:`pcie_a2a.topology.ranks`, fed by ``pcie-a2a probe`` when a record
exists) decides per ordered pair the path (P2P or host-staged) and the direction. The
all-reduce has its own kernels but takes the same decisions: a pair the planner stages
cannot be served by P2P kernels, so such a group hands every call to NCCL (said once in
the log); a pair the planner makes pull is pulled (the receiver loads the sender's data
from the sender's segment). Without a plan every pair pushes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PUSH, PULL = "push", "pull"


@dataclass(frozen=True)
class PairDecisions:
    direction: tuple[tuple[str, ...], ...]  # [src][dst]: "push" or "pull" ("push" on the diagonal)
    path: tuple[tuple[str, ...], ...]  # [src][dst]: "p2p" or "staged"
    path_classes: tuple[str, ...]  # the classes of the group's GPU pairs (topology letters)
    measured: tuple[tuple[float, ...], tuple[float, ...]] | None  # (one-way µs, GB/s) per pair
    source: str

    @property
    def world(self) -> int:
        return len(self.direction)

    def pull_matrix(self) -> list[int]:
        """``pull[src * world + dst]`` as the native code takes it."""
        return [int(v == PULL) for row in self.direction for v in row]

    def staged_pairs(self) -> list[tuple[int, int]]:
        w = self.world
        return [(s, d) for s in range(w) for d in range(w) if s != d and self.path[s][d] != "p2p"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "direction": [list(r) for r in self.direction],
            "path": [list(r) for r in self.path],
            "path_classes": sorted(set(self.path_classes)),
        }


def all_push(world: int, source: str, path_classes: tuple[str, ...] = ()) -> PairDecisions:
    return PairDecisions(
        tuple(tuple(PUSH for _ in range(world)) for _ in range(world)),
        tuple(tuple("p2p" for _ in range(world)) for _ in range(world)),
        path_classes,
        None,
        source,
    )


def explicit(direction: list[list[str]], source: str = "explicit pair_direction") -> PairDecisions:
    """Decisions from a ``[world][world]`` list of "push"/"pull" (sender first)."""
    world = len(direction)
    if world == 0 or any(len(r) != world for r in direction):
        raise ValueError(
            f"pair_direction: got {len(direction)} rows of lengths "
            f"{[len(r) for r in direction]}; expected [world][world] of 'push'/'pull'"
        )
    for s, row in enumerate(direction):
        for d, v in enumerate(row):
            if v not in (PUSH, PULL):
                raise ValueError(f"pair_direction[{s}][{d}]: got {v!r}; allowed: 'push', 'pull'")
            if s == d and v != PUSH:
                raise ValueError(f"pair_direction[{s}][{s}]: a rank cannot pull from itself")
    base = all_push(world, source)
    return PairDecisions(tuple(tuple(r) for r in direction), base.path, (), None, source)


def from_rank_transfers(rank_plan: Any, plan: Any, note: str) -> PairDecisions:
    """The decisions for the ranks of ``rank_plan`` (:class:`pcie_a2a.topology.ranks.RankTransfers`,
    with ``plan`` the :class:`pcie_a2a.topology.TransferPlan` it came from). Directions come from
    ``rank_plan.pair_direction`` where the planner provides it (push otherwise); measured
    per-pair numbers only when every pair of the group was measured by a probe."""
    gpus = list(rank_plan.gpus)
    world = len(gpus)
    directions = getattr(rank_plan, "pair_direction", ()) or ()
    direction = tuple(
        tuple(PUSH if s == d or not directions else str(directions[s][d]) for d in range(world))
        for s in range(world)
    )
    path = tuple(
        tuple(str(rank_plan.pair_transport[s][d]) for d in range(world)) for s in range(world)
    )
    classes, lat, gbps, measured = [], [], [], True
    for s in range(world):
        for d in range(world):
            if s == d or gpus[s] == gpus[d]:
                continue
            q = plan.pair(gpus[s], gpus[d])
            classes.append(q.path_class)
            lat.append(float(q.latency_us))
            gbps.append(float(q.gbps))
            measured = measured and str(q.estimate).startswith("probe")
    m = (tuple(lat), tuple(gbps)) if measured and lat else None
    return PairDecisions(direction, path, tuple(classes), m, note)
