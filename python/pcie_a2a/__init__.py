"""pcie_a2a: expert-parallel MoE dispatch/combine for GPU servers without NVLink.

Quick start (every rank, after ``torch.distributed.init_process_group``)::

    buf = pcie_a2a.Buffer(None, num_experts=384, hidden=7168, max_tokens_per_rank=128,
                          payload="fp8")
    recv = buf.dispatch(x, topk_ids, topk_weights)
    y = my_experts(recv.x, recv.topk_ids, recv.topk_weights)  # weighted, summed per row
    out = buf.combine(y, recv.handle)

The top level is lazy: ``import pcie_a2a`` loads neither torch nor the compiled extension,
so the pure-Python tools (``pcie-a2a topo``, ``plan``, ``balance``) run without them; each
name below is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> (module, attribute in it)
_LAZY = {
    "AllReduce": ("pcie_a2a.allreduce", "AllReduce"),
    "Buffer": ("pcie_a2a.buffer", "Buffer"),
    "DispatchHandle": ("pcie_a2a.buffer", "DispatchHandle"),
    "DispatchResult": ("pcie_a2a.buffer", "DispatchResult"),
    "MoE": ("pcie_a2a.moe", "MoE"),
    "Router": ("pcie_a2a.moe", "Router"),
    "Placement": ("pcie_a2a.placement", "Placement"),
    "expert_forward": ("pcie_a2a.reference", "expert_forward"),
    "plan_transfers": ("pcie_a2a.topology", "plan_transfers"),
    "cuda_available": ("pcie_a2a._native", "cuda_available"),
    "cuda_unavailable_reason": ("pcie_a2a._native", "cuda_unavailable_reason"),
}
# the transport's error types live in the compiled extension
_NATIVE_ERRORS = ("PeerError", "PeerTimeoutError", "PeerAbortedError")

if TYPE_CHECKING:  # for type checkers and IDEs only; at run time __getattr__ imports
    from pcie_a2a._native import cuda_available, cuda_unavailable_reason
    from pcie_a2a.allreduce import AllReduce
    from pcie_a2a.buffer import Buffer, DispatchHandle, DispatchResult
    from pcie_a2a.moe import MoE, Router
    from pcie_a2a.placement import Placement
    from pcie_a2a.reference import expert_forward
    from pcie_a2a.topology import plan_transfers


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
    elif name in _NATIVE_ERRORS:
        from pcie_a2a._native import transport

        value = getattr(transport(), name)
    else:
        raise AttributeError(f"module 'pcie_a2a' has no attribute {name!r}")
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AllReduce",
    "Buffer",
    "DispatchHandle",
    "DispatchResult",
    "MoE",
    "PeerAbortedError",
    "PeerError",
    "PeerTimeoutError",
    "Placement",
    "Router",
    "cuda_available",
    "cuda_unavailable_reason",
    "expert_forward",
    "plan_transfers",
]
