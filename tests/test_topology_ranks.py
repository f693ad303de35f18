"""Ranks -> topology GPUs -> the CUDA transport's per-rank plan (pcie_a2a.topology.ranks),
on the real boxes of the fixture set."""

from __future__ import annotations

import pytest

from pcie_a2a.topology import load, plan_transfers
from pcie_a2a.topology.ranks import match_ranks, normalise_bus_id, rank_transfers
from topology_fixtures import FIXTURES

BROADCOM = "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt"
XEON_4090 = "8x-rtx4090-dual-xeon-broadcom-pix.topo.txt"
L40S = "4x-l40s-dual-socket.topo.txt"
AZURE_XML = "4x-a100-pcie-azure-ncv4.nccl-topo.xml.txt"

# Eight bus ids in PCI order (GPU i of a topo -m file is the i-th), handed to ranks shuffled.
BUS = ["0000:01:00.0", "0000:21:00.0", "0000:41:00.0", "0000:61:00.0",
       "0000:81:00.0", "0000:a1:00.0", "0000:c1:00.0", "0000:e1:00.0"]  # fmt: skip
SHUFFLE = [5, 0, 7, 2, 1, 6, 3, 4]  # rank r runs on GPU SHUFFLE[r]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("0000:41:00.0", "0000:41:00.0"),
        ("00000000:41:00.0", "0000:41:00.0"),
        ("0000:C1:00.0", "0000:c1:00.0"),
        ("41:00.0", "0000:41:00.0"),
        (" 0001:00:00.0 ", "0001:00:00.0"),
    ],
)
def test_normalise_bus_id(text, want):
    assert normalise_bus_id(text) == want


@pytest.mark.parametrize("name", [BROADCOM, XEON_4090])
def test_one_rank_per_gpu_follows_the_plan(name):
    t = load(FIXTURES / name)
    p = plan_transfers(t)
    rp = rank_transfers(t, p, [BUS[g] for g in SHUFFLE])
    assert rp.gpus == tuple(SHUFFLE) and "bus order" in rp.how
    for s in range(8):
        for d in range(8):
            want = "p2p" if s == d else p.pair(SHUFFLE[s], SHUFFLE[d]).transport
            assert rp.pair_transport[s][d] == want, (s, d)
        order = rp.send_order[s]
        assert sorted(order) == list(range(8)) and order[-1] == s
        # round r: this rank's GPU sends to the GPU the planner scheduled
        assert [SHUFFLE[d] for d in order[:-1]] == [rnd[SHUFFLE[s]] for rnd in p.rounds]
    assert rp.staging_numa == tuple(t.gpus[g].numa_node for g in SHUFFLE)
    assert {"p2p", "staged"} >= {x for row in rp.pair_transport for x in row}


def test_staged_pairs_stage_on_the_receivers_node():
    t = load(FIXTURES / XEON_4090)
    p = plan_transfers(t)
    rp = rank_transfers(t, p, BUS)
    staged = [(s, d) for s in range(8) for d in range(8) if rp.pair_transport[s][d] == "staged"]
    assert staged, "this box has staged pairs (SYS)"
    for s, d in staged:
        assert p.pair(s, d).staging_node == rp.staging_numa[d] == t.gpus[d].numa_node


def test_two_ranks_per_gpu():
    t = load(FIXTURES / L40S)
    p = plan_transfers(t)
    ids = [BUS[r // 2] for r in range(8)]  # ranks 0,1 on GPU 0; 2,3 on GPU 1; ...
    rp = rank_transfers(t, p, ids)
    assert rp.gpus == (0, 0, 1, 1, 2, 2, 3, 3)
    assert rp.pair_transport[0][1] == rp.pair_transport[7][6] == "p2p"  # IPC on one GPU
    assert rp.pair_transport[0][7] == p.pair(0, 3).transport
    assert rp.send_order[3] == (4, 5, 6, 7, 0, 1, 2, 3)  # not one to one: default order


def test_bus_ids_of_the_topology_are_used_when_it_has_them():
    t = load(FIXTURES / AZURE_XML)
    ids = ["00000003:00:00.0", "0001:00:00.0", "0004:00:00.0", "0002:00:00.0"]
    gpus, how = match_ranks(t, ids)
    assert gpus == [2, 0, 3, 1] and how == "by PCI bus id"
    with pytest.raises(ValueError, match=r"GPUs 0009:00:00.0 of the ranks are not in"):
        match_ranks(t, ["0001:00:00.0", "0009:00:00.0"])


def test_index_only_topology_needs_every_gpu():
    t = load(FIXTURES / BROADCOM)
    with pytest.raises(ValueError, match=r"has 8, but the ranks use 2: cannot tell"):
        match_ranks(t, BUS[:2])


def test_plan_of_another_topology_is_refused():
    with pytest.raises(ValueError, match="the plan has 4 GPUs, the topology 8"):
        rank_transfers(load(FIXTURES / BROADCOM), plan_transfers(load(FIXTURES / L40S)), BUS)
