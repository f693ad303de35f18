"""scripts/gpu_check.sh on the CPU: its plan fits the budget, it is valid bash, and run end
to end with fake steps (GPU_CHECK_DRY_RUN=1, scripts/gpu_check_fake.py) in a copy of the
scripts it prints each row as its step ends, kills a hung step with its children at the
deadline, skips what the budget no longer allows, reports missing files and modules, and
leaves only the result files the device tool returns (at most 8, 16 MiB each, no folders).
Also: the smoke selection picks exactly the named tier-1 tests, the preflight runs without
a GPU, and the parsers behind the preflight and the kernel breakdown.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
CHECK_SCRIPTS = (
    "gpu_check.sh", "gpu_check.py", "gpu_check_plan.py", "gpu_check_steps.py",
    "gpu_check_report.py", "gpu_check_fake.py", "gpu_check_pytest.py", "gpu_preflight.py",
    "gpu_kernel_breakdown.py",
)  # fmt: skip
TREE = (
    "tests/test_cuda_transport.py", "tests/test_cuda_stress.py", "tests/test_moe_int4_gpu.py",
    "tests/test_other_gpu.py", "benchmarks/bench_moe_gemm.py", "benchmarks/bench_cuda_one_gpu.py",
    "benchmarks/bench_allreduce_one_gpu.py", "csrc/bindings/transport.cpp", "csrc/bindings/cuda.cu",
    "csrc/bindings/cuda_transport.cu", "csrc/bindings/moe_int4.cu", "csrc/bindings/allreduce.cpp",
    "csrc/bindings/allreduce_cuda.cu", "CMakeLists.txt", "tests/test_allreduce_gpu.py",
)  # fmt: skip
OUT_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _load(name: str):
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up while it loads
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(SCRIPTS))


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "BUDGET_S"))}
    env.pop("OUT", None)
    env.pop("LOG_DIR", None)
    env.update(extra)
    return env


def fake_repo(tmp_path: Path) -> Path:
    """The gpu_check scripts and stand-ins for the files its steps need (no in-process
    harness file: that step must say "missing")."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in CHECK_SCRIPTS:
        shutil.copy2(SCRIPTS / name, repo / "scripts" / name)
    for rel in TREE:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text("# pytest.mark.gpu stand-in\n")
    return repo


def dry_run(repo: Path, out: Path, timeout: float = 90, **env: str):
    """Runs the real gpu_check.sh with fake steps; returns (rc, [(seconds, line)])."""
    start = time.monotonic()
    proc = subprocess.Popen(
        ["bash", str(repo / "scripts" / "gpu_check.sh")],
        env=_env(GPU_CHECK_DRY_RUN="1", LOG_DIR=str(out), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, lines


def rows_of(lines) -> dict[str, tuple[float, str]]:
    """step -> (arrival time, status) of the rows printed as steps ended (first table)."""
    rows: dict[str, tuple[float, str]] = {}
    for t, line in lines:
        if line.startswith("pcie_a2a GPU check on"):
            break  # the final table repeats the rows
        m = re.match(r"^(\w+)\s{2,}(\S.*?)\s{2,}", line)
        if m and m.group(1) not in rows and m.group(1) != "step":
            rows[m.group(1)] = (t, m.group(2).strip())
    return rows


def check_out_dir(out: Path) -> set[str]:
    """The device tool's limits on what comes back from $OUT."""
    files = list(out.iterdir())
    assert len(files) <= 8, files
    for f in files:
        assert f.is_file(), f"{f}: a folder or link would not come back"
        assert OUT_NAME.match(f.name), f.name
        assert f.stat().st_size <= 16 << 20, (f.name, f.stat().st_size)
    return {f.name for f in files}


def archive_members(out: Path) -> dict[str, bytes]:
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


# ---- the plan ----------------------------------------------------------------------------
def _plan(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh"), *args],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_plan_fits_the_default_budget():
    r = _plan("--plan")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fits" in r.stdout and "BUDGET_S=480" in r.stdout
    doc = json.loads(_plan("--plan-json").stdout)
    counted = [s for s in doc["steps"] if s["counted"]]
    assert sum(s["cap_s"] for s in counted) + doc["reserve_s"] <= doc["budget_s"] == 480
    names = {s["name"] for s in counted}
    assert names == {"preflight", "build", "transport_smoke", "stress", "transport_rest",
                     "inprocess", "allreduce", "gpu_other", "int4", "topo"}  # fmt: skip
    assert all(0 < s["min_s"] <= s["cap_s"] for s in doc["steps"])
    spare = {s["name"] for s in doc["steps"] if s["optional"]}
    # the benchmarks run only in time left over: slowness there never makes the run fail
    assert spare == {"bench_allreduce", "bench_one_gpu", "bench_moe_gemm", "kernels",
                     "bench_nccl", "sanitizer"}  # fmt: skip
    # the device machine: at most 600 s a command, so the budget leaves room for the start
    # of the command, the carried wheels and the copy of $OUT
    assert doc["budget_s"] <= 540
    assert {s["name"] for s in doc["steps"] if s["min_gpus"] > 1} == {"bench_nccl"}


def test_plan_that_does_not_fit_says_so_and_bad_settings_are_refused():
    r = _plan("--plan", BUDGET_S="300")
    assert r.returncode == 1 and "DOES NOT FIT" in r.stdout
    assert _plan("--plan", BUDGET_S="200", GPU_CHECK_ONLY="stress").returncode == 0
    r = _plan("--plan", BUDGET_S="abc")
    assert r.returncode == 2 and "BUDGET_S='abc'" in r.stderr
    r = _plan("--plan", GPU_CHECK_ONLY="stres")
    assert r.returncode == 2 and "unknown step(s) ['stres']" in r.stderr and "stress" in r.stderr
    r = _plan("--plan", GPU_CHECK_CAPS="build=fast")
    assert r.returncode == 2 and "expected step=seconds" in r.stderr


def test_scripts_are_valid_bash():
    for script in ("gpu_check.sh", "dev_build.sh"):
        r = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{script}: {r.stderr}"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_pass_shellcheck():
    r = subprocess.run(
        ["shellcheck", str(SCRIPTS / "gpu_check.sh"), str(SCRIPTS / "dev_build.sh")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


# ---- end to end with fake steps ------------------------------------------------------------
def test_dry_run_passes_and_returns_only_what_the_device_tool_keeps(tmp_path):
    repo, out = fake_repo(tmp_path), tmp_path / "out"
    rc, lines = dry_run(repo, out, GPU_CHECK_FAKE="kernels=biglog:6")
    text = "\n".join(line for _, line in lines)
    assert rc == 0, text
    rows = rows_of(lines)
    assert list(rows) == ["preflight", "build_tools", "build", "transport_smoke",
                          "transport_rest", "inprocess", "stress", "allreduce", "gpu_other",
                          "int4", "topo", "bench_allreduce", "bench_one_gpu", "bench_moe_gemm",
                          "kernels", "bench_nccl", "sanitizer"], text  # fmt: skip
    assert rows["inprocess"][1] == "missing"
    assert rows["bench_nccl"][1] == "skipped: 1 GPU"
    assert all(rows[n][1] == "ok" for n in rows if n not in ("inprocess", "bench_nccl")), rows
    assert "verdict: DRY RUN PASS" in text
    assert "  > stress+allreduce (one pytest process" in text  # the serial group: one process
    assert text.rstrip().endswith("continue: nothing left to run"), text[-300:]
    assert check_out_dir(out) == {"gpu_check_summary.txt", "gpu_check_junit.xml",
                                  "gpu_check_results.json", "gpu_check_logs.tar.gz",
                                  "gpu_check_modules.tar.gz"}  # fmt: skip
    logs = archive_members(out)
    big = logs["gpu_check/kernels.log"]
    assert (4 << 20) < len(big) < (4 << 20) + 200 and big.startswith(b"[gpu_check: first ")
    suite = ET.parse(out / "gpu_check_junit.xml").getroot()
    assert suite.get("failures") == "0" and int(suite.get("tests")) > len(rows)
    doc = json.loads((out / "gpu_check_results.json").read_text())
    assert doc["verdict"].startswith("DRY RUN PASS") and len(doc["rows"]) == len(rows)


def test_dry_run_failure_hang_and_budget(tmp_path):
    repo, out = fake_repo(tmp_path), tmp_path / "out"
    rc, lines = dry_run(repo, out, GPU_CHECK_FAKE="transport_smoke=fail,stress=hang",
                        GPU_CHECK_TIME_SCALE="0.05", GPU_CHECK_CAPS="stress=100", BUDGET_S="7")  # fmt: skip
    text = "\n".join(line for _, line in lines)
    assert rc == 1, text
    rows = rows_of(lines)
    # a wrong result is FAIL; the hang ran out of time: not a failure, the run unfinished
    assert rows["transport_smoke"][1] == "FAIL" and rows["stress"][1] == "TIMEOUT", rows
    assert rows["transport_rest"][1] == "ok", rows
    assert re.search(r"^stress .*did not finish: test_a", text, re.M), text
    # stress and allreduce share one pytest process: the hang left allreduce no time
    assert rows["allreduce"][1] == "TIMEOUT" and "before this step's tests started" in text
    for name in ("gpu_other", "int4", "topo", "bench_moe_gemm", "bench_one_gpu",
                 "bench_allreduce", "kernels", "sanitizer"):  # fmt: skip
        assert rows[name][1] == "skipped: budget", (name, rows)
    assert rows["inprocess"][1] == "missing"
    # each row was printed when its step ended, not at the end: the hang came between
    assert rows["stress"][0] - rows["transport_smoke"][0] > 1.5, rows
    at = [
        i for i, (_, line) in enumerate(lines) if "AssertionError: boom in transport_smoke" in line
    ]
    row_at = [i for i, (_, line) in enumerate(lines) if line.startswith("transport_smoke ")]
    assert at and row_at[0] < at[0] < next(
        i for i, (_, ln) in enumerate(lines) if ln.startswith("stress ")
    )
    verdict = next(ln for _, ln in lines if ln.startswith("verdict: "))
    assert verdict.startswith("verdict: DRY RUN FAIL: 1 of") and "(transport_smoke)" in verdict
    assert "not finished: stress, allreduce, gpu_other, int4, topo" in verdict, verdict
    # the hung step's child died with it
    pid = int(archive_members(out)["gpu_check/serial.child_pid"] if "gpu_check/serial.child_pid"
              in archive_members(out) else archive_members(out)["gpu_check/stress.child_pid"])  # fmt: skip
    assert _gone(pid), f"the hung step's child {pid} is still running"
    check_out_dir(out)
    suite = ET.parse(out / "gpu_check_junit.xml").getroot()
    assert suite.get("failures") == "2"  # the failed step and its failing test
    assert suite.get("errors") == "0"  # the test the deadline stopped is skipped, not an error
    summary = (out / "gpu_check_summary.txt").read_text()
    assert "skipped: budget" in summary and "AssertionError: boom in transport_smoke" in summary
    # the last line: the command that runs what did not finish (not what failed), with the
    # modules this run built
    cont = text.rstrip().splitlines()[-1].strip()
    assert cont == (
        "GPU_CHECK_PREBUILT=build/gpu-prebuilt/gpu_check_modules.tar.gz "
        "GPU_CHECK_CAPS=stress=100 GPU_CHECK_TIME_SCALE=0.05 GPU_CHECK_ONLY=stress,allreduce,"
        "gpu_other,int4,topo,bench_allreduce,bench_one_gpu,bench_moe_gemm,kernels,sanitizer "
        f"BUDGET_S={_continue_budget(repo, 'stress,allreduce,gpu_other,int4,topo,bench_allreduce,bench_one_gpu,bench_moe_gemm,kernels,sanitizer')} "
        "LOG_DIR=$OUT bash scripts/gpu_check.sh"
    ), cont
    assert summary.rstrip().endswith(cont)


def _continue_budget(repo: Path, steps: str) -> str:
    doc = json.loads(
        subprocess.run(
            [sys.executable, str(repo / "scripts" / "gpu_check.py"), "--plan-json"],
            env=_env(GPU_CHECK_TIME_SCALE="0.05", GPU_CHECK_CAPS="stress=100"),
            capture_output=True, text=True, check=False,
        ).stdout
    )  # fmt: skip
    caps = {s["name"]: s["cap_s"] for s in doc["steps"]}
    total = caps["preflight"] + min(caps["build"], 15) + doc["reserve_s"]
    return f"{min(480, total + sum(caps[n] for n in steps.split(','))):.0f}"


def test_dry_run_slowness_is_incomplete_and_the_continue_command_finishes_it(tmp_path):
    """Out of time (the step's deadline, a per-test timeout) is INCOMPLETE, exit 4, never
    FAIL; the printed continue command, run with the returned modules, runs exactly the
    steps left, without a rebuild."""
    repo, out = fake_repo(tmp_path), tmp_path / "out"
    rc, lines = dry_run(repo, out, GPU_CHECK_FAKE="stress=hang,int4=slowtest",
                        GPU_CHECK_TIME_SCALE="0.05", GPU_CHECK_CAPS="stress=3", BUDGET_S="30")  # fmt: skip
    text = "\n".join(line for _, line in lines)
    rows = rows_of(lines)
    assert rc == 4, text
    assert rows["stress"][1] == "TIMEOUT" and rows["allreduce"][1] == "TIMEOUT", rows
    assert rows["int4"][1] == "TIMEOUT" and "over the per-test timeout" in text, rows
    assert all(rows[n][1] == "ok" for n in ("transport_smoke", "gpu_other", "topo")), rows
    assert re.search(r"^verdict: DRY RUN INCOMPLETE: no failure; 3 not finished .*stress, "
                     r"allreduce, int4\)$", text, re.M), text  # fmt: skip
    cont = text.rstrip().splitlines()[-1].strip()
    assert "GPU_CHECK_ONLY=stress,allreduce,int4 " in cont, cont
    prebuilt = tmp_path / "build" / "gpu-prebuilt"
    prebuilt.mkdir(parents=True)
    shutil.copy(out / "gpu_check_modules.tar.gz", prebuilt)
    argv = shlex.split(
        cont.replace("build/gpu-prebuilt", str(prebuilt)).replace("$OUT", str(tmp_path / "again"))
    )
    env = dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("-"))
    assert env.pop("LOG_DIR") == str(tmp_path / "again")
    rc, lines = dry_run(repo, tmp_path / "again", GPU_CHECK_FAKE="build=fail", **env)
    rows, text = rows_of(lines), "\n".join(ln for _, ln in lines)
    assert rc == 0, text
    assert rows["build"][1] == "ok" and "prebuilt: 6 modules" in text, text
    ran = [n for n, (_, st) in rows.items() if st == "ok"]
    assert ran == ["preflight", "build_tools", "build", "stress", "allreduce", "int4"], rows
    assert text.rstrip().endswith("continue: nothing left to run")


def test_dry_run_crash_is_a_failure_and_the_group_after_it_did_not_run(tmp_path):
    repo, out = fake_repo(tmp_path), tmp_path / "out"
    rc, lines = dry_run(repo, out, GPU_CHECK_FAKE="stress=crash", GPU_CHECK_ONLY="stress,allreduce")
    rows, text = rows_of(lines), "\n".join(ln for _, ln in lines)
    assert rc == 1, text
    assert rows["stress"][1] == "FAIL" and "crashed in: test_a" in text, rows
    assert rows["allreduce"][1] == "not run" and "crashed in stress" in text, rows
    assert "GPU_CHECK_ONLY=allreduce " in text.rstrip().splitlines()[-1]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" in f.read()
    except FileNotFoundError:
        return True


def test_dry_run_without_gpu_and_without_build_tools(tmp_path):
    repo = fake_repo(tmp_path)
    rc, lines = dry_run(repo, tmp_path / "a", GPU_CHECK_FAKE="preflight=nogpu")
    rows = rows_of(lines)
    assert rc == 3 and rows["preflight"][1] == "NO GPU" and rows["build"][1] == "ok"
    assert rows["stress"][1] == "skipped: no GPU" and rows["kernels"][1] == "skipped: no GPU"
    rc, lines = dry_run(repo, tmp_path / "b", GPU_CHECK_FAKE="preflight=missingtools")
    rows, text = rows_of(lines), "\n".join(ln for _, ln in lines)
    assert rc == 1 and rows["build_tools"][1] == "FAIL" and "missing: ninja, pybind11" in text
    assert rows["build"][1] == "FAIL" and rows["stress"][1] == "skipped: no module"


def test_dry_run_module_not_built_and_prebuilt_modules(tmp_path):
    repo = fake_repo(tmp_path)
    rc, lines = dry_run(repo, tmp_path / "a", GPU_CHECK_ONLY="stress,int4",
                        GPU_CHECK_FAKE_MODULES="_transport,_cuda,_cuda_transport")  # fmt: skip
    rows, text = rows_of(lines), "\n".join(ln for _, ln in lines)
    assert rc == 1 and rows["build"][1] == "FAIL"
    # per module: the ones that built, and each one that failed with its sources
    assert re.search(r"^build +FAIL .*3 of 6 modules .*built: _cuda _cuda_transport _transport;"
                     r".* _moe_int4 FAILED: did not compile: csrc/bindings/moe_int4.cu", text, re.M), text  # fmt: skip
    assert rows["int4"][1] == "skipped: no module" and "needs pcie_a2a._moe_int4" in text
    assert rows["stress"][1] == "ok"
    # its modules come back with their status: the next call neither rebuilds the three
    # nor tries the failed ones again on the same sources
    partial = str(tmp_path / "a" / "gpu_check_modules.tar.gz")
    rc, lines = dry_run(repo, tmp_path / "a2", GPU_CHECK_PREBUILT=partial,
                        GPU_CHECK_FAKE="build=fail", GPU_CHECK_ONLY="stress")  # fmt: skip
    rows, text = rows_of(lines), "\n".join(ln for _, ln in lines)
    assert rc == 1 and rows["build"][1] == "FAIL" and rows["stress"][1] == "ok", text
    assert "in the prebuilt run, same sources: not rebuilt" in text and "fake build" not in text
    # a full build's modules come back and spare the next call its build
    assert dry_run(repo, tmp_path / "b", GPU_CHECK_ONLY="topo")[0] == 0
    prebuilt = str(tmp_path / "b" / "gpu_check_modules.tar.gz")
    rc, lines = dry_run(repo, tmp_path / "c", GPU_CHECK_PREBUILT=prebuilt,
                        GPU_CHECK_FAKE="build=fail", GPU_CHECK_ONLY="topo")  # fmt: skip
    rows, text = rows_of(lines), "\n".join(ln for _, ln in lines)
    assert rc == 0 and rows["build"][1] == "ok" and "prebuilt: 6 modules" in text, text
    assert rows["topo"][1] == "ok" and rows["stress"][1] == "skipped: not selected"
    (repo / "csrc" / "bindings" / "cuda.cu").write_text("// changed\n")
    rc, lines = dry_run(repo, tmp_path / "d", GPU_CHECK_PREBUILT=prebuilt,
                        GPU_CHECK_FAKE="build=fail", GPU_CHECK_ONLY="topo")  # fmt: skip
    text = "\n".join(ln for _, ln in lines)
    assert rc == 1 and "prebuilt modules do not match (source_hash differ); building" in text


def test_dry_run_interrupted_still_reports(tmp_path):
    repo, out = fake_repo(tmp_path), tmp_path / "out"
    proc = subprocess.Popen(
        ["bash", str(repo / "scripts" / "gpu_check.sh")],
        env=_env(GPU_CHECK_DRY_RUN="1", LOG_DIR=str(out), GPU_CHECK_FAKE="stress=hang"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("  > stress"):
                time.sleep(0.5)
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.stdout.read()
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 4, rest  # stopped from outside (the device tool's limit): INCOMPLETE
    assert re.search(r"^interrupted\s+interrupted\s.*SIGTERM", rest, re.M), rest
    assert re.search(r"GPU_CHECK_ONLY=stress,allreduce,gpu_other,.*LOG_DIR=\$OUT", rest), rest
    assert "stress" not in json.loads((out / "gpu_check_results.json").read_text())["tests"]
    pid = int(archive_members(out)["gpu_check/stress.child_pid"])
    assert _gone(pid)


# ---- the real pieces that need no GPU ------------------------------------------------------
def test_real_pytest_step_selects_the_smoke_tier_and_reports_skips(tmp_path):
    """The real transport_smoke step (pytest, the plugin, the results file) on this CPU:
    tier 1 holds every SMOKE_TESTS name once (and whatever the files mark smoke), no tier-2
    test, and all of them skip here."""
    from pcie_a2a import cuda_available

    if cuda_available():
        pytest.skip("a GPU is usable here: the tests would run instead of skipping")
    out = tmp_path / "out"
    r = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh")],
        env=_env(LOG_DIR=str(out), GPU_CHECK_SKIP="preflight,build",
                 GPU_CHECK_ONLY="transport_smoke", GPU_CHECK_FORCE="1",
                 PYTHONPATH=os.pathsep.join(sys.path)),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    m = re.search(r"^transport_smoke\s+(\S+)\s.*$", r.stdout, re.M)
    assert m and m.group(1) == "SKIPPED", r.stdout + r.stderr
    assert "not found" not in m.group(0), m.group(0)
    doc = json.loads((out / "gpu_check_results.json").read_text())
    ran = [t["nodeid"] for t in doc["tests"]["transport_smoke"]]
    assert f"nothing ran: 0 passed; {len(ran)} skipped" in m.group(0)
    plan = _load("gpu_check_plan")
    for name in plan.SMOKE_TESTS:
        assert sum(n.endswith((f"[{name}]", f"::{name}")) for n in ran) == 1, (name, ran)
    assert not any("leak" in n or "multi_" in n for n in ran), ran


def test_preflight_without_gpu(tmp_path):
    from pcie_a2a import cuda_available

    if cuda_available():
        pytest.skip("a GPU is usable here")
    out = tmp_path / "p.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_preflight.py"), "--json", str(out), "--timeout", "60"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 3, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["gpu_count"] == 0 and doc["no_gpu_reason"]
    assert doc["host"]["cores"] >= 1 and doc["host"]["dev_shm_bytes"] > 0
    assert "missing" in doc["build_tools"] and doc["torch_probe"]["torch"]


def test_preflight_parsers():
    pf = _load("gpu_preflight")
    csv = "NVIDIA H200, 580.159.04, Default, 9.0, 143771 MiB, 5, 5, 16, 16, 00000000:18:00.0\n"
    gpus = pf.parse_smi_csv(csv + "garbage line\n")
    assert (
        len(gpus) == 1 and gpus[0]["compute_cap"] == "9.0" and gpus[0]["compute_mode"] == "Default"
    )
    assert pf.cuda_archs(gpus) == "90-real"
    assert pf.cuda_archs(
        [{"compute_cap": "12.0"}, {"compute_cap": "9.0"}]
    ) == "12.0-real;9.0-real".replace(".", "")
    assert pf.cuda_archs([{"compute_cap": "[N/A]"}]) == "native"
    mem = "FB Memory Usage\n Total : 143771 MiB\nBAR1 Memory Usage\n    Total   : 262144 MiB\n    Used : 1 MiB\n"
    assert pf.parse_bar1_mib(mem) == [262144]
    assert pf.version_tuple("cmake version 3.31.6") == (3, 31, 6) >= pf.CMAKE_MIN
    assert pf.version_tuple("release 13.0, V13.0.88") == (13, 0)


def test_kernel_breakdown_aggregates_device_events():
    kb = _load("gpu_kernel_breakdown")

    def ev(name, us, device="DeviceType.CUDA"):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))  # fmt: skip

    events = [ev("void pcie_a2a::send_kernel<2, bf16>(Args const*)", 10.0)] * 4 + [
        ev("Memcpy DtoH (Device -> Pageable)", 2.0)] * 2 + [ev("cudaLaunchKernel", 99.0, "DeviceType.CPU")]  # fmt: skip
    rows = kb.aggregate(events, calls=2)
    assert [r["name"] for r in rows] == [
        "pcie_a2a::send_kernel",
        "Memcpy DtoH (Device -> Pageable)",
    ]
    assert rows[0]["per_call"] == 2 and rows[0]["mean_us"] == 10 and rows[0]["us_per_call"] == 20
    assert kb.kernels_per_call(rows) == 2 and kb.copies_per_call(rows) == (1, 0)


def test_kernel_breakdown_checks_its_calls_on_the_cpu_and_needs_a_gpu():
    """--backend cpu runs every call and its check on the CPU transport; the default
    (cuda) exits 2 without a GPU."""
    from pcie_a2a import cuda_available

    env = _env(PYTHONPATH=os.pathsep.join(sys.path))
    script = str(SCRIPTS / "gpu_kernel_breakdown.py")
    r = subprocess.run([sys.executable, script, "--small", "--backend", "cpu"],
                       capture_output=True, text=True, timeout=180, env=env)  # fmt: skip
    assert r.returncode == 0 and "summary: 6 calls checked" in r.stdout, r.stdout + r.stderr
    if not cuda_available():
        r = subprocess.run([sys.executable, script], capture_output=True, text=True,
                           timeout=120, env=env)  # fmt: skip
        assert r.returncode == 2 and "needs a GPU" in r.stderr, r.stdout + r.stderr


def test_bench_flags_the_script_no_longer_has_drop_out(tmp_path):
    steps = _load("gpu_check_steps")
    script = tmp_path / "bench.py"
    script.write_text('ap.add_argument("--model")\nap.add_argument("--iters", type=int)\n')
    got = steps.tolerant_args(
        script, [("--model", "kimi-k2"), ("--rows", "1", "16"), ("--iters", "10")]
    )
    assert got == ["--model", "kimi-k2", "--iters", "10"]
    assert steps.tolerant_args(tmp_path / "gone.py", [("--x",)]) == []


def test_report_files_stay_within_the_limits(tmp_path, monkeypatch):
    rep = _load("gpu_check_report")
    monkeypatch.setattr(rep, "MAX_FILE_BYTES", 1 << 20)  # 16 MiB on the device: scaled down
    work = tmp_path / "work"
    work.mkdir()
    for i in range(3):
        (work / f"step{i}.log").write_bytes(os.urandom(1 << 20))  # incompressible
    data = rep.logs_archive(work)
    assert len(data) <= 1 << 20
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
        assert len(members) == 3  # every log kept, each cut to its end
        tail = tar.extractfile(members[0]).read()
    assert tail.startswith(b"[gpu_check: first ") and (work / "step0.log").read_bytes().endswith(
        tail[-1000:]
    )


def test_docs_table_matches_the_plan():
    doc = json.loads(_plan("--plan-json").stdout)
    table = dict(
        re.findall(r"^\| (\w+) \| (\d+) \|", (ROOT / "docs" / "gpu_check.md").read_text(), re.M)
    )
    assert {s["name"]: int(s["cap_s"]) for s in doc["steps"]} == {
        k: int(v) for k, v in table.items()
    }
    planned = sum(s["cap_s"] for s in doc["steps"] if s["counted"]) + doc["reserve_s"]
    assert (
        f"{doc['budget_s']:.0f} s: {planned:.0f} s planned"
        in (ROOT / "docs" / "gpu_check.md").read_text()
    )


def test_bench_steps_pass_their_scripts_argument_checks(tmp_path):
    """The bench commands gpu_check builds get past the scripts' own argument checks (a bad
    flag or a refused value would fail the step on the GPU): without a GPU each one stops
    at the GPU check instead, exit 2, saying so."""
    from pcie_a2a import cuda_available

    if cuda_available():
        pytest.skip("a GPU is present: the commands would run the benchmarks")
    steps = _load("gpu_check_steps")
    check = SimpleNamespace(py=sys.executable, work=tmp_path, preflight={})
    env = _env(PYTHONPATH=os.pathsep.join(sys.path))
    for make in (steps.cmd_bench_moe_gemm, steps.cmd_bench_one_gpu):
        ((argv, _),) = make(check)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
        out = r.stdout + r.stderr
        refused_flag = re.search(r": --[a-z-]+[ :]", out)  # "bench: --iters 10: ..." style
        assert r.returncode == 2 and "usage:" not in out and not refused_flag, (argv, out)
        assert re.search(r"GPU|CUDA (driver|device)", out), (argv, out)


# ---- scripts/dev_build.sh for real, on a small tree ------------------------------------------
def _small_tree(tmp_path: Path, cuda: bool) -> Path:
    """CMakeLists.txt and dev_build.sh with a tiny csrc: a good pybind11 module, a binding
    that does not compile and, with nvcc, a CUDA part that does not compile (csrc/cuda/broken)
    beside one that does, each included by its own binding."""
    repo = tmp_path / "tree"
    for d in ("scripts", "csrc/core", "csrc/bindings", "python/pcie_a2a"):
        (repo / d).mkdir(parents=True)
    shutil.copy2(ROOT / "CMakeLists.txt", repo)
    shutil.copy2(SCRIPTS / "dev_build.sh", repo / "scripts")
    (repo / "csrc/core/a.cpp").write_text("int pa2a_answer() { return 42; }\n")
    (repo / "csrc/bindings/ok.cpp").write_text(
        "#include <pybind11/pybind11.h>\nint pa2a_answer();\n"
        'PYBIND11_MODULE(_ok, m) { m.def("answer", &pa2a_answer); }\n'
    )
    (repo / "csrc/bindings/bad.cpp").write_text("int f() { return 1 }\n")
    if cuda:
        for part, body in (("good", "return 7;"), ("broken", "return undeclared_name;")):
            (repo / "csrc/cuda" / part).mkdir(parents=True)
            (repo / "csrc/cuda" / part / "k.cuh").write_text(f"#pragma once\nint {part}_k();\n")
            (repo / "csrc/cuda" / part / "k.cu").write_text(
                f'#include "cuda/{part}/k.cuh"\nint {part}_k() {{ {body} }}\n'
            )
            (repo / "csrc/bindings" / f"{part}_cu.cu").write_text(
                f'#include "cuda/{part}/k.cuh"\nextern "C" int {part}_entry() {{ return {part}_k(); }}\n'
            )
    return repo


def test_dev_build_goes_on_past_a_broken_source_and_reports_per_module(tmp_path):
    """A source that does not compile sinks only the modules that need it: the others are
    built and installed, one line per module says which failed on which source."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    cuda = shutil.which("nvcc") is not None
    repo = _small_tree(tmp_path, cuda)
    env = _env(PYTHON=sys.executable, PCIE_A2A_WITH_CUDA="1" if cuda else "0",
               PCIE_A2A_CUDA_ARCHS="90-real", JOBS="2")  # fmt: skip
    r = subprocess.run(["bash", str(repo / "scripts/dev_build.sh")], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    status = (repo / "build/dev/pcie_a2a_modules_status.txt").read_text().splitlines()
    want = {"_ok ok", "_bad FAILED: did not compile: csrc/bindings/bad.cpp"}
    if cuda:
        want |= {"_good_cu ok", "_broken_cu FAILED: did not compile: csrc/cuda/broken/k.cu"}
    assert set(status) == want, out
    installed = sorted(p.name.split(".")[0] for p in (repo / "python/pcie_a2a").glob("_*.so"))
    assert installed == (["_good_cu", "_ok"] if cuda else ["_ok"]), out
    r = subprocess.run([sys.executable, "-c", "import _ok; print(_ok.answer())"],
                       cwd=repo / "python/pcie_a2a", capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.stdout.strip() == "42", r.stdout + r.stderr


def test_dev_build_names_every_missing_tool_before_configuring(tmp_path):
    """Without cmake, a compiler, ninja/make and nvcc on PATH: each is named, exit 2, and
    nothing was configured."""
    repo = _small_tree(tmp_path, cuda=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "awk", "grep", "head", "cut", "mkdir", "rm", "cp", "mv",
                 "tee", "sed", "sort"):  # fmt: skip
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    env = _env(PATH=str(bin_dir), PYTHON=sys.executable, PCIE_A2A_WITH_CUDA="1")
    env.pop("CXX", None)
    env.pop("CUDACXX", None)
    env.pop("PCIE_A2A_CUDA_TOOLKIT", None)
    r = subprocess.run([str(bin_dir / "bash"), str(repo / "scripts/dev_build.sh")], cwd=repo,
                       env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    for what in (
        "cmake (>= 3.24)",
        "a C++ compiler",
        "ninja or make",
        "nvcc (PCIE_A2A_WITH_CUDA=1",
    ):
        assert f"  - {what}" in r.stderr, (what, r.stderr)
    assert "Python.h" not in r.stderr and "pybind11" not in r.stderr, r.stderr
    assert not (repo / "build").exists()
