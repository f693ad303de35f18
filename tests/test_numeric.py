"""The host/device scalar conversions of csrc/core/numeric.h against torch's casts, bit
for bit: they define the bytes every transport puts on the wire."""

from __future__ import annotations

import pytest
import torch

from pcie_a2a import _native
from pcie_a2a.reference import quantize_fp8


def _sweep() -> torch.Tensor:
    """Every bf16 value's neighbourhood plus random floats: dense around each rounding tie."""
    all_bf16 = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    base = all_bf16.float()
    base = base[torch.isfinite(base)]
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(200_000, generator=g) * torch.exp2(
        torch.randint(-20, 20, (200_000,), generator=g).float()
    )
    ties = base * (1 + 2.0**-9)  # halfway points of bf16-like grids
    return torch.cat([base, noise, ties, base.nextafter(torch.tensor(float("inf")))])


def test_fp8_e4m3_encoder_matches_torch():
    v = _sweep()
    v = v[v.abs() <= 448]  # beyond 448 we saturate where torch gives NaN
    out = torch.empty(v.numel(), dtype=torch.uint8)
    _native.transport().float_to_fp8(v.data_ptr(), v.numel(), out.data_ptr())
    want = v.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (out != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. {v[bad[:5]].tolist()}"


def test_fp8_e4m3_encoder_saturates():
    v = torch.tensor([448.0, 449.0, 1e6, float("inf"), -1e9], dtype=torch.float32)
    out = torch.empty(5, dtype=torch.uint8)
    _native.transport().float_to_fp8(v.data_ptr(), 5, out.data_ptr())
    assert out.tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE]


@pytest.mark.parametrize("dtype, code", [(torch.bfloat16, 0), (torch.float16, 1)])
def test_half_encoders_match_torch(dtype, code):
    v = _sweep()
    out = torch.empty(v.numel(), dtype=torch.int16)
    _native.transport().float_to_half(v.data_ptr(), v.numel(), code, out.data_ptr())
    want = v.to(dtype).view(torch.int16)
    bad = (out != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. {v[bad[:5]].tolist()}"


@pytest.mark.parametrize("dtype, code", [(torch.bfloat16, 0), (torch.float16, 1)])
def test_group_quantisation_matches_reference(dtype, code):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(16, 512, generator=g) * torch.logspace(-4, 3, 16).unsqueeze(1)).to(dtype)
    x[3, :128] = 0  # an all-zero group stays finite
    q = torch.empty(16, 512, dtype=torch.uint8)
    s = torch.empty(16, 4, dtype=torch.float32)
    _native.transport().quantize_fp8_rows(x.data_ptr(), code, 16, 512, q.data_ptr(), s.data_ptr())
    want_q, want_s = quantize_fp8(x)
    assert torch.equal(s, want_s)
    assert torch.equal(q, want_q.view(torch.uint8))
