#!/usr/bin/env python3
"""SASS report of the INT4 MoE GEMM: per instantiation and architecture, the instructions
per 64-deep k-tile of the main loop, registers, spills and occupancy.

Reads compiled code only (no GPU): the built ``_moe_int4`` extension (its sm_90/sm_120
cubins, as CI builds it) and/or cubins it compiles itself from csrc/cuda/moe_int4/gen/*.cu
for other architectures (``--arch sm_89``; needs nvcc). Disassembly uses ``cuobjdump``
from the CUDA toolkit or the ``nvidia-cuda-cuobjdump`` wheel.

How the main loop is found: the innermost backward branch whose body holds mma
instructions (HMMA); per k-tile = its instruction count (NOPs excluded) scaled by
(HMMA per k-tile) / (HMMA in the body), so an unrolled loop counts right. The count is
static: both sides of a branch inside the body count, so it is an upper bound of what a
warp issues. A loop nested inside the main loop is reported (its trip count is unknown).

    python scripts/sass_report.py [--so PATH] [--arch sm_89 ...] [--check] [--budget 600]

``--check`` exits 1 when an instantiation's loop exceeds the budget, has a nested loop,
spills (local memory or STL/LDL), or when no main loop is found.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 600


def _grid_model():
    """python/pcie_a2a/quant/grid_model.py, loaded by path (no package import, no torch)."""
    path = ROOT / "python" / "pcie_a2a" / "quant" / "grid_model.py"
    spec = importlib.util.spec_from_file_location("_pa2a_grid_model", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


GM = _grid_model()


def find_tool(name: str, given: str | None = None) -> str | None:
    """`name` from --flag, PATH, the CUDA toolkit, or the nvidia-cuda-* wheels."""
    if given:
        return given
    hit = shutil.which(name)
    if hit:
        return hit
    for d in ("/usr/local/cuda/bin",):
        if (Path(d) / name).is_file():
            return str(Path(d) / name)
    spec = importlib.util.find_spec("nvidia")
    for base in spec.submodule_search_locations if spec else []:
        for cand in sorted(Path(base).glob(f"*/bin/{name}")):
            return str(cand)
    return None


@dataclass
class Function:
    arch: str
    name: str
    instrs: list[tuple[int, str, str]]  # (address, opcode, text)
    regs: int = -1
    local_bytes: int = 0
    stack_bytes: int = 0
    static_smem: int = 0


_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")
_TARGET = re.compile(r"0x([0-9a-f]+)")
# Template arguments <T, kBlockM, kZeros, kGroup32> (the zero-point and group arguments are
# absent in builds from before they existed: reported as "-").
_KERNEL = re.compile(
    r"moe_int4_gemm_kernelI(13__nv_bfloat16|6__half)Li(\d+)E(?:Lb([01])ELb([01])E)?"
)


def parse_sass(text: str) -> list[Function]:
    """Functions of ``cuobjdump -sass`` output, with their architecture."""
    funcs: list[Function] = []
    arch = "?"
    cur: Function | None = None
    for line in text.splitlines():
        s = line.strip()
        m = re.match(r"(?:arch = |code for )(sm_\d+)", s)
        if m:
            arch = m.group(1)
            continue
        if s.startswith("Function : "):
            cur = Function(arch, s.split(":", 1)[1].strip(), [])
            funcs.append(cur)
            continue
        m = _ADDR.search(line)
        if m and cur is not None:
            body = _PRED.sub("", m.group(2))
            op = body.split()[0] if body else ""
            cur.instrs.append((int(m.group(1), 16), op, body))
    return funcs


def parse_res_usage(text: str, funcs: list[Function]) -> None:
    """REG / LOCAL / STACK / SHARED of ``cuobjdump -res-usage`` into the functions."""
    by_name = {f.name: f for f in funcs}
    name = None
    for line in text.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and name in by_name:
            f = by_name[name]
            f.regs, f.stack_bytes, f.static_smem, f.local_bytes = (int(x) for x in m.groups())


@dataclass
class LoopReport:
    found: bool
    instructions: int = 0  # static, NOPs excluded
    hmma: int = 0
    per_k_tile: float = 0.0
    nested_loops: int = 0
    spill_instrs: int = 0  # STL/LDL anywhere in the function


def main_loop(f: Function, hmma_per_k_tile: int) -> LoopReport:
    spills = sum(1 for _, op, _ in f.instrs if op.startswith(("STL", "LDL")))
    loops = []
    for addr, op, body in f.instrs:
        if op.startswith("BRA"):
            t = _TARGET.search(body.split(None, 1)[1] if " " in body else "")
            if t and int(t.group(1), 16) <= addr:
                loops.append((int(t.group(1), 16), addr))
    best = None
    for lo, hi in loops:
        body = [op for a, op, _ in f.instrs if lo <= a <= hi]
        hmma = sum(1 for op in body if op.startswith("HMMA"))
        if hmma == 0:
            continue
        if best is None or hi - lo < best[1] - best[0]:
            best = (lo, hi, body, hmma)
    if best is None:
        return LoopReport(False, spill_instrs=spills)
    lo, hi, body, hmma = best
    n = sum(1 for op in body if not op.startswith("NOP"))
    nested = sum(1 for a, b in loops if lo <= a and b < hi and (a, b) != (lo, hi))
    return LoopReport(True, n, hmma, n * hmma_per_k_tile / hmma, nested, spills)


@dataclass
class Row:
    arch: str
    variant: str
    block_m: int
    regs: int
    spills: int  # local bytes + STL/LDL instructions
    loop: LoopReport
    ctas_per_sm: int
    warps_per_sm: int


def report(funcs: list[Function]) -> list[Row]:
    rows = []
    for f in funcs:
        m = _KERNEL.search(f.name)
        if not m:
            continue
        dtype = "bf16" if "bfloat16" in m.group(1) else "fp16"
        bm = int(m.group(2))
        if m.group(3) is None:
            variant = f"{dtype} m{bm} (any)"
        else:
            zp = "zp" if m.group(3) == "1" else "sym"
            variant = f"{dtype} m{bm} {zp} " + ("g32" if m.group(4) == "1" else "g>=64")
        loop = main_loop(f, GM.HMMA_PER_K_TILE[bm])
        arch = GM.ARCHS.get(f.arch)
        occ = GM.ctas_per_sm(arch, bm, f.regs) if arch and f.regs > 0 else -1
        rows.append(
            Row(
                f.arch,
                variant,
                bm,
                f.regs,
                f.local_bytes + f.stack_bytes + loop.spill_instrs,
                loop,
                occ,
                occ * GM.WARPS,
            )
        )
    rows.sort(key=lambda r: (r.arch, r.variant))
    return rows


def problems(rows: list[Row], budget: int) -> list[str]:
    bad = []
    for r in rows:
        where = f"{r.arch} {r.variant}"
        if not r.loop.found:
            bad.append(f"{where}: no main loop (backward branch around HMMA) found")
            continue
        if r.loop.per_k_tile > budget:
            bad.append(f"{where}: {r.loop.per_k_tile:.0f} instructions per k-tile > {budget}")
        if r.loop.nested_loops:
            bad.append(f"{where}: {r.loop.nested_loops} loop(s) nested in the main loop")
        if r.spills:
            bad.append(f"{where}: spills ({r.spills} bytes/instructions of local memory)")
    return bad


def format_rows(rows: list[Row]) -> str:
    out = [
        f"{'arch':7s} {'instantiation':20s} {'instr/ktile':>11s} {'HMMA':>5s} {'nested':>6s}"
        f" {'regs':>4s} {'spills':>6s} {'CTAs/SM':>7s} {'warps/SM':>8s}"
    ]
    for r in rows:
        lp = r.loop
        out.append(
            f"{r.arch:7s} {r.variant:20s} {lp.per_k_tile:11.0f} {lp.hmma:5d} {lp.nested_loops:6d}"
            f" {r.regs:4d} {r.spills:6d} {r.ctas_per_sm:7d} {r.warps_per_sm:8d}"
        )
    return "\n".join(out)


def _run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed:\n{r.stderr[-3000:]}")
    return r.stdout


def functions_of(binary: Path, cuobjdump: str) -> list[Function]:
    funcs = parse_sass(_run([cuobjdump, "-sass", str(binary)]))
    res = _run([cuobjdump, "-res-usage", str(binary)])
    # -res-usage of a multi-arch file lists each arch's functions under the same names:
    # split it by arch in the same order as the SASS.
    chunks = re.split(r"(?=arch = sm_\d+|code for sm_\d+)", res)
    for chunk in chunks:
        m = re.search(r"(?:arch = |code for )(sm_\d+)", chunk)
        if m:
            parse_res_usage(chunk, [f for f in funcs if f.arch == m.group(1)])
    if not any(f.regs >= 0 for f in funcs):
        parse_res_usage(res, funcs)
    return funcs


def compile_cubins(arch: str, out: Path, nvcc: str, jobs: int, csrc: Path) -> list[Path]:
    """csrc/cuda/moe_int4/gen/*.cu -> one cubin each for `arch` (device code only)."""
    srcs = sorted((csrc / "cuda" / "moe_int4" / "gen").glob("moe_int4_gemm_*.cu"))
    num = arch.split("_")[1]

    def one(src: Path) -> Path:
        cubin = out / f"{src.stem}.{arch}.cubin"
        _run(
            [nvcc, "-std=c++17", f"-arch=sm_{num}", "-cubin", "--expt-relaxed-constexpr",
             "-I", str(csrc), "-o", str(cubin), str(src)]
        )  # fmt: skip
        return cubin

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, srcs))


def default_so() -> Path | None:
    hits = sorted((ROOT / "python" / "pcie_a2a").glob("_moe_int4*.so"))
    if hits:
        return hits[0]
    spec = importlib.util.find_spec("pcie_a2a")
    if spec and spec.origin:
        hits = sorted(Path(spec.origin).parent.glob("_moe_int4*.so"))
        if hits:
            return hits[0]
    return None


def collect(
    so: Path | None,
    archs: list[str],
    cuobjdump: str,
    nvcc: str | None,
    jobs: int,
    csrc: Path = ROOT / "csrc",
):
    funcs: list[Function] = []
    if so is not None:
        funcs += functions_of(so, cuobjdump)
    if archs:
        if nvcc is None:
            raise RuntimeError("nvcc not found: needed to compile " + ", ".join(archs))
        with tempfile.TemporaryDirectory() as tmp:
            for arch in archs:
                for cubin in compile_cubins(arch, Path(tmp), nvcc, jobs, csrc):
                    funcs += functions_of(cubin, cuobjdump)
    return report(funcs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--so", type=Path, help="built _moe_int4 extension (default: found)")
    ap.add_argument("--no-so", action="store_true", help="only the --arch cubins")
    ap.add_argument("--arch", action="append", default=[], help="also compile for this (sm_89)")
    ap.add_argument("--cuobjdump")
    ap.add_argument("--nvcc")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--csrc", type=Path, default=ROOT / "csrc", help="sources for --arch")
    ap.add_argument("--budget", type=int, default=BUDGET)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    cuobjdump = find_tool("cuobjdump", args.cuobjdump)
    if cuobjdump is None:
        print("cuobjdump not found (CUDA toolkit or: pip install nvidia-cuda-cuobjdump)")
        return 2
    so = None if args.no_so else (args.so or default_so())
    if so is None and not args.arch:
        print("no built _moe_int4 extension found; give --so or --arch")
        return 2
    rows = collect(so, args.arch, cuobjdump, find_tool("nvcc", args.nvcc), args.jobs, args.csrc)
    print(format_rows(rows))
    bad = problems(rows, args.budget)
    if not rows:
        bad.append("no moe_int4 GEMM instantiation in the inputs")
    for b in bad:
        print("FAIL:", b)
    return 1 if (args.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
