"""Routing that looks like real MoE routing, for the benchmark and the tests.

* :func:`zipf_weights`: expert popularity ``1 / rank^skew`` over a random order per layer
  (skew 0 is uniform; measured DeepSeek/Kimi layers sit around 0.6-1.2);
* :func:`group_weights`: popularity concentrated in a few expert groups (contiguous id
  ranges, as group-limited routing and fine-tuned models produce): Zipf over groups, Zipf
  within each group;
* :func:`drift`: the next time window's popularity, each weight scaled by log-normal noise;
* :func:`route`: each token draws ``top_k`` distinct experts with probability proportional
  to the weights (Gumbel top-k), per source rank and step.
"""

from __future__ import annotations

import numpy as np


def zipf_weights(num_experts: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    w = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** skew
    return w[rng.permutation(num_experts)] / w.sum()


def group_weights(
    num_experts: int, num_groups: int, skew: float, rng: np.random.Generator
) -> np.ndarray:
    if num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not split into {num_groups} groups")
    size = num_experts // num_groups
    g = 1.0 / np.arange(1, num_groups + 1, dtype=np.float64) ** (2 * skew)
    g = g[rng.permutation(num_groups)]
    inner = np.stack([zipf_weights(size, skew, rng) for _ in range(num_groups)])
    w = (g[:, None] * inner).reshape(-1)
    return w / w.sum()


def drift(weights: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    w = weights * np.exp(sigma * rng.standard_normal(weights.shape))
    return w / w.sum()


def route(
    weights: np.ndarray,
    world: int,
    tokens_per_rank: int,
    top_k: int,
    steps: int,
    rng: np.random.Generator,
) -> list[list[np.ndarray]]:
    """``steps[i][s]``: source ``s``'s ``topk_ids [tokens_per_rank, top_k]`` in step ``i``."""
    logw = np.log(np.maximum(weights, 1e-300))
    out = []
    for _ in range(steps):
        g = logw[None, None] + rng.gumbel(size=(world, tokens_per_rank, weights.size))
        ids = np.argpartition(-g, top_k - 1, axis=2)[..., :top_k]
        out.append([ids[s].astype(np.int64) for s in range(world)])
    return out


def loads_of(steps: list[list[np.ndarray]], num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(``loads [E]``, ``share [W, E]``) counted from routed steps."""
    world = len(steps[0])
    per = np.zeros((world, num_experts))
    for step in steps:
        for s, ids in enumerate(step):
            v = ids[ids >= 0]
            per[s] += np.bincount(v, minlength=num_experts)
    loads = per.sum(axis=0)
    share = np.where(loads > 0, per / np.maximum(loads, 1e-300), 1.0 / world)
    return loads, share
