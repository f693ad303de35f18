"""`pcie-a2a plan`: each cost term against a hand calculation (Kimi K2.6 on 8x RTX PRO 6000
unless stated), the tables' interpolation, and the load-imbalance estimate against a
seeded Monte Carlo of top-k routing."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

from pcie_a2a.configplan import comm
from pcie_a2a.configplan.calibrate import calibration_env
from pcie_a2a.configplan.configs import Config
from pcie_a2a.configplan.exchange import Exchanges, dispatch_row_bytes
from pcie_a2a.configplan.imbalance import (
    from_counts,
    pick_probabilities,
    place,
    rank_hit_probability,
    rank_load,
    uniform,
    zipf,
)
from pcie_a2a.configplan.measured import Measured
from pcie_a2a.configplan.models import WeightFormat, load_model
from pcie_a2a.configplan.predict import step
from pcie_a2a.configplan.stacks import STACKS, Mtp
from pcie_a2a.configplan.tables import KB, MB, Curve, Tables
from pcie_a2a.configplan.topo import synthetic_topology
from pcie_a2a.gpus import GPUS
from pcie_a2a.quant import grid_model
from pcie_a2a.topology import Traffic, expected_distinct_ranks, plan_transfers

H, I, L, E, K, V = 7168, 2048, 61, 384, 8, 163840
BW = 1792e3 * 0.85  # bytes per µs at the assumed memory efficiency
PRO = GPUS["rtx-pro-6000"]


@pytest.fixture(scope="module")
def kimi():
    return load_model("kimi-k2.6")


def env_for(
    stack: str = "vllm-tuned", step_us: float = 0.0, request_us: float = 0.0, mtp=None, **kw
):
    s = replace(STACKS[stack], step_us=step_us, request_us=request_us)
    if mtp is not None:
        s = replace(s, mtp=mtp)
    return replace(calibration_env(s, Tables()), **kw)


# Kimi K2.6's routed experts on one of 8 EP ranks, from its config.json (hidden 7168,
# moe_intermediate 2048, 384 experts / 8 ranks, top-8, INT4 group 32); the low-latency
# receive buffer holds 8 ranks x 8192 tokens (vLLM's chunk, which its launch line sets as
# PCIE_A2A_MAX_TOKENS_PER_RANK)
EP8_SHAPE = grid_model.Shape(
    hidden=7168, intermediate=2048, local_experts=48, topk=8, group=32, ll_rows=8 * 8192
)


def grid_us(active: float, shape, layout: str, rows: int = 1) -> float:
    """The grid model's time for an expected number of experts: linear between the two
    whole numbers around it (docs/plan.md)."""
    lo = math.floor(active)
    t = [
        grid_model.predict("rtx_pro_6000", a, rows, shape=shape, layout=layout).time_us
        if a
        else 0.0
        for a in (lo, lo + 1)
    ]
    return t[0] + (active - lo) * (t[1] - t[0])


# kernels per step counted by hand from the frameworks' decode path (docs/plan.md): 12 for
# attention and 12 for a MoE layer (4 for a dense MLP), 5 per step (embedding, final norm,
# LM head, sampling); Kimi: 61 layers, 60 of them MoE
KIMI_KERNELS = 61 * 12 + 60 * 12 + 1 * 4 + 5


# ---- weights ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, k, want",
    [
        (WeightFormat("bf16"), 7168, 2.0),
        (WeightFormat("fp8"), 7168, 1 + 4 / 16384),
        (WeightFormat("int4", 32), 7168, 0.5 + 2 / 32),
        (WeightFormat("int4", 128, zeros=True), 7168, 0.5 + 2 / 128 + 0.5 / 128),
        (WeightFormat("int4", -1), 2048, 0.5 + 2 / 2048),
    ],
)
def test_bytes_per_weight(fmt, k, want):
    assert fmt.bytes_per_weight(k) == pytest.approx(want, rel=1e-12)


def test_bad_weight_format_names_the_argument():
    with pytest.raises(ValueError, match="weight format 'int3'"):
        WeightFormat("int3")
    with pytest.raises(ValueError, match="int4 group 3"):
        WeightFormat("int4", 3)


def test_kimi_weights_by_hand(kimi):
    # research/marlin_anchors.md s2.4: 24.77 MB per INT4 g32 expert, 9.51 GB per layer
    assert kimi.expert_bytes() == 3 * H * I * (0.5 + 2 / 32) == 24_772_608
    split, repl = kimi.attention_params()
    q_a, q_b = H * 1536, 1536 * 64 * 192
    kv_a, kv_b, o = H * (512 + 64), 512 * 64 * (128 + 128), 64 * 128 * H
    assert (split, repl) == (q_b + kv_b + o, q_a + kv_a)
    assert kimi.attention_bytes(8) == pytest.approx(2 * ((q_b + kv_b + o) / 8 + q_a + kv_a))
    assert kimi.fmt("experts").label == "int4-g32"
    assert {kimi.fmt(p).kind for p in ("attention", "shared", "dense", "lm_head")} == {"bf16"}
    # the checkpoint is ~594 GB (marlin_anchors s2.4); ours leaves out norms and biases
    text_only = kimi.total_weight_bytes() - kimi.extra_weight_bytes
    assert text_only == pytest.approx(594e9, rel=0.01)


def test_kv_cache_bytes(kimi):
    # MLA caches the latent (512) + rope key (64) once per token and layer, whatever the TP
    assert kimi.kv_bytes_per_token(1, 2.0) == kimi.kv_bytes_per_token(8, 2.0) == 1152
    qwen = load_model("qwen3-235b-a22b")  # 4 KV heads of 128
    assert qwen.kv_bytes_per_token(2, 2.0) == 2 * 2 * 128 * 2
    assert qwen.kv_bytes_per_token(8, 2.0) == 2 * 1 * 128 * 2  # replicated past 4 ranks
    assert qwen.kv_bytes_per_token(8, 1.0) == 2 * 128


# ---- the decode step, term by term ------------------------------------------------------------


def test_tp8_decode_terms_at_c1_by_hand(kimi):
    env = env_for(step_us=300.0, request_us=7.0)
    s = step(env, Config(8), 1)
    split, repl = kimi.attention_params()
    attn = L * 2 * (split / 8 + repl) / BW
    assert s.terms["attention"] == pytest.approx(attn, rel=1e-9)
    # one token touches 8 experts; MoE TP 8: each GPU holds a 1/8 slice (moe_intermediate
    # 2048 / 8 = 256) of all 384: pcie_a2a's INT4 kernel model for 8 experts of one row each
    tp8 = grid_model.Shape(hidden=7168, intermediate=256, local_experts=384, topk=8, group=32)
    one = grid_model.predict("rtx_pro_6000", 8, 1, shape=tp8, layout="normal").time_us
    assert s.terms["experts"] == pytest.approx(60 * one, rel=1e-9)
    # no faster than streaming the 8 slices at the spec DRAM bandwidth (gpus.py: 1792 GB/s)
    assert s.terms["experts"] >= 60 * 8 * 24_772_608 / 8 / 1792e3
    assert s.terms["imbalance"] == 0.0
    assert s.terms["shared"] == pytest.approx(60 * 3 * H * I * 2 / 8 / BW, rel=1e-9)
    ar = Tables().custom_ar8(H * 2)  # 14,336 B: 11.8 µs measured
    assert ar == pytest.approx(11.8)
    lo, hi = math.log(256 * KB), math.log(1 * MB)
    t = (math.log(V * 2) - lo) / (hi - lo)  # logits gather of 1 x vocab bf16, log-log
    gather = math.exp(math.log(45.4) + t * (math.log(76.9) - math.log(45.4)))
    assert s.terms["comm"] == pytest.approx(2 * L * ar + gather, rel=1e-6)
    assert KIMI_KERNELS == 1461
    assert s.terms["launch"] == pytest.approx(1461 * 2.5)  # graph replay: 2.5 µs a kernel
    assert s.terms["framework"] == pytest.approx(300.0 + 7.0)  # one forward, one request
    # other: dense layer 0, 60 routers, LM head (vocab-parallel), activations, embedding row
    other = 3 * H * 18432 * 2 / 8 + 60 * 2 * E * H + V * H * 2 / 8 + L * 8 * H * 2 + H * 2
    assert s.terms["other"] == pytest.approx(other / BW, rel=1e-9)
    assert s.tpot_us == pytest.approx(sum(s.terms.values()))
    assert s.tok_s == pytest.approx(1e6 / s.tpot_us)


def test_kv_read_and_attention_flops_at_context(kimi):
    base = step(env_for(context=0), Config(8), 4).terms["attention"]
    ctx = 4096
    got = step(env_for(context=ctx), Config(8), 4).terms["attention"]
    # KV read (bandwidth-bound here): 4 requests x 4096 tokens x 1152 B per layer
    assert got - base == pytest.approx(L * 4 * ctx * 1152 / BW, rel=1e-6)
    # DP attention: each of 8 groups holds a quarter of nothing... 4 requests on 4 groups,
    # the busiest group reads one request's KV with the whole attention replicated
    dp = step(env_for(context=ctx), Config(8, 1, 8, 8, "ag-rs"), 4).terms["attention"]
    split, repl = kimi.attention_params()
    assert dp == pytest.approx(L * (2 * (split + repl) + ctx * 1152) / BW, rel=1e-6)


def test_ep_imbalance_and_no_per_expert_overhead(kimi):
    env = env_for(stack="sglang-stock")
    cfg = Config(8, ep=8, comm="allreduce")
    s = step(env, cfg, 1)
    load = env.load(cfg, 1)
    assert load.mean_experts == pytest.approx(1.0)  # 8 experts over 8 ranks
    # each rank holds 384 / 8 = 48 whole experts; the mean rank runs one, of one row
    mean = grid_us(1.0, EP8_SHAPE, "normal")
    assert s.terms["experts"] == pytest.approx(60 * mean, rel=1e-9)
    busy = grid_us(load.max_experts, EP8_SHAPE, "normal")
    assert s.terms["imbalance"] == pytest.approx(60 * (busy - mean), rel=1e-9)
    # the overheads do not depend on how many experts a rank runs: same as TP8's
    tp8 = step(env, Config(8), 1)
    assert s.terms["launch"] == tp8.terms["launch"] == pytest.approx(1461 * 2.5)
    assert s.terms["framework"] == tp8.terms["framework"] == 0.0
    # stock SGLang all-reduces through NCCL: 27.4 µs at 16 KB, log-log down to 14,336 B
    t = (math.log(H * 2) - math.log(4 * KB)) / (math.log(16 * KB) - math.log(4 * KB))
    ar = math.exp(math.log(25.5) + t * (math.log(27.4) - math.log(25.5)))
    assert s.sources["all-reduce"][0] == "measured"
    assert comm.all_reduce(H * 2, 8, PRO, Tables(), "nccl").us == pytest.approx(ar)


def test_compute_bound_prefill_uses_tensor_peak(kimi):
    env = env_for()
    s = step(env, Config(8), 8192, ctx=0)
    # dense layer 0 at 8192 tokens: FLOPs 2 x 8192 x 3 H I_dense / 8 at 500 TFLOPS x 0.6
    fl = 2 * 8192 * 3 * H * 18432 / 8 / (500e6 * 0.6)
    by = 3 * H * 18432 * 2 / 8 / BW
    assert fl > by
    assert s.terms["other"] >= fl  # the dense MLP is in "other"


# ---- communication ----------------------------------------------------------------------------


def test_curve_interpolation_and_extension():
    c = Curve(((1.0, 10.0), (4.0, 40.0), (16.0, 100.0)), "test")
    assert c(0.5) == 10.0  # the latency floor below the first point
    assert c(2.0) == pytest.approx(20.0)  # log-log between points
    assert c(32.0) == pytest.approx(100.0 + (100 - 40) / 12 * 16)  # last segment's bandwidth
    with pytest.raises(ValueError, match="increasing"):
        Curve(((2.0, 1.0), (1.0, 2.0)), "bad")


def test_derived_nccl_alpha_beta_by_hand():
    t = Tables()
    g4090 = GPUS["rtx-4090"]
    size = 2 * MB
    got = comm.nccl("all_gather", size, 4, g4090, t)
    a8_ar, a4_ar = 25.5, 14.7
    alpha = (a4_ar + (a8_ar - a4_ar) / 4 * 0) * 14.7 / 25.5  # world 4, all_gather floor
    busbw = (7 / 8) * 16 * MB / (653 - 14.7) * 25.0 / 53.0
    assert got.kind == "derived"
    assert got.us == pytest.approx(alpha + (3 / 4) * size / busbw, rel=1e-9)
    assert comm.nccl("alltoall", 0, 8, PRO, t).us == 0.0
    assert comm.nccl("alltoall", 4 * KB, 1, PRO, t).kind == "none"
    with pytest.raises(ValueError, match="collective op"):
        comm.nccl("broadcast", 1, 8, PRO, t)


def test_tuned_all_reduce_switches_to_patched_nccl_above_56kb():
    t = Tables()
    small = comm.all_reduce(48 * KB, 8, PRO, t, "custom")
    assert small.kind == "measured" and small.us == pytest.approx(t.custom_ar8(48 * KB))
    big = comm.all_reduce(2 * MB, 8, PRO, t, "custom")
    assert big.kind == "model"
    assert big.us == pytest.approx(25.5 + 1.75 * 2 * MB / 40e3, rel=1e-9)
    assert big.us < comm.all_reduce(2 * MB, 8, PRO, t, "nccl").us
    with pytest.raises(ValueError, match="all-reduce mode"):
        comm.all_reduce(1, 8, PRO, t, "fast")


def test_pcie_a2a_exchange_is_the_topology_planners_prediction(kimi):
    env = env_for()
    topo = synthetic_topology(8, 5)
    ex = Exchanges(topo, Measured(), 5)
    cfg = Config(8, 1, 8, 8, "pcie_a2a")
    tokens = 128  # 16 per rank
    got = ex.cost(cfg, tokens, env)
    p_hit = expected_distinct_ranks(8, E, K) / 8
    rows = 16 * p_hit

    def matrix(b):
        return tuple(tuple(0.0 if s == d else rows * b for d in range(8)) for s in range(8))

    disp = Traffic("d", matrix(16 + 8 * K + H + 4 * (H // 128)))
    comb = Traffic("c", matrix(2 * H))
    want = sum(r.predicted_us for r in plan_transfers(topo, [disp, comb]).reports) + 2 * 5.0
    assert got.us == pytest.approx(want, rel=1e-9)
    assert got.kind == "model"
    assert dispatch_row_bytes(H, K, "bf16") == 16 + 64 + 2 * H


def test_nccl_alltoall_and_ag_rs_exchanges(kimi):
    env = env_for()
    ex = env.exchanges
    a2a = ex.cost(Config(8, 1, 8, 8, "a2a-nccl"), 256, env)
    load = env.load(Config(8, 1, 8, 8, "a2a-nccl"), 256)
    size = 32 * K * H * 2 * load.rows_factor
    assert a2a.us == pytest.approx(2 * Tables().nccl8["alltoall"](size))
    agrs = ex.cost(Config(8, 1, 8, 8, "ag-rs"), 256, env)
    size = 256 * H * 2
    t = Tables().nccl8
    assert agrs.us == pytest.approx(t["all_gather"](size) + t["reduce_scatter"](size))


# ---- load imbalance ---------------------------------------------------------------------------


def _monte_carlo(share, k, ranks, tokens, seed=3):
    """Top-k without replacement, weighted (Gumbel top-k), contiguous placement."""
    rng = np.random.default_rng(seed)
    samples = max(150, 2000 // tokens)  # the max of many tokens varies little
    q = np.asarray(share)
    e = len(q)
    rows, experts = [], []
    for _ in range(samples):
        g = np.log(q)[None, :] - np.log(-np.log(rng.random((tokens, e))))
        picks = np.argpartition(-g, k, axis=1)[:, :k]
        rows.append(np.bincount((picks // (e // ranks)).ravel(), minlength=ranks).max())
        touched = np.zeros(e, bool)
        touched[picks.ravel()] = True
        experts.append(touched.reshape(ranks, -1).sum(1).max())
    return float(np.mean(rows)), float(np.mean(experts))


@pytest.mark.parametrize("tokens", [1, 16, 128])
def test_uniform_imbalance_against_monte_carlo(tokens):
    r = uniform(E)
    load = rank_load(r, place(r, 8), K, tokens)
    rows, experts = _monte_carlo(r.share, K, 8, tokens)
    assert load.mean_rows == pytest.approx(tokens * K / 8)
    assert load.max_rows == pytest.approx(rows, rel=0.08)
    assert load.max_experts == pytest.approx(experts, rel=0.05)


def test_skewed_imbalance_against_monte_carlo():
    r = zipf(E, 1.0, seed=0)
    load = rank_load(r, place(r, 8), K, 64)
    rows, experts = _monte_carlo(r.share, K, 8, 64)
    assert load.max_rows == pytest.approx(rows, rel=0.15)
    assert load.max_experts == pytest.approx(experts, rel=0.1)
    assert load.rows_factor > rank_load(uniform(E), place(uniform(E), 8), K, 64).rows_factor


def test_redundant_experts_spread_the_hot_expert():
    counts = [1.0] * 16
    counts[0] = 16.0  # one expert takes half of the routed pairs
    r = from_counts(counts, 16, "test")
    plain = rank_load(r, place(r, 4), 2, 256)
    pl = place(r, 4, redundant=4)
    assert sum(len(s) for s in pl.slots) == 20
    assert sum(sh for s in pl.slots for x, sh in s if x == 0) == pytest.approx(1.0)
    assert len({rank for rank, s in enumerate(pl.slots) if any(x == 0 for x, _ in s)}) >= 3
    balanced = rank_load(r, pl, 2, 256)
    assert balanced.max_rows < 0.8 * plain.max_rows
    with pytest.raises(ValueError, match="redundant"):
        place(r, 4, redundant=3)


def test_pick_probabilities_sum_to_k_and_cap_at_one():
    share = np.array([0.5, 0.3, 0.1, 0.05, 0.05])
    p = pick_probabilities(share, 2)
    assert p.sum() == pytest.approx(2.0) and p.max() <= 1.0 + 1e-12
    assert p[0] == pytest.approx(1.0)


def test_rank_hit_probability_uniform_is_exact():
    r = uniform(E)
    hit = rank_hit_probability(r, place(r, 8), K)
    assert sum(hit) == pytest.approx(expected_distinct_ranks(8, E, K), rel=1e-12)


def test_routing_counts_checked():
    with pytest.raises(ValueError, match="expected 4 per-expert counts"):
        from_counts([1, 2, 3], 4, "f.json")
    with pytest.raises(ValueError, match="not all 0"):
        from_counts([0, 0, 0, 0], 4, "f.json")
    per_layer = from_counts([[1, 1, 2, 0], [2, 2, 4, 0]], 4, "f.json")
    assert per_layer.share == pytest.approx((0.25, 0.25, 0.5, 0.0))


def test_pipeline_stages_charge_framework_on_stage_0_and_their_own_launches():
    from pcie_a2a.configplan import predict

    env = env_for(step_us=500.0, request_us=2.0)
    cfg = Config(1, 2)
    for st in range(2):  # 61 layers: 31 (embedding, dense layer 0) + 30 (LM head)
        t = predict._stage(env, cfg, st, 32, env.context, {}, 32)
        # per micro-batch: the scheduler's forward pass and its 32 requests, on stage 0;
        # each stage launches its own kernels (31 x 12 + 30 x 12 + 4 / 30 x 24 + 5)
        assert t["framework"] == pytest.approx(500.0 + 2.0 * 32 if st == 0 else 0.0)
        assert t["launch"] == pytest.approx(2.5 * (736 if st == 0 else 725))


# (name, pp, concurrency, per stage (work, send) in us, tpot, bubble), worked by hand:
# micro-batches = min(pp, concurrency); tpot = max(one trip through all stages,
# micro-batches x slowest stage); bubble = tpot - micro-batches x trip / pp.
PIPELINE_CASES = [
    # 2 micro-batches; stages 410 and 270: trip 680 < 2 x 410 = 820; 820 - 2 x 680 / 2 = 140
    ("two_unequal_stages", 2, 64, [(400.0, 10.0), (250.0, 20.0)], 820.0, 140.0),
    # 1 micro-batch: the trip, 680; 680 - 1 x 680 / 2 = 340
    ("one_request", 2, 1, [(400.0, 10.0), (250.0, 20.0)], 680.0, 340.0),
    # 2 micro-batches through 3 stages 100, 350, 150: trip 600 < 2 x 350 = 700; 700 - 400 = 300
    (
        "fewer_micro_batches_than_stages",
        3,
        2,
        [(100.0, 0.0), (350.0, 0.0), (150.0, 0.0)],
        700.0,
        300.0,
    ),
    # equal stages, 2 micro-batches: 2 x 200 = 400 = the trip; no bubble
    ("equal_stages", 2, 8, [(150.0, 50.0), (150.0, 50.0)], 400.0, 0.0),
]


@pytest.mark.parametrize(
    ("pp", "concurrency", "stages", "tpot", "bubble"),
    [c[1:] for c in PIPELINE_CASES],
    ids=[c[0] for c in PIPELINE_CASES],
)
def test_pipeline_tpot_is_micro_batches_times_the_slowest_stage(
    monkeypatch, pp, concurrency, stages, tpot, bubble
):
    from pcie_a2a.configplan import predict

    def stage_cost(env, cfg, stage, *args):
        t = dict.fromkeys(predict.TERMS, 0.0)
        t["experts"] = stages[stage][0]
        return t

    monkeypatch.setattr(predict, "_stage", stage_cost)
    monkeypatch.setattr(predict, "_pp_send", lambda env, cfg, stage, *a: stages[stage][1])
    s = step(env_for(), Config(1, pp), concurrency)
    assert s.micro_batches == min(pp, concurrency)
    assert s.tpot_us == pytest.approx(tpot, rel=1e-12)
    assert s.bubble_us == pytest.approx(bubble, abs=1e-9)


def test_custom_all_reduce_stops_at_56kb():
    t = Tables()
    assert comm.all_reduce(100 * KB, 8, PRO, t, "custom").kind == "model"
    assert comm.all_reduce(50 * 1000, 8, PRO, t, "custom").kind == "measured"


def _made_points(truth, cs=(1, 64, 128)):
    from pcie_a2a.configplan.stacks import CalPoint

    env = calibration_env(truth, Tables())
    return tuple(CalPoint(Config(8), c, step(env, Config(8), c).tok_s, "model") for c in cs)


def test_fit_recovers_known_constants():
    """Calibration points made by the model itself at known host costs come back exactly,
    in sample and held out (any two of the three points fix both constants)."""
    from pcie_a2a.configplan.calibrate import fit, peak

    truth = replace(STACKS["vllm-tuned"], step_us=800.0, request_us=3.0)
    points = _made_points(truth)
    env = calibration_env(truth, Tables())
    ep = Config(8, ep=8, comm="allreduce")
    c_peak, peak_tok_s = peak(env, ep)
    from pcie_a2a.configplan.stacks import CalPoint

    points += (CalPoint(ep, None, peak_tok_s, "model"),)
    got = fit(replace(truth, points=points, step_us=0.0, request_us=0.0))
    assert got.step_us == pytest.approx(800.0, rel=1e-6)
    assert got.request_us == pytest.approx(3.0, rel=1e-6)
    for _, measured, model in (*got.residuals, *got.loo):
        assert model == pytest.approx(measured, rel=1e-6)
    assert f"C={c_peak}" in got.residuals[3][0]
    assert got.band == pytest.approx((1.0, 1.0), abs=1e-6)


def test_leave_one_out_residual_by_hand():
    """One point 10% above what the true constants give: the two others still fix the
    truth, so held out it is predicted at the truth, 1 / 1.1 - 1 = -9.09% off; the band
    then reaches x1.1 up."""
    from pcie_a2a.configplan.calibrate import fit
    from pcie_a2a.configplan.stacks import CalPoint

    truth = replace(STACKS["vllm-tuned"], step_us=800.0, request_us=3.0)
    p1, p2, p3 = _made_points(truth)
    bumped = CalPoint(p3.config, p3.concurrency, p3.tok_s * 1.1, "model, +10%")
    got = fit(replace(truth, points=(p1, p2, bumped), step_us=0.0, request_us=0.0))
    label, measured, predicted = got.loo[2]
    assert "C=128" in label
    assert predicted == pytest.approx(p3.tok_s, rel=1e-6)
    assert predicted / measured - 1 == pytest.approx(1 / 1.1 - 1, rel=1e-6)
    assert got.band[1] >= 1.1 - 1e-6
    assert got.band[0] <= 1.0


def test_shipped_stacks_fit_only_their_stated_sources():
    from pcie_a2a.configplan.calibrate import fit

    tuned = fit(STACKS["vllm-tuned"])
    # research/field_2026.md s1: kimi-k26-v4 92.4 / 2222.6, kimi-k26-v3 91.4 / 2310.2
    assert sorted((m, lab.split(" [")[1]) for lab, m, _ in tuned.loo) == sorted(
        [
            (92.4, "kimi-k26-v4]"),
            (2222.6, "kimi-k26-v4]"),
            (91.4, "kimi-k26-v3]"),
            (2310.2, "kimi-k26-v3]"),
        ]
    )
    stock = fit(STACKS["sglang-stock"])
    assert sorted(m for _, m, _ in stock.loo) == [26.0, 65.0, 961.0]  # field_2026 s1
    like = fit(STACKS["pcie-a2a-allreduce"])
    assert (like.step_us, like.request_us, like.band) == (
        tuned.step_us,
        tuned.request_us,
        tuned.band,
    )


def test_stock_tp8_curve_rises_with_concurrency():
    """Every measured stock server gains throughput with concurrency (field_2026 s1: EP8 65
    tok/s at C = 1, ~961 at its peak); no host cost may make the curve fall."""
    from pcie_a2a.configplan.calibrate import fit

    for name in ("sglang-stock", "vllm-tuned"):
        env = calibration_env(fit(STACKS[name]), Tables())
        for cfg in (Config(8), Config(8, ep=8, comm="allreduce")):
            rates = [step(env, cfg, c).tok_s for c in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
            assert all(b > a for a, b in itertools.pairwise(rates)), (name, cfg.name, rates)


def test_tuned_tp8_at_context_0_inside_its_band_of_the_measurement():
    """At --context 0 (the calibration setting) TP8 at C = 128 on the tuned stack must land
    within its band of the measured 2222.6 tok/s (kimi-k26-v4.md, field_2026 s1), not at
    the 12,329 tok/s an overhead on each expert GEMM gave."""
    from pcie_a2a.configplan.api import Inputs, make_plan

    p = make_plan(Inputs(context=0, output=1, gpus=8))  # decode reads no context
    tp8 = next(r for r in p.results if r.config == Config(8))
    lo, hi = p.stack.band
    assert tp8.steps[128].tok_s * lo <= 2222.6 <= tp8.steps[128].tok_s * hi
    rec = p.recommendation
    c, tok = max(
        ((c, t) for c, t in rec.best.curve if c <= rec.best.c_max and c / t * 1e3 <= 50),
        key=lambda x: x[1],
    )
    assert c / tok * 1e3 <= 50.0  # the recommendation respects the TPOT cap


def test_redundant_experts_under_skew_prefill_and_decode():
    """Replicas balance the rows: that removes the imbalance of a compute-bound prefill
    chunk; a decode step streams weights, and replicas do not reduce the distinct experts a
    rank must read (they add slots), so decode keeps its imbalance."""
    env = env_for(routing=zipf(E, 1.0, seed=0))
    cfg, spread = Config(8, ep=8, comm="allreduce"), Config(8, ep=8, comm="allreduce", redundant=16)
    pre, pre_r = step(env, cfg, 8192, ctx=4096), step(env, spread, 8192, ctx=4096)
    assert pre.terms["imbalance"] > 0.5 * pre.terms["experts"]
    # the product's EPLB packs replicas by balanced packing (a rank may hold two copies):
    # it removes over 90% of the prefill imbalance here (the old greedy copy: 95%)
    assert pre_r.terms["imbalance"] < 0.1 * pre.terms["imbalance"]
    assert env.load(spread, 256).rows_factor < 0.7 * env.load(cfg, 256).rows_factor
    dec, dec_r = step(env, cfg, 256), step(env, spread, 256)
    assert dec_r.terms["imbalance"] > 0.8 * dec.terms["imbalance"]
    assert dec_r.terms["experts"] > dec.terms["experts"]  # more slots to stream


def test_pcie_a2a_rows_launch_eager_and_its_all_reduce_is_labelled_assumed():
    """pcie_a2a's launch lines disable CUDA graphs: its rows pay the eager launch (5 µs a
    kernel, 1461 kernels by hand) where the graph rows pay 2.5 µs; pcie_a2a.AllReduce has
    never run on a GPU: costed at the measured one-shot table (14,336 B: 11.8 µs) and
    labelled assumed."""
    env = env_for()
    ours = step(env, Config(8, 1, 8, 8, "pcie_a2a"), 8)
    ag = step(env, Config(8, 1, 8, 8, "ag-rs"), 8)
    assert ours.terms["launch"] == pytest.approx(1461 * 5.0)
    assert ag.terms["launch"] == pytest.approx(1461 * 2.5)
    c = comm.all_reduce(H * 2, 8, PRO, Tables(), "pcie_a2a")
    assert (c.us, c.kind) == (pytest.approx(11.8), "assumed")
    with pytest.raises(ValueError, match="allowed nccl, custom, pcie_a2a"):
        comm.all_reduce(H * 2, 8, PRO, Tables(), "tuned")


def test_redundant_placement_is_the_products_eplb():
    """plan --redundant-experts predicts with the placement pcie_a2a.balance.eplb makes,
    each replica taking 1 / (its expert's replica count) of the expert's tokens."""
    from pcie_a2a.balance.eplb import eplb

    r = zipf(E, 1.0, seed=0)
    got = place(r, 8, 16)
    table = eplb(np.asarray(r.share), 8, 16)
    assert [[x for x, _ in rank] for rank in got.slots] == table.tolist()
    count = np.bincount(table.reshape(-1), minlength=E)
    for rank in got.slots:
        for x, share in rank:
            assert share == 1.0 / count[x]
    assert sum(share for rank in got.slots for _, share in rank) == pytest.approx(E)


# (hidden, top-k, payload) -> (dispatch, combine) bytes, by hand from wire_format.h: a 16 B
# header, then the k int32 expert ids and the k fp32 weights each starting 16-aligned, then
# the payload (fp8: hidden bytes + an fp32 scale per 128 channels, 16-aligned; bf16: 2 x
# hidden), the slot rounded up to 16; a combine row is 2 x hidden rounded up to 16.
WIRE_ROWS = [
    (7168, 8, "fp8", (7472, 14336)),  # 48 -> 80 -> 7248 + 224
    (7168, 8, "bf16", (14416, 14336)),  # 80 + 14336
    (4096, 6, "fp8", (4304, 8192)),  # up16(40) 48 -> up16(72) 80 -> 4176 + 128
    (2048, 1, "bf16", (4144, 4096)),  # up16(20) 32 -> up16(36) 48 + 4096
    (7168, 9, "fp8", (7504, 14336)),  # up16(52) 64 -> up16(100) 112 -> 7280 + 224
]


@pytest.mark.parametrize(("hidden", "topk", "payload", "want"), WIRE_ROWS)
def test_every_model_of_the_exchange_counts_the_wire_formats_rows(hidden, topk, payload, want):
    """The plan, the balancer and the topology planner's Kimi traffic count the wire
    format's slots (one formula, pcie_a2a.buffer_memory), and so does the native layout
    where it is built."""
    from pcie_a2a.balance import RowBytes
    from pcie_a2a.configplan import exchange
    from pcie_a2a.topology import kimi_k2_decode

    assert exchange.row_bytes(hidden, topk, payload) == want
    assert dispatch_row_bytes(hidden, topk, payload) == want[0]
    rb = RowBytes.for_model(hidden, topk, payload)
    assert (rb.dispatch, rb.combine) == want
    if (hidden, topk) == (H, K):
        rows = 128 * expected_distinct_ranks(8, E, K) / 8  # to one other rank, uniform
        dispatch, combine = kimi_k2_decode(8, 128, payload)
        assert dispatch.bytes[0][1] == pytest.approx(rows * want[0])
        assert combine.bytes[0][1] == pytest.approx(rows * want[1])
    native = pytest.importorskip("pcie_a2a._transport")
    code = {"bf16": 0, "fp8": 2}[payload]
    assert tuple(native.slot_bytes(8, hidden, 256, topk, code, 0)[:2]) == want


# ---- one expert-GEMM cost ------------------------------------------------------------------


def test_int4_experts_on_a_grid_modelled_gpu_take_the_grid_model():
    """Kimi K2.6 (INT4 g32 experts), RTX PRO 6000, DP8 + EP8 pcie_a2a, C = 1: the routed
    experts are 60 MoE layers x pcie_a2a's INT4 kernel model (quant/grid_model.py, the one
    scripts/sass_report.py ties to the SASS) of the mean rank, one expert of one row, in the
    low-latency layout; the imbalance is the busiest rank's expected experts less that."""
    env = env_for()
    cfg = Config(8, 1, 8, 8, "pcie_a2a")
    s = step(env, cfg, 1)
    load = env.load(cfg, 1)
    assert load.mean_experts == pytest.approx(1.0) and load.mean_rows == pytest.approx(1.0)
    mean = grid_model.predict("rtx_pro_6000", 1, 1, shape=EP8_SHAPE, layout="low_latency")
    assert s.terms["experts"] == pytest.approx(60 * mean.time_us, rel=1e-9)
    busy = grid_us(load.max_experts, EP8_SHAPE, "low_latency")
    assert s.terms["imbalance"] == pytest.approx(60 * (busy - mean.time_us), rel=1e-9)
    # lower bounds by hand: an expert is 3 x 7168 x 2048 x (0.5 + 2 / 32) = 24,772,608 B,
    # streamed at best at the spec DRAM bandwidth (gpus.py: 1792 GB/s = 1792e3 B/µs)
    assert s.terms["experts"] / 60 >= 24_772_608 / 1792e3
    busiest = (s.terms["experts"] + s.terms["imbalance"]) / 60
    assert busiest >= load.max_experts * 24_772_608 / 1792e3
    kind, src = s.sources["experts"]
    assert kind == "model" and src.startswith("INT4 grid model")
    assert "48 local experts, low_latency layout" in src
    ar = step(env, Config(8, ep=8, comm="allreduce"), 1)  # every GPU has every token
    assert "normal layout" in ar.sources["experts"][1]


def test_other_formats_and_gpus_keep_the_roofline_and_say_why():
    # block FP8 Kimi K2: one expert of 3 H I (1 + 4 / 128^2) bytes per rank and layer at
    # 1792 GB/s x 0.85, GEMM efficiency 1.0 at one row per expert
    fp8 = env_for(model=load_model("kimi-k2"))
    s = step(fp8, Config(8, ep=8, comm="allreduce"), 1)
    assert s.terms["experts"] == pytest.approx(60 * 3 * H * I * (1 + 4 / 16384) / BW, rel=1e-9)
    assert s.sources["experts"][1].startswith("roofline (fp8 weights")
    assert "fp8 experts" in s.sources["experts"][1]
    # a GPU the grid model has no occupancy table for: the roofline at its 768 GB/s
    a6000 = env_for(gpu=GPUS["a6000"])
    s = step(a6000, Config(8, ep=8, comm="allreduce"), 1)
    assert s.terms["experts"] == pytest.approx(60 * 24_772_608 / (768e3 * 0.85), rel=1e-9)
    assert "NVIDIA RTX A6000 is not in the INT4 grid model" in s.sources["experts"][1]
    # a prefill chunk of 8192 tokens: 8192 x 8 / 8 rows over 48 experts = 171 per expert,
    # where the kernel takes block_m 64, outside the grid model
    pre = step(env_for(), Config(8, ep=8, comm="allreduce"), 8192, ctx=0, prefill=True)
    assert "171 rows per expert" in pre.sources["experts"][1]
    assert pre.sources["experts"][1].startswith("roofline (int4-g32 weights")


# Kimi K2.6 rows on the wire (buffer_memory.row_bytes, worked by hand in WIRE_ROWS above):
# dispatch fp8 = 16 B header + 8 int32 ids (-> 48) + 8 fp32 weights (-> 80) + 7168 B
# payload (-> 7248) + 56 fp32 scales = 7472 B; combine = 2 x 7168 = 14,336 B, no header.
# A token goes to a rank once if any of its 8 distinct experts (of 384, uniform) is there:
# EP2 (192 a rank): 1 - C(192, 8) / C(384, 8) = 0.99637373; EP4 (96 a rank):
# 1 - C(288, 8) / C(384, 8) = 1 - prod_{j<8} (288 - j) / (384 - j) = 0.90232775.
def _all_to_all(n: int, b: float) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(0.0 if s == d else b for d in range(n)) for s in range(n))


# (fixture, GPU PCIe generation, EP, tokens, rows to each other rank)
PLANNED_CASES = [
    # GeForce pair, P2P "GNS" (host-staged); 4 tokens on DP2: 2 a rank, 2 x 0.99637 rows
    ("2x-rtx5090-threadripper3975wx.topo-p2p.txt", 5, 2, 4, 2 * 0.9963737325144445),
    # dual socket, two NODE pairs joined by SYS; 16 tokens on DP4: 4 a rank, 4 x 0.90233
    ("4x-l40s-dual-socket.topo.txt", 4, 4, 16, 4 * 0.9023277510040769),
]


@pytest.mark.parametrize(("fixture", "gen", "ep", "tokens", "rows"), PLANNED_CASES)
def test_pcie_a2a_cost_is_the_planners_total_on_a_real_box(fixture, gen, ep, tokens, rows):
    """The pcie_a2a exchange the plan charges per MoE layer = the topology planner's
    predicted dispatch + combine for the hand-written traffic + 2 x pcie_a2a_call_us."""
    from pcie_a2a.topology import TransferOptions, load
    from topology_fixtures import FIXTURES

    topo = load(FIXTURES / fixture)
    assert topo.num_gpus == ep
    env = env_for()
    got = Exchanges(topo, Measured(), gen).cost(Config(ep, 1, ep, ep, "pcie_a2a"), tokens, env)
    disp = Traffic("dispatch", _all_to_all(ep, rows * 7472))
    comb = Traffic("combine", _all_to_all(ep, rows * 14336))
    reports = plan_transfers(topo, [disp, comb], TransferOptions(default_link_gen=gen)).reports
    want = reports[0].predicted_us + reports[1].predicted_us + 2 * Tables().pcie_a2a_call_us
    assert got.us == pytest.approx(want, rel=1e-12)
    assert got.kind == "model" and got.source.startswith("topology planner")
    assert Tables().pcie_a2a_call_us == 5.0  # the assumed per-call cost (tables.py)


# ---- MTP ------------------------------------------------------------------------------------


def test_mtp_step_reads_weights_and_cache_once_and_emits_accept_len(kimi):
    """TP8, C = 1, context 4096, MTP with 3 drafts accepted to 2.278 tokens a step: the step
    runs 1 + 3 = 4 rows; the weights other than the routed experts and the request's KV
    cache are read as often as without MTP (by hand below); the routed experts are the ones
    4 tokens touch; the step emits 2.278 tokens."""
    plain = step(env_for(context=4096), Config(8), 1)
    spec = step(env_for(context=4096, mtp=Mtp(3, 2.278, "test")), Config(8), 1)
    split, repl = kimi.attention_params()
    weights = (
        L * 2 * (split / 8 + repl)  # attention, bf16, TP8 (q_a and kv_a replicated)
        + 60 * 2 * E * H  # routers
        + 3 * H * 18432 * 2 / 8  # dense layer 0
        + 60 * 3 * H * I * 2 / 8  # shared experts
        + V * H * 2 / 8  # LM head, vocab-parallel
    )
    assert plain.bytes_read["weights"] == pytest.approx(weights, rel=1e-12)
    assert spec.bytes_read["weights"] == pytest.approx(weights, rel=1e-12)
    kv = L * 4096 * 1152  # one request's cache: (512 + 64) x 2 B a token and layer
    assert plain.bytes_read["kv"] == pytest.approx(kv) and spec.bytes_read["kv"] == pytest.approx(
        kv
    )
    # a GPU streams its 1/8 slice of every expert the step's tokens touch: 8 for one token,
    # 384 (1 - (1 - 8/384)^4) = 30.8 for four
    slice_ = 24_772_608 / 8
    assert plain.bytes_read["experts"] == pytest.approx(60 * 8 * slice_, rel=1e-9)
    touched = 384 * (1 - (1 - 8 / 384) ** 4)
    assert spec.bytes_read["experts"] == pytest.approx(60 * touched * slice_, rel=1e-9)
    assert (plain.rows_per_request, spec.rows_per_request) == (1, 4)
    assert (plain.tokens_per_step, spec.tokens_per_step) == (1.0, 2.278)
    # tokens out of a step: C x accept_len in its time
    assert spec.tok_s * spec.total_us / 1e6 == pytest.approx(2.278, rel=1e-12)
    assert spec.tpot_us == pytest.approx(spec.total_us / 2.278, rel=1e-12)
    # a prefill chunk drafts nothing
    pre = step(env_for(mtp=Mtp(3, 2.278, "test")), Config(8), 256, ctx=128, prefill=True)
    assert pre.rows_per_request == 1 and pre.tokens_per_step == 1.0


def test_the_one_shipped_mtp_stack_cites_its_accepted_length():
    """vllm-tuned-mtp: EAGLE3 with 3 drafts; kimi-k26-v4.md's 'Kimi Draft Acceptance Notes'
    give per-position acceptance 0.645, 0.393, 0.240 (DCP1), so 1 + their sum = 2.278
    tokens a step; its calibration numbers are the pages' MTP rows (field_2026.md s1:
    v4 122.0 / 2245.8, v3 110.1 / 2406.5). No other shipped stack claims MTP."""
    s = STACKS["vllm-tuned-mtp"]
    assert (s.mtp.draft_tokens, s.mtp.accept_len) == (3, pytest.approx(1 + 0.645 + 0.393 + 0.240))
    assert "kimi-k26-v4.md" in s.mtp.source and "0.645, 0.393, 0.240" in s.mtp.source
    assert sorted(p.tok_s for p in s.points) == [110.1, 122.0, 2245.8, 2406.5]
    assert [n for n, st in STACKS.items() if st.mtp is not None] == ["vllm-tuned-mtp"]
    part = {p.name: p for p in s.parts()}["MTP"]
    assert part.value.startswith("3 draft tokens, 2.278 tokens per step")
    assert part.source == s.mtp.source
    assert {p.name: p for p in STACKS["vllm-tuned"].parts()}["MTP"].value == "off"
    with pytest.raises(ValueError, match=r"accept_len: got 4.5; allowed: a number from 1 to 1 \+"):
        Mtp(3, 4.5, "x")
    with pytest.raises(ValueError, match="draft_tokens: got 0; allowed: an int >= 1"):
        Mtp(0, 1.0, "x")
