"""`pcie-a2a topo`: text and JSON output from fixture files, --probe without GPUs, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pcie_a2a.topology import Plan, format_plan
from pcie_a2a.topology import cli as topo_cli

SHARED = Path(__file__).resolve().parents[2] / "shared/fixtures/topology"
VENDORED = Path(__file__).resolve().parent / "fixtures/topology"
FIXTURES = SHARED if SHARED.is_dir() else VENDORED
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
    assert "GPU0  X             PIX  ?P  25.0 NODE ?P  25.0" in out
    assert "GPU4 <- GPU0 GPU1 GPU2 GPU3: NUMA node 1" in out
    assert "most flows on one shared link in any round: 3" in out
    assert "E[distinct ranks] = 5.28 of 8 ranks" in out
    assert "Kimi K2 decode dispatch (128 tok/rank, fp8): 34.97 MB on the wire" in out
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
    reloaded = Plan.from_json(saved.read_text())
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
    assert "--probe needs CUDA GPUs" in err and "no numbers were measured" in err


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
