"""Collective times: NCCL by op, size and world, the tuned stacks' custom PCIe all-reduce,
and point-to-point sends between pipeline stages.

Where the GPU and world match a measured table (8x RTX PRO 6000; 4x for all_reduce) the
table is used as is. Elsewhere the time is an alpha-beta model derived from the 8-GPU
table: ``t = alpha(world) + bus_factor(world) * size / busbw``, with busbw taken from the
table's 16 MB point and scaled by the GPU's PCIe link capacity, and alpha from the measured
4- and 8-GPU all_reduce floors, linear in the number of ring steps. Every result carries a
``source`` tag that says which of these it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from pcie_a2a.topology import estimates

from ..gpus import Gpu
from .tables import KB, MB, Tables

OPS = ("all_reduce", "all_gather", "reduce_scatter", "alltoall")


KINDS = ("measured", "predicted", "derived", "model", "assumed", "none")


@dataclass(frozen=True)
class Cost:
    us: float
    kind: str  # measured (a table or file of measurements), predicted (another tool's
    # prediction from a file), derived (a measured table scaled to this case), model
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"cost kind {self.kind!r}: allowed {', '.join(KINDS)}")


ZERO = Cost(0.0, "none", "one GPU: no communication")


def bus_factor(op: str, n: int) -> float:
    """Bytes each rank moves per byte of ``size`` (nccl-tests' busbw factor)."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n


def link_gbps(gpu: Gpu) -> float:
    return estimates.link_capacity(gpu.pcie_gen, 16)


def _alpha(op: str, n: int, t: Tables) -> float:
    a8 = t.nccl8["all_reduce"](4 * KB)
    a4 = t.nccl4_all_reduce(16 * KB)
    per_step = (a8 - a4) / 4.0
    ar = a4 + per_step * (n - 4)
    return max(ar, 1.0) * t.nccl8[op](4 * KB) / a8


def nccl(op: str, size: float, n: int, gpu: Gpu, t: Tables) -> Cost:
    if op not in OPS:
        raise ValueError(f"collective op {op!r}: allowed {', '.join(OPS)}")
    if n <= 1 or size <= 0:
        return ZERO
    if gpu.key == "rtx-pro-6000" and n == 8:
        return Cost(t.nccl8[op](size), "measured", f"NCCL {op} table: {t.nccl8[op].source}")
    if gpu.key == "rtx-pro-6000" and n == 4 and op == "all_reduce":
        return Cost(
            t.nccl4_all_reduce(size), "measured", f"NCCL table: {t.nccl4_all_reduce.source}"
        )
    table = t.nccl8[op]
    a8 = table(4 * KB)
    busbw = bus_factor(op, 8) * 16 * MB / (table(16 * MB) - a8)  # bytes per µs
    busbw *= link_gbps(gpu) / t.reference_link_gbps
    us = _alpha(op, n, t) + bus_factor(op, n) * size / busbw
    return Cost(
        us,
        "derived",
        f"alpha-beta from the 8x RTX PRO 6000 NCCL {op} table, world {n}, bandwidth scaled "
        f"by PCIe Gen{gpu.pcie_gen} link capacity",
    )


def all_reduce(size: float, n: int, gpu: Gpu, t: Tables, mode: str) -> Cost:
    """``mode``: ``nccl`` (stock: the engines turn their custom all-reduce off above 2 PCIe
    GPUs), ``custom`` (a PCIe custom all-reduce up to ``custom_ar_max_bytes``, patched NCCL
    above) or ``pcie_a2a`` (``pcie_a2a.AllReduce``: the same one-shot class of algorithm,
    costed from the same measured table because it has never run on a GPU)."""
    if n <= 1 or size <= 0:
        return ZERO
    stock = nccl("all_reduce", size, n, gpu, t)
    if mode == "nccl":
        return stock
    if mode not in ("custom", "pcie_a2a"):
        raise ValueError(f"all-reduce mode {mode!r}: allowed nccl, custom, pcie_a2a")
    if size <= t.custom_ar_max_bytes:
        table = t.custom_ar8 if n > 4 else t.custom_ar4
        us = min(table(size), stock.us)
        if mode == "pcie_a2a":
            return Cost(
                us,
                "assumed",
                "pcie_a2a.AllReduce, never run on a GPU: taken as the measured PCIe one-shot "
                f"all-reduce ({table.source})",
            )
        if gpu.key != "rtx-pro-6000":
            return Cost(us, "derived", f"RTX PRO 6000 custom all-reduce table: {table.source}")
        return Cost(us, "measured", f"custom all-reduce table: {table.source}")
    busbw = t.tuned_nccl_busbw_gbps * 1e3 * link_gbps(gpu) / t.reference_link_gbps
    floor = nccl("all_reduce", 4 * KB, n, gpu, t).us
    us = floor + bus_factor("all_reduce", n) * size / busbw
    if us >= stock.us:
        return stock
    return Cost(
        us, "model", f"tuned NCCL: small-size floor + size at tuned busbw ({t.tuned_nccl_source})"
    )


def p2p_send(size: float, gbps: float, latency_us: float, t: Tables, where: str) -> Cost:
    """A pipeline-stage send of ``size`` bytes over a pair the topology plan rates at
    ``gbps`` and ``latency_us`` (NCCL send/recv: its floor plus the bytes)."""
    if size <= 0:
        return ZERO
    us = max(t.pp_send_floor_us, latency_us) + size / (gbps * 1e3)
    if where.startswith("node "):  # between two nodes (configplan.nodes): the NIC's numbers
        return Cost(us, "model", f"NCCL send between nodes: {where}")
    return Cost(
        us, "model", f"NCCL send: {t.pp_send_floor_source}; pair numbers from the topology plan"
    )
