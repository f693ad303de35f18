"""The calibration probe on the CPU: the pipeline on a simulated machine (gate, timing,
budget), derivation, the JSON record, decisions from measurements, the per-machine cache
and fingerprint, how Buffer's planner picks a probe up, and ``pcie-a2a probe``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

import pytest

from pcie_a2a.topology import probe_cache, sources
from pcie_a2a.topology.calibration import concurrent_patterns, derive
from pcie_a2a.topology.errors import TopologyError
from pcie_a2a.topology.planner import TransferOptions, plan_transfers
from pcie_a2a.topology.probe import GpuIdentity, PairMeasurement, Probe, ProbeGateError
from pcie_a2a.topology.probe_run import ProbeSettings, gate_seed, run_probe
from probe_synthetic import (
    BOXES,
    SyntheticBackend,
    broadcom_box,
    direct_attach_box,
    synthetic_probe_file,
)
from topology_fixtures import FIXTURES

BROADCOM = "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx"
DIRECT = "8x-rtxpro6000-dual-epyc9124-direct"


def probe_file(name: str) -> Path:
    return synthetic_probe_file(name, FIXTURES)


def record(name: str) -> Probe:
    path = probe_file(name)
    return Probe.from_json(path.read_text(), str(path))


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for k in ("PCIE_A2A_P2P", "PCIE_A2A_P2P_LEVEL", "PCIE_A2A_DIRECTION", "PCIE_A2A_ENGINE",
              "PCIE_A2A_SCHEDULE", "PCIE_A2A_PAIRS", "PCIE_A2A_PROBE_FILE", "PCIE_A2A_TOPO_FILE",
              "PCIE_A2A_PROBE_CACHE"):  # fmt: skip
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


# ---- the records the pipeline makes on the two box models -------------------------------
@pytest.mark.parametrize("name", sorted(BOXES))
def test_derived_numbers_follow_from_the_raw_samples(name):
    probe = record(name)
    pairs, patterns = derive(probe.samples)
    assert pairs == probe.pairs and patterns == probe.patterns
    # By hand for one pair: the median of the three samples.
    row = next(
        r for r in probe.samples["pairs"] if (r["src"], r["dst"], r["mode"]) == (0, 1, "store")
    )
    t = sorted(row["seconds"])[1]
    assert probe.get(0, 1).store_gbps == round(probe.samples["pair_bytes"] / t / 1e9, 3)
    a2a = probe.pattern("all to all store")
    slowest = sorted(max(rep) for rep in next(
        p for p in probe.samples["patterns"] if p["name"] == "all to all store")["seconds"])[1]  # fmt: skip
    assert a2a.aggregate_gbps == round(56 * probe.samples["pattern_bytes"] / slowest / 1e9, 3)


def test_broadcom_record_shows_the_reported_collapse_and_pulls_cross_root():
    probe = record(BROADCOM)
    one = probe.pattern("switch sw0 to 1 root complex store")
    two = probe.pattern("switch sw0 to 2 root complexes store")
    reads = probe.pattern("switch sw0 to 2 root complexes load")
    assert 35.5 < one.aggregate_gbps < 38 and 2.6 < two.aggregate_gbps < 2.8
    assert 49 < reads.aggregate_gbps < 52
    a2a_w, a2a_r = probe.pattern("all to all store"), probe.pattern("all to all load")
    assert 35 < a2a_w.aggregate_gbps < 37.5 and 52 < a2a_r.aggregate_gbps < 55
    d = {(p["src"], p["dst"]): p for p in probe.decisions["pairs"]}
    topo = broadcom_box(FIXTURES).topo
    for (a, b), q in d.items():
        same_switch = topo.classes[a][b] == "PIX"
        assert (q["path"], q["direction"], q["engine"]) == (
            "p2p",
            "push" if same_switch else "pull",
            "sm",
        ), (a, b)
    assert sum("posted-write collapse on switch" in line for line in probe.diagnosis) == 4
    assert not any("ForceP2P" in line for line in probe.diagnosis)


def test_direct_attach_record_uses_the_copy_engine_and_names_the_driver_option():
    probe = record(DIRECT)
    assert all(q["engine"] == "copy_engine" for q in probe.decisions["pairs"])
    # ... and its direction compares the copy engine from either side, not the slow kernels
    assert all(
        "(copy engine, pair alone)" in q["direction_reason"] for q in probe.decisions["pairs"]
    )
    line = next(x for x in probe.diagnosis if "ForceP2P" in x)
    assert 'NVreg_RegistryDwords="ForceP2P=0x11;RMForceP2PType=1;RMPcieP2PType=2"' in line
    assert "15x slower than the copy engine on 56 pairs (NODE/SYS" in line
    assert "pcie_a2a never sets it" in line


# ---- the pipeline on a simulated machine -------------------------------------------------
def test_gate_failure_names_the_pair_and_stops_before_timing():
    box = broadcom_box(FIXTURES)
    backend = SyntheticBackend(box, faults={(2, 5, "load"): 1000})
    with pytest.raises(ProbeGateError) as info:
        run_probe(backend, box.topo, ProbeSettings(gate_bytes=4133))
    msg = str(info.value)
    assert "GPU2->GPU5 (load): byte 1000 of 4133 is" in msg
    assert "GPU2->GPU5 (load, all pairs at once)" in msg and "No timing was run" in msg
    assert not any(c.startswith(("flows", "latency")) for c in backend.calls)
    # every ordered pair in every mode, then all pairs at once in 4 modes
    assert sum(c.startswith("gate") for c in backend.calls) == 56 * 5 + 56 * 4


def test_gate_covers_staged_only_pairs_when_cuda_refuses_p2p():
    box = dataclasses.replace(direct_attach_box(FIXTURES), p2p=False)
    backend = SyntheticBackend(box)
    probe = run_probe(backend, box.topo, ProbeSettings(reps=1, gate_bytes=64))
    assert {c.split()[-1] for c in backend.calls if c.startswith("gate")} == {"staged"}
    assert all(m.p2p_possible is False and m.store_gbps is None for m in probe.pairs.values())
    p = plan_transfers(box.topo, options=TransferOptions(probe=probe))
    assert all(
        q.transport == "staged" and "cudaDeviceCanAccessPeer is 0" in q.reason for q in p.pairs
    )


def test_eight_gpus_fit_the_budget_and_a_slow_box_is_cut_to_fit():
    box = broadcom_box(FIXTURES)
    backend = SyntheticBackend(box)
    probe = run_probe(backend, box.topo, ProbeSettings(gate_bytes=4133))
    assert probe.elapsed_s < 60 and probe.settings["skipped"] == []
    assert probe.settings["pair_bytes_used"] == 32 << 20
    # 1000x slower links: pair transfers halve down to 4 MiB, then patterns that would start
    # past the budget are skipped and listed.
    slow = dataclasses.replace(
        box, rates={m: {k: v / 1000 for k, v in r.items()} for m, r in box.rates.items()}
    )
    probe = run_probe(SyntheticBackend(slow), slow.topo, ProbeSettings(budget_s=60, gate_bytes=64))
    assert probe.settings["pair_bytes_used"] == 4 << 20
    assert probe.settings["skipped"] and all(
        "over the 60 s budget" in s for s in probe.settings["skipped"]
    )
    assert probe.samples["pair_bytes"] == 4 << 20


def test_patterns_of_a_topology():
    topo = broadcom_box(FIXTURES).topo
    names = [p["name"] for p in concurrent_patterns(topo)]
    assert names[:2] == ["all to all store", "all to all load"]
    # k root complexes for k up to the switch's 2 GPUs (one flow per GPU)
    assert "switch sw0 to 2 root complexes store" in names and "cross socket load" in names
    assert "switch sw0 to 3 root complexes store" not in names
    two = next(
        p for p in concurrent_patterns(topo) if p["name"] == "switch sw0 to 2 root complexes store"
    )
    assert two["flows"] == [(0, 2), (1, 4)]  # GPU i of the switch into root complex i mod 2
    # The Threadripper box: each root switch reaches only one other root complex.
    from pcie_a2a.topology import load

    tr = load(FIXTURES / "8x-rtxpro6000-threadripper-3switch-pxb.topo.txt")
    assert not any(p["kind"] == "switch_roots" and p["roots"] >= 2 for p in concurrent_patterns(tr))


# ---- the JSON record ---------------------------------------------------------------------
def test_json_round_trip_and_version_one():
    probe = record(BROADCOM)
    again = Probe.from_json(probe.to_json())
    assert again == dataclasses.replace(probe, source=probe.source)
    v1 = json.dumps({"format": "pcie_a2a.probe", "version": 1, "source": "old",
                     "pairs": [{"src": 0, "dst": 1, "p2p_gbps": 20.0}]})  # fmt: skip
    assert Probe.from_json(v1).get(0, 1) == PairMeasurement(p2p_gbps=20.0)


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"format": "pcie_a2a.probe", "version": 7}, "expected format='pcie_a2a.probe' version 1 or 2"),
        ({"format": "pcie_a2a.probe", "version": 2, "pairs": [{"src": 0, "dst": 1, "speed": 3}]}, "pairs[0]"),
        ({"format": "pcie_a2a.probe", "version": 2, "patterns": [
            {"name": "x", "kind": "all_to_all", "mode": "write", "flows": [[0, 1]], "flow_gbps": [1.0],
             "aggregate_gbps": 1.0}]}, "patterns[0]: mode 'write'"),
        ({"format": "pcie_a2a.probe", "version": 2, "patterns": [
            {"name": "x", "kind": "all_to_all", "mode": "store", "flows": [[0, 1]], "flow_gbps": [],
             "aggregate_gbps": 1.0}]}, "flows and flow_gbps differ"),
    ],
)  # fmt: skip
def test_bad_records_name_what_is_wrong(doc, expected):
    with pytest.raises(TopologyError, match="bad.json") as info:
        Probe.from_json(json.dumps(doc), "bad.json")
    assert expected in str(info.value)


def test_probe_is_matched_to_the_topology_by_bus_id():
    probe = record(BROADCOM)
    topo = broadcom_box(FIXTURES).topo
    # The probing process saw the devices in another order (CUDA_DEVICE_ORDER=FASTEST_FIRST).
    order = [3, 0, 7, 1, 6, 2, 5, 4]  # device k is topology GPU order[k]
    inv = {g: k for k, g in enumerate(order)}
    shuffled = dataclasses.replace(
        probe,
        pairs={(inv[a], inv[b]): m for (a, b), m in probe.pairs.items()},
        patterns=(),
        gpus=tuple(dataclasses.replace(probe.gpus[g], index=k) for k, g in enumerate(order)),
    )
    back = shuffled.aligned_to([g.bus_id for g in topo.gpus])
    assert back.pairs == probe.pairs
    with pytest.raises(
        TopologyError, match=r"probed GPU 0 \(0000:72:00.0\) is not in the topology"
    ):
        shuffled.aligned_to(["0000:01:00.0"] * 8)


# ---- fingerprint and cache ---------------------------------------------------------------
def test_fingerprint_names_gpus_and_driver_not_device_order():
    gpus = [GpuIdentity(0, "0000:41:00.0", "GPU-a"), GpuIdentity(1, "0000:01:00.0", "GPU-b")]
    fp = probe_cache.fingerprint(gpus, "580.95.05")
    assert fp == probe_cache.fingerprint(list(reversed(gpus)), "580.95.05") and len(fp) == 16
    assert fp != probe_cache.fingerprint(gpus, "580.95.06")
    assert fp != probe_cache.fingerprint(
        [gpus[0], dataclasses.replace(gpus[1], uuid="GPU-c")], "580.95.05"
    )


def test_cache_round_trip_damage_and_mismatch(clean_env):
    probe = record(BROADCOM)
    path = probe_cache.save(probe)
    assert path == clean_env / "cache" / "pcie_a2a" / f"probe-{probe.fingerprint}.json"
    assert probe_cache.lookup(probe.fingerprint) == probe
    assert probe_cache.lookup("0" * 16) is None
    path.write_text("{ not json")
    with pytest.warns(RuntimeWarning, match="ignoring the cached probe"):
        assert probe_cache.lookup(probe.fingerprint) is None
    other = path.with_name("probe-1111111111111111.json")
    other.write_text(probe.to_json())
    with pytest.warns(RuntimeWarning, match="records fingerprint"):
        assert probe_cache.lookup("1111111111111111") is None
    with pytest.raises(ValueError, match="probe.fingerprint"):
        probe_cache.save(dataclasses.replace(probe, fingerprint=None))


def test_current_with_probe_picks_up_file_then_cache(clean_env, monkeypatch):
    box = broadcom_box(FIXTURES)
    probe = record(BROADCOM)
    monkeypatch.setattr(sources, "discover", lambda sysfs_root="/sys": box.topo)
    # No NVML here: no identity, no cache.
    assert sources.current_with_probe() == (box.topo, None)
    monkeypatch.setattr(
        probe_cache,
        "machine_identity",
        lambda bus_ids, proc_root="/proc": (probe.gpus, probe.driver),
    )
    assert sources.current_with_probe()[1] is None  # nothing cached yet
    probe_cache.save(probe)
    assert sources.current_with_probe()[1] == probe
    monkeypatch.setenv("PCIE_A2A_PROBE_CACHE", "0")
    assert sources.current_with_probe()[1] is None
    monkeypatch.setenv("PCIE_A2A_PROBE_FILE", str(probe_file(DIRECT)))
    assert sources.current_with_probe()[1].fingerprint == record(DIRECT).fingerprint


def test_buffer_planner_reads_the_recorded_probe(clean_env, monkeypatch, tmp_path):
    """cuda_backend.topology_rank_transfers (what Buffer(backend="cuda") calls on rank 0) with a
    recorded probe: the ranks' pairs carry the probe's directions."""
    from pcie_a2a.transport.cuda import topology_rank_transfers

    box = broadcom_box(FIXTURES)
    topo_file = tmp_path / "topo.json"
    topo_file.write_text(box.topo.to_json())
    monkeypatch.setenv("PCIE_A2A_TOPO_FILE", str(topo_file))
    monkeypatch.setenv("PCIE_A2A_PROBE_FILE", str(probe_file(BROADCOM)))
    buses = [g.bus_id for g in box.topo.gpus]
    rp, note = topology_rank_transfers(buses)
    assert rp is not None and "by PCI bus id" in note
    assert rp.pair_direction[0][1] == "push" and rp.pair_direction[0][2] == "pull"
    assert rp.to_dict()["pairs"][1]["direction"] == "pull"  # 0 -> 2


# ---- pcie-a2a probe ----------------------------------------------------------------------
def cli(*argv: str) -> int:
    from pcie_a2a.topology import probe_cli

    parser = argparse.ArgumentParser(prog="pcie-a2a")
    probe_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["probe", *argv])
    return args.func(args)


def test_probe_without_gpus_exits_2(capsys, clean_env):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli() == 2
    err = capsys.readouterr().err
    assert "the probe needs CUDA GPUs" in err and "nothing was measured" in err


def test_probe_file_prints_pairs_decisions_diagnosis_and_prediction(capsys, clean_env, tmp_path):
    out_file = tmp_path / "again.json"
    assert cli("--probe-file", str(probe_file(BROADCOM)), "--out", str(out_file)) == 0
    out = capsys.readouterr().out
    assert "  0->2   NODE   36.83" in out  # the pair table: kernel stores into one root complex
    assert "switch sw0 to 2 root complexes store" in out
    assert "posted-write collapse on switch sw0" in out
    assert "pull    48 pairs: measured loads" in out
    assert "Kimi K2 decode step" in out and "probe" in out
    again = Probe.from_json(out_file.read_text())
    assert again.decisions == record(BROADCOM).decisions
    assert cli("--probe-file", str(probe_file(DIRECT)), "--json") == 0
    assert json.loads(capsys.readouterr().out)["format"] == "pcie_a2a.probe"
    assert cli("--probe-file", str(tmp_path / "missing.json")) == 2
    assert "No such file" in capsys.readouterr().err


def test_gate_seed_differs_per_transfer():
    seeds = {
        gate_seed(s, d, m)
        for s in range(8)
        for d in range(8)
        for m in ("store", "load", "ce", "ce_read", "staged")
    }
    assert len(seeds) == 8 * 8 * 5


def test_no_warnings_from_a_clean_plan(clean_env):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_transfers(broadcom_box(FIXTURES).topo, options=TransferOptions(probe=record(BROADCOM)))
