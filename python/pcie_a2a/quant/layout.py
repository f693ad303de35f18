"""The packed INT4 layout the expert kernel reads, its packer, and a CPU emulation of it.

Why this layout (hardware reason): the kernel multiplies with ``mma.sync.m16n8k16``
(bf16/fp16 in, fp32 accumulate). For its B operand (the weights, K x N, "col"), lane
``t`` of a warp holds column ``t / 4`` of an n8 tile, rows ``k = 2 (t % 4) + {0, 1}`` in
register b0 and ``+ {8, 9}`` in b1 (PTX ISA, "Matrix Fragments for mma.m16n8k16").
We store weights so that, for one 16 (k) x 64 (n) tile, each lane finds *all* of its
nibbles for the 8 n8 tiles of that tile in 4 consecutive 32-bit words: one 16-byte load,
no shuffles, and a 512-byte contiguous tile for coalesced global reads. The mirror of
this file in C++ is ``csrc/cuda/moe_int4/layout.h``; the two must stay trivially identical
(same constant names, same formulas), and this module is the tested oracle.

Packed weight of one expert (after padding to ``n_pad`` x ``k_pad``):

* ``qweight[e, kt, nt*128 + lane*4 + j]`` int32, ``kt = k / 16``, ``nt = n / 64``:
  word ``j`` (0..3) of ``lane`` covers columns ``16 j .. 16 j + 15`` of the 64-column
  tile. Nibble ``p`` of the word holds logical value ``v = NIBBLE_ORDER[p]``, where value
  ``v`` is column ``16 j + 8 (v // 4) + lane // 4`` and row ``2 (lane % 4) + KOFF[v % 4]``.
  The order ``[0, 2, 4, 6, 1, 3, 5, 7]`` is chosen so that ``(word >> 4 s) & 0x000F000F``
  yields, for s = 0..3, exactly the (low, high) pairs of registers b0, b1 of n8 tile
  ``2 j`` and b0, b1 of n8 tile ``2 j + 1``: one mask per register, no nibble shuffles.
* ``scales[e, gi, n']`` in the activation dtype, ``n'`` permuted inside each block of 64
  columns: position ``8 (c % 8) + c // 8`` holds column ``c``, so lane group ``g = lane/4``
  finds the scales of its 8 columns ``g, g + 8, ..., g + 56`` at ``8 g .. 8 g + 7``: one
  16-byte load. Zero points (AWQ) use the same layout, stored as small integers in the
  activation dtype; ``None`` means symmetric (zero point 8).
* Per-channel quantisation is one group spanning ``k_pad`` (``group_size_eff``).
* Padding: N to a multiple of ``PAD_N`` (the kernel's CTA tile), K to a multiple of
  ``max(PAD_K, group_size)``. Padded weights dequantise to exactly 0 (code = zero point,
  or scale 0).
* Gate/up (w13): rows are interleaved in blocks of 32: packed column ``p`` is gate
  channel ``32 (p // 64) + p % 32`` when ``p % 64 < 32``, else the up row of that channel.
  So the accumulators of n8 tiles ``i`` and ``i + 4`` of a warp's 64-column slice hold gate
  and up of the same channel in the same lane, and SiLU(gate) * up happens in registers.
* Act-order (GPTQ ``desc_act``): K is sorted by ``g_idx`` (stable) so groups are
  contiguous; ``k_perm[e, j]`` is the logical input channel at packed position ``j``
  (-1 for padding). The kernel gathers activations through it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .formats import Int4Weights, _pack_nibbles

TILE_K = 16  # mma k
TILE_N = 64  # four 16-column sub-tiles = 8 n8 tiles per warp
WARP = 32
PAD_K = 64  # the kernel's k-tile per pipeline stage
PAD_N = 256  # the kernel's CTA tile in N (4 warps x 64)
GATE_UP_BLOCK = 32  # gate/up interleave granularity inside each 64-column tile
NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p holds logical value NIBBLE_ORDER[p]
KOFF = (0, 1, 8, 9)  # k offset (from 2 * (lane % 4)) of logical value v % 4

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def padded_k(k: int, group_size: int) -> int:
    return round_up(k, PAD_K if group_size == -1 else max(PAD_K, group_size))


def scale_position(col: torch.Tensor) -> torch.Tensor:
    """Column ``c`` of a 64-column block -> its position in the permuted scale row."""
    return 8 * (col % 8) + col // 8


def gate_up_source_row(p: torch.Tensor, i_pad: int) -> torch.Tensor:
    """Packed w13 column -> row of ``cat(gate_pad, up_pad)`` (each ``i_pad`` rows)."""
    blk, r = p // TILE_N, p % TILE_N
    ch = blk * GATE_UP_BLOCK + r % GATE_UP_BLOCK
    return torch.where(r < GATE_UP_BLOCK, ch, ch + i_pad)


def _nibble_source() -> torch.Tensor:
    """int64 [32 lanes, 4 words, 8 nibbles]: flat ``k * 64 + n`` inside a 16x64 tile."""
    lane = torch.arange(WARP).view(WARP, 1, 1)
    j = torch.arange(4).view(1, 4, 1)
    v = torch.tensor(NIBBLE_ORDER).view(1, 1, 8)
    k = 2 * (lane % 4) + torch.tensor(KOFF)[v % 4]
    n = 16 * j + 8 * (v // 4) + lane // 4
    return k * TILE_N + n


@dataclass
class PackedInt4Weight:
    """A stack of INT4 expert matrices ``[E, N, K]`` in the kernel layout."""

    qweight: torch.Tensor  # int32 [E, k_pad / 16, 2 * n_pad]
    scales: torch.Tensor  # dtype [E, G, n_pad] (permuted)
    zeros: torch.Tensor | None  # dtype [E, G, n_pad] (permuted) or None (symmetric)
    k_perm: torch.Tensor | None  # int32 [E, k_pad]: logical k at packed position, -1 pad
    k_perm_inv: torch.Tensor | None  # int32 [E, round_up(k, PAD_N/2)]: inverse, identity pad
    n: int
    k: int
    n_pad: int
    k_pad: int
    group_size: int  # 32, 64, 128 or -1 (per channel)
    dtype: torch.dtype
    gate_up: bool  # rows interleaved as gate/up (w13)

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def group_size_eff(self) -> int:
        return self.k_pad if self.group_size == -1 else self.group_size

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes the kernel streams for all experts (weights + scales + zeros)."""
        b = self.qweight.numel() * 4 + self.scales.numel() * self.scales.element_size()
        if self.zeros is not None:
            b += self.zeros.numel() * self.zeros.element_size()
        return b

    def to(self, device: torch.device | str) -> PackedInt4Weight:
        def mv(t):
            return None if t is None else t.to(device)

        return replace(
            self,
            qweight=self.qweight.to(device),
            scales=self.scales.to(device),
            zeros=mv(self.zeros),
            k_perm=mv(self.k_perm),
            k_perm_inv=mv(self.k_perm_inv),
        )


@dataclass
class PackedInt4Experts:
    """The routed experts of one MoE layer on one rank: w13 (gate|up) and w2 (down)."""

    w13: PackedInt4Weight  # logical [E, 2 I, H], gate/up interleaved
    w2: PackedInt4Weight  # logical [E, H, I]

    def __post_init__(self) -> None:
        check_expert_pair(self.w13, self.w2)

    @property
    def hidden(self) -> int:
        return self.w2.n

    @property
    def intermediate(self) -> int:
        return self.w2.k

    @property
    def num_experts(self) -> int:
        return self.w13.num_experts

    @property
    def dtype(self) -> torch.dtype:
        return self.w13.dtype

    def to(self, device: torch.device | str) -> PackedInt4Experts:
        return PackedInt4Experts(self.w13.to(device), self.w2.to(device))

    @staticmethod
    def from_weights(
        gate: Int4Weights,
        up: Int4Weights,
        down: Int4Weights,
        dtype: torch.dtype,
        *,
        allow_inexact_scales: bool = False,
    ) -> PackedInt4Experts:
        from .formats import concat_gate_up

        w13 = pack_int4(
            concat_gate_up(gate, up), dtype, gate_up=True, allow_inexact_scales=allow_inexact_scales
        )
        w2 = pack_int4(down, dtype, allow_inexact_scales=allow_inexact_scales)
        return PackedInt4Experts(w13, w2)


def check_expert_pair(w13: PackedInt4Weight, w2: PackedInt4Weight) -> None:
    if not w13.gate_up:
        raise ValueError("w13 must be packed with gate_up=True (gate/up interleaved)")
    if w2.gate_up:
        raise ValueError("w2 must be packed with gate_up=False")
    if w13.num_experts != w2.num_experts:
        raise ValueError(f"w13 has {w13.num_experts} experts but w2 has {w2.num_experts}")
    if w13.n != 2 * w2.k:
        raise ValueError(f"w13 N={w13.n} must be 2 * w2 K (2 * {w2.k} = {2 * w2.k})")
    if w13.k != w2.n:
        raise ValueError(f"w13 K={w13.k} (hidden) must equal w2 N={w2.n} (hidden)")
    if w13.dtype != w2.dtype:
        raise ValueError(f"w13 dtype {w13.dtype} differs from w2 dtype {w2.dtype}")


def _to_dtype_exact(t: torch.Tensor, dtype: torch.dtype, name: str, allow: bool) -> torch.Tensor:
    out = t.to(dtype)
    if not allow and not torch.equal(out.float(), t.float()):
        bad = (out.float() != t.float()).sum().item()
        raise ValueError(
            f"{name}: {bad} of {t.numel()} values change when converted from {t.dtype} to "
            f"the activation dtype {dtype}; supported: exactly representable scales, or "
            "pass allow_inexact_scales=True to round them"
        )
    return out


def pack_int4(
    w: Int4Weights,
    dtype: torch.dtype,
    *,
    gate_up: bool = False,
    allow_inexact_scales: bool = False,
) -> PackedInt4Weight:
    """Pack ``[E, N, K]`` (or ``[N, K]``) weights for activations of ``dtype``.

    ``gate_up=True`` treats rows ``0..N/2-1`` as gate and ``N/2..N-1`` as up and
    interleaves them for the fused SiLU epilogue.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"dtype={dtype} is not supported; supported: torch.bfloat16, torch.float16"
        )
    w.validate()
    _to_dtype_exact(w.scales, dtype, "scales", allow_inexact_scales)
    codes, scales, zeros, g_idx = w.codes, w.scales, w.zeros, w.g_idx
    if codes.dim() == 2:
        codes, scales = codes[None], scales[None]
        zeros = None if zeros is None else zeros[None]
        g_idx = None if g_idx is None else g_idx.reshape(1, -1)
    if codes.dim() != 3:
        raise ValueError(f"codes must be [E, N, K] or [N, K], got {tuple(w.codes.shape)}")
    e, n, k = codes.shape
    if k == 0 or n == 0:
        raise ValueError(f"empty weight: N={n}, K={k}")
    if g_idx is not None and g_idx.dim() == 1:
        g_idx = g_idx.expand(e, k)
    g = w.group_size
    k_pad = padded_k(k, g)
    geff = k_pad if g == -1 else g
    n_groups = k_pad // geff
    scales = scales[..., : (k + geff - 1) // geff] if g != -1 else scales[..., :1]
    if zeros is not None:
        zeros = zeros[..., : scales.shape[-1]]

    # Act-order: sort K by group so every group is contiguous.
    k_perm = k_perm_inv = None
    if g_idx is not None:
        if g == -1:
            raise ValueError("g_idx (act-order) given with group_size=-1 (per channel)")
        perm = torch.argsort(g_idx, dim=-1, stable=True)
        want = (torch.arange(k) // g).expand(e, k)
        if not torch.equal(torch.gather(g_idx, 1, perm).cpu(), want):
            raise ValueError(
                f"g_idx does not form groups of exactly group_size={g} input channels; "
                "supported: any permutation of the channels with every group of full size"
            )
        codes = torch.gather(codes, 2, perm.unsqueeze(1).expand(e, n, k))
        k_perm = torch.full((e, k_pad), -1, dtype=torch.int32)
        k_perm[:, :k] = perm.to(torch.int32)
        # Where the gate/up epilogue writes channel c of h when this is w2 (the down GEMM
        # reads h in packed order). h has round_up(I, PAD_N / 2) columns; beyond k: identity.
        inv_len = round_up(k, PAD_N // 2)
        k_perm_inv = torch.arange(inv_len, dtype=torch.int64).repeat(e, 1)
        k_perm_inv.scatter_(1, perm, torch.arange(k).repeat(e, 1))
        k_perm_inv = k_perm_inv.to(torch.int32)

    # Pad K: a padded code must dequantise to 0, i.e. equal its group's zero point.
    if k_pad > k:
        grp = torch.arange(k, k_pad) // geff  # group of each padded position
        real = grp < scales.shape[-1]
        fill = torch.zeros(e, n, k_pad - k, dtype=torch.uint8)
        if zeros is None:
            fill[:] = 8
        else:
            fill[..., real] = zeros[..., grp[real]]
        codes = torch.cat([codes, fill], dim=-1)
    pad_g = n_groups - scales.shape[-1]
    scales = torch.nn.functional.pad(scales.float(), (0, pad_g)).to(scales.dtype)
    if zeros is not None:
        zeros = torch.nn.functional.pad(zeros, (0, pad_g))

    # Pad N (scale 0 makes padded rows exactly 0) and interleave gate/up.
    if gate_up:
        if n % 2:
            raise ValueError(f"gate_up weight needs an even N (gate rows then up rows), got {n}")
        i, i_pad = n // 2, round_up(n // 2, PAD_N // 2)
        n_pad = 2 * i_pad

        def pad_rows(t: torch.Tensor) -> torch.Tensor:
            half = [t[:, :i], t[:, i:]]
            return torch.cat(
                [
                    torch.nn.functional.pad(h.float(), (0, 0, 0, i_pad - i)).to(t.dtype)
                    for h in half
                ],
                dim=1,
            )

        src = gate_up_source_row(torch.arange(n_pad), i_pad)
        codes, scales = pad_rows(codes)[:, src], pad_rows(scales)[:, src]
        zeros = None if zeros is None else pad_rows(zeros)[:, src]
    else:
        n_pad = round_up(n, PAD_N)
        codes = torch.nn.functional.pad(codes, (0, 0, 0, n_pad - n), value=8)
        scales = torch.nn.functional.pad(scales.float(), (0, 0, 0, n_pad - n)).to(scales.dtype)
        if zeros is not None:
            zeros = torch.nn.functional.pad(zeros, (0, 0, 0, n_pad - n))

    # Weights: [E, N, K] -> tiles [E, K/16, N/64, 16 x 64] -> lane-major words.
    kt, nt = k_pad // TILE_K, n_pad // TILE_N
    tiles = codes.view(e, nt, TILE_N, kt, TILE_K).permute(0, 3, 1, 4, 2).reshape(e, kt, nt, -1)
    nib = tiles[..., _nibble_source().flatten()].view(e, kt, nt, WARP, 4, 8)
    qweight = _pack_nibbles(nib).reshape(e, kt, nt * WARP * 4).contiguous()

    # Scales / zeros: [E, N, G] -> [E, G, N] with the 64-column permutation.
    pos = scale_position(torch.arange(TILE_N))
    inv = torch.empty_like(pos)
    inv[pos] = torch.arange(TILE_N)

    def perm_cols(t: torch.Tensor) -> torch.Tensor:
        t = t.transpose(1, 2).reshape(e, n_groups, nt, TILE_N)[..., inv]
        return t.reshape(e, n_groups, n_pad).contiguous()

    s = scales.to(dtype)
    z = None if zeros is None else zeros.to(dtype)
    return PackedInt4Weight(
        qweight=qweight,
        scales=perm_cols(s),
        zeros=None if z is None else perm_cols(z),
        k_perm=k_perm,
        k_perm_inv=k_perm_inv,
        n=n,
        k=k,
        n_pad=n_pad,
        k_pad=k_pad,
        group_size=g,
        dtype=dtype,
        gate_up=gate_up,
    )


# ---- CPU emulation of the kernel's fragment reads ----------------------------------------


def emulate_fragments(p: PackedInt4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """What each lane holds, decoded the way the kernel decodes it.

    Returns ``(codes, where)``: ``codes`` uint8 ``[E, K/16, N/64, 32 lanes, 4 words,
    4 pairs, 2 halves]`` and ``where`` int64 ``[32, 4, 4, 2, 2]`` giving (k, n) inside the
    16x64 tile of each value. Pair ``s`` of word ``j`` is ``(word >> 4 s) & 0x000F000F``
    (low half = element 0); pairs 0, 1 are registers b0, b1 of n8 tile ``2 j``, pairs 2, 3
    those of n8 tile ``2 j + 1``; per PTX, register ``b_r`` element ``h`` of lane ``t`` is
    row ``2 (t % 4) + h + 8 r``, column ``t / 4`` of its n8 tile. This is written from the
    kernel's decode sequence and the PTX fragment table, not from the packer's tables.
    """
    e = p.num_experts
    kt, nt = p.k_pad // TILE_K, p.n_pad // TILE_N
    words = p.qweight.cpu().view(e, kt, nt, WARP, 4)
    shift = (torch.arange(4).view(4, 1) * 4 + torch.arange(2).view(1, 2) * 16).to(torch.int32)
    codes = ((words[..., None, None] >> shift) & 0xF).to(torch.uint8)
    lane = torch.arange(WARP).view(WARP, 1, 1, 1)
    j = torch.arange(4).view(1, 4, 1, 1)
    s = torch.arange(4).view(1, 1, 4, 1)
    h = torch.arange(2).view(1, 1, 1, 2)
    n8_tile = 2 * j + s // 2
    reg = s % 2
    k = 2 * (lane % 4) + h + 8 * reg
    n = 8 * n8_tile + lane // 4
    where = torch.stack(torch.broadcast_tensors(k, n), dim=-1)
    return codes, where


def emulate_scale_loads(t: torch.Tensor) -> torch.Tensor:
    """Permuted ``[E, G, n_pad]`` -> logical ``[E, G, n_pad]`` as lanes read it.

    Lane group ``g = lane / 4`` does one 16-byte load of positions ``8 g .. 8 g + 7`` of
    each 64-column block; element ``i`` is the scale of its n8 tile ``i``, i.e. of column
    ``8 i + g``.
    """
    e, ng, n_pad = t.shape
    loads = t.view(e, ng, n_pad // TILE_N, 8, 8)  # [..., g (lane group), i (element)]
    return loads.transpose(-1, -2).reshape(e, ng, n_pad)  # column 8 i + g


def dequantize_packed(p: PackedInt4Weight) -> torch.Tensor:
    """fp32 logical ``[E, N, K]`` from the packed layout, through the lane emulation.

    Undoes padding, the gate/up interleave (w13 comes back as ``cat(gate, up)``) and the
    act-order permutation; the value arithmetic is ``(q - z) * s`` in fp32 with the scale
    of the group ``k_packed // group_size_eff`` that the kernel uses.
    """
    e = p.num_experts
    kt, nt = p.k_pad // TILE_K, p.n_pad // TILE_N
    codes, where = emulate_fragments(p)
    flat = (where[..., 0] * TILE_N + where[..., 1]).flatten()
    if not torch.equal(torch.sort(flat).values, torch.arange(TILE_K * TILE_N)):
        raise AssertionError("fragment map does not cover every element of a tile once")
    tile = torch.empty(e, kt, nt, TILE_K * TILE_N, dtype=torch.uint8)
    tile[..., flat] = codes.reshape(e, kt, nt, -1)
    q = tile.view(e, kt, nt, TILE_K, TILE_N).permute(0, 2, 4, 1, 3).reshape(e, p.n_pad, p.k_pad)
    grp = torch.arange(p.k_pad) // p.group_size_eff
    s = emulate_scale_loads(p.scales.cpu().float()).transpose(1, 2)[..., grp]  # [E, N, K]
    if p.zeros is None:
        z = 8.0
    else:
        z = emulate_scale_loads(p.zeros.cpu().float()).transpose(1, 2)[..., grp]
    w = (q.float() - z) * s
    if p.gate_up:
        i_pad = p.n_pad // 2
        src = gate_up_source_row(torch.arange(p.n_pad), i_pad)
        logical = torch.empty_like(w)
        logical[:, src] = w
        i = p.n // 2
        w = torch.cat([logical[:, :i], logical[:, i_pad : i_pad + i]], dim=1)
    else:
        w = w[:, : p.n]
    if p.k_perm is not None:
        out = torch.empty(e, w.shape[1], p.k, dtype=w.dtype)
        perm = p.k_perm[:, : p.k].to(torch.int64).cpu()
        out.scatter_(2, perm.unsqueeze(1).expand(e, w.shape[1], p.k), w[..., : p.k])
        if bool((w[..., p.k :] != 0).any()):
            raise AssertionError("padded K of an act-order weight is not zero")
        return out
    if bool((w[..., p.k :] != 0).any()):
        raise AssertionError("padded K is not zero")
    return w[..., : p.k]
