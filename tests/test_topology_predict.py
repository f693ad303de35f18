"""The Kimi K2 decode floor the plan predicts (dispatch + combine, fp8 and bf16 dispatch):
by hand on two boxes, and for every fixture box with a GPU count that 384 experts split
over. ``python tests/test_topology_predict.py`` prints the table."""

from __future__ import annotations

import math
import sys

import pytest

from pcie_a2a.topology import (
    P2PStatus,
    Traffic,
    TransferOptions,
    load,
    load_probe,
    parse_topo,
    plan_transfers,
    roots,
)
from pcie_a2a.topology.predict import format_predictions, predict
from pcie_a2a.topology.probe import PairMeasurement, Probe
from pcie_a2a.topology.sources import load_with_probe
from probe_synthetic import synthetic_probe_file
from topology_fixtures import FIXTURES

# (label, topology file, probe file or None, PCIe generation, cpu, switch vendor, P2P off)
# Generations and vendors from each fixture's `# platform:` header.
BOXES = [
    ("2x-rtx5090-threadripper3975wx.topo-p2p.txt", None, 5, "amd", None, False),
    ("4x-a100-pcie-azure-ncv4.nccl-topo.xml.txt", None, 4, "amd", None, False),
    ("4x-l40s-dual-socket.topo.txt", None, 4, None, None, False),
    ("4x-rtx4090-a6000-mixed-single-socket-phb.topo.txt", None, 4, None, None, False),
    ("6x-rtx4090-2023-driver.topo.txt", "6x-rtx4090-2023-driver.p2p.txt", 4, None, None, False),
    ("6x-rtx4090-tinygrad-patched.p2p.txt", None, 4, None, None, False),
    ("8x-a100-pcie-nvlink-bridge-pairs.topo.txt", None, 4, None, None, False),
    ("8x-h100-sxm-nvswitch.p2p.txt", None, 5, None, None, False),
    ("8x-rtx3090-pcie3-p2p-disabled.p2p.txt", None, 3, None, None, False),
    ("8x-rtx4090-dual-socket-all-sys.topo.txt", None, 4, None, None, False),
    ("8x-rtx4090-dual-xeon-broadcom-pix.topo.txt", None, 4, "intel", "broadcom", True),
    ("8x-rtx5090-dual-epyc9575f-patched.nccl-allreduce.txt", None, 5, "amd", None, False),
    ("8x-rtxpro6000-dual-epyc9124-direct.topo.txt", None, 5, "amd", None, False),
    ("8x-rtxpro6000-dual-epyc9124-direct.topo.txt", "8x-rtxpro6000-dual-epyc9124-direct.p2p.txt", 5, "amd", None, False),
    ("8x-rtxpro6000-dual-epyc9124-direct.topo.txt", "probe/8x-rtxpro6000-dual-epyc9124-direct.synthetic-probe.json", 5, "amd", None, False),
    ("8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt", None, 5, "amd", "broadcom", False),
    ("8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt", "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.p2p.txt", 5, "amd", "broadcom", False),
    ("8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt", "probe/8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.synthetic-probe.json", 5, "amd", "broadcom", False),
    ("8x-rtxpro6000-threadripper-3switch-pxb.topo.txt", None, 5, "amd", "microchip", False),
    ("8x-rtxpro6000-threadripper-3switch-pxb.topo.txt", "8x-rtxpro6000-threadripper-3switch-pxb.p2p.txt", 5, "amd", "microchip", False),
]  # fmt: skip


def box_prediction(name, probe_file, gen, cpu, switch, p2p_off):
    topo, measured = load_with_probe(FIXTURES / name)
    topo = roots.with_vendor_hints(topo, cpu=cpu, switch=switch)
    if p2p_off:  # GeForce boards on the stock driver (the fixture's NCCL log shows it)
        topo = topo.with_p2p(P2PStatus.DISABLED)
    probe = measured
    if probe_file:
        if probe_file.startswith("probe/"):  # made by the probe pipeline at test time
            path = synthetic_probe_file(probe_file.split("/")[1].split(".")[0], FIXTURES)
        else:
            path = FIXTURES / probe_file
        probe = load_probe(str(path))
    pred = predict(topo, TransferOptions(probe=probe, default_link_gen=gen))
    label = name.split(".")[0] + (
        f" + {probe_file.split('/')[-1].split('.', 1)[1]}" if probe_file else ""
    )
    from dataclasses import replace

    return replace(pred, source=label)


@pytest.mark.parametrize("box", BOXES, ids=[f"{b[0]}+{b[1]}" for b in BOXES])
def test_every_fixture_box_has_a_sane_prediction(box):
    p = box_prediction(*box)
    fp8, bf16 = p.rows
    assert (fp8.payload, bf16.payload) == ("fp8", "bf16")
    for r in p.rows:
        assert math.isfinite(r.total_us) and r.dispatch_us > 0 and r.combine_us > 0
    assert bf16.dispatch_us > fp8.dispatch_us  # 14416 vs 7472 bytes a row
    assert bf16.combine_us == fp8.combine_us  # combine is bf16 either way
    # the same rows; a dispatch row carries 80 B of expert ids and weights more
    assert bf16.dispatch_us > bf16.combine_us
    assert bf16.dispatch_mb == pytest.approx(fp8.dispatch_mb * 14416 / 7472)
    assert bf16.dispatch_mb == pytest.approx(bf16.combine_mb * 14416 / 14336)


def test_pull_pair_by_hand():
    """Two GPUs on one host bridge, measured: loads win in the all-to-all, so the pair
    pulls; 1 MB at the measured load rate after the ready flag (a store) and one read round
    trip."""
    topo = parse_topo("\tGPU0\tGPU1\tNUMA Affinity\nGPU0\t X \tPHB\t0\nGPU1\tPHB\t X \t0\n", "two")
    m = PairMeasurement(
        store_gbps=20.0, load_gbps=24.0, store_us=0.8, load_us=1.7, a2a_store_gbps=10.0,
        a2a_load_gbps=16.0, ce_gbps=22.0, ce_read_gbps=23.0,
    )  # fmt: skip
    probe = Probe(pairs={(0, 1): m, (1, 0): m}, source="by hand")
    p = plan_transfers(
        topo, Traffic("1 MB", ((0.0, 1e6), (1e6, 0.0))), TransferOptions(probe=probe)
    )
    q = p.pair(0, 1)
    assert (q.direction, q.engine, q.gbps) == ("pull", "sm", 24.0)
    assert q.direction_reason == "measured loads 16.0 GB/s > stores 10.0 (in the all-to-all)"
    assert p.reports[0].predicted_us == pytest.approx(0.8 + 1.7 + 1e6 / 24e3)


def l40s_by_hand() -> dict[str, tuple[float, float]]:
    """4x L40S, Gen4, no probe: NODE pairs P2P (25 GB/s, 0.45 us), SYS pairs host-staged
    (13 GB/s, 14 us; the socket link's 50 GB/s shared by at most 2 staged flows is more).
    Every one of the 3 rounds carries a staged flow, the slowest, so each lasts
    14 us + bytes / 13 GB/s. The bound: each GPU's own link (Gen4 x16, 25 GB/s) carries its
    3 outgoing flows (the socket link, 50 GB/s with 4 flows each way, is less loaded).
    {payload: (total us, bound us)}."""
    rows = 128 * (1 - math.comb(384 - 96, 8) / math.comb(384, 8))  # a token reaches a given rank
    return {
        payload: (
            3 * (14 + rows * row / 13e3) + 3 * (14 + rows * 14336 / 13e3),
            3 * rows * (row + 14336) / 25e3,
        )
        # dispatch rows as the wire stores them: 80 B of header, ids and weights first
        for payload, row in (("fp8", 80 + 7168 + 224), ("bf16", 80 + 14336))
    }


def test_l40s_by_hand():
    topo = load(FIXTURES / "4x-l40s-dual-socket.topo.txt")
    p = plan_transfers(topo, options=TransferOptions(default_link_gen=4))
    assert all(any(p.pair(a, b).transport == "staged" for a, b in enumerate(r)) for r in p.rounds)
    got = predict(topo, TransferOptions(default_link_gen=4))
    want = l40s_by_hand()
    assert {r.payload: r.total_us for r in got.rows} == pytest.approx(
        {k: v[0] for k, v in want.items()}
    )
    assert {r.payload: r.bound_us for r in got.rows} == pytest.approx(
        {k: v[1] for k, v in want.items()}
    )
    assert got.basis == "model" and got.staged_pairs == 8 and got.pull_pairs == 0


def test_topo_predict_prints_the_table(capsys):
    """The command prints the hand-derived L40S floor (to its 0.1 us rounding), and refuses a
    GPU count 384 experts do not split over."""
    import argparse

    from pcie_a2a.topology import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["topo", "--from", str(FIXTURES / "4x-l40s-dual-socket.topo.txt"),
                              "--predict", "--link-gen", "4"])  # fmt: skip
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    for payload, (total, bound) in l40s_by_hand().items():
        row = next(line for line in out if "4x-l40s-dual-socket" in line and f" {payload} " in line)
        fields = row.split()
        # GPUs, tokens, basis, pull pairs, host-staged pairs, copy-engine pairs
        assert fields[1:7] == ["4", "128", "model", "0", "8", "0"], row
        assert float(fields[-2]) == pytest.approx(total, abs=0.05)
        assert float(fields[-1]) == pytest.approx(bound, abs=0.05)
    args = parser.parse_args(
        ["topo", "--from", str(FIXTURES / "5x-rtx50series-epyc-patched.topo-p2p.txt"), "--predict"]
    )
    assert args.func(args) == 2
    assert "no Kimi K2 prediction for 5 GPUs" in capsys.readouterr().err


if __name__ == "__main__":
    sys.stdout.write(format_predictions([box_prediction(*b) for b in BOXES]) + "\n")
