"""Push or pull, SM or copy engine, per pair: the defaults per topology class, the
collapse-avoiding schedule, the environment overrides, and the decisions as data."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pcie_a2a.topology import TransferOptions, kimi_k2_decode, load, plan_transfers, roots
from pcie_a2a.topology.planner import decisions_dict
from pcie_a2a.topology.ranks import rank_transfers
from topology_fixtures import FIXTURES

BROADCOM = FIXTURES / "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt"
THREADRIPPER = FIXTURES / "8x-rtxpro6000-threadripper-3switch-pxb.topo.txt"
DIRECT = FIXTURES / "8x-rtxpro6000-dual-epyc9124-direct.topo.txt"


def broadcom(cpu=None, switch=None):
    return roots.with_vendor_hints(load(BROADCOM), cpu=cpu, switch=switch)


def test_collapse_prone_class_pulls_cross_root_pairs():
    p = plan_transfers(broadcom("amd", "broadcom"), options=TransferOptions(default_link_gen=5))
    for q in p.pairs:
        if q.transport == "staged":  # SYS without a measurement
            assert q.direction == "push" and q.path_class == "SYS"
        elif q.path_class == "PIX":
            assert q.direction == "push" and q.trigger_switch is None
        else:
            assert q.direction == "pull" and q.trigger_switch == f"sw{q.src // 2}"
            assert "Broadcom/PLX switch into AMD root complexes" in q.direction_reason
            assert "36.8 -> 2.7 GB/s" in q.direction_reason
    # A pull's latency is the ready flag plus a read round trip: twice the table's NODE figure.
    assert p.pair(0, 2).latency_us == pytest.approx(2 * 0.45)
    assert not p.phased  # nothing pushes out of a switch


@pytest.mark.parametrize(
    ("cpu", "switch", "words"),
    [
        (None, None, "switch vendor not in the source: push in phases"),
        ("amd", None, "switch vendor not in the source: push in phases"),
        (None, "broadcom", "CPU (root port) vendor not in the source: push in phases"),
        (
            "intel",
            "broadcom",
            "(Broadcom/PLX switch into Intel root complexes): no collapse reported",
        ),
        ("amd", "microchip", "concurrent writes from one switch"),
    ],
)
def test_class_defaults_by_vendor(cpu, switch, words):
    p = plan_transfers(broadcom(cpu, switch))
    q = p.pair(0, 2)
    assert words in q.direction_reason
    assert q.direction == ("pull" if cpu == "amd" and switch == "microchip" else "push")


def test_no_trigger_without_two_destination_root_complexes():
    # Threadripper: each root switch reaches only the other root port's complex.
    p = plan_transfers(load(THREADRIPPER))
    assert all(q.direction == "push" and q.trigger_switch is None for q in p.pairs)
    assert "no shared switch uplink" in p.pair(0, 4).direction_reason
    assert not p.phased and p.collapse_violations == 0
    # Direct attach: no switch at all; the engine reason warns about driver staging.
    d = plan_transfers(roots.with_vendor_hints(load(DIRECT), cpu="amd"))
    assert all(q.direction == "push" for q in d.pairs)
    assert (
        "on direct-attach NODE pairs the driver may route kernel P2P" in d.pair(0, 1).engine_reason
    )


def test_schedule_keeps_each_switch_on_one_root_complex_per_round():
    t = broadcom()
    p = plan_transfers(
        t, options=TransferOptions(p2p_level="SYS")
    )  # every pair P2P push, 48 leave a switch
    assert p.phased and p.collapse_violations == 0
    for r, rnd in enumerate(p.rounds):
        per_switch: dict[str, set[str]] = {}
        for a, b in enumerate(rnd):
            q = p.pair(a, b)
            assert q.phase == r
            if q.trigger_switch:
                per_switch.setdefault(q.trigger_switch, set()).add(roots.root_complex(t, b))
        assert all(len(rcs) == 1 for rcs in per_switch.values()), (r, per_switch)
    spread = plan_transfers(t, options=TransferOptions(p2p_level="SYS", schedule="spread"))
    assert spread.collapse_violations > 0 and not spread.phased


def test_collapse_in_the_prediction_when_push_is_forced_on_the_prone_class():
    t = broadcom("amd", "broadcom")
    opts = TransferOptions(default_link_gen=5, p2p_level="SYS", direction="push")
    auto = plan_transfers(t, kimi_k2_decode(8), opts)
    spread = plan_transfers(t, kimi_k2_decode(8), replace(opts, schedule="spread"))
    assert auto.collapse_violations == 0 < spread.collapse_violations
    assert dict((sw, f) for sw, f, _ in auto.collapse_factors)["sw0"] == pytest.approx(2.7 / 36.8)
    # rounds that push into 2+ root complexes keep 7% of their rate: several times slower
    assert spread.reports[0].predicted_us > 3 * auto.reports[0].predicted_us


def test_environment_overrides(monkeypatch):
    t = broadcom("amd", "broadcom")
    monkeypatch.setenv("PCIE_A2A_DIRECTION", "push")
    monkeypatch.setenv("PCIE_A2A_ENGINE", "ce")
    p = plan_transfers(t, options=TransferOptions.from_env())
    assert all(q.direction == "push" for q in p.pairs)
    assert all(
        q.engine == "copy_engine" and q.engine_reason == "PCIE_A2A_ENGINE=copy_engine"
        for q in p.pairs
    )
    assert p.pair(0, 2).direction_reason == "PCIE_A2A_DIRECTION=push"
    monkeypatch.delenv("PCIE_A2A_DIRECTION")
    monkeypatch.delenv("PCIE_A2A_ENGINE")
    monkeypatch.setenv("PCIE_A2A_PAIRS", "0-4:p2p+push; *-7:staged+ce, 2-3:pull 0-5:staged+pull")
    p = plan_transfers(t, options=TransferOptions.from_env())
    q = p.pair(0, 4)
    assert (q.transport, q.direction, q.reason) == ("p2p", "push", "PCIE_A2A_PAIRS sets p2p")
    assert all(
        p.pair(s, 7).transport == "staged" and p.pair(s, 7).engine == "copy_engine"
        for s in range(7)
    )
    assert p.pair(2, 3).direction == "pull" and p.pair(3, 2).direction == "push"
    assert p.pair(0, 2).direction == "pull"  # untouched: the class default
    staged = p.pair(0, 5)  # a host-staged pair cannot pull, whatever is asked
    assert (staged.transport, staged.direction) == ("staged", "push")
    assert staged.direction_reason.startswith("host-staged")
    monkeypatch.setenv("PCIE_A2A_SCHEDULE", "spread")
    assert TransferOptions.from_env().schedule == "spread"


def test_pair_override_cannot_beat_the_driver(monkeypatch):
    from pcie_a2a.topology import P2PStatus

    t = broadcom().with_p2p(P2PStatus.DISABLED, [(0, 1)])
    monkeypatch.setenv("PCIE_A2A_PAIRS", "0-1:p2p")
    q = plan_transfers(t, options=TransferOptions.from_env()).pair(0, 1)
    assert q.transport == "staged"
    assert q.reason == "driver reports P2P disabled; PCIE_A2A_PAIRS cannot override the driver"


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("PCIE_A2A_DIRECTION", "sideways", "PCIE_A2A_DIRECTION='sideways': expected auto or one of push, pull"),
        ("PCIE_A2A_ENGINE", "dma", "expected auto or one of sm, copy_engine"),
        ("PCIE_A2A_SCHEDULE", "ring", "expected auto or one of spread"),
        ("PCIE_A2A_PAIRS", "0->4:pull", "entry '0->4:pull': expected SRC-DST:choice"),
        ("PCIE_A2A_PAIRS", "0-4:fast", "'fast' in '0-4:fast': expected one of push, pull"),
        ("PCIE_A2A_PAIRS", "0-4", "expected SRC-DST:choice"),
        ("PCIE_A2A_PROBE_CACHE", "maybe", "PCIE_A2A_PROBE_CACHE='maybe'"),
    ],
)  # fmt: skip
def test_bad_environment_values_name_the_variable(monkeypatch, name, value, expected):
    from pcie_a2a import env

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        TransferOptions.from_env()
        env.probe_cache()
    assert expected in str(info.value)


def test_options_validate():
    with pytest.raises(ValueError, match="direction='up': expected None or one of push, pull"):
        TransferOptions(direction="up")
    with pytest.raises(ValueError, match="engine='gpu'"):
        TransferOptions(engine="gpu")


def test_decisions_as_data_for_stats_and_ranks():
    t = broadcom("amd", "broadcom")
    p = plan_transfers(t)
    d = decisions_dict(p)
    assert len(d["pairs"]) == 56 and d["rounds"] == [list(r) for r in p.rounds]
    first = d["pairs"][1]  # 0 -> 2
    assert (first["src"], first["dst"], first["path"], first["direction"]) == (0, 2, "p2p", "pull")
    assert (
        first["phase"] == p.pair(0, 2).phase >= 0
        and "leaves switch sw0" in first["direction_reason"]
    )
    buses = [f"0000:{b:02x}:00.0" for b in (0x11, 0x12, 0x71, 0x72, 0x81, 0x82, 0xF1, 0xF2)]
    shuffle = [5, 0, 7, 2, 1, 6, 3, 4]
    rp = rank_transfers(t, p, [buses[g] for g in shuffle])
    for s in range(8):
        for d_ in range(8):
            if s == d_:
                assert (rp.pair_direction[s][d_], rp.pair_phase[s][d_]) == ("push", -1)
                continue
            q = p.pair(shuffle[s], shuffle[d_])
            assert rp.pair_direction[s][d_] == q.direction and rp.pair_engine[s][d_] == q.engine
            assert rp.pair_phase[s][d_] == q.phase == rp.send_order[s].index(d_)
            assert rp.reasons[s][d_].startswith(q.reason)
    doc = rp.to_dict()
    assert len(doc["pairs"]) == 56 and doc["phased"] is False
    assert {x["direction"] for x in doc["pairs"]} == {"push", "pull"}
