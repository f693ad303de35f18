"""csrc/cuda/moe_int4/layout.h through the built ``_moe_int4`` module (no GPU needed).

The module builds wherever nvcc is found; importing and calling it needs no device. The
header's index functions must equal the Python layout (the tested oracle), and run()
must reject bad arguments with errors that name them, before touching the device.
"""

from __future__ import annotations

import pytest
import torch

from pcie_a2a.quant import PackedInt4Experts, random_int4
from pcie_a2a.quant import layout as L
from pcie_a2a.quant import moe as M

mi = pytest.importorskip("pcie_a2a._moe_int4", reason="pcie_a2a._moe_int4 is not built")


def test_constants():
    assert (mi.TILE_K, mi.TILE_N, mi.PAD_K, mi.PAD_N, mi.GATE_UP_BLOCK) == (
        L.TILE_K,
        L.TILE_N,
        L.PAD_K,
        L.PAD_N,
        L.GATE_UP_BLOCK,
    )


def test_nibble_source_matches_python():
    src = L._nibble_source()  # flat k * 64 + n, [32, 4, 8]
    for lane in range(32):
        for j in range(4):
            for p in range(8):
                k, n = mi.nibble_source(lane, j, p)
                assert k * 64 + n == int(src[lane, j, p]), (lane, j, p)


def test_scale_position_and_gate_up_match_python():
    cols = torch.arange(64)
    assert [mi.scale_position(c) for c in range(64)] == L.scale_position(cols).tolist()
    i_pad = 512
    for p in range(0, 2 * i_pad, 2):
        n0, col = p // 64 * 64, p % 64
        src = int(L.gate_up_source_row(torch.tensor(p), i_pad))
        if col < 32:  # gate columns: the kernel's channel is the gate row itself
            assert mi.gate_up_channel(n0, col) == src
        else:  # up columns of the same channel
            assert mi.gate_up_channel(n0, col) == src - i_pad


def _args(**kw):
    a = mi.Args()
    base = dict(
        dtype=0,
        block_m=16,
        num_experts=4,
        hidden=256,
        num_rows=8,
        num_topk=2,
        x=4096,
        out=4096,
        acc=4096,
        topk_ids=4096,
        topk_weights=4096,
        w13_qweight=4096,
        w13_scales=4096,
        w13_n_pad=256,
        w13_k_pad=256,
        w13_group=32,
        w13_num_groups=8,
        w2_qweight=4096,
        w2_scales=4096,
        w2_n_pad=256,
        w2_k_pad=128,
        w2_group=128,
        w2_num_groups=1,
        h_stride=128,
        h=4096,
        pair_src=4096,
        pair_w=4096,
        tiles=4096,
        status=4096,
        row_pairs=4096,
        active_rows=4096,
        row_cnt=4096,
        max_pairs=16,
        max_tiles=6,
    )
    base.update(kw)
    for k, v in base.items():
        setattr(a, k, v)
    return a


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        (dict(dtype=2), r"dtype=2; allowed: 0 \(bf16\), 1 \(fp16\)"),
        (dict(block_m=32), r"block_m=32; allowed: 16, 64"),
        (dict(num_experts=2000), r"num_experts=2000; allowed: 1..1024"),
        (dict(hidden=100), r"hidden=100; allowed: a positive multiple of 8"),
        (dict(x=4100), r"x=0x1004 is not 16-byte aligned"),
        (dict(topk_ids=4098), r"topk_ids=0x1002 is not 4-byte aligned"),
        (dict(topk_weights=0), r"topk_weights is null"),
        (dict(w13_group=16), r"w13_qweight group=16; allowed: 32, 64, 128, or k_pad"),
        (dict(w2_n_pad=300), r"w2_qweight n_pad=300; allowed: a positive multiple of 256"),
        (dict(w13_num_groups=4), r"num_groups=4 with k_pad=256 group=32"),
        (dict(h_stride=64), r"h_stride=64 must equal w13 n_pad / 2 \(128\)"),
        (dict(max_pairs=15), r"max_pairs=15 is below the number of .* pairs 16"),
        (dict(max_tiles=5), r"max_tiles=5; need >= num_experts \+ pairs / block_m \+ 1 = 6"),
        (dict(split_k=2), r"split_k=2; allowed: 0, 1"),
        (dict(block_m=64, w2_zeros=4096), r"block_m=64 is not available with zero points"),
        (dict(row_cnt=0), r"row_cnt is null"),
        (dict(errors=4098), r"errors=0x1002 is not 4-byte aligned"),
        (dict(x_perm=4096), r"x_perm_buf is null"),
        (
            dict(split_ws=4096, split_cnt=4096, ws_items=0),
            r"ws_items=0; must be >= 1 when split_ws is given",
        ),
    ],
)
def test_run_rejects_bad_arguments(kw, msg):
    with pytest.raises(ValueError, match=msg):
        mi.run(_args(**kw))


def test_smem_fits_99kb_parts():
    # sm_86/89/120: 99 KB (101376 bytes) per block, 100 KB per SM with 1 KB reserved per
    # block. The decode tile must fit twice per SM there.
    assert mi.gemm_smem_bytes(64) <= 101376
    assert 2 * (mi.gemm_smem_bytes(16) + 1024) <= 102400


@pytest.mark.parametrize("expert_major", [False, True])
def test_launch_fields_are_binding_args(expert_major):
    """moe._launch_fields (what _run_cuda passes) names only fields of the binding's Args,
    with values its setters accept; the GPU path cannot run here, so check it this way."""
    g = torch.Generator().manual_seed(0)
    kw = dict(group_size=32, scale_dtype=torch.bfloat16, generator=g)
    parts = [random_int4(2, n, k, **kw) for n, k in ((64, 128), (64, 128), (128, 64))]
    ex = PackedInt4Experts.from_weights(*parts, torch.bfloat16)
    if expert_major:
        x = torch.zeros(2, 3, 128, dtype=torch.bfloat16)
        io = dict(topk_ids=None, topk_weights=None, counts=torch.zeros(2, dtype=torch.int32))
    else:
        x = torch.zeros(5, 128, dtype=torch.bfloat16)
        ids = torch.zeros(5, 2, dtype=torch.int32)
        io = dict(topk_ids=ids, topk_weights=torch.zeros(5, 2), counts=None)
    fields = M._launch_fields(
        x,
        torch.empty_like(x),
        ex.w13,
        ex.w2,
        expert_major=expert_major,
        block_m=None,
        num_sms=4,
        empty=lambda *s, dtype: torch.empty(*s, dtype=dtype),
        workspace=M.Workspace(lambda *s, dtype: torch.zeros(*s, dtype=dtype), torch.zeros(1)),
        **io,
    )
    a = mi.Args()
    for name, v in fields.items():
        assert hasattr(a, name), name
        setattr(a, name, v.data_ptr() if isinstance(v, torch.Tensor) else (v or 0))
    assert a.expert_major is expert_major and a.block_m == 16 and a.h_stride == 128


def test_partition_matches_the_grid_model():
    """The kernel's stream-K partition (gemm_kernel.cuh) is the grid model's."""
    from pcie_a2a.quant import grid_model as G

    cases = [(16, 112, 376, True), (7, 18, 12, True), (3, 18, 2, False)]
    # the 32-bit owner() starts from a float estimate: many units over many CTAs
    cases += [(2000, 112, 752, True), (997, 29, 753, True), (500, 64, 1000, False)]
    for items, k_tiles, grid, split in cases:
        ctas, begins, owners = mi.partition(items, k_tiles, grid, split)
        pt = G.make_partition(items, k_tiles, grid, split)
        assert ctas == pt.ctas
        assert begins == [pt.begin(b) for b in range(pt.ctas + 1)]
        assert owners == [pt.owner(v) for v in range(pt.units)]
