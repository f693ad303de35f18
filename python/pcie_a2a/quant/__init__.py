"""INT4 expert weights: checkpoint formats in, one kernel layout out, and the fused op.

* :mod:`.formats` — GPTQ, AWQ, compressed-tensors loaders and per-format oracles.
* :mod:`.layout` — the packed ``mma.m16n8k16`` tile layout, packer and lane emulation.
* :mod:`.checkpoint` — a layer's routed experts from checkpoint tensors, by name.
* :mod:`.moe` — ``moe_int4_mlp`` (CUDA kernel or CPU reference) and the references.

See docs/int4.md.

Lazy: ``import pcie_a2a.quant.grid_model`` (the planner's INT4 cost model, pure Python)
must not load torch, which the other submodules need; each name below is imported from its
submodule on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule
_LAZY = {
    "Int4Weights": "formats",
    "LazyTensors": "checkpoint",
    "PackedInt4Experts": "layout",
    "PackedInt4Weight": "layout",
    "SUPPORTED_GROUP_SIZES": "formats",
    "cat_packed": "checkpoint",
    "check_routing_errors": "moe",
    "concat_gate_up": "formats",
    "dequantize_awq": "formats",
    "dequantize_compressed_tensors": "formats",
    "dequantize_gptq": "formats",
    "dequantize_packed": "layout",
    "emulate_fragments": "layout",
    "from_awq": "formats",
    "from_compressed_tensors": "formats",
    "from_gptq": "formats",
    "load_int4_experts": "checkpoint",
    "moe_int4_mlp": "moe",
    "moe_int4_mlp_expert_major": "moe",
    "moe_int4_mlp_expert_major_reference": "moe",
    "moe_int4_mlp_reference": "moe",
    "pack_int4": "layout",
    "random_int4": "formats",
    "stack_experts": "formats",
    "to_awq": "formats",
    "to_compressed_tensors": "formats",
    "to_gptq": "formats",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
