"""CPU-side checks of ``pcie-a2a bench --backend``: parsing, the one-line exit 2 without a
GPU, the device / process-group / baselines decisions (pure functions, as a table), the
GPU memory check, and the report of a run whose baselines cannot run (forced on the CPU
transport, since the GPU run itself is tests/test_bench.py::test_cuda_backend_world_2)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pcie_a2a
from pcie_a2a.bench import cli, device, memory, report, runner

ROOT = Path(__file__).resolve().parents[1]
_NO_CUDA = device.cuda_unusable()


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_backend_defaults_to_cpu_and_accepts_cuda():
    assert _args().backend == "cpu"
    assert cli.resolve(_args("--quick"), 2)["backend"] == "cpu"
    assert cli.resolve(_args("--quick", "--backend", "cuda"), 2)["backend"] == "cuda"


def test_bad_backend_names_option_and_allowed_values(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.resolve(_args("--quick", "--backend", "gpu"), 2)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--backend" in err and "'gpu'" in err and "cpu, cuda" in err


@pytest.mark.skipif(not _NO_CUDA, reason="CUDA is usable here: --backend cuda would run")
def test_cuda_without_gpu_exits_2_with_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(pcie_a2a.__file__).resolve().parents[1]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    js = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pcie_a2a", "bench", "--backend", "cuda", "--world", "2",
         "--json", str(js)],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "[bench]" not in proc.stderr  # nothing spawned
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("pcie-a2a bench:")]
    assert "--backend" in line and "'cuda'" in line and "allowed here: cpu" in line
    assert _NO_CUDA in line
    assert proc.stdout == "" and not js.exists()


def test_bad_option_reported_before_the_gpu_check(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.resolve(_args("--backend", "cuda", "--payload", "fp4"), 2)
    assert exc.value.code == 2
    assert "--payload" in capsys.readouterr().err


# (backend, GPUs visible, ranks on the machine) -> (process group, baselines n/a text)
PLANS = [
    ("cpu", 0, 1, "gloo", None),
    ("cpu", 0, 4, "gloo", None),
    ("cpu", 8, 4, "gloo", None),  # GPUs present but not asked for
    ("cuda", 1, 1, "nccl", None),
    ("cuda", 1, 2, "gloo", "n/a: NCCL needs one GPU per rank; 2 ranks share 1 GPU"),
    ("cuda", 1, 8, "gloo", "n/a: NCCL needs one GPU per rank; 8 ranks share 1 GPU"),
    ("cuda", 2, 2, "nccl", None),
    ("cuda", 2, 4, "gloo", "n/a: NCCL needs one GPU per rank; 4 ranks share 2 GPUs"),
    ("cuda", 4, 8, "gloo", "n/a: NCCL needs one GPU per rank; 8 ranks share 4 GPUs"),
    ("cuda", 8, 4, "nccl", None),  # more GPUs than ranks: ranks 0..3 use GPUs 0..3
    ("cuda", 8, 8, "nccl", None),
]


@pytest.mark.parametrize(("backend", "gpus", "world", "pg", "na"), PLANS)
def test_run_spec_table(backend, gpus, world, pg, na):
    p = device.run_spec(backend, gpus, world)
    assert (p.backend, p.pg_backend, p.baselines_na) == (backend, pg, na)
    assert (p.device_count, p.local_world) == (gpus, world)


def test_run_spec_rejects_what_cannot_run():
    with pytest.raises(ValueError, match="device_count: got 0"):
        device.run_spec("cuda", 0, 2)
    with pytest.raises(ValueError, match="backend: got 'rocm'; allowed: cpu, cuda"):
        device.run_spec("rocm", 1, 2)
    with pytest.raises(ValueError, match="local_world: got 0"):
        device.run_spec("cpu", 0, 0)


@pytest.mark.parametrize(
    ("gpus", "world", "devices", "sharing"),
    [
        (1, 4, [0, 0, 0, 0], [4]),
        (2, 4, [0, 1, 0, 1], [2, 2]),
        (3, 4, [0, 1, 2, 0], [2, 1, 1]),
        (8, 4, [0, 1, 2, 3], [1, 1, 1, 1, 0, 0, 0, 0]),
    ],
)
def test_rank_devices_round_robin(gpus, world, devices, sharing):
    assert [device.rank_device(r, gpus) for r in range(world)] == devices
    assert [device.ranks_on_device(world, gpus, d) for d in range(gpus)] == sharing


def test_gpu_memory_check_counts_ranks_sharing_a_gpu():
    gib = 1 << 30
    need = {"world": 4, "shm_per_rank": 0, "bytes_per_rank": 10 * gib}
    assert memory.why_not_gpu(need, 100 * gib, 4, 0) is None
    why = memory.why_not_gpu(need, 30 * gib, 4, 1)
    assert why == "needs ~40.0 GiB of GPU 1 memory for 4 ranks, 30.0 GiB free"


def test_cpu_clock_is_perf_counter():
    import time

    import torch

    assert device.make_clock(torch.device("cpu")) is time.perf_counter_ns


def test_report_without_baselines_says_na_and_omits_ratios():
    """The shared-GPU path of the worker and report, forced on the CPU transport."""
    cfg = cli.resolve(_args("--quick", "--tokens", "4", "--payload", "bf16"), 2)
    na = device.na_reason(2, 1)
    cfg |= {"pg_backend": "gloo", "device_count": 0, "local_world": 2, "baselines_na": na}
    raw = runner.run_spawned(cfg, 2)
    assert raw["baselines_na"] == na and raw["ag_rs_reduce"] == na
    summary = report.summarize(raw)
    (res,) = summary
    methods = res["methods"]
    assert methods["a2a"] == {"unavailable": na} and methods["ag_rs"] == {"unavailable": na}
    assert "speedup" not in methods["pcie_a2a"]
    assert methods["pcie_a2a"]["max_rel_err"] <= report.TOLERANCE["bf16"]
    assert all(s["p50_us"] > 0 for s in methods["pcie_a2a"]["phases"].values())
    text = report.table(summary)
    rows = [" ".join(line.split()) for line in text.splitlines()]
    assert f"4 bf16 uniform a2a {na}" in rows and f"4 bf16 uniform ag_rs {na}" in rows
    assert re.search(r"\d\.\d+x", text) is None  # no ratio anywhere
    (line,) = report.target_lines(summary)
    assert f"a2a {na} (no ratio)" in line and "target" not in line
    assert report.checks(summary) == []
