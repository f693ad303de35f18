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
    # a Buffer built without pair_direction pushes: asked for pull, the arm must not run
    with env.direction_forced("pull"):
        buf = pcie_a2a.Buffer(None, 8, 64, 4, backend="cpu")
    try:
        why = arms.why_not_direction(buf, "pull", None)
        push_ok = arms.why_not_direction(buf, "push", None)
        decisions = buf.stats()["decisions"]
    finally:
        buf.close()
    return err, marks[1] - marks[0], why, push_ok, decisions, buf.stats()["calls"]


def test_allreduce_ep_arm_and_cpu_pull_refusal_and_decisions():
    for rank, (err, dispatch_ns, why, push_ok, dec, calls) in enumerate(run_ok(2, _two_ranks)):
        assert err <= 0.02, err  # bf16 partials summed by all_reduce vs the fp32 reference
        assert dispatch_ns == 0  # no dispatch phase: the tokens are replicated
        assert why and "its decisions say push" in why
        assert push_ok is None
        assert dec["plan"] is None and "CPU transport" in dec["source"]
        assert [(p["src"], p["dst"]) for p in dec["pairs"]] == [(rank, 1 - rank)]
        pair = dec["pairs"][0]
        assert (pair["path"], pair["direction"], pair["engine"], pair["phase"]) == (
            "shm", "push", "cpu", 0,
        )  # fmt: skip
        assert "push by default" in pair["reason"]
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
    from pcie_a2a.transport.cuda import P2P, STAGED, CudaTransport, topology_rank_plan
    from topology_fixtures import FIXTURES

    box = FIXTURES / "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt"
    monkeypatch.setenv("PCIE_A2A_TOPO_FILE", str(box))
    bus = [f"0000:{b:02x}:00.0" for b in (0x01, 0x21, 0x41, 0x61, 0x81, 0xA1, 0xC1, 0xE1)]
    rp, note = topology_rank_plan(bus)
    assert rp is not None
    t = CudaTransport.__new__(CudaTransport)
    t.rank, t.world, t.topology_plan, t.topology_note = 2, 8, rp, note
    t.pair_transport = [[P2P if v == "p2p" else STAGED for v in row] for row in rp.pair_transport]
    t.pair_transport[2][5] = STAGED  # as if CUDA reported no peer access
    t.send_order = [list(o) for o in rp.send_order]
    dec = t.decisions()
    assert dec["source"] == note and dec["plan"] == rp.to_dict()
    assert [p["dst"] for p in dec["pairs"]] == [0, 1, 3, 4, 5, 6, 7]
    for p in dec["pairs"]:
        d = p["dst"]
        assert p["planned"]["direction"] == rp.pair_direction[2][d]
        assert p["planned"]["reason"] == rp.reasons[2][d]
        assert p["path"] == ("staged" if d == 5 else rp.pair_transport[2][d])
        assert p["phase"] == rp.send_order[2].index(d)
        assert p["direction"] == "push" and "pull in the protocol is not in yet" in p["reason"]
