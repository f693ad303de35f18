"""`pcie-a2a topo`: text and JSON output from fixture files, --probe without GPUs, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pcie_a2a.topology import TransferPlan, format_plan
from pcie_a2a.topology import cli as topo_cli
from topology_fixtures import FIXTURES

BROADCOM = FIXTURES / "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt"


def run(*argv: str) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="pcie-a2a")
    topo_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["topo", *argv])
    return args.func(args)


def test_text_output(capsys):
    assert run("--from", str(BROADCOM)) == 0
    out = capsys.readouterr().out
    assert "8 GPUs, 2 NUMA nodes, 2 sockets, 4 root ports, 4 switches, 0 NICs" in out
    assert "GPU0  X              PIX  ?Ps  25.0 NODE ?Ps  25.0" in out
    assert "GPU4 <- GPU0 GPU1 GPU2 GPU3: NUMA node 1" in out
    assert "most flows on one shared link in any round: 3" in out
    assert "E[distinct ranks] = 5.28 of 8 ranks" in out
    # the same rows as before (34.97 MB / 7392 B = 4731 rows off-rank), each now counted as
    # the wire format's whole fp8 slot: 7168 payload + 224 scales + 80 ids/weights/header
    # = 7472 B, so 4731 * 7472 B = 35.35 MB
    assert "Kimi K2 decode dispatch (128 tok/rank, fp8): 35.35 MB on the wire" in out
    assert "predicted total for the 2 exchanges:" in out


def test_json_save_and_reload(tmp_path, capsys):
    saved = tmp_path / "plan.json"
    probe = FIXTURES / "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.p2p.txt"
    assert (
        run(
            "--from",
            str(BROADCOM),
            "--probe-file",
            str(probe),
            "--link-gen",
            "5",
            "--json",
            "--save",
            str(saved),
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["topology"]["format"] == "pcie_a2a.topology" and len(doc["topology"]["gpus"]) == 8
    assert all(p["transport"] == "p2p" for p in doc["plan"]["pairs"])
    reloaded = TransferPlan.from_json(saved.read_text())
    assert json.loads(reloaded.to_json()) == doc["plan"]
    # The printed plan is the saved plan: the text of the reloaded one appears verbatim.
    assert run("--from", str(BROADCOM), "--probe-file", str(probe), "--link-gen", "5") == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if line.startswith("Kimi K2 decode step:"))
    assert "p2p     56 pairs: measured P2P 46.5-52 GB/s >= staged 28.5 (table)" in out
    assert format_plan(reloaded, note) in out
    # The topology JSON is itself a valid --from source.
    topo_json = tmp_path / "topo.json"
    topo_json.write_text(json.dumps(doc["topology"]))
    assert run("--from", str(topo_json)) == 0


def test_env_topo_file_and_overrides(monkeypatch, capsys):
    monkeypatch.setenv("PCIE_A2A_TOPO_FILE", str(BROADCOM))
    monkeypatch.setenv("PCIE_A2A_P2P", "0")
    assert run() == 0
    out = capsys.readouterr().out
    assert "staged  56 pairs: P2P forced off (PCIE_A2A_P2P=0)" in out


def test_probe_needs_gpus(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert run("--from", str(BROADCOM), "--probe") == 2
    err = capsys.readouterr().err
    assert "the probe needs CUDA GPUs" in err and "no numbers were measured" in err


def test_errors_exit_nonzero_with_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("\tGPU0\tGPU1\nGPU0\t X \tPIZ\nGPU1\tPIX\t X \n")
    assert run("--from", str(bad)) == 2
    assert f"{bad}:2: GPU0/GPU1: 'PIZ' is not a path class" in capsys.readouterr().err
    assert run("--from", str(tmp_path / "missing.txt")) == 2
    assert "No such file" in capsys.readouterr().err


def test_live_machine_without_gpus(capsys, monkeypatch):
    monkeypatch.delenv("PCIE_A2A_TOPO_FILE", raising=False)
    for dev in Path("/sys/bus/pci/devices").glob("*"):
        if (dev / "vendor").exists() and (dev / "vendor").read_text().strip() == "0x10de":
            pytest.skip("this machine has an NVIDIA device")
    assert run() == 0
    assert "no NVIDIA GPU found" in capsys.readouterr().out


# ---- every fixture through `topo --from` ------------------------------------------------


def plan_json(capsys, path: Path) -> dict:
    assert run("--from", str(path), "--json") == 0
    return json.loads(capsys.readouterr().out)


def pairs_of(doc: dict) -> dict[tuple[int, int], dict]:
    return {(p["src"], p["dst"]): p for p in doc["plan"]["pairs"]}


@pytest.mark.parametrize(
    "name", sorted(p.name for p in FIXTURES.iterdir() if p.name != "README.md")
)
def test_every_fixture_prints_a_plan(name, capsys):
    assert run("--from", str(FIXTURES / name)) == 0
    out = capsys.readouterr().out
    assert "decisions" in out and "send schedule:" in out


def test_p2p_test_without_connectivity_rtx3090(capsys):
    doc = plan_json(capsys, FIXTURES / "8x-rtx3090-pcie3-p2p-disabled.p2p.txt")
    gpus = doc["topology"]["gpus"]
    # The file's Device: lines: 8x RTX 3090 at bus 1b, 1c, 1d, 1e, 3d, 3f, 40, 41.
    assert len(gpus) == 8 and {g["name"] for g in gpus} == {"NVIDIA GeForce RTX 3090"}
    assert [g["bus_id"][5:7] for g in gpus] == ["1b", "1c", "1d", "1e", "3d", "3f", "40", "41"]
    pairs = pairs_of(doc)
    assert len(pairs) == 56 and all(p["transport"] == "staged" for p in pairs.values())
    assert all(p["path_class"] == "?" and p["p2p_status"] == "unknown" for p in pairs.values())
    # The body has no connectivity matrix: what stages every pair is the "P2P" measurement
    # (bidir 6.11-8.63 GB/s, halved) being below staging.
    assert "measured P2P 3.1 GB/s < staged" in pairs[(0, 1)]["reason"]
    assert pairs[(0, 1)]["latency_us"] == 15.33  # P2P=Disabled latency row 0, column 1
    assert pairs[(1, 0)]["latency_us"] == 20.72
    assert run("--from", str(FIXTURES / "8x-rtx3090-pcie3-p2p-disabled.p2p.txt")) == 0
    out = capsys.readouterr().out
    assert "GPU0  X              ?    ?Hs  13.0" in out
    assert "path class ? unknown" in out and "decisions rest on the P2P status" in out


def test_p2p_test_h100_nvswitch(capsys):
    doc = plan_json(capsys, FIXTURES / "8x-h100-sxm-nvswitch.p2p.txt")
    pairs = pairs_of(doc)
    assert len(doc["topology"]["gpus"]) == 8
    # Connectivity matrix all 1: P2P for every pair; row 0 carries the NVLink numbers.
    assert all(p["p2p_status"] == "supported" for p in pairs.values())
    assert all(p["transport"] == "p2p" for p in pairs.values())
    assert pairs[(0, 1)]["gbps"] == 371.02 and pairs[(0, 6)]["gbps"] == 375.94
    assert "measured P2P 371.0 GB/s >= staged 37.2 (measured)" in pairs[(0, 1)]["reason"]
    # 0->7 was cut off in the source: P2P on the driver's word, table number.
    assert pairs[(0, 7)]["reason"] == "path class unknown; P2P status supported, no P2P measurement"
    assert pairs[(0, 7)]["estimate"].startswith("table")


def test_p2p_test_enabled_matrix_wins_9x_patched(capsys):
    doc = plan_json(capsys, FIXTURES / "9x-rtx5090-rtxpro6000-dual-epyc9575f-patched.p2p.txt")
    gpus = doc["topology"]["gpus"]
    assert len(gpus) == 9
    assert gpus[0]["name"] == "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
    assert gpus[0]["bus_id"] == "0000:c1:00.0" and gpus[8]["bus_id"] == "0000:f1:00.0"
    pairs = pairs_of(doc)
    assert len(pairs) == 72 and all(p["transport"] == "p2p" for p in pairs.values())
    assert pairs[(0, 1)]["gbps"] == 111.17 / 2  # bidirectional P2P=Enabled, halved
    assert pairs[(0, 1)]["latency_us"] == 0.38
    assert "(measured)" in pairs[(0, 1)]["reason"]  # against P2P=Disabled bidir 56.70 / 2


def test_p2p_test_slow_2023_driver_is_staged(capsys):
    doc = plan_json(capsys, FIXTURES / "6x-rtx4090-2023-driver.p2p.txt")
    pairs = pairs_of(doc)
    assert len(doc["topology"]["gpus"]) == 6
    assert all(p["transport"] == "staged" for p in pairs.values())
    assert "measured P2P 9.9 GB/s < staged 20.1 (measured)" in pairs[(0, 1)]["reason"]


def test_p2p_test_names_from_appended_nccl_tests(capsys):
    doc = plan_json(capsys, FIXTURES / "6x-rtx4090-tinygrad-patched.p2p.txt")
    gpus = doc["topology"]["gpus"]
    assert [g["bus_id"] for g in gpus] == [
        f"0000:{b}:00.0" for b in ("01", "42", "81", "82", "c1", "c2")
    ]
    assert all(p["transport"] == "p2p" for p in doc["plan"]["pairs"])
    assert pairs_of(doc)[(0, 1)]["gbps"] == 50.11 / 2


def test_nccl_paths_topology(capsys):
    doc = plan_json(capsys, FIXTURES / "8x-rtx4090-dual-xeon-broadcom-pix.nccl-paths.txt")
    topo = doc["topology"]
    buses = ["4e", "4f", "50", "51", "ce", "cf", "d0", "d1"]
    assert [g["bus_id"] for g in topo["gpus"]] == [f"0000:{b}:00.0" for b in buses]
    assert [g["numa_node"] for g in topo["gpus"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    c = topo["classes"]
    assert c[4][5] == "PHB" and c[2][0] == "PHB"  # GPU/CE000 -> cf000, GPU/50000 -> 4e000
    assert c[0][4] == "SYS" and c[7][3] == "SYS"
    assert c[0][1] == "?"  # neither 4e000's nor 4f000's line is in the excerpt
    pairs = pairs_of(doc)
    assert pairs[(0, 4)]["transport"] == "staged" and pairs[(4, 5)]["transport"] == "p2p"
    assert pairs[(4, 5)]["p2p_status"] == "unknown"
    assert any("NCCL's computed routes" in n for n in topo["notes"])


def test_nccl_tests_topology(capsys):
    path = FIXTURES / "8x-rtx5090-dual-epyc9575f-patched.nccl-allreduce.txt"
    doc = plan_json(capsys, path)
    gpus = doc["topology"]["gpus"]
    assert len(gpus) == 8 and {g["name"] for g in gpus} == {"NVIDIA GeForce RTX 5090"}
    assert gpus[0]["bus_id"] == "0000:01:00.0" and gpus[7]["bus_id"] == "0000:f1:00.0"
    assert all(c in ("X", "?") for r in doc["topology"]["classes"] for c in r)
    notes = doc["plan"]["notes"]
    assert "the test's command line sets NCCL_P2P_LEVEL=SYS" in notes
    assert any("busbw peaks at 45.7 GB/s (33554432 B)" in n for n in notes)
    assert all(p["transport"] == "staged" for p in doc["plan"]["pairs"])


def test_unknown_path_and_p2p_level(monkeypatch, capsys):
    h100 = FIXTURES / "8x-h100-sxm-nvswitch.p2p.txt"
    monkeypatch.setenv("PCIE_A2A_P2P_LEVEL", "PXB")
    assert run("--from", str(h100)) == 0
    assert "PCIE_A2A_P2P_LEVEL=PXB cannot be checked: path class unknown" in capsys.readouterr().out
    monkeypatch.setenv("PCIE_A2A_P2P_LEVEL", "SYS")
    assert run("--from", str(h100)) == 0
    assert "p2p     56 pairs: PCIE_A2A_P2P_LEVEL=SYS allows any path" in capsys.readouterr().out


def test_probe_file_replaces_the_files_own_numbers(capsys):
    h100 = FIXTURES / "8x-h100-sxm-nvswitch.p2p.txt"
    other = FIXTURES / "6x-rtx4090-2023-driver.p2p.txt"
    assert run("--from", str(h100), "--probe-file", str(other), "--json") == 0
    pairs = pairs_of(json.loads(capsys.readouterr().out))
    assert pairs[(0, 1)]["gbps"] != 371.02  # the 6-GPU probe's numbers, not the H100's


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "x NCCL INFO GPU/4e000 :GPU/0-4f000 (2/24.0/PIX) GPU/0-50000 (2/24.0/FOO)\n",
            "bad.txt:1: path type 'FOO' is not one of NCCL's",
        ),
        (
            # The command line first: a leading run of "# " lines is a fixture header.
            "./all_reduce_perf -g 2\n"
            "#  Rank  0 Group  0 Pid  1 on h device  0 [0x01] GPU\n"
            "#  Rank  0 Group  0 Pid  1 on h device  1 [0x02] GPU\n"
            "     8   2   float   sum   -1   25.47   0.00   0.00   0   24.82   0.00   0.00   0\n",
            "bad.txt:3: rank 0 listed twice",
        ),
        (
            "./all_reduce_perf -g 1\n"
            "#  Rank  0 Group  0 Pid  1 on h device  0 [0x01] GPU\n"
            "     8   2   float   sum   -1   abc   0.00   0.00   0   24.82   0.00   0.00   0\n",
            "bad.txt:3: nccl-tests row 8: expected time, algbw, busbw numbers",
        ),
        (
            "P2P Connectivity Matrix\n D\\D 0 1\n 0 1 one\n 1 x 1\n",
            "bad.txt:4: row 1: 'x' is not a number",
        ),
    ],
)
def test_garbled_new_formats(tmp_path, capsys, text, expected):
    bad = tmp_path / "bad.txt"
    bad.write_text(text)
    assert run("--from", str(bad)) == 2
    assert f"{tmp_path}/{expected}" in capsys.readouterr().err
