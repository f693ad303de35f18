"""The step kinds of scripts/gpu_check.sh (see gpu_check.py): preflight, build (or the
prebuilt modules of an earlier run), pytest, and plain commands; and what their logs say.

Each ``run_*(check, step, seconds, log)`` returns the step's Row; ``check`` is the running
gpu_check.Check (its ``run`` starts a command in its own process group under a deadline,
``fake`` gives the dry-run stand-in, ``preflight`` holds the preflight's JSON).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sysconfig
import tarfile
import time
from pathlib import Path

import gpu_check_report as R
from gpu_check_plan import (
    INT4,
    OWN_STEP_FILES,
    ROOT,
    SMOKE_TESTS,
    STRESS,
    Step,
    binding_modules,
    discover_gpu_files,
    have,
    source_hash,
)


def run_preflight(check, step: Step, t: float, log: Path) -> R.Row:
    out = check.work / "preflight.json"
    if check.dry:
        argv = check.fake("preflight", step, str(out))
    else:
        argv = [check.py, str(ROOT / "scripts" / "gpu_preflight.py"), "--json", str(out),
                "--timeout", f"{max(5.0, t - 4):.0f}"]  # fmt: skip
    rc, timed_out = check.run(argv, log, t)
    try:
        check.preflight = json.loads(out.read_text())
    except (OSError, ValueError):
        check.preflight = {}
    pf = check.preflight
    check.facts.update(machine=pf.get("summary", "?"), gpu=pf.get("gpu_name", "?"),
                      driver=pf.get("driver", "?"))  # fmt: skip
    if rc == 3 or (not timed_out and rc == 0 and not pf.get("gpu_count")):
        check.no_gpu = pf.get("no_gpu_reason") or "the preflight found no usable GPU"
    tools = pf.get("build_tools", {})
    missing = tools.get("missing", ["(preflight gave no answer)"] if not pf else [])
    if timed_out:
        row = R.Row(step.name, "TIMEOUT", 0, f"stopped after {t:.0f}s; {pf.get('summary', '')}")
    elif check.no_gpu:
        row = R.Row(step.name, "NO GPU", 0, f"{check.no_gpu}; {pf.get('summary', '')}")
    else:
        problems = pf.get("problems", [])
        ok = rc == 0 and not problems
        detail = pf.get("summary", "no preflight JSON") + (
            "" if ok else f"; PROBLEMS: {'; '.join(problems) or f'exit {rc}'}"
        )
        row = R.Row(step.name, "ok" if ok else "FAIL", 0, detail)
    # one row for the build tools, right after
    check.tools_row = R.Row(
        "build_tools", "FAIL" if missing else "ok", 0.0,
        ("missing: " + ", ".join(missing) + " (carry them: README 'Verifying on a GPU')")
        if missing else tools.get("summary", ""),
    )  # fmt: skip
    return row


def add_tools_row(check) -> None:
    row = getattr(check, "tools_row", None)
    if row is not None:
        check.tools_row = None
        row.started = check.elapsed()
        check.add(row)


def run_build(check, step: Step, t: float, log: Path) -> R.Row:
    targets = binding_modules()
    tools = check.preflight.get("build_tools", {})
    if tools.get("missing"):
        return R.Row(step.name, "FAIL", 0, "not run: build tools missing (row build_tools)")
    archs = check.preflight.get("cuda_archs") or "native"
    prebuilt = os.environ.get("GPU_CHECK_PREBUILT", "").strip()
    note = ""
    if prebuilt:
        ok, note = use_prebuilt(check, Path(prebuilt), archs, targets)
        with open(log, "a") as f:
            f.write(f"prebuilt {prebuilt}: {note}\n")
        if ok:
            return R.Row(step.name, "ok", 0, note)
        note += "; building"
    if check.dry:
        argv = check.fake("build", step, str(check.modules_dir), ",".join(targets))
        env = {}
    else:
        argv = ["bash", str(ROOT / "scripts" / "dev_build.sh"), *targets]
        jobs = str(os.cpu_count() or 4)
        env = {"BUILD": "build/gpu-check", "PCIE_A2A_WITH_CUDA": "1",
               "PCIE_A2A_CUDA_ARCHS": archs, "JOBS": jobs, "PCIE_A2A_WERROR": "0",
               "PYTHON": check.py}  # fmt: skip
        nvcc_dir = tools.get("nvcc_dir")
        if nvcc_dir:
            env["PATH"] = nvcc_dir + os.pathsep + check.env.get("PATH", "")
    if not check.dry:  # dev_build.sh installs into python/: run against that from now on
        check.modules_dir = ROOT / "python" / "pcie_a2a"
        if str(ROOT / "python") not in check.env["PYTHONPATH"].split(os.pathsep):
            check.env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + check.env["PYTHONPATH"]
    rc, timed_out = check.run(argv, log, t, env)
    absent = [m for m in targets if not check.built(m)]
    what = f"{len(targets)} modules ({' '.join(targets)}) for {archs}, -j{os.cpu_count()}"
    if note:
        what = f"{note}; {what}"
    if timed_out:
        return R.Row(step.name, "TIMEOUT", 0, f"stopped after {t:.0f}s: {what}")
    if rc != 0 or absent:
        why = f"exit {rc}" + (f", not built: {' '.join(absent)}" if absent else "")
        return R.Row(step.name, "FAIL", 0, f"{why}: {what}")
    pack_modules(check, targets, archs)
    return R.Row(step.name, "ok", 0, what)


def _module_files(check, targets) -> list[Path]:
    files = []
    for m in targets:
        files += sorted(check.modules_dir.glob(f"{m}.*so")) or [
            p for p in (check.modules_dir / m, check.modules_dir / f"{m}.so") if p.exists()
        ]
    return files


def _manifest(check, archs: str) -> dict:
    return {"source_hash": source_hash(ROOT), "archs": archs,
            "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"), "commit": check.facts["commit"]}  # fmt: skip


def pack_modules(check, targets, archs: str) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = json.dumps(_manifest(check, archs)).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for p in _module_files(check, targets):
            tar.add(p, arcname=p.name)
    if len(buf.getvalue()) < R.MAX_FILE_BYTES:
        R.write_atomic(check.log_dir / R.MODULES, buf.getvalue())


def use_prebuilt(check, path: Path, archs: str, targets) -> tuple[bool, str]:
    try:
        with tarfile.open(path) as tar:
            manifest = json.load(tar.extractfile("manifest.json"))
            want = _manifest(check, archs)
            stale = [
                k for k in ("source_hash", "archs", "ext_suffix") if manifest.get(k) != want[k]
            ]
            if stale:
                return False, f"prebuilt modules do not match ({', '.join(stale)} differ)"
            names = [m.name for m in tar.getmembers()
                     if m.isfile() and m.name != "manifest.json" and "/" not in m.name]  # fmt: skip
            check.modules_dir.mkdir(parents=True, exist_ok=True)
            for name in names:
                dst = check.modules_dir / name
                tmp = dst.with_name(f"{name}.tmp.{os.getpid()}")
                tmp.write_bytes(tar.extractfile(name).read())
                tmp.chmod(0o755)
                os.replace(tmp, dst)  # by rename: see dev_build.sh
    except (OSError, KeyError, ValueError, tarfile.TarError) as exc:
        return False, f"prebuilt modules unusable: {exc}"
    absent = [m for m in targets if not check.built(m)]
    if absent:
        return False, f"prebuilt modules lack {' '.join(absent)}"
    return True, f"prebuilt: {len(names)} modules from {path.name} (sources match)"


def pytest_files(check, step: Step) -> list[str]:
    if step.collect == "gpu_all":
        return [f for f in discover_gpu_files() if f not in (STRESS, INT4)]
    if step.collect == "gpu_other":
        return [f for f in discover_gpu_files() if f not in OWN_STEP_FILES]
    return [f for f in step.files + step.expect if (ROOT / f).exists()]


def run_pytest(check, step: Step, t: float, log: Path) -> R.Row:
    files = pytest_files(check, step)
    if not files:
        return R.Row(step.name, "skipped: no files", 0, "no test file with GPU tests left for it")
    results = check.work / f"{step.name}.tests.jsonl"
    end = time.monotonic() + t
    rcs, timed_out = [], False
    if check.dry:
        rcs.append(check.run(check.fake("pytest", step, str(results)), log, t)[0])
        timed_out = rcs[-1] == 124
    else:
        base = [check.py, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "gpu_check_pytest",
                f"--gpu-check-results={results}", "-m", step.marker]  # fmt: skip
        if step.smoke:
            base.append("--gpu-check-smoke=" + ",".join(SMOKE_TESTS))
        if have("pytest_timeout"):
            base += [f"--timeout={step.per_test_s:.0f}", "--timeout-method=signal"]
        parallel = step.workers > 1 and have("xdist") and os.environ.get("GPU_CHECK_XDIST") != "0"
        runs = [(["-k", f"not ({step.serial_k})"] if step.serial_k else [], parallel)]
        if step.serial_k:
            runs.append((["-k", step.serial_k], False))
        for extra, par in runs:
            argv = base + extra + (["-n", str(step.workers)] if par else []) + files
            rc, timed_out = check.run(argv, log, end - time.monotonic())
            rcs.append(rc)
            if timed_out:
                break
    tests, unmatched = R.read_test_results(results)
    n = R.count_tests(tests)
    failed = [R.short_id(x["nodeid"]) for x in tests if x["outcome"] in ("failed", "error")]
    parts = [f"{n['passed']} passed"]
    if failed:
        parts.insert(
            0,
            f"{len(failed)} failed: {', '.join(failed[:6])}{' ...' if len(failed) > 6 else ''}",
        )
    if n["skipped"]:
        reason = next((x["message"] for x in tests if x["outcome"] == "skipped"), "")
        parts.append(f"{n['skipped']} skipped ({reason[:120]})")
    unfinished = [R.short_id(x["nodeid"]) for x in tests if not x["outcome"]]
    if unfinished:
        parts.append(f"did not finish: {', '.join(unfinished[:4])}")
    if unmatched:
        parts.append(f"smoke names not found: {', '.join(unmatched)}")
    detail = "; ".join(parts)
    row = R.Row(step.name, "ok", 0, detail, tests=tests)
    if timed_out:
        row.status, row.detail = "TIMEOUT", f"stopped after {t:.0f}s; {detail}"
    elif failed or any(rc not in (0, 5) for rc in rcs):
        bad = [rc for rc in rcs if rc not in (0, 1, 5)]
        row.status = "FAIL"
        if bad and not failed:
            row.detail = f"pytest exit {bad[0]} (error before or between tests); {detail}"
    elif n["passed"] == 0:
        row.status = "SKIPPED"
        row.detail = "nothing ran: " + (detail if tests else "no test selected")
    return row


def run_cmd(check, step: Step, t: float, log: Path) -> R.Row:
    cmds = COMMANDS[step.name](check)
    if isinstance(cmds, str):  # a reason it cannot run here
        return R.Row(step.name, "skipped: " + cmds.split(":")[0], 0, cmds)
    end = time.monotonic() + t
    rcs, timed_out = [], False
    for argv, env in cmds:
        if check.dry:
            argv = check.fake("cmd", step)
        rc, timed_out = check.run(argv, log, end - time.monotonic(), env)
        rcs.append(rc)
        if timed_out or check.dry:
            break
    detail = summarise(step.name, log)
    report = report_lines(step.name, log)
    if report:
        check.reports.append((REPORT_TITLES.get(step.name, step.name), report))
    if timed_out:
        status = "incomplete" if step.optional else "TIMEOUT"
        return R.Row(step.name, status, 0, f"stopped after {t:.0f}s; {detail}")
    bad = [rc for rc in rcs if rc != 0]
    return R.Row(
        step.name, "FAIL" if bad else "ok", 0, (f"exit {bad[0]}: " if bad else "") + detail
    )


# ---- commands of the cmd steps (a str: why it cannot run here) ---------------------------
def cmd_bench_moe_gemm(check):
    script = "benchmarks/bench_moe_gemm.py"
    # --quick is the bench's own reduced sweep (A 1/8/48, m 1/4, one prefill point); its
    # medians need its default 100 iterations (it refuses fewer).
    args = tolerant_args(ROOT / script, [("--model", "kimi-k2"), ("--quick",), ("--check",),
                         ("--json", str(check.work / "bench_moe_gemm.json"))])  # fmt: skip
    return [([check.py, script, *args], None)]


def cmd_bench_one_gpu(check):
    script = "benchmarks/bench_cuda_one_gpu.py"
    args = tolerant_args(ROOT / script, [("--worlds", "1,2,4"), ("--warmup", "3"), ("--iters", "50"),
                         ("--budget-s", "1.0"), ("--world-timeout-s", "30"), ("--copy-mib", "256"),
                         ("--json", str(check.work / "bench_cuda_one_gpu.json"))])  # fmt: skip
    return [([check.py, script, *args], None)]


def cmd_bench_allreduce(check):
    script = "benchmarks/bench_allreduce_one_gpu.py"
    args = tolerant_args(ROOT / script, [("--quick",),
                         ("--json", str(check.work / "bench_allreduce_one_gpu.json"))])  # fmt: skip
    return [([check.py, script, *args], None)]


def cmd_kernels(check):
    out = str(check.work / "kernels.json")
    return [([check.py, "scripts/gpu_kernel_breakdown.py", "--json", out], None)]


def cmd_topo(check):
    gpus = int(check.preflight.get("gpu_count", 0) or 0)
    return [([check.py, "-m", "pcie_a2a", "topo", *(["--probe"] if gpus >= 2 else [])], None)]


def cmd_bench_nccl(check):
    world = min(8, int(check.preflight.get("gpu_count", 2) or 2))
    return [([check.py, "-m", "pcie_a2a", "bench", "--backend", "cuda", "--world", str(world),
              "--tokens", "128", "--iters", "20", "--warmup", "3", "--max-seconds", "10",
              "--timeout", "45", "--json", str(check.work / "bench_nccl.json"), "--plot", "none"],
             None)]  # fmt: skip


def cmd_sanitizer(check):
    tool = None if check.dry else find_sanitizer()
    if tool is None and not check.dry:
        return "compute-sanitizer not found: memcheck not run"
    env = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}  # every tensor its own allocation
    base = [tool or "compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "99",
            "--print-limit", "20", "--target-processes", "all"]  # fmt: skip
    return [
        ([*base, check.py, "scripts/gpu_kernel_breakdown.py", "--small"], env),
        ([*base, check.py, "-m", "pytest", "-q", "-p", "no:cacheprovider", INT4, "-k", "test_expert_counts and 16 and skewed"], env),
    ]  # fmt: skip


def tolerant_args(script: Path, options: list[tuple[str, ...]]) -> list[str]:
    """The options the script still accepts (its source names them): a renamed or removed
    flag drops out instead of failing the step with a usage error."""
    try:
        text = script.read_text()
    except OSError:
        return []
    out: list[str] = []
    for opt in options:
        if f'"{opt[0]}"' in text or f"'{opt[0]}'" in text:
            out += list(opt)
    return out


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda-*/bin/compute-sanitizer",
                    "/opt/nvidia/*/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):  # fmt: skip
        hits = sorted(Path("/").glob(pattern.lstrip("/")))
        if hits:
            return str(hits[-1])
    return None


REPORT_TITLES = {
    "bench_one_gpu": "bench_cuda_one_gpu (worlds > 1 share one GPU: correctness, not speed)",
    "bench_moe_gemm": "bench_moe_gemm (reduced)",
    "bench_allreduce": "bench_allreduce_one_gpu --quick (W ranks share one GPU: kernel cost, not PCIe)",
    "kernels": "per-kernel breakdown, world 1",
    "bench_nccl": "pcie-a2a bench --backend cuda (vs NCCL)",
    "topo": "pcie-a2a topo",
}
_REPORT_START = {
    "bench_one_gpu": r"^ *world +payload",
    "bench_moe_gemm": r"^device: ",
    "bench_allreduce": r"^ONE GPU",
    "kernels": r"^kernel breakdown",
    "bench_nccl": r"^machine: ",
    "topo": r"^\$ ",
}


def report_lines(name: str, log: Path, limit: int = 45) -> list[str]:
    start = _REPORT_START.get(name)
    if start is None:
        return []
    lines = R.log_tail(log, 400)
    for i, line in enumerate(lines):
        if re.search(start, line):
            body = [ln for ln in lines[i:] if not ln.startswith(("[gpu_check:", "$ "))]
            if name == "bench_one_gpu":  # several processes on one GPU time-slice it
                body = [ln + "  [correctness, not speed]" if re.match(r"^\s*[2-8]\s", ln) else ln
                        for ln in body]  # fmt: skip
            return body[:limit]
    return []


def summarise(name: str, log: Path) -> str:
    lines = R.log_tail(log, 400)
    if name == "bench_one_gpu":
        worlds = [m.group(0) for ln in lines if (m := re.match(r"world \d+: \S+", ln))]
        if worlds:
            return ", ".join(worlds) + "; worlds > 1 time-slice one GPU: correctness, not speed"
    if name == "bench_moe_gemm":
        check = next((ln for ln in lines if ln.startswith("check:")), "")
        points = sum(1 for ln in lines if re.search(r" m= *\d+ int4 ", ln))
        return f"{points} points; {check or 'no check line'}"
    if name == "bench_allreduce":
        rows = [ln for ln in lines if re.match(r"^ *\d+ +(one|two)_shot +\d+ +[\d.]+ ", ln)]
        wrong = sum(1 for ln in rows if ln.rstrip().endswith("WRONG"))
        if rows:
            return f"{len(rows)} points, {wrong} wrong; one GPU: kernel cost, not PCIe"
    if name == "sanitizer":
        errors = [ln.strip() for ln in lines if "ERROR SUMMARY" in ln]
        if errors:
            return "; ".join(errors)
    if name == "kernels":
        found = [ln.removeprefix("summary: ") for ln in lines if ln.startswith("summary: ")]
        if found:
            return "; ".join(found)
    kept = [ln for ln in lines if not ln.startswith(("[gpu_check:", "$ "))]
    return kept[-1][:200] if kept else ""


COMMANDS = {
    "bench_moe_gemm": cmd_bench_moe_gemm,
    "bench_one_gpu": cmd_bench_one_gpu,
    "bench_allreduce": cmd_bench_allreduce,
    "kernels": cmd_kernels,
    "topo": cmd_topo,
    "bench_nccl": cmd_bench_nccl,
    "sanitizer": cmd_sanitizer,
}
KINDS = {"preflight": run_preflight, "build": run_build, "pytest": run_pytest, "cmd": run_cmd}
