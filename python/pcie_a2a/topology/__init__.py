"""Topology discovery, parsers, the transfer planner (path, direction and engine per pair,
the phased send schedule), the calibration probe's records, predictions and NUMA-aware
staging memory.

topo, probe = pcie_a2a.topology.current_with_probe()   # or load("box.topo.txt"), discover()
p = pcie_a2a.topology.plan_transfers(topo, kimi_k2_decode(8), TransferOptions.from_env(probe=probe))
print(format_plan(p))
print(format_predictions([predict(topo, TransferOptions.from_env(probe=probe))]))
"""

from __future__ import annotations

from .errors import TopologyError
from .live import cuda_peer_matrix, discover, nvml_info
from .model import Gpu, Nic, NumaNode, P2PStatus, RootPort, Switch, Topology, class_rank
from .nccl_xml import parse_xml
from .nvidia_smi import parse_p2p_matrix, parse_topo
from .p2p_bandwidth import parse_p2p_test
from .planner import (
    Link,
    PairRoute,
    Traffic,
    TrafficReport,
    TransferOptions,
    TransferPlan,
    decisions_dict,
    expected_distinct_ranks,
    kimi_k2_decode,
    plan_transfers,
    with_reports,
)
from .predict import BoxPrediction, Prediction, format_predictions, predict
from .probe import (
    GpuIdentity,
    PairMeasurement,
    PatternMeasurement,
    Probe,
    ProbeGateError,
    ProbeUnavailable,
)
from .render import format_plan, format_tree
from .roots import with_vendor_hints
from .sources import current, current_with_probe, load, load_probe, parse
from .staging import alloc_staging

__all__ = [
    "BoxPrediction",
    "Gpu",
    "GpuIdentity",
    "Link",
    "Nic",
    "NumaNode",
    "P2PStatus",
    "PairMeasurement",
    "PairRoute",
    "PatternMeasurement",
    "Prediction",
    "Probe",
    "ProbeGateError",
    "ProbeUnavailable",
    "RootPort",
    "Switch",
    "Topology",
    "TopologyError",
    "Traffic",
    "TrafficReport",
    "TransferOptions",
    "TransferPlan",
    "alloc_staging",
    "class_rank",
    "cuda_peer_matrix",
    "current",
    "current_with_probe",
    "decisions_dict",
    "discover",
    "expected_distinct_ranks",
    "format_plan",
    "format_predictions",
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
    "plan_transfers",
    "predict",
    "with_reports",
    "with_vendor_hints",
]
