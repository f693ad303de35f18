"""Smoke tests of ``pcie-a2a bench``: the command runs end to end on 2 ranks with tiny
shapes and writes sane JSON. No timing assertions (performance lives in benchmarks)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pcie_a2a
from pcie_a2a.bench.device import cuda_unusable
from pcie_a2a.bench.routing import RoutingSpec, make_routing, ranks_per_token

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("dispatch", "combine", "disp+comb", "d+e+c")


def _bench(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    # the children import the same pcie_a2a as this test (source tree or installed)
    env = dict(os.environ, PYTHONPATH=str(Path(pcie_a2a.__file__).resolve().parents[1]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # never look like a torchrun rank
    return subprocess.run(
        [sys.executable, "-m", "pcie_a2a", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_quick_run_writes_sane_json(tmp_path):
    js = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    args = ["--quick", "--world", "2", "--routing", "uniform,kimi", "--n-group", "4",
            "--topk-group", "2", "--json", str(js), "--plot", str(png)]  # fmt: skip
    proc = _bench(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "p50 µs" in proc.stdout and "vs a2a" in proc.stdout
    assert "[bench] 1/" in proc.stderr  # progress
    doc = json.loads(js.read_text())
    assert doc["machine"]["world"] == 2 and doc["machine"]["torch"] == torch.__version__
    assert doc["ag_rs_reduce"]
    results = doc["results"]
    assert {(r["tokens"], r["payload"], r["routing"]) for r in results} == {
        (t, p, r) for t in (4, 32) for p in ("bf16", "fp8") for r in ("uniform", "kimi")
    }
    for res in results:
        assert res["iters"] >= 1
        methods = res["methods"]
        assert set(methods) == {"pcie_a2a", "a2a", "ag_rs"}
        for name, m in methods.items():
            tol = 0.15 if name == "pcie_a2a" and res["payload"] == "fp8" else 0.02
            assert m["max_rel_err"] <= tol, (res["tokens"], res["payload"], name)
            for ph in PHASES:
                s = m["phases"][ph]
                assert 0 < s["p50_us"] <= s["p99_us"]
                assert len(s["samples_us"]) == res["iters"]
                assert s["wire_bytes"] > 0 and s["gbps"] >= 0
        ours, a2a = methods["pcie_a2a"]["phases"], methods["a2a"]["phases"]
        # a token crosses once per rank, not once per expert (top-4 of 32 on 2 ranks)
        assert ours["dispatch"]["wire_bytes"] < a2a["dispatch"]["wire_bytes"]
        assert ours["combine"]["wire_bytes"] < a2a["combine"]["wire_bytes"]
        assert set(methods["pcie_a2a"]["speedup"]) == {"vs_a2a", "vs_ag_rs"}
    assert png.exists() or "plot skipped" in proc.stdout


def test_bad_option_names_option_and_allowed_values(tmp_path):
    proc = _bench("--quick", "--world", "2", "--payload", "fp4", "--json",
                  str(tmp_path / "x.json"), timeout=30)  # fmt: skip
    assert proc.returncode == 2
    assert "--payload" in proc.stderr and "'fp4'" in proc.stderr and "bf16, fp8" in proc.stderr
    proc = _bench("--world", "4", "--experts", "30", timeout=30)
    assert proc.returncode == 2 and "--experts" in proc.stderr


@pytest.mark.parametrize("kind", ["uniform", "zipf", "kimi"])
def test_routings_are_valid_and_deterministic(kind):
    spec = RoutingSpec(kind, num_experts=64, topk=8)
    ids, w = make_routing(spec, 50, rank=1)
    assert ids.shape == (50, 8) and ids.dtype == torch.int64 and w.dtype == torch.float32
    assert int(ids.min()) >= 0 and int(ids.max()) < 64
    assert all(len(set(row)) == 8 for row in ids.tolist())  # distinct experts per token
    assert torch.allclose(w.sum(dim=1), torch.ones(50))
    again, _ = make_routing(spec, 50, rank=1)
    assert torch.equal(ids, again)
    assert not torch.equal(ids, make_routing(spec, 50, rank=2)[0])


def test_kimi_routing_limits_groups():
    spec = RoutingSpec("kimi", num_experts=64, topk=8, n_group=8, topk_group=2)
    ids, _ = make_routing(spec, 200, rank=0)
    groups = ids // 8
    assert all(len(set(row)) <= 2 for row in groups.tolist())
    # groups are contiguous expert blocks, so on 4 ranks a token touches at most 2 ranks
    assert ranks_per_token(ids, 64, 4) <= 2.0


@pytest.mark.gpu
@pytest.mark.skipif(bool(cuda_unusable()), reason=cuda_unusable() or "n/a")
def test_cuda_backend_world_2(tmp_path):
    """``--backend cuda --world 2``: NCCL baselines with 2+ GPUs, pcie_a2a only on one GPU."""
    js = tmp_path / "bench.json"
    args = ["--backend", "cuda", "--quick", "--world", "2", "--tokens", "32",
            "--json", str(js), "--plot", "none", "--timeout", "90"]  # fmt: skip
    proc = _bench(*args, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(js.read_text())
    mach = doc["machine"]
    assert mach["backend"] == "cuda" and mach["gpu_count"] == torch.cuda.device_count()
    assert mach["gpus"] and "gpus: " in proc.stdout
    shared = mach["gpu_count"] < 2
    assert mach["process_group"] == ("gloo" if shared else "nccl")
    assert {r["payload"] for r in doc["results"]} == {"bf16", "fp8"}
    for res in doc["results"]:
        methods = res["methods"]
        ours = methods["pcie_a2a"]
        assert ours["max_rel_err"] <= (0.15 if res["payload"] == "fp8" else 0.02)
        for s in ours["phases"].values():
            assert math.isfinite(s["p50_us"]) and 0 < s["p50_us"] <= s["p99_us"]
            assert s["wire_bytes"] > 0
        for base in ("a2a", "ag_rs"):
            if shared:
                assert "NCCL needs one GPU per rank" in methods[base]["unavailable"]
            else:
                assert methods[base]["max_rel_err"] <= 0.02
                assert all(math.isfinite(s["p50_us"]) for s in methods[base]["phases"].values())
        assert ("speedup" in ours) is not shared
    assert "pcie_a2a" in proc.stdout and ("n/a: NCCL" in proc.stdout) is shared
