"""A fluid model of the INT4 MoE kernel's grid: which tile, how many work items, how the
k-tiles are split over the CTAs, and the predicted fraction of the weight-bandwidth floor.

It is an estimate, not a measurement: every CTA streams its k-tiles at the smaller of its
share of DRAM bandwidth, what its cp.async pipeline keeps in flight over the memory
latency, and what its SM can issue (instructions per k-tile from the compiled SASS, see
scripts/sass_report.py); plus fixed costs per call (launch gaps, zeroing and finalise
traffic). What it is for: seeing tails, idle SMs and fixed costs before a GPU run, and
pinning the decisions that remove them. The benchmark
(benchmarks/bench_moe_gemm.py) measures the real numbers.

The kernel it models is the one in this tree: block_m 16 unless the caller estimates >= 48
rows per expert, stream-K over every CTA for both GEMMs, zeroing and finalise of the rows
that have a local expert only, programmatic dependent launch on sm_90/120.

``python -m pcie_a2a.quant.grid_model`` prints the decode table for every target GPU.
Pure Python (no torch), so scripts can load it by path.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

# ---- the kernel's constants (csrc/cuda/moe_int4/gemm_kernel.cuh; a test compares) -------
THREADS = 128
WARPS = THREADS // 32
STAGES = 4
BLOCK_K = 64
BLOCK_N = 256
MIN_PART_K_TILES = 4
A_ROW_STRIDE = BLOCK_K + 8
B_STAGE_BYTES = (BLOCK_K // 16) * WARPS * 512
S_STAGE_BYTES = 2 * BLOCK_N * 2
WS_SLOTS_PER_SM = {16: 4, 64: 2}  # python/pcie_a2a/quant/moe.py
BLOCK_M_64_MIN_ROWS = 48  # python/pcie_a2a/quant/moe.py
HMMA_PER_K_TILE = {16: 32, 64: 128}  # m16n8k16 per warp and 64-deep k-tile

# Instructions per warp per 64-deep k-tile of the main loop, and registers: the largest
# over dtype, zero points and group of each block_m on any arch, from
# scripts/sass_report.py (the compiled code is checked to stay within these).
INSTR_PER_K_TILE = {16: 440, 64: 600}
REGS = {16: 128, 64: 255}
# Async copies (cp.async) per thread and k-tile: activation chunks, 4 weight rows, 1 scale
# (or zero point) row; scripts/sass_report.py --check counts them in the compiled loop.
COPIES_PER_K_TILE = {bm: bm * 8 // THREADS + BLOCK_K // 16 + 1 for bm in (16, 64)}
# Fixed cost of one GEMM launch, from the compiled code (scripts/sass_report.py reports
# them per instantiation, and the compiled kernels are checked to stay within these): the static instructions from the entry to the first weight copy (also the
# --check budget), the chain of dependent global loads that copy's address waits for
# (num_tiles -> the tile's expert: 2; the report's count is an upper bound, 3 on some), and the tails' serial round trips (the ticket RMW with
# release/acquire, then the re-read of the sums or of the accumulator row).
PROLOGUE_INSTR = 500
PROLOGUE_DEPENDENT_LOADS = 3
TAIL_ROUND_TRIPS = 2
# The schedule kernel (one CTA, schedule.cuh): reads of the routing (count, scatter) and the
# writes the GEMMs then read, plus the one-thread prefix sum over the experts.
SCHEDULE_ROUND_TRIPS = 4
SCHEDULE_CYCLES_PER_EXPERT = 40
LAUNCHES = 3  # schedule, gate/up, down (act-order adds the permute)


def smem_bytes(block_m: int) -> int:
    """Dynamic shared memory of one GEMM CTA (SmemLayout<kBlockM>::kBytes)."""
    return STAGES * (block_m * A_ROW_STRIDE * 2 + B_STAGE_BYTES + 2 * S_STAGE_BYTES)


@dataclass(frozen=True)
class Arch:
    name: str
    max_warps: int  # per SM
    max_blocks: int  # per SM
    smem_per_sm: int  # bytes usable by CTAs (opt-in carveout)
    smem_optin: int  # per block
    regs_per_sm: int = 65536
    reserved_smem: int = 1024  # per block (sm_80 and newer)


ARCHS = {
    "sm_89": Arch("sm_89", max_warps=48, max_blocks=24, smem_per_sm=102400, smem_optin=101376),
    "sm_90": Arch("sm_90", max_warps=64, max_blocks=32, smem_per_sm=233472, smem_optin=232448),
    "sm_120": Arch("sm_120", max_warps=48, max_blocks=32, smem_per_sm=102400, smem_optin=101376),
}


@dataclass(frozen=True)
class Gpu:
    name: str
    arch: str
    sms: int
    bw_gbs: float  # spec DRAM bandwidth
    clock_ghz: float  # sustained SM clock under load (estimate)
    latency_us: float  # DRAM latency under load (estimate)
    l2_mb: int = 50  # L2 size (the gate/up GEMM prefetches the down weights into half)
    l2_latency_us: float = 0.3  # a load that hits L2 (data the previous kernel wrote)


def _gpu_table() -> dict:
    """pcie_a2a/gpus.py, the one GPU table (by path when this file was loaded by path)."""
    if __package__:
        from .. import gpus

        return gpus.GPUS
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "_pa2a_gpus", Path(__file__).resolve().parents[1] / "gpus.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return mod.GPUS


# Keyed as the table with underscores (rtx_pro_6000); the GPUs the table gives an arch.
GPUS = {
    k.replace("-", "_"): Gpu(
        g.name, g.arch, g.sms, float(g.bandwidth_gbps), g.clock_ghz, g.dram_latency_us, g.l2_mb
    )
    for k, g in _gpu_table().items()
    if g.arch in ARCHS
}


def ctas_per_sm(arch: Arch, block_m: int, regs: int) -> int:
    """Occupancy of one GEMM CTA: the smallest of the shared-memory, register, warp and
    block limits (registers are allocated per warp in units of 256)."""
    smem = smem_bytes(block_m) + arch.reserved_smem
    by_smem = arch.smem_per_sm // smem
    regs_per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = (arch.regs_per_sm // regs_per_warp) // WARPS
    return max(0, min(by_smem, by_regs, arch.max_warps // WARPS, arch.max_blocks))


# ---- the stream-K partition (Partition / make_partition in gemm_kernel.cuh) --------------


@dataclass(frozen=True)
class Partition:
    units: int
    ctas: int
    gran: int

    def begin(self, b: int) -> int:
        return (b * (self.units // self.gran) // self.ctas) * self.gran

    def owner(self, v: int) -> int:
        return ((v // self.gran + 1) * self.ctas - 1) // (self.units // self.gran)


def make_partition(items: int, k_tiles: int, grid: int, splittable: bool) -> Partition:
    units = items * k_tiles
    gran = 1 if splittable else k_tiles
    chunks = units // gran
    c = chunks // MIN_PART_K_TILES if splittable else chunks
    return Partition(units, max(1, min(c, grid)), gran)


# ---- the problem -------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    hidden: int = 7168
    intermediate: int = 2048
    local_experts: int = 48
    topk: int = 8
    group: int = 32
    ll_rows: int = 1024  # low-latency receive buffer rows (world x max_tokens)

    def w_bytes(self, n: int, k: int) -> int:
        """One expert matrix: int4 weights plus bf16 group scales."""
        return n * k // 2 + n * (k // self.group) * 2


def _pad(v: int, m: int) -> int:
    return -(-v // m) * m


@dataclass
class GemmGrid:
    items: int
    k_tiles: int
    ctas: int
    max_units: int  # k-tiles of the busiest CTA
    min_units: int  # of the least busy CTA that has work
    max_parts: int  # CTAs sharing one item, at most
    split_items: int
    time_us: float = 0.0


@dataclass
class Prediction:
    gpu: str
    active_experts: int
    rows_per_expert: int
    block_m: int
    gate_up: GemmGrid
    down: GemmGrid
    floor_us: float
    fixed_us: float
    time_us: float
    notes: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.floor_us / self.time_us


def _fluid_time(loads_bytes: list[float], bw: float, cap: float) -> float:
    """Seconds until every CTA has streamed its bytes, all sharing `bw`, each at most `cap`
    (bytes/s): water-filling over the loads sorted ascending."""
    loads = sorted(x for x in loads_bytes if x > 0)
    t, done, n = 0.0, 0.0, len(loads)
    for i, load in enumerate(loads):
        active = n - i
        rate = min(cap, bw / active)
        t += (load - done) / rate
        done = load
    return t


def _gemm(
    gpu: Gpu,
    per_sm: int,
    block_m: int,
    instr: int,
    tiles: int,
    n: int,
    k: int,
    needs_ws: bool,
    unit_bytes: int,
) -> GemmGrid:
    n_blocks = _pad(n, BLOCK_N) // BLOCK_N
    k_tiles = _pad(k, BLOCK_K) // BLOCK_K
    items = tiles * n_blocks
    slots = gpu.sms * per_sm
    grid = min(slots, WS_SLOTS_PER_SM[block_m] * gpu.sms) if needs_ws else slots
    pt = make_partition(items, k_tiles, grid, True)
    loads = [pt.begin(b + 1) - pt.begin(b) for b in range(pt.ctas)]
    parts = [pt.owner((i + 1) * k_tiles - 1) - pt.owner(i * k_tiles) + 1 for i in range(items)]
    busy = [x for x in loads if x > 0]
    plan = GemmGrid(
        items=items,
        k_tiles=k_tiles,
        ctas=len(busy),
        max_units=max(busy, default=0),
        min_units=min(busy, default=0),
        max_parts=max(parts, default=1),
        split_items=sum(1 for p in parts if p > 1),
    )
    bw = gpu.bw_gbs * 1e9
    in_flight = (STAGES - 1) * unit_bytes / (gpu.latency_us * 1e-6)
    # Issue: the SM's 4 schedulers shared by its CTAs (resident ones share even when the
    # partition leaves some idle: count the CTAs actually placed on one SM).
    on_sm = max(1, min(per_sm, math.ceil(plan.ctas / gpu.sms)))
    issue = unit_bytes * gpu.clock_ghz * 1e9 * 4 / (on_sm * WARPS * instr)
    plan.time_us = 1e6 * _fluid_time([x * unit_bytes for x in busy], bw, min(in_flight, issue))
    plan.time_us += gpu.latency_us  # pipeline fill of the first k-tiles
    return plan


def gemm_fixed_us(gpu: Gpu) -> float:
    """One GEMM launch's fixed cost: the dependent loads and instructions before a CTA's
    first weight copy, and its tail's round trips (all on data in L2)."""
    issue = PROLOGUE_INSTR / (gpu.clock_ghz * 1e3)  # one warp, one instruction a cycle
    return (PROLOGUE_DEPENDENT_LOADS + TAIL_ROUND_TRIPS) * gpu.l2_latency_us + issue


def schedule_us(gpu: Gpu, experts: int) -> float:
    """The one-CTA schedule kernel: its round trips and the serial prefix over the experts."""
    return SCHEDULE_ROUND_TRIPS * gpu.l2_latency_us + experts * SCHEDULE_CYCLES_PER_EXPERT / (
        gpu.clock_ghz * 1e3
    )


LAYOUTS = ("low_latency", "normal")
L2_PREFETCH_NOTE = "down weights prefetched into L2 across the launch gap"


def launch_us(gpu: Gpu) -> float:
    """The gap one launch adds: programmatic dependent launch (sm_90 and newer) hides most
    of it; sm_89 pays the whole gap."""
    return 2.5 if gpu.arch == "sm_89" else 1.0


def predict(
    gpu_name: str,
    active_experts: int,
    rows_per_expert: int,
    *,
    shape: Shape = Shape(),
    layout: str = "low_latency",
) -> Prediction:
    """One decode step of one rank: ``active_experts`` experts with ``rows_per_expert``
    rows each, in the low-latency rows layout (``shape.ll_rows`` rows, mostly -1 slots) or
    the normal layout (only routed rows)."""
    if gpu_name not in GPUS:
        raise ValueError(f"gpu_name: got {gpu_name!r}; allowed: {', '.join(sorted(GPUS))}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: got {layout!r}; allowed: {', '.join(LAYOUTS)}")
    for name, v in (("active_experts", active_experts), ("rows_per_expert", rows_per_expert)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: got {v!r}; allowed: an int >= 1")
    gpu = GPUS[gpu_name]
    arch = ARCHS[gpu.arch]
    pairs = active_experts * rows_per_expert
    # at most one pair per row in the normal layout (a bound for the costs)
    rows = shape.ll_rows if layout == "low_latency" else pairs
    notes: list[str] = []
    bm = 16  # choose_block_m: no estimate from the layer at decode
    instr, regs = INSTR_PER_K_TILE[bm], REGS[bm]
    per_sm = max(1, ctas_per_sm(arch, bm, regs))
    tiles = active_experts * -(-rows_per_expert // bm)
    h, i = shape.hidden, shape.intermediate
    scale_bytes = 2 * BLOCK_N * 2 if shape.group == 32 else BLOCK_N * 2
    unit = B_STAGE_BYTES + scale_bytes
    gu = _gemm(gpu, per_sm, bm, instr, tiles, 2 * i, h, True, unit)
    dn = _gemm(gpu, per_sm, bm, instr, tiles, h, i, False, unit)
    bw = gpu.bw_gbs * 1e3  # bytes per microsecond
    floor = active_experts * (shape.w_bytes(2 * i, h) + shape.w_bytes(h, i)) / bw
    active_rows = min(rows, pairs)
    launch = launch_us(gpu)
    fixed = LAUNCHES * launch + schedule_us(gpu, shape.local_experts) + 2 * gemm_fixed_us(gpu)
    fixed += active_rows * h * (4 + 4 + 2) / bw  # zero, finalise r/w
    # The gate/up CTAs prefetch the down weights into L2 as they finish: the gap to the
    # down GEMM's first copies (launch, prologue) streams them, if they fit.
    down_bytes = active_experts * shape.w_bytes(h, i)
    if down_bytes <= gpu.l2_mb * 2**20 / 2:
        fixed -= min(launch + gemm_fixed_us(gpu), dn.time_us)
        notes.append(L2_PREFETCH_NOTE)
    total = gu.time_us + dn.time_us + fixed
    return Prediction(
        gpu_name, active_experts, rows_per_expert, bm, gu, dn, floor, fixed, total, notes
    )


DECODE_ACTIVE = (1, 2, 4, 8, 12, 16, 17, 24, 32, 48)
DECODE_ROWS = (1, 2, 4, 8, 16)


def table(gpus=None, rows=(1, 4, 16)) -> str:
    out = [
        "gpu, active experts, rows/expert -> block_m, items (gate/up, down),"
        " CTAs, k-tiles per CTA max/min, max parts per item, fixed us, floor us, predicted us,"
        " fraction of floor"
    ]
    for g in gpus or GPUS:
        for a in DECODE_ACTIVE:
            for m in rows:
                p = predict(g, a, m)
                gu, dn = p.gate_up, p.down
                out.append(
                    f"{g:12s} A={a:2d} m={m:2d} bm={p.block_m:2d} items={gu.items:4d}/{dn.items:4d}"
                    f" ctas={gu.ctas:3d}/{dn.ctas:3d} kt={gu.max_units}-{gu.min_units}/"
                    f"{dn.max_units}-{dn.min_units} parts={gu.max_parts}/{dn.max_parts}"
                    f" fixed={p.fixed_us:5.1f} floor={p.floor_us:6.1f} t={p.time_us:6.1f}"
                    f" frac={p.fraction:4.2f}"
                )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="append", choices=sorted(GPUS))
    ap.add_argument("--rows", type=int, action="append", help="rows per expert (default 1 4 16)")
    args = ap.parse_args(argv)
    rows = tuple(args.rows) if args.rows else (1, 4, 16)
    print(table(args.gpu, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
