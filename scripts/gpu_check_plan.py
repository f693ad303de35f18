"""The plan of scripts/gpu_check.sh: its steps, their budgets, the settings that change
them, and facts about the source tree the steps need (see gpu_check.py).

A step's ``cap`` is the seconds planned for it; the caps of the steps a one-GPU machine
runs (not the optional ones: the benchmarks, in time left over) plus RESERVE_S must fit
BUDGET_S, which ``--plan`` checks (and a test asserts, so an added step cannot overrun). ``min_s``: a step
is not started with less. Steps of one ``group`` (serial pytest steps) run in one pytest
process: one torch import and one CUDA context for all of them, a row each.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 480
RESERVE_S = 10  # kept back for the last report and packing

TRANSPORT = "tests/test_cuda_transport.py"
INPROCESS = "tests/test_cuda_inprocess.py"
STRESS = "tests/test_cuda_stress.py"
INT4 = "tests/test_moe_int4_gpu.py"
ALLREDUCE = "tests/test_allreduce_gpu.py"
OWN_STEP_FILES = (TRANSPORT, INPROCESS, STRESS, INT4, ALLREDUCE)
CUDA = ("_transport", "_cuda", "_cuda_transport")
INT4_MODULES = ("_transport", "_moe_int4")
ALLREDUCE_MODULES = ("_allreduce", "_allreduce_cuda")

# Tier 1 (issue 10): normal bf16 and fp8, LL rows and expert-major, staged, copy engine,
# mixed pairs, graph replay, silent rank. Names or parameter ids (gpu_check_pytest.py);
# tests marked @pytest.mark.smoke in any GPU test file join them.
SMOKE_TESTS = (
    "normal_bf16_2",
    "normal_fp8_2",
    "ll_rows_bf16_4",
    "ll_em_bf16_2",
    "staged_normal_2",
    "ce_all_normal_bf16_2",
    "mixed_ll_rows_4",
    "test_cuda_graph_replay_with_new_inputs",
    "test_rank_that_never_calls_raises_not_hangs",
)


@dataclass(frozen=True)
class Step:
    name: str
    cap: int  # planned seconds
    min_s: int  # not started with less
    what: str
    kind: str = "cmd"  # preflight | build | pytest | cmd
    gpu: bool = True  # skipped when the preflight found no GPU
    min_gpus: int = 1
    modules: tuple[str, ...] = ()  # pcie_a2a extension modules it imports
    files: tuple[str, ...] = ()  # this check's own files: FAIL if absent
    expect: tuple[str, ...] = ()  # other work's files: a "missing" row while absent
    optional: bool = False  # only in time left over; not in the plan's total
    marker: str = "gpu"  # pytest -m
    per_test_s: int = 60  # pytest-timeout per test, when installed
    workers: int = 1  # pytest-xdist workers, when installed
    serial_k: str = ""  # -k of the tests run afterwards, one at a time
    smoke: bool = False  # pass SMOKE_TESTS to the plugin
    collect: str = ""  # "": files + expect; "gpu_all" / "gpu_other": discovered files
    group: str = ""  # consecutive pytest steps of one group share one pytest process


STEPS = (
    Step("preflight", 45, 40, "host (cores, /dev/shm, ulimit -l, NUMA), nvidia-smi (driver, "
         "compute mode, PCIe link, BAR1), MPS, nvcc, torch, build tools; IPC and "
         "cudaHostRegister smokes (torch only, imported once; the IPC child gets 30 s)",
         kind="preflight", gpu=False),
    Step("build", 110, 45, "scripts/dev_build.sh <every csrc/bindings module> for the GPU's "
         "compute capability, -j nproc, each module on its own (or GPU_CHECK_PREBUILT)",
         kind="build", gpu=False),
    Step("transport_smoke", 60, 20, "tier 1, 2 at a time: -m 'gpu and smoke' over the GPU "
         "test files (SMOKE_TESTS by name, and every test marked smoke)", kind="pytest",
         modules=CUDA, files=(TRANSPORT,), marker="gpu and smoke", per_test_s=45, workers=2,
         smoke=True, collect="gpu_all"),
    Step("transport_rest", 65, 20, f"tier 2: the rest of {TRANSPORT} (4 at a time with "
         "pytest-xdist); the leak tests alone, after", kind="pytest", modules=CUDA,
         files=(TRANSPORT,), marker="gpu and not smoke", workers=4, serial_k="leak",
         smoke=True),
    Step("stress", 30, 15, f"{STRESS}: 200 LL dispatch+combine calls, fresh data each step, "
         "IPC and staged (PCIE_A2A_P2P=0) pairs", kind="pytest", modules=CUDA, files=(STRESS,),
         marker="gpu and not smoke", smoke=True, group="serial"),
    Step("inprocess", 23, 10, f"{INPROCESS}: W transports in one process (real concurrency "
         "on one GPU)", kind="pytest", modules=CUDA, expect=(INPROCESS,),
         marker="gpu and not smoke", smoke=True, group="serial"),
    Step("allreduce", 35, 10, f"{ALLREDUCE}: AllReduce(backend='cuda'), eager and CUDA graph "
         "replay, worlds 2 and 4 on one GPU, bit for bit", kind="pytest",
         modules=ALLREDUCE_MODULES, files=(ALLREDUCE,), marker="gpu and not smoke",
         per_test_s=90, smoke=True, group="serial"),
    Step("gpu_other", 55, 20, "every other file with GPU tests (Buffer backend='cuda', "
         "bench --backend cuda, ...), 3 at a time", kind="pytest", modules=CUDA,
         marker="gpu and not smoke", per_test_s=120, workers=3, smoke=True, collect="gpu_other"),
    Step("int4", 30, 10, f"{INT4}: the INT4 MoE GEMM against the CPU reference",
         kind="pytest", modules=INT4_MODULES, expect=(INT4,), workers=4),
    Step("topo", 8, 4, "pcie-a2a topo on the live machine (+ --probe with >= 2 GPUs)",
         modules=("_transport",)),
    # Benchmarks: optional, in the time the steps above left over; what does not get to run
    # is in the continue command. A wrong result in one is still a FAIL.
    Step("bench_allreduce", 30, 10, "benchmarks/bench_allreduce_one_gpu.py --quick: the "
         "all-reduce kernels, worlds 2 and 8 on one GPU in one CUDA graph, every replay "
         "checked bit for bit (kernel cost, not PCIe)", modules=ALLREDUCE_MODULES,
         expect=("benchmarks/bench_allreduce_one_gpu.py",), optional=True),
    Step("bench_one_gpu", 70, 25, "benchmarks/bench_cuda_one_gpu.py --worlds 1,2,4 (worlds 2, "
         "4 time-slice one GPU: correctness, not speed)", modules=CUDA,
         expect=("benchmarks/bench_cuda_one_gpu.py",), optional=True),
    Step("bench_moe_gemm", 45, 15, "benchmarks/bench_moe_gemm.py --model kimi-k2 --quick "
         "--check", modules=INT4_MODULES, expect=("benchmarks/bench_moe_gemm.py",),
         optional=True),
    Step("kernels", 30, 10, "scripts/gpu_kernel_breakdown.py: world 1, per-kernel device time, "
         "launches and host copies per call", modules=CUDA,
         files=("scripts/gpu_kernel_breakdown.py",), optional=True),
    Step("bench_nccl", 90, 30, "pcie-a2a bench --backend cuda vs NCCL (all_to_all_single, "
         "all-gather + reduce-scatter, NCCL EP when nccl4py has it), one rank per GPU",
         modules=CUDA, min_gpus=2, optional=True),
    Step("sanitizer", 60, 20, "compute-sanitizer memcheck: world-1 transport calls "
         "(gpu_kernel_breakdown.py --small) and one INT4 case", modules=(*CUDA, "_moe_int4"),
         optional=True),
)  # fmt: skip
STEP_NAMES = tuple(s.name for s in STEPS)
ALWAYS = ("preflight", "build")


# ---- configuration ---------------------------------------------------------------------
class ConfigError(ValueError):
    pass


def names(var: str) -> set[str]:
    names = {n.strip() for n in os.environ.get(var, "").split(",") if n.strip()}
    bad = names - set(STEP_NAMES)
    if bad:
        raise ConfigError(f"{var}: unknown step(s) {sorted(bad)}; steps: {', '.join(STEP_NAMES)}")
    return names


def budget_s() -> float:
    text = os.environ.get("BUDGET_S", "").strip() or str(DEFAULT_BUDGET_S)
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"BUDGET_S={text!r}: expected seconds") from None
    if value <= 0:
        raise ConfigError(f"BUDGET_S={text!r}: expected a positive number of seconds")
    return value


def time_scale() -> float:
    """GPU_CHECK_TIME_SCALE (CPU tests only): every cap, minimum and the reserve times it."""
    text = os.environ.get("GPU_CHECK_TIME_SCALE", "").strip() or "1"
    try:
        scale = float(text)
    except ValueError:
        scale = -1.0
    if not scale > 0:
        raise ConfigError(f"GPU_CHECK_TIME_SCALE={text!r}: expected a positive number")
    return scale


def reserve_s() -> float:
    return RESERVE_S * time_scale()


def configured_steps() -> list[Step]:
    """STEPS with GPU_CHECK_CAPS and GPU_CHECK_TIME_SCALE applied."""
    scale = time_scale()
    caps: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in os.environ.get("GPU_CHECK_CAPS", "").split(","))):
        name, _, value = item.partition("=")
        if name not in STEP_NAMES:
            raise ConfigError(
                f"GPU_CHECK_CAPS: unknown step {name!r}; steps: {', '.join(STEP_NAMES)}"
            )
        try:
            caps[name] = float(value)
        except ValueError:
            raise ConfigError(f"GPU_CHECK_CAPS: {item!r}: expected step=seconds") from None
    out = []
    for s in STEPS:
        cap = caps.get(s.name, s.cap * scale)
        out.append(replace(s, cap=cap, min_s=min(cap, s.min_s * scale)))
    return out


def selected(step: Step, only: set[str], skip: set[str]) -> bool:
    if step.name in skip:
        return False
    return not only or step.name in only or step.name in ALWAYS


# ---- the plan ----------------------------------------------------------------------------
def plan(steps: list[Step], budget: float, only: set[str], skip: set[str], gpus: int = 1):
    rows, total = [], 0.0
    for s in steps:
        runs = selected(s, only, skip) and s.min_gpus <= gpus
        counted = runs and not s.optional
        total += s.cap if counted else 0
        rows.append({"name": s.name, "cap_s": s.cap, "min_s": s.min_s, "optional": s.optional,
                     "min_gpus": s.min_gpus, "selected": selected(s, only, skip),
                     "counted": counted, "what": s.what})  # fmt: skip
    return rows, total, total + reserve_s() <= budget


def print_plan(steps, budget, only, skip) -> bool:
    rows, total, fits = plan(steps, budget, only, skip)
    reserve = reserve_s()
    print(
        f"gpu_check plan for one GPU: BUDGET_S={budget:g} (of it {reserve:g} s kept for the report)"
    )
    print(f"{'#':>2}  {'step':<16} {'cap s':>5} {'min s':>5}  {'when':<10} what")
    for i, r in enumerate(rows, 1):
        when = ("not run" if not r["selected"] else "spare time" if r["optional"]
                else f">={r['min_gpus']} GPUs" if r["min_gpus"] > 1 else "always")  # fmt: skip
        print(
            f"{i:>2}  {r['name']:<16} {r['cap_s']:>5.0f} {r['min_s']:>5.0f}  {when:<10} {r['what']}"
        )
    slack = budget - reserve - total
    verdict = "fits" if fits else "DOES NOT FIT"
    print(f"    total {total:.0f} s + {reserve:g} s reserve = {total + reserve:.0f} s of "
          f"{budget:g} s: {verdict} ({slack:+.0f} s)")  # fmt: skip
    print(f"    smoke tier names: {', '.join(SMOKE_TESTS)}")
    return fits


# ---- facts about the tree ------------------------------------------------------------------
def binding_modules(root: Path = ROOT) -> list[str]:
    """The CMake module targets (CMakeLists.txt: one per csrc/bindings/*.cpp or *.cu)."""
    stems = {
        p.stem for p in (root / "csrc" / "bindings").glob("*.c*") if p.suffix in (".cpp", ".cu")
    }
    return sorted(f"_{s}" for s in stems)


def source_hash(root: Path, parts=("csrc", "CMakeLists.txt")) -> str:
    h = hashlib.sha256()
    for part in parts:
        base = root / part
        files = sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else [base]
        for p in files:
            if p.exists() and "__pycache__" not in p.parts and p.suffix not in (".so", ".pyc"):
                h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def tree_hash(root: Path = ROOT) -> str:
    return source_hash(root, ("csrc", "python", "tests", "scripts", "benchmarks", "CMakeLists.txt"))


def commit(root: Path = ROOT) -> str:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)  # fmt: skip
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
            return out.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "no git"


def discover_gpu_files(root: Path = ROOT) -> list[str]:
    """Test files with GPU tests (they say ``mark.gpu``), relative to root."""
    found = []
    for p in sorted((root / "tests").rglob("test_*.py")):
        try:
            if "mark.gpu" in p.read_text(errors="replace"):
                found.append(p.relative_to(root).as_posix())
        except OSError:
            continue
    return found


def installed_package() -> Path | None:
    """The folder of an installed pcie_a2a (pip), found without importing it."""
    spec = importlib.util.find_spec("pcie_a2a")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def use_source_tree() -> bool:
    """Run against python/ (what scripts/dev_build.sh and the build step fill) unless a
    pcie_a2a is installed and the source tree has no built module (CI: pip install .)."""
    built = any((ROOT / "python" / "pcie_a2a").glob("_transport*.so"))
    return built or installed_package() is None


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
