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

``--check`` exits 1 when no main loop is found or an instantiation
  * exceeds the instruction budget per k-tile, has a loop nested in the main loop, or
    spills (local memory or STL/LDL);
  * waits in the main loop for fewer than STAGES - 2 copy groups in flight (DEPBAR.LE SB0,
    N with N < STAGES - 2: e.g. ``cp_async_wait<0>`` leaves one stage in flight, not three);
  * issues another number of async copies (LDGSTS) per k-tile than the kernel's stage
    needs (activation chunks + 4 weight rows + 1 scale row);
  * has a memory barrier (MEMBAR: a ``__threadfence()``) inside the main loop;
  * runs more than PROLOGUE_BUDGET instructions (static, from the entry) before its first
    weight copy, or calls a subroutine (the 64-bit division) on the way there.
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
from dataclasses import dataclass, field
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
    instrs: list[tuple[int, str, str]]  # (address, opcode, text without the guard)
    regs: int = -1
    local_bytes: int = 0
    stack_bytes: int = 0
    static_smem: int = 0
    guarded: dict[int, str] = field(default_factory=dict)  # address -> guard (@P0, @!UP1)


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
            addr = int(m.group(1), 16)
            body = _PRED.sub("", m.group(2))
            if body != m.group(2):
                cur.guarded[addr] = m.group(2)[: len(m.group(2)) - len(body)].strip()
            op = body.split()[0] if body else ""
            cur.instrs.append((addr, op, body))
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
    wait_depth: int | None = None  # smallest N of the loop's DEPBAR.LE SB0, N (None: no wait)
    copies_per_k_tile: float = 0.0  # LDGSTS
    membars: int = 0  # MEMBAR in the loop


@dataclass
class Prologue:
    """From the entry to the first weight copy (an unguarded LDGSTS without the zero-fill
    predicate of the activation copies): what a CTA runs before its weights start moving."""

    found: bool
    instructions: int = 0  # static, NOPs excluded
    calls: int = 0  # CALL (the 64-bit division subroutine)
    loads: int = 0  # LDG (each a memory round trip unless independent of the others)
    dependent_loads: int = 0  # the longest chain of LDGs the first weight copy's address needs


_DEPBAR = re.compile(r"DEPBAR\.LE\s+SB0\s*,\s*(0x[0-9a-f]+|\d+)")
_ZFILL = re.compile(r",\s*!?P\d+$")  # cp.async with a source size: the activations' zero fill


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
    texts = [t for a, _, t in f.instrs if lo <= a <= hi]
    waits = [int(m.group(1), 0) for t in texts if (m := _DEPBAR.search(t))]
    copies = sum(1 for op in body if op.startswith("LDGSTS"))
    scale = hmma_per_k_tile / hmma
    return LoopReport(
        True,
        n,
        hmma,
        n * scale,
        nested,
        spills,
        min(waits) if waits else None,
        copies * scale,
        sum(1 for op in body if op.startswith("MEMBAR")),
    )


_NO_DEST = ("ST", "LDGSTS", "LDGDEPBAR", "DEPBAR", "BRA", "BAR", "EXIT", "CALL", "RET", "RED")
_NO_DEST += ("MEMBAR", "WARPSYNC", "NOP", "CCTL", "PREEXIT", "ACQBULK")


def _regs(operand: str) -> list[str]:
    """Registers an operand names: R4.64 is R4 and R5, R4.128 is R4..R7 (RZ/URZ: none)."""
    out = []
    for m in re.finditer(r"\b(U?[RP])(\d+)(\.64|\.128)?\b", operand):
        n = {"": 1, ".64": 2, ".128": 4}[m.group(3) or ""]
        out += [f"{m.group(1)}{int(m.group(2)) + i}" for i in range(n)]
    return out


def _width(op: str) -> int:
    return 4 if ".128" in op else 2 if ".64" in op else 1


def prologue(f: Function) -> Prologue:
    """Dataflow over the instructions before the first weight copy, in address order; a
    register's depth is the largest of all its definitions so far (the two sides of a
    branch, reused registers), so the chain is an upper bound."""
    n = calls = loads = 0
    depth: dict[str, int] = {}
    for addr, op, body in f.instrs:
        operands = [o.strip() for o in body.split(None, 1)[1].split(",")] if " " in body else []
        srcs = [r for o in operands[1:] for r in _regs(o)] + _regs(f.guarded.get(addr, ""))
        src_depth = max((depth.get(r, 0) for r in srcs), default=0)
        if op.startswith("LDGSTS") and addr not in f.guarded and not _ZFILL.search(body):
            chain = max((depth.get(r, 0) for o in operands for r in _regs(o)), default=0)
            return Prologue(True, n, calls, loads, chain)
        n += not op.startswith("NOP")
        calls += op.startswith("CALL")
        is_load = op.startswith("LDG") and not op.startswith(("LDGSTS", "LDGDEPBAR"))
        loads += is_load
        if operands and not op.startswith(_NO_DEST):
            dest = _regs(operands[0])[:1]
            if dest:
                m = re.match(r"(U?[RP])(\d+)", dest[0])
                width = _width(op) if is_load else 2 if ".WIDE" in op else 1
                for i in range(width):  # max over every definition: branches reuse registers
                    r = f"{m.group(1)}{int(m.group(2)) + i}"
                    depth[r] = max(depth.get(r, 0), src_depth + is_load)
    return Prologue(False, n, calls, loads)


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
    prologue: Prologue = field(default_factory=lambda: Prologue(False))


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
                prologue(f),
            )
        )
    rows.sort(key=lambda r: (r.arch, r.variant))
    return rows


def problems(rows: list[Row], budget: int, prologue_budget: int | None = None) -> list[str]:
    if prologue_budget is None:
        prologue_budget = GM.PROLOGUE_INSTR
    bad = []
    for r in rows:
        where = f"{r.arch} {r.variant}"
        if not r.loop.found:
            bad.append(f"{where}: no main loop (backward branch around HMMA) found")
            continue
        lp = r.loop
        if lp.per_k_tile > budget:
            bad.append(f"{where}: {lp.per_k_tile:.0f} instructions per k-tile > {budget}")
        if lp.nested_loops:
            bad.append(f"{where}: {lp.nested_loops} loop(s) nested in the main loop")
        if r.spills:
            bad.append(f"{where}: spills ({r.spills} bytes/instructions of local memory)")
        depth = GM.STAGES - 2
        if lp.wait_depth is None:
            bad.append(f"{where}: the main loop waits for no copy group (no DEPBAR.LE SB0)")
        elif lp.wait_depth < depth:
            bad.append(
                f"{where}: the main loop waits until {lp.wait_depth} copy groups are in flight;"
                f" the {GM.STAGES}-stage pipeline needs {depth}"
            )
        want = GM.COPIES_PER_K_TILE[r.block_m]
        if lp.copies_per_k_tile != want:
            bad.append(
                f"{where}: {lp.copies_per_k_tile:g} async copies (LDGSTS) per k-tile; a stage"
                f" is {want}"
            )
        if lp.membars:
            bad.append(f"{where}: {lp.membars} MEMBAR in the main loop (serialises the copies)")
        pr = r.prologue
        if not pr.found:
            bad.append(f"{where}: no weight copy (unguarded LDGSTS without zero fill) found")
        else:
            if pr.instructions > prologue_budget:
                bad.append(
                    f"{where}: {pr.instructions} instructions before the first weight copy"
                    f" > {prologue_budget}"
                )
            if pr.calls:
                bad.append(f"{where}: {pr.calls} subroutine call(s) before the first weight copy")
    return bad


def format_rows(rows: list[Row]) -> str:
    out = [
        f"{'arch':7s} {'instantiation':20s} {'instr/ktile':>11s} {'HMMA':>5s} {'nested':>6s}"
        f" {'regs':>4s} {'spills':>6s} {'CTAs/SM':>7s} {'warps/SM':>8s} {'wait':>4s}"
        f" {'cp/kt':>5s} {'membar':>6s} {'prolog':>6s} {'calls':>5s} {'LDG':>3s} {'chain':>5s}"
    ]
    for r in rows:
        lp, pr = r.loop, r.prologue
        wait = "-" if lp.wait_depth is None else str(lp.wait_depth)
        out.append(
            f"{r.arch:7s} {r.variant:20s} {lp.per_k_tile:11.0f} {lp.hmma:5d} {lp.nested_loops:6d}"
            f" {r.regs:4d} {r.spills:6d} {r.ctas_per_sm:7d} {r.warps_per_sm:8d} {wait:>4s}"
            f" {lp.copies_per_k_tile:5g} {lp.membars:6d} {pr.instructions:6d} {pr.calls:5d}"
            f" {pr.loads:3d} {pr.dependent_loads:5d}"
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


def compile_cubins(
    arch: str, out: Path, nvcc: str, jobs: int, csrc: Path, variant: str = "*"
) -> list[Path]:
    """csrc/cuda/moe_int4/gen/moe_int4_gemm_<variant>.cu (a glob; default all) -> one cubin
    each for `arch` (device code only)."""
    srcs = sorted((csrc / "cuda" / "moe_int4" / "gen").glob(f"moe_int4_gemm_{variant}.cu"))
    if not srcs:
        raise RuntimeError(f"no generated instantiation moe_int4_gemm_{variant}.cu in {csrc}")
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
    variant: str = "*",
):
    """Rows of the extension's cubins plus those compiled for `archs`; an arch the
    extension already holds is not compiled again (one row per instantiation and arch)."""
    funcs: list[Function] = []
    if so is not None:
        funcs += functions_of(so, cuobjdump)
    built = {f.arch for f in funcs}
    archs = [a for a in dict.fromkeys(archs) if a not in built]
    if archs:
        if nvcc is None:
            raise RuntimeError("nvcc not found: needed to compile " + ", ".join(archs))
        with tempfile.TemporaryDirectory() as tmp:
            for arch in archs:
                for cubin in compile_cubins(arch, Path(tmp), nvcc, jobs, csrc, variant):
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
    ap.add_argument("--variant", default="*", help="gen/ instantiations for --arch (a glob)")
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
    nvcc = find_tool("nvcc", args.nvcc)
    rows = collect(so, args.arch, cuobjdump, nvcc, args.jobs, args.csrc, args.variant)
    print(format_rows(rows))
    bad = problems(rows, args.budget)
    if not rows:
        bad.append("no moe_int4 GEMM instantiation in the inputs")
    for b in bad:
        print("FAIL:", b)
    return 1 if (args.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
