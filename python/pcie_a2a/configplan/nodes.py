"""``pcie-a2a plan --nodes N --nic SPEC``: N nodes of the box the topology describes, joined
by the NICs SPEC names, and the configurations that span them.

The inter-node hop is NCCL's (issue 22: our multi-node Buffer sends between nodes through
NCCL's host API, the one engine that runs with or without GPUDirect RDMA). Per exchange and
node it costs

* ``latency``: NCCL rounds x ``internode_latency_us`` (a cited small-message send/recv
  time); an exchange of the multi-node Buffer is two rounds, the 16-byte header per peer
  (status, rows) and then the rows (docs/internode.md),
* ``wire``: the bytes leaving (or entering: the busier) the node over the node's NCCL
  bandwidth, ``count x min(line rate x nic_efficiency, nic_nogdr_cap_gbps without GDR)``:
  the one measured anchor is 15 GB/s for 2 x 100G RoCE without GDR; other classes scale
  from their line rate and are labelled assumed,
* ``bounce`` (no GDR only): NCCL stages through pinned host memory, so each byte also
  crosses the sending GPU's PCIe link to the host and the receiving GPU's link back; each
  GPU moves its own rows on its own link, in parallel, counted on top of the wire (the
  anchor's large-message figure already hides part of it: this errs slow).

Bytes come from the multi-node Buffer's protocol: a token crosses once per other node that
holds one of its experts (one dispatch wire row there), and one fp32 row (4H bytes) per
(token, node) comes back, each after the node's own exchange (the topology planner, as for
one box); the flat comparisons send a row per (token, expert) (bf16 both ways, the bench's
``a2a``) or per (token, rank) (pcie_a2a's flat Buffer).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

import numpy as np

from pcie_a2a.buffer_memory import combine_slot_bytes, dispatch_slot_bytes

from . import comm as cm
from .configs import Config
from .exchange import Exchanges
from .imbalance import Routing, pick_probabilities, place, rank_hit_probability
from .run import CONCURRENCIES, Result, evaluate, under_cap
from .tables import Tables

# the header every rail exchange starts with, per peer (int32 status, rows, culprit, 0):
# internode/buffer.py HEADER_BYTES, which imports torch; tests/test_plan_nodes.py ties them
HEADER_BYTES = 16
NIC_RATES = (10, 25, 40, 50, 100, 200, 400, 800)  # Gb/s per port
NIC_KINDS = {"roce": "RoCE", "ib": "InfiniBand", "eth": "Ethernet (NCCL sockets)"}
_SPEC = re.compile(r"([1-8])x(\d+)g-(roce|ib|eth)(?:-(gdr|nogdr))?")
_FORM = (
    "COUNTxRATEg-KIND[-gdr|-nogdr]: COUNT 1-8 NICs per node, RATE in Gb/s one of "
    + ", ".join(map(str, NIC_RATES))
    + ", KIND roce, ib or eth, nogdr (no GPUDirect RDMA, as on GeForce cards) by default; "
    "e.g. 2x100g-roce, 1x400g-ib-gdr, 1x25g-eth"
)
_ANCHOR = (2, 100, "roce", False)  # the measured anchor's NICs (tables.nic_efficiency)

NOT_BUILT = (
    "pcie_a2a does not span nodes on GPUs yet: its CUDA inter-node stage (NCCL between "
    "nodes, per-node packing kernels) is not built, and SGLang/vLLM servers across nodes are "
    "refused at launch on GPUs (the CPU path runs, docs/internode.md); predicted as what "
    "that design would give"
)


@dataclass(frozen=True)
class Nic:
    count: int
    gbit: int  # per NIC, Gb/s
    kind: str  # roce, ib, eth
    gdr: bool
    spec: str

    @property
    def line_gbps(self) -> float:
        """All the node's NICs together, GB/s per direction."""
        return self.count * self.gbit / 8.0

    @property
    def label(self) -> str:
        gdr = "GPUDirect RDMA" if self.gdr else "no GPUDirect RDMA"
        return f"{self.count} x {self.gbit} Gb/s {NIC_KINDS[self.kind]}, {gdr}"


def parse_nic(spec: str) -> Nic:
    """``--nic SPEC``, strictly (:data:`_FORM`)."""
    m = _SPEC.fullmatch(spec.strip().lower()) if isinstance(spec, str) else None
    if m is None or int(m.group(2)) not in NIC_RATES:
        raise ValueError(f"--nic: got {spec!r}; allowed: {_FORM}")
    kind, gdr = m.group(3), m.group(4) == "gdr"
    if kind == "eth" and gdr:
        raise ValueError(
            f"--nic: got {spec!r}; allowed: eth without gdr (NCCL's socket transport has no "
            "GPUDirect RDMA: use roce or ib for gdr)"
        )
    return Nic(int(m.group(1)), int(m.group(2)), kind, gdr, spec.strip().lower())


def node_gbps(nic: Nic, t: Tables) -> tuple[float, str, str]:
    """(GB/s per node and direction, kind, source) of NCCL between two nodes."""
    per = nic.gbit / 8.0 * t.nic_efficiency
    capped = not nic.gdr and per > t.nic_nogdr_cap_gbps
    if not nic.gdr:
        per = min(per, t.nic_nogdr_cap_gbps)
    gbps = nic.count * per
    default = Tables()
    anchor = (nic.count, nic.gbit, nic.kind, nic.gdr) == _ANCHOR and (
        t.nic_efficiency_source == default.nic_efficiency_source
        and t.nic_nogdr_cap_source == default.nic_nogdr_cap_source
    )
    how = (
        f"{nic.count} x min({nic.gbit / 8:g} GB/s x {t.nic_efficiency:g}, "
        f"{t.nic_nogdr_cap_gbps:g} without GDR)"
        if capped
        else f"{nic.count} x {nic.gbit / 8:g} GB/s x {t.nic_efficiency:g}"
    )
    if anchor:
        return gbps, "measured", f"{how}: {t.nic_efficiency_source}"
    src = f"{how}, scaled from the line rate: {t.nic_efficiency_source}"
    if capped:
        src += f"; cap: {t.nic_nogdr_cap_source}"
    return gbps, "assumed", src


@dataclass(frozen=True)
class Hop:
    """One inter-node exchange on the busiest node, µs by part."""

    latency_us: float
    wire_us: float
    bounce_us: float

    @property
    def us(self) -> float:
        return self.latency_us + self.wire_us + self.bounce_us


def hop(node_bytes: float, gpu_bytes: float, rounds: int, nic: Nic, gpu, t: Tables) -> Hop:
    """``node_bytes`` through the node's NICs, ``gpu_bytes`` of them from (and to) one GPU."""
    if node_bytes <= 0:
        return Hop(0.0, 0.0, 0.0)
    gbps = node_gbps(nic, t)[0]
    bounce = 0.0 if nic.gdr else 2.0 * gpu_bytes / (cm.link_gbps(gpu) * 1e3)
    return Hop(rounds * t.internode_latency_us, node_bytes / (gbps * 1e3), bounce)


@dataclass(frozen=True)
class Crossing:
    """Expected rows per token to other nodes, on the busiest node (the larger of what
    one node sends and what one receives), with the experts in contiguous blocks."""

    node_rows: float  # multi-node Buffer: one per other node holding one of its experts
    expert_rows: float  # flat per-expert all-to-all: one per expert on another node
    rank_rows: float  # flat pcie_a2a: one per rank on another node holding one
    local_hit: tuple[float, ...]  # P(a token hits rank r) for the busiest node's ranks


def crossing(routing: Routing, k: int, nodes: int, per_node: int) -> Crossing:
    n = nodes

    def busiest(p_dest: list[float]) -> tuple[float, int]:
        # a token of node s goes to each d != s with p_dest[d] (routing does not depend on
        # the source); node s sends sum_{d != s} p[d], node d receives (n - 1) p[d]
        total = sum(p_dest)
        loads = [max(total - p, (n - 1) * p) for p in p_dest]
        b = max(range(n), key=lambda i: loads[i])
        return loads[b], b

    node_p = rank_hit_probability(routing, place(routing, n), k)
    rank_p = rank_hit_probability(routing, place(routing, n * per_node), k)
    per_rank = [sum(rank_p[d * per_node : (d + 1) * per_node]) for d in range(n)]
    picks = pick_probabilities(np.asarray(routing.share, dtype=np.float64), k)
    block = routing.experts // n
    per_expert = [float(picks[d * block : (d + 1) * block].sum()) for d in range(n)]
    node_rows, b = busiest(node_p)
    lo = b * per_node
    return Crossing(
        node_rows,
        busiest(per_expert)[0],
        busiest(per_rank)[0],
        tuple(rank_p[lo : lo + per_node]),
    )


@dataclass(frozen=True)
class LayerTraffic:
    """One MoE layer of one decode step, ``tokens_per_rank`` tokens on each EP rank:
    bytes leaving the busiest node per exchange, and the times."""

    concurrency: int
    tokens_per_rank: int
    node_rows: float  # per token (dedup)
    dispatch_bytes: float  # multi-node Buffer, headers included
    combine_bytes: float
    flat_expert_bytes: float  # each way
    flat_rank_bytes: tuple[float, float]  # dispatch, combine
    dispatch_hop: Hop
    combine_hop: Hop
    intra_us: float  # the node's own dispatch + combine (topology planner)
    flat_expert_hop_us: float  # both ways, inter-node part only
    flat_rank_hop_us: float
    call_us: float

    @property
    def layer_us(self) -> float:
        return self.dispatch_hop.us + self.combine_hop.us + self.intra_us + self.call_us


@dataclass
class NodeExchanges(Exchanges):
    """:class:`.exchange.Exchanges` for N nodes of the box: pcie_a2a over all N x G ranks
    is the multi-node Buffer (inter-node hop + the node's own exchange), GPU pairs on two
    nodes are the NIC."""

    nodes: int = 1
    per_node: int = 1
    nic: Nic | None = None
    env: object | None = None  # the nodes' Env (pair() needs its tables and GPU)
    _traffic: dict = field(default_factory=dict)

    def pair(self, a: int, b: int) -> tuple[float, float, str]:
        g = self.per_node
        if a // g == b // g:
            return super().pair(a % g, b % g)
        t, gpu = self.env.tables, self.env.gpu
        gbps, _, _ = node_gbps(self.nic, t)
        if not self.nic.gdr:  # + the bounce through host memory at each end
            gbps = 1.0 / (1.0 / gbps + 2.0 / cm.link_gbps(gpu))
        where = (
            f"node {a // g} -> node {b // g} over {self.nic.spec}: {gbps:.1f} GB/s"
            + ("" if self.nic.gdr else " with the host bounce")
            + f", {t.internode_latency_us:g} µs NCCL round (assumed; docs/plan.md)"
        )
        return gbps, t.internode_latency_us, where

    def _cost(self, cfg: Config, tokens: int, env) -> cm.Cost:
        if cfg.comm != "pcie_a2a" or cfg.tp != self.nodes * self.per_node:
            return super()._cost(cfg, tokens, env)
        lt = self.layer(tokens, env, cfg.payload)
        return cm.Cost(
            lt.layer_us,
            "model",
            f"multi-node Buffer: NCCL hop over {self.nic.spec} (dispatch + combine, "
            f"{node_gbps(self.nic, env.tables)[1]} NIC numbers) + the node's exchange "
            f"(topology planner, {self.pair_numbers()}) + 2 x {env.tables.pcie_a2a_call_us:g} µs",
        )

    def layer(self, tokens: int, env, payload: str, concurrency: int = 0) -> LayerTraffic:
        key = (tokens, payload, concurrency)
        if key not in self._traffic:
            self._traffic[key] = self._layer(tokens, env, payload, concurrency or tokens)
        return self._traffic[key]

    def _layer(self, tokens: int, env, payload: str, concurrency: int) -> LayerTraffic:
        m, t, gpu = env.model, env.tables, env.gpu
        n, g = self.nodes, self.per_node
        per_rank = math.ceil(tokens / (n * g))
        x = crossing(env.routing, m.top_k, n, g)
        d_row = dispatch_slot_bytes(m.hidden, m.top_k, payload)
        c_row = combine_slot_bytes(m.hidden)
        heads = g * (n - 1) * HEADER_BYTES
        rows = g * per_rank * x.node_rows
        disp = rows * d_row + heads
        comb = rows * 4.0 * m.hidden + heads  # the node's fp32 partial sum per (token, node)
        flat_e = g * per_rank * x.expert_rows * 2.0 * m.hidden
        flat_r = (g * per_rank * x.rank_rows * d_row, g * per_rank * x.rank_rows * c_row)
        nic = self.nic
        d_hop = hop(disp, disp / g, 2, nic, gpu, t)
        c_hop = hop(comb, comb / g, 2, nic, gpu, t)
        fe = 2 * hop(flat_e, flat_e / g, 1, nic, gpu, t).us
        fr = sum(hop(b, b / g, 1, nic, gpu, t).us for b in flat_r)
        return LayerTraffic(
            concurrency,
            per_rank,
            x.node_rows,
            disp,
            comb,
            flat_e,
            flat_r,
            d_hop,
            c_hop,
            self._intra(per_rank * n, x.local_hit, d_row, c_row) if per_rank else 0.0,
            fe,
            fr,
            2 * t.pcie_a2a_call_us,
        )

    def _intra(self, rows_per_rank: int, hit, d_row: float, c_row: float) -> float:
        """The node's own exchange: each rank passes its tokens and the ones its rail
        peers forwarded (``rows_per_rank`` = tokens x nodes in expectation: a forwarded
        token hits local rank r with P(r) / P(node)), to each local rank it hits."""
        return self.planned_us(self.per_node, rows_per_rank, hit, d_row, c_row)


@dataclass
class NodesPlan:
    nodes: int
    per_node: int
    nic: Nic
    gbps: float
    gbps_kind: str
    gbps_source: str
    traffic: list[LayerTraffic]
    results: list[Result]
    refused: list[tuple[str, str]]
    not_evaluated: list[str]
    assumed: list[str]
    replicas: tuple[str, int, float] | None  # one box's recommendation: name, C, tok/s
    env: object = None  # the nodes' Env (its exchanges: NodeExchanges)

    @property
    def gpus(self) -> int:
        return self.nodes * self.per_node


def candidates(nodes: int, per_node: int, payload: str) -> list[Config]:
    """EP over all N x G GPUs (pcie_a2a's multi-node Buffer) with TP attention inside a node
    and DP attention across nodes, or DP attention on every GPU; PP with one stage per
    node (the frameworks' own way across nodes), with and without EP inside the stage."""
    w = nodes * per_node
    out = [
        Config(w, 1, nodes, w, "pcie_a2a", 0, payload),
        Config(w, 1, w, w, "pcie_a2a", 0, payload),
        Config(per_node, nodes),
    ]
    if per_node > 1:
        out.append(Config(per_node, nodes, 1, per_node, "allreduce"))
    return out


def evaluate_nodes(
    env, per_node: int, nodes: int, nic: Nic, payload: str, cap_ms: float, box_best=None
) -> NodesPlan:
    t = env.tables
    base = env.exchanges
    ex = NodeExchanges(
        base.topology, base.measured, base.link_gen, base.topo_plan, nodes=nodes,
        per_node=per_node, nic=nic,
    )  # fmt: skip
    nenv = replace(env, exchanges=ex, _loads={})
    ex.env = nenv
    gbps, kind, source = node_gbps(nic, t)
    results = []
    for cfg in candidates(nodes, per_node, payload):
        r = evaluate(nenv, cfg, nodes * per_node, cap_ms=cap_ms)
        if cfg.comm == "pcie_a2a":
            for fw in r.reasons:
                r.reasons[fw].append(NOT_BUILT)
        results.append(r)
    q = 1 + env.stack.mtp.draft_tokens if env.stack.mtp else 1
    traffic = []  # the multi-node Buffer's contiguous placement needs E % (N x G) == 0
    if env.model.experts % (nodes * per_node) == 0:
        traffic = [ex.layer(c * q, nenv, payload, c) for c in CONCURRENCIES]
    if nic.gdr:
        why = (
            "need NVLink (or xGMI) inside the node besides GPUDirect RDMA between nodes; none "
            "is validated on PCIe-only boxes or sm_120 (research/field_2026.md s9)"
        )
    else:
        why = (
            f"need GPUDirect RDMA between nodes ({nic.spec} says none: GeForce cards have none) "
            "and most of them NVLink inside the node (research/field_2026.md s9)"
        )
    refused = [
        (
            "DeepEP, UCCL-EP, pplx-garden, Mooncake EP, NCCL EP across nodes (SGLang "
            "--moe-a2a-backend deepep / mooncake, vLLM's DeepEP backends)",
            why,
        )
    ]
    m = env.model
    floor = 2 * m.layers * t.internode_latency_us / 1e3
    not_evaluated = [
        f"TP{nodes * per_node} across the nodes and DP attention + EP AG/RS across the nodes: "
        "the frameworks run them, this plan does not model them; each layer's collectives "
        f"would cross the NIC, at least 2 x {m.layers} layers x {t.internode_latency_us:g} µs "
        f"= {floor:.1f} ms of NCCL rounds per step before any byte moves"
    ]
    assumed = [
        f"the nodes: {nodes} x this box ({per_node} GPUs each), joined by {nic.label} per "
        f"node ({nic.spec}): NCCL {gbps:.1f} GB/s per node and direction (NIC line below)",
        "no inter-node number has been measured on these boxes (no published cross-node EP "
        "latency exists for PCIe-only RTX boxes, research/field_2026.md s9), and pcie_a2a's "
        "NCCL stage is not built: every figure across nodes is a prediction from other boxes' "
        "NIC numbers",
        "NCCL's all_reduce figures may come from its tree algorithm, which crosses the network "
        "once per byte where the ring does 2(n-1)/n times (the GDR figure on the anchor's "
        "network, 28 GB/s, is above its 25 GB/s line rate): the wire may be up to 2x slower "
        "than taken",
    ]
    if not nic.gdr:
        assumed.append(
            "no GPUDirect RDMA: every byte also crosses each end's GPU link to host memory "
            f"(PCIe Gen{env.gpu.pcie_gen} x16, {cm.link_gbps(env.gpu):g} GB/s per direction, "
            "each GPU its own; shared switch uplinks not modelled), counted on top of the wire"
        )
    replicas = None
    if box_best is not None:
        c, tok = under_cap(box_best, cap_ms)
        replicas = (box_best.config.name, c, tok)
    return NodesPlan(
        nodes,
        per_node,
        nic,
        gbps,
        kind,
        source,
        traffic,
        results,
        refused,
        not_evaluated,
        assumed,
        replicas,
        nenv,
    )


def multinode_flags(framework: str, nodes: int) -> str:
    """What each node's launch line adds (NODE_RANK 0 .. nodes - 1, HEAD_IP node 0's)."""
    if framework == "sglang":
        return f"--nnodes {nodes} --node-rank $NODE_RANK --dist-init-addr $HEAD_IP:5000"
    return f"--nnodes {nodes} --node-rank $NODE_RANK --master-addr $HEAD_IP"
