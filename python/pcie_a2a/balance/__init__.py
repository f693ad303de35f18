"""Expert load balancing for PCIe boxes (see docs/balance.md).

Pure functions over data: loads per expert (``[layers, experts]``), the box as
:class:`Islands`, a GEMM cost curve. :func:`balance` returns per layer a placement with
redundant replicas and a per-(source, expert) replica choice table for the wire layer.
"""

from .algorithm import LayerResult, Options, balance, balance_layer, replicate
from .cost import GemmCost, RowBytes
from .evaluate import Metrics, Workload, expected, simulate
from .islands import Islands
from .layout import from_placement, to_placement
from .pack import island_tree

__all__ = [
    "GemmCost",
    "Islands",
    "LayerResult",
    "Metrics",
    "Options",
    "RowBytes",
    "Workload",
    "balance",
    "balance_layer",
    "expected",
    "from_placement",
    "island_tree",
    "replicate",
    "simulate",
    "to_placement",
]
