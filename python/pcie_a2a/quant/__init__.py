"""INT4 expert weights: checkpoint formats in, one kernel layout out, and the fused op.

* :mod:`.formats` — GPTQ, AWQ, compressed-tensors loaders and per-format oracles.
* :mod:`.layout` — the packed ``mma.m16n8k16`` tile layout, packer and lane emulation.
* :mod:`.checkpoint` — a layer's routed experts from checkpoint tensors, by name.
* :mod:`.moe` — ``moe_int4_mlp`` (CUDA kernel or CPU reference) and the references.

See docs/int4.md.
"""

from .checkpoint import LazyTensors, cat_packed, load_int4_experts
from .formats import (
    SUPPORTED_GROUP_SIZES,
    Int4Weights,
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
from .layout import (
    PackedInt4Experts,
    PackedInt4Weight,
    dequantize_packed,
    emulate_fragments,
    pack_int4,
)
from .moe import (
    check_routing_errors,
    moe_int4_mlp,
    moe_int4_mlp_expert_major,
    moe_int4_mlp_expert_major_reference,
    moe_int4_mlp_reference,
)

__all__ = [
    "SUPPORTED_GROUP_SIZES",
    "Int4Weights",
    "LazyTensors",
    "PackedInt4Experts",
    "PackedInt4Weight",
    "cat_packed",
    "check_routing_errors",
    "concat_gate_up",
    "dequantize_awq",
    "dequantize_compressed_tensors",
    "dequantize_gptq",
    "dequantize_packed",
    "emulate_fragments",
    "from_awq",
    "from_compressed_tensors",
    "from_gptq",
    "load_int4_experts",
    "moe_int4_mlp",
    "moe_int4_mlp_expert_major",
    "moe_int4_mlp_expert_major_reference",
    "moe_int4_mlp_reference",
    "pack_int4",
    "random_int4",
    "stack_experts",
    "to_awq",
    "to_compressed_tensors",
    "to_gptq",
]
