"""The docs name real files, and stay short.

Docs rot silently: a renamed module leaves a page pointing at nothing, and pages grow back
to the length issue 23 cut them from. Both are checked here, on the text alone (no imports,
well under a second).
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

# Half of each page's length before issue 23 (wc -w); a page may shrink, not grow past this.
WORD_BUDGET = {
    "allreduce.md": 1415,
    "balance.md": 1727,
    "benchmarks.md": 1605,
    "cuda_transport.md": 2966,
    "gpu_check.md": 925,
    "int4.md": 1681,
    "internode.md": 700,
    "moe.md": 606,
    "plan.md": 2519,
    "probe.md": 600,
    "sglang.md": 1718,
    "topology.md": 1090,
    "transport.md": 554,
    "vllm.md": 1161,
}

REPO_PREFIXES = ("python/", "csrc/", "scripts/", "tests/", "docs/", "benchmarks/")

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A path ends before punctuation that closes a sentence or a list in prose.
_TRAILING = ",;:.)]'\""


def _code_tokens(text: str) -> list[str]:
    """Whitespace-separated words inside inline code spans and fenced blocks."""
    spans = [m.group(0) for m in _FENCE.finditer(text)]
    spans += _INLINE_CODE.findall(_FENCE.sub("", text))
    return [tok for span in spans for tok in span.split()]


def repo_path_refs(text: str) -> list[str]:
    """Repo paths named in code: `python/x.py`, `tests/t.py::name`, `csrc/a.h:12`."""
    refs = []
    for tok in _code_tokens(text):
        tok = tok.strip("`(\"'")
        # `PYTHONPATH=python python -m pytest tests/x.py` style tokens: the path follows '='.
        if "=" in tok:
            tok = tok.rsplit("=", 1)[1]
        # `csrc/bindings/<name>.cu` is a pattern in prose, not a file.
        if not tok.startswith(REPO_PREFIXES) or "<" in tok:
            continue
        tok = tok.split("::", 1)[0]
        tok = re.sub(r":[\w.-]*$", "", tok)
        tok = tok.rstrip(_TRAILING)
        if tok:
            refs += _expand_braces(tok)
    return refs


def link_targets(text: str) -> list[str]:
    """Relative markdown link targets, anchors stripped; URLs and pure anchors skipped."""
    out = []
    for target in _LINK.findall(_FENCE.sub("", text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        target = target.split("#", 1)[0]
        if target:
            out.append(target)
    return out


def _expand_braces(path: str) -> list[str]:
    """`csrc/core/shm.{h,cpp}` names two files; each must exist."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [
        out
        for alt in m.group(1).split(",")
        for out in _expand_braces(path[: m.start()] + alt + path[m.end() :])
    ]


def _exists(path: Path) -> bool:
    if any(c in str(path) for c in "*?["):
        return bool(glob.glob(str(path)))
    return path.exists()


def missing_refs(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    bad = [f"link {t}" for t in link_targets(text) if not _exists(page.parent / t)]
    bad += [f"path {p}" for p in repo_path_refs(text) if not _exists(ROOT / p)]
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_file_exists(page):
    bad = missing_refs(page)
    assert not bad, f"{page.relative_to(ROOT)} names files that do not exist: {bad}"


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_page_within_word_budget(page):
    assert page.name in WORD_BUDGET, f"docs/{page.name} has no word budget: add one here"
    words = len(page.read_text(encoding="utf-8").split())
    assert words <= WORD_BUDGET[page.name], (
        f"docs/{page.name} has {words} words, budget {WORD_BUDGET[page.name]}: cut, don't grow"
    )


def test_checker_catches_broken_references(tmp_path):
    """The scanners above must see each kind of reference (else the tests pass vacuously)."""
    page = tmp_path / "page.md"
    page.write_text(
        "See [the plan](plan.md#model) and [gone](no_such_page.md), [web](https://x.org).\n"
        "Code in `python/pcie_a2a/env.py`, `tests/test_docs_links.py::test_x`, "
        "`csrc/core/wire_format.h:12`, `python/pcie_a2a/nothing_here.py`, "
        "`csrc/core/wire_format.{h,nope}`.\n"
        "```bash\nPYTHONPATH=python python -m pytest -q tests/test_missing_file.py\n```\n",
        encoding="utf-8",
    )
    (tmp_path / "plan.md").write_text("x", encoding="utf-8")
    assert link_targets(page.read_text()) == ["plan.md", "no_such_page.md"]
    assert sorted(missing_refs(page)) == [
        "link no_such_page.md",
        "path csrc/core/wire_format.nope",
        "path python/pcie_a2a/nothing_here.py",
        "path tests/test_missing_file.py",
    ]
