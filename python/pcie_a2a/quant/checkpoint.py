"""Routed experts of one MoE layer from checkpoint tensors, by name.

Tensor names follow the DeepSeek-V3 / Kimi K2 / Qwen3-MoE convention
``{prefix}.{expert}.{gate_proj,up_proj,down_proj}.{tensor}``, for example
``model.layers.3.mlp.experts.17.gate_proj.weight_packed``. ``tensors`` is any mapping
from names to tensors: a state dict, or a safetensors ``safe_open`` handle wrapped as
``{k: f.get_tensor(k) for k in f.keys()}`` (or lazily, see :class:`LazyTensors`).

Experts are unpacked and packed one at a time, so peak host memory is a few times one
expert, not the whole layer (Kimi K2: 48 local experts of 24.8 MB packed each).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from .formats import (
    Int4Weights,
    concat_gate_up,
    from_awq,
    from_compressed_tensors,
    from_gptq,
)
from .layout import PackedInt4Experts, PackedInt4Weight, pack_int4

FORMATS = ("compressed-tensors", "gptq", "gptq_v2", "awq")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class LazyTensors(Mapping):
    """A mapping that loads a tensor only when asked (e.g. ``safe_open(...).get_tensor``)."""

    def __init__(self, keys: Iterable[str], get: Callable[[str], torch.Tensor]):
        self._keys = set(keys)
        self._get = get

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._get(key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _one(tensors: Mapping, base: str, fmt: str, group_size: int) -> Int4Weights:
    def need(name: str) -> torch.Tensor:
        key = base + name
        if key not in tensors:
            raise KeyError(f"{key!r} not found; format {fmt!r} needs {base}{{{names}}}")
        return tensors[key]

    def maybe(name: str) -> torch.Tensor | None:
        return tensors.get(base + name)

    if fmt == "compressed-tensors":
        names = "weight_packed,weight_scale,weight_shape[,weight_g_idx]"
        return from_compressed_tensors(
            need("weight_packed"),
            need("weight_scale"),
            need("weight_shape"),
            group_size=group_size,
            weight_zero_point=maybe("weight_zero_point"),
            weight_g_idx=maybe("weight_g_idx"),
        )
    if fmt in ("gptq", "gptq_v2"):
        names = "qweight,scales[,qzeros,g_idx]"
        return from_gptq(
            need("qweight"),
            maybe("qzeros"),
            need("scales"),
            maybe("g_idx"),
            group_size=group_size,
            checkpoint_format=fmt,
        )
    names = "qweight,qzeros,scales"
    return from_awq(need("qweight"), need("qzeros"), need("scales"), group_size=group_size)


def cat_packed(parts: list[PackedInt4Weight]) -> PackedInt4Weight:
    """Concatenate packed weights along the expert dimension (same shapes and options)."""
    first = parts[0]
    for i, p in enumerate(parts):
        same = (p.n, p.k, p.n_pad, p.k_pad, p.group_size, p.dtype, p.gate_up) == (
            first.n, first.k, first.n_pad, first.k_pad, first.group_size, first.dtype,
            first.gate_up,
        )  # fmt: skip
        if not same or (p.zeros is None) != (first.zeros is None):
            raise ValueError(f"packed part {i} differs from part 0 in shape or options")
        if (p.k_perm is None) != (first.k_perm is None):
            raise ValueError(f"packed part {i} mixes act-order and plain weights with part 0")

    def cat(name: str) -> torch.Tensor | None:
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else torch.cat(ts)

    return PackedInt4Weight(
        cat("qweight"), cat("scales"), cat("zeros"), cat("k_perm"), cat("k_perm_inv"),
        first.n, first.k, first.n_pad, first.k_pad, first.group_size, first.dtype, first.gate_up,
    )  # fmt: skip


def load_int4_experts(
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    experts: Iterable[int],
    *,
    fmt: str,
    group_size: int,
    dtype: torch.dtype,
    allow_inexact_scales: bool = False,
    device: torch.device | str | None = None,
) -> PackedInt4Experts:
    """Pack the experts ``experts`` (local order = iteration order) of one layer.

    ``fmt``: "compressed-tensors" (Kimi K2: group 32), "gptq" (v1 zero points),
    "gptq_v2" or "awq". ``device``: where the packed tensors end up (packing runs on the
    CPU, expert by expert).
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r} is not supported; supported: {', '.join(FORMATS)}")
    ids = list(experts)
    if not ids:
        raise ValueError("experts is empty; give at least one expert id")
    w13, w2 = [], []
    for e in ids:
        gate, up, down = (_one(tensors, f"{prefix}.{e}.{p}.", fmt, group_size) for p in PROJECTIONS)
        kw = dict(allow_inexact_scales=allow_inexact_scales)
        p13 = pack_int4(concat_gate_up(gate, up), dtype, gate_up=True, **kw)
        p2 = pack_int4(down, dtype, **kw)
        if device is not None:
            p13, p2 = p13.to(device), p2.to(device)
        w13.append(p13)
        w2.append(p2)
    return PackedInt4Experts(cat_packed(w13), cat_packed(w2))
