"""The torch MoE layer: router, experts (bf16 or INT4), shared expert, dispatch/combine
through :class:`pcie_a2a.Buffer`. See docs/moe.md."""

from .config import MoESpec, QuantSpec, TensorSource, parse_config, random_checkpoint
from .experts import BF16Experts, Experts, Int4Experts, SharedExpert
from .layer import MoE, build_experts
from .router import Router

__all__ = [
    "BF16Experts",
    "Experts",
    "Int4Experts",
    "MoE",
    "MoESpec",
    "QuantSpec",
    "Router",
    "SharedExpert",
    "TensorSource",
    "build_experts",
    "parse_config",
    "random_checkpoint",
]
