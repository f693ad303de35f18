"""Bytes are the currency: stats() must equal the analytic count of what crossed, and
the per-rank wire format must beat per-expert bf16 all-to-all (what NCCL users send)."""

from __future__ import annotations

import torch

from dist_utils import run_ok

E, H, M, K = 16, 256, 8, 4


def _align(n: int) -> int:
    return (n + 15) // 16 * 16


def dispatch_slot_bytes(hidden: int, num_topk: int, payload: str) -> int:
    """The slot of wire_format.h, derived independently: header, ids, weights, payload."""
    head = 16 + _align(4 * num_topk) + _align(4 * num_topk)
    if payload == "fp8":
        return head + _align(hidden) + _align(4 * (hidden // 128))
    return head + _align(2 * hidden)


FLAG_BYTES = 16  # the flag word and the op code, per (source, receiver) and call


def _fixed_routing(rank, world):
    # token t of rank r goes to experts (t + r + j * 5) % E: fixed, easy to count by hand
    t = 6
    ids = torch.tensor([[(i + rank + j * 5) % E for j in range(K)] for i in range(t)])
    return torch.ones(t, H, dtype=torch.bfloat16), ids, torch.full((t, K), 0.25)


def _measure(rank, world, payload):
    import pcie_a2a

    with pcie_a2a.Buffer(None, E, H, M, payload=payload, num_topk=K) as buf:
        x, ids, w = _fixed_routing(rank, world)
        res = buf.dispatch(x, ids, w)
        d = buf.stats()
        buf.combine(res.x.clone(), res.handle)
        c = buf.stats()
        return (
            d["last_bytes_per_rank"],
            c["last_bytes_per_rank"],
            c["total_wire_bytes"],
            res.recv_count.tolist(),
        )


def _expected_rows(world):
    """rows[s][d]: tokens rank s sends to rank d (each token once per destination rank)."""
    per = E // world
    rows = [[0] * world for _ in range(world)]
    for s in range(world):
        _, ids, _ = _fixed_routing(s, world)
        for row in ids.tolist():
            for d in {e // per for e in row}:
                rows[s][d] += 1
    return rows


def test_stats_equal_the_analytic_byte_count():
    world = 4
    for payload in ("bf16", "fp8"):
        results = run_ok(world, _measure, payload)
        rows = _expected_rows(world)
        slot = dispatch_slot_bytes(H, K, payload)
        for s, (disp, comb, total_wire, recv) in enumerate(results):
            assert recv == [rows[r][s] for r in range(world)]
            assert disp == [rows[s][d] * slot + FLAG_BYTES for d in range(world)]
            assert comb == [rows[d][s] * _align(2 * H) + FLAG_BYTES for d in range(world)]
            wire = sum(disp[d] + comb[d] for d in range(world) if d != s)
            assert total_wire == wire


def kimi_decode_bytes(world=8, hidden=7168, experts=384, topk=8, tokens=128, seed=0):
    """Bytes one decode step puts on the links, ours vs per-expert bf16 all-to-all."""
    g = torch.Generator().manual_seed(seed)
    per = experts // world
    ours = theirs = 0
    for s in range(world):
        for _ in range(tokens):
            ex = torch.randperm(experts, generator=g)[:topk].tolist()
            remote_ranks = {e // per for e in ex} - {s}
            remote_experts = [e for e in ex if e // per != s]
            ours += len(remote_ranks) * (
                dispatch_slot_bytes(hidden, topk, "fp8") + _align(2 * hidden)
            )
            theirs += len(remote_experts) * 2 * hidden * 2  # bf16 there and back
    return ours, theirs


def test_kimi_decode_wire_bytes_vs_per_expert_all_to_all():
    ours, theirs = kimi_decode_bytes()
    ratio = ours / theirs
    print(
        f"\nKimi K2 decode step (8 ranks, 128 tokens/rank, H=7168, top-8 of 384): "
        f"pcie_a2a fp8 dispatch + bf16 combine {ours / 1e6:.1f} MB vs per-expert bf16 "
        f"all-to-all {theirs / 1e6:.1f} MB: ratio {ratio:.3f}"
    )
    # ~5.25 rank copies instead of 8 expert copies, and fp8 halves dispatch: ~0.5
    assert 0.40 < ratio < 0.55
