"""The benchmark's routing options (:mod:`.routing` generates them with torch): torch-free,
so the ``pcie-a2a`` command line is built without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

ROUTINGS = ("uniform", "zipf", "kimi")


@dataclass(frozen=True)
class RoutingSpec:
    kind: str
    num_experts: int
    topk: int
    seed: int = 0
    zipf_s: float = 1.0
    n_group: int = 8
    topk_group: int = 4


def check_spec(spec: RoutingSpec) -> str | None:
    """Why the spec cannot be generated (an error text naming the option), or None."""
    if spec.kind not in ROUTINGS:
        return f"--routing: got {spec.kind!r}; allowed: {', '.join(ROUTINGS)}"
    if spec.topk > spec.num_experts:
        return f"--topk: got {spec.topk}; allowed: at most --experts ({spec.num_experts})"
    if spec.kind == "zipf" and spec.zipf_s < 0:
        return f"--zipf-s: got {spec.zipf_s}; allowed: a number >= 0"
    if spec.kind == "kimi":
        if spec.n_group < 1 or spec.num_experts % spec.n_group:
            return (
                f"--n-group: got {spec.n_group}; allowed: a divisor of --experts "
                f"({spec.num_experts})"
            )
        if not 1 <= spec.topk_group <= spec.n_group:
            return f"--topk-group: got {spec.topk_group}; allowed: 1..--n-group ({spec.n_group})"
        room = spec.topk_group * (spec.num_experts // spec.n_group)
        if spec.topk > room:
            return (
                f"--topk: got {spec.topk}; allowed: at most --topk-group x experts per "
                f"group = {room} with routing 'kimi'"
            )
    return None
