"""Pull per ordered pair on the CPU transport (the oracle), and the reuse rule of pulled
pairs (csrc/core/wire_format.h: "Reuse invariant").

In pull, a sender stages its rows in its own segment and release-stores the (seq, count)
flag into the receiver's memory; the receiver loads the rows from the sender's segment and
then release-stores a consumed flag into the sender's memory, which the sender waits for
before it stages into the same parity again. The direct tests drive two transports of one
process by hand (a sender two calls ahead of a slow reader, what real ranks cannot do) and
seed the slips: reuse before consumed, wrong consumed epoch. The distributed tests run
every dispatch/combine case of tests/test_dispatch_combine.py with mixed push/pull pairs in
one call and compare bit for bit with pcie_a2a.reference.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch
from test_dispatch_combine import CASES, _run_case

from dist_utils import run_ok
from pcie_a2a import _native

W, H, M, K = 2, 64, 4, 2
OP_DISPATCH = 1
MUTATION = {"none": 0, "reuse_before_consumed": 1, "wrong_consumed_epoch": 2}


def _pair(pull_matrix, timeout_s=0.3):
    t = _native.transport()
    prefix = f"pcie_a2a.{os.getpid()}_{uuid.uuid4().hex[:8]}"
    flat = [int(d == "pull") for row in pull_matrix for d in row]
    ranks = [t.ShmTransport(prefix, r, W, H, M, K, 0, 0, flat, timeout_s) for r in range(W)]
    for r in ranks:
        r.attach_peers()
    return t, ranks


def _send(t, sender, seq, parity, value):
    """One row of `value` to expert 1 (rank 1)."""
    x = torch.full((1, H), value, dtype=torch.bfloat16)
    ids = torch.tensor([[1, -1]], dtype=torch.int32)
    w = torch.ones(1, 2)
    placement = t.Placement([0, 1, 2], [0, 1], [0, 0], W)
    send_token = torch.empty(W * M, dtype=torch.int32)
    send_count = torch.empty(W, dtype=torch.int32)
    sender.dispatch_send(
        seq, OP_DISPATCH, parity, x.data_ptr(), 1, ids.data_ptr(), w.data_ptr(), 2, placement,
        send_token.data_ptr(), send_count.data_ptr(),
    )  # fmt: skip


def _receive(receiver, seq, parity):
    """Rank 1 waits for call `seq` and reads it; returns the value of rank 0's row."""
    assert receiver.wait(seq, OP_DISPATCH, 1.0) == [1, 1]
    return _unpack(receiver, parity)


def _unpack(receiver, parity):
    """Rank 1 reads the rows of a call whose flags it has seen (one from each rank)."""
    c = torch.tensor([1, 1], dtype=torch.int32)
    base = torch.tensor([0, 1], dtype=torch.int64)
    x = torch.empty(2, H, dtype=torch.bfloat16)
    src_rank, src_token = torch.empty(2, dtype=torch.int32), torch.empty(2, dtype=torch.int32)
    ids, ws = torch.empty(2, K, dtype=torch.int32), torch.empty(2, K)
    per_expert = torch.zeros(1, dtype=torch.int32)
    receiver.unpack_rows(
        parity, c.data_ptr(), base.data_ptr(), x.data_ptr(), 0, 0, src_rank.data_ptr(),
        src_token.data_ptr(), ids.data_ptr(), ws.data_ptr(), 1, per_expert.data_ptr(),
    )  # fmt: skip
    assert src_rank.tolist() == [0, 1]
    return float(x[0, 0])


PULL_0_TO_1 = [["push", "pull"], ["push", "push"]]  # rank 1 pulls rank 0's rows


def test_pulled_rows_are_staged_in_the_senders_segment_and_read_after_the_flag():
    t, (r0, r1) = _pair(PULL_0_TO_1)
    try:
        assert r1.pulls(0, 1) and not r1.pulls(1, 0)
        _, _, push_total = t.slot_bytes(W, H, M, K, 0, 0)
        assert r0.segment_bytes > push_total  # it holds the pull send slots too
        _send(t, r0, seq=1, parity=1, value=1.0)
        _send(t, r1, seq=1, parity=1, value=-1.0)
        assert r0.last_bytes()[1] == r0.dispatch_slot_bytes + 16  # counted on the 0 -> 1 link
        assert _receive(r1, seq=1, parity=1) == 1.0
        assert r1.last_bytes()[0] == 16 + 8  # its flag, then the consumed flag, to rank 0
    finally:
        r0.close()
        r1.close()


@pytest.mark.parametrize("mutation", ["none", "reuse_before_consumed"])
def test_sender_waits_for_a_slow_reader_before_reusing_its_send_slots(mutation):
    """Rank 0 stages call 1, then call 3 into the same parity while rank 1 has not read call
    1's rows yet (a slow reader: it has seen the ready flag). The consumed wait stops rank 0 with an error naming rank 1 and
    call 1's rows survive; with the wait removed (the seeded slip) rank 0 overwrites them
    and rank 1 reads call 3's rows as call 1's."""
    t, (r0, r1) = _pair(PULL_0_TO_1)
    try:
        r0._set_pull_mutation(MUTATION[mutation])
        _send(t, r0, seq=1, parity=1, value=1.0)
        _send(t, r1, seq=1, parity=1, value=-1.0)
        assert r1.wait(1, OP_DISPATCH, 1.0) == [1, 1]
        if mutation == "none":
            with pytest.raises(t.PeerTimeoutError, match="waiting for rank 1 to consume .* call 1"):
                _send(t, r0, seq=3, parity=1, value=3.0)
        else:
            _send(t, r0, seq=3, parity=1, value=3.0)
        got = _unpack(r1, parity=1)
        assert got == (1.0 if mutation == "none" else 3.0)
    finally:
        r0.close()
        r1.close()


@pytest.mark.parametrize("mutation", ["none", "wrong_consumed_epoch"])
def test_consumed_flag_releases_the_sender(mutation):
    """Once rank 1 has read call 1 its consumed flag lets rank 0 stage call 3 into the same
    parity at once. A reader that stores the wrong epoch (seq - 1) leaves rank 0 waiting:
    it times out naming rank 1 instead of reusing."""
    t, (r0, r1) = _pair(PULL_0_TO_1)
    try:
        r1._set_pull_mutation(MUTATION[mutation])
        _send(t, r0, seq=1, parity=1, value=1.0)
        _send(t, r1, seq=1, parity=1, value=-1.0)
        assert _receive(r1, seq=1, parity=1) == 1.0
        if mutation == "none":
            _send(t, r0, seq=3, parity=1, value=3.0)
            _send(t, r1, seq=3, parity=1, value=-3.0)
            assert _receive(r1, seq=3, parity=1) == 3.0
        else:
            with pytest.raises(t.PeerTimeoutError, match="rank 1"):
                _send(t, r0, seq=3, parity=1, value=3.0)
    finally:
        r0.close()
        r1.close()


@pytest.mark.parametrize(
    "flat, match",
    [
        ([0, 1, 0], "world x world = 4 entries, got 3"),
        ([1, 0, 0, 0], r"pair_direction\[0\]\[0\]: a rank cannot pull from itself"),
        ([0, 2, 0, 0], r"pair_direction\[0\]\[1\] must be 0 \(push\) or 1 \(pull\), got 2"),
    ],
)
def test_bad_pull_matrix_is_refused(flat, match):
    t = _native.transport()
    prefix = f"pcie_a2a.{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with pytest.raises(ValueError, match=match):
        t.ShmTransport(prefix, 0, W, H, M, K, 0, 0, flat, 1.0)
    assert not os.path.exists("/dev/shm" + t.ShmTransport.segment_name(prefix, 0))


# ---- distributed: mixed pairs against the reference ------------------------------------


def _mixed(world, seed):
    """Every rank has pushed and pulled sources, and some pairs differ by direction."""
    gen = torch.Generator().manual_seed(seed)
    pull = torch.rand(world, world, generator=gen) < 0.5
    pull[0, 1], pull[1, 0] = True, False  # a mixed pair for sure
    return [
        ["pull" if pull[s, d] and s != d else "push" for d in range(world)] for s in range(world)
    ]


def _all_pull(world):
    return [["push" if s == d else "pull" for d in range(world)] for s in range(world)]


def _cases_with(rank, world, direction):
    import pcie_a2a

    done = []
    for i, case in enumerate(CASES):
        try:
            done.append(_run_case(rank, world, case, 7000 + i, pair_direction=direction))
        except AssertionError as exc:
            raise AssertionError(f"case {case[0]} (world {world}, pull): {exc}") from exc
    with pytest.raises(ValueError, match=r"pair_direction\[1\]\[1\]: got 'pull'"):
        bad = [["push"] * world for _ in range(world)]
        bad[1][1] = "pull"
        pcie_a2a.Buffer(None, 16, 256, 4, pair_direction=bad)
    with pytest.raises(ValueError, match="pair_direction: got"):
        pcie_a2a.Buffer(None, 16, 256, 4, pair_direction=[["push"]])
    return done


def _planned(monkeypatch):
    """The planner's own per-pair decisions for the 4x L40S fixture, with PCIE_A2A_PAIRS
    pulling some P2P pairs (one pair pulled one way and pushed the other; staged pairs
    push): what a Buffer built from RankTransfers.pair_direction receives."""
    from pcie_a2a.topology import TransferOptions, load, plan_transfers
    from pcie_a2a.topology.ranks import rank_transfers
    from topology_fixtures import FIXTURES

    monkeypatch.setenv("PCIE_A2A_PAIRS", "0-1:pull,1-0:push,2-3:pull,3-2:pull,1-3:pull")
    topo = load(FIXTURES / "4x-l40s-dual-socket.topo.txt")
    p = plan_transfers(topo, options=TransferOptions.from_env())
    rp = rank_transfers(topo, p, [f"0000:{0x01 + 0x20 * i:02x}:00.0" for i in range(4)])
    assert rp.pair_direction[0][1] == "pull" and rp.pair_direction[1][0] == "push"
    assert rp.pair_direction[1][3] == "push"  # a staged pair pushes
    return rp.pair_direction


@pytest.mark.parametrize("world, kind", [(2, "all_pull"), (4, "planned")])
def test_mixed_push_pull_pairs_match_reference(world, kind, monkeypatch):
    direction = _all_pull(world) if kind == "all_pull" else _planned(monkeypatch)
    results = run_ok(world, _cases_with, direction, timeout=300)
    assert all(r == [c[0] for c in CASES] for r in results)


def _rounds(rank, world, direction, rounds):
    """Many calls on one Buffer (pull slots of both parities reused under the consumed
    guard), rank 1 a slow reader (its receive hook runs late), mixed with low-latency calls;
    every call compared exactly with the reference, and the bytes per link with push."""
    import time

    import pcie_a2a
    from pcie_a2a import reference as ref
    from routing_cases import inputs, placement

    E, Hd, Mt, Kt = 16, 128, 8, 4
    pl = placement("random", E, world)
    kw = dict(placement=pl, num_topk=Kt, timeout_s=20.0)
    with (
        pcie_a2a.Buffer(None, E, Hd, Mt, pair_direction=direction, **kw) as buf,
        pcie_a2a.Buffer(None, E, Hd, Mt, **kw) as push_buf,
    ):
        for i in range(rounds):
            xs, ids, ws = inputs(world, E, Hd, Mt, Kt, "uniform", 100 * world + i)
            expected = ref.reference_dispatch(xs, ids, ws, pl, Mt, Kt)
            exp = expected[rank]
            ys = [(e.x.float() * (r + 2)).to(torch.bfloat16) for r, e in enumerate(expected)]
            want = ref.reference_combine(ys, expected, [x.shape[0] for x in xs], Hd)[rank]
            if i % 2 == 0:
                res = buf.dispatch(xs[rank], ids[rank], ws[rank])
                pushed = push_buf.dispatch(xs[rank], ids[rank], ws[rank])
                flags = [
                    8 if s != rank and direction[s][rank] == "pull" else 0 for s in range(world)
                ]
                got = buf.stats()["last_bytes_per_rank"]
                assert got == [
                    b + f for b, f in zip(push_buf.stats()["last_bytes_per_rank"], flags)
                ]
                push_buf.combine(pushed.x, pushed.handle)
                assert torch.equal(res.x, exp.x) and torch.equal(res.src_token, exp.src_token)
                out = buf.combine(res.x * (rank + 2), res.handle)
            else:
                hook = buf.low_latency_dispatch(
                    xs[rank], ids[rank], ws[rank], layout="rows", return_recv_hook=True
                )
                if rank == 1:
                    time.sleep(0.05)  # the slow reader: its peers' next calls must wait
                res = hook()
                counts = res.recv_count.tolist()
                valid = torch.cat([torch.arange(s * Mt, s * Mt + c) for s, c in enumerate(counts)])
                assert torch.equal(res.x.reshape(world * Mt, Hd)[valid], exp.x)
                y = torch.zeros(world * Mt, Hd, dtype=torch.bfloat16)
                y[valid] = ys[rank]
                out = buf.low_latency_combine(y.view(world, Mt, Hd), res.handle)
            assert torch.equal(out, want), f"round {i}: combine differs from the reference"
    return rounds


def test_many_calls_with_a_slow_reader_reuse_pull_slots_safely():
    world = 4
    assert run_ok(world, _rounds, _mixed(world, seed=11), 8, timeout=300) == [8] * world


def _auto_from_env(rank, world):
    """Buffer(pair_direction=None) with PCIE_A2A_DIRECTION=pull: the CPU transport resolves
    every pair to pull by itself (no plan), says why, and the calls match the reference."""
    import pcie_a2a

    with pcie_a2a.Buffer(None, 16, 256, 4) as buf:
        used = buf.pair_direction
        pairs = buf.stats()["decisions"]["pairs"]
    assert used == tuple(tuple(r) for r in _all_pull(world)), used
    assert {(p["direction"], p["reason"]) for p in pairs} == {("pull", "PCIE_A2A_DIRECTION=pull")}
    return [_run_case(rank, world, case, 7100 + i) for i, case in enumerate(CASES[:2])]


def test_auto_direction_takes_the_environment_on_the_cpu(monkeypatch):
    monkeypatch.setenv("PCIE_A2A_DIRECTION", "pull")
    assert run_ok(2, _auto_from_env, timeout=300) == [[c[0] for c in CASES[:2]]] * 2
