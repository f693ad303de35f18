"""Evaluating every candidate configuration: framework rules, memory, predicted decode
throughput at the asked concurrencies and at the peak, a prefill chunk; then the
recommendation.

The recommendation picks, among configurations some framework can launch and whose memory
fits, the highest peak throughput; anything within ``margin`` (5%) of it counts as a tie,
and ties go to the configuration with fewer moving parts (TP before all-reduce EP before
AG/RS before pcie_a2a; fewer pipeline stages), so that a small change in an input does not
flip the answer between two configurations the model cannot tell apart.
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
    memory: Memory
    steps: dict[int, Step] = field(default_factory=dict)  # by concurrency
    peak_c: int = 0
    peak_tok_s: float = 0.0
    curve: list[tuple[int, float]] = field(default_factory=list)
    prefill: Step | None = None
    prefill_chunk: int = 0
    c_max: int = 0  # most requests the stack batches and the KV cache holds

    @property
    def launchable(self) -> list[str]:
        return [f for f, r in self.reasons.items() if not r]

    @property
    def runs(self) -> bool:
        return bool(self.launchable) and self.memory.fits

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


def evaluate(env: Env, cfg: Config, gpus: int, concurrencies=CONCURRENCIES) -> Result:
    """Rules, memory and (when the layout itself is valid for the model: every split
    divides what it splits) the predicted numbers. A layout only a framework refuses is
    still predicted, as a reference."""
    why = reasons(cfg, env.model, gpus)
    mem = memory(env.model, cfg, env.gpu, env.stack, env.context, env.kv_bytes)
    res = Result(cfg, why, mem)
    if model_reasons(cfg, env.model, gpus):
        return res
    for c in concurrencies:
        res.steps[c] = step(env, cfg, c)
    res.peak_c, res.peak_tok_s = peak(env, cfg)
    res.c_max = c_max = max_concurrency(env, cfg)
    res.curve = [(c, step(env, cfg, c).tok_s) for c in concurrency_grid(max(c_max, 1))]
    chunk, _ = env.stack.prefill_chunk(env.gpu)
    res.prefill_chunk = chunk
    res.prefill = prefill(env, cfg, chunk)
    return res


@dataclass
class Recommendation:
    best: Result | None
    latency: Result | None  # best at C = 1
    ties: list[Result]
    note: str


def recommend(results: list[Result], margin: float = MARGIN) -> Recommendation:
    ok = [r for r in results if r.runs and r.peak_tok_s > 0]
    if not ok:
        return Recommendation(None, None, [], "no configuration both launches and fits in memory")

    def simple(r: Result) -> tuple:
        c = r.config
        return (c.pp, _SIMPLICITY[c.comm], c.attn_dp, c.redundant, c.name)

    top = max(r.peak_tok_s for r in ok)
    ties = sorted([r for r in ok if r.peak_tok_s >= (1 - margin) * top], key=simple)
    best = ties[0]
    lat_top = max(r.steps[1].tok_s for r in ok)
    lat = sorted([r for r in ok if r.steps[1].tok_s >= (1 - margin) * lat_top], key=simple)[0]
    note = ""
    if len(ties) > 1:
        others = ", ".join(f"{r.config.name} {r.peak_tok_s:.0f}" for r in ties[1:])
        note = (
            f"within {margin:.0%} of the best peak (a tie for this model; the simpler one is "
            f"named): {others}"
        )
    return Recommendation(best, lat, ties, note)


def evaluate_all(env: Env, gpus: int, redundant: int = 0, payload: str = "fp8") -> list[Result]:
    return [evaluate(env, c, gpus) for c in candidates(gpus, redundant, payload)]
