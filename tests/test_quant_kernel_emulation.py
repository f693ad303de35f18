"""A line-by-line CPU emulation of the CUDA kernel's data flow (no GPU here to run it).

Mirrors csrc/cuda/moe_int4/{schedule.cuh, gemm_kernel.cuh}: the schedule kernels, the
per-item row metadata, load_stage's global -> shared offsets (activations with zero fill
and the act-order gather, the 2048-byte weight rows, the <= 2 scale/zero rows), the lane
decode of compute_stage (shift/mask pairs, magic-free integer values, (q - z) * s rounded
to the activation dtype), mma.m16n8k16 through the PTX fragment tables, and the three
epilogues. The emulated op must meet the GPU tests' error bound against the reference:
a wrong offset, group row, channel map or row index gives O(1) errors.

It checks the algorithm and the index arithmetic as transcribed, not the compiled code.
The transcription predates issue 12: its work split is the earlier whole-number split-K
and its decode is the shift/mask form; the kernel's current stream-K partition, ldmatrix
and Marlin-style dequant run in tests/test_quant_kernel_source_emulation.py (the source
itself). The layout and fragment arithmetic checked here are unchanged.
"""

from __future__ import annotations

import pytest
import torch

from pcie_a2a.quant import (
    PackedInt4Experts,
    from_awq,
    from_gptq,
    moe_int4_mlp_expert_major_reference,
    moe_int4_mlp_reference,
    random_int4,
    to_awq,
    to_gptq,
)

KBLOCK_K, KBLOCK_N, KWARPS, KTILE_N = 64, 256, 4, 64
LANE = torch.arange(32)
G, C = LANE // 4, LANE % 4


def schedule_rows(ids, wts, e, bm):
    flat = ids.flatten().tolist()
    topk = ids.shape[1]
    cnt = [0] * e
    for v in flat:
        if 0 <= v < e:
            cnt[v] += 1
    off, tile_off, pairs, tiles = [], [], 0, 0
    for x in range(e):
        off.append(pairs)
        tile_off.append(tiles)
        pairs += cnt[x]
        tiles += (cnt[x] + bm - 1) // bm
    cursor = [0] * e
    pair_src, pair_w = [0] * max(pairs, 1), [0.0] * max(pairs, 1)
    for i, v in enumerate(flat):
        if 0 <= v < e:
            pos = off[v] + cursor[v]
            cursor[v] += 1
            pair_src[pos] = i // topk
            pair_w[pos] = float(wts.flatten()[i])
    return pair_src, pair_w, _tiles(cnt, off, bm)


def schedule_expert_major(counts, cap, e, bm):
    cnt = [min(max(int(c), 0), cap) for c in counts]
    off, pairs = [], 0
    for x in range(e):
        off.append(pairs)
        pairs += cnt[x]
    pair_src, pair_w = [0] * max(pairs, 1), [1.0] * max(pairs, 1)
    for i in range(cap * e):
        x, r = i // cap, i % cap
        if r < cnt[x]:
            pair_src[off[x] + r] = i
    return pair_src, pair_w, _tiles(cnt, off, bm)


def _tiles(cnt, off, bm):
    out = []
    for x, n in enumerate(cnt):
        for t in range((n + bm - 1) // bm):
            out.append((x, off[x] + t * bm, min(bm, n - t * bm)))
    return out


def mma(af, b):
    """af: [32 lanes, 4 regs, 2 halves] A, b: [32, 2 regs, 2 halves] B -> D frag [32, 4]."""
    a = torch.zeros(16, 16)
    for i in range(4):
        for h in range(2):
            a[G + 8 * (i % 2), 2 * C + h + 8 * (i // 2)] = af[:, i, h]
    bm = torch.zeros(16, 8)
    for r in range(2):
        for h in range(2):
            bm[2 * C + h + 8 * r, G] = b[:, r, h]
    d = a @ bm
    return torch.stack([d[G + 8 * (e // 2), 2 * C + e % 2] for e in range(4)], dim=1)


MAX_SPLITS, MIN_SPLIT_K_TILES = 16, 4


def gemm(p, dtype, bm, grid):
    """One launch of moe_int4_gemm_kernel<T, bm> on ``grid`` CTAs (items in any order)."""
    a = p["a"]  # [rows, lda] dtype
    n_pad, k_pad, group = p["n_pad"], p["k_pad"], p["group"]
    qw = p["qweight"].flatten()
    sc = p["scales"].flatten()
    zs = None if p["zeros"] is None else p["zeros"].flatten()
    n_tiles = n_pad // KTILE_N
    n_blocks, k_tiles = n_pad // KBLOCK_N, k_pad // KBLOCK_K
    base_items = len(p["tiles"]) * n_blocks
    splits = 1
    if (
        base_items > 0
        and p["epilogue"] != 2
        and (p["epilogue"] != 0 or base_items <= p["ws_items"])
    ):
        splits = max(1, min(grid // base_items, MAX_SPLITS, k_tiles // MIN_SPLIT_K_TILES))
    ws, tickets = {}, {}
    for item in range(base_items * splits):
        base, part = item // splits, item % splits
        kt_begin, kt_end = part * k_tiles // splits, (part + 1) * k_tiles // splits
        expert, pair0, rows = p["tiles"][base // n_blocks]
        nb = base % n_blocks
        live = [r < rows for r in range(bm)]
        src = [p["pair_src"][pair0 + r] if live[r] else -1 for r in range(bm)]
        arow = [(src[r] if p["a_gather"] else pair0 + r) if live[r] else -1 for r in range(bm)]
        acc = torch.zeros(bm // 16, KWARPS, 8, 32, 4)
        for kt in range(kt_begin, kt_end):
            # ---- load_stage
            k0 = kt * KBLOCK_K
            sa = torch.zeros(bm, KBLOCK_K + 8, dtype=dtype)
            for r in range(bm):
                for kc in range(8):
                    col = k0 + kc * 8
                    if p["a_perm"] is None:
                        if arow[r] >= 0 and col < p["a_cols"]:
                            sa[r, kc * 8 : kc * 8 + 8] = a[arow[r], col : col + 8]
                    else:
                        perm = p["a_perm"][expert, col : col + 8]
                        for i in range(8):
                            if arow[r] >= 0 and perm[i] >= 0:
                                sa[r, kc * 8 + i] = a[arow[r], perm[i]]
            qbase = expert * (k_pad // 16) * (2 * n_pad)
            sb = torch.zeros(512 * 4, dtype=torch.int64)
            for c in range(512):
                s, w = c // 128, c % 128
                word = ((kt * 4 + s) * n_tiles + nb * KWARPS) * 128 + w * 4
                sb[c * 4 : c * 4 + 4] = qw[qbase + word : qbase + word + 4].long() & 0xFFFFFFFF
            g0 = k0 // group
            ng = KBLOCK_K // group if group < KBLOCK_K else 1
            sbase = expert * p["num_groups"] * n_pad + nb * KBLOCK_N
            ss = torch.zeros(2, KBLOCK_N, dtype=dtype)
            sz = torch.zeros(2, KBLOCK_N, dtype=dtype)
            for r in range(ng):
                lo = sbase + (g0 + r) * n_pad
                ss[r] = sc[lo : lo + KBLOCK_N]
                if zs is not None:
                    sz[r] = zs[lo : lo + KBLOCK_N]
            # ---- compute_stage
            for s in range(4):
                gi = (k0 + s * 16) // group - g0
                for warp in range(KWARPS):
                    chunk = (s * KWARPS + warp) * 32 + LANE
                    words = torch.stack([sb[chunk * 4 + j] for j in range(4)], 1)  # [32, 4]
                    cols = warp * KTILE_N + 8 * G.view(32, 1) + torch.arange(8)
                    sv = ss[gi][cols]  # [32, 8]: element t = scale of n8 tile t
                    zv = sz[gi][cols] if zs is not None else torch.full((32, 8), 8.0)
                    b = torch.zeros(32, 8, 2, 2, dtype=dtype)
                    for j in range(4):
                        for q in range(4):
                            t = 2 * j + q // 2
                            raw = (words[:, j] >> (4 * q)) & 0x000F000F
                            vals = torch.stack([raw & 0xF, (raw >> 16) & 0xF], 1).float()
                            dq = (vals - zv[:, t : t + 1].float()).to(dtype)  # exact
                            b[:, t, q % 2] = dq * sv[:, t : t + 1]  # one rounding (hmul2)
                    for mb in range(bm // 16):
                        r0, r1 = mb * 16 + G, mb * 16 + G + 8
                        k = s * 16 + 2 * C
                        af = torch.stack(
                            [
                                torch.stack([sa[r0, k], sa[r0, k + 1]], 1),
                                torch.stack([sa[r1, k], sa[r1, k + 1]], 1),
                                torch.stack([sa[r0, k + 8], sa[r0, k + 9]], 1),
                                torch.stack([sa[r1, k + 8], sa[r1, k + 9]], 1),
                            ],
                            1,
                        ).float()
                        for t in range(8):
                            acc[mb, warp, t] += mma(af, b[:, t].float())
        # ---- split-K: gate/up parts reduce through the workspace, the last one goes on
        if splits > 1 and p["epilogue"] == 0:
            ws[base] = ws.get(base, 0) + acc
            tickets[base] = tickets.get(base, 0) + 1
            if tickets[base] < splits:
                continue
            acc = ws.pop(base)
        # ---- epilogue
        for warp in range(KWARPS):
            n0 = nb * KBLOCK_N + warp * KTILE_N
            for mb in range(bm // 16):
                for half in range(2):
                    for lane in range(32):
                        g, c = lane // 4, lane % 4
                        r = mb * 16 + g + 8 * half
                        if r >= rows:
                            continue
                        a_ = acc[mb, warp]
                        if p["epilogue"] == 0:
                            for t in range(4):
                                ch = (n0 // KTILE_N) * 32 + (8 * t + 2 * c) % 32
                                for e in range(2):
                                    gate = float(a_[t, lane, 2 * half + e])
                                    up = float(a_[t + 4, lane, 2 * half + e])
                                    v = gate / (1 + torch.exp(torch.tensor(-gate))) * up
                                    pos = ch + e
                                    if p["out_perm"] is not None:
                                        pos = int(p["out_perm"][expert, ch + e])
                                    p["out"][pair0 + r, pos] = v
                        else:
                            orow = src[r]
                            for t in range(8):
                                n = n0 + 8 * t + 2 * c
                                if n >= p["n_valid"]:
                                    continue
                                for e in range(2):
                                    v = float(a_[t, lane, 2 * half + e])
                                    if p["epilogue"] == 1:
                                        p["out"][orow, n + e] += p["pair_w"][pair0 + r] * v
                                    else:
                                        p["out"][orow, n + e] = v


def emulate_op(x, w13, w2, bm, *, ids=None, wts=None, counts=None, grid=8, ws_items=4):
    """moe_int4_run: schedule, gemm13, (zero acc), gemm2, finalize."""
    dtype, e, hdim = x.dtype, w13.num_experts, w13.k
    expert_major = counts is not None
    if expert_major:
        cap = x.shape[1]
        pair_src, pair_w, tiles = schedule_expert_major(counts.tolist(), cap, e, bm)
        a = x.reshape(-1, hdim)
    else:
        pair_src, pair_w, tiles = schedule_rows(ids, wts, e, bm)
        a = x
    h_stride = w13.n_pad // 2
    hbuf = torch.full((len(pair_src), h_stride), float("nan"), dtype=dtype)  # like empty()

    def weight(w):
        return dict(
            qweight=w.qweight,
            scales=w.scales,
            zeros=w.zeros,
            n_pad=w.n_pad,
            k_pad=w.k_pad,
            group=w.group_size_eff,
            num_groups=w.num_groups,
        )

    common = dict(pair_src=pair_src, pair_w=pair_w, tiles=tiles, ws_items=ws_items)
    gemm(
        dict(
            a=a,
            a_cols=hdim,
            a_perm=w13.k_perm,
            a_gather=True,
            epilogue=0,
            out=hbuf,
            out_perm=w2.k_perm_inv,
            n_valid=w13.n_pad,
            **weight(w13),
            **common,
        ),
        dtype,
        bm,
        grid,
    )
    if expert_major:
        out = torch.zeros(a.shape[0], hdim, dtype=dtype)
        gemm(
            dict(
                a=hbuf,
                a_cols=w2.k_pad,
                a_perm=None,
                a_gather=False,
                epilogue=2,
                out=out,
                out_perm=None,
                n_valid=hdim,
                **weight(w2),
                **common,
            ),
            dtype,
            bm,
            grid,
        )
        return out.view_as(x)
    acc = torch.zeros(x.shape[0], hdim)
    gemm(
        dict(
            a=hbuf,
            a_cols=w2.k_pad,
            a_perm=None,
            a_gather=False,
            epilogue=1,
            out=acc,
            out_perm=None,
            n_valid=hdim,
            **weight(w2),
            **common,
        ),
        dtype,
        bm,
        grid,
    )
    return acc.to(dtype)


def make(fmt, group_size, dtype, e, h, i, seed):
    g = torch.Generator().manual_seed(seed)
    kw = dict(group_size=group_size, scale_dtype=dtype, generator=g, scale=0.05)
    if fmt == "gptq-act":
        gate = random_int4(e, i, h, act_order=True, **kw)
        up = random_int4(e, i, h, **kw)
        up.g_idx = gate.g_idx.clone()
        down = random_int4(e, h, i, act_order=True, **kw)
        parts = []
        for w in (gate, up, down):
            d = to_gptq(w, checkpoint_format="gptq_v2")
            parts.append(from_gptq(**d, group_size=group_size, checkpoint_format="gptq_v2"))
    elif fmt == "awq":
        parts = [
            from_awq(**to_awq(random_int4(e, n, k, symmetric=False, **kw)), group_size=group_size)
            for n, k in ((i, h), (i, h), (h, i))
        ]
    else:
        parts = [random_int4(e, n, k, **kw) for n, k in ((i, h), (i, h), (h, i))]
    return PackedInt4Experts.from_weights(*parts, dtype)


def rel_err(out, ref):
    out, ref = out.float(), ref.float()
    return float((out - ref).abs().mean() / ref.abs().mean())


@pytest.mark.parametrize(
    ("fmt", "group_size", "dtype", "bm"),
    [
        ("ct", 32, torch.bfloat16, 16),
        ("awq", 64, torch.float16, 16),
        ("gptq-act", 32, torch.float16, 16),
        ("ct", -1, torch.bfloat16, 64),
    ],
)
def test_emulated_kernel_rows(fmt, group_size, dtype, bm):
    # Ragged K and N (padding), two 256-column blocks in both GEMMs (H 264 -> 512,
    # 2 * I 272 -> 512), two groups per k-tile at g=32.
    e, h, i = 3, 264, 136
    if bm == 64:
        h, i = 136, 72  # 4x the mma work per tile: keep this case small (one block)
    if fmt == "gptq-act":
        h, i = 256, 256  # act-order needs full groups; several groups so perms are not trivial
    ex = make(fmt, group_size, dtype, e, h, i, seed=1)
    g = torch.Generator().manual_seed(2)
    # 21 rows: experts 0 and 2 get 9 and 12 rows, so mma rows 8..15 of a tile carry data
    # (with <= 8 rows per tile, a mistake in the g+8 half of the fragments goes unseen).
    r = 21
    x = torch.randn(r, h, generator=g).to(dtype)
    ids = torch.tensor(
        [[0, 2], [1, -1], [-1, -1], [2, 0], [2, 1], [0, -1], [2, -1]] * 3, dtype=torch.int32
    )
    wts = torch.rand(r, 2, generator=g) * (ids >= 0)
    if fmt == "gptq-act":
        for w in (ex.w13, ex.w2):
            assert not torch.equal(w.k_perm[:, : w.k].long(), torch.arange(w.k).expand(e, -1))
    out = emulate_op(x, ex.w13, ex.w2, bm, ids=ids, wts=wts)
    ref = moe_int4_mlp_reference(x, ids, wts, ex.w13, ex.w2)
    assert torch.all(out[2] == 0)
    assert rel_err(out, ref) < 1e-2


def test_emulated_kernel_expert_major():
    e, cap, h, i = 3, 5, 136, 72
    ex = make("ct", 32, torch.bfloat16, e, h, i, seed=3)
    x = torch.randn(e, cap, h, generator=torch.Generator().manual_seed(4)).bfloat16()
    counts = torch.tensor([2, 0, 5], dtype=torch.int32)
    out = emulate_op(x, ex.w13, ex.w2, 16, counts=counts)
    ref = moe_int4_mlp_expert_major_reference(x, counts, ex.w13, ex.w2)
    assert torch.all(out[0, 2:] == 0) and torch.all(out[1] == 0)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("ws_items", [16, 4])
def test_emulated_kernel_split_k(ws_items):
    """Few items, many CTAs: both GEMMs split K (gate/up through the workspace, the down
    GEMM's parts red.add into the row accumulator). ws_items=4 < 8 gate/up items: the
    gate/up GEMM must fall back to one part while the down GEMM still splits."""
    e, h, i = 2, 512, 512
    ex = make("ct", 32, torch.bfloat16, e, h, i, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, h, generator=g).bfloat16()
    ids = torch.tensor([[0, 1], [1, -1], [0, -1]], dtype=torch.int32)
    wts = torch.rand(3, 2, generator=g) * (ids >= 0)
    out = emulate_op(x, ex.w13, ex.w2, 16, ids=ids, wts=wts, grid=64, ws_items=ws_items)
    ref = moe_int4_mlp_reference(x, ids, wts, ex.w13, ex.w2)
    assert rel_err(out, ref) < 1e-2
