"""Planner decisions on real boxes (shared/fixtures/topology), the send schedule, the
traffic prediction, overrides, purity, and plan JSON round trips."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pcie_a2a.topology import (
    P2PStatus,
    Traffic,
    TransferOptions,
    TransferPlan,
    expected_distinct_ranks,
    format_plan,
    kimi_k2_decode,
    load,
    parse_p2p_test,
    parse_topo,
    plan_transfers,
)
from pcie_a2a.topology.nccl_log import parse_nccl_paths
from topology_fixtures import FIXTURES

BROADCOM = "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx"
XEON_4090 = "8x-rtx4090-dual-xeon-broadcom-pix"
ALL_SYS = "8x-rtx4090-dual-socket-all-sys"
THREADRIPPER = "8x-rtxpro6000-threadripper-3switch-pxb"
NVLINK = "8x-a100-pcie-nvlink-bridge-pairs"


def topo(name: str, suffix: str = ".topo.txt"):
    return load(FIXTURES / (name + suffix))


def probe(name: str):
    return parse_p2p_test((FIXTURES / (name + ".p2p.txt")).read_text(), name)


def pairs(n: int):
    return [(a, b) for a in range(n) for b in range(n) if a != b]


def shared_load(p: TransferPlan, rounds) -> int:
    """Most flows on one shared link in any round, for any schedule over plan p's paths."""
    shared = {lk.id for lk in p.links if lk.shared}
    worst = 0
    for rnd in rounds:
        count: dict[str, int] = {}
        for a, b in enumerate(rnd):
            for lid in p.pair(a, b).links:
                if lid in shared:
                    count[lid] = count.get(lid, 0) + 1
        worst = max([worst, *count.values()])
    return worst


def naive_rounds(n: int):
    return [tuple((i + r) % n for i in range(n)) for r in range(1, n)]


def cross_socket_per_round(p: TransferPlan, sockets: list[int]) -> list[int]:
    return [
        sum(1 for a, b in enumerate(rnd) if sockets[a] == 0 and sockets[b] == 1) for rnd in p.rounds
    ]


def test_broadcom_box_measured_p2p_everywhere_and_cross_socket_spread():
    t = topo(BROADCOM)
    # p2pBandwidthLatencyTest numbers (no loads, no patterns), vendors not in topo -m: every
    # pair pushes, and the cross-root pushes of the four 2-GPU switches are phased.
    opts = TransferOptions(probe=probe(BROADCOM), default_link_gen=5)
    p = plan_transfers(t, kimi_k2_decode(8), opts)
    assert all(q.transport == "p2p" and q.direction == "push" for q in p.pairs)
    assert p.pair(0, 4).reason == "measured P2P 47.0 GB/s >= staged 28.5 (table)"
    assert (p.pair(0, 1).gbps, p.pair(0, 1).latency_us) == (51.0, 0.73)
    assert p.phased and p.collapse_violations == 0
    # Keeping each switch on one destination root complex per round costs the socket link
    # one flow: 4 in the busiest round instead of 3.
    sockets = [0, 0, 0, 0, 1, 1, 1, 1]
    assert sum(cross_socket_per_round(p, sockets)) == 16
    assert p.max_shared_load == 4 == shared_load(p, p.rounds)
    # Without the trigger rule (PCIE_A2A_SCHEDULE=spread): 16 cross-socket flows per
    # direction over 7 rounds, at best 3 in the busiest round; sending in index order
    # (i -> i + r) puts all 4 of a socket's GPUs across in round 4.
    spread = plan_transfers(t, kimi_k2_decode(8), replace(opts, schedule="spread"))
    assert max(cross_socket_per_round(spread, sockets)) == 3
    assert sum(cross_socket_per_round(spread, sockets)) == 16
    assert shared_load(p, naive_rounds(8)) == 4
    assert spread.max_shared_load == 3 == shared_load(spread, spread.rounds)
    assert not spread.phased and spread.collapse_violations > 0
    dispatch = spread.reports[0]
    assert dispatch.bottleneck in ("socket0->1", "socket1->0")
    assert dispatch.predicted_us >= dispatch.bottleneck_us > 0


def test_broadcom_box_without_measurement_stages_sys_on_receiver_node():
    p = plan_transfers(topo(BROADCOM))
    for q in p.pairs:
        cross = (q.src < 4) != (q.dst < 4)
        assert q.transport == ("staged" if cross else "p2p")
        assert q.staging_node == ((1 if q.dst >= 4 else 0) if cross else None)
    assert p.pair(0, 1).path_class == "PIX" and p.pair(0, 2).path_class == "NODE"
    everything = plan_transfers(topo(BROADCOM), options=TransferOptions(p2p_level="SYS"))
    assert all(q.transport == "p2p" for q in everything.pairs)


def test_dual_xeon_4090_driver_disabled_p2p_stages_on_receiver_node():
    t = topo(XEON_4090)
    # Evidence in the NCCL log of the same box: same-switch pairs (PIX in topo -m) were
    # rerouted through the CPU (PHB), i.e. NVML reported P2P off for these GeForce boards.
    paths = parse_nccl_paths((FIXTURES / (XEON_4090 + ".nccl-paths.txt")).read_text())
    buses = ["4e000", "4f000", "50000", "51000", "ce000", "cf000", "d0000", "d1000"]
    rerouted = [
        (buses.index(a), buses.index(b))
        for (a, b), (_, _, typ) in paths.items()
        if a != b and typ == "PHB" and t.classes[buses.index(a)][buses.index(b)] == "PIX"
    ]
    assert len(rerouted) >= 12
    t = t.with_p2p(P2PStatus.DISABLED)
    p = plan_transfers(t, kimi_k2_decode(8))
    assert all(
        q.transport == "staged" and q.reason == "driver reports P2P disabled" for q in p.pairs
    )
    assert all(q.staging_node == (0 if q.dst < 4 else 1) for q in p.pairs)
    forced = plan_transfers(t, options=TransferOptions(p2p=True))
    assert all(q.transport == "staged" for q in forced.pairs)
    assert forced.pair(0, 1).reason.endswith("PCIE_A2A_P2P=1 cannot override the driver")
    assert p.pair(0, 1).gbps == 13.0 and p.pair(0, 1).latency_us == 14.0  # Gen4 staged table


def test_all_sys_box():
    t = topo(ALL_SYS)
    p = plan_transfers(t)
    assert all(q.transport == "staged" and q.reason.startswith("SYS crosses") for q in p.pairs)
    assert [p.pair((d + 1) % 8, d).staging_node for d in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert max(cross_socket_per_round(p, [0, 0, 0, 0, 1, 1, 1, 1])) == 3
    forced = plan_transfers(t, options=TransferOptions(p2p_level="SYS"))
    assert all(q.transport == "p2p" for q in forced.pairs)
    assert forced.pair(0, 1).reason == (
        "PCIE_A2A_P2P_LEVEL=SYS allows SYS; P2P status unknown here, checked when the transport connects"
    )


def test_threadripper_three_switches_all_p2p_and_uplinks_spread():
    t = topo(THREADRIPPER)
    p = plan_transfers(
        t, kimi_k2_decode(8), TransferOptions(probe=probe(THREADRIPPER), default_link_gen=5)
    )
    assert all(q.transport == "p2p" and q.staging_node is None for q in p.pairs)
    assert {p.pair(0, b).path_class for b in range(1, 8)} == {"PIX", "PXB", "NODE"}
    assert p.pair(0, 5).gbps == 52.0 and p.pair(0, 5).latency_us == 0.53
    # A root switch serves 4 GPUs that send 16 flows to the other root over 7 rounds.
    assert p.max_shared_load == 3 == shared_load(p, p.rounds)
    assert shared_load(p, naive_rounds(8)) == 4
    # PIX traffic never leaves its leaf switch.
    assert p.pair(0, 1).links == ("GPU0^", "GPU1v")


def test_nvlink_pairs_preferred():
    p = plan_transfers(topo(NVLINK), kimi_k2_decode(8))
    nv = p.pair(0, 1)
    assert (nv.transport, nv.reason, nv.links) == ("p2p", "NVLink (NV12)", ())
    assert nv.gbps == pytest.approx(12 * 20.8)
    pcie = p.pair(0, 2)
    assert pcie.transport == "p2p" and pcie.gbps == 25.0 and nv.gbps > pcie.gbps
    assert p.pair(0, 4).transport == "p2p"  # published NODE (Slurm cgroup anomaly)


def test_measured_slow_p2p_falls_back_to_staging():
    t = parse_topo((FIXTURES / "6x-rtx4090-2023-driver.topo.txt").read_text(), "6x")
    p = plan_transfers(t, options=TransferOptions(probe=probe("6x-rtx4090-2023-driver")))
    assert all(q.transport == "staged" for q in p.pairs)
    assert p.pair(0, 1).reason == "measured P2P 9.9 GB/s < staged 20.1 (measured)"
    assert p.pair(0, 1).gbps == 20.10 and p.pair(0, 1).estimate == "probe"


def test_gns_status_from_topo_p2p_is_respected():
    p = plan_transfers(topo("2x-rtx5090-threadripper3975wx", ".topo-p2p.txt"))
    assert [q.transport for q in p.pairs] == ["staged", "staged"]
    ok = plan_transfers(topo("5x-rtx50series-epyc-patched", ".topo-p2p.txt"))
    assert all(q.transport == "p2p" for q in ok.pairs) and ok.pair(3, 4).path_class == "PHB"


@pytest.mark.parametrize(
    "name", [BROADCOM, XEON_4090, ALL_SYS, THREADRIPPER, NVLINK, "4x-l40s-dual-socket"]
)
def test_schedule_covers_every_pair_once_one_send_and_receive_per_round(name):
    p = plan_transfers(topo(name))
    n = p.num_gpus
    seen = []
    for rnd in p.rounds:
        assert sorted(rnd) == list(range(n)) and all(rnd[i] != i for i in range(n))
        seen += list(enumerate(rnd))
    assert sorted(seen) == pairs(n)


def test_prediction_by_hand_on_two_gpus():
    text = "\tGPU0\tGPU1\tNUMA Affinity\nGPU0\t X \tPHB\t0\nGPU1\tPHB\t X \t0\n"
    t = parse_topo(text, "two")
    traffic = Traffic("1 MB each way", ((0.0, 1e6), (1e6, 0.0)))
    p = plan_transfers(t, traffic, TransferOptions(default_link_gen=4))
    rep = p.reports[0]
    # Gen4 PHB P2P: 25 GB/s, 0.4 us; one round; the GPU links (25 GB/s) carry one flow each.
    assert rep.round_us == (pytest.approx(0.4 + 1e6 / 25e3),)
    assert rep.predicted_us == pytest.approx(40.4)
    assert rep.bottleneck_bytes == 1e6 and rep.bottleneck_us == pytest.approx(40.0)
    assert rep.total_bytes == 2e6


def test_kimi_k2_traffic():
    k = expected_distinct_ranks(8, 384, 8)
    assert k == pytest.approx(8 * (1 - math.comb(336, 8) / math.comb(384, 8)))
    assert 5.2 < k < 5.3
    dispatch, combine = kimi_k2_decode(8)
    assert dispatch.bytes[0][0] == 0
    assert dispatch.bytes[0][1] == pytest.approx(128 * k / 8 * 7472)  # 80 B of ids + fp8 row
    assert combine.bytes[3][5] == pytest.approx(128 * k / 8 * 14336)
    with pytest.raises(ValueError, match="ranks=5"):
        kimi_k2_decode(5)


def test_plan_is_pure_and_env_only_through_from_env(monkeypatch):
    t = topo(BROADCOM)
    first = plan_transfers(t, kimi_k2_decode(8))
    monkeypatch.setenv("PCIE_A2A_P2P", "0")
    assert plan_transfers(t, kimi_k2_decode(8)) == first
    off = plan_transfers(t, options=TransferOptions.from_env())
    assert all(
        q.transport == "staged" and q.reason == "P2P forced off (PCIE_A2A_P2P=0)" for q in off.pairs
    )
    monkeypatch.delenv("PCIE_A2A_P2P")
    monkeypatch.setenv("PCIE_A2A_P2P_LEVEL", "pix")
    lvl = plan_transfers(t, options=TransferOptions.from_env())
    assert lvl.pair(0, 1).transport == "p2p" and lvl.pair(0, 2).transport == "staged"
    monkeypatch.setenv("PCIE_A2A_P2P_LEVEL", "bogus")
    with pytest.raises(ValueError, match="PCIE_A2A_P2P_LEVEL"):
        TransferOptions.from_env()
    with pytest.raises(ValueError, match="path class 'FAR'"):
        TransferOptions(p2p_level="far")


def test_plan_json_round_trip_prints_the_same():
    p = plan_transfers(
        topo(BROADCOM),
        kimi_k2_decode(8),
        TransferOptions(probe=probe(BROADCOM), default_link_gen=5),
    )
    text = p.to_json()
    again = TransferPlan.from_json(text)
    assert again == p
    assert again.to_json() == text
    assert format_plan(again) == format_plan(p)


def test_traffic_size_must_match():
    with pytest.raises(ValueError, match="is 2x2, the topology has 8 GPUs"):
        plan_transfers(topo(BROADCOM), Traffic("small", ((0.0, 1.0), (1.0, 0.0))))
