"""The CPU reference of the fused INT4 expert MLP (the oracle of the CUDA kernel)."""

from __future__ import annotations

import pytest
import torch

from pcie_a2a.quant import (
    PackedInt4Experts,
    dequantize_packed,
    moe_int4_mlp,
    moe_int4_mlp_expert_major,
    moe_int4_mlp_expert_major_reference,
    moe_int4_mlp_reference,
    random_int4,
)

E, H, I = 4, 96, 40  # ragged: H and I are not tile multiples


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def experts(dtype=torch.bfloat16, group_size=32, symmetric=True, seed=0) -> tuple:
    g = gen(seed)
    sdt = dtype
    gate = random_int4(
        E,
        I,
        H,
        group_size=group_size,
        scale_dtype=sdt,
        symmetric=symmetric,
        generator=g,
        scale=0.05,
    )
    up = random_int4(
        E,
        I,
        H,
        group_size=group_size,
        scale_dtype=sdt,
        symmetric=symmetric,
        generator=g,
        scale=0.05,
    )
    down = random_int4(
        E,
        H,
        I,
        group_size=group_size,
        scale_dtype=sdt,
        symmetric=symmetric,
        generator=g,
        scale=0.05,
    )
    return PackedInt4Experts.from_weights(gate, up, down, dtype), (gate, up, down)


def naive(x, ids, wts, gate, up, down):
    """Row by row, straight from the logical weights (not through the packed layout)."""
    g, u, d = gate.dequantize(), up.dequantize(), down.dequantize()
    out = torch.zeros(x.shape, dtype=torch.float32)
    for r in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[r, k])
            if e < 0:
                continue
            xr = x[r].float()
            h = torch.nn.functional.silu(g[e] @ xr) * (u[e] @ xr)
            out[r] += float(wts[r, k]) * (d[e] @ h)
    return out.to(x.dtype)


def routing(r: int, topk: int, seed: int, skew: bool = False):
    g = gen(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(r)]).to(torch.int32)
    if skew:
        ids[:, 0] = 0  # every row hits expert 0
    drop = torch.rand(r, topk, generator=g) < 0.3
    ids[drop] = -1
    ids[0] = -1  # a row with no local expert
    wts = torch.rand(r, topk, generator=g)
    wts[ids < 0] = 0
    return ids, wts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_reference_matches_naive(dtype, group_size):
    ex, (gate, up, down) = experts(dtype, group_size, symmetric=group_size != 64)
    x = (torch.randn(9, H, generator=gen(1))).to(dtype)
    ids, wts = routing(9, 3, seed=2, skew=True)
    got = moe_int4_mlp_reference(x, ids, wts, ex.w13, ex.w2)
    want = naive(x, ids, wts, gate, up, down)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-3)
    assert torch.all(got[0] == 0)  # no local expert -> zero row
    assert torch.equal(moe_int4_mlp(x, ids, wts, ex.w13, ex.w2), got)  # CPU dispatches here


def test_expert_major_matches_rows():
    ex, _ = experts()
    cap = 5
    counts = torch.tensor([5, 0, 2, 1], dtype=torch.int32)
    x = torch.randn(E, cap, H, generator=gen(3)).to(torch.bfloat16)
    out = moe_int4_mlp_expert_major_reference(x, counts, ex.w13, ex.w2)
    assert out.shape == x.shape
    for e in range(E):
        n = int(counts[e])
        assert torch.all(out[e, n:] == 0)
        if n:
            ids = torch.full((n, 1), e, dtype=torch.int32)
            rows = moe_int4_mlp_reference(x[e, :n], ids, torch.ones(n, 1), ex.w13, ex.w2)
            torch.testing.assert_close(out[e, :n], rows, rtol=0, atol=0)
    assert torch.equal(moe_int4_mlp_expert_major(x, counts, ex.w13, ex.w2), out)


def test_kernel_numerics_within_gpu_bound():
    """Emulate the kernel's rounding (weights dequantised to the activation dtype as
    (q - z) * s with one rounding, h rounded to the dtype, fp32 accumulation) and check it
    sits inside the bound the GPU tests use: mean|out - ref| / mean|ref| < 1e-2."""
    for dtype in (torch.bfloat16, torch.float16):
        ex, _ = experts(dtype, 32)
        x = torch.randn(16, H, generator=gen(4)).to(dtype)
        ids, wts = routing(16, 2, seed=5)
        ref = moe_int4_mlp_reference(x, ids, wts, ex.w13, ex.w2).float()
        w13 = dequantize_packed(ex.w13).to(dtype).float()
        w2 = dequantize_packed(ex.w2).to(dtype).float()
        out = torch.zeros(16, H)
        for e in range(E):
            r, k = torch.nonzero(ids == e, as_tuple=True)
            gu = x[r].float() @ w13[e].T
            h = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(dtype).float()
            out.index_add_(0, r, (h @ w2[e].T) * wts[r, k, None])
        out = out.to(dtype).float()
        err = (out - ref).abs().mean() / ref.abs().mean()
        assert err < 1e-2, (dtype, float(err))


def test_reference_errors():
    ex, _ = experts()
    x = torch.randn(3, H).to(torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.int32)
    wts = torch.ones(3, 2)
    with pytest.raises(ValueError, match=r"row_experts holds 4; allowed: -1 or .*\[0, 4\)"):
        moe_int4_mlp_reference(x, ids + 4, wts, ex.w13, ex.w2)
    with pytest.raises(ValueError, match="rows dtype torch.float16 differs"):
        moe_int4_mlp_reference(x.half(), ids, wts, ex.w13, ex.w2)
    with pytest.raises(ValueError, match="rows hidden size 95 differs .* 96"):
        moe_int4_mlp_reference(x[:, :95], ids, wts, ex.w13, ex.w2)
    with pytest.raises(ValueError, match="row_experts must be int32, got torch.int64"):
        moe_int4_mlp_reference(x, ids.long(), wts, ex.w13, ex.w2)
    with pytest.raises(ValueError, match="row_weights must be float32"):
        moe_int4_mlp_reference(x, ids, wts.half(), ex.w13, ex.w2)
    with pytest.raises(ValueError, match="w13 must be packed with gate_up=True"):
        moe_int4_mlp_reference(x, ids, wts, ex.w2, ex.w2)
    with pytest.raises(ValueError, match=r"counts \[6, 0, 0, 0\] must lie in \[0, capacity=5\]"):
        moe_int4_mlp_expert_major_reference(
            torch.zeros(E, 5, H, dtype=torch.bfloat16),
            torch.tensor([6, 0, 0, 0], dtype=torch.int32),
            ex.w13,
            ex.w2,
        )


def test_registered_torch_ops():
    """torch.ops.pcie_a2a.moe_int4_mlp{,_expert_major}: schema, fake (meta) kernel and the
    CPU implementation (the reference) pass torch.library.opcheck."""
    from pcie_a2a.quant.moe import _weight_args, _weight_meta

    ex, _ = experts(torch.bfloat16, 64, symmetric=False)
    x = torch.randn(5, H, generator=gen(6)).bfloat16()
    ids, wts = routing(5, 2, seed=7)
    args = (
        x,
        ids,
        wts,
        *_weight_args(ex.w13),
        *_weight_args(ex.w2),
        _weight_meta(ex.w13) + _weight_meta(ex.w2),
        -1,
    )
    torch.library.opcheck(
        torch.ops.pcie_a2a.moe_int4_mlp.default, args, test_utils=("test_schema", "test_faketensor")
    )
    xe = torch.randn(E, 3, H, generator=gen(8)).bfloat16()
    counts = torch.tensor([3, 0, 1, 2], dtype=torch.int32)
    args = (
        xe,
        counts,
        *_weight_args(ex.w13),
        *_weight_args(ex.w2),
        _weight_meta(ex.w13) + _weight_meta(ex.w2),
        -1,
    )
    torch.library.opcheck(
        torch.ops.pcie_a2a.moe_int4_mlp_expert_major.default,
        args,
        test_utils=("test_schema", "test_faketensor"),
    )
