"""The torch MoE layer: router, experts (bf16 or INT4), shared expert, dispatch/combine
through :class:`pcie_a2a.Buffer`. See docs/moe.md.

Lazy, like the top level: ``pcie_a2a.moe.spec`` (what a config says) is read by
``pcie-a2a plan`` without torch; the names below import their module on first use."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "MoESpec": "spec",
    "QuantSpec": "spec",
    "parse_config": "spec",
    "TensorSource": "config",
    "random_checkpoint": "config",
    "BF16Experts": "experts",
    "Experts": "experts",
    "Int4Experts": "experts",
    "SharedExpert": "experts",
    "MoE": "layer",
    "build_experts": "layer",
    "Router": "router",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pcie_a2a.moe' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_LAZY)
