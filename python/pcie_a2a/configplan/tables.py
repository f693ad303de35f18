"""Measured tables and assumed efficiencies the cost terms read, each with its source.

Collective tables follow the nccl-tests convention for ``size``: all_reduce the buffer,
all_gather the gathered output, reduce_scatter the input, alltoall one rank's send
buffer (all peers together). Between points the time is interpolated log-log; above the
last point it grows with the last segment's bandwidth; below the first it stays at the
first (the latency floor).

Every table can be replaced by a JSON file (``--tables FILE``, :func:`Tables.with_overrides`)
holding the same keys; the output then names the file as the source.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

KB = 1024
MB = 1024 * 1024


@dataclass(frozen=True)
class Curve:
    """A measured (x, y) table with its source. y(x) interpolated log-log."""

    points: tuple[tuple[float, float], ...]
    source: str

    def __post_init__(self) -> None:
        xs = [p[0] for p in self.points]
        if len(xs) < 1 or xs != sorted(xs) or len(set(xs)) != len(xs):
            raise ValueError(f"table {self.source!r}: x values must be strictly increasing")
        if any(x <= 0 or y <= 0 or not math.isfinite(y) for x, y in self.points):
            raise ValueError(f"table {self.source!r}: x and y must be positive")

    def __call__(self, x: float) -> float:
        pts = self.points
        if x <= pts[0][0] or len(pts) == 1:
            return pts[0][1] if x <= pts[0][0] else _extend(pts, x)
        if x >= pts[-1][0]:
            return _extend(pts, x)
        i = bisect.bisect_right([p[0] for p in pts], x)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


def _extend(pts: tuple[tuple[float, float], ...], x: float) -> float:
    """Beyond the last point: time grows with the bandwidth of the last segment."""
    if len(pts) == 1:
        return pts[0][1] * x / pts[0][0]
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    slope = (y1 - y0) / (x1 - x0)  # µs per byte
    return y1 + max(slope, 0.0) * (x - x1)


@dataclass(frozen=True)
class Flat:
    """An efficiency table by rows per expert (or a single value)."""

    points: tuple[tuple[float, float], ...]
    source: str

    def __call__(self, x: float) -> float:
        pts = self.points
        if x <= pts[0][0]:
            return pts[0][1]
        if x >= pts[-1][0]:
            return pts[-1][1]
        i = bisect.bisect_right([p[0] for p in pts], x)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return y0 + t * (y1 - y0)


_SIZES = (4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB)
_AICONFIG = (
    "ai-dynamo/aiconfigurator perf database systems/data/rtx_pro_6000_server/comm/nccl/"
    "2.29.2 (nccl-tests, 8x RTX PRO 6000 Server, eager), via research/field_2026.md s2"
)


def _table(values: tuple[float, ...], source: str) -> Curve:
    return Curve(tuple(zip(map(float, _SIZES), values)), source)


@dataclass(frozen=True)
class Tables:
    # NCCL collectives measured on 8x RTX PRO 6000 (µs by size in bytes).
    nccl8: dict[str, Curve] = field(
        default_factory=lambda: {
            "alltoall": _table((10.2, 13.1, 26.9, 29.0, 77.5, 260, 1014), _AICONFIG),
            "all_reduce": _table((25.5, 27.4, 31.5, 85.7, 167, 398, 1409), _AICONFIG),
            "all_gather": _table((14.7, 16.1, 36.1, 45.4, 76.9, 182, 653), _AICONFIG),
            "reduce_scatter": _table((15.7, 17.0, 18.7, 47.1, 90.6, 231, 798), _AICONFIG),
        }
    )
    # NCCL all_reduce on 4x RTX PRO 6000, one NUMA node.
    nccl4_all_reduce: Curve = Curve(
        ((16 * KB, 14.7), (256 * KB, 40.9), (1 * MB, 85.2)),
        "voipmonitor/rtx6kpro optimization/pcie-oneshot-allreduce.md (4x RTX PRO 6000, one "
        "NUMA node, NCCL), via research/field_2026.md s3",
    )
    # The tuned stacks' PCIe custom all-reduce (used up to custom_ar_max_bytes).
    custom_ar8: Curve = Curve(
        ((256.0, 9.6), (14336.0, 11.8), (458752.0, 147.0)),
        "8x RTX PRO 6000: 256 B 9.6 µs (dual-socket custom IPC all-reduce, rtx6kpro "
        "hardware/pcie-bandwidth.md, research/dispatch_anchors.md s3); 14,336 B 11.8 µs and "
        "458 KB 147 µs (fused one-stage all-reduce + residual, local-inference-lab/rtx6kpro "
        "communicator notes, research/field_2026.md s3)",
    )
    custom_ar4: Curve = Curve(
        ((16 * KB, 7.7), (256 * KB, 28.7), (1 * MB, 95.6)),
        "4x RTX PRO 6000 one-shot all-reduce (voipmonitor/rtx6kpro "
        "optimization/pcie-oneshot-allreduce.md), via research/field_2026.md s3",
    )
    custom_ar_max_bytes: float = 56 * 1000.0  # "custom all-reduce for messages up to ~56 KB"
    custom_ar_max_source: str = (
        "local-inference-lab/rtx6kpro models/kimi-k26-v4.md: custom all-reduce up to ~56 KB "
        "(research/field_2026.md s1)"
    )
    # Patched/tuned NCCL bus bandwidth (all_reduce, large messages).
    tuned_nccl_busbw_gbps: float = 40.0
    tuned_nccl_source: str = (
        "8x RTX PRO 6000 NCCL all_reduce busbw 37.6-41.7 GB/s after tuning (NCCL_P2P_LEVEL=SYS, "
        "graph XML fix) vs 22.2 default (voipmonitor/rtx6kpro hardware/pcie-bandwidth.md, "
        "research/dispatch_anchors.md s3); 40 taken, floor = the default table's small-size time"
    )
    # Gen5 x16 link capacity per direction the 8x RTX PRO 6000 tables were measured on; other
    # GPUs' tables are derived by scaling the bandwidth part by their link capacity.
    reference_link_gbps: float = 53.0
    # Expert GEMM efficiency relative to the roofline, by rows per expert.
    gemm_efficiency: Flat = Flat(
        ((1.0, 1.0), (32.0, 0.98), (64.0, 0.95), (128.0, 0.945)),
        "Marlin README/paper (IST-DASLab/marlin, A10, 72k x 18k, g128): speedup over FP16 at "
        "the ideal 3.87x for batch 1-32, 3.1 of 3.27 at 64, 1.55 of 1.64 at 128 "
        "(research/marlin_anchors.md s2.1). Measured on A10, not on these GPUs: replace with "
        "a measured table (--tables)",
    )
    memory_efficiency: float = 0.85
    memory_efficiency_source: str = (
        "assumed: achieved / spec DRAM bandwidth of a streaming kernel (copy benchmarks on "
        "GDDR6/GDDR7/HBM parts reach 80-92%); no measurement on these GPUs in our notes; "
        "replace with a measured copy bandwidth (--tables memory_efficiency)"
    )
    tensor_efficiency: float = 0.6
    tensor_efficiency_source: str = (
        "assumed: achieved / dense peak of large bf16/fp8 GEMMs in serving kernels (dequantising "
        "int4 GEMMs lower); only prefill and large batches are compute-bound; replace with a "
        "measured number (--tables tensor_efficiency)"
    )
    activation_passes: float = 8.0
    activation_passes_source: str = (
        "counted: per layer the hidden states are read or written about 8 times outside the "
        "GEMMs (2 RMSNorms in/out, 2 residual adds, router input, dispatch pack)"
    )
    pcie_a2a_call_us: float = 5.0
    pcie_a2a_call_source: str = (
        "assumed from research/dispatch_anchors.md s7: kernel launch / graph node a few µs + "
        "count exchange one PCIe round (1-2 µs) + flags 0.4-1.3 µs, per dispatch or combine"
    )
    kernel_gap_graph_us: float = 2.5
    kernel_gap_graph_source: str = (
        "estimate: the gap one dependent kernel leaves inside a CUDA graph without "
        "programmatic dependent launch (drain, launch, ramp), as pcie_a2a's own INT4 MoE model "
        "takes it (quant/grid_model.py: 2.5 µs without PDL); not measured on these GPUs"
    )
    kernel_gap_eager_us: float = 5.0
    kernel_gap_eager_source: str = (
        "a host kernel launch through the CUDA driver and runtime takes about 4-6 µs (RTX 5070 "
        "Ti, CUDA 13; susun-blog.com pegainfer part 3); decode kernels are shorter, so eager "
        "steps are launch-bound; PyTorch's own dispatch comes on top (not counted)"
    )
    pp_send_floor_us: float = 10.2
    pp_send_floor_source: str = (
        "NCCL point-to-point floor taken as the 8-GPU all-to-all 4 KB time (10.2 µs, "
        + _AICONFIG
        + ")"
    )
    # The inter-node hop (``--nodes N --nic SPEC``, :mod:`.nodes`). No NCCL number has been
    # measured across nodes of these boxes; these come from other PCIe boxes.
    nic_efficiency: float = 0.6
    nic_efficiency_source: str = (
        "measured once: 2 nodes x 8 RTX 5090, dual-port 100G RoCE, no GPUDirect RDMA: NCCL "
        "all_reduce about 15 GB/s (github.com/aikitoria/open-gpu-kernel-modules issue 20, "
        "research/field_2026.md s9) = 0.6 of the 25 GB/s line rate; every other NIC class is "
        "assumed to reach the same fraction of its line rate"
    )
    nic_nogdr_cap_gbps: float = 7.5
    nic_nogdr_cap_source: str = (
        "without GPUDirect RDMA NCCL stages through host memory and does not follow the line "
        "rate: 15 GB/s over 2 x 100G NICs is 7.5 per NIC, and 3 nodes x 8 RTX 5090 with one "
        "400G IB NIC each reached 8 GB/s all_reduce (20 with GDR enabled), the same issue 20"
    )
    internode_latency_us: float = 31.0
    internode_latency_source: str = (
        "one NCCL send/recv round between 2 nodes, 256 B-8 KB: 30.7-34.2 µs (nccl-tests "
        "sendrecv_perf, 2 x A40 nodes, github.com/NVIDIA/nccl-tests issue 214); another box "
        "and network, taken for every NIC class (assumed)"
    )
    overrides: str = ""

    def with_overrides(self, doc: Mapping[str, Any], source: str) -> Tables:
        """A copy with the tables named in ``doc`` replaced (same keys as the fields; curves
        as ``[[x, y], ...]``, NCCL ops under ``nccl8``)."""
        changes: dict[str, Any] = {}
        for key, value in doc.items():
            if key == "nccl8":
                if not isinstance(value, Mapping):
                    raise ValueError(f"{source}: nccl8 must map op names to [[bytes, us], ...]")
                table = dict(self.nccl8)
                for op, pts in value.items():
                    if op not in table:
                        raise ValueError(f"{source}: nccl8.{op}: allowed {', '.join(table)}")
                    table[op] = Curve(_points(pts, f"{source} nccl8.{op}"), f"{source} ({op})")
                changes["nccl8"] = table
            elif key in ("nccl4_all_reduce", "custom_ar8", "custom_ar4"):
                changes[key] = Curve(_points(value, f"{source} {key}"), f"{source} ({key})")
            elif key == "gemm_efficiency":
                changes[key] = Flat(_points(value, f"{source} {key}"), f"{source} ({key})")
            elif key in _SCALARS:
                v = value
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                    raise ValueError(f"{source}: {key}: got {v!r}; allowed: a positive number")
                if key.endswith("efficiency") and v > 1:
                    raise ValueError(f"{source}: {key}: got {v!r}; allowed: (0, 1]")
                changes[key] = float(v)
                changes[_SCALARS[key]] = f"{source} ({key})"
            else:
                allowed = [f for f in self.__dataclass_fields__ if not f.endswith("source")]
                raise ValueError(f"{source}: unknown table {key!r}; allowed: {', '.join(allowed)}")
        return replace(self, overrides=source, **changes)


# scalar tables and the field that holds each one's source
_SCALARS = {
    "memory_efficiency": "memory_efficiency_source",
    "tensor_efficiency": "tensor_efficiency_source",
    "tuned_nccl_busbw_gbps": "tuned_nccl_source",
    "custom_ar_max_bytes": "custom_ar_max_source",
    "activation_passes": "activation_passes_source",
    "pcie_a2a_call_us": "pcie_a2a_call_source",
    "pp_send_floor_us": "pp_send_floor_source",
    "kernel_gap_graph_us": "kernel_gap_graph_source",
    "kernel_gap_eager_us": "kernel_gap_eager_source",
    "nic_efficiency": "nic_efficiency_source",
    "nic_nogdr_cap_gbps": "nic_nogdr_cap_source",
    "internode_latency_us": "internode_latency_source",
}


def _points(value: Any, where: str) -> tuple[tuple[float, float], ...]:
    try:
        pts = tuple((float(x), float(y)) for x, y in value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected [[x, y], ...]") from None
    if not pts:
        raise ValueError(f"{where}: expected at least one [x, y] point")
    return pts


def load_tables(path: str) -> Tables:
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--tables {path}: not JSON ({exc})") from None
    if not isinstance(doc, Mapping):
        raise ValueError(f"--tables {path}: expected a JSON object of tables")
    return Tables().with_overrides(doc, path)
