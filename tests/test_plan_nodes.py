"""`pcie-a2a plan --nodes N --nic SPEC`: the --nic grammar (good and bad SPECs), the NIC
numbers per class, the multi-node Buffer's bytes and times per MoE layer against a hand
calculation, the configurations that span nodes (and why not), and N = 1 = no --nodes.
About 7 s (three plans; no torch)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pcie_a2a.configplan import cli as plan_cli
from pcie_a2a.configplan import nodes as nd
from pcie_a2a.configplan import report
from pcie_a2a.configplan.api import Inputs, make_plan
from pcie_a2a.configplan.imbalance import uniform
from pcie_a2a.configplan.tables import Tables

BOX = "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_env_topology(monkeypatch):
    monkeypatch.delenv("PCIE_A2A_TOPO_FILE", raising=False)


@pytest.fixture(scope="module")
def kimi2():
    """Kimi K2.6 on 2 nodes of the Broadcom box over 2 x 100G RoCE, no GDR (once)."""
    return make_plan(Inputs(model="kimi-k2.6", topo=BOX, nodes=2, nic="2x100g-roce"))


# ---- --nic ------------------------------------------------------------------------------

# spec -> (count, Gb/s, kind, gdr, NCCL GB/s per node, kind of number). GB/s by hand:
# line rate x 0.6 (the anchor: 15 GB/s measured / 25 GB/s line rate of 2 x 100G), without
# GDR at most 7.5 GB/s per NIC (15 / 2 NICs; 8 GB/s measured on one 400G NIC).
GOOD = [
    ("2x100g-roce", 2, 100, "roce", False, 2 * 12.5 * 0.6, "measured"),  # 15.0: the anchor
    ("2x100g-roce-nogdr", 2, 100, "roce", False, 15.0, "measured"),
    ("2X100G-RoCE", 2, 100, "roce", False, 15.0, "measured"),  # case does not matter
    ("2x100g-roce-gdr", 2, 100, "roce", True, 15.0, "assumed"),  # GDR: not the anchor
    ("1x400g-ib", 1, 400, "ib", False, 7.5, "assumed"),  # 50 x 0.6 = 30, capped at 7.5
    ("1x400g-ib-gdr", 1, 400, "ib", True, 50 * 0.6, "assumed"),  # 30.0
    ("1x25g-eth", 1, 25, "eth", False, 3.125 * 0.6, "assumed"),  # 1.875, under the cap
    ("4x200g-roce-gdr", 4, 200, "roce", True, 4 * 25 * 0.6, "assumed"),  # 60.0
    ("8x10g-eth-nogdr", 8, 10, "eth", False, 8 * 1.25 * 0.6, "assumed"),  # 6.0
]


@pytest.mark.parametrize("spec,count,gbit,kind,gdr,gbps,how", GOOD)
def test_nic_specs(spec, count, gbit, kind, gdr, gbps, how):
    nic = nd.parse_nic(spec)
    assert (nic.count, nic.gbit, nic.kind, nic.gdr) == (count, gbit, kind, gdr)
    got, got_kind, source = nd.node_gbps(nic, Tables())
    assert got == pytest.approx(gbps, rel=1e-12)
    assert got_kind == how
    assert "aikitoria/open-gpu-kernel-modules issue 20" in source
    if how == "assumed":
        assert source.endswith("assumed to reach the same fraction of its line rate") or (
            "; cap: without GPUDirect RDMA NCCL stages through host memory" in source
        )
        assert ", scaled from the line rate: measured once: 2 nodes x 8 RTX 5090" in source


BAD = [
    "",
    "2x100g",  # no kind
    "2x100-roce",  # no g
    "x100g-roce",
    "0x100g-roce",  # 1-8 NICs
    "9x100g-roce",
    "2x99g-roce",  # not a port rate
    "2x100g-rocev2",
    "2x100g-roce-gdr-nogdr",
    "2x100g-roce gdr",
    "2x100g-nvlink",
    "2x100gb-roce",
]


@pytest.mark.parametrize("spec", BAD)
def test_bad_nic_specs_name_the_option_the_value_and_the_form(spec):
    with pytest.raises(ValueError) as e:
        nd.parse_nic(spec)
    msg = str(e.value)
    assert msg.startswith(f"--nic: got {spec!r}; allowed: COUNTxRATEg-KIND[-gdr|-nogdr]")
    assert "2x100g-roce" in msg


def test_eth_has_no_gdr():
    with pytest.raises(ValueError, match=r"--nic: got '1x25g-eth-gdr'; allowed: eth without gdr"):
        nd.parse_nic("1x25g-eth-gdr")


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"nodes": 0, "nic": "2x100g-roce"}, r"--nodes: got 0; allowed: 1 to 64"),
        ({"nodes": 65, "nic": "2x100g-roce"}, r"--nodes: got 65; allowed: 1 to 64"),
        ({"nodes": True, "nic": "2x100g-roce"}, r"--nodes: got True; allowed: an int >= 1"),
        ({"nodes": "2", "nic": "2x100g-roce"}, r"--nodes: got '2'; allowed: an int >= 1"),
        ({"nodes": 2}, r"--nodes 2: needs --nic SPEC"),
        ({"nic": "2x100g-roce"}, r"--nic: got '2x100g-roce' without --nodes"),
        ({"nodes": 1, "nic": "2x100q-roce"}, r"--nic: got '2x100q-roce'; allowed: COUNTx"),
        ({"nodes": 2, "nic": "1x25g-eth-gdr"}, r"allowed: eth without gdr"),
    ],
)
def test_bad_inputs(kw, match):
    with pytest.raises(ValueError, match=match):
        make_plan(Inputs(model="qwen3-30b-a3b", topo=BOX, gpus=2, **kw))


def test_cli_error_and_header_constant(capsys):
    import argparse

    parser = argparse.ArgumentParser(prog="pcie-a2a")
    plan_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", "--topo", BOX, "--nodes", "2", "--nic", "2x100g"])
    assert args.func(args) == 2
    assert "pcie-a2a plan: error: --nic: got '2x100g'; allowed:" in capsys.readouterr().err
    # the header per peer the plan counts is the multi-node Buffer's (which imports torch:
    # read from its source)
    src = (ROOT / "python/pcie_a2a/internode/buffer.py").read_text(encoding="utf-8")
    assert int(re.search(r"^HEADER_BYTES = (\d+)", src, re.M).group(1)) == nd.HEADER_BYTES


# ---- expected rows per token --------------------------------------------------------------


def test_crossing_small_uniform_by_hand():
    # 8 experts, top-2, 2 nodes x 2 ranks (2 experts per rank, 4 per node), uniform:
    # P(a token hits the other node) = 1 - C(4,2)/C(8,2) = 1 - 6/28 = 22/28;
    # P(hits one rank there) = 1 - C(6,2)/C(8,2) = 13/28, two ranks: 26/28 (pcie_a2a flat);
    # per-expert rows to the other node: 2 picks x 1/2 = 1 (the flat a2a's).
    x = nd.crossing(uniform(8), 2, 2, 2)
    assert x.node_rows == pytest.approx(22 / 28, rel=1e-12)
    assert x.rank_rows == pytest.approx(26 / 28, rel=1e-12)
    assert x.expert_rows == pytest.approx(1.0, rel=1e-12)
    assert x.local_hit == pytest.approx((13 / 28, 13 / 28), rel=1e-12)
    # 4 nodes x 1 rank, 8 experts, top-2: each other node is missed with C(6,2)/C(8,2)
    # = 15/28, so 3 x 13/28 = 39/28 nodes per token; per-expert rows 2 x 3/4 = 1.5
    x = nd.crossing(uniform(8), 2, 4, 1)
    assert x.node_rows == pytest.approx(39 / 28, rel=1e-12)
    assert x.expert_rows == pytest.approx(1.5, rel=1e-12)
    assert x.rank_rows == pytest.approx(39 / 28, rel=1e-12)  # one rank per node: the same


# ---- the hand-calculated case: Kimi K2.6, 2 nodes x 8 RTX PRO 6000, 2 x 100G RoCE, no GDR --


def test_kimi_two_nodes_bytes_and_times_by_hand(kimi2):
    q = kimi2.nodes
    assert (q.nodes, q.per_node, q.gpus) == (2, 8, 16)
    lt = {t.concurrency: t for t in q.traffic}[128]
    # C = 128 requests, DP attention over the 2 nodes, the batch scattered over 16 EP
    # ranks: 8 tokens per rank. 384 experts, 192 per node, top-8 distinct picks:
    # P(no pick on the other node) = C(192,8)/C(384,8) = (192/384)(191/383)...(185/377)
    #   = 0.5 x 0.498695 x 0.497382 x 0.496063 x 0.494737 x 0.493404 x 0.492063 x 0.490716
    #   = 0.0036263, so 0.9963737 other nodes per token.
    miss = 1.0
    for i in range(8):
        miss *= (192 - i) / (384 - i)
    assert miss == pytest.approx(math.comb(192, 8) / math.comb(384, 8), rel=1e-12)
    p = 1 - miss
    assert p == pytest.approx(0.9963737, abs=1e-7)
    assert lt.tokens_per_rank == 8 and lt.node_rows == pytest.approx(p, rel=1e-12)
    # the fp8 dispatch wire row (csrc/core/wire_format.h): 16 B header + 8 x 4 B expert ids
    # = 48, + 8 x 4 B weights = 80, + 7168 B payload = 7248, + 7168/128 x 4 B scales = 7472
    row = 16 + 4 * 8 + 4 * 8 + 7168 + 7168 // 128 * 4
    assert row == 7472
    # leaving a node per exchange: 8 ranks x 8 tokens x 0.9963737 rows + one 16 B header
    # per rank and other node: 64 x 0.9963737 x 7472 + 128 = 476,601.9 B; combine: a fp32
    # row of 4 x 7168 = 28,672 B per (token, node): 64 x 0.9963737 x 28672 + 128 = 1,828,481.8
    assert lt.dispatch_bytes == pytest.approx(64 * p * 7472 + 128, rel=1e-12)
    assert lt.dispatch_bytes == pytest.approx(476_601.9, abs=0.1)
    assert lt.combine_bytes == pytest.approx(64 * p * 28672 + 128, rel=1e-12)
    assert lt.combine_bytes == pytest.approx(1_828_481.8, abs=0.1)
    # flat per-expert all-to-all: 64 tokens x 8 picks x 1/2 on the other node x 14,336 B
    # (bf16) = 3,670,016 B each way: 7.7x the dedup'd dispatch
    assert lt.flat_expert_bytes == 64 * 8 // 2 * 14336 == 3_670_016
    # times, NIC 15 GB/s = 15,000 B/µs per node; 2 NCCL rounds (header, rows) x 31 µs;
    # the host bounce: each GPU's eighth, down its link and up the other's, at 53 GB/s:
    #   dispatch wire 476,601.9 / 15,000 = 31.773 µs; bounce 2 x 59,575.2 / 53,000 = 2.248
    #   combine wire 1,828,481.8 / 15,000 = 121.899 µs; bounce 2 x 228,560.2 / 53,000 = 8.625
    d, c = lt.dispatch_hop, lt.combine_hop
    assert (d.latency_us, c.latency_us) == (62.0, 62.0)
    assert d.wire_us == pytest.approx(31.773, abs=1e-3)
    assert d.bounce_us == pytest.approx(2.248, abs=1e-3)
    assert c.wire_us == pytest.approx(121.899, abs=1e-3)
    assert c.bounce_us == pytest.approx(8.625, abs=1e-3)
    assert d.us + c.us == pytest.approx(62 + 31.773 + 2.248 + 62 + 121.899 + 8.625, abs=1e-2)
    # the layer: both hops + the node's exchange (topology planner) + 2 x 5 µs calls, which
    # is what the spanning configuration's step charges per MoE layer
    assert lt.layer_us == pytest.approx(d.us + c.us + lt.intra_us + 10.0, rel=1e-12)
    assert lt.intra_us > 0
    ep = next(r for r in q.results if r.config.name == "TP8xDP2+EP16 pcie_a2a")
    cost = q.env.exchanges.cost(ep.config, 128, q.env)
    assert cost.us == pytest.approx(lt.layer_us, rel=1e-12)
    assert "multi-node Buffer: NCCL hop over 2x100g-roce" in cost.source


def test_pp_send_between_nodes_is_the_nic(kimi2):
    ex = kimi2.nodes.env.exchanges
    # one flow: 1 / (1/15 + 2/53) = 9.578 GB/s (wire, then the bounce at both ends)
    gbps, lat, where = ex.pair(0, 8)
    assert gbps == pytest.approx(1 / (1 / 15 + 2 / 53), rel=1e-12)
    assert gbps == pytest.approx(9.578, abs=1e-3)
    assert lat == 31.0 and where.startswith("node 0 -> node 1 over 2x100g-roce")
    assert ex.pair(9, 10) == kimi2.env.exchanges.pair(1, 2)  # inside node 1: the box's pair
    pp = next(r for r in kimi2.nodes.results if r.config.name == "TP8xPP2")
    _, src = pp.steps[1].sources["pp send"]  # the last one: stage 1 back to stage 0
    assert src.startswith("NCCL send between nodes: node 1 -> node 0 over 2x100g-roce")


def test_spanning_configurations_and_refusals(kimi2):
    q = kimi2.nodes
    names = [r.config.name for r in q.results]
    assert names == [
        "TP8xDP2+EP16 pcie_a2a",
        "DP16+EP16 pcie_a2a",
        "TP8xPP2",
        "TP8xPP2+EP8 all-reduce",
    ]
    for r in q.results:
        assert r.modelled and r.steps[1].tok_s > 0
        if r.config.comm == "pcie_a2a":
            assert not r.runs
            assert all(nd.NOT_BUILT in r.reasons[fw] for fw in ("sglang", "vllm"))
        else:
            assert r.runs and r.reasons == {"sglang": [], "vllm": []}
    ((name, why),) = q.refused
    assert "DeepEP" in name and "need GPUDirect RDMA between nodes" in why
    out = report.text(kimi2)
    section = out.split("across 2 nodes (--nodes 2 --nic 2x100g-roce)")[1]
    assert "no inter-node number has been measured on these boxes" in section
    assert "NIC: 15.0 GB/s per node and direction (measured: 2 x 12.5 GB/s x 0.6" in section
    assert "476,602" in section and "1,828,482" in section and "3,670,016" in section
    assert "TP8xDP2+EP16 pcie_a2a  (x)" in section
    assert "--pp-size 2 --context-length 5120 --nnodes 2 --node-rank $NODE_RANK" in section
    assert "--pipeline-parallel-size 2 --max-model-len 5120 --nnodes 2 --node-rank" in section
    assert "2 separate boxes, each running the one-box recommendation" in section
    assert "  assumed: across 2 nodes: the NIC numbers (measured)" in out.split("\n\n")[0]
    doc = json.loads(report.to_json(kimi2))["nodes"]
    assert doc["nic"]["nccl_gbps"] == 15.0 and doc["nic"]["kind_of_number"] == "measured"
    assert doc["moe_layer"][-1]["dispatch_bytes"] == pytest.approx(476_601.9, abs=0.1)
    assert [c["name"] for c in doc["configurations"]] == names
    pp = doc["configurations"][2]["frameworks"]["sglang"]["launch"]
    assert pp.endswith("--nnodes 2 --node-rank $NODE_RANK --dist-init-addr $HEAD_IP:5000")


def test_gdr_drops_the_bounce_and_changes_the_refusal():
    p = make_plan(Inputs(model="kimi-k2.6", topo=BOX, gpus=4, nodes=2, nic="1x400g-ib-gdr"))
    q = p.nodes
    assert all(t.dispatch_hop.bounce_us == 0 == t.combine_hop.bounce_us for t in q.traffic)
    assert q.gbps == pytest.approx(30.0) and q.gbps_kind == "assumed"
    assert "need NVLink (or xGMI) inside the node" in q.refused[0][1]
    assert not any("host memory" in a for a in q.assumed)
    assert q.results[0].config.name == "TP4xDP2+EP8 pcie_a2a"


def test_one_node_is_the_box():
    base = make_plan(Inputs(model="qwen3-30b-a3b", topo=BOX, gpus=2))
    for kw in ({"nodes": 1}, {"nodes": 1, "nic": "2x100g-roce"}):
        one = make_plan(Inputs(model="qwen3-30b-a3b", topo=BOX, gpus=2, **kw))
        assert one.nodes is None
        assert report.text(one) == report.text(base)
        assert report.to_json(one) == report.to_json(base)
    assert json.loads(report.to_json(base))["nodes"] is None


def test_configplan_does_not_import_torch():
    code = (
        "import sys; import pcie_a2a.configplan.api, pcie_a2a.configplan.nodes, "
        "pcie_a2a.configplan.report; assert 'torch' not in sys.modules"
    )
    env = {"PYTHONPATH": str(ROOT / "python"), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)
