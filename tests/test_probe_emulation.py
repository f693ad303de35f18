"""The calibration probe's CUDA sources executed on the CPU: its known-answer gate.

No GPU here, so ``csrc/cuda/probe/{kernels.cu, session.cu}`` are compiled with the host C++
compiler against the CUDA execution model (``tests/native/emu``: fibers per thread, block
barriers, shared memory that starts as garbage, a fake runtime whose device memory is an
arena poisoned for AddressSanitizer outside live allocations) with N fake devices
(``tests/native/probe_emu/override/cuda/probe/runtime.cuh``). The driver
(``tests/native/probe_emu/main.cpp``) runs the real ``Session``: the known-answer exchange
of every ordered pair in every mode (kernel store, kernel load, copy engine from either
side, host-staged), the same for all pairs at once (several flows per kernel), the load,
copy-engine and staged latencies, the argument checks, and close() with nothing left.

The mutation test shows the gate fails on plausible slips: a skipped tail byte, a vector
loop that overruns into the guard, a fill that writes another pattern, a flow sent to the
wrong slot, a copy one byte short, a staged copy from the wrong device, the multi-flow
block -> flow mapping.

What it cannot show: the start gate (launches run when issued, so the model opens it at
once), the flag ping-pong (two kernels must run at the same time), timing, PCIe ordering.
"""

from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from native_emulation import (
    MODEL_FLAGS,
    PTX_MODEL,
    compiler,
    missed_mutations,
    mutate,
    skip_or_fail,
)
from probe_synthetic import gate_pattern

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
EMU = Path(__file__).resolve().parent / "native" / "probe_emu"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
NBYTES = 4133  # 258 vectors and a 5-byte tail
DEVICES = 3
MODES = ("store", "load", "ce", "ce_read", "staged")


def _units(csrc: Path) -> list[tuple[Path, list[str]]]:
    return [
        (csrc / "cuda" / "probe" / "kernels.cu", ["-x", "c++"]),
        (csrc / "cuda" / "probe" / "session.cu", ["-x", "c++"]),
        (csrc / "core" / "numa_memory.cpp", []),
        (EMU / "main.cpp", []),
    ]


def _flags(csrc: Path, sanitize: bool) -> list[str]:
    f = ["-std=c++17", "-fno-strict-aliasing", "-Wno-unknown-pragmas", "-fno-omit-frame-pointer"]
    f += ["-iquote", str(EMU / "override"), "-I", str(EMU / "include"), *MODEL_FLAGS]
    return f + ["-I", str(csrc)] + (SANITIZE if sanitize else [])


def _sanitizer_works(cxx: str, tmp: Path) -> bool:
    src = tmp / "probe.cpp"
    src.write_text("int main() { return 0; }\n")
    r = subprocess.run([cxx, *SANITIZE, str(src), "-o", str(tmp / "a")], capture_output=True)
    return r.returncode == 0


def build(out: Path, csrc: Path = CSRC, base: Path | None = None, rebuild: tuple[str, ...] = ()):
    """The emulation binary in `out`; with `base`, only `rebuild` is compiled again (-O0,
    no sanitizer) and linked with base's other objects."""
    cxx = compiler()
    out.mkdir(parents=True, exist_ok=True)
    sanitize = _sanitizer_works(cxx, out) if base is None else (base / "sanitized").exists()
    units = _units(csrc) if base is None else [u for u in _units(csrc) if u[0].name in rebuild]
    flags = (
        [*_flags(csrc, sanitize), "-O1", "-g"] if base is None else [*_flags(csrc, False), "-O0"]
    )

    def compile_one(unit):
        src, extra = unit
        obj = out / (src.name.split(".")[0] + ".o")
        r = subprocess.run([cxx, *flags, *extra, "-c", str(src), "-o", str(obj)],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"probe emulation build failed ({src.name}):\n{r.stderr[-4000:]}")
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objs = list(pool.map(compile_one, units))
    if base is not None:
        built = {o.name for o in objs}
        objs += [base / (u[0].name.split(".")[0] + ".o") for u in _units(CSRC)]
        objs = [o for o in objs if o.parent == out or o.name not in built]
    if sanitize:
        (out / "sanitized").touch()
    binary = out / "probe_emu"
    r = subprocess.run(
        [cxx, *(SANITIZE if sanitize else []), *map(str, objs), "-o", str(binary), "-lrt", "-lpthread"],
        capture_output=True, text=True,
    )  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"probe emulation link failed:\n{r.stderr[-4000:]}")
    return binary


def run(binary: Path, *args: str) -> list[str]:
    r = subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"},
    )  # fmt: skip
    assert r.returncode == 0, f"probe emulation exited {r.returncode}:\n{r.stderr[-3000:]}"
    return r.stdout.splitlines()


@pytest.fixture(scope="session")
def emulator(tmp_path_factory) -> Path:
    if compiler() is None:
        skip_or_fail("no host C++ compiler (c++/g++) to build the probe emulation")
    if not (CSRC / "cuda" / "probe" / "session.cu").is_file():
        pytest.skip("the probe sources are not in this checkout")
    return build(tmp_path_factory.mktemp("probe_emu"))


def check_output(lines: list[str], no_peer: set[tuple[int, int]] = frozenset()) -> None:
    """Everything the driver prints is right (raises AssertionError naming what is not)."""
    wrong = [line for line in lines if "WRONG" in line]
    assert not wrong, wrong
    gates = {
        tuple(line.split()[1:4])
        for line in lines
        if line.startswith("gate ") and line.endswith(" ok")
    }
    want = {
        (str(a), str(b), m)
        for a in range(DEVICES)
        for b in range(DEVICES)
        if a != b
        for m in MODES
        if m == "staged" or ((a, b) not in no_peer and (b, a) not in no_peer)
    }
    assert gates == want, sorted(want - gates)
    for m in ("store", "load", "ce", "ce_read"):
        assert f"flows {m} ok" in lines, m
    assert "done" in lines and lines[-1] == "leaks: ", lines[-3:]


def test_gate_passes_every_pair_and_mode(emulator):
    lines = run(emulator, str(DEVICES), str(NBYTES))
    check_output(lines)
    # The host's pattern is the one tests/probe_synthetic.py mirrors.
    assert f"pattern 12345 37 {gate_pattern(12345, 37).hex()}" in lines
    lat = {line.split()[1]: float(line.split()[4]) for line in lines if line.startswith("latency ")}
    assert set(lat) == {"load", "ce", "staged"} and all(v > 0 for v in lat.values())
    errors = [line for line in lines if line.startswith("error ")]
    assert any("pair (0, 0): expected two different devices in 0..2" in e for e in errors)
    assert any(f"nbytes {NBYTES + 1} outside 1..{NBYTES}" in e for e in errors)


def test_refused_peer_access_stages_only(emulator):
    # CUDA refuses 0 -> 1: the pair is not P2P either way (a load by 1 would read 0's memory).
    lines = run(emulator, str(DEVICES), str(NBYTES), hex(1 << (0 * 8 + 1)))
    assert "can 0 1 0" in lines and "can 1 0 0" in lines and "can 0 2 1" in lines
    check_output(lines, no_peer={(0, 1)})


MUTATIONS = [
    ("cuda/probe/kernels.cu", "vectors * 16 + threadIdx.x; i < f.bytes", "vectors * 16 + threadIdx.x + 1; i < f.bytes", "tail skips a byte"),
    ("cuda/probe/kernels.cu", "i < vectors;", "i <= vectors;", "vector loop overruns into the guard"),
    ("cuda/probe/kernels.cu", "pattern_byte(seed, i) ^ flip", "pattern_byte(seed, i + 1) ^ flip", "fill writes another pattern"),
    ("cuda/probe/kernels.cu", "const int flow = static_cast<int>(blockIdx.x) / blocks_per_flow;", "const int flow = static_cast<int>(blockIdx.x) % blocks_per_flow;", "block -> flow mapping"),
    ("cuda/probe/session.cu", ".send, recv_slot(d, s), nbytes}", ".send, recv_slot(d, d), nbytes}", "flow sent to the wrong slot"),
    ("cuda/probe/session.cu", "ds.send, ds.id, nbytes, st)", "ds.send, ds.id, nbytes - 1, st)", "copy one byte short"),
    ("cuda/probe/session.cu", "ds.send, nbytes, cudaMemcpyDeviceToHost", "dd.send, nbytes, cudaMemcpyDeviceToHost", "staged copy from the wrong device"),
]  # fmt: skip


def test_mutations_are_caught(emulator, tmp_path):
    def make(k: int) -> Path:
        fname, old, new, label = MUTATIONS[k]
        src = tmp_path / f"m{k}" / "csrc"
        for part in ("cuda/probe", "core"):
            (src / part).mkdir(parents=True, exist_ok=True)
            for f in (CSRC / part).iterdir():
                if f.is_file():
                    (src / part / f.name).write_bytes(f.read_bytes())
        mutate(src / fname, old, new, label)
        return build(
            tmp_path / f"m{k}" / "out", src, base=emulator.parent, rebuild=(Path(fname).name,)
        )

    def check(_k: int, binary: Path) -> None:
        check_output(run(binary, str(DEVICES), str(NBYTES)))

    missed = missed_mutations(MUTATIONS, make, check, (AssertionError, subprocess.TimeoutExpired))
    assert not missed, f"mutations not caught by the probe gate: {missed}"


def test_emulated_sources_are_the_probe():
    """The probe's kernels get their PTX from cuda/common/ptx.cuh only (the one header the
    execution model replaces): no inline PTX in csrc/cuda/probe, and the model defines every
    primitive the kernels call."""
    used = set()
    for path in (CSRC / "cuda" / "probe").iterdir():
        text = path.read_text()
        assert not re.search(r"\basm\b", text), f"{path.name} has inline PTX"
        used |= set(re.findall(r"using cuda::(\w+);", text))
    assert used == {"ld_acquire_sys", "ld_relaxed_sys", "st_release_sys", "globaltimer_ns"}
    real, emu = (CSRC / "cuda" / "common" / "ptx.cuh").read_text(), PTX_MODEL.read_text()
    for fn in used:
        assert re.search(rf"\b{fn}\(", real) and re.search(rf"\b{fn}\(", emu), fn
