"""Synthetic router outputs for the benchmark: uniform, Zipf-skewed and Kimi-like.

Every generator is deterministic in ``(seed, rank)``; the parts that describe the model
(which experts are popular) depend on ``seed`` only, so all ranks agree on them. Ours and
the baselines are fed the very same tensors.

* ``uniform``: ``k`` distinct experts per token, uniformly at random.
* ``zipf``: expert popularity ~ ``1 / popularity_rank ** s`` (``--zipf-s``, default 1.0);
  the popularity order is a random permutation of the experts, so hot experts land on
  random ranks; ``k`` distinct experts per token drawn without replacement.
* ``kimi``: DeepSeek-V3-style group-limited routing on a Kimi-K2-sized layer: sigmoid
  scores of random logits plus a per-expert bias (mild load skew), experts split into
  ``n_group`` contiguous groups, a group scores the sum of its best two experts, a token
  keeps its best ``topk_group`` groups and picks its top-``k`` experts inside them. With
  contiguous placement a group lives on one rank, so tokens touch fewer ranks. (Kimi K2's
  released config sets n_group=1; the defaults 8/4 are DeepSeek-V3's.)
"""

from __future__ import annotations

import torch

from pcie_a2a.bench.routing_spec import ROUTINGS, RoutingSpec, check_spec


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(scores: torch.Tensor) -> torch.Tensor:
    return (scores / scores.sum(dim=1, keepdim=True)).float().contiguous()


def make_routing(
    spec: RoutingSpec, num_tokens: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k] int64, topk_weights [T, k] fp32, rows summing to 1) for one rank."""
    error = check_spec(spec)
    if error:
        raise ValueError(error)
    e, k, t = spec.num_experts, spec.topk, num_tokens
    kind_id = ROUTINGS.index(spec.kind)
    g = _gen(spec.seed * 1_000_003 + rank * 7919 + kind_id)
    shared = _gen(spec.seed * 1_000_003 + 104_729 + kind_id)
    if spec.kind == "uniform":
        ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices
        return ids, _weights(torch.rand(t, k, generator=g) + 0.1)
    if spec.kind == "zipf":
        order = torch.randperm(e, generator=shared)
        popularity = torch.empty(e)
        popularity[order] = 1.0 / torch.arange(1, e + 1, dtype=torch.float32) ** spec.zipf_s
        if t == 0:
            return torch.empty(0, k, dtype=torch.int64), torch.empty(0, k)
        ids = torch.multinomial(popularity.expand(t, e), k, replacement=False, generator=g)
        return ids, _weights(torch.rand(t, k, generator=g) + 0.1)
    bias = 0.5 * torch.randn(e, generator=shared)
    scores = torch.sigmoid(torch.randn(t, e, generator=g) + bias)
    per_group = e // spec.n_group
    grouped = scores.view(t, spec.n_group, per_group)
    group_score = grouped.topk(min(2, per_group), dim=2).values.sum(dim=2)
    keep = group_score.topk(spec.topk_group, dim=1).indices
    mask = torch.zeros(t, spec.n_group, dtype=torch.bool)
    mask.scatter_(1, keep, True)
    masked = grouped.masked_fill(~mask.unsqueeze(2), -1.0).view(t, e)
    top = masked.topk(k, dim=1)
    return top.indices, _weights(top.values)


def ranks_per_token(topk_ids: torch.Tensor, num_experts: int, world: int) -> float:
    """Mean number of distinct ranks a token touches under contiguous placement."""
    if topk_ids.numel() == 0:
        return 0.0
    dest = topk_ids // (num_experts // world)
    hit = torch.zeros(topk_ids.shape[0], world, dtype=torch.bool)
    hit.scatter_(1, dest, True)
    return float(hit.sum(dim=1).float().mean())
