"""The packed mma-fragment layout: bit-exact against every format's oracle, through a CPU
emulation of which lane holds which element (CPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pcie_a2a.quant import (
    dequantize_awq,
    dequantize_compressed_tensors,
    dequantize_gptq,
    dequantize_packed,
    from_awq,
    from_compressed_tensors,
    from_gptq,
    pack_int4,
    random_int4,
    to_awq,
    to_compressed_tensors,
    to_gptq,
)
from pcie_a2a.quant import layout as L
from pcie_a2a.quant.formats import concat_gate_up

GROUPS = (32, 64, 128, -1)
# (E, N, K): small ragged shapes and Kimi K2's gate/up (N=4096, K=7168).
SHAPES = [(2, 72, 200), (3, 8, 64), (1, 4096, 7168)]
HEADER = Path(__file__).resolve().parents[1] / "csrc" / "cuda" / "moe_int4" / "layout.h"


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)
    )


def make(fmt: str, shape, group_size: int, seed: int, act_order=False, symmetric=True):
    """(oracle fp32 [E, N, K], Int4Weights from the loader, scale dtype) for a checkpoint."""
    e, n, k = shape
    sdt = torch.bfloat16 if fmt == "ct" else torch.float16
    w = random_int4(
        e,
        n,
        k,
        group_size=group_size,
        scale_dtype=sdt,
        symmetric=symmetric,
        act_order=act_order,
        generator=gen(seed),
    )
    if fmt == "gptq":
        d = to_gptq(w, checkpoint_format="gptq_v2")
        g_idx = d.pop("g_idx") if act_order else None
        d.pop("g_idx", None)
        ref = dequantize_gptq(**d, g_idx=g_idx, group_size=group_size, checkpoint_format="gptq_v2")
        lw = from_gptq(**d, g_idx=g_idx, group_size=group_size, checkpoint_format="gptq_v2")
    elif fmt == "awq":
        d = to_awq(w)
        ref = dequantize_awq(**d, group_size=group_size)
        lw = from_awq(**d, group_size=group_size)
    else:
        d = to_compressed_tensors(w)
        ref = dequantize_compressed_tensors(**d, group_size=group_size)
        lw = from_compressed_tensors(**d, group_size=group_size)
    return ref, lw, sdt


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct"])
def test_packed_equals_original_bit_for_bit(fmt, group_size, shape):
    if shape[2] < 128 and group_size == 128:
        pass  # K padded up to the group: still exact
    ref, lw, sdt = make(
        fmt, shape, group_size, seed=hash((fmt, group_size)) % 1000, symmetric=(fmt != "awq")
    )
    p = pack_int4(lw, sdt)
    assert p.n_pad % L.PAD_N == 0 and p.k_pad % L.PAD_K == 0
    assert p.qweight.shape == (shape[0], p.k_pad // 16, 2 * p.n_pad)
    assert bits_equal(dequantize_packed(p), ref)


@pytest.mark.parametrize("group_size", (32, 64, 128))
def test_gptq_act_order_is_a_permutation(group_size):
    ref, lw, sdt = make("gptq", (2, 40, 384), group_size, seed=11, act_order=True)
    p = pack_int4(lw, sdt)
    assert p.k_perm is not None and p.k_perm.shape == (2, p.k_pad)
    assert bits_equal(dequantize_packed(p), ref)
    # The kernel gathers activations through k_perm: x[:, k_perm] @ W_packed == x @ W.
    x = torch.randn(3, 384)
    wp = dequantize_packed(L.PackedInt4Weight(**{**p.__dict__, "k_perm": None, "k": p.k_pad}))
    perm = p.k_perm[0].long()
    xp = torch.where(perm >= 0, x[:, perm.clamp(min=0)], torch.zeros(()))
    torch.testing.assert_close(xp @ wp[0].T, x @ ref[0].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct"])
@pytest.mark.parametrize("group_size", GROUPS)
def test_gate_up_interleave_exact(fmt, group_size):
    ref_g, g, sdt = make(fmt, (2, 48, 128), group_size, seed=21, symmetric=(fmt != "awq"))
    ref_u, u, _ = make(fmt, (2, 48, 128), group_size, seed=22, symmetric=(fmt != "awq"))
    p = pack_int4(concat_gate_up(g, u), sdt, gate_up=True)
    assert p.n_pad == 2 * L.round_up(48, L.PAD_N // 2)
    assert bits_equal(dequantize_packed(p), torch.cat([ref_g, ref_u], dim=1))


def test_one_element_by_hand():
    """(k=11, n=35) of tile (0, 0): lane 13 (c=1, g=3), word 2 (columns 32..47), nibble 5
    (value 3 = KOFF 9, first n8 tile): k = 2*1 + 9, n = 32 + 3. Scale of column 35 sits at
    position 8 * (35 % 8) + 35 // 8 = 28."""
    codes = torch.full((1, 64, 16), 8, dtype=torch.uint8)
    codes[0, 35, 11] = 13
    scales = torch.ones(1, 64, 1, dtype=torch.bfloat16)
    scales[0, 35, 0] = 3.0
    p = pack_int4(L.Int4Weights(codes, scales, None, -1), torch.bfloat16)
    word = int(p.qweight[0, 0, 13 * 4 + 2]) & 0xFFFFFFFF
    assert (word >> 20) & 0xF == 13
    others = [(word >> (4 * q)) & 0xF for q in range(8) if q != 5]
    assert others == [8] * 7
    assert p.scales[0, 0, 28].item() == 3.0


def test_gate_up_source_row():
    i_pad = 128
    src = L.gate_up_source_row(torch.tensor([0, 31, 32, 63, 64, 100]), i_pad)
    assert src.tolist() == [0, 31, i_pad + 0, i_pad + 31, 32, i_pad + 32 + 4]


def test_header_constants_match_python():
    """csrc/cuda/moe_int4/layout.h mirrors this module; keep the numbers in step."""
    text = HEADER.read_text()

    def const(name: str) -> int:
        m = re.search(rf"\b{name}\s*=\s*(\d+)", text)
        assert m, f"{name} not found in {HEADER}"
        return int(m.group(1))

    assert const("kTileK") == L.TILE_K
    assert const("kTileN") == L.TILE_N
    assert const("kPadK") == L.PAD_K
    assert const("kPadN") == L.PAD_N
    assert const("kGateUpBlock") == L.GATE_UP_BLOCK
    m = re.search(r"kNibbleOrder\[8\]\s*=\s*\{([^}]*)\}", text)
    assert m and tuple(int(v) for v in m.group(1).split(",")) == L.NIBBLE_ORDER
    m = re.search(r"kKOff\[4\]\s*=\s*\{([^}]*)\}", text)
    assert m and tuple(int(v) for v in m.group(1).split(",")) == L.KOFF


def test_fragment_map_is_a_bijection():
    _, where = L.emulate_fragments(pack_int4(random_int4(64, 16, group_size=-1), torch.bfloat16))
    flat = (where[..., 0] * 64 + where[..., 1]).flatten()
    assert torch.equal(torch.sort(flat).values, torch.arange(1024))


# ---- errors ------------------------------------------------------------------------------


def test_pack_errors():
    w = random_int4(2, 16, 64, group_size=32, generator=gen(3))
    with pytest.raises(ValueError, match=r"dtype=torch.float32 is not supported; supported"):
        pack_int4(w, torch.float32)
    odd = random_int4(2, 15, 64, group_size=32, generator=gen(3))
    with pytest.raises(ValueError, match="even N .* got 15"):
        pack_int4(odd, torch.bfloat16, gate_up=True)
    big = random_int4(2, 16, 64, group_size=32, generator=gen(3))
    big.scales = big.scales.float()
    big.scales[0, 0, 0] = 1.0 + 2**-20  # not representable in bf16
    with pytest.raises(
        ValueError,
        match=r"scales: 1 of 64 values change .*float32 to the activation dtype "
        r"torch.bfloat16",
    ):
        pack_int4(big, torch.bfloat16)
    pack_int4(big, torch.bfloat16, allow_inexact_scales=True)
    bad = random_int4(1, 8, 64, group_size=32, act_order=True, generator=gen(4))
    bad.g_idx[..., 0] = 1  # group 1 now has 33 members
    with pytest.raises(ValueError, match="groups of exactly group_size=32"):
        pack_int4(bad, torch.float16)
