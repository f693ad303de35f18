"""Fitting a stack's overhead constants on its calibration numbers, and nothing else.

The calibration box is the one the numbers were measured on: Kimi K2.6 INT4 on 8x RTX PRO
6000, context ~0 (the tuned pages say so; the stock numbers do not, and are taken the
same), uniform routing. Every other term of the model is fixed (sourced tables, assumed
efficiencies, counted kernels); the step is linear in the stack's two host costs
``step_us`` and ``request_us``, so the fit is a non-negative least-squares problem on the
relative error of the step time, iterated for a "peak" point (whose concurrency moves with
the constants). Then each point is predicted by the fit made without it (leave-one-out):
those residuals, not the in-sample ones, are the band every predicted figure carries.
"""

from __future__ import annotations

from dataclasses import replace

from ..gpus import GPUS
from .configs import Config
from .exchange import Exchanges
from .imbalance import uniform
from .measured import Measured
from .memory import memory
from .models import load_model
from .predict import Env, step
from .stacks import Stack
from .tables import Tables
from .topo import synthetic_topology

CAL_MODEL = "kimi-k2.6"
CAL_GPU = "rtx-pro-6000"
CAL_CONTEXT = 0


def concurrency_grid(c_max: int) -> list[int]:
    grid, c = [], 1
    while c < c_max:
        grid.append(c)
        c *= 2
    grid.append(max(c_max, 1))
    return grid


def max_concurrency(env: Env, cfg: Config) -> int:
    mem = memory(env.model, cfg, env.gpu, env.stack, env.held, env.kv_bytes)
    bs, _ = env.stack.max_batch(env.gpu, cfg)
    return max(0, min(mem.max_requests, bs * cfg.attn_dp))


def peak(env: Env, cfg: Config) -> tuple[int, float]:
    """(concurrency, tok/s) of the best point on the grid up to the most requests the
    stack batches and the KV cache holds."""
    c_max = max_concurrency(env, cfg)
    if c_max < 1:
        return 0, 0.0
    best = (1, 0.0)
    for c in concurrency_grid(c_max):
        r = step(env, cfg, c).tok_s
        if r > best[1]:
            best = (c, r)
    return best


def calibration_env(stack: Stack, tables: Tables) -> Env:
    model = load_model(CAL_MODEL)
    topo = synthetic_topology(8, GPUS[CAL_GPU].pcie_gen)
    return Env(
        model,
        GPUS[CAL_GPU],
        stack,
        tables,
        uniform(model.experts),
        CAL_CONTEXT,
        2.0,
        Exchanges(topo, Measured(), GPUS[CAL_GPU].pcie_gen),
    )


def _terms(env: Env, cfg: Config, c: int) -> tuple[float, float, float]:
    """(T at zero host cost, dT/d step_us, dT/d request_us) of a decode step, µs."""
    base = replace(env.stack, step_us=0.0, request_us=0.0)
    t0 = step(replace(env, stack=base, _loads=env._loads), cfg, c).tpot_us
    t1 = step(replace(env, stack=replace(base, step_us=1.0), _loads=env._loads), cfg, c).tpot_us
    t2 = step(replace(env, stack=replace(base, request_us=1.0), _loads=env._loads), cfg, c).tpot_us
    return t0, t1 - t0, t2 - t0


def _nnls2(rows: list[tuple[float, float, float]], fit_y: bool) -> tuple[float, float]:
    """min sum (a x + b y - r)^2 over x, y >= 0 (y = 0 unless fit_y)."""

    def solve_x() -> tuple[float, float]:
        saa = sum(a * a for a, _, _ in rows)
        return (max(sum(a * r for a, _, r in rows) / saa, 0.0) if saa else 0.0), 0.0

    def cost(x: float, y: float) -> float:
        return sum((a * x + b * y - r) ** 2 for a, b, r in rows)

    options = [solve_x()]
    if fit_y:
        sbb = sum(b * b for _, b, _ in rows)
        if sbb:
            options.append((0.0, max(sum(b * r for _, b, r in rows) / sbb, 0.0)))
        saa = sum(a * a for a, _, _ in rows)
        sab = sum(a * b for a, b, _ in rows)
        sar = sum(a * r for a, _, r in rows)
        sbr = sum(b * r for _, b, r in rows)
        det = saa * sbb - sab * sab
        if abs(det) > 1e-18 * max(saa * sbb, 1e-30):
            x = (sar * sbb - sbr * sab) / det
            y = (saa * sbr - sab * sar) / det
            if x >= 0 and y >= 0:
                options.append((x, y))
    return min(options, key=lambda o: cost(*o))


def _fit_points(env: Env, points) -> tuple[Env, dict[int, int]]:
    """The environment with the fitted host costs for ``points``, and each point's C."""
    conc = {
        i: p.concurrency if p.concurrency is not None else max_concurrency(env, p.config)
        for i, p in enumerate(points)
    }
    for _ in range(12):
        rows = []
        for i, p in enumerate(points):
            c = conc[i]
            t0, a, b = _terms(env, p.config, c)
            target = c / p.tok_s * 1e6
            rows.append((a / target, b / target, (target - t0) / target))
        x, y = _nnls2(rows, True)
        env = replace(env, stack=replace(env.stack, step_us=x, request_us=y))
        moved = False
        for i, p in enumerate(points):
            if p.concurrency is None:
                c, _ = peak(env, p.config)
                moved |= c != conc.get(i)
                conc[i] = c
        if not moved:
            break
    return env, conc


def _predict_point(env: Env, p) -> tuple[str, float]:
    if p.concurrency is None:
        c, r = peak(env, p.config)
        return f"{p.config.name} peak (model peak at C={c})", r
    return f"{p.config.name} C={p.concurrency}", step(env, p.config, p.concurrency).tok_s


def fit(stack: Stack, tables: Tables | None = None) -> Stack:
    """``stack`` with its fitted host costs, in-sample and leave-one-out residuals. A
    stack ``like`` a shipped one takes that one's fit and band."""
    tables = tables or Tables()
    if stack.like:
        from .stacks import STACKS

        base = fit(STACKS[stack.like], tables)
        return stack.with_fit(base.step_us, base.request_us, base.residuals, base.loo)
    if not stack.points:
        raise ValueError(f"stack {stack.name}: no calibration numbers and no 'like' stack")
    env0 = calibration_env(stack, tables)
    env, _ = _fit_points(env0, stack.points)
    residuals = []
    for p in stack.points:
        label, r = _predict_point(env, p)
        residuals.append((label, p.tok_s, r))
    loo = []
    if len(stack.points) > 1:
        for i, p in enumerate(stack.points):
            rest = [q for j, q in enumerate(stack.points) if j != i]
            env_i, _ = _fit_points(env0, rest)
            label, r = _predict_point(env_i, p)
            loo.append((f"{label} [{p.tag}]", p.tok_s, r))
    s = env.stack
    return stack.with_fit(s.step_us, s.request_us, residuals, loo)
