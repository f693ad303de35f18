"""The CUDA transport executed on the CPU: kernels *and* host code, compared bit for bit.

No GPU here, so ``csrc/cuda/transport/{kernels.cu, cuda_transport.cu}`` are compiled with
the host C++ compiler against a CUDA execution model (``tests/native/emu``: one fiber per
CUDA thread, real block barriers and warp collectives, shared memory that starts as
garbage; a fake runtime whose device memory is an arena shared by forked rank processes
the way CUDA IPC shares it, poisoned for AddressSanitizer outside what a process may
touch). Only ``cuda/common/ptx.cuh`` (the inline PTX: acquire/release loads and stores, fences,
%globaltimer) and ``launch.cuh`` (the chevrons) are replaced. The driver
(``tests/native/transport_emu/main.cpp``) forks one process per rank; each builds the real
``CudaTransport``, exchanges IPC handles, opens its peers with a pair plan (P2P pairs
through the arena, staged pairs through real POSIX shared memory), probes every pair, and
makes the calls ``pcie_a2a.transport.cuda`` makes, with no barrier between calls or before the
two-phase close. So slot assignment, the warp ballots and scans, the per-warp fp8 quantiser,
flag parity and call numbers begun by the send kernels, the pollers and work items, the
staged rows' arrival marks, the abort and timeout paths, device-side id checks, the
copy-engine path (count, read back, pack, copy, the flag by stream memory operation or
kernel) and ``open_peers``/probe/``close`` (nothing left allocated, mapped or registered;
the segment kept when a peer never closes) all run, against the same expectations as the
GPU tests (tests/cuda_transport_cases.py, pcie_a2a.reference), exactly. Every low-latency
step also checks what the emulated runtime counted: no host synchronisation and at most two
stream operations per half (four per dispatch + combine), one graph launch per half when
replayed from a capture. ``inprocess`` scenarios put the W transports in one process
(open_local, phase by phase).

``w2_staged_drain_gate`` makes a staged sender slow and partial on purpose
(EMU_STAGED_GATE, hooked into the emulation's PTX model): its low-latency flags are held until the
receiver has consumed a row or combine chunk of the call, so the expert-major and combine
receives must drain staged rows before the flag (the earlier "wait for the flag" code fails
it), and it waits before each early line and after each mark until the receiver read it,
so a mark stored before its data or a stale mark or early line taken for the call reads
wrong bytes.

The mutation test shows that plausible slips in the kernels (slot parity, slot order,
ballot rank, warp scan, last-block publish, copy-engine parity, staged progress, ...) fail
here. A reversed
summation order is not among them: with these inputs its sums round the same.

Two parts of the memory and launch model are checked on top: the lane views poison a staged
row from the acquire of its mark until a barrier that orders memory (``__syncwarp``,
``__syncthreads``) completes for the acquiring warp, so a warp that hands an acquire on with
only a shuffle or ballot reads garbage; and a flag wait after ``griddep_launch_dependents``
in the same block fails the run (a dependent kernel would be resident while it spins).

What it cannot show: memory ordering across real PCIe (the model is sequentially
consistent within the CPU; a missing fence is invisible), true concurrency of the warps
of a block (they interleave only at barriers and warp collectives) or of blocks (they run
one after another, so a work item's wait for an earlier item is always satisfied and the
staged drain sees whole rows), the effect of programmatic dependent launch (launches run
in order; only where a kernel triggers is checked), timing, and the compiled SASS.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from native_emulation import (
    MODEL_FLAGS,
    PTX_MODEL,
    TRANSPORT_PTX_HOOKS,
    compiler,
    missed_mutations,
    mutate,
    skip_or_fail,
)

try:
    import cuda_transport_cases as C
except ImportError:  # pragma: no cover - run from another directory
    from tests import cuda_transport_cases as C

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
EMU = Path(__file__).resolve().parent / "native" / "transport_emu"
KERNEL_FILES = ("kernels_send.cu", "kernels_recv.cu", "kernels_combine.cu", "kernels_control.cu")
SOURCES = (*KERNEL_FILES, "cuda_transport.cu", "launch.cuh", "device_protocol.cuh",
           "kernel_common.cuh", "staged_progress.cuh", "pull.cuh")  # fmt: skip
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
ERR_VALUE, ERR_TIMEOUT, ERR_PEER, ERR_ABORTED = 0, 1, 2, 3  # pa2a::Error::Kind
SHORT_TIMEOUT_MS = 400  # the timeout of steps where a peer never comes
ONLY0_TIMEOUT_MS = 1000  # ... and of the step where rank 0 waits for seven silent peers


def _units(csrc: Path) -> list[tuple[Path, list[str]]]:
    # kernels_*.o: -fdata-sections puts every static __shared__ variable in its own section,
    # which emu_shared.ld collects (the model refills them with garbage per block).
    kernels = [
        (csrc / "cuda" / "transport" / f, ["-x", "c++", "-fdata-sections"]) for f in KERNEL_FILES
    ]
    return [
        *kernels,
        (csrc / "cuda" / "transport" / "cuda_transport.cu", ["-x", "c++"]),
        (csrc / "core" / "dispatch_layout.cpp", []),
        (csrc / "core" / "numa_memory.cpp", []),
        (EMU / "main.cpp", []),
    ]


def _flags(csrc: Path, sanitize: bool) -> list[str]:
    f = ["-std=c++17", "-fno-strict-aliasing", "-ffp-contract=off"]
    f += ["-Wno-unknown-pragmas", "-fno-omit-frame-pointer"]
    f += [
        "-iquote",
        str(EMU / "override"),
        "-I",
        str(EMU / "include"),
        *MODEL_FLAGS,
        TRANSPORT_PTX_HOOKS,
    ]
    return f + ["-I", str(csrc)] + (SANITIZE if sanitize else [])


def _sanitizer_works(cxx: str, tmp: Path) -> bool:
    src = tmp / "probe.cpp"
    src.write_text("int main() { return 0; }\n")
    r = subprocess.run([cxx, *SANITIZE, str(src), "-o", str(tmp / "probe")], capture_output=True)
    return r.returncode == 0


def build_emulator(
    out: Path,
    csrc: Path = CSRC,
    base: Path | None = None,
    rebuild: tuple[str, ...] = (),
    fast: bool = True,
) -> Path:
    """Compiles the transport and the driver into ``out``/transport_emu (sanitized, -O1).
    With ``base`` (a previous build's directory) only the sources named in ``rebuild`` are
    compiled again and linked with base's other objects (the mutation builds): quickly
    (-O0, no sanitizer) if ``fast``, else like base."""
    cxx = compiler()
    out.mkdir(parents=True, exist_ok=True)
    if base is None:
        sanitize = _sanitizer_works(cxx, out)
        units, flags = _units(csrc), [*_flags(csrc, sanitize), "-O1", "-g"]
    else:
        sanitize = (base / "sanitized").exists()
        units = [u for u in _units(csrc) if u[0].name in rebuild]
        slow = [*_flags(csrc, sanitize), "-O1", "-g"]
        flags = [*_flags(csrc, False), "-O0", "-g0"] if fast else slow

    def compile_one(unit):
        src, extra = unit
        obj = out / (src.name.split(".")[0] + ".o")
        r = subprocess.run([cxx, *flags, *extra, "-c", str(src), "-o", str(obj)],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"emulator build failed ({src.name}):\n{r.stderr[-4000:]}")
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objs = list(pool.map(compile_one, units))
    if base is not None:
        built = {o.name for o in objs}
        objs += [base / n for n in _objects() if n not in built]
    if sanitize:
        (out / "sanitized").touch()
    binary = out / "transport_emu"
    link = [cxx, *(SANITIZE if sanitize else []), *map(str, objs), "-o", str(binary)]
    r = subprocess.run([*link, f"-Wl,-T,{EMU / 'emu_shared.ld'}", "-lrt", "-lpthread"],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:  # a linker without INSERT scripts: shared memory starts zeroed
        r = subprocess.run([*link, "-lrt", "-lpthread"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"emulator link failed:\n{r.stderr[-4000:]}")
    return binary


def _objects() -> list[str]:
    return [u[0].name.split(".")[0] + ".o" for u in _units(CSRC)]


@pytest.fixture(scope="session")
def emulator(tmp_path_factory) -> Path:
    if compiler() is None:
        skip_or_fail("no host C++ compiler (c++/g++) to build the transport emulation")
    if sys.platform != "linux":
        pytest.skip("the emulation's rank processes share memory the Linux way (prctl, shm)")
    if (
        not all((CSRC / "cuda" / "transport" / s).is_file() for s in SOURCES)
        or not (CSRC / "cuda" / "common" / "ptx.cuh").is_file()
    ):
        pytest.skip("the CUDA transport sources are not in this checkout")
    return build_emulator(tmp_path_factory.mktemp("transport_emu"))


# ---- scenarios -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    case: C.Case
    # one call sequence per step: ll_rows, ll_em, graph_rows, graph_em, normal (+ "_raw":
    # fp8 rows as raw bytes), or KIND:WHO with KIND in abort, abort_combine, abort_silent,
    # skip, mismatch, count_mismatch, bad_ids, exit (tests/native/transport_emu/main.cpp)
    steps: tuple[str, ...]
    timeout_ms: int = 20_000
    schedule: int = 0  # EMU_SCHEDULE: shuffled block and thread order
    inprocess: bool = False  # W transports in one process (open_local), phase by phase
    max_recv_blocks: int = 0  # receive grid cap (0: the emulated SM count, 3)
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the run (emulated faults)
    close_ms: int = 30_000  # how long close() waits for the peers' close marks
    ids64: bool = False  # topk_ids as int64
    probe: tuple[tuple[int, ...], ...] = ()  # expected probe status per rank (default all 0)
    leaked: tuple[int, ...] = ()  # ranks whose close() must keep its segment (a peer's mark
    # never came)

    @property
    def name(self) -> str:
        return self.case.name


def _dispatch_slot(case: C.Case) -> int:
    """wire_format.h's slot, derived independently: header, ids, weights, payload."""

    def a(n: int) -> int:
        return (n + 15) // 16 * 16

    head = 16 + 2 * a(4 * case.num_topk)
    if case.payload == "fp8":
        return head + a(case.hidden) + a(4 * (case.hidden // 128))
    return head + a(2 * case.hidden)


def _calls(kind: str) -> int:
    """Call numbers a step consumes (every rank, whoever skips or aborts)."""
    if kind == "exit":
        return 0
    one = ("abort", "abort_combine", "abort_silent", "skip", "only0", "mismatch")
    # two_in_flight: two dispatches (2)
    return 1 if kind in one else 2


def _sent_ids(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """What a rank with bad ids sends: entries the reference has as -1 (so the expectations
    stay the reference's) replaced by an id past E, an id below -1 and a repeat of the
    token's first expert; the device must skip exactly those and report them."""
    bad = ids.clone()
    t, k = bad.shape
    assert t > 5 and k >= 2 and bool((bad[[0, 3, 5], [-1, 0, -1]] == -1).all())
    bad[0, -1] = experts + 3
    bad[3, 0] = -7
    bad[5, -1] = bad[5, 0]
    return bad


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _y(case: C.Case, kind: str, step: int, rank: int) -> torch.Tensor | None:
    """The combine input a rank's expert would produce from the *expected* received rows."""
    exp = C.expected(case, step)[rank]
    w, m, h = case.world, case.max_tokens, case.hidden
    dtype = C.DTYPES[case.dtype][0]
    if kind == "normal":
        return C.rows_fn(exp.x, rank)
    if kind in ("ll_rows", "graph_rows", "bad_ids"):
        y = torch.zeros(w * m, h, dtype=dtype)
        for s in range(w):
            sel = (exp.src_rank == s).nonzero().flatten()
            y[s * m : s * m + sel.numel()] = C.rows_fn(exp.x[sel], rank)
        return y
    if kind in ("ll_em", "graph_em"):
        e_local = C.placement(case).num_local_experts(rank)
        y = torch.zeros(e_local, w * m, h, dtype=dtype)
        for e, rows in enumerate(C.expert_lists(exp, e_local)):
            if rows:
                y[e, : len(rows)] = C.em_fn(exp.x[rows], e)
        return y
    return None


def _step_timeout_ms(sc: Scenario, kind: str) -> int:
    if kind == "only0":
        return ONLY0_TIMEOUT_MS
    return SHORT_TIMEOUT_MS if kind in ("skip", "abort_silent") else sc.timeout_ms


def _ce_bytes(case: C.Case, slot: int) -> int:
    limit = C.ce_min_bytes(case, slot)
    return -1 if limit is None else limit


def write_scenario(sc: Scenario, d: Path) -> None:
    case, w = sc.case, sc.case.world
    pl = C.placement(case)
    offset, ranks, local = pl.csr()
    plan = C.pair_plan(case) or [["p2p"] * w for _ in range(w)]
    pull = C.pair_direction(case)
    code = {"staged": "1", "p2p": "0"}
    lines = [
        f"config {w} {case.hidden} {case.max_tokens} {case.num_topk} "
        f"{C.PAYLOADS[case.payload]} {C.DTYPES[case.dtype][1]} 32",
        f"offset {len(offset)} " + " ".join(map(str, offset)),
        f"replica_rank {len(ranks)} " + " ".join(map(str, ranks)),
        f"replica_local {len(local)} " + " ".join(map(str, local)),
        "local_experts " + " ".join(str(pl.num_local_experts(r)) for r in range(w)),
    ]
    for r in range(w if pl.choice is not None else 0):
        choice_offset, choice = pl.choice_csr(r)
        lines.append(f"choice_offset {r} {len(choice_offset)} " + " ".join(map(str, choice_offset)))
        lines.append(f"choice {r} {len(choice)} " + " ".join(map(str, choice)))
    for r in range(w):
        row = ["2" if pull[r][d] == "pull" else code[v] for d, v in enumerate(plan[r])]
        lines.append(f"send {r} " + " ".join(row))
        lines.append(f"order {r} " + " ".join(map(str, C.send_order(case)[r])))
    lines.append(f"options {int(sc.inprocess)} {sc.max_recv_blocks} 3000 {sc.close_ms}")
    ce_d = _ce_bytes(case, _dispatch_slot(case))
    ce_c = _ce_bytes(case, 2 * case.hidden)
    for i, step in enumerate(sc.steps):
        kind, _, who = step.partition(":")
        raw = kind.endswith("_raw")
        kind = kind.removesuffix("_raw")
        lines.append(
            f"step {i} {kind} {who or -1} {ce_d} {ce_c} {int(raw)} {_step_timeout_ms(sc, kind)}"
        )
        for r in range(w):
            x, ids, wts = C.inputs(case, r, i)
            lines.append(f"shape {i} {r} {x.shape[0]} {ids.shape[1]}")
            (d / f"s{i}.r{r}.x").write_bytes(_bytes(x))
            if kind == "bad_ids" and r == int(who):
                ids = _sent_ids(ids, case.experts)
            if sc.ids64:
                (d / f"s{i}.r{r}.ids64").write_bytes(_bytes(ids.to(torch.int64)))
            else:
                (d / f"s{i}.r{r}.ids").write_bytes(_bytes(ids.to(torch.int32)))
            (d / f"s{i}.r{r}.w").write_bytes(_bytes(wts.float()))
            y = _y(case, kind, i, r)
            if y is not None:
                (d / f"s{i}.r{r}.y").write_bytes(_bytes(y))
    (d / "case.txt").write_text("\n".join(lines) + "\n")


class EmulatorError(RuntimeError):
    pass


def run_scenario(binary: Path, sc: Scenario, d: Path) -> float:
    d.mkdir(parents=True, exist_ok=True)
    write_scenario(sc, d)
    env = dict(
        os.environ,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
        EMU_SCHEDULE=str(sc.schedule),
        **dict(sc.env),
    )
    t0 = time.monotonic()
    r = subprocess.run([str(binary), str(d)], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        err = "\n".join(ln for ln in r.stderr.splitlines() if "swapcontext" not in ln)
        raise EmulatorError(f"{sc.name}: exit status {r.returncode}:\n{err[-6000:]}")
    return time.monotonic() - t0


# ---- reading the results ---------------------------------------------------------------------
class Out:
    def __init__(self, d: Path, step: int, rank: int):
        self.d, self.step, self.rank = d, step, rank
        self.log: dict[str, str] = {}
        txt = d / f"s{step}.r{rank}.txt"
        for line in txt.read_text().splitlines() if txt.exists() else []:
            key, _, value = line.partition(" ")
            if key == "counts":  # "counts HALF LAUNCHES SYNCS PDL"
                half, _, value = value.partition(" ")
                key = f"counts_{half}"
            self.log[key] = value

    def __call__(self, name: str, dtype: torch.dtype, *shape: int) -> torch.Tensor:
        data = bytearray((self.d / f"s{self.step}.r{self.rank}.{name}").read_bytes())
        if not data:
            return torch.empty(*shape, dtype=dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(*shape)

    def error(self) -> tuple[int, str] | None:
        if "error" not in self.log:
            return None
        kind, _, msg = self.log["error"].partition(" ")
        return int(kind), msg


def _check_send_side(case: C.Case, step: int, rank: int, o: Out, exp_all) -> None:
    """send_count / send_token: slot j of destination d is the j-th token of this rank,
    in token order, with an expert on d (what combine_recv's binary search relies on)."""
    w, m = case.world, case.max_tokens
    send_count = o("send_count", torch.int32, w).tolist()
    send_token = o("send_token", torch.int32, w, m)
    for d in range(w):
        mine = exp_all[d].src_token[exp_all[d].src_rank == rank]
        assert send_count[d] == mine.numel(), f"send_count[{d}]"
        assert torch.equal(send_token[d, : mine.numel()], mine), f"send_token[{d}]"


def _rows_outputs(case: C.Case, rank: int, o: Out, n: int) -> dict:
    """The rows layout's per-row outputs of a dispatch (n rows) as the emulator wrote them."""
    w, k = case.world, case.num_topk
    return {
        "counts": o("counts", torch.int32, w),
        "src_rank": o("src_rank", torch.int32, n),
        "src_token": o("src_token", torch.int32, n),
        "ids_o": o("ids_o", torch.int32, n, k),
        "ws_o": o("ws_o", torch.float32, n, k),
        "per_expert": o("per_expert", torch.int32, C.placement(case).num_local_experts(rank)),
    }


def _check_rows_step(case: C.Case, kind: str, raw: bool, step: int, rank: int, o: Out) -> None:
    w, m, h = case.world, case.max_tokens, case.hidden
    dtype = C.DTYPES[case.dtype][0]
    exp_all = C.expected(case, step)
    exp = exp_all[rank]
    t = C.tokens(case, rank)
    ll = kind in ("ll_rows", "graph_rows")
    n = w * m if ll else exp.x.shape[0]
    b = {**_rows_outputs(case, rank, o, n), "out": o("out", dtype, t, h)}
    if raw:
        b["fp8"] = o("fp8", torch.uint8, n, h)
        b["scales"] = o("scales", torch.float32, n, h // 128)
    else:
        b["xo"] = o("xo", dtype, n, h)
    _check_send_side(case, step, rank, o, exp_all)
    if ll:
        C.check_ll_rows(case, rank, step, b, t)
        return
    assert b["counts"].tolist() == [int((exp.src_rank == s).sum()) for s in range(w)]
    assert torch.equal(b["src_rank"], exp.src_rank)
    assert torch.equal(b["src_token"], exp.src_token)
    assert torch.equal(b["ids_o"], exp.topk_ids)
    assert torch.equal(b["ws_o"], exp.topk_weights)
    assert b["per_expert"].tolist() == exp.tokens_per_expert
    C.assert_rows(case, exp, b.get("xo"), b.get("fp8"), b.get("scales"), step)
    want = C.combined(case, step, [C.rows_fn(e.x, r) for r, e in enumerate(exp_all)])
    assert torch.equal(C.bits(b["out"]), C.bits(want[rank])), "combined output differs"
    if case.copy_engine != "off":  # exactly the pairs at or over the threshold
        counts = b["counts"].tolist()
        send_count = o("send_count", torch.int32, w).tolist()
        dslot, cslot = map(int, o.log["slots"].split())
        assert (dslot, cslot) == (_dispatch_slot(case), 2 * h), "slot sizes"
        pulled = [v == "pull" for v in C.pair_direction(case)[rank]]  # rows stay here
        for key, ns, slot in (("ce_dispatch", send_count, dslot), ("ce_combine", counts, cslot)):
            limit = C.ce_min_bytes(case, slot)
            want_mask = sum(1 << r for r, c in enumerate(ns)
                            if c > 0 and c * slot >= limit and not pulled[r])  # fmt: skip
            assert int(o.log[key]) == want_mask, f"{key} mask"


def _check_two_in_flight(case: C.Case, raw: bool, step: int, rank: int, o: Out) -> None:
    """Both dispatches of the step: the reference's rows (no combine ran)."""
    w, m, h, k = case.world, case.max_tokens, case.hidden, case.num_topk
    n = w * m
    dtype = C.DTYPES[case.dtype][0]
    b = _rows_outputs(case, rank, o, n)
    payload = ("fp8", torch.uint8) if raw else ("xo", dtype)
    b[payload[0]] = o(payload[0], payload[1], n, h)
    if raw:
        b["scales"] = o("scales", torch.float32, n, h // 128)
    C.check_ll_rows(case, rank, step, b, C.tokens(case, rank))
    _check_send_side(case, step, rank, o, C.expected(case, step))
    assert torch.equal(o("b_counts", torch.int32, w), b["counts"]), "second dispatch's counts"
    for name, dt, shape in (("src_token", torch.int32, (n,)), ("ids_o", torch.int32, (n, k)),
                            (payload[0], payload[1], (n, h))):  # fmt: skip
        assert torch.equal(o(f"b_{name}", dt, *shape), b[name]), f"second dispatch's {name}"


def _check_em_step(case: C.Case, raw: bool, step: int, rank: int, o: Out, reduce=True) -> None:
    """reduce: the step also ran the pre-reduction alone (reduce_expert_major)."""
    w, m, h, k = case.world, case.max_tokens, case.hidden, case.num_topk
    cap = w * m
    dtype = C.DTYPES[case.dtype][0]
    e_local = C.placement(case).num_local_experts(rank)
    exp_all = C.expected(case, step)
    exp = exp_all[rank]
    b = {
        "per_expert": o("per_expert", torch.int32, e_local),
        "src_info": o("src_info", torch.int32, e_local, cap),
        "layout_range": o("layout_range", torch.int64, e_local, w),
    }
    if raw:
        b["fp8"] = o("fp8", torch.uint8, e_local, cap, h)
        b["scales"] = o("scales", torch.float32, e_local, cap, h // 128)
    else:
        b["xo"] = o("xo", dtype, e_local, cap, h)
    C.check_expert_major(case, rank, step, b)
    _check_send_side(case, step, rank, o, exp_all)
    counts = o("counts", torch.int32, w).tolist()
    assert counts == [int((exp.src_rank == s).sum()) for s in range(w)], "counts differ"
    # per received row (s, j): its experts, weights and positions in the expert lists
    row_experts = o("row_experts", torch.int32, w, m, k)
    row_weights = o("row_weights", torch.float32, w, m, k)
    expert_pos = o("expert_pos", torch.int32, w, m, k)
    reduced = o("reduced", dtype, w, m, h) if reduce else None
    lists = C.expert_lists(exp, e_local)
    partial = C.pre_reduced(exp, dtype)
    for s in range(w):
        rows = (exp.src_rank == s).nonzero().flatten().tolist()
        ids = exp.topk_ids[rows]
        assert torch.equal(row_experts[s, : len(rows)], ids), "row_experts differ"
        assert torch.equal(row_weights[s, : len(rows)], exp.topk_weights[rows])
        pos = torch.tensor(
            [[lists[e].index(i) if e >= 0 else -1 for e in ids[j].tolist()] for j, i in
             enumerate(rows)],
            dtype=torch.int32,
        ).reshape(len(rows), k)  # fmt: skip
        assert torch.equal(expert_pos[s, : len(rows)], pos), "expert_pos differ"
        assert bool((row_experts[s, len(rows) :] == -1).all())
        assert bool((row_weights[s, len(rows) :] == 0).all())
        assert bool((expert_pos[s, len(rows) :] == -1).all())
        if reduced is not None:
            assert torch.equal(C.bits(reduced[s, : len(rows)]), C.bits(partial[rows])), "reduced"
    want = C.combined(case, step, C.em_partials(case, step))[rank]
    out = o("out", dtype, C.tokens(case, rank), h)
    assert torch.equal(C.bits(out), C.bits(want)), "expert-major combine differs"


# A low-latency dispatch + combine through the Buffer's calls: at most this many stream
# operations (kernel launches, async copies, memsets) per half, and no host synchronisation
# (issue 10: 0 syncs, <= 4 launches). The counts come from the emulated runtime, which runs
# the real CudaTransport host code.
LL_LAUNCHES_PER_HALF = 2
GRAPH_LAUNCHES_PER_HALF = 1


def _check_counts(o: Out, graph: bool, inprocess: bool) -> None:
    if inprocess:  # one process counts every rank's work: nothing per rank to compare
        return
    want = GRAPH_LAUNCHES_PER_HALF if graph else LL_LAUNCHES_PER_HALF
    for half in ("dispatch", "combine"):
        assert f"counts_{half}" in o.log, f"no counts of the {half}: {o.log}"
        launches, syncs, pdl = map(int, o.log[f"counts_{half}"].split())
        assert syncs == 0, f"{half}: {syncs} host synchronisations"
        assert launches <= want, f"{half}: {launches} launches, expected <= {want}"
        if not graph:  # the emulated device is sm_90: every kernel uses PDL
            assert pdl == launches, f"{half}: {pdl} of {launches} launches with PDL"


def _check_stats(case: C.Case, o: Out) -> None:
    """The send kernels' statistics after the combine: its rows per source = received."""
    assert "stats" in o.log, f"no statistics: {o.log}"
    calls, family, *rows = map(int, o.log["stats"].split())
    assert family == 1 and calls >= 2, o.log["stats"]
    assert rows == o("counts", torch.int32, case.world).tolist(), "stats rows"


def _check_rank_log(sc: Scenario, d: Path, r: int) -> None:
    """The bootstrap probe and close() of rank r (DIR/r<R>.txt)."""
    lines = (d / f"r{r}.txt").read_text().splitlines() if (d / f"r{r}.txt").exists() else []
    probe = [ln.split()[1:] for ln in lines if ln.startswith("probe")]
    want = dict(sc.probe).get(r, (0,) * sc.case.world) if not sc.inprocess else None
    if want is not None:
        assert probe and tuple(map(int, probe[0])) == tuple(want), f"rank {r} probe {probe}"
    closed = [ln.split()[1] for ln in lines if ln.startswith("close")]
    if any(st.startswith("exit:") and int(st.split(":")[1]) == r for st in sc.steps):
        assert not closed, f"rank {r} exited yet closed"
        return
    assert closed == ["LEAKED" if r in sc.leaked else "OK"], f"rank {r} close {closed}"


def check_scenario(sc: Scenario, d: Path) -> None:
    case = sc.case
    for r in range(case.world):
        _check_rank_log(sc, d, r)
    seq = 0
    for i, step in enumerate(sc.steps):
        kind, _, who_s = step.partition(":")
        raw = kind.endswith("_raw")
        kind = kind.removesuffix("_raw")
        who = int(who_s) if who_s else -1
        first = seq + 1  # the call number of the step's first call
        seq += _calls(kind)
        for r in range(case.world):
            o = Out(d, i, r)
            err = o.error()
            where = f"{sc.name} step {i} ({step}) rank {r}"
            try:
                assert "elapsed_ms" in o.log or kind == "exit", f"no complete log: {o.log}"
                if kind in ("ll_rows", "ll_em", "graph_rows", "graph_em"):
                    assert err is None, err
                    _check_counts(o, graph=kind.startswith("graph"), inprocess=sc.inprocess)
                    if not kind.startswith("graph"):
                        _check_stats(case, o)
                if kind in ("ll_rows", "normal", "graph_rows"):
                    assert err is None, err
                    _check_rows_step(case, kind, raw, i, r, o)
                elif kind in ("ll_em", "graph_em"):
                    assert err is None, err
                    _check_em_step(case, raw, i, r, o, reduce=kind == "ll_em")
                elif kind == "bad_ids":  # the rows are the reference's; `who` is told
                    _check_counts(o, graph=False, inprocess=sc.inprocess)
                    if r == who:
                        assert err is not None and err[0] == ERR_VALUE, err
                        assert (
                            f"topk_ids of low_latency_dispatch (call {first}) on rank {who}"
                            in err[1]
                        ), err
                    else:
                        assert err is None, err
                    _check_rows_step(case, "ll_rows", raw, i, r, o)
                elif kind == "two_in_flight":
                    assert err is None, err
                    _check_two_in_flight(case, raw, i, r, o)
                elif kind == "exit":
                    pass
                elif kind in ("abort", "abort_combine"):
                    op = "dispatch" if kind == "abort" else "combine"
                    if r == who:
                        assert err is None, err
                    else:
                        assert err is not None and err[0] == ERR_ABORTED, err
                        assert f"rank {who} aborted {op} (call {first})" in err[1], err
                elif kind == "skip":
                    if r != who:
                        assert err is not None and err[0] == ERR_TIMEOUT, err
                        assert f"rank {r} timed out" in err[1], err
                        assert f"(call {first}) waiting for rank {who}" in err[1], err
                        # every receive block of the missing source gives up once the first
                        # one timed out: ~400 ms, not 400 ms for each of its 10 blocks (the
                        # bound leaves room for a loaded machine)
                        assert int(o.log["elapsed_ms"]) < 2500, o.log
                elif kind == "only0":  # rank 0 waits for 7 silent peers, one receive block
                    if r == 0:
                        assert err is not None and err[0] == ERR_TIMEOUT, err
                        assert f"(call {first}) waiting for rank 1" in err[1], err
                        # the pollers of the other silent peers give up once the first timed
                        # out (the error word, read on the timer path): one timeout, not seven
                        assert int(o.log["elapsed_ms"]) < 4 * ONLY0_TIMEOUT_MS, o.log
                    else:
                        assert err is None, err
                elif kind == "abort_silent":
                    silent = case.world - 1
                    if r != silent:
                        assert err is not None and err[0] == ERR_TIMEOUT, err
                        assert f"(call {first}) waiting for rank {silent}" in err[1], err
                elif kind == "count_mismatch":
                    sent = C.expected(case, i)[who].src_rank.tolist()
                    victim = next(d for d in range(case.world) if d != who and d in sent)
                    if r == victim:
                        assert err is not None and err[0] == ERR_PEER, err
                        assert (
                            f"rank {who} returned a different number of rows in combine "
                            f"(call {first + 1})" in err[1]
                        ), err
                    else:
                        assert err is None, err
                elif kind == "mismatch":
                    assert err is not None and err[0] == ERR_PEER, err
                    assert "is in another call" in err[1], err
            except (AssertionError, KeyError, ValueError, OSError, RuntimeError) as exc:
                # a missing or short output is a failed check too (a mutant cut the step short)
                raise AssertionError(f"{where}: {type(exc).__name__}: {exc}") from exc


# ---- the table -------------------------------------------------------------------------------
def S(name: str, world: int, steps: str, **kw) -> Scenario:
    fields = ("timeout_ms", "schedule", "inprocess", "max_recv_blocks", "env", "close_ms", "ids64",
              "probe", "leaked")  # fmt: skip
    sc = {k: kw.pop(k) for k in fields if k in kw}
    return Scenario(C.Case(name, world, "emu", **kw), tuple(steps.split()), **sc)


SCENARIOS = [
    # one rank: every row goes to itself (own segment, no IPC)
    S("w1_bf16", 1, "ll_rows normal ll_em", seed=30),
    # both parities and their reuse, normal and low-latency calls interleaved
    S("w2_bf16_p2p", 2, "normal ll_rows normal ll_rows", seed=31),
    S("w2_fp8_staged_raw", 2, "normal_raw ll_rows ll_em_raw", payload="fp8",
      transport="staged", hidden=384, seed=32),
    S("w4_fp16_mixed_reversed", 4, "ll_rows ll_rows ll_rows", dtype="fp16", payload="fp16",
      transport="mixed", order="reversed", max_tokens=37, seed=33),
    S("w4_fp8_em_redundant_top8", 4, "ll_em ll_em ll_em", payload="fp8", experts=16, topk=8,
      num_topk=8, hidden=384, placement="redundant", seed=34),
    S("w4_bf16_ce_all_staged", 4, "normal normal", copy_engine="all", transport="staged",
      placement="random", experts=16, seed=35),
    S("w4_fp16_ce_mixed", 4, "normal normal_raw", dtype="fp16", payload="fp8",
      copy_engine="mixed", transport="mixed", experts=16, topk=6, num_topk=6, seed=36),
    # a replica choice table (pcie_a2a.balance): the kernels pick the rows' ranks from it
    S("w4_choice_table", 4, "ll_em normal", experts=16, topk=4, placement="table", seed=44),
    S("w4_sparse_placement", 4, "ll_em normal ll_rows count_mismatch:2", placement="sparse",
      experts=12, max_tokens=20, seed=37),
    # eight ranks; the smallest rows (one 16-byte vector) and a single receive block; the
    # largest num_topk (two ballot rounds, 64 expert slots per row)
    S("w8_mixed", 8, "ll_rows normal ll_em", experts=16, topk=4, max_tokens=10,
      transport="mixed", seed=50),
    S("w2_tiny_rows", 2, "ll_rows normal ll_em ll_rows", hidden=8, max_tokens=5, topk=2,
      num_topk=2, experts=4, seed=51),
    S("w2_topk64_fp8", 2, "ll_em normal ll_rows", experts=64, topk=64, num_topk=64,
      max_tokens=8, hidden=128, payload="fp8", seed=52),
    S("w2_topk1_shuffled", 2, "ll_rows ll_em normal", topk=1, num_topk=1, experts=4,
      max_tokens=50, schedule=7, seed=38),
    S("w4_abort_then_reuse", 4, "normal abort:2 ll_rows abort_combine:1 ll_em",
      transport="mixed", experts=16, schedule=11, seed=39),
    # prefill sizes: several tokens per dispatch block, many receive blocks per source
    S("w2_prefill_ce_mixed", 2, "normal ll_rows normal", max_tokens=300, copy_engine="mixed",
      experts=16, seed=43),
    S("w2_timeout", 2, "ll_rows skip:1", max_tokens=160, seed=40),
    # seven silent peers and one receive block: their pollers run one after another
    S("w8_only_rank0_calls", 8, "only0", experts=16, max_tokens=8, max_recv_blocks=1, seed=44),
    S("w2_op_mismatch", 2, "normal mismatch:1", seed=41),
    S("w3_abort_silent_peer", 3, "ll_em abort_silent:0", experts=9, seed=42),
    # W transports in one process, each on its own stream, tables from each other's pointers
    # (open_local, no IPC), the calls of all ranks issued phase by phase
    S("w4_inprocess_mixed", 4, "ll_rows ll_em ll_rows", transport="mixed", experts=16,
      inprocess=True, seed=60),
    S("w2_inprocess_staged_fp8", 2, "ll_em ll_rows", payload="fp8", transport="staged",
      inprocess=True, seed=61),
    # CUDA graphs: both halves captured once, replayed with new inputs (both parities, reuse)
    S("w2_graph_rows", 2, "graph_rows graph_rows graph_rows", seed=62),
    S("w4_graph_em_mixed_fp8", 4, "graph_em graph_em graph_em", payload="fp8", experts=16,
      transport="mixed", seed=63),
    # int64 ids; ids past E, below -1 and repeated, skipped and reported by the device
    S("w2_ids64_bad_ids", 2, "ll_rows bad_ids:0 ll_em", ids64=True, seed=64),
    # receive grids capped at one block (every item on one block), and above the items
    S("w4_one_recv_block", 4, "ll_rows ll_em normal", experts=16, max_recv_blocks=1, seed=65),
    S("w2_many_recv_blocks", 2, "ll_em ll_rows", max_recv_blocks=64, seed=66),
    # the copy engine's flags by a kernel where stream memory operations are missing
    S("w2_ce_flag_kernel", 2, "normal", copy_engine="all", seed=67,
      env=(("EMU_NO_STREAM_MEMOPS", "1"),)),
    # "P2P supported" but not working: every store into rank 1's memory through IPC is lost.
    # Its probe names rank 0, and its close keeps its segment (rank 0's mark never came).
    S("w2_p2p_blackhole", 2, "", env=(("EMU_IPC_BLACKHOLE", "1"),), probe=((1, (1, 0)),),
      leaked=(1,), close_ms=300),
    # a slow, partial staged sender: rank 0 holds each low-latency flag until rank 1 has
    # consumed a row or chunk of the call (EMU_STAGED_GATE, in the emulation's PTX model), so a
    # receive that waits for the flag instead of draining fails; rank 0 also stores each
    # early line only once rank 1 polls it and waits after each mark until rank 1 read it
    # (a line, row or chunk taken before it is complete reads stale bytes). The expert-major receive and the combine, both parities and their reuse. (Not
    # the rows layout: its poller item waits for the flag before the row items, and blocks
    # run one after another here.)
    S("w2_staged_drain_gate", 2, "ll_em ll_em ll_em", transport="staged", seed=69,
      env=(("EMU_STAGED_GATE", "0"),)),
    # a rank that exits without close(): the others keep their segments
    S("w3_exit_without_close", 3, "ll_rows exit:2", experts=9, leaked=(0, 1), close_ms=300,
      seed=68),
    # pull (cuda/transport/pull.cuh): every P2P pair pulled, dispatch and combine, both
    # layouts and modes, each parity reused; mixed with push and host-staged (push) pairs,
    # fp8; the copy engine beside pulled pairs (they stay warp stores into own memory);
    # graphs (the consumed guard's record lives on the device); aborts (a receiver that
    # reads nothing of a call still marks it consumed); one process (open_local)
    S("w2_pull_all", 2, "normal ll_rows ll_em normal ll_rows", direction="pull", seed=70),
    S("w4_fp8_pull_mixed", 4, "ll_rows ll_em_raw normal_raw ll_rows", payload="fp8",
      hidden=384, experts=16, transport="mixed", direction="mixed", seed=71),
    S("w4_ce_pull_mixed", 4, "normal normal", copy_engine="all", direction="mixed", experts=16,
      seed=72),
    S("w2_pull_graph_em", 2, "graph_em graph_em graph_em", direction="pull", dtype="fp16",
      payload="fp16", seed=73),
    S("w4_pull_abort_then_reuse", 4, "normal abort:2 ll_rows abort_combine:1 ll_em",
      direction="mixed", experts=16, seed=74),
    S("w2_inprocess_pull", 2, "ll_rows ll_em ll_rows", direction="pull", inprocess=True,
      seed=75),
    # two dispatches in flight (a deferred receive), rank 1 slow before its sends and its
    # receives: its peer must wait for its consumed flag before reusing a parity (a slow
    # reader) and for its ready flag before loading (a slow sender)
    S("w2_pull_two_in_flight_slow", 2, "two_in_flight two_in_flight two_in_flight",
      direction="pull", env=(("EMU_SLOW_RANK", "1"), ("EMU_SLOW_MS", "300")), seed=76),
]  # fmt: skip


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_transport_matches_reference(emulator, tmp_path, sc):
    run_scenario(emulator, sc, tmp_path)
    check_scenario(sc, tmp_path)


# ---- the emulation catches kernel and host-code mistakes ----------------------------------
# Each mutation is a plausible slip (file under csrc/cuda/transport, exact text,
# replacement) and the scenario that must then fail (wrong bytes, a wrong error, a
# timeout, an emulation fault); optionally the only kernel files to rebuild (a header slip
# in code only they use). The scenarios run with short timeouts.
MUTATIONS = [
    # dispatch rows stored in the other parity's slots than the receiver reads
    (
        "kernels_send.cu",
        ": pull::send_slot(k, kDispatchRegion, static_cast<int>(t.parity), d, j);",
        ": pull::send_slot(k, kDispatchRegion, static_cast<int>(t.seq & 1u), d, j);",
        "w2_bf16_p2p",
    ),
    # slots of a destination assigned in reverse token order within a block
    (
        "kernels_send.cu",
        "    for (int i = 0; i < ntok; ++i) {\n      if (!((mask[i] >> d) & 1ull)) continue;",
        "    for (int i = ntok - 1; i >= 0; --i) {\n      if (!((mask[i] >> d) & 1ull)) continue;",
        "w2_bf16_p2p",
    ),
    # a row's experts ranked from the top lane down in the ballot
    (
        "kernels_send.cu",
        "const int at = n + __popc(bal & lanemask_lt());",
        "const int at = n + __popc(bal) - 1 - __popc(bal & lanemask_lt());",
        "w2_bf16_p2p",
    ),
    # a block's rows laid out in planner order all start at row 0 (they overwrite each other)
    ("kernels_send.cu", "      first_row[d] = r;", "      first_row[d] = 0;", "w4_fp16_mixed_reversed"),
    # the per-block counts of earlier tokens are not zeroed (shared memory starts as garbage)
    ("kernels_send.cu", "  for (int d = tid; d < W; d += blockDim.x) base[d] = 0;\n", "", "w2_bf16_p2p"),
    # fp8: the group's |max| of one lane instead of the warp's (the per-warp quantiser)
    (
        "kernels_send.cu",
        "const float amax = bits_float(__reduce_max_sync(kFull, m));",
        "const float amax = bits_float(m);",
        "w2_fp8_staged_raw",
    ),
    # a staged row's arrival mark with the wrong call: the receiver must wait for the mark
    (
        "kernels_send.cu",
        "(static_cast<uint64_t>(t.seq) << 32) | static_cast<uint32_t>(k.rank));",
        "(static_cast<uint64_t>(t.seq + 1) << 32) | static_cast<uint32_t>(k.rank));",
        "w2_fp8_staged_raw",
    ),
    # ---- staged progress (staged_progress.cuh), against the slow, partial staged sender
    # the expert-major receive waits for a staged source's flag again (the old way)
    (
        "staged_progress.cuh",
        "return staged_from(k, s) && k.num_local_experts <= kEarlyMaxExperts;",
        "return false;",
        "w2_staged_drain_gate",
        ("kernels_recv.cu",),
    ),
    # combine: a staged source's poller waits for its flag before the tokens (the old way)
    (
        "kernels_combine.cu",
        "if (threadIdx.x == 0 && !staged_from(k, static_cast<int>(item))) {",
        "if (threadIdx.x == 0) {",
        "w2_staged_drain_gate",
    ),
    # a staged dispatch row's arrival mark stored before its experts, weights and payload
    (
        "kernels_send.cu",
        "    for (int q = lane; q < kvec; q += 32) {\n      reinterpret_cast<int4*>(slot + k.slot.experts_off)",
        "    if (drain && lane == 0)\n      st_release_sys(reinterpret_cast<uint64_t*>(slot + 8),\n"
        "                     (static_cast<uint64_t>(t.seq) << 32) | static_cast<uint32_t>(k.rank));\n"
        "    for (int q = lane; q < kvec; q += 32) {\n      reinterpret_cast<int4*>(slot + k.slot.experts_off)",
        "w2_staged_drain_gate",
    ),
    # a combine chunk's mark stored before the chunk's rows
    (
        "kernels_combine.cu",
        "  const int j1 = min((static_cast<int>(blockIdx.y) + 1) * kRowsPerBlock, n);\n"
        "  for (int j = blockIdx.y * kRowsPerBlock + warp; j < j1; j += kWarps) {\n"
        "    uint4* dst = reinterpret_cast<uint4*>(\n        pull::send_slot(",
        "  const int j1 = min((static_cast<int>(blockIdx.y) + 1) * kRowsPerBlock, n);\n"
        "  publish_chunk_mark(k, t, s, static_cast<int>(blockIdx.y),\n"
        "                     j1 - static_cast<int>(blockIdx.y) * kRowsPerBlock);\n"
        "  for (int j = blockIdx.y * kRowsPerBlock + warp; j < j1; j += kWarps) {\n"
        "    uint4* dst = reinterpret_cast<uint4*>(\n        pull::send_slot(",
        "w2_staged_drain_gate",
    ),
    # expert-major: a row read while its mark still holds the previous call of its parity
    (
        "staged_progress.cuh",
        "while ((ld_acquire_sys(mark) >> 32) != t.seq) {",
        "while ((ld_acquire_sys(mark) >> 32) + 2 < t.seq) {",
        "w2_staged_drain_gate",
        ("kernels_recv.cu",),
    ),
    # the early count line taken without checking that it holds this call
    (
        "staged_progress.cuh",
        "      const uint64_t w = ld_acquire_sys(&line->word);\n      if (flag_seq(w) == t.seq) {",
        "      const uint64_t w = ld_acquire_sys(&line->word);\n      if (flag_seq(w) != 0) {",
        "w2_staged_drain_gate",
        ("kernels_recv.cu",),
    ),
    # the expert-major warp scan adds every shuffled value (lanes below the offset too)
    ("kernel_common.cuh", "if (lane >= o) incl += v;", "incl += v;", "w1_bf16"),
    # expert-major: a source's rows placed after its own rows instead of the earlier sources'
    (
        "kernels_recv.cu",
        "for (int r = 0; r < s; ++r) b += __ldcg(cnt_ws + e * W + r);",
        "for (int r = 0; r <= s; ++r) b += __ldcg(cnt_ws + e * W + r);",
        "w3_abort_silent_peer",
    ),
    # expert-major: src_info's -1 padding starts one row late
    (
        "kernels_recv.cu",
        "for (int64_t p = sum + lane; p < cap; p += 32)",
        "for (int64_t p = sum + 1 + lane; p < cap; p += 32)",
        "w1_bf16",
    ),
    # fp8 dequantisation with the scale of the wrong 128-channel group
    (
        "kernels_recv.cu",
        "dequant16<kDT>(q[v], sc[(v * 16) / kFp8GroupSize], o, o + 1);",
        "dequant16<kDT>(q[v], sc[v / kFp8GroupSize], o, o + 1);",
        "w2_fp8_staged_raw",
    ),
    # low-latency rows past a source's count are left unmarked
    (
        "kernels_recv.cu",
        "const int j1 = min(j0 + kRowsPerBlock, wait ? M : n);",
        "const int j1 = min(j0 + kRowsPerBlock, n);",
        "w2_bf16_p2p",
    ),
    # the poller mirrors the flag under another call number: the other items never see it
    (
        "kernels_recv.cu",
        "  publish_mirror(k.state, s, t.seq, n);\n}",
        "  publish_mirror(k.state, s, t.seq - 1, n);\n}",
        "w2_bf16_p2p",
    ),
    # the fused expert-major pre-reduction forgets the routing weight
    (
        "kernels_combine.cu",
        "acc[i] = __fadd_rn(acc[i], __fmul_rn(w, f[i]));",
        "acc[i] = __fadd_rn(acc[i], f[i]);",
        "w1_bf16",
    ),
    # the copy engine's fallback flag kernel announces the wrong count
    (
        "kernels_send.cu",
        "st_release_sys(&f->word, pack_flag(seq, count));",
        "st_release_sys(&f->word, pack_flag(seq, count + 1));",
        "w2_ce_flag_kernel",
    ),
    # combine_recv no longer checks a source's row count against what it sent there
    (
        "kernels_combine.cu",
        "wait_flag(f, t, d, M, send_count[d], timeout_ns, k.err)",
        "wait_flag(f, t, d, M, -1, timeout_ns, k.err)",
        "w4_sparse_placement",
    ),
    # the first block to finish publishes the flags instead of the last one
    (
        "kernel_common.cuh",
        "last = atomicAdd(&k.state->arrive[family], 1u) == gridDim.x * gridDim.y - 1;",
        "last = atomicAdd(&k.state->arrive[family], 1u) == 0;",
        "w2_bf16_p2p",
    ),
    # the send kernel begins the call but never advances the call number
    ("kernel_common.cuh", "      st->seq = t.seq;\n", "", "w2_bf16_p2p"),
    # the receive kernel's last block does not reset the work tickets for the next one
    ("kernel_common.cuh", "    k.state->recv_ticket = 0;\n", "", "w2_bf16_p2p"),
    # the expert counts are moved out but not zeroed for the next unpack
    (
        "kernel_common.cuh",
        "expert_count[e] = atomicExch(k.ecount + e, 0);",
        "expert_count[e] = k.ecount[e];",
        "w2_bf16_p2p",
    ),
    # a token's repeated expert is not detected (sent twice, not reported)
    (
        "kernel_common.cuh",
        "  for (int q = 0; q < kk; ++q)\n    if (load_id(ids, ids64, row + q) == e) {",
        "  for (int q = 0; q < 0; ++q)\n    if (load_id(ids, ids64, row + q) == e) {",
        "w2_ids64_bad_ids",
    ),
    # int64 ids read as int32
    (
        "kernel_common.cuh",
        "  return ids64 ? static_cast<const int64_t*>(ids)[i]",
        "  return ids64 ? static_cast<const int32_t*>(ids)[i]",
        "w2_ids64_bad_ids",
    ),
    # the bootstrap probe writes the pattern of the other direction
    (
        "kernels_control.cu",
        "*reinterpret_cast<uint4*>(line) = probe_pattern(k.rank, d, nonce);",
        "*reinterpret_cast<uint4*>(line) = probe_pattern(d, k.rank, nonce);",
        "w2_bf16_p2p",
    ),
    # the close mark lands in another source's line: a peer would free too early or never
    (
        "kernels_control.cu",
        "k.peers->send_base[d] + kCloseLineOff + static_cast<size_t>(k.rank) * kCloseLineBytes;",
        "k.peers->send_base[d] + kCloseLineOff + static_cast<size_t>(d) * kCloseLineBytes;",
        "w2_bf16_p2p",
    ),
    # an abort recorded first hides a peer that never came
    (
        "device_protocol.cuh",
        "if (old == 0 || (error_is_mild(error_code(old)) && !error_is_mild(code)))",
        "if (old == 0)",
        "w3_abort_silent_peer",
    ),
    # every receive block waits out its own full timeout after the first one expired
    ("device_protocol.cuh", "      if (timed_out_elsewhere(err)) return false;\n", "",
     "w8_only_rank0_calls"),
    # a timeout is not echoed into this GPU's memory: the other waiters, which poll the echo
    # and not the host-mapped word, each wait out their own timeout
    ("device_protocol.cuh",
     "    if (is_timeout(code)) *reinterpret_cast<volatile uint32_t*>(err.timed_out) = 1u;\n",
     "", "w8_only_rank0_calls"),
    # the warp hand-off of a staged row mark / combine chunk marks without the __syncwarp:
    # the other lanes read the rows after only a shuffle / ballot (no ordering in PTX; the
    # model's lane views poison a row from its mark's acquire until a memory barrier)
    ("kernels_recv.cu", "  __syncwarp();  // lane 0's acquire -> every lane's reads of the row\n", "",
     "w2_fp8_staged_raw"),
    ("staged_progress.cuh",
     "  __syncwarp();  // each lane's acquires -> every lane's reads of the partials\n", "",
     "w2_fp8_staged_raw", ("kernels_combine.cu",)),
    # a spinning receive kernel triggers its dependents at entry, before its waits (the
    # model fails a flag wait after the trigger in the same block)
    ("kernels_recv.cu", "  griddep_wait();\n  __shared__ int32_t n_sh;\n",
     "  griddep_wait();\n  griddep_launch_dependents();\n  __shared__ int32_t n_sh;\n",
     "w2_bf16_p2p"),
    ("kernels_combine.cu", "  griddep_wait();\n  __shared__ int fail;\n",
     "  griddep_wait();\n  griddep_launch_dependents();\n  __shared__ int fail;\n", "w2_bf16_p2p"),
    # host: a staged sender's rows are looked for in the receiver's device segment
    (
        "cuda_transport.cu",
        "table_.recv_base[r] = r != rank_ && staged_in ? host_seg_dev_ : dev_seg_;",
        "table_.recv_base[r] = dev_seg_;",
        "w2_fp8_staged_raw",
    ),
    # host: in one process, a staged pair writes the peer's device segment
    (
        "cuda_transport.cu",
        "      table_.send_base[r] = p->host_seg_dev_;",
        "      table_.send_base[r] = p->dev_seg_;",
        "w2_inprocess_staged_fp8",
    ),
    # host: close() frees its segment without waiting for the peers' close marks
    ("cuda_transport.cu", "  bool all = close_marks_arrived(&missing);", "  bool all = true;",
     "w3_exit_without_close"),
    # host: the replica choice table is not handed to the kernels (modulo rule instead)
    (
        "cuda_transport.cu",
        "placement_.choice_offset = choice_offset.empty() ? nullptr : placement_dev_ + choice_at;",
        "placement_.choice_offset = nullptr;",
        "w4_choice_table",
    ),
    # host: close() forgets a device buffer (the model lists what a rank still holds)
    ("cuda_transport.cu", "  (void)cudaFree(cnt_ws_);\n", "", "w1_bf16"),
    # host: the copy-engine transfer lands in the other parity's slots
    (
        "cuda_transport.cu",
        "layout_.dispatch_off + slot_offset(config_, static_cast<int>(t.parity), rank_, 0, slot);",
        "layout_.dispatch_off + slot_offset(config_, 1 - static_cast<int>(t.parity), rank_, 0, slot);",
        "w4_bf16_ce_all_staged",
    ),
    # pull (a): a wrong consumed epoch: the sender checks the consumed flag for the call
    # before the one that last used the parity, so it reuses the slots (and the ready flag's
    # line) while a slow reader has not read them. (A reader storing seq - 1 is no such slip:
    # consumed only grows, and the reader's next call of the region, which it reads before
    # the sender can reuse the parity, stores a value past the guard.)
    ("pull.cuh", "k.state->staged_seq[region][t.parity] = t.seq;",
     "k.state->staged_seq[region][t.parity] = t.seq - 1;", "w2_pull_two_in_flight_slow"),
    # pull: the combine receive marks the dispatch region consumed: the combine's pulled
    # slots are never handed back, and the sender times out naming the reader
    ("kernels_combine.cu", "  finish_recv(k, nullptr, t, kCombineRegion);",
     "  finish_recv(k, nullptr, t, kDispatchRegion);", "w2_pull_all"),
    # pull (b): the receiver skips the ready-flag acquire of a pulled pair and loads the rows
    # (and the count) that are there: a slow sender's previous call, or nothing
    (
        "kernels_recv.cu",
        "    n = wait_flag(f, t, s, k.cfg.max_tokens, -1, timeout_ns, k.err);\n    counts[s]",
        "    n = pull::pulls_from(k, s) ? static_cast<int32_t>(flag_count(ld_acquire_sys(&f->word)))"
        " : wait_flag(f, t, s, k.cfg.max_tokens, -1, timeout_ns, k.err);\n    counts[s]",
        "w2_pull_two_in_flight_slow",
    ),
    # pull (c): the sender reuses a parity without waiting for the reader's consumed flag: it
    # overwrites the rows (and the ready flag) a slow reader has not read yet
    ("pull.cuh", "  const uint32_t need = k.state->staged_seq[region][t.parity];",
     "  const uint32_t need = 0;", "w2_pull_two_in_flight_slow"),
    # pull: the receive side reads a pulled source's rows from its own receive slots
    ("pull.cuh", "  if (pulls_from(k, s)) {\n    const size_t off",
     "  if (false) {\n    const size_t off", "w4_fp8_pull_mixed"),
    # pull, host: the copy engine also serves a pulled destination (pushes into its memory)
    ("cuda_transport.cu", "    if ((table_.pull_send >> d) & 1ull) continue;  // d pulls: the rows stay here\n",
     "", "w4_ce_pull_mixed"),
    # host: the copy engine's flag (a stream memory operation) announces the wrong count
    (
        "cuda_transport.cu",
        "write64_(s, addr + offsetof(FlagLine, word), pack_flag(t.seq, count), 0) == 0)",
        "write64_(s, addr + offsetof(FlagLine, word), pack_flag(t.seq, count + 1), 0) == 0)",
        "w4_bf16_ce_all_staged",
    ),
]  # fmt: skip

_BY_NAME = {s.name: s for s in SCENARIOS}


def _mutant(base: Path, tmp: Path, n: int, mutations=MUTATIONS, fast: bool = True) -> Path:
    fname, old, new = mutations[n][:3]
    tree = tmp / f"m{n}" / "csrc"
    for sub in ("core", "cuda/common", "cuda/transport"):
        shutil.copytree(CSRC / sub, tree / sub)
    mutate(tree / "cuda" / "transport" / fname, old, new, f"mutation {n}")
    rebuild = {
        "kernel_common.cuh": KERNEL_FILES,
        "staged_progress.cuh": KERNEL_FILES[:3],
        "device_protocol.cuh": (*KERNEL_FILES, "cuda_transport.cu"),
        "pull.cuh": KERNEL_FILES,
    }.get(fname, (fname,))
    if len(mutations[n]) > 4:  # a header slip in code only these kernel files use
        rebuild = mutations[n][4]
    return build_emulator(tmp / f"m{n}" / "build", tree, base=base, rebuild=rebuild, fast=fast)


def test_emulation_catches_mutations(emulator, tmp_path):
    """Build the emulator against mutated copies of the sources: every one must fail."""
    base = emulator.parent

    def check(n: int, binary: Path) -> None:
        sc = dataclasses.replace(_BY_NAME[MUTATIONS[n][3]], timeout_ms=2000, close_ms=2000)
        d = tmp_path / f"m{n}" / "run"
        run_scenario(binary, sc, d)
        check_scenario(sc, d)

    missed = missed_mutations(
        MUTATIONS, lambda n: _mutant(base, tmp_path, n), check, (AssertionError, EmulatorError)
    )
    assert not missed, "mutations the emulation did not detect:\n" + "\n".join(missed)


# Faults the hardware would raise (or silently corrupt memory with) and the model's
# sanitizers report: (file, text, replacement, scenario, what the report must say).
FAULTS = [
    # a row header stored 4 bytes off its 16-byte slot alignment (a misaligned vector store)
    (
        "kernels_send.cu",
        "*reinterpret_cast<int4*>(slot) = make_int4(tok, n, k.rank, static_cast<int>(t.seq));",
        "*reinterpret_cast<int4*>(slot + 4) = make_int4(tok, n, k.rank, static_cast<int>(t.seq));",
        "w2_bf16_p2p",
        "misaligned address",
    ),
    # one element past an output buffer (ASan: the arena outside live allocations)
    (
        "kernels_recv.cu",
        "        if (lane == 0) src_rank[i] = src_token[i] = -1;\n",
        "        if (lane == 0) src_rank[i] = src_token[i + 1] = -1;\n",
        "w2_bf16_p2p",
        "AddressSanitizer",
    ),
]  # fmt: skip


def test_sanitizers_report_faults(emulator, tmp_path):
    """Misaligned vector accesses and out-of-bounds device accesses are reported."""
    base = emulator.parent
    if not (base / "sanitized").exists():
        pytest.skip("the host compiler cannot build with AddressSanitizer/UBSan")
    mutations = [f[:4] for f in FAULTS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        binaries = list(
            pool.map(lambda n: _mutant(base, tmp_path, n, mutations, False), range(len(FAULTS)))
        )
    for n, ((*_, name, report), binary) in enumerate(zip(FAULTS, binaries)):
        with pytest.raises(EmulatorError, match=report):
            run_scenario(binary, _BY_NAME[name], tmp_path / f"m{n}" / "run")


def test_emulated_sources_are_the_transport():
    """The emulation replaces common/ptx.cuh and launch.cuh only: no inline PTX in
    csrc/cuda/transport, no chevron launch outside launch.cuh, and the stand-ins define the
    functions the real headers do."""
    for path in (CSRC / "cuda" / "transport").iterdir():
        text = path.read_text()
        assert not re.search(r"\basm\b", text), f"{path.name} has inline PTX outside common/ptx.cuh"
        if path.name != "launch.cuh":
            assert "<<<" not in text, f"{path.name} launches a kernel outside launch.cuh"
    launch = ("cuda", "transport", "launch.cuh")
    for real, emu, fns in (
        (CSRC / "cuda" / "common" / "ptx.cuh", PTX_MODEL,
         ("ld_acquire_sys", "ld_relaxed_sys", "st_release_sys", "st_relaxed_sys",
          "ld_acquire_gpu", "st_release_gpu", "griddep_wait", "griddep_launch_dependents",
          "fence_acq_rel_sys", "globaltimer_ns", "lanemask_lt", "dynamic_smem")),
        (CSRC.joinpath(*launch), EMU.joinpath("override", *launch), ("launch_kernel",)),
    ):  # fmt: skip
        real_text, emu_text = real.read_text(), emu.read_text()
        for fn in fns:
            assert re.search(rf"\b{fn}\(", real_text) and re.search(rf"\b{fn}\(", emu_text), (
                real.name,
                fn,
            )


def test_every_kernel_is_loaded_at_construction():
    """load_transport_kernels() names every __global__ kernel of the transport (each template
    instance), so lazy loading never happens in the middle of a call; the emulated runtime
    also refuses to launch a kernel that was not loaded first."""
    loaded = set()
    for f in KERNEL_FILES:
        text = (CSRC / "cuda" / "transport" / f).read_text()
        kernel = r"__global__ void(?: __launch_bounds__\(\w+\))?\s+(\w+)\("
        kernels = re.findall(kernel, text)
        templated = set(re.findall(r"template <[^>]*>\s*" + kernel, text))
        loads = re.findall(r"PA2A_LOAD\(\(?(\w+)(<[^)]*>)?\)?\)", text)
        names = {n for n, _ in loads}
        loaded |= names
        for k in kernels:
            assert k in names, f"{f}: kernel {k} is not in its load list"
        for k in templated:  # four instances (dtype x fp8) or two (dtype)
            instances = [a for n, a in loads if n == k]
            assert len(instances) in (2, 4) and len(set(instances)) == len(instances), (f, k)
    assert loaded, "no PA2A_LOAD lines found"


def test_cuda_host_segment_says_dev_shm_is_too_small(emulator, tmp_path):
    """A staged receiver's host segment that does not fit in /dev/shm: an error naming it
    and the flags, from the real host code, not a SIGBUS (a small private /dev/shm)."""
    from test_shm_space import in_small_shm

    sc = dataclasses.replace(_BY_NAME["w2_fp8_staged_raw"], steps=())
    sc = dataclasses.replace(sc, case=dataclasses.replace(sc.case, hidden=1024, max_tokens=256))
    d = tmp_path / "run"
    d.mkdir()
    write_scenario(sc, d)
    run = f"import subprocess, sys; sys.exit(subprocess.run([{str(emulator)!r}, {str(d)!r}]).returncode)"
    r = in_small_shm(run, size="2m")
    assert r.returncode == 1, f"exit {r.returncode} (135: SIGBUS)\n{r.stderr[-3000:]}"
    assert "/dev/shm is too small" in r.stderr and "--shm-size=" in r.stderr, r.stderr[-3000:]
    assert "the shared-memory segment /pcie_a2a." in r.stderr, r.stderr[-3000:]


def test_gpu_without_host_registration_is_refused_clearly(emulator, tmp_path):
    """cudaDevAttrHostRegisterSupported = 0 on a rank that needs staging memory: an error
    naming the attribute and what to do, at construction, not a failed call later."""
    sc = dataclasses.replace(_BY_NAME["w2_fp8_staged_raw"], steps=(),
                             env=(("EMU_NO_HOST_REGISTER", "1"),))  # fmt: skip
    with pytest.raises(EmulatorError, match=r"cudaDevAttrHostRegisterSupported = 0\), which the "
                       r"host-staged pairs of this plan need"):  # fmt: skip
        run_scenario(emulator, sc, tmp_path / "run")
