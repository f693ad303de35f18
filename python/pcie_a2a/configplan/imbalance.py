"""Expert load per rank: how much more work the busiest expert-parallel rank gets than the
average one, for top-k routing under a placement.

Routing is described by each expert's share of the routed (token, expert) pairs: uniform,
Zipf with exponent ``skew`` over a seeded random order of the experts, or the per-expert
token counts of a routing-statistics file. A token picks expert e with probability
``p_e`` (``sum p_e = k``, ``p_e <= 1``).

Placement: contiguous blocks of E / ranks experts (SGLang's and vLLM's default) or, with
``redundant`` extra slots, the placement the product ships (``pcie_a2a.balance.eplb``:
DeepSeek EPLB's global policy, research/field_2026.md s7). A replica takes an equal share
of its expert's tokens.

Per rank r the rows it computes are approximated as Binomial(B k, Q_r / k), Q_r = its
expected rows per token (a token's k picks treated as independent draws: the variance is
overstated by (E - k) / (E - 1), 2% for Kimi K2), and the experts it must stream as a sum
of independent Bernoullis (slot s is touched by at least one of B tokens with probability
``1 - (1 - p_s)^B``). The expected maximum over ranks treats ranks as independent
(their loads are slightly negatively correlated, so this errs high).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Routing:
    """Share of routed pairs per expert (sums to 1) and where it came from."""

    share: tuple[float, ...]
    source: str

    @property
    def experts(self) -> int:
        return len(self.share)


def uniform(experts: int) -> Routing:
    return Routing(tuple([1.0 / experts] * experts), "uniform routing")


def zipf(experts: int, skew: float, seed: int = 0) -> Routing:
    if not skew >= 0:
        raise ValueError(f"--skew: got {skew!r}; allowed: a number >= 0 (0 = uniform)")
    if skew == 0:
        return uniform(experts)
    w = 1.0 / np.arange(1, experts + 1, dtype=np.float64) ** skew
    order = np.random.default_rng(seed).permutation(experts)
    share = np.empty(experts)
    share[order] = w / w.sum()
    return Routing(
        tuple(share.tolist()), f"Zipf s={skew:g} over a seeded (seed {seed}) expert order"
    )


def from_counts(counts, experts: int, source: str) -> Routing:
    a = np.asarray(counts, dtype=np.float64)
    if a.ndim == 2:  # [layers, experts]: the average share over layers
        if a.shape[1] != experts:
            raise ValueError(f"{source}: {a.shape[1]} experts per layer, the model has {experts}")
        rows = a.sum(axis=1, keepdims=True)
        if np.any(rows <= 0):
            raise ValueError(f"{source}: a layer with no routed tokens")
        a = (a / rows).mean(axis=0)
    if a.ndim != 1 or a.shape[0] != experts:
        raise ValueError(
            f"{source}: expected {experts} per-expert counts (or [layers][{experts}]), got "
            f"shape {list(a.shape)}"
        )
    if np.any(a < 0) or not np.all(np.isfinite(a)) or a.sum() <= 0:
        raise ValueError(f"{source}: counts must be finite, >= 0 and not all 0")
    return Routing(tuple((a / a.sum()).tolist()), f"routing statistics {source}")


def load_routing(path: str, experts: int) -> Routing:
    """A JSON file: a list of per-expert token counts, ``{"expert_counts": [...]}``, or
    SGLang's ``{"logical_count": [[...] per layer]}``."""
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--routing {path}: not JSON ({exc})") from None
    if isinstance(doc, dict):
        for key in ("expert_counts", "logical_count", "counts"):
            if key in doc:
                doc = doc[key]
                break
        else:
            raise ValueError(
                f"--routing {path}: expected a list of counts or a dict with "
                "'expert_counts' or 'logical_count'"
            )
    return from_counts(doc, experts, path)


def pick_probabilities(share: np.ndarray, k: int) -> np.ndarray:
    """P(a token picks expert e): k * share, capped at 1 with the excess spread over the
    uncapped experts (a token cannot pick an expert twice)."""
    p = k * share
    for _ in range(len(p)):
        over = p > 1.0
        if not over.any():
            break
        excess = (p[over] - 1.0).sum()
        p[over] = 1.0
        free = p < 1.0
        if not free.any():
            break
        p[free] += excess * p[free] / p[free].sum()
    return p


@dataclass(frozen=True)
class Placement:
    """slots[r] = ((expert, share of its tokens), ...) for each rank."""

    slots: tuple[tuple[tuple[int, float], ...], ...]
    redundant: int
    rule: str

    @property
    def ranks(self) -> int:
        return len(self.slots)


def place(routing: Routing, ranks: int, redundant: int = 0) -> Placement:
    e = routing.experts
    if ranks < 1 or (e % ranks and redundant == 0):
        raise ValueError(f"placement: {e} experts do not split evenly over {ranks} ranks")
    if redundant < 0 or (e + redundant) % ranks:
        raise ValueError(
            f"--redundant-experts: got {redundant}; allowed: >= 0 with experts + redundant "
            f"({e} + {redundant}) a multiple of the EP size {ranks}"
        )
    if redundant == 0:
        per = e // ranks
        slots = tuple(tuple((r * per + j, 1.0) for j in range(per)) for r in range(ranks))
        return Placement(slots, 0, "contiguous blocks")
    # the placement the product ships (pcie_a2a.balance.eplb: DeepSeek EPLB's global
    # policy, an expert's tokens split equally over its replicas), not a copy of it
    from pcie_a2a.balance.eplb import eplb

    table = eplb(np.asarray(routing.share), ranks, redundant)
    count = np.bincount(table.reshape(-1), minlength=e)
    slots = tuple(tuple((int(x), 1.0 / int(count[x])) for x in row) for row in table)
    return Placement(slots, redundant, f"EPLB (pcie_a2a.balance.eplb), {redundant} redundant")


@dataclass(frozen=True)
class Load:
    tokens: int
    mean_rows: float
    max_rows: float
    mean_experts: float  # distinct local experts (slots) touched, per rank
    max_experts: float

    @property
    def rows_factor(self) -> float:
        return self.max_rows / self.mean_rows if self.mean_rows > 0 else 1.0


def _log_binom_pmf(n: int, p: float) -> np.ndarray:
    x = np.arange(n + 1, dtype=np.float64)
    if p <= 0:
        out = np.full(n + 1, -np.inf)
        out[0] = 0.0
        return out
    if p >= 1:
        out = np.full(n + 1, -np.inf)
        out[n] = 0.0
        return out
    log_c = np.concatenate(([0.0], np.cumsum(np.log(n - x[1:] + 1) - np.log(x[1:]))))
    return log_c + x * math.log(p) + (n - x) * math.log1p(-p)


def _expected_max(cdfs: list[np.ndarray]) -> float:
    """E[max] of independent non-negative integer variables given their CDFs."""
    size = max(len(c) for c in cdfs)
    prod = np.ones(size)
    for c in cdfs:
        full = np.ones(size)
        full[: len(c)] = c
        prod *= full
    return float(np.sum(1.0 - prod[:-1])) if size > 1 else 0.0


def _poisson_binomial_cdf(probs: list[float]) -> np.ndarray:
    pmf = np.array([1.0])
    for p in probs:
        pmf = np.convolve(pmf, [1.0 - p, p])
    return np.minimum(np.cumsum(pmf), 1.0)


def rank_load(routing: Routing, placement: Placement, k: int, tokens: int) -> Load:
    """Mean and expected-maximum rows and distinct experts per rank for ``tokens`` tokens."""
    p = pick_probabilities(np.asarray(routing.share, dtype=np.float64), k)
    if tokens <= 0:
        return Load(0, 0.0, 0.0, 0.0, 0.0)
    row_cdfs, exp_cdfs, rows, touched = [], [], [], []
    for slots in placement.slots:
        ps = [p[x] * share for x, share in slots]
        q = float(sum(ps))  # expected rows per token on this rank
        rows.append(float(tokens * q))
        n = tokens * k
        pmf = np.exp(_log_binom_pmf(n, min(q / k, 1.0)))
        row_cdfs.append(np.minimum(np.cumsum(pmf), 1.0))
        a = [1.0 - (1.0 - min(s, 1.0)) ** tokens for s in ps]
        touched.append(float(sum(a)))
        exp_cdfs.append(_poisson_binomial_cdf(a))
    if placement.ranks == 1:  # nothing to be unbalanced against
        return Load(tokens, rows[0], rows[0], touched[0], touched[0])
    return Load(
        tokens,
        float(np.mean(rows)),
        max(_expected_max(row_cdfs), float(max(rows))),
        float(np.mean(touched)),
        max(_expected_max(exp_cdfs), float(max(touched))),
    )


def rank_hit_probability(routing: Routing, placement: Placement, k: int) -> list[float]:
    """P(a token sends a row to rank r): at least one of its picks is on r (per-rank
    de-duplication, as pcie_a2a sends a token once per destination rank)."""
    e = routing.experts
    if placement.redundant == 0 and max(routing.share) - min(routing.share) < 1e-12 / e:
        # Uniform: exact. A rank with E/R experts is missed when all k distinct picks fall
        # elsewhere (pcie_a2a.topology.expected_distinct_ranks).
        per = e // placement.ranks
        return [1.0 - math.comb(e - per, k) / math.comb(e, k)] * placement.ranks
    p = pick_probabilities(np.asarray(routing.share, dtype=np.float64), k)
    out = []
    for slots in placement.slots:
        miss = 1.0
        for x, share in slots:
            miss *= 1.0 - min(p[x] * share, 1.0)
        out.append(1.0 - miss)
    return out
