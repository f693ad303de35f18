"""Pure-torch references: fp8 payload quantisation, the expert MLP, and a single-process
model of dispatch and combine. The tests and the benchmark check the transports against
these; they favour obviousness over speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pcie_a2a.placement import Placement

FP8_GROUP = 128
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-128-channel e4m3 quantisation: (q float8_e4m3fn [..., H], scales fp32 [..., H/128])."""
    if x.shape[-1] % FP8_GROUP:
        raise ValueError(f"hidden must be a multiple of {FP8_GROUP}, got {x.shape[-1]}")
    g = x.float().reshape(*x.shape[:-1], -1, FP8_GROUP)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale.squeeze(-1)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    g = q.float().reshape(*q.shape[:-1], -1, FP8_GROUP) * scales.unsqueeze(-1)
    return g.reshape(q.shape).to(dtype)


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    return dequantize_fp8(*quantize_fp8(x), x.dtype)


def make_expert_weights(
    num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16/fp16 expert weights: w13 [E, 2I, H] (gate then up), w2 [E, H, I]."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate**0.5
    return w13.to(dtype), w2.to(dtype)


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert in fp32: down(silu(gate(x)) * up(x))."""
    gate_up = x.float() @ w13.float().t()
    gate, up = gate_up.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w2.float().t()


def expert_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """Dispatch rows -> combine rows: ``y[r] = sum_k w[r,k] * MLP_{ids[r,k]}(x[r])``.

    ``x [R, H]``, ``topk_ids [R, K]`` local expert ids (-1 = none), ``topk_weights [R, K]``;
    the rows are not copied per expert: each expert gathers the rows that chose it and
    scatters its weighted output back (fp32), then the sum is cast to x's dtype.
    """
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    ids = topk_ids.long()
    for e in torch.unique(ids[ids >= 0]).tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        y = expert_mlp(x[rows], w13[e], w2[e])
        out.index_add_(0, rows, y * topk_weights[rows, slot].float().unsqueeze(1))
    return out.to(x.dtype)


def expert_forward_expert_major(
    x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Expert-major ``x [E, cap, H]`` -> unweighted outputs ``[E, cap, H]`` (rows past counts[e] zero)."""
    out = torch.zeros_like(x)
    for e, n in enumerate(counts.tolist()):
        if n:
            out[e, :n] = expert_mlp(x[e, :n], w13[e], w2[e]).to(x.dtype)
    return out


def scale_expert(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """A cheap stand-in expert for benchmarks: ``y = x * sum_k w_k * (1 + id_k / 64)``."""
    ids = topk_ids.float()
    factor = torch.where(topk_ids >= 0, topk_weights * (1 + ids / 64), torch.zeros_like(ids))
    return (x.float() * factor.sum(dim=1, keepdim=True)).to(x.dtype)


# ---- single-process model of dispatch/combine ------------------------------------------
@dataclass
class ExpectedRows:
    """What one receiving rank should get, in wire order (by source rank, then token)."""

    x: torch.Tensor  # [R, H]
    src_rank: torch.Tensor  # [R] int32
    src_token: torch.Tensor  # [R] int32
    topk_ids: torch.Tensor  # [R, num_topk] int32, -1 padded
    topk_weights: torch.Tensor  # [R, num_topk] fp32, 0 padded
    tokens_per_expert: list[int]


def reference_dispatch(
    xs: list[torch.Tensor],
    topk_ids: list[torch.Tensor],
    topk_weights: list[torch.Tensor],
    placement: Placement,
    max_tokens: int,
    num_topk: int,
    payload: str = "bf16",
) -> list[ExpectedRows]:
    world = placement.world
    rows: list[list] = [[] for _ in range(world)]
    for s in range(world):
        x = fp8_roundtrip(xs[s]) if payload == "fp8" and xs[s].shape[0] else xs[s]
        for t in range(xs[s].shape[0]):
            per_rank: dict[int, list[tuple[int, float]]] = {}
            for k in range(topk_ids[s].shape[1]):
                e = int(topk_ids[s][t, k])
                if e < 0:
                    continue
                r, local = placement.replica_for(e, s * max_tokens + t, s)
                per_rank.setdefault(r, []).append((local, float(topk_weights[s][t, k])))
            for r in sorted(per_rank):
                rows[r].append((s, t, per_rank[r], x[t]))
    out = []
    for r in range(world):
        n = len(rows[r])
        hidden = xs[0].shape[1]
        ids = torch.full((n, num_topk), -1, dtype=torch.int32)
        ws = torch.zeros(n, num_topk, dtype=torch.float32)
        counts = [0] * placement.num_local_experts(r)
        for i, (_, _, experts, _) in enumerate(rows[r]):
            for k, (local, w) in enumerate(experts):
                ids[i, k] = local
                ws[i, k] = w
                counts[local] += 1
        out.append(
            ExpectedRows(
                x=torch.stack([row[3] for row in rows[r]])
                if n
                else torch.empty(0, hidden, dtype=xs[0].dtype),
                src_rank=torch.tensor([row[0] for row in rows[r]], dtype=torch.int32),
                src_token=torch.tensor([row[1] for row in rows[r]], dtype=torch.int32),
                topk_ids=ids,
                topk_weights=ws,
                tokens_per_expert=counts,
            )
        )
    return out


def reference_combine(
    ys: list[torch.Tensor], expected: list[ExpectedRows], num_tokens: list[int], hidden: int
) -> list[torch.Tensor]:
    """Each source sums the partials of its tokens in fp32, in ascending rank order."""
    world = len(ys)
    acc = [torch.zeros(num_tokens[s], hidden, dtype=torch.float32) for s in range(world)]
    for r in range(world):
        for i in range(expected[r].src_rank.shape[0]):
            s, t = int(expected[r].src_rank[i]), int(expected[r].src_token[i])
            acc[s][t] += ys[r][i].float()
    return [a.to(ys[0].dtype) for a in acc]
