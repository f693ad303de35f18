"""Expert placement: which rank (and local index there) holds each expert.

A placement maps every global expert to one or more replicas ``(rank, local_index)``.
The default is contiguous blocks of ``num_experts / world``; any map works: random
permutations, topology-aware maps, and redundant copies of hot experts (EPLB). With
several replicas, a token uses replica ``global_token % num_replicas`` where
``global_token = source_rank * max_tokens_per_rank + token`` (see csrc/core/routing.h).
"""

from __future__ import annotations

import random
from collections.abc import Sequence


class Placement:
    """Expert -> list of (rank, local index) replicas."""

    def __init__(self, replicas: Sequence[Sequence[tuple[int, int]]], world: int):
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.world = int(world)
        self.replicas: list[list[tuple[int, int]]] = []
        seen: dict[tuple[int, int], int] = {}
        if isinstance(replicas, (str, bytes)) or not isinstance(replicas, Sequence):
            raise ValueError(
                f"placement: got {type(replicas).__name__}; allowed: a Placement or a list "
                "giving each expert's (rank, local) pair or list of pairs"
            )
        for e, reps in enumerate(replicas):
            if isinstance(reps, tuple) and len(reps) == 2 and isinstance(reps[0], int):
                reps = [reps]  # a single (rank, local) pair
            try:
                reps = [(int(r), int(l)) for r, l in reps]
            except (TypeError, ValueError):
                raise ValueError(
                    f"placement: expert {e}: got {reps!r}; allowed: a (rank, local) pair or a "
                    "list of them"
                ) from None
            if not reps:
                raise ValueError(f"placement: expert {e} has no replica")
            for r, l in reps:
                if not 0 <= r < world:
                    raise ValueError(f"placement: expert {e} on rank {r}, allowed [0, {world})")
                if l < 0:
                    raise ValueError(f"placement: expert {e} has local index {l} < 0")
                if (r, l) in seen:
                    raise ValueError(
                        f"placement: experts {seen[(r, l)]} and {e} share rank {r} local index {l}"
                    )
                seen[(r, l)] = e
            self.replicas.append(reps)
        if not self.replicas:
            raise ValueError("placement: no experts")
        self._local_to_global: list[list[int]] = [[] for _ in range(world)]
        for r in range(world):
            locals_here = sorted((l, e) for (rr, l), e in seen.items() if rr == r)
            for i, (l, e) in enumerate(locals_here):
                if l != i:
                    raise ValueError(
                        f"placement: local indices on rank {r} must be 0..n-1 without gaps; "
                        f"local index {i} is missing"
                    )
                self._local_to_global[r].append(e)

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def contiguous(cls, num_experts: int, world: int) -> Placement:
        if num_experts % world != 0:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by world={world}: pass an explicit "
                "placement (pcie_a2a.Placement) to place experts unevenly"
            )
        per = num_experts // world
        return cls([[(e // per, e % per)] for e in range(num_experts)], world)

    @classmethod
    def random_permutation(cls, num_experts: int, world: int, seed: int = 0) -> Placement:
        """Contiguous-sized blocks, but a random expert in each slot."""
        base = cls.contiguous(num_experts, world)
        perm = list(range(num_experts))
        random.Random(seed).shuffle(perm)
        return cls([base.replicas[perm[e]] for e in range(num_experts)], world)

    @classmethod
    def with_redundant(cls, base: Placement, hot: dict[int, Sequence[int]]) -> Placement:
        """Adds replicas of hot experts: ``hot[e]`` lists extra ranks that get a copy."""
        replicas = [list(r) for r in base.replicas]
        next_local = [len(base.local_experts(r)) for r in range(base.world)]
        for e, ranks in hot.items():
            for r in ranks:
                replicas[e].append((r, next_local[r]))
                next_local[r] += 1
        return cls(replicas, base.world)

    # -- queries --------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return len(self.replicas)

    def local_experts(self, rank: int) -> list[int]:
        """Global expert id of each local index on ``rank``."""
        return list(self._local_to_global[rank])

    def num_local_experts(self, rank: int) -> int:
        return len(self._local_to_global[rank])

    def csr(self) -> tuple[list[int], list[int], list[int]]:
        offset, ranks, locals_ = [0], [], []
        for reps in self.replicas:
            for r, l in reps:
                ranks.append(r)
                locals_.append(l)
            offset.append(len(ranks))
        return offset, ranks, locals_

    def replica_for(self, expert: int, global_token: int) -> tuple[int, int]:
        reps = self.replicas[expert]
        return reps[global_token % len(reps)]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and (self.world, self.replicas) == (
            other.world,
            other.replicas,
        )

    def __repr__(self) -> str:
        return f"Placement(num_experts={self.num_experts}, world={self.world})"
