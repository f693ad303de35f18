"""Pure-torch references of the all-reduce numerics (csrc/core/allreduce_math.h), exact to
the bit: the fixed-rank-order fp32 sum, the fused residual add and the fused add + RMSNorm
with its fixed reduction order. The tests compare both paths (CPU and the CUDA kernels in
the CPU model of CUDA) with these, and the NCCL/gloo fallback uses them for the fused parts.
"""

from __future__ import annotations

import torch

NORM_THREADS = 256  # allreduce_math.h kNormThreads
VEC = 8  # 16-bit elements per 16-byte vector


def sum_in_rank_order(xs: list[torch.Tensor]) -> torch.Tensor:
    """fp32 sum, rank 0 first, separately rounded additions, rounded once to the dtype."""
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


def add_residual(r: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """dtype(float(r) + float(residual)): what ``r + residual`` gives in torch."""
    if residual is None:
        return r
    return (r.float() + residual.float()).to(r.dtype)


def _butterfly(p: torch.Tensor) -> torch.Tensor:
    """The xor butterfly over the last dimension (32 lanes); returns lane 0."""
    lanes = torch.arange(32)
    off = 16
    while off >= 1:
        p = p + p[..., lanes ^ off]
        off //= 2
    return p[..., 0]


def norm_sum_sq(z: torch.Tensor) -> torch.Tensor:
    """The kernel's fixed-order sum of z^2 per row of ``z [rows, H]`` (fp32)."""
    rows, hidden = z.shape
    nvec = hidden // VEC
    part = torch.zeros(rows, NORM_THREADS, dtype=torch.float32)
    for v0 in range(0, nvec, NORM_THREADS):
        n = min(NORM_THREADS, nvec - v0)
        zv = z[:, v0 * VEC : (v0 + n) * VEC].reshape(rows, n, VEC)
        for e in range(VEC):
            q = zv[:, :, e]
            part[:, :n] = part[:, :n] + q * q
    warps = _butterfly(part.reshape(rows, NORM_THREADS // 32, 32))
    padded = torch.zeros(rows, 32, dtype=torch.float32)
    padded[:, : warps.shape[1]] = warps
    return _butterfly(padded)


def add_rmsnorm(
    r: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual_out) of the fused add + RMSNorm over the last dimension, exactly as
    the CPU implementation and the kernels compute it."""
    dtype, shape = r.dtype, r.shape
    hidden = shape[-1]
    z = r.float().reshape(-1, hidden)
    if residual is not None:
        z = z + residual.float().reshape(-1, hidden)
    s = norm_sum_sq(z)
    eps_t = torch.tensor(eps, dtype=torch.float32)
    inv = 1.0 / torch.sqrt(s / torch.tensor(float(hidden), dtype=torch.float32) + eps_t)
    normed = ((z * inv.unsqueeze(1)).to(dtype).float() * weight.float()).to(dtype)
    return normed.reshape(shape), z.to(dtype).reshape(shape)
