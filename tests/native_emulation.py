"""What the CPU emulations of CUDA sources share (tests/native: the INT4 kernel, the
transport, the all-reduce, the probe): finding a host compiler, the execution model's include
paths (with its one stand-in for csrc/cuda/common/ptx.cuh), and the mutation check that
proves an emulation can fail (seed one plausible slip per build; every mutant must be
caught)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODEL = Path(__file__).resolve().parent / "native" / "emu"  # the CUDA execution model
# The model of csrc/cuda/common/ptx.cuh: found before csrc's through MODEL_FLAGS' -iquote.
PTX_MODEL = MODEL / "override" / "cuda" / "common" / "ptx.cuh"
MODEL_FLAGS = ["-iquote", str(MODEL / "override"), "-I", str(MODEL)]
# The transport builds' hooks into the model's loads and stores: the staged gate
# (transport_emu/include, on their -I).
TRANSPORT_PTX_HOOKS = '-DEMU_PTX_HOOKS="emu_staged_gate.h"'


def skip_or_fail(reason: str) -> None:
    """Skips the calling test for a missing tool, or fails it under
    PCIE_A2A_REQUIRE_NATIVE_TOOLS=1 (CI: these are the only runs of the CUDA code before a
    GPU, so they must not skip silently)."""
    import pytest

    from pcie_a2a import env

    if env.require_native_tools():
        pytest.fail(f"PCIE_A2A_REQUIRE_NATIVE_TOOLS=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def compiler() -> str | None:
    """The host C++ compiler the emulations build with ($CXX, else c++ or g++)."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def mutate(path: Path, old: str, new: str, label: str) -> None:
    """Replaces `old` (which must occur exactly once) by `new` in the file at `path`."""
    text = path.read_text()
    assert text.count(old) == 1, f"{label}: {old!r} not found exactly once in {path.name}"
    path.write_text(text.replace(old, new))


def missed_mutations(
    mutations: Sequence[tuple],
    build: Callable[[int], Path],
    check: Callable[[int, Path], None],
    caught: tuple[type[BaseException], ...],
) -> list[str]:
    """Builds every mutant (in parallel) and runs `check` on each, two at a time (most
    checks wait on a deadline, not a core); returns the mutations (file, old, new, ...)
    whose check raised none of `caught`: the ones not detected."""

    def detected(n: int, binary: Path) -> bool:
        try:
            check(n, binary)
        except caught:
            return True
        return False

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        binaries = list(pool.map(build, range(len(mutations))))
    with ThreadPoolExecutor(max_workers=2) as pool:
        found = list(pool.map(detected, range(len(mutations)), binaries))
    return ["{}: {!r} -> {!r}".format(*mutations[n][:3]) for n, ok in enumerate(found) if not ok]
