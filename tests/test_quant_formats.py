"""INT4 checkpoint formats: hand-checked packing orders, oracles, loaders, errors (CPU)."""

from __future__ import annotations

import pytest
import torch

from pcie_a2a.quant import (
    concat_gate_up,
    dequantize_awq,
    dequantize_compressed_tensors,
    dequantize_gptq,
    from_awq,
    from_compressed_tensors,
    from_gptq,
    random_int4,
    stack_experts,
    to_awq,
    to_compressed_tensors,
    to_gptq,
)

GROUPS = (32, 64, 128, -1)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def word(nibbles: dict[int, int]) -> int:
    """An int32 with nibble p = value (two's complement)."""
    v = sum(val << (4 * p) for p, val in nibbles.items())
    return v - 2**32 if v >= 2**31 else v


# ---- packing orders, checked by hand ---------------------------------------------------


def test_gptq_packs_along_k_and_v1_zero_is_stored_minus_one():
    k, n = 16, 8
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    qweight[1, 3] = word({5: 12})  # row 8 * 1 + 5 = 13, column 3 -> code 12
    qzeros = torch.full((1, 1), word(dict.fromkeys(range(8), 7)), dtype=torch.int32)
    scales = torch.full((1, n), 0.5, dtype=torch.float16)
    w = dequantize_gptq(qweight, qzeros, scales, group_size=-1)  # [N, K]
    assert w[3, 13].item() == (12 - 8) * 0.5
    assert w[3, 12].item() == (0 - 8) * 0.5
    lw = from_gptq(qweight, qzeros, scales, group_size=-1)
    assert lw.zeros is None  # every stored zero 7 (= 8 - 1): symmetric
    assert lw.codes[3, 13].item() == 12


def test_awq_interleave():
    k, n = 4, 8
    qweight = torch.zeros(k, n // 8, dtype=torch.int32)
    qweight[2, 0] = word({1: 9})  # nibble 1 holds column AWQ_ORDER[1] = 2
    qzeros = torch.full((1, 1), word({1: 3}), dtype=torch.int32)  # column 2 zero 3
    scales = torch.ones(1, n, dtype=torch.float16)
    w = dequantize_awq(qweight, qzeros, scales, group_size=-1)
    assert w[2, 2].item() == 9 - 3
    assert w[2, 0].item() == -3  # [N, K]: column 2, row 0 -> code 0, zero 3
    assert w[1, 2].item() == 0  # column 1: code 0, zero 0
    lw = from_awq(qweight, qzeros, scales, group_size=-1)
    assert lw.codes[2, 2].item() == 9 and lw.zeros[2, 0].item() == 3


def test_compressed_tensors_packs_along_k_with_offset_8():
    n, k = 2, 10  # ragged K: two words per row, the second half used
    packed = torch.full((n, 2), word(dict.fromkeys(range(8), 8)), dtype=torch.int32)
    packed[1, 1] = word({0: 8, 1: 15})  # element j = 9 of row 1 -> 15 - 8 = 7
    scale = torch.tensor([[2.0], [0.25]], dtype=torch.bfloat16)
    w = dequantize_compressed_tensors(packed, scale, (n, k), group_size=-1)
    assert w.shape == (n, k)
    assert w[1, 9].item() == 7 * 0.25 and w[1, 8].item() == 0
    assert from_compressed_tensors(packed, scale, (n, k), group_size=-1).codes[1, 9] == 15


# ---- loaders agree with the oracles (which are independent code) ------------------------


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_loader_matches_oracle(group_size, symmetric, fmt):
    w = random_int4(
        2,
        24,
        96,
        group_size=group_size,
        symmetric=symmetric,
        generator=gen(1),
        scale_dtype=torch.float16,
    )
    if fmt == "gptq" and w.zeros is not None:
        w.zeros.clamp_(min=1)  # v1 cannot store zero point 0
    d = to_gptq(w, checkpoint_format=fmt)
    ref = dequantize_gptq(**d, group_size=group_size, checkpoint_format=fmt)
    got = from_gptq(**d, group_size=group_size, checkpoint_format=fmt)
    assert torch.equal(got.dequantize(), ref)
    assert torch.equal(ref, w.dequantize())


@pytest.mark.parametrize("group_size", (32, 64, 128))
def test_gptq_act_order_loader_matches_oracle(group_size):
    w = random_int4(2, 16, 256, group_size=group_size, act_order=True, generator=gen(2))
    d = to_gptq(w)
    ref = dequantize_gptq(**d, group_size=group_size)
    got = from_gptq(**d, group_size=group_size)
    assert got.g_idx is not None
    assert torch.equal(got.dequantize(), ref)


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_loader_matches_oracle(group_size, symmetric):
    w = random_int4(
        3,
        40,
        128,
        group_size=group_size,
        symmetric=symmetric,
        generator=gen(3),
        scale_dtype=torch.float16,
    )
    d = to_awq(w)
    ref = dequantize_awq(**d, group_size=group_size)
    assert torch.equal(from_awq(**d, group_size=group_size).dequantize(), ref)
    assert torch.equal(ref, w.dequantize())


@pytest.mark.parametrize("group_size", GROUPS)
def test_compressed_tensors_loader_matches_oracle(group_size):
    w = random_int4(2, 24, 100, group_size=group_size, generator=gen(4))  # ragged K
    d = to_compressed_tensors(w)
    ref = dequantize_compressed_tensors(**d, group_size=group_size)
    assert torch.equal(from_compressed_tensors(**d, group_size=group_size).dequantize(), ref)
    assert torch.equal(ref, w.dequantize())


def test_stack_and_concat():
    a = random_int4(8, 32, group_size=32, generator=gen(5))
    b = random_int4(8, 32, group_size=32, generator=gen(6))
    s = stack_experts([a, b])
    assert s.codes.shape == (2, 8, 32)
    gu = concat_gate_up(s, s)
    assert gu.codes.shape == (2, 16, 32)


# ---- errors say what was given and what is supported -------------------------------------


def test_unsupported_group_size_message():
    w = random_int4(8, 64, group_size=32, generator=gen(7))
    d = to_gptq(w)
    with pytest.raises(ValueError, match=r"group_size=16 .*supported: 32, 64, 128, or -1"):
        from_gptq(**d, group_size=16)


def test_wrong_shapes_and_dtypes():
    w = random_int4(16, 64, group_size=32, generator=gen(8), scale_dtype=torch.float16)
    d = to_gptq(w)
    with pytest.raises(ValueError, match=r"scales has shape \(1, 16\); expected \[\.\.\., 2, 16\]"):
        from_gptq(d["qweight"], d["qzeros"], d["scales"][:1], group_size=32)
    with pytest.raises(ValueError, match="qweight must be int32, got torch.int64"):
        from_gptq(d["qweight"].long(), d["qzeros"], d["scales"], group_size=32)
    with pytest.raises(ValueError, match="checkpoint_format='exl2'"):
        from_gptq(**d, group_size=32, checkpoint_format="exl2")
    a = to_awq(w)
    with pytest.raises(ValueError, match=r"qzeros has shape"):
        from_awq(a["qweight"], a["qzeros"][:1], a["scales"], group_size=32)
    c = to_compressed_tensors(w)
    with pytest.raises(ValueError, match=r"weight_packed has shape .*expected \[\.\.\., 16, 9\]"):
        from_compressed_tensors(c["weight_packed"], c["weight_scale"], (16, 72), group_size=32)
    with pytest.raises(ValueError, match="weight_zero_point .* not supported"):
        from_compressed_tensors(**c, group_size=32, weight_zero_point=torch.zeros(2, 2))


def test_gate_up_with_different_act_order_rejected():
    a = random_int4(8, 64, group_size=32, act_order=True, generator=gen(9))
    b = random_int4(8, 64, group_size=32, act_order=True, generator=gen(10))
    with pytest.raises(ValueError, match="different act-order g_idx"):
        concat_gate_up(a, b)


# ---- a layer's experts from checkpoint tensors, by name -----------------------------------


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "awq"])
def test_load_int4_experts_from_state_dict(fmt):
    from pcie_a2a.quant import dequantize_packed, load_int4_experts

    e_ids, h, i = [3, 0, 5], 64, 48
    sdt = torch.bfloat16 if fmt == "compressed-tensors" else torch.float16
    sd, want = {}, {p: [] for p in ("gate_proj", "up_proj", "down_proj")}
    for seed, e in enumerate(e_ids):
        for j, (proj, n, k) in enumerate(
            (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i))
        ):
            w = random_int4(
                n,
                k,
                group_size=32,
                scale_dtype=sdt,
                symmetric=fmt != "awq",
                generator=gen(10 * seed + j),
            )
            d = {"compressed-tensors": to_compressed_tensors, "awq": to_awq}.get(fmt, to_gptq)(w)
            if fmt == "gptq":
                d.pop("g_idx")
            for name, t in d.items():
                sd[f"model.layers.1.mlp.experts.{e}.{proj}.{name}"] = t
            want[proj].append(w.dequantize())
    ex = load_int4_experts(
        sd, "model.layers.1.mlp.experts", e_ids, fmt=fmt, group_size=32, dtype=sdt
    )
    assert ex.num_experts == 3 and ex.hidden == h and ex.intermediate == i
    w13 = torch.cat([torch.stack(want["gate_proj"]), torch.stack(want["up_proj"])], dim=1)
    assert torch.equal(dequantize_packed(ex.w13), w13)
    assert torch.equal(dequantize_packed(ex.w2), torch.stack(want["down_proj"]))


def test_load_int4_experts_errors():
    from pcie_a2a.quant import load_int4_experts

    with pytest.raises(ValueError, match="fmt='exl2' is not supported; supported: "):
        load_int4_experts({}, "p", [0], fmt="exl2", group_size=32, dtype=torch.bfloat16)
    with pytest.raises(KeyError, match=r"'p.0.gate_proj.weight_packed' not found"):
        load_int4_experts(
            {}, "p", [0], fmt="compressed-tensors", group_size=32, dtype=torch.bfloat16
        )


def test_compressed_tensors_actorder_group():
    from pcie_a2a.quant import dequantize_packed, pack_int4

    w = random_int4(2, 16, 128, group_size=32, act_order=True, generator=gen(11))
    d = to_compressed_tensors(w)
    assert "weight_g_idx" in d
    ref = dequantize_compressed_tensors(**d, group_size=32)
    assert torch.equal(ref, w.dequantize())
    lw = from_compressed_tensors(**d, group_size=32)
    assert torch.equal(dequantize_packed(pack_int4(lw, torch.bfloat16)), ref)
