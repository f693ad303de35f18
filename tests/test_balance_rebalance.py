"""Measure and apply on 4 CPU ranks: ``Buffer.expert_load`` counts what each rank sent,
the MoE layer's window sums its forwards, and ``MoE.rebalance`` moves the experts to a
balanced placement with redundant copies and a replica choice table, the layer matching
the dense reference before and after (bf16 and INT4 experts), forwards issued right
before and after without a barrier; a placement that differs between ranks is refused on
every rank and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_moe_layer import KIMI_SMALL, KIMI_SMALL_INT4, _Dense, _route

from dist_utils import run_ok
from pcie_a2a import Placement
from pcie_a2a.moe import MoE, random_checkpoint

WORLD, CAP = 4, 32


def _x(step: int, rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 512, generator=g).bfloat16()


def _reference(dense: _Dense, x: torch.Tensor, placement: Placement, source: int, cap: int):
    """(out, tol) as test_moe_layer's reference, with each (token, expert) on the rank the
    wire layer picks for it (replicas and choice table included)."""
    logits = F.linear(x.float(), dense.gate.float())
    wd = _route(dense.cfg, logits, dense.bias)
    xf = x.float()
    gate = torch.einsum("th,eih->tei", xf, dense.w_gate)
    up = torch.einsum("th,eih->tei", xf, dense.w_up)
    y = torch.einsum("tei,ehi->teh", F.silu(gate) * up, dense.w_down) * wd.unsqueeze(-1)
    partials = torch.zeros(x.shape[0], placement.world, x.shape[1])
    for t in range(x.shape[0]):
        for e in wd[t].nonzero().flatten().tolist():
            r, _ = placement.replica_for(e, source * cap + t, source)
            partials[t, r] += y[t, e]
    routed = partials.sum(1)
    g, u, d = dense.shared
    out = routed + (F.silu(xf @ g.t()) * (xf @ u.t())) @ d.t()
    ref = out.bfloat16()
    tol = 2.0**-8 * (partials.abs().sum(1) + routed.abs() + 2 * ref.float().abs()) + 1e-4
    return ref, tol


def _balanced(loads: np.ndarray) -> Placement:
    from pcie_a2a.balance import Islands, Options, balance_layer

    islands = Islands.from_paths([["socket0"], ["socket0"], ["socket1"], ["socket1"]])
    return balance_layer(loads, islands, Options(redundant=8, tokens_per_step=CAP)).placement


def _rank(rank: int, world: int, cfg: dict, seed: int) -> dict:
    import torch.distributed as dist

    out: dict = {}
    moe = MoE.from_config(
        cfg, weights=random_checkpoint(cfg, seed=seed), max_tokens_per_rank=CAP, load_window=4
    )
    sizes = [[20, 3, 32, 9], [32, 32, 0, 17], [5, 30, 11, 2]]
    ys, sent = [], torch.zeros(64, dtype=torch.int64)
    for step, n in enumerate(sizes):
        x = _x(step, rank, n[rank])
        ids, _ = moe.router(x)
        sent += torch.bincount(ids.flatten(), minlength=64)
        ys.append(moe(x, mode="low_latency" if step % 2 else "normal").float().numpy())
    out["load"] = moe.expert_load().tolist()
    out["sent"] = sent.tolist()
    out["buffer_load_after_take"] = moe.buffer.expert_load().tolist()  # the layer took it
    loads = moe.gather_expert_load()
    out["gathered"] = loads.tolist()
    placement = _balanced(loads.sum(0).double().numpy())
    # a placement that differs on one rank: refused everywhere, nothing changes
    wrong = placement if rank else Placement.random_permutation(64, world, seed=1)
    try:
        moe.rebalance(wrong)
        out["wrong"] = "accepted"
    except ValueError as exc:
        out["wrong"] = str(exc)
    out["still_old"] = moe.placement == Placement.contiguous(64, world)
    x = _x(7, rank, 13)
    ys.append(moe(x).float().numpy())  # right before: no barrier
    moe.rebalance(placement)
    ys.append(moe(x).float().numpy())  # right after, same tokens, new placement
    ys.append(moe(_x(8, rank, 32), mode="normal").float().numpy())
    out["ys"] = ys
    out["local_experts"] = moe.local_experts
    out["placement"] = moe.placement.to_dict()
    out["buffer_placement_is_new"] = moe.buffer.placement == placement
    # the weights this rank now holds are those experts' weights
    e0 = moe.local_experts
    if cfg is KIMI_SMALL:
        out["w13"] = moe.experts.w13.float().numpy()
    out["experts_kind"] = type(moe.experts).__name__
    out["num_local"] = moe.experts.num_local_experts == len(e0)
    dist.barrier()
    moe.close()
    return out


def _check(cfg, seed, results):
    dense = _Dense(cfg, random_checkpoint(cfg, seed=seed))
    contiguous = Placement.contiguous(64, WORLD)
    new = Placement.from_dict(results[0]["placement"])
    assert new.choice is not None and sum(len(r) for r in new.replicas) == 72
    sizes = [[20, 3, 32, 9], [32, 32, 0, 17], [5, 30, 11, 2]]
    for r, res in enumerate(results):
        assert Placement.from_dict(res["placement"]) == new and res["buffer_placement_is_new"]
        assert res["local_experts"] == new.local_experts(r) and res["num_local"]
        assert "differs between ranks" in res["wrong"] and "nothing was changed" in res["wrong"]
        assert res["still_old"]
        assert res["load"] == res["sent"]  # the window holds every forward's routing
        assert sum(res["buffer_load_after_take"]) == 0
        assert res["gathered"] == [o["load"] for o in results]
        inputs = [(_x(s, r, sizes[s][r]), contiguous) for s in range(3)]
        inputs += [(_x(7, r, 13), contiguous), (_x(7, r, 13), new), (_x(8, r, 32), new)]
        for i, ((x, pl), y) in enumerate(zip(inputs, res["ys"])):
            if x.shape[0] == 0:
                continue
            ref, tol = _reference(dense, x, pl, r, CAP)
            err = (torch.from_numpy(y) - ref.float()).abs()
            assert bool((err <= tol).all()), (r, i, float(err.max()))
        if "w13" in res:
            want = torch.cat([dense.w_gate, dense.w_up], dim=1)[new.local_experts(r)]
            assert torch.equal(torch.from_numpy(res["w13"]), want.bfloat16().float())


def test_rebalance_bf16_experts_against_dense_reference():
    _check(KIMI_SMALL, 11, run_ok(WORLD, _rank, KIMI_SMALL, 11, timeout=300))


def test_rebalance_int4_experts_against_dense_reference():
    results = run_ok(WORLD, _rank, KIMI_SMALL_INT4, 12, timeout=300)
    assert results[0]["experts_kind"] == "Int4Experts"
    _check(KIMI_SMALL_INT4, 12, results)


def test_buffer_counts_expert_load_only_when_asked():
    """Off by default (the low-latency path's launch budget); on, ids outside the experts are
    left out instead of indexing with them."""
    from pcie_a2a import Buffer

    buf = Buffer.__new__(Buffer)  # only the counting state: no transport needed
    buf.num_experts, buf.device, buf.count_expert_load, buf._load = (
        8,
        torch.device("cpu"),
        False,
        None,
    )
    buf._count_load(torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="count_expert_load = True"):
        buf.expert_load()
    buf.count_expert_load = True
    buf._count_load(torch.tensor([[0, 1], [1, -1], [7, 8], [99, 3]]))
    assert buf.expert_load().tolist() == [1, 2, 0, 1, 0, 0, 0, 1]
    assert buf.expert_load().tolist() == [0] * 8  # reading starts a new count
