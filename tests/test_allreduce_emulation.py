"""The CUDA all-reduce executed on the CPU: kernels *and* host code, compared bit for bit.

``csrc/cuda/allreduce/{kernels.cu, communicator.cu}`` are compiled with the host compiler
against the CUDA execution model of ``tests/native/emu`` (a fiber per CUDA thread, real
block barriers and warp shuffles, shared memory that starts as garbage, a device arena
shared by forked rank processes the way CUDA IPC shares device memory, ASan poisoning
outside what a process may touch). Only the inline PTX (``cuda/common/ptx.cuh``, by the
model's one stand-in in ``tests/native/emu/override``) and the launch (``launch.cuh``, by
``tests/native/allreduce_emu/override``) are replaced. The driver
(``tests/native/allreduce_emu/main.cpp``) forks one process per rank; each makes the real
``CudaAllReduce``, exchanges IPC handles, opens its peers with a push/pull plan and makes
the calls ``pcie_a2a.allreduce.cuda`` makes, with no barrier between calls. Results are
compared exactly with :mod:`pcie_a2a.allreduce.reference` (the CPU implementation's
numerics, tests/test_allreduce.py).

Ownership across CUDA-graph replays: the ``graph`` steps call the kernels with the same
static buffers and identical arguments every time, and one rank is made slow right after
it sees a flag and before it reads the data (the emulated ld.acquire sleeps), while its peer
runs on into the next call. The mutation test removes the parity (one buffer, no barrier)
and the end barrier (barrier mode): both must then read the next call's data.

What it cannot show: memory ordering across real PCIe (the model is sequentially
consistent; a missing fence is invisible), true concurrency of warps, timing, the SASS.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from native_emulation import (
    MODEL_FLAGS,
    PTX_MODEL,
    compiler,
    missed_mutations,
    mutate,
    skip_or_fail,
)
from pcie_a2a.allreduce import reference as R

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
EMU = Path(__file__).resolve().parent / "native" / "allreduce_emu"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
ERR_TIMEOUT, ERR_PEER, ERR_ABORTED = 1, 2, 3  # pa2a::Error::Kind
DTYPES = {"bf16": (torch.bfloat16, 0), "fp16": (torch.float16, 1)}
ALGOS = {"one": 1, "two": 2}


def _units(csrc: Path) -> list[tuple[Path, str, list[str]]]:
    # ar_kernels.o: -fdata-sections puts every static __shared__ variable in its own section,
    # which emu_shared.ld collects (the model refills them with garbage per block).
    return [
        (csrc / "cuda" / "allreduce" / "kernels.cu", "ar_kernels.o", ["-x", "c++", "-fdata-sections"]),
        (csrc / "cuda" / "allreduce" / "communicator.cu", "ar_communicator.o", ["-x", "c++"]),
        (EMU / "main.cpp", "main.o", []),
    ]  # fmt: skip


def _flags(csrc: Path, sanitize: bool) -> list[str]:
    f = ["-std=c++17", "-fno-strict-aliasing", "-ffp-contract=off", "-Wno-unknown-pragmas"]
    f += ["-fno-omit-frame-pointer", "-iquote", str(EMU / "override"), "-I", str(EMU / "include")]
    return f + [*MODEL_FLAGS, "-I", str(csrc)] + (SANITIZE if sanitize else [])


def _sanitizer_works(cxx: str, tmp: Path) -> bool:
    src = tmp / "probe.cpp"
    src.write_text("int main() { return 0; }\n")
    r = subprocess.run([cxx, *SANITIZE, str(src), "-o", str(tmp / "probe")], capture_output=True)
    return r.returncode == 0


def build_emulator(out: Path, csrc: Path = CSRC, base: Path | None = None, rebuild=()) -> Path:
    """Compiles the kernels, the host class and the driver into ``out``/allreduce_emu
    (sanitized, -O1). With ``base`` only the units named in ``rebuild`` are compiled again
    (-O0, no sanitizer: the mutation builds) and linked with base's other objects."""
    cxx = compiler()
    out.mkdir(parents=True, exist_ok=True)
    if base is None:
        sanitize = _sanitizer_works(cxx, out)
        units, flags = _units(csrc), [*_flags(csrc, sanitize), "-O1", "-g"]
    else:
        sanitize = False
        units = [u for u in _units(csrc) if u[0].name in rebuild]
        flags = [*_flags(csrc, False), "-O0", "-g0"]

    def compile_one(unit):
        src, obj, extra = unit
        r = subprocess.run([cxx, *flags, *extra, "-c", str(src), "-o", str(out / obj)],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"emulator build failed ({src.name}):\n{r.stderr[-4000:]}")
        return out / obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objs = list(pool.map(compile_one, units))
    if base is not None:
        built = {o.name for o in objs}
        objs += [base / u[1] for u in _units(CSRC) if u[1] not in built]
    if sanitize:
        (out / "sanitized").touch()
    binary = out / "allreduce_emu"
    link = [
        cxx,
        *(SANITIZE if base is None and sanitize else []),
        *map(str, objs),
        "-o",
        str(binary),
    ]
    base_sanitized = base is not None and (base / "sanitized").exists()
    if base_sanitized:  # the reused objects need the sanitizer runtimes
        link.insert(1, SANITIZE[0])
    r = subprocess.run([*link, f"-Wl,-T,{EMU / 'emu_shared.ld'}", "-lrt", "-lpthread"],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:  # a linker without INSERT scripts: shared memory starts zeroed
        r = subprocess.run([*link, "-lrt", "-lpthread"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"emulator link failed:\n{r.stderr[-4000:]}")
    return binary


@pytest.fixture(scope="session")
def emulator(tmp_path_factory) -> Path:
    if compiler() is None:
        skip_or_fail("no host C++ compiler (c++/g++) to build the all-reduce emulation")
    if sys.platform != "linux":
        pytest.skip("the emulation's rank processes share memory the Linux way (fork, prctl)")
    return build_emulator(tmp_path_factory.mktemp("allreduce_emu"))


# ---- scenarios -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    kind: str  # run | graph | norm | abort | skip | mismatch
    algo: str = "one"
    dtype: str = "bf16"
    numel: int = 4096
    residual: bool = False
    inplace: bool = False
    who: int = -1
    hidden: int = 0
    eps: float = 1e-6
    data: str = "randn"  # randn | order (values whose fp32 sum depends on the order)


@dataclass(frozen=True)
class Scenario:
    name: str
    world: int
    steps: tuple[Step, ...]
    buffers: int = 2
    end_barrier: bool = False
    pull: str = "none"  # none | alternate (pull[s][d] for odd s + d) | all
    delay: tuple[int, int, int] | None = None  # (rank, call, ms)
    timeout_ms: int = 20_000
    schedule: int = 0
    max_bytes: int = 1 << 16


def _pull(sc: Scenario) -> list[list[int]]:
    w = sc.world
    if sc.pull == "all":
        return [[int(s != d) for d in range(w)] for s in range(w)]
    if sc.pull == "alternate":
        return [[int(s != d and (s + d) % 2 == 1) for d in range(w)] for s in range(w)]
    return [[0] * w for _ in range(w)]


def _inputs(
    sc: Scenario, i: int, st: Step
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    dtype = DTYPES[st.dtype][0]
    g = torch.Generator().manual_seed(1000 * i + 7 * len(sc.name))
    if st.data == "order":
        # x0 = 2^24, x1 = 1, x2 = -2^24 (rank 0 first gives 0, rank 2 first gives 1), mixed
        # with random values so that every element is not the same pattern
        base = torch.tensor([2.0**24, 1.0, -(2.0**24)] + [0.5] * (sc.world - 3))
        xs = [torch.full((st.numel,), float(base[r]), dtype=dtype) for r in range(sc.world)]
        xs = [
            x + (torch.randn(st.numel, generator=g) * 1e-3).to(dtype) * (r >= 3)
            for r, x in enumerate(xs)
        ]
    else:
        xs = [(torch.randn(st.numel, generator=g) * (1 + r)).to(dtype) for r in range(sc.world)]
    res = torch.randn(st.numel, generator=g).to(dtype)
    w = (torch.rand(max(st.hidden, 1), generator=g) + 0.5).to(dtype)
    return xs, res, w


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def write_scenario(sc: Scenario, d: Path) -> None:
    lines = [f"config {sc.world} {sc.max_bytes} {sc.buffers} {int(sc.end_barrier)} 16"]
    for s, row in enumerate(_pull(sc)):
        lines.append(f"pull {s} " + " ".join(map(str, row)))
    if sc.delay:
        lines.append("delay {} {} {}".format(*sc.delay))
    for i, st in enumerate(sc.steps):
        timeout = 400 if st.kind == "skip" else sc.timeout_ms
        lines.append(
            f"step {i} {st.kind} {ALGOS[st.algo]} {DTYPES[st.dtype][1]} {st.numel} "
            f"{int(st.residual)} {int(st.inplace)} {st.who} {timeout} {st.hidden} {st.eps}"
        )
        xs, res, w = _inputs(sc, i, st)
        for r in range(sc.world):
            (d / f"s{i}.r{r}.x").write_bytes(_bytes(xs[r]))
            (d / f"s{i}.r{r}.res").write_bytes(_bytes(res))
            (d / f"s{i}.r{r}.w").write_bytes(_bytes(w[: st.hidden]))
    (d / "case.txt").write_text("\n".join(lines) + "\n")


class EmulatorError(RuntimeError):
    pass


def run_scenario(binary: Path, sc: Scenario, d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    write_scenario(sc, d)
    env = dict(
        os.environ,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
        EMU_SCHEDULE=str(sc.schedule),
    )
    r = subprocess.run([str(binary), str(d)], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        err = "\n".join(ln for ln in r.stderr.splitlines() if "swapcontext" not in ln)
        raise EmulatorError(f"{sc.name}: exit status {r.returncode}:\n{err[-6000:]}")


def _log(d: Path, i: int, r: int) -> dict[str, str]:
    out = {}
    p = d / f"s{i}.r{r}.txt"
    for line in p.read_text().splitlines() if p.exists() else []:
        key, _, value = line.partition(" ")
        out[key] = value
    return out


def _read(d: Path, i: int, r: int, name: str, dtype: torch.dtype) -> torch.Tensor:
    data = bytearray((d / f"s{i}.r{r}.{name}").read_bytes())
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def expected_bytes(sc: Scenario, st: Step, rank: int) -> list[int]:
    """Bytes rank stores into each segment in the step, derived from the protocol (not from
    the C++ counting): data to pushing peers, flags per block and phase, staging copies."""
    w, nvec = sc.world, st.numel // 8
    pull = _pull(sc)

    def blocks(n):
        return max(1, min(64, -(-n // 256)))

    def shard(dd):
        per = -(-nvec // w)
        lo = min(nvec, per * dd)
        return min(nvec, lo + per) - lo

    if st.algo == "one":
        b, phases = blocks(nvec), 1 + sc.end_barrier
    else:
        b, phases = blocks(-(-nvec // w)), 2 + sc.end_barrier
    out = [0] * w
    for dd in range(w):
        if dd == rank:
            continue
        data = nvec * 16 if st.algo == "one" else (shard(dd) + shard(rank)) * 16
        out[dd] = (0 if pull[rank][dd] else data) + b * phases * 8
    if any(pull[rank]):
        if st.algo == "one":
            out[rank] = nvec * 16
        else:
            out[rank] = sum(shard(dd) * 16 for dd in range(w) if pull[rank][dd]) + shard(rank) * 16
    return out


def check_scenario(sc: Scenario, d: Path) -> None:
    for i, st in enumerate(sc.steps):
        xs, res, w = _inputs(sc, i, st)
        dtype = DTYPES[st.dtype][0]
        want = R.sum_in_rank_order(xs)
        first_call = i + 1  # every step is one call on every rank
        for r in range(sc.world):
            log = _log(d, i, r)
            err = log.get("error")
            where = f"{sc.name} step {i} ({st.kind}) rank {r}"
            try:
                if st.kind in ("run", "graph"):
                    assert err is None, err
                    got = _read(d, i, r, "out", dtype)
                    exp = R.add_residual(want, res if st.residual else None)
                    assert torch.equal(_bits(got), _bits(exp)), "all-reduce result differs"
                    bytes_ = [int(v) for v in log["bytes"].split()]
                    assert bytes_ == expected_bytes(sc, st, r), f"bytes {bytes_}"
                elif st.kind == "norm":
                    assert err is None, err
                    normed, resout = R.add_rmsnorm(
                        want.reshape(-1, st.hidden),
                        res.reshape(-1, st.hidden) if st.residual else None,
                        w,
                        st.eps,
                    )
                    assert torch.equal(
                        _bits(_read(d, i, r, "normed", dtype)), _bits(normed.flatten())
                    )
                    assert torch.equal(
                        _bits(_read(d, i, r, "resout", dtype)), _bits(resout.flatten())
                    )
                elif st.kind == "abort":
                    if r == st.who:
                        assert err is None, err
                    else:
                        kind, _, msg = err.partition(" ")
                        assert int(kind) == ERR_ABORTED, err
                        assert f"rank {st.who} aborted all-reduce call {first_call}" in msg, err
                elif st.kind == "skip":
                    if r != st.who:
                        kind, _, msg = err.partition(" ")
                        assert int(kind) == ERR_TIMEOUT, err
                        assert f"in all-reduce call {first_call}" in msg, err
                        assert f"waiting for rank {st.who}" in msg, err
                        # every block gives up once the first wait expired (bound: room for
                        # a loaded machine)
                        assert int(log["elapsed_ms"]) < 2500, log
                elif st.kind == "mismatch":
                    kind, _, msg = (err or "none").partition(" ")
                    assert kind == str(ERR_PEER) and "all-reduces another shape" in msg, err
            except AssertionError as exc:
                raise AssertionError(f"{where}: {exc}") from exc


def S(name: str, world: int, steps: list[Step], **kw) -> Scenario:
    return Scenario(name, world, tuple(steps), **kw)


RUN = Step("run")
GRAPH = Step("graph", numel=2048)
SCENARIOS = [
    # one rank: the all-reduce is the identity (plus the residual)
    S("w1", 1, [RUN, Step("run", "two", residual=True), Step("run", numel=8)]),
    # both algorithms and buffers; one vector; two-shot with three pieces per shard
    S("w2_bf16", 2, [RUN, Step("run", "two", numel=9600), Step("run", numel=8),
                     Step("run", "two", numel=16), RUN]),
    S("w3_fp16_residual_inplace", 3, [
        Step("run", dtype="fp16", residual=True, inplace=True),
        Step("run", "two", dtype="fp16", numel=12000, residual=True, inplace=True),
        Step("run", "two", dtype="fp16", numel=24, residual=True)]),
    # mixed push/pull pairs, one- and two-shot, a shuffled block and thread order
    S("w4_pull_mixed", 4, [Step("run", residual=True), Step("run", "two", numel=8192),
                           Step("run", "two", numel=40, residual=True)], pull="alternate",
      schedule=5),
    S("w3_pull_all_barrier", 3, [RUN, Step("run", "two", numel=6000), RUN], pull="all",
      buffers=1, end_barrier=True),
    # graph replays (static buffers, frozen arguments) with a rank slow between seeing the
    # flag of call 2 and reading its data (one block per call, so that the slow rank has sent
    # everything and its peer runs on into call 3): parity / the end barrier must keep call
    # 3's data out of the buffer being read
    S("w2_graph_skew", 2, [GRAPH] * 4, delay=(1, 2, 300)),
    S("w2_graph_skew_barrier", 2, [GRAPH] * 4, delay=(1, 2, 300), buffers=1, end_barrier=True),
    # (the two-shot needs neither fence for its data: its gather hop already orders a peer's
    # next call after this rank's reads, core/allreduce_wire.h; these check it stays right)
    S("w3_graph_two_shot_skew", 3, [Step("graph", "two", numel=6144)] * 4, delay=(2, 2, 300)),
    S("w3_graph_two_shot_skew_barrier", 3, [Step("graph", "two", numel=6144, residual=True)] * 4,
      delay=(2, 2, 300), buffers=1, end_barrier=True),
    # the fused add + RMSNorm (rows longer than the 256 threads' vectors, with and without
    # the residual)
    S("w3_norm", 3, [Step("norm", numel=2 * 2304, hidden=2304, residual=True),
                     Step("norm", "two", dtype="fp16", numel=3 * 1024, hidden=1024),
                     Step("norm", numel=64, hidden=64, residual=True, eps=1e-5)]),
    # the fp32 sum is in rank order: inputs whose sum depends on it
    S("w3_order", 3, [Step("run", numel=64, data="order"), Step("run", "two", numel=64, data="order")]),
    S("w3_abort_then_reuse", 3, [RUN, Step("abort", who=1), Step("run", "two", numel=2048), RUN]),
    S("w3_abort_barrier", 3, [Step("abort", who=0), RUN], buffers=1, end_barrier=True),
    # rank 0 slow reading call 1 (one block, so that it has sent everything) while rank 1
    # aborts call 2 and runs on into call 3, which reuses call 1's parity: the abort must end
    # only once rank 0 has begun call 2
    S("w2_abort_skew", 2, [Step("run", numel=2048), Step("abort", who=1, numel=2048),
                           Step("run", numel=2048)], delay=(0, 1, 300)),
    S("w2_timeout", 2, [RUN, Step("skip", numel=8 * 256 * 8, who=1)]),
    S("w3_mismatch", 3, [RUN, Step("mismatch", numel=4096, who=2)]),
    S("w8", 8, [Step("run", numel=1024), Step("run", "two", numel=4096, residual=True)],
      pull="alternate"),
]  # fmt: skip


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_allreduce_kernels_match_reference(emulator, tmp_path, sc):
    run_scenario(emulator, sc, tmp_path)
    check_scenario(sc, tmp_path)


# ---- the emulation catches kernel and host-code mistakes ----------------------------------
# (file under csrc, exact text, replacement, scenario that must then fail)
MUTATIONS = [
    # the graph-replay ownership invariant: parity removed (one buffer, no barrier) ...
    (
        "core/allreduce_wire.h",
        "return c.buffers == 1 ? 0 : static_cast<int>(seq & 1u);",
        "return 0;",
        "w2_graph_skew",
    ),
    # ... and the end barrier removed in end-barrier mode (one buffer)
    ("cuda/allreduce/one_shot.cuh", "    wait_peers(k, kDone, seq, b, tag);\n", "", "w2_graph_skew_barrier"),
    ("cuda/allreduce/two_shot.cuh", "if (k.pull_to != 0) own_gather[v] = sum;", "", "w3_pull_all_barrier"),
    # the call number is not advanced on the device (a replay reuses the previous epoch)
    (
        "cuda/allreduce/device.cuh",
        "      *reinterpret_cast<volatile uint32_t*>(&k.state->seq) = seq;\n",
        "",
        "w2_bf16",
    ),
    # a pulled peer's data looked for in our own segment
    (
        "cuda/allreduce/device.cuh",
        "const int owner = ((k.pull_from >> s) & 1u) ? s : k.rank;",
        "const int owner = ((k.pull_from >> s) & 1u) ? k.rank : s;",
        "w4_pull_mixed",
    ),
    # the one-shot does not stage its data for pulling peers
    ("cuda/allreduce/one_shot.cuh", "    if (k.pull_to != 0) own_slot[v] = val;\n", "", "w4_pull_mixed"),
    # two-shot: every block sums the first piece of its shard
    (
        "cuda/allreduce/two_shot.cuh",
        "const Range mine = shard_piece(nvec, W, me, B, b);",
        "const Range mine = shard_piece(nvec, W, me, B, 0);",
        "w2_bf16",
    ),
    # two-shot: the gathered shards miss the residual
    (
        "cuda/allreduce/two_shot.cuh",
        "c.out[v] = c.residual != nullptr ? add_residual8<kDT>(val, c.residual[v]) : val;",
        "c.out[v] = val;",
        "w3_fp16_residual_inplace",
    ),
    # the sum in reverse rank order
    (
        "cuda/allreduce/device.cuh",
        "    if (s < world) in[s] = source_vectors(k, c, s, buf)[v];",
        "    if (s < world) in[s] = source_vectors(k, c, world - 1 - s, buf)[v];",
        "w3_order",
    ),
    # the norm's butterfly stops one step early
    ("cuda/allreduce/rmsnorm.cuh", "for (int off = 16; off >= 1; off >>= 1)", "for (int off = 16; off > 1; off >>= 1)", "w3_norm"),
    # a peer's abort, or a disagreeing peer, taken for a good flag
    ("cuda/allreduce/device.cuh", "if (info == kAbortInfo) {", "if (false) {", "w3_abort_then_reuse"),
    ("cuda/allreduce/device.cuh", "} else if (info != tag) {", "} else if (false) {", "w3_mismatch"),
    # an aborting rank runs two calls ahead of a slow reader (the abort does not wait)
    ("cuda/allreduce/kernels.cu", "  wait_begun(k, seq);\n", "", "w2_abort_skew"),
    # every block waits out its own timeout after the first one expired
    ("cuda/allreduce/device.cuh", "        if (timed_out_elsewhere(k)) {\n          bad = true;\n          break;\n        }\n", "", "w2_timeout"),
    # a timeout is not echoed into DeviceState: the other blocks, which poll the echo and not
    # the host-mapped word, each wait out their own timeout
    ("cuda/allreduce/device.cuh", "      *reinterpret_cast<volatile uint32_t*>(&k.state->timed_out) = 1u;\n", "      (void)k;\n", "w2_timeout"),
    # host: close() forgets the call state (the model lists what a rank still holds)
    ("cuda/allreduce/communicator.cu", "  (void)cudaFree(state_);\n", "", "w1"),
]  # fmt: skip

_BY_NAME = {s.name: s for s in SCENARIOS}


def _mutant(base: Path, tmp: Path, n: int) -> Path:
    fname, old, new, _ = MUTATIONS[n]
    tree = tmp / f"m{n}" / "csrc"
    for sub in ("core", "cuda/common", "cuda/allreduce", "cuda/transport"):
        shutil.copytree(CSRC / sub, tree / sub)
    mutate(tree / fname, old, new, f"mutation {n}")
    if fname.endswith(".cu"):
        rebuild = (Path(fname).name,)
    else:  # a header: every unit that may include it
        rebuild = ("kernels.cu", "communicator.cu", "main.cpp")
    return build_emulator(tmp / f"m{n}" / "build", tree, base=base, rebuild=rebuild)


def test_emulation_catches_mutations(emulator, tmp_path):
    """Every mutant must fail its scenario: wrong bits, a missing or wrong error, a leak."""
    base = emulator.parent

    def check(n: int, binary: Path) -> None:
        sc = _BY_NAME[MUTATIONS[n][3]]
        sc = dataclasses.replace(sc, timeout_ms=min(sc.timeout_ms, 3000))
        d = tmp_path / f"m{n}" / "run"
        run_scenario(binary, sc, d)
        check_scenario(sc, d)

    missed = missed_mutations(
        MUTATIONS, lambda n: _mutant(base, tmp_path, n), check, (AssertionError, EmulatorError)
    )
    assert not missed, "mutations the emulation did not detect:\n" + "\n".join(missed)


def test_emulated_sources_are_the_kernels():
    """Only common/ptx.cuh and launch.cuh are replaced: no inline PTX and no chevron launch in
    csrc/cuda/allreduce, and the stand-ins define the functions the kernels use."""
    used = set()
    for path in (CSRC / "cuda" / "allreduce").iterdir():
        text = path.read_text()
        assert not re.search(r"\basm\b", text), f"{path.name} has inline PTX"
        assert "<<<" not in text, f"{path.name} launches a kernel outside launch.cuh"
        used |= {fn for fn in ("ld_acquire_sys", "st_release_sys", "st_relaxed_sys",
                               "fence_acq_rel_sys", "globaltimer_ns", "launch_kernel")
                 if f"pa2a::cuda::{fn}(" in text}  # fmt: skip
    assert used, "the kernels use none of the primitives?"
    launch = ("cuda", "transport", "launch.cuh")
    for real_path, emu_path in (
        (CSRC / "cuda" / "common" / "ptx.cuh", PTX_MODEL),
        (CSRC.joinpath(*launch), EMU.joinpath("override", *launch)),
    ):
        real, emu, name = real_path.read_text(), emu_path.read_text(), real_path.name
        for fn in used:
            if f" {fn}(" in real:
                assert f" {fn}(" in emu, (name, fn)


def test_close_waits_for_its_own_work_only():
    """The all-reduce's and the transport's host code never call cudaDeviceSynchronize (it
    also waits for NCCL's and every other stream's work, and for kernels that wait on
    peers): close waits on the event of its own last call."""
    for sub in ("allreduce", "transport"):
        for path in (CSRC / "cuda" / sub).iterdir():
            code = [ln.split("//")[0] for ln in path.read_text().splitlines()]
            assert not any("cudaDeviceSynchronize(" in ln for ln in code), path.name
    comm = (CSRC / "cuda" / "allreduce" / "communicator.cu").read_text()
    assert "cudaEventSynchronize(done_)" in comm and "mark_done(stream);" in comm
