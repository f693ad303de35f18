"""`pcie-a2a bench --op allreduce` and benchmarks/bench_allreduce_one_gpu.py on the CPU: one
tiny real run (JSON, table, crossover), the crossover rule on made-up timings, bad options,
and the one-GPU script's refusal without a GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pcie_a2a import cuda_available, cuda_unavailable_reason
from pcie_a2a.bench import allreduce

ROOT = Path(__file__).resolve().parents[1]
ONE_GPU = ROOT / "benchmarks" / "bench_allreduce_one_gpu.py"


def _bench(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    import os

    import pcie_a2a

    # the pcie_a2a this test imported (the source tree in a dev build, site-packages in CI)
    env = {"PYTHONPATH": str(Path(pcie_a2a.__file__).resolve().parents[1])}

    return subprocess.run(
        [sys.executable, "-m", "pcie_a2a", "bench", "--op", "allreduce", *args],
        capture_output=True, text=True, timeout=600, cwd=cwd, env=os.environ | env,
    )  # fmt: skip


def test_a_tiny_sweep_writes_json_with_the_crossover(tmp_path):
    js = tmp_path / "ar.json"
    r = _bench(
        "--quick",
        "--sizes",
        "1024,4096",
        "--fused",
        "no",
        "--json",
        str(js),
        "--plot",
        "none",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(js.read_text())
    assert doc["op"] == "allreduce" and doc["machine"]["backend"] == "cpu"
    assert [(x["world"], x["bytes"]) for x in doc["results"]] == [(2, 1024), (2, 4096)]
    for res in doc["results"]:
        assert set(res["methods"]) == {"one_shot", "two_shot", "baseline"}
        assert res["methods"]["one_shot"]["error"] == 0.0  # ours: bit for bit
        assert res["methods"]["baseline"]["p50_us"] > 0
    (cross,) = doc["crossover"]
    assert cross["world"] == 2 and cross["dtype"] == "bfloat16" and cross["fused"] is False
    assert cross["ours_up_to_bytes"] in (0, 1024, 4096)
    assert "crossover world 2 bfloat16 plain:" in r.stdout
    assert "one-shot" in r.stdout and "baseline" in r.stdout


def _res(world, nbytes, one, two, base, fused=False):
    m = {"one_shot": {"p50_us": one}, "two_shot": {"p50_us": two}, "baseline": {"p50_us": base}}
    return {
        "world": world,
        "dtype": "bf16",
        "fused": fused,
        "bytes": nbytes,
        "backend": "cuda",
        "methods": m,
    }


def test_crossover_is_where_the_baseline_first_wins(tmp_path):
    rows = [
        _res(8, 1024, 5, 9, 25),
        _res(8, 16384, 11, 12, 27),
        _res(8, 65536, 40, 30, 31),  # two-shot still wins
        _res(8, 262144, 120, 90, 86),  # NCCL wins from here
        _res(8, 1 << 20, 400, 170, 200),  # a later win does not count: not contiguous
    ]
    (c,) = allreduce.crossover(rows)
    assert c["ours_up_to_bytes"] == 65536 and c["one_shot_up_to_bytes"] == 16384
    unavailable = [
        dict(r, methods=dict(r["methods"], baseline={"unavailable": "n/a: shared GPU"}))
        for r in rows
    ]
    (c,) = allreduce.crossover(unavailable)
    assert c["ours_up_to_bytes"] is None and c["note"] == "n/a: shared GPU"
    # the table it writes is what pcie_a2a.allreduce.tuning reads back
    from pcie_a2a.allreduce import tuning

    path = tmp_path / "cross.json"
    path.write_text(json.dumps({"op": "allreduce", "crossover": allreduce.crossover(rows)}))
    t = tuning.from_table(str(path), "cuda", 8, "bfloat16")
    assert (t.one_shot_max, t.handover) == (16384, 65536)


@pytest.mark.parametrize(
    "opt, value, msg",
    [
        ("--sizes", "1000", "multiples of 16"),
        ("--worlds", "2,x", "a comma list of positive ints"),
        ("--dtypes", "fp32", "a comma list of bf16, fp16"),
        ("--fused", "maybe", "a comma list of no, yes"),
    ],
)
def test_bad_options_exit_2_naming_them(tmp_path, opt, value, msg):
    r = _bench("--quick", opt, value, cwd=tmp_path)
    assert r.returncode == 2 and opt in r.stderr and msg in r.stderr, r.stderr


def _one_gpu():
    spec = importlib.util.spec_from_file_location("bench_allreduce_one_gpu", ONE_GPU)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(cuda_available(), reason="a GPU is usable here: the script would run")
def test_one_gpu_bench_without_a_gpu_exits_2_and_says_why(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(ONE_GPU), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "needs a GPU" in r.stderr, r.stdout + r.stderr
    assert cuda_unavailable_reason() in r.stderr and not out.exists()


def test_one_gpu_bench_arguments_and_residency_bound():
    mod = _one_gpu()
    a = mod.parse(["--quick"])
    assert a.sizes == [1024, 14336, 65536] and a.worlds == [2, 8] and a.replays == 20
    with pytest.raises(SystemExit):
        mod.parse(["--sizes", "100"])
    assert mod.fits(8, 32, 132) and not mod.fits(8, 64, 132)
