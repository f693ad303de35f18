"""Expert-parallel exchanges per MoE layer: all-gather + reduce-scatter, NCCL all-to-all,
and pcie_a2a dispatch + combine, plus the pair numbers pipeline sends use.

pcie_a2a is predicted by the topology planner (:func:`pcie_a2a.topology.plan_transfers`): it decides
every pair (P2P or host-staged, from the topology and any probe), schedules the rounds, and
gives the time of an exchange from per-pair bandwidth and latency and the load on shared
links. The traffic it is given: each rank's tokens go once to each rank holding one of
their experts (P(hit) from the routing and the placement), as fp8 (+ scales) or bf16 rows
with their ids and weights; combine sends one bf16 row back per received row. A probe or
bench file (:mod:`.measured`) replaces the prediction where it has numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pcie_a2a.buffer_memory import row_bytes  # the wire format's slots, the one formula
from pcie_a2a.topology import (
    Topology,
    Traffic,
    TransferOptions,
    TransferPlan,
    plan_transfers,
    with_reports,
)

from . import comm as cm
from .configs import Config
from .imbalance import place, rank_hit_probability
from .measured import Measured


def dispatch_row_bytes(hidden: int, topk: int, payload: str) -> float:
    return float(row_bytes(hidden, topk, payload)[0])


@dataclass
class Exchanges:
    topology: Topology
    measured: Measured
    link_gen: int
    _plan: TransferPlan | None = None
    _cache: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def topo_plan(self) -> TransferPlan:
        if self._plan is None:
            self._plan = plan_transfers(
                self.topology,
                (),
                TransferOptions(probe=self.measured.probe, default_link_gen=self.link_gen),
            )
        return self._plan

    def pair(self, a: int, b: int) -> tuple[float, float, str]:
        n = self.topology.num_gpus
        if a >= n or b >= n or a == b:
            return 25.0, 1.0, "no such pair in the topology: 25 GB/s, 1 µs assumed"
        p = self.topo_plan.pair(a, b)
        return (
            p.gbps,
            p.latency_us,
            f"GPU{a}->GPU{b} {p.transport} {p.gbps:.1f} GB/s ({p.estimate})",
        )

    def cost(self, cfg: Config, tokens: int, env) -> cm.Cost:
        """One MoE layer's exchange (there and back) for ``tokens`` tokens in the stage."""
        key = (cfg.comm, cfg.tp, cfg.ep, cfg.attn_dp, cfg.redundant, cfg.payload, tokens)
        if key not in self._cache:
            self._cache[key] = self._cost(cfg, tokens, env)
        return self._cache[key]

    def _cost(self, cfg: Config, tokens: int, env) -> cm.Cost:
        m, g, t = env.model, env.gpu, env.tables
        n = cfg.tp
        per_rank = math.ceil(tokens / n)  # each EP rank sends its share of the tokens
        if cfg.comm == "ag-rs":
            size = tokens * m.hidden * 2.0
            ag = cm.nccl("all_gather", size, n, g, t)
            rs = cm.nccl("reduce_scatter", size, n, g, t)
            return cm.Cost(ag.us + rs.us, ag.kind, f"all_gather + reduce_scatter: {ag.source}")
        shape = (m.hidden, m.experts, m.top_k)
        if cfg.comm == "a2a-nccl":
            ex = self.measured.exchange("a2a", "bf16", n, shape)
            if ex is not None:
                return cm.Cost(ex.dispatch(per_rank) + ex.combine(per_rank), ex.kind, ex.source)
            load = env.load(cfg, tokens)
            size = per_rank * m.top_k * m.hidden * 2.0 * load.rows_factor
            a = cm.nccl("alltoall", size, n, g, t)
            return cm.Cost(
                2 * a.us, a.kind, f"2 x alltoall, a row per token and expert: {a.source}"
            )
        if cfg.comm != "pcie_a2a":
            raise ValueError(f"no exchange for comm {cfg.comm!r}")
        ex = self.measured.exchange("pcie_a2a", cfg.payload, n, shape)
        if ex is None and self.measured.exchanges.get(("pcie_a2a", cfg.payload)) is not None:
            self.notes.append(
                "the measured pcie_a2a exchanges were taken on another shape or world: modelled"
            )
        if ex is not None:
            return cm.Cost(ex.dispatch(per_rank) + ex.combine(per_rank), ex.kind, ex.source)
        return self._planned(cfg, per_rank, env)

    def _planned(self, cfg: Config, per_rank: int, env) -> cm.Cost:
        m = env.model
        n, total = cfg.tp, self.topology.num_gpus
        if n > total:
            raise ValueError(f"EP {n} on a topology of {total} GPUs")
        hit = rank_hit_probability(env.routing, place(env.routing, n, cfg.redundant), m.top_k)
        d_row, c_row = row_bytes(m.hidden, m.top_k, cfg.payload)
        us = self.planned_us(n, per_rank, hit, d_row, c_row) + 2 * env.tables.pcie_a2a_call_us
        return cm.Cost(
            us,
            "model",
            f"topology planner (pair numbers: {self.pair_numbers()}), {cfg.payload} dispatch, + "
            f"2 x {env.tables.pcie_a2a_call_us:g} µs per call ({env.tables.pcie_a2a_call_source})",
        )

    def planned_us(self, n: int, rows: float, hit, d_row: float, c_row: float) -> float:
        """The topology planner's dispatch + combine on GPUs 0..n-1: each sends ``rows`` rows
        to each other rank d with probability ``hit[d]``, ``d_row`` bytes out, ``c_row`` back."""
        total = self.topology.num_gpus

        def matrix(row: float) -> tuple[tuple[float, ...], ...]:
            return tuple(
                tuple(
                    rows * hit[d] * row if s < n and d < n and s != d else 0.0 for d in range(total)
                )
                for s in range(total)
            )

        traffic = [Traffic("dispatch", matrix(d_row)), Traffic("combine", matrix(c_row))]
        return sum(r.predicted_us for r in with_reports(self.topo_plan, traffic).reports)

    def pair_numbers(self) -> str:
        pairs = self.topo_plan.pairs
        probed = sum(1 for q in pairs if q.estimate == "probe")
        if probed == 0:
            return "the planner's table"
        return f"measured for {probed} of {len(pairs)} pairs ({self.measured.probe_source})"
