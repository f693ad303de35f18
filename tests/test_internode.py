"""Buffer across nodes (simulated with PCIE_A2A_LOCAL_WORLD_SIZE on one host, gloo between
them) against the single-process reference, bit for bit.

Exactness: x holds small integers and the routing weights are multiples of 0.5, and each
rank's "expert" returns ``x * (sum of the row's weights)``: every partial and every sum of
partials is exact in bf16 and fp32, so the hierarchical combine (summed per node, then across
nodes) must equal the reference (summed in rank order) exactly whatever the order. With
fp8, the dequantised rows are bf16 values of at most 8 significant bits within a few
binades, whose sums of at most 8 terms are exact in fp32 too.

Inter-node bytes are hand-derived from the routing: a hierarchical dispatch sends one
16-byte header to each other node's rail peer and one wire row (``dispatch_slot_bytes``) per
(token, other node holding one of its experts); a flat all-to-all sends one row per
(token, rank on another node). The combine sends one fp32 row per token received from
each other node. All cases of one layout run in one spawned group (spawning costs seconds).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from dist_utils import run_ok, run_ranks
from routing_cases import placement as make_placement
from routing_cases import with_choice_table

E, H, M, K = 16, 128, 6, 8
ROW = 16 + 32 + 32 + 2 * H  # dispatch_slot_bytes(128, 8, "bf16"): header, ids, weights, bf16
ROW_FP8 = 16 + 32 + 32 + H + 4 * (H // 128) + 12  # fp8 bytes, one fp32 scale, padded to 16
HEADER = 16

# (name, tokens per rank ("many": 1..M, varying), k, payload, placement, share of -1 slots,
#  the low-latency layout also run (with "+hook": through return_recv_hook))
CASES = [
    ("no-tokens", 0, 2, "bf16", "contiguous", 0.0, "rows"),
    ("one-token-k1", 1, 1, "bf16", "contiguous", 0.0, "expert_major"),
    ("many-k2-random", "many", 2, "bf16", "random", 0.0, "rows+hook"),
    ("many-k8-masked", "many", 8, "bf16", "contiguous", 0.3, "expert_major"),
    ("many-k8-fp8", "many", 8, "fp8", "contiguous", 0.2, "expert_major+hook"),
    ("many-k8-redundant", "many", 8, "bf16", "redundant", 0.0, "rows"),
    ("many-k4-table-fp8", "many", 4, "fp8", "table", 0.25, "rows"),
    ("some-ranks-empty-k8", "some", 8, "bf16", "random", 0.1, "expert_major"),
]


def _placement(kind, world):
    if kind == "redundant":  # copies of experts 3 and 5 on both nodes' ranks
        base = make_placement("random", E, world)
        from pcie_a2a.placement import Placement

        return Placement.with_redundant(base, {3: list(range(world)), 5: [0, world - 1]})
    if kind == "table":
        return with_choice_table(make_placement("redundant", E, world))
    return make_placement(kind, E, world)


def _inputs(world, tokens, k, masked, seed):
    g = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for r in range(world):
        if tokens == "many":
            t = int(torch.randint(1, M + 1, (1,), generator=g))
        elif tokens == "some":
            t = 0 if r % 3 == 1 else M
        else:
            t = tokens
        xs.append(torch.randint(-4, 5, (t, H), generator=g).to(torch.bfloat16))
        i = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)]) if t else None
        i = i if i is not None else torch.empty(0, k, dtype=torch.int64)
        i[torch.rand(i.shape, generator=g) < masked] = -1
        ids.append(i)
        ws.append(torch.randint(1, 5, (t, k), generator=g).float() * 0.5)
    return xs, ids, ws


def _expert(x, w):
    """The stand-in expert: x times the sum of the row's (local) weights; exact here."""
    return (x.float() * w.sum(dim=1, keepdim=True)).to(torch.bfloat16)


def _hand_bytes(pl, ids, world, local, rank, num_tokens):
    """(hierarchical dispatch, flat dispatch, hierarchical combine) rows this rank sends to
    other nodes, from the routing with Placement.replica_for (one slot at a time)."""
    node = rank // local
    hier, flat = 0, 0
    for t in range(ids[rank].shape[0]):
        ranks = {pl.replica_for(int(e), rank * M + t, rank)[0] for e in ids[rank][t] if e >= 0}
        flat += sum(1 for r in ranks if r // local != node)
        hier += len({r // local for r in ranks} - {node})
    back = 0  # tokens of my rail peers that have an expert on my node
    for n in range(world // local):
        src = n * local + rank % local
        if n == node:
            continue
        for t in range(num_tokens[src]):
            reps = [pl.replica_for(int(e), src * M + t, src)[0] for e in ids[src][t] if e >= 0]
            back += any(r // local == node for r in reps)
    return hier, flat, back


def _run_case(rank, world, local, case, seed):
    import pcie_a2a
    from pcie_a2a import reference as ref
    from pcie_a2a.internode.buffer import InternodeBuffer

    name, tokens, k, payload, place_kind, masked, ll = case
    pl = _placement(place_kind, world)
    xs, ids, ws = _inputs(world, tokens, k, masked, seed)
    if payload == "fp8" and xs[0].shape[0]:  # one row of random values: a general fp8 row
        xs[0][0] = torch.randn(H, generator=torch.Generator().manual_seed(seed)).bfloat16()
    expected = ref.reference_dispatch(xs, ids, ws, pl, M, K, payload)
    exp = expected[rank]
    nodes = world // local
    with pcie_a2a.Buffer(None, E, H, M, payload=payload, placement=pl, num_topk=K) as buf:
        assert isinstance(buf, InternodeBuffer)
        res = buf.dispatch(xs[rank], ids[rank], ws[rank])
        assert torch.equal(res.src_rank, exp.src_rank), name
        assert torch.equal(res.src_token, exp.src_token), name
        assert torch.equal(res.topk_ids, exp.topk_ids), name
        assert torch.equal(res.topk_weights, exp.topk_weights), name
        assert torch.equal(res.x, exp.x), f"{name}: rows differ"
        assert res.tokens_per_expert_list == exp.tokens_per_expert
        counts = [int((exp.src_rank == s).sum()) for s in range(world)]
        assert res.recv_count.tolist() == counts
        assert res.handle.recv_count_host == counts
        n_tok = [x.shape[0] for x in xs]
        hier, flat, back = _hand_bytes(pl, ids, world, local, rank, n_tok)
        row = ROW_FP8 if payload == "fp8" else ROW
        st = buf.stats()
        assert st["last_internode_bytes"] == (nodes - 1) * HEADER + hier * row, name
        dispatch_bytes = st["last_internode_bytes"]
        if payload == "fp8":  # the same rows as the sender's e4m3 bytes and scales
            raw = buf.dispatch(xs[rank], ids[rank], ws[rank], return_fp8=True)
            if exp.x.shape[0]:
                orig = torch.stack([xs[s][t] for s, t in zip(exp.src_rank, exp.src_token)])
                q, scales = ref.quantize_fp8(orig)
                assert torch.equal(raw.x.view(torch.uint8), q.view(torch.uint8)), name
                assert torch.equal(raw.x_scales, scales), name
        y = _expert(res.x, res.topk_weights)
        out = buf.combine(y, res.handle)
        assert buf.stats()["last_internode_bytes"] == (nodes - 1) * HEADER + back * 4 * H, name
        ys = [_expert(e.x, e.topk_weights) for e in expected]
        want = ref.reference_combine(ys, expected, n_tok, H)[rank]
        assert out.dtype == torch.bfloat16 and torch.equal(out, want), f"{name}: combine"
        _low_latency(buf, ll, xs[rank], ids[rank], ws[rank], exp, want, world, name)
        total = buf.stats()["internode_bytes"]
    return name, hier, flat, dispatch_bytes, total


def _low_latency(buf, ll, x, ids, ws, exp, want, world, name):
    """The low-latency layouts hold the reference rows (as tests/test_dispatch_combine.py
    checks them) and their combine gives the same output."""
    layout, hook = ll.split("+")[0], ll.endswith("+hook")
    res = buf.low_latency_dispatch(x, ids, ws, layout=layout, return_recv_hook=hook)
    res = res() if hook else res
    counts = [int((exp.src_rank == s).sum()) for s in range(world)]
    assert res.recv_count.tolist() == counts and res.tokens_per_expert_list == exp.tokens_per_expert
    valid = torch.cat([torch.arange(s * M, s * M + c) for s, c in enumerate(counts)])
    if layout == "rows":
        assert list(res.x.shape) == [world, M, H]
        assert torch.equal(res.x.reshape(world * M, H)[valid], exp.x), name
        assert torch.equal(res.src_token.reshape(-1)[valid], exp.src_token), name
        assert torch.equal(res.topk_ids.reshape(world * M, K)[valid], exp.topk_ids), name
        assert torch.equal(res.topk_weights.reshape(world * M, K)[valid], exp.topk_weights)
        y = torch.zeros(world * M, H, dtype=torch.bfloat16)
        y[valid] = _expert(exp.x, exp.topk_weights)
        y = y.view(world, M, H)
    else:
        e_local = len(exp.tokens_per_expert)
        assert list(res.x.shape) == [e_local, world * M, H]
        y = torch.zeros(e_local, world * M, H, dtype=torch.bfloat16)
        for e in range(e_local):
            rows = (exp.topk_ids == e).any(dim=1).nonzero().flatten()
            n = rows.numel()
            assert torch.equal(res.x[e, :n], exp.x[rows]), name
            assert torch.equal(res.src_info[e, :n], exp.src_token[rows]), name
            for s in range(world):
                begin = int((exp.src_rank[rows] < s).sum())
                n_s = int((exp.src_rank[rows] == s).sum())
                assert int(res.layout_range[e, s]) == (begin << 32) | n_s, name
            y[e, :n] = res.x[e, :n]  # unweighted output: x; the combine weights and sums
    out = buf.low_latency_combine(y, res.handle, return_recv_hook=hook)
    out = out() if hook else out
    assert torch.equal(out, want), f"{name}: low-latency {layout} combine"


def _checks_then_cases(rank, world, local):
    if local == 2:  # once: each Buffer across nodes makes its gloo groups (seconds on 2 cores)
        _checks(rank, world, local)
    return [_run_case(rank, world, local, c, 100 * world + i) for i, c in enumerate(CASES)]


def _checks(rank, world, local):
    import pcie_a2a
    from pcie_a2a import buffer as buffer_mod

    os.environ["PCIE_A2A_LOCAL_WORLD_SIZE"] = "3"
    with pytest.raises(ValueError, match="PCIE_A2A_LOCAL_WORLD_SIZE: got 3; allowed: a positive"):
        pcie_a2a.Buffer(None, E, H, M, num_topk=K)
    os.environ["PCIE_A2A_LOCAL_WORLD_SIZE"] = str(world)  # one node: the flat Buffer
    with pcie_a2a.Buffer(None, E, H, M, num_topk=K) as flat:
        assert type(flat) is buffer_mod.Buffer and flat.stats()["internode_bytes"] == 0
    os.environ["PCIE_A2A_LOCAL_WORLD_SIZE"] = str(local)
    real = buffer_mod.choose_backend
    buffer_mod.choose_backend = lambda *a: "cuda"  # as on a machine with GPUs
    try:
        with pytest.raises(RuntimeError, match="'cuda' is not available across nodes yet"):
            pcie_a2a.Buffer(None, E, H, M, num_topk=K)
    finally:
        buffer_mod.choose_backend = real
    _bad_input_on_one_rank(rank, world)


def _bad_input_on_one_rank(rank, world):
    """Bad input on one rank: it raises ValueError, every other rank PeerAbortedError naming
    it (and its node); the Buffer stays usable and the call can be made again."""
    import pcie_a2a

    xs, ids, ws = _inputs(world, M, 4, 0.0, 3)
    with pcie_a2a.Buffer(None, E, H, M, num_topk=K) as buf:
        bad_ids = ids[rank].clone()
        if rank == 1:
            bad_ids[0, 0] = E
        try:
            buf.dispatch(xs[rank], bad_ids, ws[rank])
            raise AssertionError("the dispatch with a bad id on rank 1 did not raise")
        except ValueError as exc:
            assert rank == 1 and "topk_ids" in str(exc), exc
        except pcie_a2a.PeerAbortedError as exc:
            assert rank != 1 and "rank 1 (node 0" in str(exc), exc
        res = buf.dispatch(xs[rank], ids[rank], ws[rank])
        y = _expert(res.x, res.topk_weights)
        victim = world - 2  # node 1
        try:
            buf.combine(y[:-1] if rank == victim else y, res.handle)
            raise AssertionError(f"the combine with a bad y on rank {victim} did not raise")
        except ValueError as exc:
            assert rank == victim and "y.shape" in str(exc), exc
        except pcie_a2a.PeerAbortedError as exc:
            assert rank != victim and f"rank {victim} (node 1" in str(exc), exc
        out = buf.combine(y, res.handle)  # the same combine again, on every rank
        _, _, in_rank = buf.get_dispatch_layout(ids[rank])
        assert torch.equal(out.float(), xs[rank].float() * ws[rank].sum(1, keepdim=True))
        assert in_rank.shape == (M, world)


@pytest.mark.parametrize(("nodes", "local"), [(2, 2), (2, 4)])
def test_internode_matches_reference(nodes, local, monkeypatch):
    monkeypatch.setenv("PCIE_A2A_LOCAL_WORLD_SIZE", str(local))
    world = nodes * local
    results = run_ok(world, _checks_then_cases, local, timeout=180)
    by_case = {}
    for per_rank in results:
        for name, hier, flat, _, _ in per_rank:
            h, f = by_case.get(name, (0, 0))
            by_case[name] = (h + hier, f + flat)
    assert [r[0] for r in results[0]] == [c[0] for c in CASES]
    # the dedup: a token with several experts on the other node crosses once
    assert by_case["many-k8-masked"][0] < by_case["many-k8-masked"][1], by_case
    assert by_case["many-k8-redundant"][0] < by_case["many-k8-redundant"][1], by_case
    assert by_case["no-tokens"] == (0, 0)
    assert by_case["one-token-k1"][0] == by_case["one-token-k1"][1]  # one expert: no dedup


def test_nodes_from_hosts_and_local_world_size(monkeypatch):
    from pcie_a2a import env
    from pcie_a2a.internode import find_nodes

    two = find_nodes(["a", "b", "a", "b"])  # ranks interleaved over two hosts
    assert two.ranks == ((0, 2), (1, 3)) and two.hosts == ("a", "b")
    assert two.rail(1) == (2, 3) and two.node_of(3) == 1 and two.local_index(3) == 1
    assert two.describe(2) == "rank 2 (node 0 on host a, local rank 1)"
    split = find_nodes(["h"] * 8, 4)
    assert split.ranks == ((0, 1, 2, 3), (4, 5, 6, 7)) and split.rail(2) == (2, 6)
    assert find_nodes(["h"] * 4).num_nodes == 1
    assert find_nodes(["a", "a", "b", "b"], 1).ranks == ((0,), (1,), (2,), (3,))
    with pytest.raises(ValueError, match="PCIE_A2A_LOCAL_WORLD_SIZE: got 3; allowed: a positive "
                       "divisor of the group size 4"):  # fmt: skip
        find_nodes(["h"] * 4, 3)
    with pytest.raises(ValueError, match="host a has 3 ranks of the 6"):
        find_nodes(["a"] * 3 + ["b"] * 3, 2)
    with pytest.raises(ValueError, match=r"different sizes \(a: 3, b: 1 ranks\)"):
        find_nodes(["a", "a", "a", "b"])
    monkeypatch.setenv("PCIE_A2A_LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="PCIE_A2A_LOCAL_WORLD_SIZE='two': expected an integer"):
        env.local_world_size()
    monkeypatch.setenv("PCIE_A2A_LOCAL_WORLD_SIZE", "2")
    assert env.local_world_size() == 2
    monkeypatch.delenv("PCIE_A2A_LOCAL_WORLD_SIZE")
    assert env.local_world_size() is None


TIMEOUT = 5.0


def _die(rank, world, where):
    import pcie_a2a

    victim = world - 1  # node 1
    with pcie_a2a.Buffer(None, E, H, M, num_topk=K, timeout_s=TIMEOUT) as buf:
        xs, ids, ws = _inputs(world, M, K, 0.0, 7)
        if where == "dispatch" and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            res = buf.dispatch(xs[rank], ids[rank], ws[rank])
            if where == "combine" and rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            start = time.monotonic()
            buf.combine(_expert(res.x, res.topk_weights), res.handle)
        except pcie_a2a.PeerError as exc:
            return time.monotonic() - start, type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("where", ["dispatch", "combine"])
def test_killed_rank_on_other_node_is_named_everywhere(where, monkeypatch):
    monkeypatch.setenv("PCIE_A2A_LOCAL_WORLD_SIZE", "2")
    world = 4
    outcomes = run_ranks(world, _die, where, timeout=90)
    assert not outcomes[-1].ok
    for o in outcomes[:-1]:
        got = o.unwrap()
        assert got is not None, f"rank {o.rank} did not raise"
        elapsed, kind, msg = got
        assert elapsed < TIMEOUT + 2, (o.rank, elapsed, msg)
        assert kind in ("PeerError", "PeerTimeoutError"), (o.rank, kind, msg)
        assert "rank 3 (node 1" in msg, (o.rank, msg)
