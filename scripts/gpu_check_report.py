"""What scripts/gpu_check.sh leaves behind: rows, the plain summary, JUnit XML, the log
archive and the results JSON.

The device machine returns at most 8 files of at most 16 MiB each from $OUT, no deeper
than 2 folders, and nothing at all if the command is killed before it copies them. So the
result files are rewritten in LOG_DIR (atomically) after every step, and there are only
these four plus the built-modules archive the build step writes:

  gpu_check_summary.txt   the table, the verdict, failure tails, benchmark tables
  gpu_check_junit.xml     one testsuite of steps, one per pytest step with its tests
  gpu_check_results.json  the same, machine-readable, plus the preflight facts
  gpu_check_logs.tar.gz   every step's log (each cut to its last LOG_KEEP_BYTES)
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUMMARY = "gpu_check_summary.txt"
JUNIT = "gpu_check_junit.xml"
RESULTS = "gpu_check_results.json"
LOGS = "gpu_check_logs.tar.gz"
MODULES = "gpu_check_modules.tar.gz"
OUTPUT_FILES = (SUMMARY, JUNIT, RESULTS, LOGS, MODULES)
MAX_FILE_BYTES = 16 << 20  # the device tool's limit per returned file
LOG_KEEP_BYTES = 4 << 20  # per log inside the archive
TAIL_LINES = 25

# A row's status. FAIL is a wrong result, a crash or a build error: the verdict is FAIL.
# The INCOMPLETE ones (out of time, nothing ran, stopped from outside) make it INCOMPLETE
# when the step is not optional: slowness is never a failure. The others are information.
FAILING = ("FAIL",)
INCOMPLETE = ("TIMEOUT", "SKIPPED", "skipped: budget", "interrupted", "not run")
# What a continuing run runs again: the steps that did not get to finish (SKIPPED steps ran
# and every test skipped itself: running them again changes nothing).
UNFINISHED = ("TIMEOUT", "skipped: budget", "interrupted", "not run")


@dataclass
class Row:
    name: str
    status: str  # ok | FAIL | TIMEOUT | SKIPPED (ran, nothing executed) | skipped: why | missing
    seconds: float
    detail: str
    log: str = ""  # file name inside the work folder
    tail: list[str] = field(default_factory=list)
    tests: list[dict] = field(default_factory=list)  # pytest steps: one dict per test
    started: float = 0.0  # seconds since the check began
    optional: bool = False  # a benchmark: run in spare time, never makes the run INCOMPLETE

    @property
    def failing(self) -> bool:
        return self.status in FAILING

    @property
    def incomplete(self) -> bool:
        return self.status in INCOMPLETE


def format_row(row: Row) -> str:
    secs = f"{row.seconds:.0f}s" if row.seconds >= 0.5 or row.status == "ok" else "-"
    return f"{row.name:<16} {row.status:<21} {secs:>5}  {row.detail}"


def header_line() -> str:
    return f"{'step':<16} {'result':<21} {'time':>5}  detail"


def log_tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last `lines` non-empty lines of a log (reads at most its last 64 KiB)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - (64 << 10)))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    kept = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    return kept[-lines:]


# ---- pytest results (written by scripts/gpu_check_pytest.py) ---------------------------
def read_test_results(path: Path) -> tuple[list[dict], list[str]]:
    """Per-test outcomes from the plugin's JSON lines, and smoke names no test matched."""
    tests: dict[str, dict] = {}
    unmatched: set[str] | None = None
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return [], []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if "unmatched_smoke" in rec:
            got = set(rec["unmatched_smoke"])
            unmatched = got if unmatched is None else unmatched & got
            continue
        t = tests.setdefault(
            rec["nodeid"], {"nodeid": rec["nodeid"], "outcome": "", "duration": 0.0, "message": ""}
        )
        t["duration"] += rec.get("duration", 0.0)
        outcome, when = rec.get("outcome"), rec.get("when")
        if outcome == "failed":
            t["outcome"] = "failed" if when == "call" else "error"
            t["message"] = rec.get("message", "")
        elif outcome == "skipped" and t["outcome"] not in ("failed", "error"):
            t["outcome"] = "skipped"
            t["message"] = rec.get("message", "")
        elif outcome == "passed" and when == "call" and not t["outcome"]:
            t["outcome"] = "passed"
    return list(tests.values()), sorted(unmatched or ())


def count_tests(tests: list[dict]) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for t in tests:
        if t["outcome"] in counts:
            counts[t["outcome"]] += 1
    return counts


def short_id(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


# ---- the result files ------------------------------------------------------------------
def verdict(rows: list[Row], no_gpu: str | None) -> tuple[str, int]:
    """(verdict line, exit status): PASS 0, FAIL 1, NO GPU 3, INCOMPLETE 4. FAIL only for a
    wrong result, a crash or a build error; a step out of time or with nothing run makes the
    run INCOMPLETE, unless it is an optional one (a benchmark)."""
    failing = [r.name for r in rows if r.failing]
    unfinished = [r.name for r in rows if r.incomplete and not r.optional]
    spare = [r.name for r in rows if r.incomplete and r.optional]
    if no_gpu:
        return f"NO GPU: {no_gpu}", 3
    if failing:
        more = f"; not finished: {', '.join(unfinished)}" if unfinished else ""
        return f"FAIL: {len(failing)} of {len(rows)} steps ({', '.join(failing)}){more}", 1
    if unfinished:
        return (f"INCOMPLETE: no failure; {len(unfinished)} not finished (out of time or "
                f"nothing ran: {', '.join(unfinished)})", 4)  # fmt: skip
    ok = sum(r.status == "ok" for r in rows)
    more = f"; optional not finished: {', '.join(spare)}" if spare else ""
    return f"PASS: {ok} steps ok, {len(rows) - ok} not run (see rows){more}", 0


def readme_row(facts: dict, command: str, verdict_line: str) -> str:
    """The README's GPU-verification table row for this run."""
    gpu = facts.get("gpu", "?")
    return (
        f"| {gpu} | {facts.get('driver', '?')} | {time.strftime('%Y-%m-%d')} "
        f"| `{command}` (commit {facts.get('commit', '?')}) | {verdict_line} |"
    )


def summary_text(rows, facts, verdict_line, command, reports, running=None, cont=()) -> str:
    out = [
        f"pcie_a2a GPU check ({facts.get('mode', 'real')}), {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"machine: {facts.get('machine', '?')}",
        f"command: {command}; commit {facts.get('commit', '?')}; budget {facts.get('budget_s')} s",
        "",
        header_line(),
        *[format_row(r) for r in rows],
    ]
    if running:
        out.append(f"{running:<16} {'running...':<21}")
    out += [
        "",
        f"verdict: {verdict_line}",
        f"README row: {readme_row(facts, command, verdict_line)}",
    ]
    for r in rows:
        if r.tail:  # failed or out of time
            out += ["", f"---- {r.name}: last lines of {r.log} ----", *r.tail]
    for title, lines in reports:
        out += ["", f"---- {title} ----", *lines]
    if cont:
        out += ["", *cont]
    return "\n".join(out) + "\n"


_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _clean(text: str) -> str:
    return _XML_BAD.sub("?", text)


def junit_xml(rows: list[Row], facts: dict) -> bytes:
    root = ET.Element("testsuites", name="gpu_check")
    steps = ET.SubElement(root, "testsuite", name="gpu_check.steps")
    props = ET.SubElement(steps, "properties")
    for key in ("machine", "gpu", "driver", "commit", "budget_s", "mode"):
        ET.SubElement(props, "property", name=key, value=_clean(str(facts.get(key, ""))))
    totals = {"tests": 0, "failures": 0, "skipped": 0, "errors": 0}

    def case(suite, classname: str, name: str, secs: float, kind: str, msg: str, text: str):
        tc = ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{secs:.3f}")
        if kind:
            el = ET.SubElement(tc, kind, message=_clean(msg[:500]))
            el.text = _clean(text)
        return tc

    def add_suite(suite, cases):
        counts = {"tests": 0, "failures": 0, "skipped": 0, "errors": 0}
        for kind in cases:
            counts["tests"] += 1
            if kind == "failure":
                counts["failures"] += 1
            elif kind == "skipped":
                counts["skipped"] += 1
            elif kind == "error":
                counts["errors"] += 1
        for k, v in counts.items():
            suite.set(k, str(v))
            totals[k] += v

    kinds = []
    for r in rows:
        if r.failing:
            kind = "failure"
        elif r.status != "ok":
            kind = "skipped"
        else:
            kind = ""
        case(
            steps,
            "gpu_check",
            r.name,
            r.seconds,
            kind,
            f"{r.status}: {r.detail}",
            "\n".join(r.tail),
        )
        kinds.append(kind)
    add_suite(steps, kinds)
    for r in rows:
        if not r.tests:
            continue
        suite = ET.SubElement(root, "testsuite", name=f"gpu_check.{r.name}")
        kinds = []
        for t in r.tests:
            path, _, name = t["nodeid"].partition("::")
            classname = path.removesuffix(".py").replace("/", ".")
            kind = {"failed": "failure", "error": "error", "skipped": "skipped"}.get(
                t["outcome"], ""
            )
            if not t["outcome"]:  # started, never finished: a crash, or the step was stopped
                kind = "error" if r.failing else "skipped"
                t = {**t, "message": "did not finish (crashed)" if r.failing else
                     "did not finish (the step was stopped)"}  # fmt: skip
            msg = t["message"].strip().splitlines()[-1] if t["message"].strip() else t["outcome"]
            case(suite, classname, name or path, t["duration"], kind, msg, t["message"])
            kinds.append(kind)
        add_suite(suite, kinds)
    for k, v in totals.items():
        root.set(k, str(v))
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def results_json(rows: list[Row], facts: dict, verdict_line: str, plan: list[dict]) -> bytes:
    doc = {
        "facts": facts,
        "verdict": verdict_line,
        "plan": plan,
        "rows": [{k: v for k, v in asdict(r).items() if k != "tests"} for r in rows],
        "tests": {r.name: r.tests for r in rows if r.tests},
    }
    return json.dumps(doc, indent=1).encode()


def logs_archive(work: Path, keep: int = LOG_KEEP_BYTES) -> bytes:
    """gzip'd tar of every file in `work`, each cut to its last `keep` bytes, the cut
    halved until the archive is under the per-file limit."""
    while True:
        data = _archive(work, keep)
        if len(data) <= MAX_FILE_BYTES - (64 << 10) or keep <= 4096:
            return data
        keep //= 2


def _archive(work: Path, keep: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for path in sorted(p for p in work.rglob("*") if p.is_file()):
            rel = path.relative_to(work).as_posix()
            size = path.stat().st_size
            with open(path, "rb") as f:
                if size > keep:
                    f.seek(size - keep)
                    note = f"[gpu_check: first {size - keep} bytes cut]\n".encode()
                    data = note + f.read()
                else:
                    data = f.read()
            info = tarfile.TarInfo(f"gpu_check/{rel}")
            info.size = len(data)
            info.mtime = int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_atomic(path: Path, data: bytes) -> None:
    if len(data) > MAX_FILE_BYTES:  # never hand back a file the device tool drops
        data = data[: MAX_FILE_BYTES - 200] + b"\n[gpu_check: cut at the 16 MiB limit]\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
