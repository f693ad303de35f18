"""Expert placement: which rank (and local index there) holds each expert.

A placement maps every global expert to one or more replicas ``(rank, local_index)``.
The default is contiguous blocks of ``num_experts / world``; any map works: random
permutations, topology-aware maps, and redundant copies of hot experts (EPLB). With
several replicas, a token uses replica ``global_token % num_replicas`` where
``global_token = source_rank * max_tokens_per_rank + token`` (see csrc/core/routing.h).

A replica choice table (``choice``, made by :mod:`pcie_a2a.balance`) replaces that rule:
``choice[source][expert]`` lists the positions (in ``replicas[expert]``) of the replicas
that source's tokens use, typically the nearest ones on the PCIe tree; a token takes
``choice[source][expert][global_token % len(...)]`` (repeats weight a replica). The CPU and
CUDA transports apply the same table (each rank gets its own row, :meth:`choice_csr`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

FORMAT = "pcie_a2a.placement"
VERSION = 1


class Placement:
    """Expert -> list of (rank, local index) replicas."""

    def __init__(
        self,
        replicas: Sequence[Sequence[tuple[int, int]]],
        world: int,
        choice: Sequence[Sequence[Sequence[int]]] | None = None,
    ):
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
        self.choice: list[list[list[int]]] | None = (
            None if choice is None else self._check_choice(choice)
        )

    def _check_choice(self, choice: Any) -> list[list[list[int]]]:
        w, e_n = self.world, len(self.replicas)
        allowed = f"[world={w}][num_experts={e_n}] lists of replica positions"
        if isinstance(choice, (str, bytes)) or not isinstance(choice, Sequence):
            raise ValueError(f"choice: got {type(choice).__name__}; allowed: {allowed}")
        if len(choice) != w:
            raise ValueError(f"choice: got {len(choice)} source ranks; allowed: {allowed}")
        out = []
        for s, row in enumerate(choice):
            if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != e_n:
                got = len(row) if isinstance(row, Sequence) else type(row).__name__
                raise ValueError(f"choice[{s}]: got {got} experts; allowed: {allowed}")
            out_row = []
            for e, cand in enumerate(row):
                try:
                    cand = [int(j) for j in cand]
                except (TypeError, ValueError):
                    raise ValueError(
                        f"choice[{s}][{e}]: got {cand!r}; allowed: a list of replica positions"
                    ) from None
                n = len(self.replicas[e])
                if not cand or any(not 0 <= j < n for j in cand):
                    raise ValueError(
                        f"choice[{s}][{e}]: got {cand}; allowed: a non-empty list of positions "
                        f"in [0, {n}) (expert {e} has {n} replicas)"
                    )
                out_row.append(cand)
            out.append(out_row)
        return out

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

    def with_choice(self, choice: Sequence[Sequence[Sequence[int]]] | None) -> Placement:
        """The same replicas with a replica choice table (None: the modulo rule)."""
        return Placement(self.replicas, self.world, choice)

    def choice_csr(self, rank: int) -> tuple[list[int], list[int]]:
        """Source ``rank``'s row of the choice table for the wire layer: (choice_offset
        [num_experts + 1], choice [...] as indices into the :meth:`csr` replica arrays);
        two empty lists without a table."""
        if self.choice is None:
            return [], []
        if not 0 <= rank < self.world:
            raise ValueError(f"rank: got {rank}; allowed: [0, {self.world})")
        offset, out = [0], []
        base = 0
        for e, cand in enumerate(self.choice[rank]):
            out.extend(base + j for j in cand)
            offset.append(len(out))
            base += len(self.replicas[e])
        return offset, out

    def replica_for(
        self, expert: int, global_token: int, source_rank: int | None = None
    ) -> tuple[int, int]:
        """The replica a token uses, as the wire layer picks it (csrc/core/routing.h).
        ``source_rank`` is needed when the placement has a choice table."""
        reps = self.replicas[expert]
        if self.choice is None:
            return reps[global_token % len(reps)]
        if source_rank is None:
            raise ValueError("replica_for: this placement has a choice table; pass source_rank")
        cand = self.choice[source_rank][expert]
        return reps[cand[global_token % len(cand)]]

    # -- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "world": self.world,
            "replicas": [[list(p) for p in reps] for reps in self.replicas],
            "choice": self.choice,
        }

    @classmethod
    def from_dict(cls, d: Any, source: str = "<placement>") -> Placement:
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != VERSION:
            got = (d.get("format"), d.get("version")) if isinstance(d, dict) else type(d).__name__
            raise ValueError(
                f"{source}: got {got}; allowed: a {FORMAT!r} version {VERSION} document"
            )
        try:
            reps = [[(int(r), int(l)) for r, l in e] for e in d["replicas"]]
            return cls(reps, int(d["world"]), d.get("choice"))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{source}: not a valid {FORMAT} document: {exc}") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and (self.world, self.replicas, self.choice) == (
            other.world,
            other.replicas,
            other.choice,
        )

    def __repr__(self) -> str:
        return f"Placement(num_experts={self.num_experts}, world={self.world})"
