"""pcie_a2a: expert-parallel MoE dispatch/combine for GPU servers without NVLink.

Quick start (every rank, after ``torch.distributed.init_process_group``)::

    buf = pcie_a2a.Buffer(None, num_experts=384, hidden=7168, max_tokens_per_rank=128,
                          payload="fp8")
    recv = buf.dispatch(x, topk_ids, topk_weights)
    y = my_experts(recv.x, recv.topk_ids, recv.topk_weights)  # weighted, summed per row
    out = buf.combine(y, recv.handle)
"""

from pcie_a2a._native import cuda_available, cuda_unavailable_reason
from pcie_a2a.allreduce import AllReduce
from pcie_a2a.buffer import Buffer, DispatchHandle, DispatchResult
from pcie_a2a.moe import MoE, Router
from pcie_a2a.placement import Placement
from pcie_a2a.reference import expert_forward
from pcie_a2a.topology import plan

__version__ = "0.1.0"


def _errors():
    from pcie_a2a._native import transport

    t = transport()
    return t.PeerError, t.PeerTimeoutError, t.PeerAbortedError


PeerError, PeerTimeoutError, PeerAbortedError = _errors()

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
    "plan",
]
