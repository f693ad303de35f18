"""``pcie-a2a bench --direction`` and the all-reduce EP arm (bench/arms.py, methods.AllReduceEP),
and the per-pair decisions ``Buffer.stats()`` records. No timing assertions."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_bench import _bench

from dist_utils import run_ok
from pcie_a2a import env
from pcie_a2a.bench import arms
from pcie_a2a.bench.methods import AllReduceEP, expected_output


def test_direction_option_parses_and_names_bad_values(capsys):
    assert arms.parse_directions("auto") == ["auto"]
    assert arms.parse_directions("pull,push,pull") == ["auto", "pull", "push"]
    assert arms.parse_directions("all") == ["auto", "push", "pull"]
    for bad in ("sideways", ""):
        with pytest.raises(SystemExit) as exc:
            arms.parse_directions(bad)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--direction" in err and "auto, push, pull" in err


def test_direction_forced_sets_and_restores_the_knob(monkeypatch):
    monkeypatch.setenv("PCIE_A2A_DIRECTION", "push")
    with env.direction_forced("pull"):
        assert env.direction() == "pull"
    assert os.environ["PCIE_A2A_DIRECTION"] == "push"
    with env.direction_forced("auto"):
        assert env.direction() is None
    assert env.direction() == "push"
    with pytest.raises(ValueError, match="PCIE_A2A_DIRECTION='up'"):
        with env.direction_forced("up"):
            pass
    assert env.direction() == "push"


def _two_ranks(rank: int, world: int):
    import pcie_a2a

    # the all-reduce EP arm: replicated tokens, local experts, all_reduce = the full MoE
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(6)])
    w = torch.rand(6, 3, generator=g)
    out, marks = AllReduceEP(None, world, rank, 8).step(x, ids, w, record=True)
    want = expected_output(x, ids, w, 4)
    err = float((out.float() - want).abs().max() / want.abs().max())
    # a Buffer built without pair_direction takes PCIE_A2A_DIRECTION (the CPU transport has
    # no plan): forced pull, it pulls, and asked for push the arm must not run
    with env.direction_forced("pull"):
        buf = pcie_a2a.Buffer(None, 8, 64, 4, backend="cpu")
    try:
        why = arms.why_not_direction(buf, "push", None)
        push_ok = arms.why_not_direction(buf, "pull", None)
        decisions = buf.stats()["decisions"]
    finally:
        buf.close()
    return err, marks[1] - marks[0], why, push_ok, decisions, buf.stats()["calls"]


def test_allreduce_ep_arm_and_cpu_auto_direction_and_decisions():
    for rank, (err, dispatch_ns, why, push_ok, dec, calls) in enumerate(run_ok(2, _two_ranks)):
        assert err <= 0.02, err  # bf16 partials summed by all_reduce vs the fp32 reference
        assert dispatch_ns == 0  # no dispatch phase: the tokens are replicated
        assert why and "its decisions say pull" in why
        assert push_ok is None
        assert dec["plan"] is None and "CPU transport" in dec["source"]
        assert [(p["src"], p["dst"]) for p in dec["pairs"]] == [(rank, 1 - rank)]
        pair = dec["pairs"][0]
        assert (pair["path"], pair["direction"], pair["engine"], pair["phase"]) == (
            "shm", "pull", "cpu", 0,
        )  # fmt: skip
        assert pair["reason"] == "PCIE_A2A_DIRECTION=pull"
        assert calls == 0  # stats() stays readable after close()


def test_bench_cli_direction_and_allreduce_arms(tmp_path):
    js = tmp_path / "bench.json"
    proc = _bench("--quick", "--world", "2", "--tokens", "4", "--payload", "bf16",
                  "--iters", "3", "--warmup", "0", "--direction", "push,pull",
                  "--json", str(js), "--plot", "none")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not run" not in proc.stderr and "NOT RUN" not in proc.stdout, proc.stdout
    assert "all_reduce [tokens, hidden] bf16" in proc.stdout
    doc = json.loads(js.read_text())
    assert doc["config"]["directions"] == ["auto", "push", "pull"]
    (res,) = doc["results"]
    assert set(res["methods"]) == {"pcie_a2a", "a2a", "ag_rs"}
    got = res["arms"]
    assert set(got) == {"pcie_a2a[push]", "pcie_a2a[pull]", "ar_ep"}
    pull = got["pcie_a2a[pull]"]  # the CPU transport pulls every pair (wire_format.h)
    assert "unavailable" not in pull and pull["max_rel_err"] <= 0.02
    dc = res["methods"]["pcie_a2a"]["phases"]["disp+comb"]["p50_us"]
    push, ar = got["pcie_a2a[push]"], got["ar_ep"]
    assert push["max_rel_err"] <= 0.02 and ar["max_rel_err"] <= 0.02
    assert len(push["phases"]["disp+comb"]["samples_us"]) == res["iters"] == 3
    assert push["over_auto"] == pytest.approx(push["disp+comb_p50_us"] / dc)
    assert ar["allreduce_p50_us"] > 0
    assert ar["allreduce_over_dispatch_combine"] == pytest.approx(ar["allreduce_p50_us"] / dc)
    # the all-reduce moves 2 (W - 1) / W of [tokens, hidden] bf16 per rank
    assert ar["phases"]["combine"]["wire_bytes"] == 4 * 256 * 2


def test_cuda_transport_records_the_plan_per_pair(monkeypatch):
    """CudaTransport.decisions() (host only, no bootstrap): the path it uses (a pair CUDA
    peer access forced to staged says staged), its send-order phase, the plan's entry."""
    from pcie_a2a.transport.cuda import P2P, STAGED, CudaTransport, topology_rank_transfers
    from topology_fixtures import FIXTURES

    box = FIXTURES / "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt"
    monkeypatch.setenv("PCIE_A2A_TOPO_FILE", str(box))
    bus = [f"0000:{b:02x}:00.0" for b in (0x01, 0x21, 0x41, 0x61, 0x81, 0xA1, 0xC1, 0xE1)]
    rp, note = topology_rank_transfers(bus)
    assert rp is not None
    t = CudaTransport.__new__(CudaTransport)
    t.rank, t.world, t.topology_plan, t.topology_note = 2, 8, rp, note
    t.pair_transport = [[P2P if v == "p2p" else STAGED for v in row] for row in rp.pair_transport]
    t.pair_transport[2][5] = STAGED  # as if CUDA reported no peer access
    t.send_order = [list(o) for o in rp.send_order]
    t._resolve_directions(None, rp)  # Buffer(pair_direction=None): the plan's directions
    dec = t.decisions()
    assert dec["source"] == note and dec["plan"] == rp.to_dict()
    assert [p["dst"] for p in dec["pairs"]] == [0, 1, 3, 4, 5, 6, 7]
    for p in dec["pairs"]:
        d = p["dst"]
        assert p["planned"]["direction"] == rp.pair_direction[2][d]
        assert p["planned"]["reason"] == rp.reasons[2][d]
        assert p["path"] == ("staged" if d == 5 else rp.pair_transport[2][d])
        assert p["phase"] == rp.send_order[2].index(d)
        if p["path"] == "staged":  # staged pairs push, whatever the plan says
            assert p["direction"] == "push" and "host-staged" in p["reason"], p
        else:
            assert p["direction"] == rp.pair_direction[2][d], p
            assert p["reason"] == "topology plan (RankTransfers.pair_direction)", p
    assert t._pair_codes()[2] == t.pair_transport[2]  # this fixture's plan pushes (no vendor)
    # an explicit list still wins (and a staged pair still pushes)
    t._resolve_directions([["pull" if s != d else "push" for d in range(8)] for s in range(8)], rp)
    assert [t.pair_direction[2][d] for d in range(8)] == [
        "push" if d == 2 or t.pair_transport[2][d] == STAGED else "pull" for d in range(8)
    ]
    assert t.direction_reasons[2][0] == "explicit Buffer(pair_direction=...)"


def test_cuda_auto_direction_pulls_the_pairs_the_plan_pulls():
    """Buffer(backend="cuda", pair_direction=None): the directions come from the topology
    plan (rank 0's, gathered). On the Broadcom box with AMD hosts the plan pulls the
    cross-root pairs; the transport pulls exactly those, pushes PIX and host-staged pairs,
    and hands the kernels PULL for them."""
    from pcie_a2a.topology import TransferOptions, load, plan_transfers, roots
    from pcie_a2a.topology.ranks import rank_transfers
    from pcie_a2a.transport.cuda import P2P, PULL, STAGED, CudaTransport
    from topology_fixtures import FIXTURES

    box = FIXTURES / "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt"
    topo = roots.with_vendor_hints(load(box), cpu="amd", switch="broadcom")
    bus = [f"0000:{b:02x}:00.0" for b in (0x01, 0x21, 0x41, 0x61, 0x81, 0xA1, 0xC1, 0xE1)]
    rp = rank_transfers(
        topo, plan_transfers(topo, options=TransferOptions(default_link_gen=5)), bus
    )
    t = CudaTransport.__new__(CudaTransport)
    t.rank, t.world = 0, 8
    t.pair_transport = [[P2P if v == "p2p" else STAGED for v in row] for row in rp.pair_transport]
    t._resolve_directions(None, rp)
    pulled = {(s, d) for s in range(8) for d in range(8) if t.pair_direction[s][d] == "pull"}
    planned = {(s, d) for s in range(8) for d in range(8) if rp.pair_direction[s][d] == "pull"}
    assert pulled and pulled == planned, (pulled, planned)
    for s in range(8):
        for d in range(8):
            if rp.pair_transport[s][d] == "staged" or s == d:
                assert t.pair_direction[s][d] == "push"
            code = t._pair_codes()[s][d]
            assert code == (PULL if (s, d) in pulled else t.pair_transport[s][d])
    assert t._with_pull()
    assert t.direction_reasons[0][2] == "topology plan (RankTransfers.pair_direction)"


def test_nccl_ep_arm_says_not_installed(monkeypatch):
    """``bench --backend cuda`` reports NCCL EP in every config: here (no nccl_ep package)
    "not installed" through the real import path, and the report prints it as the arm's
    NOT RUN line; a package without its library, or one that imports, is said so too."""
    import importlib.util
    import sys
    import types

    from pcie_a2a.bench import arms, nccl_ep

    if importlib.util.find_spec("nccl_ep") is not None:
        pytest.skip("nccl_ep is installed here")
    ok, what = nccl_ep.status()
    assert not ok and what == "not installed (import nccl_ep: No module named 'nccl_ep')"
    why = nccl_ep.unavailable_reason()
    ours = {"disp+comb": {"p50_us": 10.0, "p99_us": 12.0}}
    summary = [{"tokens": 8, "payload": "bf16", "routing": "uniform",
                "methods": {"pcie_a2a": {"phases": ours}},
                "arms": arms.summarize(ours, {}, {nccl_ep.ARM: why})}]  # fmt: skip
    assert f"  nccl_ep         NOT RUN: {why}" in arms.lines(summary)
    assert arms.checks(summary, {"bf16": 0.02}) == []
    fake = types.ModuleType("nccl_ep")
    fake.HAVE_NCCL_EP = False
    monkeypatch.setitem(sys.modules, "nccl_ep", fake)
    assert nccl_ep.status() == (
        False, "not installed (the nccl_ep package imports but finds no libnccl_ep.so)"
    )  # fmt: skip
    fake.HAVE_NCCL_EP, fake.__version__ = True, "0.1"
    assert nccl_ep.status() == (True, "nccl_ep 0.1")
    assert nccl_ep.unavailable_reason().startswith("installed (nccl_ep 0.1) but not timed")
