"""Evaluating every candidate configuration: framework rules, memory, predicted decode
throughput at the asked concurrencies and at the peak, a prefill chunk; then the
recommendation.

The recommendation picks, among configurations some framework can launch and whose memory
fits, the highest throughput whose time per output token stays under the cap
(``--max-tpot-ms``), and the lowest TPOT at C = 1 (the latency choice). Within ``margin``
(5%) of the top the configuration with fewer moving parts is named (TP before all-reduce EP
before AG/RS before pcie_a2a; fewer pipeline stages), so that a small change in an input
does not flip the answer; every configuration inside the named one's band (the stack's
leave-one-out residuals) is listed as a tie the model cannot rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .calibrate import concurrency_grid, max_concurrency, peak
from .configs import Config, candidates
from .memory import Memory, memory
from .predict import Env, Step, prefill, step
from .rules import model_reasons, reasons

CONCURRENCIES = (1, 8, 32, 128)
MARGIN = 0.05
_SIMPLICITY = {"tp": 0, "allreduce": 1, "ag-rs": 2, "a2a-nccl": 3, "pcie_a2a": 4}


@dataclass
class Result:
    config: Config
    reasons: dict[str, list[str]]
    memory: Memory  # in the stack's framework's layout and budget
    steps: dict[int, Step] = field(default_factory=dict)  # by concurrency
    peak_c: int = 0
    peak_tok_s: float = 0.0
    curve: list[tuple[int, float]] = field(default_factory=list)
    prefill: Step | None = None
    prefill_chunk: int = 0
    c_max: int = 0  # most requests the stack batches and the KV cache holds
    memories: dict[str, Memory] = field(default_factory=dict)  # each framework's own

    def mem(self, fw: str) -> Memory:
        return self.memories.get(fw, self.memory)

    @property
    def launchable(self) -> list[str]:
        return [f for f, r in self.reasons.items() if not r]

    @property
    def runs(self) -> bool:
        """Some framework launches it and, in that framework's own layout, it fits."""
        return any(self.mem(f).fits for f in self.launchable)

    @property
    def modelled(self) -> bool:
        """Numbers exist: the layout is valid (it may still be out of memory or unsupported
        by both frameworks, as a reference)."""
        return bool(self.steps)

    def why_not(self) -> str:
        if self.runs:
            return ""
        parts = []
        if self.modelled and not self.memory.fits:
            parts.append("out of memory: " + self.memory.summary())
        for fw in self.launchable:
            if self.mem(fw).fits != self.memory.fits:
                state = "fits" if self.mem(fw).fits else "out of memory"
                parts.append(
                    f"in {fw}'s own layout and budget it {state}: {self.mem(fw).summary()}"
                )
        common = set(self.reasons["sglang"]) & set(self.reasons["vllm"])
        for r in self.reasons["sglang"]:
            if r in common:
                parts.append(r)
        if not (self.reasons["sglang"] and self.reasons["vllm"]):
            return "; ".join(parts)
        for fw in ("sglang", "vllm"):
            only = [r for r in self.reasons[fw] if r not in common]
            if only:
                parts.append(f"{fw}: " + "; ".join(only))
        return "; ".join(parts)


def _refine(env: Env, cfg: Config, curve: list[tuple[int, float]], cap_ms: float) -> None:
    """Adds to ``curve`` the largest C between two grid points whose TPOT is still under
    the cap (bisection; TPOT grows with C), so the capped choice is not a grid artefact."""
    under = [c for c, tok in curve if tok > 0 and c / tok * 1e3 <= cap_ms]
    if not under:
        return
    lo = max(under)
    above = [c for c, tok in curve if c > lo]
    if not above:
        return
    hi = min(above)
    best = None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        s = step(env, cfg, mid)
        if s.tpot_us / 1e3 <= cap_ms:
            lo, best = mid, (mid, s.tok_s)
        else:
            hi = mid
    if best is not None:
        curve.append(best)
        curve.sort()


def evaluate(
    env: Env, cfg: Config, gpus: int, concurrencies=CONCURRENCIES, cap_ms: float | None = None
) -> Result:
    """Rules, memory and (when the layout itself is valid for the model: every split
    divides what it splits) the predicted numbers. A layout only a framework refuses is
    still predicted, as a reference."""
    why = reasons(cfg, env.model, gpus)
    mems = {
        fw: memory(env.model, cfg, env.gpu, env.stack, env.held, env.kv_bytes, fw)
        for fw in ("sglang", "vllm")
    }
    res = Result(cfg, why, mems[env.stack.framework], memories=mems)
    if model_reasons(cfg, env.model, gpus):
        return res
    for c in concurrencies:
        res.steps[c] = step(env, cfg, c)
    res.peak_c, res.peak_tok_s = peak(env, cfg)
    res.c_max = c_max = max_concurrency(env, cfg)
    res.curve = [(c, step(env, cfg, c).tok_s) for c in concurrency_grid(max(c_max, 1))]
    if cap_ms is not None:
        _refine(env, cfg, res.curve, cap_ms)
    chunk, _ = env.stack.prefill_chunk(env.gpu)
    res.prefill_chunk = chunk
    res.prefill = prefill(env, cfg, chunk)
    return res


@dataclass
class Recommendation:
    best: Result | None  # highest throughput with TPOT under the cap
    latency: Result | None  # lowest TPOT at C = 1
    ties: list[Result]  # inside the best's band (the model cannot rank them)
    note: str
    cap_ms: float = 50.0
    latency_ties: list[Result] = field(default_factory=list)


def under_cap(r: Result, cap_ms: float) -> tuple[int, float]:
    """(C, tok/s) of the best point of ``r``'s curve whose time per output token is at most
    ``cap_ms``; (0, 0.0) when none is."""
    best = (0, 0.0)
    for c, tok in r.curve:
        if c > r.c_max:  # more requests than the stack batches or the KV cache holds
            continue
        if tok > 0 and c / tok * 1e3 <= cap_ms and tok > best[1]:
            best = (c, tok)
    return best


def _simple(r: Result) -> tuple:
    c = r.config
    return (c.pp, _SIMPLICITY[c.comm], c.attn_dp, c.dcp, c.kv_fp8, c.redundant, c.name)


def recommend(
    results: list[Result],
    margin: float = MARGIN,
    cap_ms: float = 50.0,
    band: tuple[float, float] = (1.0, 1.0),
) -> Recommendation:
    """Throughput under the TPOT cap and latency at C = 1. Configurations whose predicted
    figure lies inside the best's band (``band``: low and high factors from the stack's
    leave-one-out residuals) are ties, listed; within ``margin`` of the best the simpler
    one is named, so that a small change in an input does not flip the answer."""
    ok = [r for r in results if r.runs and r.peak_tok_s > 0]
    if not ok:
        return Recommendation(
            None, None, [], "no configuration both launches and fits in memory", cap_ms
        )
    lo, hi = band
    lat_top = min(r.steps[1].tpot_us for r in ok)
    lat_near = [r for r in ok if r.steps[1].tpot_us <= (1 + margin) * lat_top]
    lat = sorted(lat_near, key=_simple)[0]
    lat_ties = [
        r for r in ok if r is not lat and r.steps[1].tpot_us * lo <= lat.steps[1].tpot_us * hi
    ]
    capped = [(r, under_cap(r, cap_ms)) for r in ok]
    capped = [(r, ct) for r, ct in capped if ct[1] > 0]
    if not capped:
        note = (
            f"no configuration reaches a TPOT of {cap_ms:g} ms even at C=1; the lowest is "
            f"{lat.config.name} at {lat.steps[1].tpot_us / 1e3:.1f} ms (raise --max-tpot-ms)"
        )
        return Recommendation(None, lat, [], note, cap_ms, lat_ties)
    top = max(ct[1] for _, ct in capped)
    near = [r for r, ct in capped if ct[1] >= (1 - margin) * top]
    best = sorted(near, key=_simple)[0]
    b_tok = under_cap(best, cap_ms)[1]
    ties = [r for r, ct in capped if r is not best and ct[1] * hi >= b_tok * lo]
    ties.sort(key=lambda r: -under_cap(r, cap_ms)[1])
    note = ""
    if ties:
        names = ", ".join(f"{r.config.name} {under_cap(r, cap_ms)[1]:.0f}" for r in ties[:6])
        more = f" and {len(ties) - 6} more" if len(ties) > 6 else ""
        note = (
            f"a tie: {names}{more} tok/s are inside {best.config.name}'s band "
            f"(x{lo:.2f}..x{hi:.2f}); the model cannot rank them; "
            + (
                "the simplest within 5% of the top is named"
                if best is not max(capped, key=lambda rc: rc[1][1])[0]
                else "the top prediction is named"
            )
        )
    return Recommendation(best, lat, [best, *ties], note, cap_ms, lat_ties)


def evaluate_all(
    env: Env, gpus: int, redundant: int = 0, payload: str = "fp8", cap_ms: float | None = None
) -> list[Result]:
    return [evaluate(env, c, gpus, cap_ms=cap_ms) for c in candidates(gpus, redundant, payload)]
