"""Load files in (SGLang's recorder dump, ours), placement files out (ours, SGLang's
--init-expert-location), the choice table's validation, and `pcie-a2a balance`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pcie_a2a import Placement
from pcie_a2a.balance import io
from pcie_a2a.cli import main
from topology_fixtures import FIXTURES

BROADCOM = FIXTURES / "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt"


def _counts(layers=3, experts=64, seed=0):
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, experts + 1)
    return np.stack([rng.poisson(2000 * w[rng.permutation(experts)]) for _ in range(layers)])


def test_reads_sglang_stat_dump_and_json(tmp_path):
    c = _counts()
    steps = np.stack([c, 2 * c])  # [buffered steps, layers, experts], as SGLang records
    pt = tmp_path / "expert_distribution_recorder_1.pt"
    torch.save({"rank": 0, "logical_count": torch.tensor(steps, dtype=torch.int32),
                "average_utilization_rate_over_window": None}, pt)  # fmt: skip
    loads, share = io.read_loads(pt)
    assert loads.tolist() == (3 * c).tolist() and share is None
    js = tmp_path / "init.json"
    js.write_text(json.dumps({"logical_count": c.tolist()}))
    assert io.read_loads(js)[0].tolist() == c.tolist()


def test_our_load_file_round_trips_with_source_shares(tmp_path):
    src = np.stack([_counts(seed=s) for s in range(4)], axis=1)  # [layers, world, experts]
    path = tmp_path / "loads.json"
    io.write_loads(path, src.sum(axis=1), src)
    loads, share = io.read_loads(path)
    assert loads.tolist() == src.sum(axis=1).tolist()
    assert share.shape == (3, 4, 64) and np.allclose(share.sum(axis=1), 1.0)
    assert np.allclose(share * loads[:, None], src)


@pytest.mark.parametrize(
    "doc, fragment",
    [
        ({"something": 1}, "allowed: SGLang's recorder output"),
        ({"logical_count": [1, 2, 3]}, "allowed: \\[..., layers, experts\\]"),
        ({"logical_count": [[1, -2]]}, "negative"),
        (
            {"format": "pcie_a2a.expert_load", "version": 1, "loads": [[1, 2]],
             "source_loads": [[[1, 2, 3]]]},
            "source_loads has shape",
        ),
        ([1, 2], "allowed: a dict"),
    ],
)  # fmt: skip
def test_bad_load_files_name_the_file_and_the_problem(tmp_path, doc, fragment):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=fragment) as info:
        io.read_loads(path)
    assert str(path) in str(info.value)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="invalid JSON"):
        io.read_loads(tmp_path / "broken.json")


def test_placement_files_round_trip(tmp_path):
    p = Placement([[(0, 0), (1, 1)], [(1, 0)], [(0, 1)]], 2)
    p = p.with_choice([[[0], [0], [0]], [[1], [0], [0]]])
    io.write_placements(tmp_path / "pl.json", [p, p.with_choice(None)], [3, 7])
    back = io.read_placements(tmp_path / "pl.json")
    assert back == {3: p, 7: p.with_choice(None)} and back[3].choice == p.choice
    maps = [np.array([[0, 1], [2, 0]]), np.array([[2, 1], [0, 1]])]
    io.write_sglang(tmp_path / "sg.json", maps)
    doc = json.loads((tmp_path / "sg.json").read_text())
    assert list(doc) == ["physical_to_logical_map"]  # SGLang passes the keys as arguments
    assert doc["physical_to_logical_map"] == [[0, 1, 2, 0], [2, 1, 0, 1]]
    assert [m.tolist() for m in io.read_sglang(tmp_path / "sg.json", 2)] == [
        m.tolist() for m in maps
    ]


@pytest.mark.parametrize(
    "choice, fragment",
    [
        ([[[0], [0]]], "got 1 source ranks"),
        ([[[0], [0]], [[0]]], "choice\\[1\\]: got 1 experts"),
        ([[[0], [0]], [[2], [0]]], "choice\\[1\\]\\[0\\]: got \\[2\\]"),
        ([[[0], []], [[0], [0]]], "non-empty"),
        ([[["a"], [0]], [[0], [0]]], "replica positions"),
    ],
)
def test_choice_table_is_validated(choice, fragment):
    base = Placement([[(0, 0), (1, 0)], [(1, 1)]], 2)
    with pytest.raises(ValueError, match=fragment):
        base.with_choice(choice)


def test_choice_csr_is_the_wire_row():
    p = Placement([[(0, 0), (1, 0)], [(1, 1)], [(0, 1), (1, 2)]], 2)
    p = p.with_choice([[[0], [0], [1, 0, 0]], [[1], [0], [1]]])
    assert p.csr()[0] == [0, 2, 3, 5]
    assert p.choice_csr(0) == ([0, 1, 2, 5], [0, 2, 4, 3, 3])
    assert p.choice_csr(1) == ([0, 1, 2, 3], [1, 2, 4])
    assert p.replica_for(2, 7, source_rank=0) == (0, 1)  # 7 % 3 = 1 -> position 0
    with pytest.raises(ValueError, match="source_rank"):
        p.replica_for(2, 7)
    assert Placement.contiguous(4, 2).choice_csr(0) == ([], [])


def test_native_placement_validates_the_choice_row():
    from pcie_a2a import _native

    t = _native.transport()
    t.Placement([0, 2, 3], [0, 1, 1], [0, 0, 1], 2, [0, 1, 2], [1, 2])
    for off, ch, fragment in (
        ([0, 1], [0], "got 2 entries"),
        ([0, 1, 2], [2, 2], "expert 0 names replica 2"),
        ([0, 0, 1], [2], "expert 0 has no candidate"),
        ([0, 5, 1], [2], "expert 1 has no candidate"),  # bounds checked before any read
        ([0, 1, 3], [0, 2], "inconsistent"),
        ([], [1], "without its offsets"),
    ):
        with pytest.raises(ValueError, match=fragment):
            t.Placement([0, 2, 3], [0, 1, 1], [0, 0, 1], 2, off, ch)


def test_cli_balances_a_recorded_file(tmp_path, capsys):
    c = np.stack([_counts(2, 384, seed=s) for s in range(2)]).sum(axis=0)
    pt = tmp_path / "rec.pt"
    torch.save({"logical_count": torch.tensor(c[None])}, pt)
    out, sg = tmp_path / "pl.json", tmp_path / "sg.json"
    args = ["balance", "--load", str(pt), "--topo", str(BROADCOM), "--redundant", "32"]
    assert main([*args, "--out", str(out), "--sglang-out", str(sg)]) == 0
    text = capsys.readouterr().out
    assert "layer 0:" in text and "layer 1:" in text and "overall" in text
    before = [line for line in text.splitlines() if line.strip().startswith("before")]
    after = [line for line in text.splitlines() if line.strip().startswith("after")]
    assert len(before) == len(after) == 3
    assert float(after[-1].split()[1]) < float(before[-1].split()[1])  # max/mean
    assert float(after[-1].split()[2]) < float(before[-1].split()[2])  # socket MB
    pls = io.read_placements(out)
    assert sorted(pls) == [0, 1] and all(p.choice is not None for p in pls.values())
    maps = io.read_sglang(sg, 8)
    assert [m.tolist() for m in maps] == [
        [p.local_experts(r) for r in range(8)] for p in pls.values()
    ]
    # again with the result as the current placement: nothing needs to move
    assert main([*args, "--previous", str(out), "--layers", "1"]) == 0
    assert "experts moved: 0 " in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--redundant", "3"], "do not split evenly over 8 ranks"),
        (["--layers", "5"], "--layers: got '5'; allowed: values in \\[0, 2\\)"),
        (["--layers", "x"], "numbers and ranges"),
        (["--world", "4"], "pass --ranks"),
    ],
)
def test_cli_refuses_bad_arguments(tmp_path, capsys, extra, fragment):
    pt = tmp_path / "rec.json"
    pt.write_text(json.dumps({"logical_count": _counts(2, 384).tolist()}))
    assert main(["balance", "--load", str(pt), "--topo", str(BROADCOM), *extra]) == 2
    import re

    assert re.search(fragment, capsys.readouterr().err)


def test_balance_gpus_knob(monkeypatch):
    from pcie_a2a import env

    monkeypatch.delenv("PCIE_A2A_BALANCE_GPUS", raising=False)
    assert env.balance_gpus() is None
    monkeypatch.setenv("PCIE_A2A_BALANCE_GPUS", "0,2,4,6")
    assert env.balance_gpus() == [0, 2, 4, 6]
    for bad in ("0,x", "-1,0", ","):
        monkeypatch.setenv("PCIE_A2A_BALANCE_GPUS", bad)
        with pytest.raises(ValueError, match="PCIE_A2A_BALANCE_GPUS=.*GPU indices"):
            env.balance_gpus()
