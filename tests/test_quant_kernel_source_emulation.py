"""The INT4 MoE kernel *source* executed on the CPU (no GPU here to run it).

``csrc/cuda/moe_int4/{gemm_kernel.cuh, schedule.cuh, validate.h}`` and the GEMM parameters
of ``moe_int4.cuh`` are compiled with the host C++ compiler against a small CUDA execution
model (``tests/native/emu/emu_cuda.h``, shared with the transport's emulation, plus
``tests/native/moe_int4_emu``: one fiber per CUDA thread with real barriers, cp.async
copies that land only at ``wait_group`` and poison their destination until then, a
warp-collective mma.m16n8k16 written from the PTX fragment tables, bf16/fp16 with
round-to-nearest-even). Only ``device_ops.cuh`` (the inline PTX) is replaced. The inputs
are the Python packer's layout and exactly the launch arguments ``_run_cuda`` would pass
(``moe._launch_fields``), and the result must meet the GPU tests' bound against the fp32
reference. Unlike tests/test_quant_kernel_emulation.py (a transcription of the kernel),
this runs the kernel's own index arithmetic, pipeline and epilogues, so a disagreement
between the kernel and the packer (or the reference) fails here; the mutation test below
shows that typical index and synchronisation mistakes do. Out-of-bounds accesses are caught
by AddressSanitizer where the compiler supports it, and by the model's checks of every
cp.async (alignment, source buffer, shared-memory range).

What it cannot see: the compiled SASS, the real asynchrony between warps and the memory
model of the split-K reduction (the model is sequentially consistent).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from native_emulation import compiler, missed_mutations, mutate, skip_or_fail
from pcie_a2a.quant import (
    PackedInt4Experts,
    from_awq,
    from_compressed_tensors,
    from_gptq,
    moe_int4_mlp_expert_major_reference,
    moe_int4_mlp_reference,
    random_int4,
    to_awq,
    to_compressed_tensors,
    to_gptq,
)
from pcie_a2a.quant import moe as M

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
EMU = Path(__file__).resolve().parent / "native" / "moe_int4_emu"
EMU_MODEL = Path(__file__).resolve().parent / "native" / "emu"  # shared CUDA model
SOURCES = ("gemm_kernel.cuh", "schedule.cuh", "validate.h", "moe_int4.cuh", "layout.h")


def build_emulator(out: Path, csrc: Path = CSRC, sanitize: bool = True) -> Path:
    """Compile tests/native/moe_int4_emu/main.cpp against the kernel headers in ``csrc``."""
    cxx = compiler()
    base = [cxx, "-std=c++17", "-g", "-fno-strict-aliasing", "-Wno-unknown-pragmas"]
    base += ["-iquote", str(EMU / "override"), "-I", str(EMU / "include")]
    base += ["-I", str(EMU_MODEL), "-I", str(csrc)]
    base += [str(EMU / "main.cpp"), "-o", str(out)]
    if sanitize:
        san = ["-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
        r = subprocess.run(base + san + ["-fno-omit-frame-pointer"], capture_output=True, text=True)
        if r.returncode == 0:
            return out
    r = subprocess.run([*base, "-O1"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"emulator build failed:\n{r.stderr[-4000:]}")
    return out


@pytest.fixture(scope="session")
def emulator(tmp_path_factory) -> Path:
    if compiler() is None:
        skip_or_fail("no host C++ compiler (c++/g++) to build the kernel emulation")
    if not all((CSRC / "cuda" / "moe_int4" / s).is_file() for s in SOURCES):
        skip_or_fail("the kernel sources are not in this checkout")
    return build_emulator(tmp_path_factory.mktemp("moe_int4_emu") / "moe_int4_emu")


class EmulatorError(RuntimeError):
    pass


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _garbage(*shape, dtype):
    """torch.empty stand-in: NaN / 0xA5A5A5A5, so reading unwritten scratch shows up."""
    t = torch.empty(*shape, dtype=dtype)
    return t.fill_(float("nan") if dtype.is_floating_point else -0x5A5A5A5B)


def run_emulated(
    binary: Path,
    workdir: Path,
    x: torch.Tensor,
    w13,
    w2,
    *,
    ids=None,
    wts=None,
    counts=None,
    block_m=None,
    num_sms=4,
    per_sm=4,
    smem_optin=101376,
    offsets: dict[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """One moe_int4_run on the emulated device; returns every buffer after the launch.

    ``offsets`` places a tensor that many bytes into its (256-byte aligned) allocation,
    like a slice of a larger tensor."""
    offsets = offsets or {}
    workdir.mkdir(parents=True, exist_ok=True)
    expert_major = counts is not None
    # Like _moe_int4_mlp_op / _moe_int4_mlp_expert_major_op: empty_like.
    out = _garbage(*x.shape, dtype=x.dtype)
    ws = M.Workspace(
        lambda *shape, dtype: torch.zeros(*shape, dtype=dtype), torch.zeros(1, dtype=torch.int32)
    )
    fields = M._launch_fields(
        x,
        out,
        w13,
        w2,
        expert_major=expert_major,
        topk_ids=ids,
        topk_weights=wts,
        counts=counts,
        block_m=16 if block_m is None else block_m,
        num_sms=num_sms,
        empty=_garbage,
        workspace=ws,
    )
    M._check_devices(x.device, fields)
    lines, tensors = [], {}
    for name, v in fields.items():
        if isinstance(v, torch.Tensor):
            off = offsets.get(name, 0)
            (workdir / f"{name}.bin").write_bytes(b"\xee" * off + _bytes(v))
            lines.append(f"{name} @{name}+{off}")
            tensors[name] = v
        elif v is not None:
            lines.append(f"{name} {int(v)}")
    (workdir / "args.txt").write_text("\n".join(lines) + "\n")
    (workdir / "device.txt").write_text(
        f"num_sms {num_sms}\nper_sm {per_sm}\nsmem_optin {smem_optin}\n"
    )
    env = dict(
        os.environ,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    r = subprocess.run(
        [str(binary), str(workdir)], capture_output=True, text=True, env=env, timeout=600
    )
    if r.returncode != 0:
        err = "\n".join(ln for ln in r.stderr.splitlines() if "swapcontext" not in ln)
        raise EmulatorError(f"exit status {r.returncode}:\n{err[-6000:]}")
    res = {}
    for name, v in tensors.items():
        data = bytearray((workdir / f"{name}.out.bin").read_bytes())[offsets.get(name, 0) :]
        res[name] = torch.frombuffer(data, dtype=torch.uint8).view(v.dtype).reshape(v.shape)
    # The persistent scratch must be zero again for the next launch (moe_int4.cuh).
    for name in ("split_ws", "split_cnt", "row_cnt"):
        if name in res:
            assert torch.all(res[name] == 0), f"{name} was not left zeroed"
    return res


def check_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """tests/test_moe_int4_gpu.py's bound."""
    out, ref = out.float(), ref.float()
    assert torch.isfinite(out).all(), "non-finite output"
    denom = ref.abs().mean()
    if denom == 0:
        assert out.abs().max() == 0
        return
    rel = ((out - ref).abs().mean() / denom).item()
    assert rel < 1e-2, f"mean relative error {rel:.3e} >= 1e-2"
    worst = (out - ref).abs().max().item()
    assert worst <= 5e-2 * ref.abs().max().item() + 1e-3, f"max abs error {worst:.3e}"


def check_rows(res: dict, ref: torch.Tensor) -> None:
    """Rows layout: routed rows meet the bound; rows with no local expert are never written
    (they keep the NaN fill of the empty output)."""
    routed = (res["ids"] >= 0).any(1)
    assert routed.any()
    check_close(res["out"][routed], ref[routed])
    assert torch.all(torch.isnan(res["out"][~routed].float())), "an unrouted row was written"


def make_experts(fmt, group_size, dtype, e, h, i, seed):
    """Random experts through a checkpoint format ('gptq-act': GPTQ with desc_act)."""
    g = torch.Generator().manual_seed(seed)
    sdt = torch.bfloat16 if fmt == "ct" else torch.float16
    kw = dict(group_size=group_size, scale_dtype=sdt, generator=g, scale=0.05)
    act = fmt == "gptq-act"
    gate = random_int4(e, i, h, act_order=act, symmetric=fmt != "awq", **kw)
    up = random_int4(e, i, h, symmetric=fmt != "awq", **kw)
    if act:
        up.g_idx = gate.g_idx.clone()
    down = random_int4(e, h, i, act_order=act, symmetric=fmt != "awq", **kw)
    parts = []
    for w in (gate, up, down):
        if fmt in ("gptq", "gptq-act"):
            d = to_gptq(w, checkpoint_format="gptq_v2")
            if not act:
                d.pop("g_idx")
            parts.append(from_gptq(**d, group_size=group_size, checkpoint_format="gptq_v2"))
        elif fmt == "awq":
            parts.append(from_awq(**to_awq(w), group_size=group_size))
        else:
            parts.append(from_compressed_tensors(**to_compressed_tensors(w), group_size=group_size))
    return PackedInt4Experts.from_weights(*parts, dtype, allow_inexact_scales=True)


def routing(rows: int, topk: int, e: int, seed: int):
    """Random distinct experts per row, ~20% of slots empty, row 2 routed nowhere."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(rows)])
    ids[torch.rand(rows, topk, generator=g) < 0.2] = -1
    ids[2] = -1
    wts = torch.rand(rows, topk, generator=g) * (ids >= 0)
    return ids.to(torch.int32), wts


def tiles_for(ids: torch.Tensor, e: int, bm: int) -> int:
    counts = torch.bincount(ids[ids >= 0].long(), minlength=e)
    return int(((counts + bm - 1) // bm).sum())


def rows_case(binary, workdir, fmt, group_size, dtype, bm, *, num_sms=4, per_sm=4):
    """23 rows, top-2 over 3 experts (~12 rows each: mma rows 8..15 carry data), ragged
    H and I (two 256-column blocks in both GEMMs)."""
    e, h, i = 3, 264, 136
    if fmt == "gptq-act":
        h, i = 256, 256  # act-order needs full groups
    ex = make_experts(fmt, group_size, dtype, e, h, i, seed=1)
    x = torch.randn(23, h, generator=torch.Generator().manual_seed(2)).to(dtype)
    ids, wts = routing(23, 2, e, seed=3)
    x[2] = float("nan")  # routed nowhere: must not be read
    res = run_emulated(
        binary,
        workdir,
        x,
        ex.w13,
        ex.w2,
        ids=ids,
        wts=wts,
        block_m=bm,
        num_sms=num_sms,
        per_sm=per_sm,
    )
    res["ids"] = ids
    return res, moe_int4_mlp_reference(x, ids, wts, ex.w13, ex.w2)


@pytest.mark.parametrize(
    ("fmt", "group_size", "dtype", "bm"),
    [
        ("ct", 32, torch.bfloat16, 16),
        ("ct", 32, torch.float16, 64),
        ("awq", 64, torch.float16, 16),
        ("awq", 32, torch.float16, 16),  # zero points with two groups per k-tile
        ("awq", 32, torch.bfloat16, 16),
        ("awq", 128, torch.bfloat16, 16),
        ("gptq", 64, torch.bfloat16, 64),
        ("gptq", 128, torch.float16, 16),
        ("gptq", -1, torch.bfloat16, 16),
        ("ct", -1, torch.float16, 64),
        ("gptq-act", 32, torch.float16, 16),
        ("gptq-act", 128, torch.bfloat16, 64),
    ],
)
def test_rows_layout(emulator, tmp_path, fmt, group_size, dtype, bm):
    res, ref = rows_case(emulator, tmp_path, fmt, group_size, dtype, bm)
    check_rows(res, ref)
    assert torch.all(torch.isnan(res["out"][2]))  # the row routed nowhere: never written
    counts = torch.bincount(res["ids"][res["ids"] >= 0].long(), minlength=3)
    assert counts.min() > 8  # every expert's first tile uses mma rows 8..15
    assert res["status"].tolist()[:2] == [tiles_for(res["ids"], 3, bm), 0]


@pytest.mark.parametrize("bm", [16, 64])
def test_skewed_duplicate_and_invalid_ids(emulator, tmp_path, bm):
    """40 rows all on expert 1 (several tiles, the last partial), a row naming one expert
    twice, expert 2 never used, ids outside [-1, E) skipped and counted in status[1]."""
    e, h, i = 4, 200, 136
    ex = make_experts("ct", 32, torch.bfloat16, e, h, i, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, h, generator=g).bfloat16()
    ids = torch.full((40, 3), -1, dtype=torch.int32)
    ids[:, 0] = 1
    ids[::3, 1] = 3
    ids[5] = torch.tensor([0, 0, 1])
    ids[7, 2], ids[9, 2], ids[11, 1] = 4, -2, 99  # invalid: skipped by the kernel
    wts = torch.rand(40, 3, generator=g)
    res = run_emulated(emulator, tmp_path, x, ex.w13, ex.w2, ids=ids, wts=wts, block_m=bm)
    valid = torch.where((ids >= -1) & (ids < e), ids, -1)
    ref = moe_int4_mlp_reference(x, valid, wts * (valid >= 0), ex.w13, ex.w2)
    check_close(res["out"], ref)
    n1, n3 = 40, len(range(0, 40, 3)) - 1  # ids[11, 1] replaced a 3
    tiles = 1 + -(-n1 // bm) + -(-n3 // bm)  # expert 0: one tile (row 5, twice)
    assert res["status"].tolist()[:3] == [tiles, 3, 40]  # tiles, invalid ids, active rows
    assert res["errors"].tolist() == [3]  # the host-visible flag the next call raises on


@pytest.mark.parametrize("bm", [16, 64])
def test_no_expert_routed(emulator, tmp_path, bm):
    ex = make_experts("awq", 32, torch.float16, 3, 128, 128, seed=5)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(6)).half()
    ids = torch.full((5, 2), -1, dtype=torch.int32)
    res = run_emulated(emulator, tmp_path, x, ex.w13, ex.w2, ids=ids, wts=torch.zeros(5, 2))
    assert torch.all(torch.isnan(res["out"]))  # nothing routed: nothing launched or written


@pytest.mark.parametrize(
    ("fmt", "bm", "dtype"),
    [("awq", 16, torch.bfloat16), ("ct", 16, torch.float16), ("gptq", 64, torch.float16)],
)
def test_expert_major(emulator, tmp_path, fmt, bm, dtype):
    e, cap, h, i = 4, 20, 136, 72
    ex = make_experts(fmt, 64, dtype, e, h, i, seed=7)
    x = torch.randn(e, cap, h, generator=torch.Generator().manual_seed(8)).to(dtype)
    counts = torch.tensor([2, 0, 20, 17], dtype=torch.int32)
    for j in range(e):  # like a dispatch buffer: garbage beyond each expert's count
        x[j, int(counts[j]) :] = float("nan")
    res = run_emulated(emulator, tmp_path, x, ex.w13, ex.w2, counts=counts, block_m=bm)
    out = res["out"].view_as(x)
    ref = moe_int4_mlp_expert_major_reference(x, counts, ex.w13, ex.w2)
    valid = torch.arange(cap)[None, :] < counts[:, None]
    check_close(out[valid], ref[valid])
    assert torch.all(torch.isnan(out[~valid]))  # rows past the counts: never written


def test_expert_major_bad_counts_are_clamped(emulator, tmp_path):
    e, cap, h, i = 3, 4, 64, 64
    ex = make_experts("ct", 32, torch.bfloat16, e, h, i, seed=9)
    x = torch.randn(e, cap, h, generator=torch.Generator().manual_seed(10)).bfloat16()
    counts = torch.tensor([-3, 9, 2], dtype=torch.int32)
    res = run_emulated(emulator, tmp_path, x, ex.w13, ex.w2, counts=counts, block_m=16)
    clamped = torch.tensor([0, cap, 2], dtype=torch.int32)
    ref = moe_int4_mlp_expert_major_reference(x, clamped, ex.w13, ex.w2)
    valid = torch.arange(cap)[None, :] < clamped[:, None]
    check_close(res["out"].view_as(x)[valid], ref[valid])
    assert res["status"].tolist()[:2] == [2, 2]
    assert res["errors"].tolist() == [2]  # the host-visible flag


def split_case(binary, workdir, bm, *, num_sms, per_sm, h=1024, i=512):
    """One row on one expert: few (tile, slice) items for many CTAs, so K is split."""
    e = 2
    ex = make_experts("ct", 32, torch.bfloat16, e, h, i, seed=11)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(3, h, generator=g).bfloat16()
    ids = torch.tensor([[1, -1], [-1, -1], [1, 0]], dtype=torch.int32)
    wts = torch.tensor([[0.7, 0.0], [0.0, 0.0], [0.2, 0.5]])
    res = run_emulated(
        binary,
        workdir,
        x,
        ex.w13,
        ex.w2,
        ids=ids,
        wts=wts,
        block_m=bm,
        num_sms=num_sms,
        per_sm=per_sm,
    )
    res["ids"] = ids
    return res, moe_int4_mlp_reference(x, ids, wts, ex.w13, ex.w2)


@pytest.mark.parametrize(
    ("bm", "num_sms", "per_sm"),
    [
        (16, 8, 4),  # 32 CTAs: gate/up 4 items x 16 k-tiles over 16 CTAs, down over 8
        (16, 2, 8),  # 16 CTAs, 8 workspace slots: the gate/up split is clamped to 8 CTAs
        (64, 4, 2),  # block_m 64 splits too (its own workspace)
        (16, 3, 5),  # odd CTA count: uneven parts that start inside items
    ],
)
def test_split_k(emulator, tmp_path, bm, num_sms, per_sm):
    kw = dict(h=512, i=256) if bm == 64 else {}  # (a 64-row tile emulates 4x the MMA work)
    res, ref = split_case(emulator, tmp_path, bm, num_sms=num_sms, per_sm=per_sm, **kw)
    check_rows(res, ref)  # (run_emulated checks that the workspace is left zeroed)


def test_rejected_arguments_come_from_validate_h(emulator, tmp_path):
    """The emulated launch runs moe_int4's own argument checks."""
    ex = make_experts("ct", 32, torch.bfloat16, 2, 64, 64, seed=13)
    x = torch.randn(2, 64).bfloat16()
    ids = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(EmulatorError, match="needs 77824 bytes of shared memory"):
        run_emulated(
            emulator,
            tmp_path,
            x,
            ex.w13,
            ex.w2,
            ids=ids,
            wts=torch.ones(2, 1),
            block_m=64,
            smem_optin=65536,
        )


def test_block_m_64_with_zero_points_is_refused(emulator, tmp_path):
    """No 64-row zero-point instantiation: the Python side and validate.h both refuse."""
    ex = make_experts("awq", 64, torch.float16, 2, 64, 64, seed=24)
    x = torch.randn(2, 64).half()
    ids = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_m=64 is not available with zero points"):
        run_emulated(
            emulator, tmp_path, x, ex.w13, ex.w2, ids=ids, wts=torch.ones(2, 1), block_m=64
        )
    assert M.choose_block_m(500, zero_points=True) == 16


def test_routing_slices_need_only_scalar_alignment(emulator, tmp_path):
    """Routing tensors are read as 4-byte scalars: a slice 8 bytes into an allocation (e.g.
    ids[1:] of a top-2 tensor) must run; activations are read with 16-byte cp.async and an
    8-byte offset must be rejected with an error naming them."""
    ex = make_experts("ct", 32, torch.bfloat16, 3, 128, 128, seed=18)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(19)).bfloat16()
    ids, wts = routing(9, 2, 3, seed=20)
    res = run_emulated(
        emulator,
        tmp_path / "ok",
        x,
        ex.w13,
        ex.w2,
        ids=ids,
        wts=wts,
        offsets={"topk_ids": 8, "topk_weights": 4},
    )
    res["ids"] = ids
    check_rows(res, moe_int4_mlp_reference(x, ids, wts, ex.w13, ex.w2))
    with pytest.raises(EmulatorError, match="x=0x[0-9a-f]+ is not 16-byte aligned"):
        run_emulated(
            emulator, tmp_path / "bad", x, ex.w13, ex.w2, ids=ids, wts=wts, offsets={"x": 8}
        )


# ---- the emulation catches kernel mistakes -------------------------------------------------
# Each mutation is a plausible slip in the kernel (file, exact text, replacement); the
# scenario that should expose it must then fail (wrong numbers, a fault, or a deadlock).
MUTATIONS = [
    # B fragment: registers b0/b1 swapped (k rows 0-7 vs 8-15)
    (
        "gemm_kernel.cuh",
        "b[t / 2][t % 2][0], b[t / 2][t % 2][1]",
        "b[t / 2][t % 2][1], b[t / 2][t % 2][0]",
        "rows16",
    ),
    # A fragment (ldmatrix): matrices 1 (rows 8-15) and 2 (columns 8-15) swapped
    (
        "gemm_kernel.cuh",
        "(lane % 16) * kARowStride + (lane / 16) * 8;",
        "(lane % 8 + (lane / 16) * 8) * kARowStride + ((lane / 8) % 2) * 8;",
        "rows16",
    ),
    # scales: lane group offset taken from the wrong index
    (
        "gemm_kernel.cuh",
        "warp * kTileN + 8 * (lane / 4)) * 2",
        "warp * kTileN + 8 * (lane % 4)) * 2",
        "rows16",
    ),
    # scales: second group row of a k-tile (group 32) ignored
    (
        "gemm_kernel.cuh",
        "group_consts(ss, s / 2 * (kGroup32 ? 1 : 0)",
        "group_consts(ss, 0 * (kGroup32 ? 1 : 0)",
        "rows16",
    ),
    # weights: global word off by one warp tile
    ("gemm_kernel.cuh", "(nb * kWarps * 128 + tid * 4) * 4", "(nb * 128 + tid * 4) * 4", "rows16"),
    # pipeline: waiting for one group too few (reads a stage before it lands)
    ("gemm_kernel.cuh", "cp_async_wait<kStages - 2>();", "cp_async_wait<kStages - 1>();", "rows16"),
    # SiLU epilogue pairs gate with the gate tile instead of the up tile
    ("gemm_kernel.cuh", "* acc[mb][t + 4][2 * half];", "* acc[mb][t][2 * half];", "rows16"),
    # A rows of the second 16-row block (block_m 64) copied from the wrong rows
    (
        "gemm_kernel.cuh",
        "i * (kThreads / 8);\n      const int32_t pair",
        "i * 8;\n      const int32_t pair",
        "rows64",
    ),
    # block_m 64: the A fragment of 16-row block mb read from block 0
    ("gemm_kernel.cuh", "a_s + mb * 16 * kARowStride", "a_s", "rows64"),
    # split-K: the last part does not re-zero the workspace
    ("gemm_kernel.cuh", "__stcg(w, 0.0f);", "(void)w;", "split"),
    # stream-K: the owner of a CTA's first unit taken as the CTA before (the float
    # estimate's correction stops one short: wrong part count of split items)
    (
        "gemm_kernel.cuh",
        "begin(b + 1) <= v) ++b;",
        "begin(b + 1) < v) ++b;",
        "split_odd",
    ),
    # stream-K: a segment drops its last k-tile (a mutant must not hang: no change to u)
    (
        "gemm_kernel.cuh",
        "for (int kt = kb; kt < ke; ++kt) {",
        "for (int kt = kb; kt + 1 < ke; ++kt) {",
        "split_uneven",
    ),
    # workspace: more CTAs than slots (slot index past the workspace)
    (
        "gemm_kernel.cuh",
        "grid > p.ws_items) grid = static_cast<int32_t>(p.ws_items);",
        "grid > p.ws_items) grid = grid;",
        "split64",
    ),
    # expert-major: split items stored without reduction
    (
        "gemm_kernel.cuh",
        "needs_ws = p.epilogue != Epilogue::kWeightedAtomic;",
        "needs_ws = p.epilogue == Epilogue::kSiluMulStore;",
        "em_split",
    ),
    # zero points ignored (the symmetric 8 is not subtracted either)
    ("gemm_kernel.cuh", "zlo[t] = __hadd2(magic, z);", "zlo[t] = magic;", "zp"),
    # fp16 odd nibbles: the 1/16 of the in-place high nibble dropped
    ("gemm_kernel.cuh", "fma2(hi, sixteenth, zhi[t])", "__hadd2(hi, zhi[t])", "rows16_fp16"),
    # group 128: shift of the group index off by one (group taken as 64)
    ("moe_int4.cuh", "while ((1 << s) < group) ++s;", "while ((1 << s) < group / 2) ++s;", "zp"),
    # finalise: a (row, column block) converted one k-tile before it is complete
    (
        "gemm_kernel.cuh",
        "p.row_pairs[orow] * (p.k_pad / kBlockK);",
        "p.row_pairs[orow] * (p.k_pad / kBlockK) - 1;",
        "split",
    ),
    # zeroing: only half of the active rows' accumulator zeroed
    (
        "gemm_kernel.cuh",
        "for (int32_t r = blockIdx.x; r < n; r += gridDim.x)",
        "for (int32_t r = blockIdx.x; r < n / 2; r += gridDim.x)",
        "rows16",
    ),
    # L2 prefetch of the down weights: expert index off by one (past the last expert)
    (
        "gemm_kernel.cuh",
        "base + e * p.prefetch_expert_bytes;",
        "base + (e + 1) * p.prefetch_expert_bytes;",
        "rows16",
    ),
    # prologue: the weights of stage 1 and 2 copied into stage 0 (weights before rows)
    (
        "gemm_kernel.cuh",
        "if (kb + st < ke) cta.load_weights(st, kb + st);",
        "if (kb + st < ke) cta.load_weights(0, kb + st);",
        "rows16",
    ),
    # act-order: A gathered through the permutation shifted by one column
    (
        "schedule.cuh",
        "const int32_t c = pe[i % k_pad];",
        "const int32_t c = pe[(i + 1) % k_pad];",
        "act",
    ),
    # fp16 outputs not saturated (inf instead of 65504)
    (
        "gemm_kernel.cuh",
        "return from_float2(sat(a), sat(b));",
        "return from_float2(a, b);",
        "fp16_sat",
    ),
    # schedule: the last tile of an expert claims a full block_m rows
    ("schedule.cuh", "min(block_m, cnt[e] - start)", "block_m", "rows16"),
]


def fp16_overflow_case(binary, workdir):
    """fp16 outputs beyond 65504 must saturate, not become inf (one row, large weights)."""
    ex = make_experts("ct", 32, torch.float16, 1, 256, 256, seed=21)
    x = torch.full((1, 256), 8.0).half()
    ids, wts = torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), 4096.0)
    res = run_emulated(binary, workdir, x, ex.w13, ex.w2, ids=ids, wts=wts)
    ref = moe_int4_mlp_reference(x, ids, torch.ones(1, 1), ex.w13, ex.w2).float() * 4096.0
    big = ref.abs() > 65504
    assert big.any(), "the case must overflow fp16"
    out = res["out"].float()
    assert torch.isfinite(out).all(), "fp16 overflow gave inf"
    assert torch.all(out[big].abs() == 65504)


def expert_major_split_case(binary, workdir):
    """Expert-major, one row on one expert, many CTAs: the store epilogue's items split."""
    e, cap, h, i = 2, 3, 1024, 512
    ex = make_experts("ct", 32, torch.bfloat16, e, h, i, seed=22)
    x = torch.randn(e, cap, h, generator=torch.Generator().manual_seed(23)).bfloat16()
    counts = torch.tensor([1, 0], dtype=torch.int32)
    res = run_emulated(binary, workdir, x, ex.w13, ex.w2, counts=counts, num_sms=8, per_sm=4)
    ref = moe_int4_mlp_expert_major_reference(x, counts, ex.w13, ex.w2)
    check_close(res["out"].view_as(x)[0, :1], ref[0, :1])


def _scenario(binary, workdir, name):
    if name in ("rows16", "rows16_fp16", "zp", "act"):
        fmt, group, dtype = {
            "rows16": ("ct", 32, torch.bfloat16),
            "rows16_fp16": ("ct", 32, torch.float16),
            "zp": ("awq", 128, torch.bfloat16),
            "act": ("gptq-act", 32, torch.float16),
        }[name]
        res, ref = rows_case(binary, workdir, fmt, group, dtype, 16)
        check_rows(res, ref)
        return
    if name == "rows64":
        e, h, i = 2, 128, 128
        ex = make_experts("ct", 64, torch.bfloat16, e, h, i, seed=14)
        x = torch.randn(40, h, generator=torch.Generator().manual_seed(15)).bfloat16()
        ids = torch.zeros(40, 1, dtype=torch.int32)
        res = run_emulated(
            binary, workdir, x, ex.w13, ex.w2, ids=ids, wts=torch.ones(40, 1), block_m=64
        )
        ref = moe_int4_mlp_reference(x, ids, torch.ones(40, 1), ex.w13, ex.w2)
    elif name in ("split", "split_odd", "split64"):
        if name == "split":
            res, ref = split_case(binary, workdir, 16, num_sms=8, per_sm=4)
        elif name == "split_odd":  # 64 units over 9 CTAs: CTAs start inside items
            res, ref = split_case(binary, workdir, 16, num_sms=3, per_sm=3, h=512, i=512)
        else:  # 8 CTAs for 4 workspace slots
            res, ref = split_case(binary, workdir, 64, num_sms=2, per_sm=4, h=512, i=256)
        check_rows(res, ref)
        return
    elif name == "em_split":
        expert_major_split_case(binary, workdir)
        return
    elif name == "fp16_sat":
        fp16_overflow_case(binary, workdir)
        return
    else:  # w13 K = 1152: 18 k-tiles; 16 items of gate/up over 3 CTAs -> uneven parts
        e, h, i = 1, 1152, 256
        ex = make_experts("ct", 32, torch.bfloat16, e, h, i, seed=16)
        x = torch.randn(1, h, generator=torch.Generator().manual_seed(17)).bfloat16()
        ids, wts = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
        res = run_emulated(binary, workdir, x, ex.w13, ex.w2, ids=ids, wts=wts, num_sms=3)
        ref = moe_int4_mlp_reference(x, ids, wts, ex.w13, ex.w2)
    check_close(res["out"], ref)


SCENARIOS = sorted({m[3] for m in MUTATIONS})


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_mutation_scenarios_pass_on_the_real_kernel(emulator, tmp_path, scenario):
    _scenario(emulator, tmp_path, scenario)


def test_emulation_catches_kernel_mutations(emulator, tmp_path):
    """Compile the emulator against mutated copies of the kernel: every one must fail."""

    def build(n: int) -> Path:
        fname, old, new, _ = MUTATIONS[n]
        tree = tmp_path / f"m{n}"
        shutil.copytree(CSRC, tree / "csrc", ignore=shutil.ignore_patterns("transport", "*.cu"))
        mutate(tree / "csrc" / "cuda" / "moe_int4" / fname, old, new, f"mutation {n}")
        return build_emulator(tree / "emu", tree / "csrc", sanitize=False)

    def check(n: int, binary: Path) -> None:
        _scenario(binary, tmp_path / f"m{n}" / "run", MUTATIONS[n][3])

    missed = missed_mutations(MUTATIONS, build, check, (AssertionError, EmulatorError))
    assert not missed, "mutations the emulation did not detect:\n" + "\n".join(missed)


def test_emulated_sources_are_the_kernel():
    """The emulation replaces device_ops.cuh only; the GEMM and schedule use nothing else
    that is device specific (no inline PTX outside device_ops.cuh)."""
    for name in ("gemm_kernel.cuh", "schedule.cuh", "moe_int4.cuh", "layout.h", "validate.h"):
        text = (CSRC / "cuda" / "moe_int4" / name).read_text()
        assert not re.search(r"\basm\b", text), f"{name} has inline PTX outside device_ops.cuh"
    emu_ops = (EMU / "override" / "cuda" / "moe_int4" / "device_ops.cuh").read_text()
    real_ops = (CSRC / "cuda" / "moe_int4" / "device_ops.cuh").read_text()
    names = ("dynamic_smem", "lop3_and_or", "cp_async16", "cp_async_commit", "cp_async_wait")
    extra = ("prmt", "fma2", "ldmatrix_x4", "grid_dependency_wait", "grid_dependency_launch")
    extra += ("atomic_add_acq_rel", "prefetch_l2")
    for fn in (*names, *extra, "mma_16816"):
        assert re.search(rf"\b{fn}\b", real_ops) and re.search(rf"\b{fn}\b", emu_ops), fn
