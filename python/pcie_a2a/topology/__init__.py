"""Topology discovery, parsers, the transfer planner and NUMA-aware staging memory.

topo = pcie_a2a.topology.load("box.topo.txt")        # or discover(), or current()
p = pcie_a2a.topology.plan(topo, kimi_k2_decode(8), PlanOptions.from_env())
print(format_plan(p))
"""

from __future__ import annotations

from .errors import TopologyError
from .live import cuda_peer_matrix, discover, nvml_info
from .model import Gpu, Nic, NumaNode, P2PStatus, RootPort, Switch, Topology, class_rank
from .nccl_xml import parse_xml
from .nvidia_smi import parse_p2p_matrix, parse_topo
from .p2p_test import parse_p2p_test
from .planner import (
    Link,
    PairPlan,
    Plan,
    PlanOptions,
    Traffic,
    TrafficReport,
    expected_distinct_ranks,
    kimi_k2_decode,
    plan,
    with_reports,
)
from .probe import PairMeasurement, Probe, ProbeUnavailable, load_probe
from .render import format_plan, format_tree
from .sources import current, load, parse
from .staging import alloc_staging

__all__ = [
    "Gpu",
    "Link",
    "Nic",
    "NumaNode",
    "P2PStatus",
    "PairMeasurement",
    "PairPlan",
    "Plan",
    "PlanOptions",
    "Probe",
    "ProbeUnavailable",
    "RootPort",
    "Switch",
    "Topology",
    "TopologyError",
    "Traffic",
    "TrafficReport",
    "alloc_staging",
    "class_rank",
    "cuda_peer_matrix",
    "current",
    "discover",
    "expected_distinct_ranks",
    "format_plan",
    "format_tree",
    "kimi_k2_decode",
    "load",
    "load_probe",
    "nvml_info",
    "parse",
    "parse_p2p_matrix",
    "parse_p2p_test",
    "parse_topo",
    "parse_xml",
    "plan",
    "with_reports",
]
