"""The routed experts' time on one rank: one expert-GEMM cost per weight format.

=====================================  =========================================================
INT4 experts, symmetric, group 32, 64  the INT4 kernel's grid model
or 128, on a GPU the grid model knows  (:func:`pcie_a2a.quant.grid_model.predict`, the model
(``grid_model.GPUS``), fewer than      ``scripts/sass_report.py`` ties to the compiled kernel)
``grid_model.BLOCK_M_64_MIN_ROWS``     for the rank's shape: hidden, moe_intermediate / moe_tp,
rows per expert                        group, top-k, local experts (E + redundant) / ep; the
                                       low-latency rows layout in a pcie_a2a decode step, the
                                       normal layout otherwise
everything else                        the roofline (weight bytes at the GPU's bandwidth x
                                       memory efficiency, or FLOPs at its tensor peak x tensor
                                       efficiency) divided by the GEMM efficiency at the rows
                                       per expert (:class:`.tables.Tables`)
=====================================  =========================================================

The grid model takes whole numbers of experts and rows per expert; the load model
(:mod:`.imbalance`) gives expected values. The time is linear between the two whole
numbers of experts around the expected count (0 experts: no time), at the expected rows
per expert rounded up. Every row of the plan says in its sources which model its
experts used and, for the roofline, why not the grid model.
"""

from __future__ import annotations

import math
from functools import lru_cache

from .configs import Config
from .memory import pcie_a2a_tokens

GRID = "INT4 grid model"
ROOFLINE = "roofline"
# an expected rows-per-expert within this of a whole number is that number (float noise)
_ROUND_EPS = 1e-9


def _grid():
    # imported on first use: the package's quant/__init__ brings torch, which the plan's
    # other models do not need
    from pcie_a2a.quant import grid_model

    return grid_model


@lru_cache(maxsize=4096)
def _grid_us(key: str, active: int, rows: int, shape, layout: str) -> float:
    if active <= 0:
        return 0.0
    return _grid().predict(key, active, rows, shape=shape, layout=layout).time_us


def grid_key(gpu) -> str:
    """The grid model's name of a :mod:`pcie_a2a.gpus` entry (its key, with underscores)."""
    return gpu.key.replace("-", "_")


def why_not_grid(env) -> str:
    """Why this model and GPU take the roofline for their routed experts ("" if they take
    the grid model at decode-sized rows)."""
    f = env.model.fmt("experts")
    if f.kind != "int4":
        return f"{f.label} experts (the grid model is of the INT4 kernel)"
    if f.zeros or f.group not in (32, 64, 128):
        return (
            f"{f.label} experts: the grid model's weights are symmetric INT4 with a bf16 scale "
            "per group of 32, 64 or 128"
        )
    if grid_key(env.gpu) not in _grid().GPUS:
        return (
            f"{env.gpu.name} is not in the INT4 grid model (no occupancy table for its "
            f"architecture; grid_model.GPUS: {', '.join(_grid().GPUS)})"
        )
    return ""


def shape(env, cfg: Config, prefill: bool):
    """The grid model's shape of one rank of ``cfg`` and its rows layout."""
    m = env.model
    layout = "low_latency" if cfg.comm == "pcie_a2a" and not prefill else "normal"
    chunk, _ = env.stack.prefill_chunk(env.gpu)
    sh = _grid().Shape(
        hidden=m.hidden,
        intermediate=m.moe_intermediate // cfg.moe_tp,
        local_experts=(m.experts + cfg.redundant) // cfg.ep,
        topk=m.top_k,
        group=m.fmt("experts").group,
        # the receive buffer: EP ranks x the tokens per rank the launch line sizes it for
        ll_rows=cfg.ep * pcie_a2a_tokens(env.stack, cfg, chunk),
    )
    return sh, layout


def experts_time(
    env, cfg: Config, active: float, rows: float, prefill: bool = False
) -> tuple[float, str, str]:
    """(µs, model name, source) of ``rows`` routed rows over ``active`` distinct experts on
    one rank."""
    if active <= 0:
        return 0.0, "", ""
    why = why_not_grid(env)
    per_expert = rows / active
    if not why:
        limit = _grid().BLOCK_M_64_MIN_ROWS
        if per_expert >= limit:
            why = (
                f"{per_expert:.0f} rows per expert: the kernel takes block_m 64 from "
                f"{limit} rows, which the grid model does not model"
            )
    if why:
        src = (
            f"{ROOFLINE} ({env.model.fmt('experts').label} weights at the GPU table's "
            f"bandwidth x memory efficiency, / GEMM efficiency by rows per expert): {why}"
        )
        return _roofline(env, cfg, active, rows), ROOFLINE, src
    sh, layout = shape(env, cfg, prefill)
    key = grid_key(env.gpu)
    r = max(1, math.ceil(per_expert - _ROUND_EPS))
    lo = math.floor(active + _ROUND_EPS)
    t_lo = _grid_us(key, lo, r, sh, layout)
    if active - lo <= _ROUND_EPS:
        us = t_lo
    else:
        us = t_lo + (active - lo) * (_grid_us(key, lo + 1, r, sh, layout) - t_lo)
    src = (
        f"{GRID} (pcie_a2a.quant.grid_model.predict, the model scripts/sass_report.py ties "
        f"to the compiled kernel): {key}, hidden {sh.hidden}, intermediate {sh.intermediate}"
        f" per rank, group {sh.group}, top-{sh.topk}, {sh.local_experts} local experts, "
        f"{layout} layout"
    )
    return us, GRID, src


def _roofline(env, cfg: Config, active: float, rows: float) -> float:
    m = env.model
    eb, flops = m.expert_bytes() / cfg.moe_tp, 2.0 * m.expert_params() / cfg.moe_tp
    dt = env.compute_dtype(m.fmt("experts"))
    eff = env.tables.gemm_efficiency(rows / active)
    return env.roofline(active * eb, rows * flops, dt) / eff
