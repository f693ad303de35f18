#!/usr/bin/env python3
"""The engine of scripts/gpu_check.sh: the first GPU run, in one call, with a verdict.

A GPU window here is short (about 15 minutes of device time with the machine's start,
at most 10 minutes per command, a fresh machine every call, only $OUT comes back), so:

* one overall deadline (BUDGET_S, default 480 s). Every step has a planned cap; the caps
  of the one-GPU plan plus RESERVE_S fit the budget (``--plan`` prints and checks it). A
  step may use time that earlier steps left unused, never the caps of the steps after
  it; a step that cannot get its minimum is skipped with a "skipped: budget" row; the
  optional steps (benchmarks) get only time nothing after them needs;
* the verdict: FAIL for a wrong result, a crash or a build error, INCOMPLETE when a
  non-optional step ran out of time or ran nothing (gpu_check_report.verdict); the output
  and the summary end with the command that runs what is left (``continue_lines``);
* every row is printed when its step ends, with the tail of its log on failure, and the
  result files in LOG_DIR ($OUT when set) are rewritten after every step, so a run that
  is killed still returns everything up to its last step (gpu_check_report.py);
* a step needs files and modules: a test file nobody has written yet gives a "missing"
  row, a module the build did not make gives "skipped: needs ...", never a crash;
* each step runs in its own process group, killed as a whole at its deadline, so no
  rank process outlives its step and holds the GPU.

Knobs (environment): BUDGET_S, LOG_DIR, GPU_CHECK_ONLY / GPU_CHECK_SKIP (comma-separated
step names; preflight and build always run unless skipped by name), GPU_CHECK_PREBUILT
(gpu_check_modules.tar.gz of an earlier run: no rebuild when the sources match),
GPU_CHECK_CAPS ("step=seconds,..."), GPU_CHECK_XDIST=0 (no parallel pytest), and for the
CPU tests GPU_CHECK_DRY_RUN=1 with GPU_CHECK_FAKE (scripts/gpu_check_fake.py),
GPU_CHECK_TIME_SCALE, and GPU_CHECK_FORCE=1 (run steps whose modules are not built: their
tests then skip inside pytest).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_report as R
import gpu_check_steps as S
from gpu_check_plan import (
    ALWAYS,
    DEFAULT_BUDGET_S,
    ROOT,
    SMOKE_TESTS,
    ConfigError,
    Step,
    budget_s,
    commit,
    configured_steps,
    installed_package,
    names,
    plan,
    print_plan,
    reserve_s,
    selected,
    tree_hash,
    use_source_tree,
)

PRINTED_TAIL = 15  # log lines printed under a failed row (the device tool keeps 12,000 chars)
PREBUILT_PATH = "build/gpu-prebuilt/gpu_check_modules.tar.gz"  # the continue command's


# ---- running ---------------------------------------------------------------------------
class Interrupted(Exception):
    pass


def _on_signal(signum, _frame):
    raise Interrupted(signal.Signals(signum).name)


class Check:
    def __init__(self, args, steps: list[Step]):
        self.steps = steps
        self.dry = os.environ.get("GPU_CHECK_DRY_RUN", "") not in ("", "0")
        self.budget = budget_s()
        self.reserve = reserve_s()
        self.only, self.skip = names("GPU_CHECK_ONLY"), names("GPU_CHECK_SKIP")
        self.log_dir = Path(os.environ.get("LOG_DIR") or os.environ.get("OUT") or
                            ROOT / "build" / "gpu-check-logs")  # fmt: skip
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check."))
        self.t0 = time.monotonic()
        self.deadline = self.t0 + self.budget
        self.py = sys.executable
        self.rows: list[R.Row] = []
        self.reports: list[tuple[str, list[str]]] = []
        self.preflight: dict = {}
        self.no_gpu: str | None = None
        self.current: subprocess.Popen | None = None
        self.force = os.environ.get("GPU_CHECK_FORCE", "") not in ("", "0")
        self.packed: list[str] = []  # modules in LOG_DIR's gpu_check_modules.tar.gz
        source_tree = use_source_tree()
        self.modules_dir = (self.work / "fake_modules" if self.dry else
                            ROOT / "python" / "pcie_a2a" if source_tree else installed_package())  # fmt: skip
        self.command = self._command()
        self.facts = {"mode": "DRY RUN (fake steps)" if self.dry else "real",
                      "budget_s": self.budget, "commit": commit(), "tree_hash": tree_hash(),
                      "machine": "?", "gpu": "?", "driver": "?"}  # fmt: skip
        self.plan_rows = plan(steps, self.budget, self.only, self.skip)[0]
        env = dict(os.environ)
        paths = [str(ROOT / "python") if source_tree else "", str(ROOT / "scripts"),
                 env.get("PYTHONPATH", "")]  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        env["PYTHONUNBUFFERED"] = "1"
        self.env = env

    def _command(self) -> str:
        keys = (
            "BUDGET_S",
            "GPU_CHECK_ONLY",
            "GPU_CHECK_SKIP",
            "GPU_CHECK_PREBUILT",
            "GPU_CHECK_CAPS",
        )
        parts = [f"{k}={os.environ[k]}" for k in keys if os.environ.get(k)]
        return " ".join(["LOG_DIR=$OUT" if os.environ.get("OUT") else "", *parts,
                         "scripts/gpu_check.sh"]).strip()  # fmt: skip

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.deadline - time.monotonic() - self.reserve

    def say(self, text: str = "") -> None:
        print(text, flush=True)

    # -- one command in its own process group
    def run(self, argv: list[str], log: Path, timeout: float, env_extra=None) -> tuple[int, bool]:
        env = {**self.env, **(env_extra or {})}
        with open(log, "ab") as f:
            f.write(f"$ {shlex.join(argv)}\n".encode())
            f.flush()
            t = time.monotonic()
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            self.current = proc
            timed_out = False
            try:
                rc = proc.wait(timeout=max(0.05, timeout))
            except subprocess.TimeoutExpired:
                timed_out, rc = True, 124
            finally:
                self._kill_group(proc)
                self.current = None
            note = "TIMEOUT (stopped)" if timed_out else f"exit {rc}"
            f.write(f"[gpu_check: {note} after {time.monotonic() - t:.1f}s]\n".encode())
        return rc, timed_out

    @staticmethod
    def _kill_group(proc: subprocess.Popen) -> None:
        """Stops the step's whole process group (ranks left by a crash too)."""
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            if proc.poll() is not None:
                try:  # the leader is gone: anything left in its group dies now
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                return
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue

    def fake(self, kind: str, step: Step, *extra: str) -> list[str]:
        return [self.py, str(ROOT / "scripts" / "gpu_check_fake.py"), kind, step.name,
                str(self.work), *extra]  # fmt: skip

    # -- preconditions
    def built(self, module: str) -> bool:
        d = self.modules_dir
        return (
            any(d.glob(f"{module}.*so")) or (d / f"{module}.so").exists() or (d / module).exists()
        )

    def blocked(self, step: Step) -> tuple[str, str] | None:
        """(status, detail) when the step cannot run, else None."""
        if not selected(step, self.only, self.skip):
            return "skipped: not selected", "GPU_CHECK_ONLY/GPU_CHECK_SKIP"
        absent = [f for f in step.files if not (ROOT / f).exists()]
        if absent:
            return "FAIL", f"file not found: {', '.join(absent)}"
        if step.expect and not any((ROOT / f).exists() for f in step.expect):
            return "missing", f"{', '.join(step.expect)} does not exist yet"
        if step.gpu and self.no_gpu:
            return "skipped: no GPU", self.no_gpu
        gpus = int(self.preflight.get("gpu_count", 0) or 0)
        if step.min_gpus > 1 and gpus < step.min_gpus:
            return f"skipped: {gpus} GPU", f"needs {step.min_gpus} GPUs (NCCL needs a GPU per rank)"
        missing = [m for m in step.modules if not self.built(m)]
        if missing and not self.force:
            return "skipped: no module", "needs " + ", ".join(
                f"pcie_a2a.{m}" for m in missing
            ) + " (not built)"
        return None

    def allowance(self, step: Step, later: float) -> float | None:
        """Seconds this step may take, or None when it cannot get its minimum."""
        left = self.left()
        bank = left - later  # what the steps after this one do not need
        if step.optional:  # only what the steps after it do not need
            t = min(step.cap, bank)
        else:
            t = min(left, max(step.cap, min(2 * step.cap, bank)))
        return t if t >= step.min_s and t > 0 else None

    def later_caps(self, index: int) -> float:
        gpus = max(1, int(self.preflight.get("gpu_count", 1) or 1))
        total = 0.0
        for s in self.steps[index + 1 :]:
            if s.optional or s.min_gpus > gpus or not selected(s, self.only, self.skip):
                continue
            if any(not (ROOT / f).exists() for f in s.files + s.expect[:1]):
                continue
            total += s.cap
        return total

    # -- the loop
    def main(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, _on_signal)
        self.say(f"gpu_check: budget {self.budget:g} s, results in {self.log_dir}, logs in {self.work}"
                 + (" [DRY RUN: fake steps]" if self.dry else ""))  # fmt: skip
        self.say(R.header_line())
        status = 1
        try:
            i = 0
            while i < len(self.steps):
                step = self.steps[i]
                j = i + 1
                while step.group and j < len(self.steps) and self.steps[j].group == step.group:
                    j += 1
                if j - i > 1:
                    self.group(i, self.steps[i:j])
                else:
                    self.one(i, step)
                i = j
        except Interrupted as why:  # the device tool's limit, say: not a failure of the code
            self.add(R.Row("interrupted", "interrupted", 0.0,
                           f"gpu_check got {why} at {self.elapsed():.0f}s"))  # fmt: skip
        finally:
            status = self.finish()
        return status

    def one(self, i: int, step: Step) -> None:
        blocked = self.blocked(step)
        if blocked:
            self.add(R.Row(step.name, blocked[0], 0.0, blocked[1], started=self.elapsed()))
            return
        later = self.later_caps(i)
        t = self.allowance(step, later)
        if t is None:
            detail = (
                f"{max(0.0, self.left()):.0f}s left before the reserve, needs {step.min_s:.0f}s"
            )
            self.add(R.Row(step.name, "skipped: budget", 0.0, detail, started=self.elapsed()))
            return
        self.write_outputs(running=step.name)
        self.say(f"  > {step.name} (up to {t:.0f}s) ...")
        log = self.work / f"{step.name}.log"
        start = time.monotonic()
        row = S.KINDS[step.kind](self, step, t, log)
        row.seconds = time.monotonic() - start
        row.started = start - self.t0
        row.log = log.name
        if t < step.cap:
            row.detail += f" (had {t:.0f}s of its {step.cap:.0f}s plan)"
        if row.failing or row.status == "TIMEOUT":
            row.tail = R.log_tail(log, 40)
        self.add(row)
        if step.kind == "preflight":
            S.add_tools_row(self)

    def group(self, i: int, members: list[Step]) -> None:
        """Consecutive pytest steps of one group in one pytest process (one torch import,
        one CUDA context), under the sum of their caps; a row for each."""
        runnable = []
        for k, step in enumerate(members):
            blocked = self.blocked(step)
            if blocked:
                self.add(R.Row(step.name, blocked[0], 0.0, blocked[1], started=self.elapsed()))
            else:
                runnable.append((i + k, step))
        if len(runnable) <= 1:
            for k, step in runnable:
                self.one(k, step)
            return
        steps = [s for _, s in runnable]
        name = "+".join(s.name for s in steps)
        whole = replace(steps[0], name=name, cap=sum(s.cap for s in steps),
                        min_s=max(s.min_s for s in steps),
                        per_test_s=max(s.per_test_s for s in steps))  # fmt: skip
        t = self.allowance(whole, self.later_caps(runnable[-1][0]))
        if t is None:
            detail = (
                f"{max(0.0, self.left()):.0f}s left before the reserve, needs {whole.min_s:.0f}s"
            )
            for s in steps:
                self.add(R.Row(s.name, "skipped: budget", 0.0, detail, started=self.elapsed()))
            return
        self.write_outputs(running=name)
        self.say(f"  > {name} (one pytest process, up to {t:.0f}s) ...")
        log = self.work / f"{steps[0].group}.log"
        start = time.monotonic()
        rows = S.run_pytest_group(self, steps, whole, t, log)
        tail = R.log_tail(log, 40)
        for row in rows:
            row.started = start - self.t0
            row.log = log.name
            if tail and (row.failing or row.status == "TIMEOUT"):
                row.tail, tail = tail, []  # one log for the group: printed once
            self.add(row)

    def add(self, row: R.Row) -> None:
        step = next((s for s in self.steps if s.name == row.name), None)
        row.optional = bool(step and step.optional)
        self.rows.append(row)
        self.say(R.format_row(row))
        for line in row.tail[-PRINTED_TAIL:]:  # the summary file keeps more
            self.say(f"    | {line}")
        self.write_outputs()

    # -- outputs
    def write_outputs(self, running: str | None = None) -> None:
        verdict_line, _ = R.verdict(self.rows, self.no_gpu)
        if self.dry:
            verdict_line = "DRY RUN " + verdict_line
        text = R.summary_text(self.rows, self.facts, verdict_line, self.command, self.reports,
                              running, self.continue_lines())  # fmt: skip
        (self.work / "summary_so_far.txt").write_text(text)
        R.write_atomic(self.log_dir / R.SUMMARY, text.encode())
        R.write_atomic(self.log_dir / R.JUNIT, R.junit_xml(self.rows, self.facts))
        R.write_atomic(self.log_dir / R.RESULTS, R.results_json(self.rows, self.facts, verdict_line,
                                                                self.plan_rows))  # fmt: skip
        R.write_atomic(self.log_dir / R.LOGS, R.logs_archive(self.work))

    def finish(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the last report is written whatever comes
        verdict_line, status = R.verdict(self.rows, self.no_gpu)
        if self.dry:
            verdict_line = "DRY RUN " + verdict_line
        self.write_outputs()
        for title, lines in self.reports:
            self.say()
            self.say(f"---- {title} ----")
            for line in lines:
                self.say(line)
        self.say()
        self.say(f"pcie_a2a GPU check on {self.facts['machine']}")
        self.say(f"commit {self.facts['commit']}, tree {self.facts['tree_hash']}, "
                 f"{self.elapsed():.0f}s of {self.budget:g}s")  # fmt: skip
        self.say(R.header_line())
        for r in self.rows:
            self.say(R.format_row(r))
        self.say(f"verdict: {verdict_line}")
        self.say(f"README row: {R.readme_row(self.facts, self.command, verdict_line)}")
        self.say(
            f"files: {', '.join(sorted(p.name for p in self.log_dir.iterdir() if p.name in R.OUTPUT_FILES))} in {self.log_dir}"
        )
        for line in self.continue_lines():
            self.say(line)
        shutil.rmtree(self.work, ignore_errors=True)
        return status

    # -- where a next call goes on
    def remaining(self) -> list[str]:
        """Selected steps that did not get to finish: out of time, skipped for the budget,
        stopped from outside, or never reached (the optional ones too)."""
        rows = {r.name: r for r in self.rows}
        gpus = max(1, int(self.preflight.get("gpu_count", 1) or 1))
        out = []
        for s in self.steps:
            if s.name in ALWAYS or not selected(s, self.only, self.skip):
                continue
            r = rows.get(s.name)
            if r is None and s.min_gpus > gpus:
                continue
            if r is None or r.status in R.UNFINISHED:  # never reached, or did not finish
                out.append(s.name)
        return out

    def continue_lines(self) -> list[str]:
        if self.no_gpu:
            return []
        rest = self.remaining()
        if not rest:
            return ["continue: nothing left to run"]
        caps = {s.name: s.cap for s in self.steps}
        complete = bool(self.packed) and not any(
            r.name == "build" and r.status != "ok" for r in self.rows
        )
        build = min(caps["build"], 15.0) if complete else caps["build"]
        budget = min(DEFAULT_BUDGET_S, caps["preflight"] + build + sum(caps[n] for n in rest)
                     + self.reserve)  # fmt: skip
        keep = ("GPU_CHECK_CAPS", "GPU_CHECK_SKIP", "GPU_CHECK_XDIST", "GPU_CHECK_TIME_SCALE")
        parts = [f"{k}={shlex.quote(os.environ[k])}" for k in keep if os.environ.get(k)]
        how = ""
        if self.packed:
            parts.insert(0, f"GPU_CHECK_PREBUILT={PREBUILT_PATH}")
            how = (f" (copy the returned {R.MODULES} to {PREBUILT_PATH} here and carry "
                   f"{Path(PREBUILT_PATH).parent}: {len(self.packed)} modules, not rebuilt)")  # fmt: skip
        cmd = " ".join([*parts, f"GPU_CHECK_ONLY={','.join(rest)}", f"BUDGET_S={budget:.0f}",
                        "LOG_DIR=$OUT", "bash", "scripts/gpu_check.sh"])  # fmt: skip
        return [f"continue where this run stopped{how}:", f"  {cmd}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", action="store_true", help="print the steps and their budgets")
    p.add_argument("--plan-json", action="store_true", help="the plan as JSON")
    p.add_argument("--tree-hash", action="store_true", help="print the tree hash a run reports")
    args = p.parse_args(argv)
    try:
        steps = configured_steps()
        budget = budget_s()
        only, skip = names("GPU_CHECK_ONLY"), names("GPU_CHECK_SKIP")
    except ConfigError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    if args.tree_hash:
        print(tree_hash())
        return 0
    if args.plan_json:
        rows, total, fits = plan(steps, budget, only, skip)
        print(json.dumps({"budget_s": budget, "reserve_s": reserve_s(), "total_s": total,
                          "fits": fits, "steps": rows, "smoke_tests": SMOKE_TESTS}, indent=1))  # fmt: skip
        return 0 if fits else 1
    if args.plan:
        return 0 if print_plan(steps, budget, only, skip) else 1
    try:
        check = Check(args, steps)
    except ConfigError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    return check.main()


if __name__ == "__main__":
    sys.exit(main())
