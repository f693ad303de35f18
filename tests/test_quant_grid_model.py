"""The grid model of the INT4 MoE kernel (python/pcie_a2a/quant/grid_model.py): its
constants are the kernel's, its partition is the kernel's stream-K partition, for every
low-latency decode step on every target GPU it predicts block_m 16 and no tails, and its
costs are the hand-computed ones (weight-byte floor, fixed cost of a launch, the L2
prefetch threshold) and grow with the active experts (an estimate; the benchmark
measures)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from pcie_a2a.quant import grid_model as G
from pcie_a2a.quant import moe as M

ROOT = Path(__file__).resolve().parents[1]
KERNEL = (ROOT / "csrc" / "cuda" / "moe_int4" / "gemm_kernel.cuh").read_text()
LAYOUT = (ROOT / "csrc" / "cuda" / "moe_int4" / "layout.h").read_text()


def _const(text: str, name: str) -> int:
    m = re.search(rf"constexpr int {name} = (\d+);", text)
    assert m, name
    return int(m.group(1))


def test_constants_are_the_kernels():
    assert _const(KERNEL, "kThreads") == G.THREADS
    assert _const(KERNEL, "kStages") == G.STAGES
    assert _const(KERNEL, "kMinPartKTiles") == G.MIN_PART_K_TILES
    assert (_const(LAYOUT, "kPadK"), _const(LAYOUT, "kPadN")) == (G.BLOCK_K, G.BLOCK_N)
    assert G.WS_SLOTS_PER_SM == M.WS_SLOTS_PER_SM
    assert G.BLOCK_M_64_MIN_ROWS == M.BLOCK_M_64_MIN_ROWS
    # The kernel's comment states the shared memory; the model computes it.
    assert (G.smem_bytes(16), G.smem_bytes(64)) == (50176, 77824)
    assert "50176 (kBlockM" in KERNEL and "77824 (kBlockM 64)" in KERNEL


def test_partition_covers_every_unit_once_and_balances():
    for items, k_tiles, grid, split in [
        (16, 112, 376, True),
        (28, 32, 376, True),
        (7, 18, 12, True),
        (5, 3, 64, True),
        (3, 18, 2, False),
        (768, 112, 256, True),
    ]:
        pt = G.make_partition(items, k_tiles, grid, split)
        assert pt.begin(0) == 0 and pt.begin(pt.ctas) == pt.units == items * k_tiles
        sizes = [pt.begin(b + 1) - pt.begin(b) for b in range(pt.ctas)]
        assert min(sizes) >= 1
        assert max(sizes) - min(sizes) <= pt.gran  # no tail: at most one chunk apart
        for b in range(pt.ctas):  # owner() inverts begin()
            for v in (pt.begin(b), pt.begin(b + 1) - 1):
                assert pt.owner(v) == b
        if not split:
            assert all(s % k_tiles == 0 for s in sizes)  # whole items only


def test_choose_block_m():
    assert M.choose_block_m() == 16  # no estimate: the buffer size is no estimate
    assert all(M.choose_block_m(m) == 16 for m in range(1, M.BLOCK_M_64_MIN_ROWS))
    assert M.choose_block_m(M.BLOCK_M_64_MIN_ROWS) == 64 and M.choose_block_m(500) == 64


@pytest.mark.parametrize("gpu", sorted(G.GPUS))
def test_every_low_latency_decode_step_uses_block_m_16_without_tails(gpu):
    for a in range(1, 49):
        for m in (1, 2, 4, 8, 16):
            p = G.predict(gpu, a, m)
            assert p.block_m == 16, (gpu, a, m)
            for plan in (p.gate_up, p.down):
                assert plan.max_units - plan.min_units <= 1, (gpu, a, m, plan)
                # every CTA slot has work unless even 4-k-tile parts cannot fill them
                spec = G.GPUS[gpu]
                slots = spec.sms * G.ctas_per_sm(G.ARCHS[spec.arch], 16, G.REGS[16])
                want = min(slots, plan.items * plan.k_tiles // G.MIN_PART_K_TILES)
                assert plan.ctas >= min(want, G.WS_SLOTS_PER_SM[16] * spec.sms), (gpu, a, m)


# Kimi K2 (the default Shape): hidden 7168, intermediate 2048, int4 weights (1/2 B each)
# and one bf16 scale (2 B) per 32 weights of a row. Per expert:
#   gate/up [4096 x 7168]: 4096 * 7168 / 2 + 4096 * (7168 / 32) * 2 = 14,680,064 + 1,835,008
#   down    [7168 x 2048]: 7168 * 2048 / 2 + 7168 * (2048 / 32) * 2 =  7,340,032 +   917,504
KIMI_GATE_UP_BYTES = 16_515_072
KIMI_DOWN_BYTES = 8_257_536


def test_weight_floor_is_the_weight_bytes_at_the_spec_bandwidth():
    # 8 Kimi experts on an RTX 4090 (1008 GB/s = 1,008,000 B/us):
    # 8 * (16,515,072 + 8,257,536) = 198,180,864 B -> 196.608 us
    assert G.GPUS["rtx_4090"].bw_gbs == 1008.0
    assert G.predict("rtx_4090", 8, 1).floor_us == pytest.approx(196.608, rel=1e-12)
    # a small shape, 3 experts on an H200 (4800 GB/s): gate/up [512 x 512]: 131,072 + 16,384;
    # down [512 x 256]: 65,536 + 8,192; 3 * 221,184 = 663,552 B -> 0.13824 us
    small = G.Shape(hidden=512, intermediate=256)
    assert G.predict("h200", 3, 4, shape=small).floor_us == pytest.approx(0.13824, rel=1e-12)
    # group 128: a quarter of the scale bytes (gate/up 14,680,064 + 458,752, down
    # 7,340,032 + 229,376), 1 expert on an L40S (864 GB/s): 22,708,224 B -> 26.282666.. us
    g128 = G.Shape(group=128)
    assert G.predict("l40s", 1, 1, shape=g128).floor_us == pytest.approx(22_708_224 / 864e3)


def test_gemm_fixed_cost_from_the_l2_latency_and_the_prologue():
    # 3 dependent loads before the first weight copy + 2 tail round trips, each an L2 hit,
    # and 500 prologue instructions, one a cycle: 5 * 0.4 us + 500 / 2000 per us = 2.25 us
    gpu = G.Gpu("hand", "sm_90", sms=132, bw_gbs=4800.0, clock_ghz=2.0, latency_us=0.7,
                l2_mb=50, l2_latency_us=0.4)  # fmt: skip
    assert G.gemm_fixed_us(gpu) == pytest.approx(2.25, rel=1e-12)
    # the table's RTX 4090 (L2 hit 0.3 us, 2.5 GHz): 5 * 0.3 + 500 / 2500 = 1.7 us
    assert G.gemm_fixed_us(G.GPUS["rtx_4090"]) == pytest.approx(1.7, rel=1e-12)


@pytest.mark.parametrize("gpu", sorted(G.GPUS))
def test_more_active_experts_never_cost_less(gpu):
    for m in (1, 16):
        ps = [G.predict(gpu, a, m) for a in range(1, 49)]
        assert all(q.time_us >= p.time_us for p, q in itertools.pairwise(ps)), (gpu, m)
        assert all(q.floor_us > p.floor_us for p, q in itertools.pairwise(ps)), (gpu, m)


# Down weights of n experts fit in half of L2 while n * 8,257,536 B <= L2 / 2:
#   128 MB: 67,108,864 / 8,257,536 = 8.13 -> 8;  96 MB: 50,331,648 / .. = 6.10 -> 6
#    72 MB: 37,748,736 / 8,257,536 = 4.57 -> 4;  50 MB: 26,214,400 / .. = 3.17 -> 3
PREFETCH_MAX_EXPERTS = {128: 8, 96: 6, 72: 4, 50: 3}


@pytest.mark.parametrize("gpu", sorted(G.GPUS))
def test_l2_prefetch_note_exactly_while_the_down_weights_fit_in_half_of_l2(gpu):
    spec = G.GPUS[gpu]
    n = PREFETCH_MAX_EXPERTS[spec.l2_mb]
    assert n * KIMI_DOWN_BYTES <= spec.l2_mb * 2**20 / 2 < (n + 1) * KIMI_DOWN_BYTES
    for a in (1, n - 1, n, n + 1, n + 2, 48):
        notes = G.predict(gpu, a, 1).notes
        assert (G.L2_PREFETCH_NOTE in notes) == (a <= n), (gpu, a, notes)


def test_prefetch_saves_at_most_a_launch_and_a_prologue():
    # On the RTX 4090 (sm_89, no PDL: a 2.5 us launch gap) 4 experts prefetch, 5 do not;
    # the fixed cost then differs by the saving, 2.5 + 1.7 us, and by the 1 more active
    # row's zero/finalise bytes (m = 1: one row per expert; 7168 * 10 B at 1008 GB/s).
    four, five = G.predict("rtx_4090", 4, 1), G.predict("rtx_4090", 5, 1)
    assert five.fixed_us - four.fixed_us == pytest.approx(2.5 + 1.7 + 7168 * 10 / 1008e3)


def test_predict_rejects_bad_input():
    with pytest.raises(ValueError, match=r"gpu_name: got 'rtx_9090'; allowed: h100_pcie, "):
        G.predict("rtx_9090", 1, 1)
    with pytest.raises(ValueError, match=r"layout: got 'sparse'; allowed: low_latency, normal"):
        G.predict("rtx_4090", 1, 1, layout="sparse")
    with pytest.raises(ValueError, match=r"active_experts: got 0; allowed: an int >= 1"):
        G.predict("rtx_4090", 0, 1)
    with pytest.raises(ValueError, match=r"rows_per_expert: got 2.5; allowed: an int >= 1"):
        G.predict("rtx_4090", 1, 2.5)


def test_table_prints_every_gpu():
    text = G.table(rows=(1,))
    for g in G.GPUS:
        assert g in text
    assert len(text.splitlines()) == 1 + len(G.GPUS) * len(G.DECODE_ACTIVE)
