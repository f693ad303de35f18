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


BUILD_DIR = "build/gpu-check"
STATUS_FILE = "pcie_a2a_modules_status.txt"  # written by dev_build.sh in its build folder


def run_build(check, step: Step, t: float, log: Path) -> R.Row:
    """Every module on its own (dev_build.sh goes on past a module that fails): the row
    says which built, which failed and on which sources; steps needing a failed module get
    "skipped: no module". Modules of GPU_CHECK_PREBUILT whose sources match are not rebuilt,
    nor are those that failed there on the same sources."""
    targets = binding_modules()
    tools = check.preflight.get("build_tools", {})
    if tools.get("missing"):
        return R.Row(step.name, "FAIL", 0, "not run: build tools missing (row build_tools)")
    archs = check.preflight.get("cuda_archs") or "native"
    if not check.dry:  # dev_build.sh installs into python/: run against that from now on
        check.modules_dir = ROOT / "python" / "pcie_a2a"
        if str(ROOT / "python") not in check.env["PYTHONPATH"].split(os.pathsep):
            check.env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + check.env["PYTHONPATH"]
    status: dict[str, str] = {}  # module -> "ok" | "FAILED: why"
    note = ""
    prebuilt = os.environ.get("GPU_CHECK_PREBUILT", "").strip()
    if prebuilt:
        status, note = use_prebuilt(check, Path(prebuilt), archs, targets)
        with open(log, "a") as f:
            f.write(f"prebuilt {prebuilt}: {note}\n")
    todo = [m for m in targets if m not in status]
    rc, timed_out = 0, False
    if todo:
        status_file = (check.work if check.dry else ROOT / BUILD_DIR) / STATUS_FILE
        status_file.unlink(missing_ok=True)
        if check.dry:
            argv = check.fake("build", step, str(check.modules_dir), ",".join(todo),
                              str(status_file))  # fmt: skip
            env = {}
        else:
            argv = ["bash", str(ROOT / "scripts" / "dev_build.sh"), *todo]
            env = {"BUILD": BUILD_DIR, "PCIE_A2A_WITH_CUDA": "1", "PCIE_A2A_CUDA_ARCHS": archs,
                   "JOBS": str(os.cpu_count() or 4), "PCIE_A2A_WERROR": "0", "PYTHON": check.py}  # fmt: skip
            nvcc_dir = tools.get("nvcc_dir")
            if nvcc_dir:
                env["PATH"] = nvcc_dir + os.pathsep + check.env.get("PATH", "")
        rc, timed_out = check.run(argv, log, t, env)
        if timed_out and not check.dry:
            install_built(todo)
        status.update(read_status(status_file, todo))
        for m in todo:  # out of time, or a build that stopped before its report
            if m not in status and check.built(m):
                status[m] = "ok"
    ok = [m for m in targets if status.get(m) == "ok"]
    failed = {m: status[m] for m in targets if status.get(m, "ok") != "ok"}
    absent = [m for m in targets if m not in status]
    if ok:
        pack_modules(check, ok, archs, status)
    parts = [f"{len(ok)} of {len(targets)} modules for {archs}, -j{os.cpu_count()}"]
    if note:
        parts.insert(0, note)
    if ok:
        parts.append("built: " + " ".join(ok))
    parts += [f"{m} {why}" for m, why in failed.items()]
    if absent:
        parts.append("not built: " + " ".join(absent) + (" (out of time)" if timed_out else
                                                            f" (dev_build.sh exit {rc})"))  # fmt: skip
    detail = "; ".join(parts)
    if failed:
        return R.Row(step.name, "FAIL", 0, detail)
    if absent:
        return R.Row(step.name, "TIMEOUT" if timed_out else "FAIL", 0, detail)
    return R.Row(step.name, "ok", 0, detail)


def read_status(path: Path, todo: list[str]) -> dict[str, str]:
    """dev_build.sh's per-module lines: "<module> ok" or "<module> FAILED: why"."""
    out = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        name, _, rest = line.strip().partition(" ")
        if name in todo and rest:
            out[name] = "ok" if rest == "ok" else rest
    return out


def install_built(todo: list[str]) -> None:
    """After a build stopped at its deadline: the modules it finished (dev_build.sh removes
    a module's old file before building it, so what is there was built now), by rename."""
    dst_dir = ROOT / "python" / "pcie_a2a"
    for m in todo:
        for so in (ROOT / BUILD_DIR).glob(f"{m}.*so"):
            tmp = dst_dir / f"{so.name}.tmp.{os.getpid()}"
            shutil.copyfile(so, tmp)
            tmp.chmod(0o755)
            os.replace(tmp, dst_dir / so.name)


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


def pack_modules(check, ok: list[str], archs: str, status: dict[str, str]) -> None:
    """The modules that built and every module's status, for a continuing call."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = json.dumps({**_manifest(check, archs), "modules": status}).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        files = _module_files(check, ok)
        for p in files:
            tar.add(p, arcname=p.name)
    if len(buf.getvalue()) < R.MAX_FILE_BYTES:
        R.write_atomic(check.log_dir / R.MODULES, buf.getvalue())
        check.packed = list(ok)


def use_prebuilt(check, path: Path, archs: str, targets) -> tuple[dict[str, str], str]:
    """({module: status} taken from the archive, what happened). Nothing is taken when the
    sources, archs or Python differ; a module that failed there on the same sources fails
    again without a rebuild."""
    try:
        with tarfile.open(path) as tar:
            manifest = json.load(tar.extractfile("manifest.json"))
            want = _manifest(check, archs)
            stale = [
                k for k in ("source_hash", "archs", "ext_suffix") if manifest.get(k) != want[k]
            ]
            if stale:
                return {}, f"prebuilt modules do not match ({', '.join(stale)} differ); building"
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
        return {}, f"prebuilt modules unusable: {exc}; building"
    recorded = manifest.get("modules") or {}
    status = {m: "ok" for m in targets if check.built(m)}
    for m, why in recorded.items():
        if m in targets and m not in status and why != "ok":
            status[m] = f"{why} (in the prebuilt run, same sources: not rebuilt)"
    rest = [m for m in targets if m not in status]
    return status, f"prebuilt: {len(names)} modules from {path.name} (sources match)" + (
        f", building {' '.join(rest)}" if rest else ""
    )


def pytest_files(check, step: Step) -> list[str]:
    if step.collect == "gpu_all":
        return [f for f in discover_gpu_files() if f not in (STRESS, INT4)]
    if step.collect == "gpu_other":
        return [f for f in discover_gpu_files() if f not in OWN_STEP_FILES]
    return [f for f in step.files + step.expect if (ROOT / f).exists()]


_PER_TEST_TIMEOUT = re.compile(r"Timeout \(?>[\d.]+s")  # pytest-timeout's failure message


def _pytest(check, step: Step, files: list[str], t: float, log: Path, results: Path,
            members: list[Step] | None = None) -> tuple[list[int], bool]:  # fmt: skip
    """Runs pytest on `files` (the fake in a dry run) under `t` seconds; (exit codes, timed out)."""
    end = time.monotonic() + t
    if check.dry:
        names = [m.name for m in members] if members else [step.name]
        rc, timed_out = check.run(check.fake("pytest", step, str(results), *names), log, t)
        return [] if timed_out else [rc], timed_out
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
    rcs, timed_out = [], False
    for extra, par in runs:
        argv = base + extra + (["-n", str(step.workers)] if par else []) + files
        rc, timed_out = check.run(argv, log, end - time.monotonic())
        if timed_out:  # its exit status is the kill's, not pytest's
            break
        rcs.append(rc)
    return rcs, timed_out


def pytest_row(name: str, tests: list[dict], rcs: list[int], timed_out: bool, t: float,
               unmatched: list[str] = ()) -> R.Row:  # fmt: skip
    """FAIL for a failed test or a crash; TIMEOUT (the run INCOMPLETE) when the step's
    deadline or a per-test timeout stopped a test; SKIPPED when nothing ran."""
    n = R.count_tests(tests)
    slow = [R.short_id(x["nodeid"]) for x in tests
            if x["outcome"] == "failed" and _PER_TEST_TIMEOUT.search(x["message"])]  # fmt: skip
    failed = [R.short_id(x["nodeid"]) for x in tests if x["outcome"] in ("failed", "error")]
    failed = [f for f in failed if f not in slow]
    unfinished = [R.short_id(x["nodeid"]) for x in tests if not x["outcome"]]
    crashed = bool(unfinished) and not timed_out  # the process died inside a test
    parts = [f"{n['passed']} passed"]
    if failed:
        more = " ..." if len(failed) > 6 else ""
        parts.insert(0, f"{len(failed)} failed: {', '.join(failed[:6])}{more}")
    if slow:
        parts.append(f"over the per-test timeout (slow or hung): {', '.join(slow[:4])}")
    if n["skipped"]:
        reason = next((x["message"] for x in tests if x["outcome"] == "skipped"), "")
        parts.append(f"{n['skipped']} skipped ({reason[:120]})")
    if unfinished:
        verb = "crashed in" if crashed else "did not finish"
        parts.append(f"{verb}: {', '.join(unfinished[:4])}")
    if unmatched:
        parts.append(f"smoke names not found: {', '.join(unmatched)}")
    detail = "; ".join(parts)
    bad = [rc for rc in rcs if rc not in (0, 1, 5)]
    if failed or crashed:
        row = R.Row(name, "FAIL", 0, detail + (f" (pytest exit {bad[0]})" if bad else ""))
    elif timed_out:
        row = R.Row(name, "TIMEOUT", 0, f"stopped after {t:.0f}s; {detail}")
    elif bad and not slow:
        row = R.Row(
            name, "FAIL", 0, f"pytest exit {bad[0]} (error before or between tests); {detail}"
        )
    elif slow:
        row = R.Row(name, "TIMEOUT", 0, detail)
    elif n["passed"] == 0:
        row = R.Row(name, "SKIPPED", 0, "nothing ran: " + (detail if tests else "no test selected"))
    else:
        row = R.Row(name, "ok", 0, detail)
    row.tests = tests
    return row


def run_pytest(check, step: Step, t: float, log: Path) -> R.Row:
    files = pytest_files(check, step)
    if not files:
        return R.Row(step.name, "skipped: no files", 0, "no test file with GPU tests left for it")
    results = check.work / f"{step.name}.tests.jsonl"
    rcs, timed_out = _pytest(check, step, files, t, log, results)
    tests, unmatched = R.read_test_results(results)
    return pytest_row(step.name, tests, rcs, timed_out, t, unmatched)


def run_pytest_group(check, members: list[Step], whole: Step, t: float, log: Path) -> list[R.Row]:
    """The members' files in one pytest process; each test's row is its file's step's. A
    member the deadline reached before its tests ran is TIMEOUT, not failed."""
    owner: dict[str, str] = {}
    for m in members:
        for f in pytest_files(check, m):
            owner.setdefault(f, m.name)
        owner[f"tests/test_{m.name}.py"] = m.name  # the dry run's fake test files
    files = [f for f in owner if (ROOT / f).exists()]
    results = check.work / f"{members[0].group}.tests.jsonl"
    start = time.monotonic()
    rcs, timed_out = _pytest(check, whole, files, t, log, results, members)
    took = time.monotonic() - start
    tests, unmatched = R.read_test_results(results)
    mine = {m.name: [x for x in tests if owner.get(x["nodeid"].split("::")[0]) == m.name]
            for m in members}  # fmt: skip
    crashed_in = next((m.name for m in members if any(not x["outcome"] for x in mine[m.name])),
                      None) if not timed_out else None  # fmt: skip
    rows = []
    reached = True  # members after the one the deadline stopped never started
    for m in members:
        got = mine[m.name]
        if crashed_in and not got and not reached:
            row = R.Row(m.name, "not run", 0, f"the shared pytest process crashed in {crashed_in}")
        elif not got and (timed_out or not reached):
            row = R.Row(m.name, "TIMEOUT", 0, f"the shared run ({whole.name}) ran out of its "
                        f"{t:.0f}s before this step's tests started")  # fmt: skip
            reached = False
        else:
            cut = timed_out and any(not x["outcome"] for x in got)
            own_rcs = rcs if crashed_in in (None, m.name) else [0]
            row = pytest_row(m.name, got, own_rcs, cut, t, unmatched if m is members[0] else [])
            if cut or m.name == crashed_in:
                reached = False
            elif timed_out and row.status == "SKIPPED" and not got:
                row.status = "TIMEOUT"
        row.seconds = sum(x["duration"] for x in got)
        rows.append(row)
    if rows and not any(r.seconds for r in rows):
        rows[0].seconds = took
    return rows


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
        status = "TIMEOUT"  # an optional step's does not make the run INCOMPLETE
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
