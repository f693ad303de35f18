"""INT4 checkpoint formats in: GPTQ, AWQ and compressed-tensors ``pack-quantized``.

Every loader turns one format into the same logical form, :class:`Int4Weights`:

* ``codes``  uint8 ``[..., N, K]`` in 0..15 (N output features, K input features, the
  ``nn.Linear`` orientation; a leading expert dimension is allowed everywhere),
* ``scales`` ``[..., N, G]`` in the checkpoint's scale dtype (G groups along K),
* ``zeros``  uint8 ``[..., N, G]`` zero points, or ``None`` for symmetric weights (zero 8),
* ``g_idx``  int64 ``[..., K]`` group of each input channel, or ``None`` for ``k // g``.

so that ``w[n, k] = (codes[n, k] - zero[n, g]) * scales[n, g]`` with ``g = g_idx[k]``.
The packer in :mod:`pcie_a2a.quant.layout` consumes only this form.

Next to each loader is an *oracle*: a dequantiser written directly against the on-disk
tensors (not through :class:`Int4Weights`), so tests compare two independent readings
of a format. Dequantisation is done in fp32: ``(q - z)`` is an integer of at most 5 bits
and a bf16/fp16 scale has at most 11 significant bits, so the fp32 product is exact and
"equal bit for bit" is a meaningful test.

Packing orders (see /work/shared/research/marlin_anchors.md section 3):

* GPTQ ``qweight`` int32 ``[K/8, N]``: packed along K, row ``8p + i`` in bits ``4i``.
  ``qzeros`` int32 ``[G, N/8]`` packed along N, sequential; format v1 ("gptq") stores
  ``zero - 1``, "gptq_v2" stores the zero itself. ``scales [G, N]``, ``g_idx [K]``.
* AWQ ``qweight`` int32 ``[K, N/8]``: packed along N with the interleave
  ``[0, 2, 4, 6, 1, 3, 5, 7]`` (nibble p holds column ``AWQ_ORDER[p]`` of the 8).
  ``qzeros [G, N/8]`` same interleave, zero stored as is. ``scales [G, N]``.
* compressed-tensors ``weight_packed`` int32 ``[N, ceil(K/8)]``: packed along K,
  element j in word ``j // 8`` bits ``4 (j % 8)``, stored as ``q + 8``;
  ``weight_scale [N, G]``; ``weight_shape = (N, K)``. Kimi K2: symmetric, group 32,
  bf16 scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Group sizes the kernel layout supports; -1 means one scale per output channel.
SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)

#: AWQ nibble p holds column AWQ_ORDER[p] of each group of 8 output columns.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_group_size(group_size: int, what: str = "group_size") -> None:
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(
            f"{what}={group_size} is not supported; supported: 32, 64, 128, or -1 (per channel)"
        )


def _num_groups(k: int, group_size: int) -> int:
    return 1 if group_size == -1 else (k + group_size - 1) // group_size


def _check_int32(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if tuple(t.shape[-len(shape) :]) != shape or t.dim() < len(shape):
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}; expected [..., {', '.join(map(str, shape))}]"
        )


def _check_scales(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.dim() < len(shape) or tuple(t.shape[-len(shape) :]) != shape:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}; expected [..., {', '.join(map(str, shape))}]"
        )


def _unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: nibble i of each word (bits 4i..4i+3)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _pack_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """uint8 [..., W, 8] (0..15) -> int32 [..., W], nibble i in bits 4i (two's complement)."""
    w = nib[..., 0].to(torch.int32)
    for i in range(1, 8):  # int32 shifts wrap: nibble 7 lands in the sign bit, as stored
        w |= nib[..., i].to(torch.int32) << (4 * i)
    return w


@dataclass
class Int4Weights:
    """One INT4 linear (or a stack of experts): the logical form every loader produces."""

    codes: torch.Tensor  # uint8 [..., N, K], 0..15
    scales: torch.Tensor  # [..., N, G]
    zeros: torch.Tensor | None  # uint8 [..., N, G] or None (symmetric: zero point 8)
    group_size: int  # 32, 64, 128 or -1
    g_idx: torch.Tensor | None = None  # int64 [..., K] or None (k // group_size)

    @property
    def n(self) -> int:
        return self.codes.shape[-2]

    @property
    def k(self) -> int:
        return self.codes.shape[-1]

    def group_index(self) -> torch.Tensor:
        """int64 [..., K] group of every input channel."""
        if self.g_idx is not None:
            return self.g_idx
        k = torch.arange(self.k, device=self.codes.device)
        return torch.zeros_like(k) if self.group_size == -1 else k // self.group_size

    def dequantize(self) -> torch.Tensor:
        """fp32 [..., N, K] (exact: see the module docstring)."""
        gi = self.group_index()
        gi = gi.unsqueeze(-2).expand(*self.codes.shape)
        s = torch.gather(self.scales.float(), -1, gi)
        z = 8.0 if self.zeros is None else torch.gather(self.zeros.float(), -1, gi)
        return (self.codes.float() - z) * s

    def validate(self) -> None:
        check_group_size(self.group_size)
        if self.codes.dtype != torch.uint8:
            raise ValueError(f"codes must be uint8, got {self.codes.dtype}")
        g = _num_groups(self.k, self.group_size)
        if self.g_idx is not None:
            g = int(self.g_idx.max()) + 1 if self.g_idx.numel() else g
        if self.scales.shape[-1] < g or self.scales.shape[-2] != self.n:
            raise ValueError(
                f"scales has shape {tuple(self.scales.shape)}; expected [..., {self.n}, {g}]"
            )
        if self.zeros is not None and self.zeros.shape != self.scales.shape:
            raise ValueError(
                f"zeros has shape {tuple(self.zeros.shape)}; expected {tuple(self.scales.shape)}"
            )


def stack_experts(weights: list[Int4Weights]) -> Int4Weights:
    """Stack per-expert weights ([N, K] each) into one [E, N, K] set."""
    if not weights:
        raise ValueError("stack_experts needs at least one expert, got an empty list")
    first = weights[0]
    for i, w in enumerate(weights):
        if w.codes.shape != first.codes.shape or w.group_size != first.group_size:
            raise ValueError(
                f"expert {i} has codes {tuple(w.codes.shape)} group {w.group_size}; expert 0 "
                f"has {tuple(first.codes.shape)} group {first.group_size}: all must match"
            )
        if (w.zeros is None) != (first.zeros is None) or (w.g_idx is None) != (first.g_idx is None):
            raise ValueError(f"expert {i} mixes symmetric/asymmetric or act-order with expert 0")
    return Int4Weights(
        codes=torch.stack([w.codes for w in weights]),
        scales=torch.stack([w.scales for w in weights]),
        zeros=None if first.zeros is None else torch.stack([w.zeros for w in weights]),
        group_size=first.group_size,
        g_idx=None if first.g_idx is None else torch.stack([w.g_idx for w in weights]),
    )


def concat_gate_up(gate: Int4Weights, up: Int4Weights) -> Int4Weights:
    """Stack gate and up along N (rows 0..I-1 gate, I..2I-1 up): the logical w13."""
    if gate.codes.shape != up.codes.shape or gate.group_size != up.group_size:
        raise ValueError(
            f"gate {tuple(gate.codes.shape)} g{gate.group_size} and up "
            f"{tuple(up.codes.shape)} g{up.group_size} must have the same shape and group size"
        )
    if (gate.zeros is None) != (up.zeros is None):
        raise ValueError("gate and up must both be symmetric or both have zero points")
    if (gate.g_idx is None) != (up.g_idx is None) or (
        gate.g_idx is not None and not torch.equal(gate.g_idx, up.g_idx)
    ):
        raise ValueError(
            "gate and up have different act-order g_idx; the fused gate/up GEMM reads one "
            "activation order, so both must share g_idx (re-quantise with the same order)"
        )
    return Int4Weights(
        codes=torch.cat([gate.codes, up.codes], dim=-2),
        scales=torch.cat([gate.scales, up.scales], dim=-2),
        zeros=None if gate.zeros is None else torch.cat([gate.zeros, up.zeros], dim=-2),
        group_size=gate.group_size,
        g_idx=gate.g_idx,
    )


# ---- GPTQ ------------------------------------------------------------------------------


def _gptq_check(qweight, qzeros, scales, g_idx, group_size, checkpoint_format):
    check_group_size(group_size)
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"checkpoint_format={checkpoint_format!r} is not supported; supported: 'gptq', "
            "'gptq_v2'"
        )
    if qweight.dim() < 2:
        raise ValueError(f"qweight must be [..., K/8, N], got shape {tuple(qweight.shape)}")
    k8, n = qweight.shape[-2:]
    k = 8 * k8
    if n % 8:
        raise ValueError(f"GPTQ N (qweight.shape[-1]) must be a multiple of 8, got {n}")
    _check_int32("qweight", qweight, (k8, n))
    if g_idx is not None and g_idx.shape[-1] != k:
        raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}; expected [..., {k}]")
    g = _num_groups(k, group_size)
    if g_idx is not None and g_idx.numel():
        g = max(g, int(g_idx.max()) + 1)
    _check_scales("scales", scales, (g, n))
    if qzeros is not None:
        _check_int32("qzeros", qzeros, (g, n // 8))
    return k, n, g


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    group_size: int,
    checkpoint_format: str = "gptq",
) -> Int4Weights:
    """GPTQ (AutoGPTQ / GPTQModel, 4 bit) -> :class:`Int4Weights`.

    ``qzeros=None`` or all zero points equal to 8 gives a symmetric weight. ``g_idx`` is
    kept only when it is not the trivial ``k // group_size`` (act-order / desc_act).
    """
    k, n, _ = _gptq_check(qweight, qzeros, scales, g_idx, group_size, checkpoint_format)
    nib = _unpack_nibbles(qweight)  # [..., K/8, N, 8]
    codes = nib.movedim(-1, -2).reshape(*qweight.shape[:-2], k, n).transpose(-1, -2)
    zeros = None
    if qzeros is not None:
        z = _unpack_nibbles(qzeros).flatten(-2)  # [..., G, N]
        if checkpoint_format == "gptq":
            z = z + 1  # v1 stores zero - 1 (a stored 15 means zero 16; kept as is)
        zeros = z.transpose(-1, -2).contiguous()
        if bool((zeros == 8).all()):
            zeros = None
    gi = None
    if g_idx is not None:
        gi = g_idx.to(torch.int64)
        trivial = torch.zeros(k, dtype=torch.int64) if group_size == -1 else torch.arange(k)
        if torch.equal(gi, trivial.expand_as(gi).to(gi.device)):
            gi = None
    return Int4Weights(
        codes=codes.contiguous(),
        scales=scales.transpose(-1, -2).contiguous(),
        zeros=zeros,
        group_size=group_size,
        g_idx=gi,
    )


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    group_size: int,
    checkpoint_format: str = "gptq",
) -> torch.Tensor:
    """Oracle: fp32 ``[..., N, K]`` straight from the GPTQ tensors."""
    k, n, _ = _gptq_check(qweight, qzeros, scales, g_idx, group_size, checkpoint_format)
    # w_kn[k, n]: row k of the logical [K, N] weight sits in word k // 8, bits 4 (k % 8).
    kk = torch.arange(k)
    rows = qweight[..., kk // 8, :]  # [..., K, N]
    q = ((rows >> (4 * (kk % 8)).to(torch.int32).unsqueeze(-1)) & 0xF).float()
    if g_idx is None:
        gi = torch.zeros(k, dtype=torch.int64) if group_size == -1 else kk // group_size
    else:
        gi = g_idx.to(torch.int64)
    s = torch.gather(scales.float(), -2, gi.unsqueeze(-1).expand(*q.shape))
    if qzeros is None:
        z = torch.full_like(q, 8.0)
    else:
        nn_ = torch.arange(n)
        zw = qzeros[..., nn_ // 8]  # [..., G, N]
        zv = ((zw >> (4 * (nn_ % 8)).to(torch.int32)) & 0xF).float()
        if checkpoint_format == "gptq":
            zv = zv + 1.0
        z = torch.gather(zv, -2, gi.unsqueeze(-1).expand(*q.shape))
    return ((q - z) * s).transpose(-1, -2).contiguous()


# ---- AWQ -------------------------------------------------------------------------------


def _awq_check(qweight, qzeros, scales, group_size):
    check_group_size(group_size)
    if qweight.dim() < 2:
        raise ValueError(f"qweight must be [..., K, N/8], got shape {tuple(qweight.shape)}")
    k, n8 = qweight.shape[-2:]
    n = 8 * n8
    _check_int32("qweight", qweight, (k, n8))
    g = _num_groups(k, group_size)
    _check_scales("scales", scales, (g, n))
    _check_int32("qzeros", qzeros, (g, n8))
    return k, n, g


def _awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., R, N/8] -> uint8 [..., R, N] undoing the AWQ column interleave."""
    nib = _unpack_nibbles(words)  # [..., R, N/8, 8], nibble p = column AWQ_ORDER[p]
    inv = torch.empty(8, dtype=torch.int64)
    inv[torch.tensor(AWQ_ORDER)] = torch.arange(8)
    return nib[..., inv].flatten(-2)


def from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, group_size: int
) -> Int4Weights:
    """AutoAWQ GEMM format (4 bit, zero points) -> :class:`Int4Weights`."""
    _awq_check(qweight, qzeros, scales, group_size)
    codes = _awq_unpack(qweight).transpose(-1, -2).contiguous()  # [..., N, K]
    zeros = _awq_unpack(qzeros).transpose(-1, -2).contiguous()  # [..., N, G]
    return Int4Weights(
        codes=codes,
        scales=scales.transpose(-1, -2).contiguous(),
        zeros=None if bool((zeros == 8).all()) else zeros,
        group_size=group_size,
    )


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, group_size: int
) -> torch.Tensor:
    """Oracle: fp32 ``[..., N, K]`` straight from the AWQ tensors."""
    k, n, _ = _awq_check(qweight, qzeros, scales, group_size)
    order = torch.tensor(AWQ_ORDER)
    # Column c of word w sits at the nibble p with AWQ_ORDER[p] == c % 8.
    pos = torch.argsort(order)[torch.arange(n) % 8]
    shift = (4 * pos).to(torch.int32)
    col_word = torch.arange(n) // 8
    q = ((qweight[..., col_word] >> shift) & 0xF).float()  # [..., K, N]
    z = ((qzeros[..., col_word] >> shift) & 0xF).float()  # [..., G, N]
    gi = torch.zeros(k, dtype=torch.int64) if group_size == -1 else torch.arange(k) // group_size
    z = z[..., gi, :]
    s = scales.float()[..., gi, :]
    return ((q - z) * s).transpose(-1, -2).contiguous()


# ---- compressed-tensors pack-quantized -------------------------------------------------


def _ct_check(
    weight_packed, weight_scale, weight_shape, group_size, weight_zero_point, weight_g_idx=None
):
    check_group_size(group_size)
    if weight_zero_point is not None:
        raise ValueError(
            "compressed-tensors weight_zero_point (asymmetric pack-quantized) is not "
            "supported; supported: symmetric pack-quantized (e.g. Kimi K2, group 32)"
        )
    shape = tuple(int(v) for v in torch.as_tensor(weight_shape).reshape(-1, 2)[0].tolist())
    n, k = shape
    if weight_packed.dim() < 2:
        raise ValueError(f"weight_packed must be [..., N, K/8], got {tuple(weight_packed.shape)}")
    _check_int32("weight_packed", weight_packed, (n, (k + 7) // 8))
    g = _num_groups(k, group_size)
    if weight_g_idx is not None:
        if weight_g_idx.shape[-1] != k:
            raise ValueError(
                f"weight_g_idx has shape {tuple(weight_g_idx.shape)}; expected [..., {k}]"
            )
        if weight_g_idx.numel():
            g = max(g, int(weight_g_idx.max()) + 1)
    _check_scales("weight_scale", weight_scale, (n, g))
    return n, k, g


def from_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | tuple[int, int],
    *,
    group_size: int,
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
) -> Int4Weights:
    """compressed-tensors ``pack-quantized`` (symmetric int4) -> :class:`Int4Weights`.

    ``weight_shape`` is the per-matrix (N, K); for stacked experts pass one of them.
    ``weight_g_idx`` (``actorder="group"``) is handled like GPTQ's act-order.
    """
    _n, k, _ = _ct_check(
        weight_packed, weight_scale, weight_shape, group_size, weight_zero_point, weight_g_idx
    )
    codes = _unpack_nibbles(weight_packed).flatten(-2)[..., :k]
    return Int4Weights(
        codes=codes.contiguous(),
        scales=weight_scale.contiguous(),
        zeros=None,
        group_size=group_size,
        g_idx=None if weight_g_idx is None else weight_g_idx.to(torch.int64),
    )


def dequantize_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | tuple[int, int],
    *,
    group_size: int,
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Oracle: fp32 ``[..., N, K]``: ``w[n, k] = (u - 8) * scale[n, g_idx[k]]`` with
    ``g_idx[k] = k // g`` unless ``weight_g_idx`` is given."""
    _n, k, _ = _ct_check(
        weight_packed, weight_scale, weight_shape, group_size, weight_zero_point, weight_g_idx
    )
    kk = torch.arange(k)
    u = ((weight_packed[..., kk // 8] >> (4 * (kk % 8)).to(torch.int32)) & 0xF).float()
    if weight_g_idx is not None:
        gi = weight_g_idx.to(torch.int64).unsqueeze(-2).expand(*u.shape)
        return (u - 8.0) * torch.gather(weight_scale.float(), -1, gi)
    gi = torch.zeros(k, dtype=torch.int64) if group_size == -1 else kk // group_size
    s = weight_scale.float()[..., gi]
    return (u - 8.0) * s


# ---- writers (used by tests and benchmarks to make checkpoints) --------------------------


def to_gptq(w: Int4Weights, *, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """Inverse of :func:`from_gptq` (for tests and benchmarks): the on-disk GPTQ tensors."""
    w.validate()
    if w.k % 8 or w.n % 8:
        raise ValueError(f"GPTQ needs N and K multiples of 8, got N={w.n} K={w.k}")
    kn = w.codes.transpose(-1, -2)  # [..., K, N]
    qweight = _pack_nibbles(kn.reshape(*kn.shape[:-2], w.k // 8, 8, w.n).movedim(-2, -1))
    z = torch.full_like(w.scales, 8, dtype=torch.uint8) if w.zeros is None else w.zeros
    z = z.transpose(-1, -2).to(torch.int64)  # [..., G, N]
    if checkpoint_format == "gptq":
        z = z - 1
    if bool(((z < 0) | (z > 15)).any()):
        raise ValueError(f"zero points do not fit format {checkpoint_format!r}")
    qzeros = _pack_nibbles(z.to(torch.uint8).reshape(*z.shape[:-1], w.n // 8, 8))
    out = {"qweight": qweight, "qzeros": qzeros, "scales": w.scales.transpose(-1, -2).contiguous()}
    out["g_idx"] = w.group_index().to(torch.int32)
    return out


def to_awq(w: Int4Weights) -> dict[str, torch.Tensor]:
    """Inverse of :func:`from_awq`: the on-disk AWQ tensors."""
    w.validate()
    if w.n % 8 or w.g_idx is not None:
        raise ValueError(f"AWQ needs N % 8 == 0 and no act-order, got N={w.n}")
    order = torch.tensor(AWQ_ORDER)

    def pack(t: torch.Tensor) -> torch.Tensor:  # t: [..., R, N]
        return _pack_nibbles(t.reshape(*t.shape[:-1], t.shape[-1] // 8, 8)[..., order])

    z = torch.full_like(w.scales, 8, dtype=torch.uint8) if w.zeros is None else w.zeros
    return {
        "qweight": pack(w.codes.transpose(-1, -2)),
        "qzeros": pack(z.transpose(-1, -2)),
        "scales": w.scales.transpose(-1, -2).contiguous(),
    }


def to_compressed_tensors(w: Int4Weights) -> dict[str, torch.Tensor]:
    """Inverse of :func:`from_compressed_tensors` (symmetric only)."""
    w.validate()
    if w.zeros is not None:
        raise ValueError("compressed-tensors writer supports symmetric weights only")
    k8 = (w.k + 7) // 8
    codes = torch.nn.functional.pad(w.codes, (0, 8 * k8 - w.k), value=8)
    out = {
        "weight_packed": _pack_nibbles(codes.reshape(*codes.shape[:-1], k8, 8)),
        "weight_scale": w.scales.contiguous(),
        "weight_shape": torch.tensor([w.n, w.k], dtype=torch.int64),
    }
    if w.g_idx is not None:
        out["weight_g_idx"] = w.g_idx.to(torch.int32)
    return out


def random_int4(
    *shape: int,
    group_size: int,
    scale_dtype: torch.dtype = torch.bfloat16,
    symmetric: bool = True,
    act_order: bool = False,
    generator: torch.Generator | None = None,
    scale: float = 0.02,
) -> Int4Weights:
    """Random weights ``[*lead, N, K]`` (tests and benchmarks)."""
    check_group_size(group_size)
    *lead, n, k = shape
    g = _num_groups(k, group_size)
    codes = torch.randint(0, 16, (*lead, n, k), dtype=torch.uint8, generator=generator)
    scales = (torch.rand((*lead, n, g), generator=generator) * 0.5 + 0.75) * scale
    zeros = None
    if not symmetric:
        zeros = torch.randint(0, 16, (*lead, n, g), dtype=torch.uint8, generator=generator)
    g_idx = None
    if act_order and group_size != -1:
        base = torch.arange(k) // group_size
        perms = [torch.randperm(k, generator=generator) for _ in range(max(1, _prod(lead)))]
        g_idx = torch.stack([base[p] for p in perms]).reshape(*lead, k)
    return Int4Weights(codes, scales.to(scale_dtype), zeros, group_size, g_idx)


def _prod(xs: list[int]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p
