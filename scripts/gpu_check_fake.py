#!/usr/bin/env python3
"""Fake steps for GPU_CHECK_DRY_RUN=1: scripts/gpu_check.sh runs end to end on a CPU, with
every step's command replaced by this one, so tests can check the rows, the budget, the
kills and the result files without a GPU.

    gpu_check_fake.py KIND STEP WORK [EXTRA...]

A pytest step of several members (a group: EXTRA is the results file, then the member
names) runs each member's behaviour in turn, in one process, as that member's own test file would.

GPU_CHECK_FAKE="step=behaviour[:seconds],..." says what each step does (default ok:0.05):
  ok            sleep, print a few lines, exit 0 (pytest: 2 passed; preflight: one fake
                GPU; build: creates the placeholders of the modules asked for that are in
                GPU_CHECK_FAKE_MODULES (default all), reports the others as failed to
                compile, as dev_build.sh does, and exits 1 if there are any)
  fail          print 30 lines ending in "AssertionError: boom in STEP", exit 1 (pytest:
                1 passed, 1 failed)
  hang          start a child that sleeps (its pid in WORK/STEP.child_pid), then sleep
                forever: gpu_check must kill both at the step's deadline (pytest: a test
                started and never finished)
  skipall       pytest: every test skipped
  crash         pytest: a test starts and the process dies of SIGSEGV
  slowtest      pytest: a test fails with pytest-timeout's message (over its timeout)
  nogpu         preflight: no GPU, exit 3
  missingtools  preflight: ninja and pybind11 missing
  biglog        write `seconds` MiB of incompressible text to the log, exit 0
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def behaviour(step: str) -> tuple[str, float]:
    spec = {}
    for item in os.environ.get("GPU_CHECK_FAKE", "").split(","):
        name, _, what = item.strip().partition("=")
        if name:
            spec[name] = what
    what, _, secs = (spec.get(step) or "ok").partition(":")
    return what, float(secs or 0.05)


def test_line(results: Path, nodeid: str, outcome: str, message: str = "") -> None:
    rec = {"nodeid": nodeid, "when": "setup" if outcome == "skipped" else "call",
           "outcome": outcome, "duration": 0.01, "message": message}  # fmt: skip
    with open(results, "a") as f:
        f.write(json.dumps(rec) + "\n")


def preflight_json(what: str) -> dict:
    gpu = what != "nogpu"
    return {
        "summary": "FAKE GPU x1 (fake driver)" if gpu else "no GPU (fake)",
        "gpu_count": 1 if gpu else 0,
        "gpu_name": "FAKE GPU" if gpu else "",
        "driver": "0.0" if gpu else "",
        "cuda_archs": "90-real",
        "no_gpu_reason": "" if gpu else "fake: nvidia-smi not found",
        "problems": ["fake problem"] if what == "fail" else [],
        "build_tools": {
            "missing": ["ninja", "pybind11"] if what == "missingtools" else [],
            "summary": "fake tools",
        },
    }


def pytest_member(step: str, results: Path, work: Path) -> int:
    what, secs = behaviour(step)
    nodeid = f"tests/test_{step}.py"
    if what in ("hang", "crash"):  # a test that starts and never ends
        rec = {"nodeid": f"{nodeid}::test_a", "when": "start", "outcome": "started"}
        with open(results, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if what == "crash":
            print(f"Fatal Python error: Segmentation fault in {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
        hang(step, work)
    time.sleep(secs)
    if what == "skipall":
        test_line(results, f"{nodeid}::test_a", "skipped", "no GPU (fake)")
        test_line(results, f"{nodeid}::test_b", "skipped", "no GPU (fake)")
        return 0
    test_line(results, f"{nodeid}::test_a", "passed")
    if what == "fail":
        for i in range(30):
            print(f"traceback line {i}", flush=True)
        print(f"AssertionError: boom in {step}", flush=True)
        test_line(results, f"{nodeid}::test_b", "failed", "AssertionError: boom")
        return 1
    if what == "slowtest":
        test_line(
            results, f"{nodeid}::test_b", "failed", "Failed: Timeout (>60.0s) from pytest-timeout."
        )
        return 1
    test_line(results, f"{nodeid}::test_b", "passed")
    return 0


def hang(step: str, work: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    (work / f"{step}.child_pid").write_text(str(child.pid))
    print("hanging", flush=True)
    time.sleep(3600)


def build(what: str, extra: list[str]) -> int:
    if what == "fail":
        print("error: fake build failure", flush=True)
        return 1
    out, todo, status = Path(extra[0]), [m for m in extra[1].split(",") if m], Path(extra[2])
    have = os.environ.get("GPU_CHECK_FAKE_MODULES")
    builds = set(have.split(",")) if have is not None else set(todo)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for m in todo:
        if m in builds:
            (out / m).write_text("fake module\n")
            lines.append(f"{m} ok")
        else:
            lines.append(f"{m} FAILED: did not compile: csrc/bindings/{m[1:]}.cu (fake)")
    status.write_text("".join(line + "\n" for line in lines))
    print("\n".join(lines), flush=True)
    return 0 if all(line.endswith(" ok") for line in lines) else 1


def main() -> int:
    kind, step, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    extra = sys.argv[4:]
    what, secs = behaviour(step)
    print(f"fake {kind} step {step}: {what}", flush=True)
    if kind == "pytest":
        members = extra[1:] or [step]
        rc = 0
        for m in members:
            rc = max(rc, pytest_member(m, Path(extra[0]), work))
        return rc
    if what == "hang":
        hang(step, work)
    if what == "biglog":
        chunk = os.urandom(1 << 19).hex()  # 1 MiB of text per line
        for _ in range(int(secs)):
            print(chunk, flush=True)
        return 0
    time.sleep(secs)
    if kind == "preflight":
        Path(extra[0]).write_text(json.dumps(preflight_json(what)))
        return {"nogpu": 3, "fail": 1}.get(what, 0)
    if kind == "build":
        return build(what, extra)
    if what == "fail":
        for i in range(30):
            print(f"traceback line {i}", flush=True)
        print(f"AssertionError: boom in {step}", flush=True)
        return 1
    print(f"fake {step} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
