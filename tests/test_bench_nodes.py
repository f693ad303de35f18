"""``pcie-a2a bench --nodes N``: argument errors, a 2 nodes x 2 ranks run whose inter-node
bytes match a hand count, and N=1 configuring exactly what no --nodes does."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pcie_a2a
from pcie_a2a.bench import cli, runner

ROOT = Path(__file__).resolve().parents[1]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


@pytest.mark.parametrize(
    ("argv", "allowed"),
    [
        (["--nodes", "0"], "a positive int"),
        (["--nodes", "3"], "a divisor of the world size (4)"),
        (["--nodes", "2", "--backend", "cuda"], "the CUDA inter-node stage"),
    ],
)
def test_bad_nodes_names_option(argv, allowed, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.resolve(_args("--quick", "--world", "4", *argv), 4)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--nodes: got " + argv[1] in err and allowed in err


def test_one_node_configures_what_no_option_does(monkeypatch):
    plain = cli.resolve(_args("--quick", "--world", "4"), 4)
    assert cli.resolve(_args("--quick", "--world", "4", "--nodes", "1"), 4) == plain
    assert "nodes" not in plain  # the worker then records no internode bytes
    monkeypatch.setenv("PCIE_A2A_LOCAL_WORLD_SIZE", "")  # so that the undo removes it
    monkeypatch.delenv("PCIE_A2A_LOCAL_WORLD_SIZE")
    runner._split_nodes(plain, 4)
    assert "PCIE_A2A_LOCAL_WORLD_SIZE" not in os.environ
    runner._split_nodes(cli.resolve(_args("--quick", "--world", "4", "--nodes", "2"), 4), 4)
    assert os.environ["PCIE_A2A_LOCAL_WORLD_SIZE"] == "2"


def test_two_nodes_bytes_match_hand_count(tmp_path):
    # top-8 of 8 experts: every token goes to every expert, 2 experts on each of 4 ranks,
    # so each token has 4 experts (ranks 2 and 3, or 0 and 1) on the other node
    js = tmp_path / "nodes.json"
    env = dict(os.environ, PYTHONPATH=str(Path(pcie_a2a.__file__).resolve().parents[1]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PCIE_A2A_LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    argv = ["--world", "4", "--nodes", "2", "--experts", "8", "--topk", "8", "--hidden",
            "128", "--tokens", "4", "--payload", "bf16", "--iters", "2", "--warmup", "0",
            "--json", str(js), "--plot", "none"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "pcie_a2a", "bench", *argv],
        capture_output=True, text=True, timeout=90, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nodes: 2 x 2 ranks, SIMULATED on one host" in proc.stdout
    doc = json.loads(js.read_text())
    assert doc["nodes"] == {"count": 2, "ranks_per_node": 2, "simulated": True}
    (res,) = doc["results"]
    assert {"pcie_a2a", "a2a"} <= set(res["methods"])
    for name in ("pcie_a2a", "a2a"):
        assert res["methods"][name]["max_rel_err"] <= 0.02
        assert res["methods"][name]["phases"]["disp+comb"]["p50_us"] > 0
    # flat a2a: 4 tokens x 4 remote experts x 2*128 B (bf16), the same rows coming back
    assert res["internode"]["a2a"] == [4096, 4096]
    # pcie_a2a: a 16 B header to the one other node, then each token once as a 336 B wire
    # row (16 B row header + 8 int32 ids = 48; + 8 fp32 weights = 80; + 128 bf16 = 336);
    # combine: the header, then the 4 received tokens' node sums in fp32 (4 x 512 B)
    assert res["internode"]["pcie_a2a"] == [16 + 4 * 336, 16 + 4 * 512]
    assert "pcie_a2a dispatch 1360 + combine 2064 = 3424" in proc.stdout
    assert "a2a      dispatch 4096 + combine 4096 = 8192" in proc.stdout
