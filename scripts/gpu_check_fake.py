#!/usr/bin/env python3
"""Fake steps for GPU_CHECK_DRY_RUN=1: scripts/gpu_check.sh runs end to end on a CPU, with
every step's command replaced by this one, so tests can check the rows, the budget, the
kills and the result files without a GPU.

    gpu_check_fake.py KIND STEP WORK [EXTRA...]

GPU_CHECK_FAKE="step=behaviour[:seconds],..." says what each step does (default ok:0.05):
  ok            sleep, print a few lines, exit 0 (pytest: 2 passed; preflight: one fake
                GPU; build: creates the module placeholders, GPU_CHECK_FAKE_MODULES or all)
  fail          print 30 lines ending in "AssertionError: boom in STEP", exit 1 (pytest:
                1 passed, 1 failed)
  hang          start a child that sleeps (its pid in WORK/STEP.child_pid), then sleep
                forever: gpu_check must kill both at the step's deadline (pytest: a test
                started and never finished)
  skipall       pytest: every test skipped
  nogpu         preflight: no GPU, exit 3
  missingtools  preflight: ninja and pybind11 missing
  biglog        write `seconds` MiB of incompressible text to the log, exit 0
"""

from __future__ import annotations

import json
import os
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


def main() -> int:
    kind, step, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    extra = sys.argv[4:]
    what, secs = behaviour(step)
    print(f"fake {kind} step {step}: {what}", flush=True)
    if what == "hang":
        if kind == "pytest":  # a test that starts and never ends
            rec = {"nodeid": f"tests/test_{step}.py::test_a", "when": "start", "outcome": "started"}
            with open(extra[0], "a") as f:
                f.write(json.dumps(rec) + "\n")
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        (work / f"{step}.child_pid").write_text(str(child.pid))
        print("hanging", flush=True)
        time.sleep(3600)
        return 0
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
        if what == "fail":
            print("error: fake build failure", flush=True)
            return 1
        mods = os.environ.get("GPU_CHECK_FAKE_MODULES") or extra[1]
        out = Path(extra[0])
        out.mkdir(parents=True, exist_ok=True)
        for m in filter(None, mods.split(",")):
            (out / m).write_text("fake module\n")
        return 0
    if kind == "pytest":
        results = Path(extra[0])
        if what == "skipall":
            test_line(results, f"tests/test_{step}.py::test_a", "skipped", "no GPU (fake)")
            test_line(results, f"tests/test_{step}.py::test_b", "skipped", "no GPU (fake)")
            return 0
        test_line(results, f"tests/test_{step}.py::test_a", "passed")
        if what == "fail":
            for i in range(30):
                print(f"traceback line {i}", flush=True)
            print(f"AssertionError: boom in {step}", flush=True)
            test_line(results, f"tests/test_{step}.py::test_b", "failed", "AssertionError: boom")
            return 1
        test_line(results, f"tests/test_{step}.py::test_b", "passed")
        return 0
    if what == "fail":
        for i in range(30):
            print(f"traceback line {i}", flush=True)
        print(f"AssertionError: boom in {step}", flush=True)
        return 1
    print(f"fake {step} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
