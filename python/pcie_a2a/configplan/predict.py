"""The step model: the time of one decode step (or one prefill chunk) of a configuration,
term by term, on the busiest GPU of each pipeline stage.

Each compute term is a roofline, ``max(bytes / (bandwidth x memory_efficiency),
flops / (peak x tensor_efficiency))``, except the routed experts, which take one
expert-GEMM cost per weight format (:mod:`.experts`: the INT4 kernel's grid model for INT4
experts on a GPU it knows, else the roofline divided by the GEMM efficiency at their rows
per expert). Communication terms come from :mod:`.comm` and
:mod:`.exchange`, each collective from its table. Overheads sit where they occur:
``launch`` is the kernels a stage runs (counted per layer, below) times the gap one launch
leaves (graph replay or eager, :mod:`.tables`); ``framework`` is the stack's host time per
forward pass and per request in it, once per micro-batch, on the first stage (the
scheduler feeds the pipeline). A pipeline of ``pp`` stages runs ``min(pp, C)`` micro-batches:
time per output token is the larger of one trip through all stages and ``micro-batches x
slowest stage``; ``bubble`` is what that leaves idle on the average stage. With the
stack's MTP part (:class:`.stacks.Mtp`) a decode step runs each request's token and its
drafts as rows and emits ``accept_len`` tokens per request: time per output token is the
step over ``accept_len``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..gpus import Gpu
from . import comm as cm
from .configs import Config
from .exchange import Exchanges
from .experts import experts_time
from .imbalance import Routing, place, rank_load
from .memory import ceil_div, dense_split, stage_layers
from .models import ModelShape, WeightFormat
from .stacks import Stack
from .tables import Tables

TERMS = ("attention", "experts", "shared", "comm", "imbalance", "other", "launch", "framework")

# Kernels of one decode layer outside its collectives (each collective's table holds its
# own launch), counted in the frameworks' DeepSeek-style decode path: attention = fused
# add + RMSNorm, fused q_a/kv_a projection, q_a and kv_a norms, q_b projection, the
# q_nope absorb, rope, cache write, the decode attention kernel and its merge, the v
# absorb, o projection; MoE = fused add + RMSNorm, router GEMM, top-k, align/sort, two
# expert GEMMs, activation, sum, and the shared expert's gate/up, activation, down, add.
# Dense MLP = norm, gate/up, activation, down. Per step: embedding, final norm, LM head,
# sampling (softmax, top-p/k, argmax/gather).
KERNELS_ATTENTION = 12
KERNELS_MOE = 12
KERNELS_DENSE = 4
KERNELS_STEP = 5


@dataclass
class Env:
    model: ModelShape
    gpu: Gpu
    stack: Stack
    tables: Tables
    routing: Routing
    context: int
    kv_bytes: float
    exchanges: Exchanges
    _loads: dict = field(default_factory=dict)
    held_context: int | None = None  # tokens a request holds at its end (default: context)

    @property
    def held(self) -> int:
        return self.context if self.held_context is None else self.held_context

    def compute_dtype(self, fmt: WeightFormat) -> str:
        if fmt.kind == "fp8" and self.gpu.has("fp8"):
            return "fp8"
        return "bf16"

    def roofline(self, nbytes: float, flops: float, dtype: str) -> float:
        t = self.tables
        mem = nbytes / (self.gpu.bandwidth_gbps * 1e3 * t.memory_efficiency)
        fl = flops / (self.gpu.peak_tflops(dtype) * 1e6 * t.tensor_efficiency)
        return max(mem, fl)

    def load(self, cfg: Config, tokens: int):
        key = (cfg.ep, cfg.redundant, tokens)
        if key not in self._loads:
            placement = place(self.routing, cfg.ep, cfg.redundant)
            self._loads[key] = rank_load(self.routing, placement, self.model.top_k, tokens)
        return self._loads[key]


@dataclass(frozen=True)
class Step:
    """One decode step (all pipeline stages) of ``concurrency`` requests."""

    concurrency: int
    terms: dict[str, float]  # µs, summed over the stages a token passes
    tpot_us: float
    tok_s: float
    sources: dict[str, tuple[str, str]]  # communication terms, experts -> (kind, source)
    micro_batches: int
    bubble_us: float = 0.0  # per step, the average stage's idle time (pipeline bubble)
    # bytes the busiest GPU of each stage streams per step, summed over the stages:
    # "weights" (all but the routed experts), "experts" (the busiest rank's), "kv"
    bytes_read: dict[str, float] = field(default_factory=dict)
    rows_per_request: int = 1  # 1 + the draft tokens a step verifies (MTP)
    tokens_per_step: float = 1.0  # output tokens per request per step (MTP: accept_len)

    @property
    def total_us(self) -> float:
        """One step (with MTP it emits ``tokens_per_step`` tokens per request)."""
        return sum(self.terms.values())


def _stage(
    env: Env,
    cfg: Config,
    stage: int,
    tokens: int,
    ctx: int,
    src: dict,
    requests: int,
    prefill: bool = False,
    rows_per_request: int = 1,
    read: dict | None = None,
) -> dict:
    """Terms (µs) of one stage for ``tokens`` rows (of ``requests`` requests) in flight;
    ``rows_per_request`` > 1: each request's rows are its token and the draft tokens it
    verifies (MTP), which read its KV cache once. Adds the bytes streamed to ``read``."""
    m, g = env.model, env.gpu
    at, ad, st = cfg.attn_tp, cfg.attn_dp, env.stack
    n, n_moe = stage_layers(m, cfg.pp)[stage]
    b_att = ceil_div(tokens, ad)  # rows on the busiest attention group
    b_kv = ceil_div(tokens // rows_per_request, ad)  # the caches those rows read
    read = {} if read is None else read
    h = m.hidden
    t = dict.fromkeys(TERMS, 0.0)

    # attention: weights, KV cache read at the context, projections + core FLOPs
    w = m.attention_bytes(at)
    # DCP: each of dcp ranks holds and reads 1/dcp of every request's cache (for the heads
    # of its dcp group, the FLOPs per rank unchanged)
    kvb = 1.0 if cfg.kv_fp8 else env.kv_bytes
    kv = b_kv * ctx * m.kv_bytes_per_token(at, kvb) / cfg.dcp
    flops = 2.0 * b_att * m.attention_params_per_rank(at)
    flops += b_att * ctx * m.attention_flops_per_context_token() / at
    t["attention"] = n * env.roofline(w + kv, flops, env.compute_dtype(m.fmt("attention")))
    weights = n * w + n_moe * m.router_bytes()
    read["kv"] = read.get("kv", 0.0) + n * kv

    # activations outside the GEMMs, router, dense layers
    act = env.tables.activation_passes * b_att * h * 2.0
    other = n * env.roofline(act, 0.0, "bf16")
    other += n_moe * env.roofline(m.router_bytes(), 2.0 * b_att * h * m.experts, "bf16")
    if n > n_moe:
        dense = m.mlp_bytes(m.dense_intermediate, "dense") / at
        fl = 2.0 * b_att * 3 * h * m.dense_intermediate / at
        other += (n - n_moe) * env.roofline(dense, fl, env.compute_dtype(m.fmt("dense")))
        weights += (n - n_moe) * dense

    # routed experts on the busiest EP rank, and what the average rank would take
    load = env.load(cfg, tokens) if n_moe else None
    if load is not None and tokens:
        mean, model, how = experts_time(env, cfg, load.mean_experts, load.mean_rows, prefill)
        busy, model_busy, how_busy = experts_time(
            env, cfg, load.max_experts, load.max_rows, prefill
        )
        busy = max(busy, mean)
        t["experts"] = n_moe * mean
        t["imbalance"] = n_moe * (busy - mean)
        if not model or model_busy in ("", model):
            src["experts"] = ("model", how or how_busy)
        else:  # the busiest rank's rows cross into the other model's regime
            src["experts"] = ("model", f"mean rank: {how}; busiest rank: {how_busy}")
        eb = n_moe * load.max_experts * m.expert_bytes() / cfg.moe_tp
        read["experts"] = read.get("experts", 0.0) + eb
        if m.shared_intermediate:
            ds = dense_split(cfg, st.framework)
            rows = b_att if ds == at else tokens  # SGLang: the gathered batch over all TP
            sb = m.mlp_bytes(m.shared_intermediate, "shared") / ds
            fl = 2.0 * rows * 3 * h * m.shared_intermediate / ds
            t["shared"] = n_moe * env.roofline(sb, fl, env.compute_dtype(m.fmt("shared")))
            weights += n_moe * sb

    # embedding (a row per token) and LM head with its logits gather
    if stage == 0:
        other += env.roofline(b_att * h * 2.0, 0.0, "bf16")
    if stage == cfg.pp - 1:
        ds = dense_split(cfg, st.framework)
        rows = b_att if ds == at else tokens
        fl = 2.0 * rows * m.vocab * h / ds
        other += env.roofline(m.lm_head_bytes() / ds, fl, env.compute_dtype(m.fmt("lm_head")))
        weights += m.lm_head_bytes() / ds
        gather = cm.nccl("all_gather", b_att * m.vocab * 2.0, at, g, env.tables)
        t["comm"] += gather.us
        if at > 1:
            src["logits gather"] = (gather.kind, gather.source)
    t["other"] = other
    read["weights"] = read.get("weights", 0.0) + weights

    # communication per layer
    if cfg.dcp > 1:
        # vLLM's and SGLang's default DCP exchange (ag_rs): all-gather the queries of the
        # dcp group's heads, reduce-scatter the partial outputs (+ fp32 log-sum-exp)
        heads = m.heads / at * cfg.dcp
        q = b_att * heads * m.kv_bytes_per_token(1, 2.0)
        o = b_att * heads * (m.kv_lora_rank * 2.0 + 4.0)
        ag = cm.nccl("all_gather", q, cfg.dcp, g, env.tables)
        rs = cm.nccl("reduce_scatter", o, cfg.dcp, g, env.tables)
        t["comm"] += n * (ag.us + rs.us)
        src["dcp"] = (ag.kind, f"DCP all_gather + reduce_scatter per layer: {ag.source}")
    hid = b_att * h * 2.0
    ar = cm.all_reduce(hid, at, g, env.tables, st.allreduce)
    if cfg.comm in ("tp", "allreduce"):
        t["comm"] += 2 * n * ar.us
        if at > 1:
            src["all-reduce"] = (ar.kind, ar.source)
    else:
        if at > 1:  # inside a DP group: attention output + MoE output consistency
            t["comm"] += 2 * n * ar.us
            src["all-reduce"] = (ar.kind, ar.source)
        if n_moe and tokens:
            ex = env.exchanges.cost(cfg, tokens, env)
            t["comm"] += n_moe * ex.us
            src[cfg.comm] = (ex.kind, ex.source)
    kernels = n * KERNELS_ATTENTION + n_moe * KERNELS_MOE + (n - n_moe) * KERNELS_DENSE
    if stage == cfg.pp - 1:
        kernels += KERNELS_STEP
    tb = env.tables
    gap = tb.kernel_gap_graph_us if st.graphs(cfg) else tb.kernel_gap_eager_us
    t["launch"] = kernels * gap
    if stage == 0:  # each DP group's scheduler runs in parallel: the busiest one counts
        t["framework"] = st.step_us + st.request_us * ceil_div(requests, ad)
    return t


def _pp_send(env: Env, cfg: Config, stage: int, tokens: int, src: dict) -> float:
    if cfg.pp == 1:
        return 0.0
    a = stage * cfg.tp
    b = ((stage + 1) % cfg.pp) * cfg.tp
    size = tokens * env.model.hidden * 2.0 if stage < cfg.pp - 1 else tokens * 8.0
    gbps, lat, where = env.exchanges.pair(a, b)
    c = cm.p2p_send(size, gbps, lat, env.tables, where)
    src["pp send"] = (c.kind, c.source)
    return c.us


def step(
    env: Env,
    cfg: Config,
    concurrency: int,
    ctx: int | None = None,
    requests: int | None = None,
    prefill: bool = False,
) -> Step:
    """Decode step of ``concurrency`` tokens (one per request unless ``requests`` says) at
    the environment's decode context (or ``ctx``); ``prefill``: a prefill chunk. With the
    stack's MTP part a decode step runs each request's token and its ``draft_tokens``
    drafts as rows (weights read once, each cache once) and emits ``accept_len`` tokens per
    request: the time per output token is the step over ``accept_len``."""
    ctx = env.context if ctx is None else ctx
    requests = concurrency if requests is None else requests
    mtp = None if prefill else env.stack.mtp
    q = 1 + mtp.draft_tokens if mtp else 1
    emitted = mtp.accept_len if mtp else 1.0
    mb = min(cfg.pp, max(concurrency, 1))
    tokens = ceil_div(concurrency, mb) * q
    src: dict[str, str] = {}
    read: dict[str, float] = {}
    totals = dict.fromkeys(TERMS, 0.0)
    slowest = 0.0
    for s in range(cfg.pp):
        t = _stage(env, cfg, s, tokens, ctx, src, ceil_div(requests, mb), prefill, q, read)
        t["comm"] += _pp_send(env, cfg, s, tokens, src)
        slowest = max(slowest, sum(t.values()))
        for k, v in t.items():
            totals[k] += v
    trip = sum(totals.values())
    step_us = max(trip, mb * slowest)
    bubble = step_us - mb * trip / cfg.pp  # idle time of the average stage per step
    tpot = step_us / emitted
    return Step(
        concurrency, totals, tpot, concurrency / tpot * 1e6, src, mb, bubble, read, q, emitted
    )


def prefill(env: Env, cfg: Config, chunk: int) -> Step:
    """One prefill chunk of ``chunk`` tokens of one request (causal: on average chunk / 2
    tokens of context each). ``tok_s`` is prefill tokens per second."""
    return step(env, cfg, chunk, ctx=chunk // 2, requests=1, prefill=True)
