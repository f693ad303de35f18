"""Routings and placements for the dispatch/combine tests, generated identically on every
rank from a seed, so each rank can build the whole single-process reference locally."""

from __future__ import annotations

import torch

from pcie_a2a.placement import Placement


def routing(kind: str, num_tokens: int, num_experts: int, topk: int, gen: torch.Generator):
    if num_tokens == 0:
        return torch.empty(0, topk, dtype=torch.int64), torch.empty(0, topk)
    if kind == "uniform":
        ids = torch.stack(
            [torch.randperm(num_experts, generator=gen)[:topk] for _ in range(num_tokens)]
        )
    elif kind == "zipf":
        p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
        ids = torch.multinomial(p.expand(num_tokens, -1), topk, replacement=False, generator=gen)
    elif kind == "one_expert":
        ids = torch.full((num_tokens, topk), -1, dtype=torch.int64)
        ids[:, 0] = 3
    elif kind == "masked":
        ids = torch.stack(
            [torch.randperm(num_experts, generator=gen)[:topk] for _ in range(num_tokens)]
        )
        ids[torch.rand(ids.shape, generator=gen) < 0.35] = -1
    else:
        raise ValueError(kind)
    ids = ids.reshape(num_tokens, topk).to(torch.int64)
    weights = torch.rand(num_tokens, topk, generator=gen, dtype=torch.float32)
    return ids, weights


def placement(kind: str, num_experts: int, world: int) -> Placement:
    if kind == "contiguous":
        return Placement.contiguous(num_experts, world)
    if kind == "random":
        return Placement.random_permutation(num_experts, world, seed=7)
    if kind == "redundant":  # experts 3 and 5 are hot: copies on other ranks
        base = Placement.random_permutation(num_experts, world, seed=11)
        return Placement.with_redundant(base, {3: list(range(world)), 5: [0, world - 1]})
    if kind == "table":  # redundant, plus a replica choice table (pcie_a2a.balance's kind)
        return with_choice_table(placement("redundant", num_experts, world))
    raise ValueError(kind)


def with_choice_table(pl: Placement) -> Placement:
    """A choice table unlike the modulo rule: a source uses its own rank's copy where there
    is one, a weighted split [0, 1, 1] for experts with 2 or 3 copies, otherwise a
    source-dependent single copy."""
    table = []
    for s in range(pl.world):
        row = []
        for e, reps in enumerate(pl.replicas):
            mine = [j for j, (r, _) in enumerate(reps) if r == s]
            if mine:
                row.append(mine)
            elif len(reps) in (2, 3):
                row.append([0, 1, 1])
            else:
                row.append([(s + e) % len(reps)])
        table.append(row)
    return pl.with_choice(table)


def inputs(world, num_experts, hidden, max_tokens, topk, kind, seed, empty_ranks=()):
    """Per-rank (x, topk_ids, topk_weights) for every rank; x values are bf16."""
    gen = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for r in range(world):
        t = 0 if r in empty_ranks else int(torch.randint(1, max_tokens + 1, (1,), generator=gen))
        xs.append(torch.randn(t, hidden, generator=gen).to(torch.bfloat16))
        i, w = routing(kind, t, num_experts, topk, gen)
        ids.append(i)
        ws.append(w)
    return xs, ids, ws
