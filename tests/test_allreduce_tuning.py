"""Where the all-reduce's algorithm thresholds and per-pair decisions come from: the
planner's decisions on the fixture boxes, a probe record's measurements, the bench's
measured crossover, the environment, and the documented defaults."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pcie_a2a.allreduce import decisions as dec
from pcie_a2a.allreduce import tuning
from pcie_a2a.topology import TransferOptions, load, plan_transfers
from pcie_a2a.topology.ranks import rank_transfers
from pcie_a2a.topology.sources import load_with_probe
from topology_fixtures import FIXTURES

KB = 1024
BUS = [f"0000:{0x01 + 0x20 * i:02x}:00.0" for i in range(8)]


def _decisions(name: str, ranks: int = 8, **opts) -> dec.PairDecisions:
    topo, probe = load_with_probe(FIXTURES / name)
    p = plan_transfers(topo, options=TransferOptions(probe=probe, **opts))
    rp = rank_transfers(topo, p, BUS[:ranks] if topo.num_gpus == ranks else BUS[: topo.num_gpus])
    return dec.from_rank_transfers(rp, p, name)


@pytest.mark.parametrize(
    "name, cls, staged",
    [
        ("8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt", "cross_socket", True),
        ("8x-rtxpro6000-threadripper-3switch-pxb.topo.txt", "single_root", False),
        ("4x-l40s-dual-socket.topo.txt", "cross_socket", True),
        ("8x-rtx4090-dual-xeon-broadcom-pix.topo.txt", "cross_socket", True),
    ],
)
def test_topology_class_and_staged_pairs_of_the_fixture_boxes(name, cls, staged):
    d = _decisions(name)
    assert tuning.topology_class(d.path_classes) == cls
    assert bool(d.staged_pairs()) == staged  # SYS pairs stage until measured (planner rule)
    assert d.measured is None  # table estimates, not a probe
    assert all(v == "push" for row in d.direction for v in row)  # no probe: every pair pushes


def test_sys_pairs_become_p2p_when_the_operator_allows_it():
    d = _decisions("8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt", p2p_level="SYS")
    assert not d.staged_pairs()


def test_directions_are_read_from_the_rank_transfers_when_it_has_them():
    """The planner's per-pair push/pull (RankTransfers.pair_direction, from the probe or
    PCIE_A2A_DIRECTION / PCIE_A2A_PAIRS) is taken as is."""
    d = _decisions("8x-rtxpro6000-threadripper-3switch-pxb.topo.txt", direction="pull")
    w = d.world
    assert all(
        d.direction[s][t] == ("push" if s == t else "pull") for s in range(w) for t in range(w)
    )
    pull = d.pull_matrix()
    assert pull[0 * w + 3] == 1 and pull[5 * w + 5] == 0
    topo = load(FIXTURES / "8x-rtxpro6000-threadripper-3switch-pxb.topo.txt")
    p = plan_transfers(topo)
    rp = replace(rank_transfers(topo, p, BUS), pair_direction=tuple(
        tuple("pull" if (s + t) % 3 == 0 and s != t else "push" for t in range(w)) for s in range(w)
    ))  # fmt: skip
    mixed = dec.from_rank_transfers(rp, p, "mixed")
    assert mixed.direction == rp.pair_direction
    assert mixed.pull_matrix()[0 * w + 1] == 0 and mixed.pull_matrix()[1 * w + 2] == 1


def test_measured_pairs_set_the_one_shot_split():
    d = _decisions("8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.p2p.txt")
    assert d.measured is not None
    lat, gbps = d.measured
    # worst one-way 1.36 us, worst pair 46.5 GB/s (the record): one-shot no slower than
    # two-shot while 7 S / G <= L + 1.75 S / G, i.e. S <= L G / 5.25 ~ 12 KB -> 8 KB
    assert max(lat) == pytest.approx(1.36) and min(gbps) == pytest.approx(46.5)
    t = tuning.choose("cuda", 8, "bfloat16", "unknown", d.measured, 1 << 20)
    assert t.one_shot_max == 8 * KB
    assert t.handover == 48 * KB  # no NCCL measured: the class default
    assert "modelled from measured pairs" in t.source
    one, _ = tuning.one_shot_limit(2, lat, gbps, 1 << 20)
    assert one == 1 << 20  # two ranks: one-shot moves no more than two-shot, one hop less


def test_defaults_for_every_class_and_world():
    for cls in ("single_root", "cross_socket", "switch", "unknown", "cpu"):
        for world in (2, 4, 8):
            t = tuning.defaults(cls, world)
            assert 0 < t.one_shot_max <= t.handover and cls in t.source
    assert tuning.defaults("cross_socket", 8).handover == 48 * KB  # field_2026 s3 crossover


def test_thresholds_route_at_the_boundaries():
    t = tuning.Thresholds(16 * KB, 64 * KB, "test")
    assert [t.route(n) for n in (16, 16 * KB, 16 * KB + 16, 64 * KB, 64 * KB + 16)] == [
        "one_shot", "one_shot", "two_shot", "two_shot", "fallback",
    ]  # fmt: skip


def test_environment_and_arguments_come_first(monkeypatch):
    monkeypatch.setenv("PCIE_A2A_ALLREDUCE_MAX_BYTES", "32768")
    t = tuning.choose("cuda", 8, "bfloat16", "single_root", None, 1 << 20)
    assert (t.one_shot_max, t.handover, t.source) == (
        32 * KB,
        32 * KB,
        "PCIE_A2A_ALLREDUCE_MAX_BYTES",
    )
    t = tuning.choose("cuda", 8, "bfloat16", "single_root", None, 1 << 20, handover_bytes=4096)
    assert t.handover == 4096 and t.source == "explicit arguments"
    t = tuning.choose("cuda", 8, "bfloat16", "single_root", None, 16 * KB)
    assert t.handover == 16 * KB  # never above the communicator's max_bytes
    monkeypatch.setenv("PCIE_A2A_ALLREDUCE_MAX_BYTES", "1000")
    with pytest.raises(
        ValueError, match="PCIE_A2A_ALLREDUCE_MAX_BYTES='1000': expected a multiple of 16"
    ):
        tuning.choose("cuda", 8, "bfloat16", "single_root", None, 1 << 20)


def test_a_bench_table_gives_the_measured_crossover(tmp_path, monkeypatch):
    doc = {
        "op": "allreduce",
        "crossover": [
            {"backend": "cuda", "world": 8, "dtype": "bfloat16", "fused": False,
             "ours_up_to_bytes": 96 * KB, "one_shot_up_to_bytes": 24 * KB},
            {"backend": "cuda", "world": 4, "dtype": "bfloat16", "fused": False,
             "ours_up_to_bytes": 512 * KB, "one_shot_up_to_bytes": 256 * KB},
        ],
    }  # fmt: skip
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    monkeypatch.setenv("PCIE_A2A_ALLREDUCE_TABLE", str(path))
    t = tuning.choose("cuda", 8, "bfloat16", "cross_socket", None, 1 << 20)
    assert (t.one_shot_max, t.handover) == (
        24 * KB,
        96 * KB,
    ) and "measured by the bench" in t.source
    t = tuning.choose("cuda", 2, "bfloat16", "cross_socket", None, 1 << 20)
    assert t.source.startswith("defaults")  # no row for this world
    path.write_text("{not json")
    with pytest.raises(ValueError, match="PCIE_A2A_ALLREDUCE_TABLE=.*cannot read it"):
        tuning.choose("cuda", 8, "bfloat16", "cross_socket", None, 1 << 20)


@pytest.mark.parametrize(
    "direction, msg",
    [
        ([["push"]] * 2, r"pair_direction: got 2 rows of lengths \[1, 1\]"),
        ([["push", "sideways"], ["push", "push"]], r"pair_direction\[0\]\[1\]: got 'sideways'"),
        ([["pull", "push"], ["push", "push"]], r"pair_direction\[0\]\[0\]: a rank cannot pull from itself"),
    ],
)  # fmt: skip
def test_explicit_directions_are_validated(direction, msg):
    with pytest.raises(ValueError, match=msg):
        dec.explicit(direction)
