"""CPU-side checks of benchmarks/bench_cuda_one_gpu.py (the GPU part runs in
scripts/gpu_check.sh): without a GPU it exits 2 and says why, and it rejects bad arguments
before it looks for a GPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from pcie_a2a import cuda_available, cuda_unavailable_reason

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cuda_one_gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_cuda_one_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(cuda_available(), reason="a GPU is usable here: the script would run")
def test_without_gpu_exits_2_and_says_why(tmp_path):
    out = tmp_path / "r.json"
    r = _run("--json", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs a GPU" in r.stderr
    assert cuda_unavailable_reason() in r.stderr
    assert not out.exists()


def test_defaults():
    args = _load().parse_args([])
    assert args.worlds == [1, 2, 4, 8]
    assert args.json is None
    args = _load().parse_args(["--worlds", "2,8", "--iters", "3", "--budget-s", "0.5"])
    assert (args.worlds, args.iters, args.budget_s) == ([2, 8], 3, 0.5)


@pytest.mark.parametrize(
    "argv",
    [
        ["--worlds", "3"],
        ["--worlds", "2,2"],
        ["--worlds", "16"],
        ["--worlds", "two"],
        ["--worlds", ""],
        ["--iters", "0"],
        ["--iters", "-5"],
        ["--warmup", "1.5"],
        ["--budget-s", "0"],
        ["--budget-s", "nan"],
        ["--world-timeout-s", "inf"],
        ["--copy-mib", "x"],
        ["--bogus"],
    ],
)
def test_bad_arguments_are_rejected(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _load().parse_args(argv)
    assert exc.value.code == 2
    assert "error: " in capsys.readouterr().err


def test_bad_argument_rejected_before_gpu_check():
    r = _run("--iters", "0")
    assert r.returncode == 2
    assert "argument --iters" in r.stderr
    assert "needs a GPU" not in r.stderr


def test_percentile_nearest_rank():
    p = _load().percentile
    assert p(list(range(1, 101)), 50) == 50
    assert p(list(range(1, 101)), 99) == 99
    assert p([7.0], 99) == 7.0
