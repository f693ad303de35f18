"""The PCIe all-reduce for the attention's tensor parallelism: :class:`AllReduce`.

See docs/allreduce.md, and csrc/core/allreduce_wire.h for the protocol and its proof.
"""

from pcie_a2a.allreduce import ops as _ops  # noqa: F401  (registers the torch.library ops)
from pcie_a2a.allreduce.communicator import AllReduce, lookup
from pcie_a2a.allreduce.tuning import Thresholds

__all__ = ["AllReduce", "Thresholds", "lookup"]
