"""What a placement costs: the INT4 expert GEMM's time by rows per expert, and the bytes of
a dispatch/combine row.

Why time and not token counts: a decode step's expert GEMM is bound by reading the expert's
weights (Kimi K2: ~25 MB per expert in INT4 with group-32 scales) until an expert has tens of
rows; one row costs nearly as much as thirty. A rank with 52 experts of 3 rows each is
slower than one with 20 experts of 8 rows, though both see 160 rows. So the balancer
evaluates each rank's step as the sum, over its experts, of the GEMM time at that expert's
rows (all of a rank's experts run in one launch over all SMs: their times add).

:class:`GemmCost` is a piecewise-linear table ``(rows, µs per expert)``. The defaults are a
roofline estimate (weights streamed at a fraction of the HBM bandwidth; rows padded to the
kernel's 16-row tiles at a fraction of the tensor-core peak), not a measurement; replace
them with ``GemmCost.from_bench_json`` on the output of ``benchmarks/bench_moe_gemm.py
--json`` from the GPU in question. Rows per step are random: a rank's expected time uses
the expected cost over a Poisson number of rows with the expected mean
(:meth:`GemmCost.expected`), so an expert with 0.3 rows per step costs about 26% of one
with 1 row, not 30% (and not 100%).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..buffer_memory import row_bytes
from ..gpus import GPUS as GPU_TABLE

_TILE_ROWS = 16
_POISSON_MAX = 48  # mean rows above which the cost of the mean is used (curve ~ linear)

# GPU: (DRAM GB/s, dense bf16 tensor TFLOP/s with fp32 accumulation), from the one table.
GPUS: dict[str, tuple[float, float]] = {
    k: (float(g.bandwidth_gbps), g.peak_tflops("bf16")) for k, g in GPU_TABLE.items()
}
# Fractions of those reached by the INT4 kernel (estimates until measured).
BANDWIDTH_EFFICIENCY = 0.80
COMPUTE_EFFICIENCY = 0.50


@dataclass(frozen=True)
class ExpertShape:
    hidden: int = 7168  # Kimi K2 / DeepSeek-V3
    intermediate: int = 2048
    group_size: int = 32  # INT4 scale group (Kimi K2: 32)
    scale_bytes: int = 2  # bf16 scales

    @property
    def weight_bytes(self) -> int:
        """INT4 gate, up and down plus one scale per group."""
        params = 3 * self.hidden * self.intermediate
        return params // 2 + (params // self.group_size) * self.scale_bytes

    @property
    def flops_per_row(self) -> int:
        return 2 * 3 * self.hidden * self.intermediate


KIMI_K2 = ExpertShape()


@dataclass(frozen=True)
class GemmCost:
    """Time of one expert's GEMM (µs) by its rows; 0 rows cost nothing."""

    rows: tuple[float, ...]  # increasing, first > 0
    us: tuple[float, ...]
    name: str = ""

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.us) or not self.rows:
            raise ValueError("GemmCost: rows and us must be non-empty and of equal length")
        if self.rows[0] <= 0 or any(b <= a for a, b in zip(self.rows, self.rows[1:])):
            raise ValueError(f"GemmCost: rows must be increasing and > 0, got {self.rows}")
        if any(not (u >= 0 and math.isfinite(u)) for u in self.us):
            raise ValueError(f"GemmCost: times must be finite and >= 0, got {self.us}")
        xs, ys = np.array((0.0, *self.rows)), np.array((0.0, *self.us))
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        k = np.arange(_POISSON_MAX * 2 + 1, dtype=np.float64)
        object.__setattr__(self, "_xy", (xs, ys, slope))
        object.__setattr__(
            self, "_poisson", (k, self(k), np.concatenate(([0.0], np.cumsum(np.log(k[1:])))))
        )

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def roofline(
        gpu: str = "rtx-pro-6000",
        shape: ExpertShape = KIMI_K2,
        max_rows: int = 1024,
        bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY,
        compute_efficiency: float = COMPUTE_EFFICIENCY,
    ) -> GemmCost:
        """The estimate: ``max(weight bytes / bandwidth, flops(rows padded to 16) /
        compute)`` at every row count up to ``max_rows`` (linear beyond)."""
        if gpu not in GPUS:
            raise ValueError(f"gpu: got {gpu!r}; allowed: {', '.join(GPUS)}")
        gbps, tflops = GPUS[gpu]
        t_weights = shape.weight_bytes / (gbps * bandwidth_efficiency * 1e3)  # µs
        per_row = shape.flops_per_row / (tflops * compute_efficiency * 1e6)  # µs
        rows = tuple(float(n) for n in range(1, max_rows + 1))
        us = tuple(max(t_weights, per_row * _TILE_ROWS * math.ceil(n / _TILE_ROWS)) for n in rows)
        return GemmCost(rows, us, f"roofline {gpu} (estimate)")

    @staticmethod
    def from_points(points: Sequence[tuple[float, float]], name: str = "") -> GemmCost:
        pts = sorted((float(r), float(u)) for r, u in points)
        return GemmCost(tuple(r for r, _ in pts), tuple(u for _, u in pts), name)

    @staticmethod
    def from_bench_json(path: str, model: str = "kimi-k2") -> GemmCost:
        """Measured: ``benchmarks/bench_moe_gemm.py --json`` output (``int4_us`` for
        ``experts`` experts of ``rows_per_expert`` rows each)."""
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        try:
            pts = [
                (r["rows_per_expert"], r["int4_us"] / r["experts"])
                for r in doc["results"]
                if r["model"] == model
            ]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a bench_moe_gemm.py --json file: {exc}") from None
        if not pts:
            raise ValueError(f"{path}: no results for model {model!r}")
        return GemmCost.from_points(pts, f"measured {doc.get('device', '?')} ({path})")

    # ---- evaluation ---------------------------------------------------------------------
    def __call__(self, rows: np.ndarray | float) -> np.ndarray:
        """Cost at exactly ``rows`` (interpolated; linear from (0, 0) to the first point and
        beyond the last)."""
        r = np.asarray(rows, dtype=np.float64)
        xs, ys, slope = self._xy
        out = np.interp(r, xs, ys)
        out = np.where(r > xs[-1], ys[-1] + (r - xs[-1]) * slope, out)
        return np.where(r > 0, out, 0.0)

    def expected(self, mean_rows: np.ndarray | float) -> np.ndarray:
        """Expected cost when the rows of a step are Poisson with mean ``mean_rows``."""
        lam = np.asarray(mean_rows, dtype=np.float64)
        k, cost_k, log_fact = self._poisson
        safe = np.maximum(lam, 1e-300)[..., None]
        pmf = np.exp(k * np.log(safe) - safe - log_fact)
        small = (pmf * cost_k).sum(axis=-1)
        return np.where(lam <= 0, 0.0, np.where(lam < _POISSON_MAX, small, self(lam)))


@dataclass(frozen=True)
class RowBytes:
    """Bytes of one dispatch row and one combine row on the wire (core/wire_format.h)."""

    dispatch: int
    combine: int

    @staticmethod
    def for_model(hidden: int = 7168, num_topk: int = 8, payload: str = "fp8") -> RowBytes:
        """Kimi K2's decode defaults: fp8 dispatch (e4m3 + one fp32 scale per 128
        channels), bf16 combine; the wire format's slots (:func:`pcie_a2a.buffer_memory.row_bytes`)."""
        return RowBytes(*row_bytes(hidden, num_topk, payload))

    @property
    def both(self) -> int:
        return self.dispatch + self.combine
