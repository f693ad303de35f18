"""pcie_a2a.balance: placement invariants, the replica choice, the hierarchy, the cost and
traffic models, the move penalty, and quality against DeepSeek's EPLB on the fixture boxes
(loads-based, deterministic: these are properties of the algorithm, not timings)."""

from __future__ import annotations

import numpy as np
import pytest

from pcie_a2a.balance import (
    GemmCost,
    Islands,
    Options,
    RowBytes,
    Workload,
    balance,
    balance_layer,
    expected,
    replicate,
    simulate,
    to_placement,
)
from pcie_a2a.balance import eplb as ep
from pcie_a2a.balance import synthetic as syn
from pcie_a2a.balance.algorithm import island_tree
from pcie_a2a.balance.layout import from_placement, nearest_fractions, replica_table
from pcie_a2a.topology import load
from topology_fixtures import FIXTURES

BROADCOM = FIXTURES / "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt"
SWITCHES = FIXTURES / "8x-rtxpro6000-threadripper-3switch-pxb.topo.txt"
DIRECT = FIXTURES / "8x-rtxpro6000-dual-epyc9124-direct.topo.txt"
E, W, K, T = 384, 8, 8, 128


@pytest.fixture(scope="module")
def boxes():
    return {p.name: Islands.from_topology(load(p)) for p in (BROADCOM, SWITCHES, DIRECT)}


def _zipf_loads(seed: int, skew: float = 1.0, experts: int = E):
    rng = np.random.default_rng(seed)
    w = syn.zipf_weights(experts, skew, rng)
    return syn.loads_of(syn.route(w, W, T, K, 16, rng), experts)[0], w


# ---- islands -------------------------------------------------------------------------------
def test_islands_of_the_broadcom_box(boxes):
    isl = boxes[BROADCOM.name]
    assert [p[0] for p in isl.paths] == ["socket0"] * 4 + ["socket1"] * 4
    near = isl.nearness()
    # GPU0: itself, then its switch mate GPU1, then GPU2/3 (same socket), then socket 1
    assert near[0, 0] > near[0, 1] > near[0, 2] == near[0, 3] > near[0, 4]
    assert any(lk.startswith("socket") for lk in isl.pair_links[0][5])
    assert not any(lk.startswith("socket") for lk in isl.pair_links[0][3])
    tree = island_tree(isl.paths)
    assert [c.ranks for c in tree.children] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [c.ranks for c in tree.children[0].children] == [[0, 1], [2, 3]]


def test_islands_from_paths_count_uplinks_and_the_socket_link():
    isl = Islands.from_paths([["socket0", "sw0"], ["socket0", "sw0"], ["socket1", "sw1"]])
    assert isl.pair_links[0][1] == ()  # behind one switch: no shared link
    assert isl.pair_links[0][2] == ("sw0^", "socket:socket0->socket1", "sw1v")
    with pytest.raises(ValueError, match="unknown link"):
        Islands(isl.paths, (((), ("x",), ()),) * 3, isl.link_gbps)


# ---- replication and placement invariants --------------------------------------------------
def test_replicate_gives_extra_copies_to_the_highest_load_per_replica():
    assert replicate(np.array([10.0, 1.0, 1.0, 1.0]), 6, 8).tolist() == [3, 1, 1, 1]
    assert replicate(np.array([10.0, 6.0, 1.0]), 5, 8).tolist() == [2, 2, 1]  # 10/2 < 6
    assert replicate(np.array([100.0, 1.0]), 4, 2).tolist() == [2, 2]  # at most 2 each
    with pytest.raises(ValueError, match="physical experts"):
        replicate(np.ones(4), 3, 8)


@pytest.mark.parametrize("box", [BROADCOM.name, SWITCHES.name, DIRECT.name])
def test_placement_invariants_and_nearest_choice(boxes, box):
    isl = boxes[box]
    loads, _ = _zipf_loads(1)
    res = balance_layer(loads, isl, Options(redundant=32))
    slots = res.slots
    assert slots.shape == (W, 52)
    assert all(len(set(row)) == 52 for row in slots)  # no rank holds an expert twice
    counts = np.bincount(slots.reshape(-1), minlength=E)
    assert counts.min() >= 1 and counts.tolist() == replicate(loads, 416, W).tolist()
    p = res.placement
    assert from_placement(p).tolist() == slots.tolist()
    near = isl.nearness()
    for s in range(W):
        for e in (0, 1, int(np.argmax(loads))):
            reps = [r for r, _ in p.replicas[e]]
            best = max(near[s, r] for r in reps)
            assert sorted(p.choice[s][e]) == [j for j, r in enumerate(reps) if near[s, r] == best]
    # the wire layer's replica rule follows the table
    hot = int(np.argmax(loads))
    for s in range(W):
        r, _ = p.replica_for(hot, s * 1000 + 7, s)
        assert near[s, r] == max(near[s, rr] for rr, _ in p.replicas[hot])


def test_hot_experts_are_spread_over_islands(boxes):
    isl = boxes[BROADCOM.name]
    loads, _ = _zipf_loads(2)
    res = balance_layer(loads, isl, Options(redundant=32))
    sockets = [p[0] for p in isl.paths]
    switches = [p[-1] for p in isl.paths]
    counts = np.bincount(res.slots.reshape(-1), minlength=E)
    for e in np.flatnonzero(counts >= 2):
        ranks = [r for r in range(W) if e in res.slots[r]]
        assert len({sockets[r] for r in ranks}) == 2, e  # a copy in each socket
        if counts[e] >= 4:
            assert len({switches[r] for r in ranks}) == 4, e  # and behind each switch


def test_balance_checks_its_inputs(boxes):
    isl = boxes[BROADCOM.name]
    with pytest.raises(ValueError, match="do not split evenly over 8 ranks"):
        balance_layer(np.ones(E), isl, Options(redundant=3))
    with pytest.raises(ValueError, match="loads"):
        balance_layer(-np.ones(E), isl, Options())
    with pytest.raises(ValueError, match="share"):
        balance_layer(np.ones(E), isl, Options(), share=np.ones((W, E)))
    with pytest.raises(ValueError, match="redundant"):
        Options(redundant=-1)
    with pytest.raises(ValueError, match="layers, experts"):
        balance(np.ones(E), isl, Options())


# ---- models --------------------------------------------------------------------------------
def test_gemm_cost_curve_and_its_poisson_expectation():
    c = GemmCost.roofline()
    rows = np.arange(0, 200)
    t = c(rows)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert t[1] == pytest.approx(t[16]) and t[1] > 10  # weight-bound: ~17 µs for Kimi K2
    assert c(400) > 3 * c(40)  # compute-bound far out
    lam = np.array([0.0, 0.3, 1.0, 5.0, 100.0])
    ex = c.expected(lam)
    # exact Poisson means of a known piecewise function
    assert ex[0] == 0
    assert ex[1] == pytest.approx((1 - np.exp(-0.3)) * c(1), rel=1e-6)
    assert ex[4] == pytest.approx(c(100.0))
    pts = GemmCost.from_points([(1, 10.0), (64, 20.0)])
    assert pts(32.5) == pytest.approx(10 + 31.5 * 10 / 63)  # between the points
    assert pts(128) == pytest.approx(20 + 64 * 10 / 63)  # the last segment's slope
    with pytest.raises(ValueError, match="increasing"):
        GemmCost.from_points([(4, 1.0), (4, 2.0)])


# (hidden, top-k, payload, dispatch row, combine row), derived by hand from the wire format:
# a 16-byte header, top-k int32 expert ids, top-k fp32 weights, then the payload (bf16: 2
# bytes a channel; fp8: 1 byte a channel, then one fp32 scale per 128 channels), each part
# starting 16-byte aligned; the combine row is bf16 hidden.
ROW_BYTES_CASES = [
    # ids 16..48, weights 48..80, e4m3 80..7248, 56 scales 7248..7472
    (7168, 8, "fp8", 7472, 14336),
    # ids 16..48, weights 48..80, bf16 80..14416
    (7168, 8, "bf16", 14416, 14336),
    # ids 16..28 -> 32, weights 32..44 -> 48, e4m3 48..2096, 16 scales 2096..2160
    (2048, 3, "fp8", 2160, 4096),
    # ids 16..28 -> 32, weights 32..44 -> 48, bf16 48..4144
    (2048, 3, "bf16", 4144, 4096),
]


@pytest.mark.parametrize(("hidden", "topk", "payload", "dispatch", "combine"), ROW_BYTES_CASES)
def test_row_bytes_follow_the_wire_format(hidden, topk, payload, dispatch, combine):
    from pcie_a2a import _transport

    rb = RowBytes.for_model(hidden, topk, payload)
    assert (rb.dispatch, rb.combine) == (dispatch, combine)
    payload_code = {"bf16": 0, "fp8": 2}[payload]  # csrc/core/numeric.h Payload
    native = _transport.slot_bytes(2, hidden, 1, topk, payload_code, 0)[:2]
    assert (rb.dispatch, rb.combine) == tuple(native)


def test_expected_metrics_agree_with_routed_tokens(boxes):
    """The loads-based estimate (rows with independent experts) against tokens routed
    through the wire rule: rank loads within sampling noise, rows within 5%."""
    isl = boxes[BROADCOM.name]
    rng = np.random.default_rng(4)
    w = syn.zipf_weights(E, 1.0, rng)
    steps = syn.route(w, W, T, K, 24, rng)
    loads, _ = syn.loads_of(steps, E)
    opt = Options(redundant=32)
    res = balance_layer(loads, isl, opt)
    work = Workload(loads, None, T, K)
    ex = expected(res.placement, work, isl, opt.cost, opt.row_bytes)
    sim = simulate(res.placement, steps, T, isl, opt.cost, opt.row_bytes)
    assert np.allclose(ex.rank_load, sim.rank_load, rtol=0.03)
    off = ~np.eye(W, dtype=bool)
    # experts taken as independent: a token's k experts are distinct, so it reaches a few
    # percent more ranks than that predicts (documented in evaluate.py)
    assert ex.rows[off].sum() == pytest.approx(sim.rows[off].sum(), rel=0.05)
    assert ex.rows[off].sum() < sim.rows[off].sum()
    assert np.allclose(ex.rows[off], sim.rows[off], rtol=0.10)
    assert ex.socket_bytes == pytest.approx(sim.socket_bytes, rel=0.05)
    assert sim.time_source == "planner" and sim.dispatch_us > 0


def test_simulate_routes_like_the_wire_layer():
    """Against Placement.replica_for token by token."""
    isl = Islands.from_paths([["s0"], ["s0"], ["s1"], ["s1"]])
    slots = np.array([[0, 2], [1, 3], [0, 1], [2, 3]])  # every expert twice
    pl = to_placement(slots, 4, isl.nearness())
    rng = np.random.default_rng(0)
    steps = [[rng.integers(-1, 4, size=(5, 2)) for _ in range(4)]]
    m = simulate(pl, steps, 8, isl, GemmCost.from_points([(1, 1.0)]), RowBytes(16, 16))
    want = np.zeros(4)
    for s, ids in enumerate(steps[0]):
        for t, row in enumerate(ids):
            for e in row:
                if e >= 0:
                    want[pl.replica_for(int(e), s * 8 + t, s)[0]] += 1
    assert m.rank_load.tolist() == want.tolist()


# ---- the move penalty ----------------------------------------------------------------------
def test_unchanged_loads_move_nothing_and_drift_moves_little(boxes):
    isl = boxes[DIRECT.name]
    loads, w = _zipf_loads(5)
    opt = Options(redundant=32)
    first = balance_layer(loads, isl, opt)
    again = balance_layer(loads, isl, opt, previous=first.slots)
    assert again.moved == 0 and again.slots.tolist() == first.slots.tolist()
    rng = np.random.default_rng(6)
    nxt = syn.loads_of(syn.route(syn.drift(w, 0.3, rng), W, T, K, 16, rng), E)[0]
    kept = balance_layer(nxt, isl, opt, previous=first.slots)
    fresh = balance_layer(nxt, isl, opt)
    moved_fresh = sum(len(set(fresh.slots[r]) - set(first.slots[r])) for r in range(W))
    assert kept.moved < moved_fresh / 2, (kept.moved, moved_fresh)
    work = Workload(nxt, None, T, K)
    mk = expected(kept.placement, work, isl, opt.cost, opt.row_bytes)
    assert mk.max_mean <= 1.05
    # moved = (rank, expert) pairs the rank did not hold
    assert kept.moved == sum(len(set(kept.slots[r]) - set(first.slots[r])) for r in range(W))


# ---- quality against EPLB ------------------------------------------------------------------
@pytest.mark.parametrize("box", [BROADCOM.name, DIRECT.name])
def test_zipf_targets_against_eplb(boxes, box):
    """The issue's targets on one Zipf(1.0) layer (benchmarks/bench_balance.py measures
    them on routed tokens over several layers and boxes)."""
    isl = boxes[box]
    loads, _ = _zipf_loads(7)
    opt = Options(redundant=32)
    work = Workload(loads, None, T, K)
    ours = expected(balance_layer(loads, isl, opt).placement, work, isl, opt.cost, opt.row_bytes)
    base = expected(
        to_placement(ep.eplb(loads, W, 32), E, None), work, isl, opt.cost, opt.row_bytes
    )
    contig = expected(
        to_placement(ep.contiguous(E, W), E, None), work, isl, opt.cost, opt.row_bytes
    )
    assert ours.max_mean <= min(1.10, base.max_mean)
    assert ours.socket_bytes <= 0.75 * base.socket_bytes
    assert ours.step_us < base.step_us < contig.step_us


def test_eplb_baseline_follows_its_description():
    loads = np.array([8.0, 4.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0])
    phys, count = ep.replicate(loads, 12)
    assert count.tolist() == [4, 2, 1, 1, 1, 1, 1, 1] and sorted(phys[8:]) == [0, 0, 0, 1]
    assert ep.balanced_packing(np.array([5.0, 4.0, 3.0, 2.0]), 2).tolist() == [0, 1, 1, 0]
    slots = ep.eplb(loads, 4, 4)
    assert slots.shape == (4, 3) and np.bincount(slots.reshape(-1)).tolist() == count.tolist()
    hier = ep.eplb(loads, 4, 4, num_groups=4, nodes=[[0, 1], [2, 3]])
    # groups of 2 experts; the node holding group 0 (experts 0, 1) holds all their copies
    node_of = {e: 0 if e in hier[:2].reshape(-1) else 1 for e in (0, 1)}
    assert node_of[0] == node_of[1] and 0 not in hier[2 * (1 - node_of[0]) :][:2].reshape(-1)


def test_nearest_fractions_split_equally_among_equally_near_replicas():
    near = np.array([[3, 1, 0, 0], [1, 3, 0, 0], [0, 0, 3, 1], [0, 0, 1, 3]])
    slots = np.array([[0, 1], [2, 3], [0, 4], [5, 6]])  # expert 0 on ranks 0 and 2
    rank, _ = replica_table(slots, 7)
    frac = nearest_fractions(rank, near)
    assert frac[0, 0].tolist() == [1.0, 0.0]  # its own copy
    assert frac[1, 0].tolist() == [1.0, 0.0]  # same socket as rank 0
    assert frac[3, 0].tolist() == [0.0, 1.0]
    assert frac[1, 5].tolist() == [1.0, 0.0]  # the only copy (the row is padded)
