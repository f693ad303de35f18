"""pytest plugin of scripts/gpu_check.sh, loaded with ``-p gpu_check_pytest``.

Two jobs, both needed because a GPU window is short and may end mid-run:

* ``--gpu-check-smoke=a,b,c`` marks the tests so named ``smoke`` before ``-m`` selects,
  so the first tier can be picked by name from files that do not (yet) carry the marker.
  A name matches a test's name (``test_x[id]``), its function name or its parameter id.
  Tests that carry ``@pytest.mark.smoke`` themselves are in the tier too.
* ``--gpu-check-results=FILE`` appends a JSON line when a test starts and one per phase
  as it finishes, so the results (and the test that was running) survive a run that is
  killed before pytest writes its own report.

With pytest-xdist the workers collect (and mark) and the controller writes the lines.
"""

from __future__ import annotations

import json
import os

import pytest

_CONFIG: list = []  # the session's config (hooks below that get no config argument)


def pytest_addoption(parser) -> None:
    group = parser.getgroup("gpu_check")
    group.addoption(
        "--gpu-check-smoke",
        default="",
        help="comma-separated test names or parameter ids to mark 'smoke'",
    )
    group.addoption(
        "--gpu-check-results",
        default=None,
        help="append one JSON line per finished test phase to this file",
    )


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "smoke: first tier of scripts/gpu_check.sh")
    _CONFIG[:] = [config]


def _write(config, record: dict) -> None:
    path = config.getoption("--gpu-check-results")
    if not path:
        return
    line = json.dumps(record) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def item_names(item) -> set[str]:
    names = {item.name, getattr(item, "originalname", item.name)}
    spec = getattr(item, "callspec", None)
    if spec is not None:
        names.add(spec.id)
    return names


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects by -m
def pytest_collection_modifyitems(config, items) -> None:
    wanted = {n.strip() for n in config.getoption("--gpu-check-smoke").split(",") if n.strip()}
    if not wanted:
        return
    found: set[str] = set()
    for item in items:
        hit = wanted & item_names(item)
        if hit:
            item.add_marker(pytest.mark.smoke)
            found |= hit
    if not hasattr(config, "workerinput"):  # xdist workers: the controller has no items
        _write(config, {"unmatched_smoke": sorted(wanted - found)})
    else:
        # every worker collects everything: the first one to report is enough
        _write(config, {"unmatched_smoke": sorted(wanted - found), "worker": True})


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = getattr(report, "longreprtext", "") or ""
    return text[-4000:]


def pytest_runtest_logstart(nodeid, location) -> None:
    config = _CONFIG[0] if _CONFIG else None
    if config is not None and not hasattr(config, "workerinput"):
        _write(config, {"nodeid": nodeid, "when": "start", "outcome": "started"})


def pytest_runtest_logreport(report) -> None:
    config = _CONFIG[0] if _CONFIG else None
    if config is None or hasattr(config, "workerinput"):
        return  # with xdist the controller sees every report too: write once
    if report.when == "call" or not report.passed:
        _write(
            config,
            {
                "nodeid": report.nodeid,
                "when": report.when,
                "outcome": report.outcome,
                "duration": round(report.duration, 3),
                "message": _message(report),
            },
        )
