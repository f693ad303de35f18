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

from native_emulation import compiler, missed_mutations, mutate
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
        pytest.skip("no host C++ compiler (c++/g++) to build the kernel emulation")
    if not all((CSRC / "cuda" / "moe_int4" / s).is_file() for s in SOURCES):
        pytest.skip("the kernel sources are not in this checkout")
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
    # Like _moe_int4_mlp_op / _moe_int4_mlp_expert_major_op: empty_like / zeros_like.
    out = torch.zeros_like(x) if expert_major else _garbage(*x.shape, dtype=x.dtype)
    fields = M._launch_fields(
        x,
        out,
        w13,
        w2,
        expert_major=expert_major,
        topk_ids=ids,
        topk_weights=wts,
        counts=counts,
        block_m=block_m,
        num_sms=num_sms,
        empty=_garbage,
        zeros=lambda *shape, dtype: torch.zeros(*shape, dtype=dtype),
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
        ("awq", 128, torch.bfloat16, 64),
        ("gptq", 128, torch.float16, 16),
        ("gptq", -1, torch.bfloat16, 16),
        ("ct", -1, torch.float16, 64),
        ("gptq-act", 32, torch.float16, 16),
        ("gptq-act", 128, torch.bfloat16, 64),
    ],
)
def test_rows_layout(emulator, tmp_path, fmt, group_size, dtype, bm):
    res, ref = rows_case(emulator, tmp_path, fmt, group_size, dtype, bm)
    check_close(res["out"], ref)
    assert torch.all(res["out"][2] == 0)  # the row routed nowhere
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
    assert res["status"].tolist()[:2] == [tiles, 3]


@pytest.mark.parametrize("bm", [16, 64])
def test_no_expert_routed(emulator, tmp_path, bm):
    ex = make_experts("awq", 32, torch.float16, 3, 128, 128, seed=5)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(6)).half()
    ids = torch.full((5, 2), -1, dtype=torch.int32)
    res = run_emulated(emulator, tmp_path, x, ex.w13, ex.w2, ids=ids, wts=torch.zeros(5, 2))
    assert torch.all(res["out"] == 0)
    assert res["status"].tolist()[:2] == [0, 0]


@pytest.mark.parametrize(("bm", "dtype"), [(16, torch.bfloat16), (64, torch.float16)])
def test_expert_major(emulator, tmp_path, bm, dtype):
    e, cap, h, i = 4, 20, 136, 72
    ex = make_experts("awq", 64, dtype, e, h, i, seed=7)
    x = torch.randn(e, cap, h, generator=torch.Generator().manual_seed(8)).to(dtype)
    counts = torch.tensor([2, 0, 20, 17], dtype=torch.int32)
    for j in range(e):  # like a dispatch buffer: garbage beyond each expert's count
        x[j, int(counts[j]) :] = float("nan")
    res = run_emulated(emulator, tmp_path, x, ex.w13, ex.w2, counts=counts, block_m=bm)
    out = res["out"].view_as(x)
    check_close(out, moe_int4_mlp_expert_major_reference(x, counts, ex.w13, ex.w2))
    for j in range(e):
        assert torch.all(out[j, int(counts[j]) :] == 0)


def test_expert_major_bad_counts_are_clamped(emulator, tmp_path):
    e, cap, h, i = 3, 4, 64, 64
    ex = make_experts("ct", 32, torch.bfloat16, e, h, i, seed=9)
    x = torch.randn(e, cap, h, generator=torch.Generator().manual_seed(10)).bfloat16()
    counts = torch.tensor([-3, 9, 2], dtype=torch.int32)
    res = run_emulated(emulator, tmp_path, x, ex.w13, ex.w2, counts=counts, block_m=16)
    clamped = torch.tensor([0, cap, 2], dtype=torch.int32)
    ref = moe_int4_mlp_expert_major_reference(x, clamped, ex.w13, ex.w2)
    check_close(res["out"].view_as(x), ref)
    assert res["status"].tolist()[:2] == [2, 2]


def split_case(binary, workdir, bm, *, num_sms, per_sm, k_mult=1):
    """One row on one expert: few (tile, slice) items for many CTAs, so K is split."""
    e, h, i = 2, 1024 * k_mult, 512
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
    return res, moe_int4_mlp_reference(x, ids, wts, ex.w13, ex.w2)


@pytest.mark.parametrize(
    ("bm", "num_sms", "per_sm"),
    [
        (16, 8, 4),  # 8 gate/up items <= 16 slots, 32 CTAs: both GEMMs split 4 / 2 ways
        (16, 2, 8),  # 8 items > 4 slots: gate/up does not split, down splits 2 ways
        (64, 8, 2),  # no workspace at block_m 64: only the down GEMM splits
        (16, 3, 5),  # odd CTA count: uneven K parts
    ],
)
def test_split_k(emulator, tmp_path, bm, num_sms, per_sm):
    res, ref = split_case(emulator, tmp_path, bm, num_sms=num_sms, per_sm=per_sm)
    check_close(res["out"], ref)
    if "split_ws" in res:  # the workspace and tickets are left zeroed for the next launch
        assert torch.all(res["split_ws"] == 0) and torch.all(res["split_cnt"] == 0)


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
    check_close(res["out"], moe_int4_mlp_reference(x, ids, wts, ex.w13, ex.w2))
    with pytest.raises(EmulatorError, match="x=0x[0-9a-f]+ is not 16-byte aligned"):
        run_emulated(
            emulator, tmp_path / "bad", x, ex.w13, ex.w2, ids=ids, wts=wts, offsets={"x": 8}
        )


# ---- the emulation catches kernel mistakes -------------------------------------------------
# Each mutation is a plausible slip in the kernel (file, exact text, replacement); the
# scenario that should expose it must then fail (wrong numbers, a fault, or a deadlock).
MUTATIONS = [
    # B fragment: registers b0/b1 swapped (k rows 0-7 vs 8-15)
    ("gemm_kernel.cuh", "af, b[t][0], b[t][1]", "af, b[t][1], b[t][0]", "rows16"),
    # A fragment: a1 (row g+8) and a2 (column +8) swapped
    (
        "gemm_kernel.cuh",
        "af[1] = *reinterpret_cast<const uint32_t*>(r1);",
        "af[1] = *reinterpret_cast<const uint32_t*>(r0 + 8);",
        "rows16",
    ),
    # scales: lane group offset taken from the wrong index
    ("gemm_kernel.cuh", "warp * kTileN + 8 * g) * 2", "warp * kTileN + 8 * c) * 2", "rows16"),
    # scales: second group row of a k-tile (group 32) ignored
    ("gemm_kernel.cuh", "/ p.group - g0;", "/ p.group - g0 - (s / 2);", "rows16"),
    # weights: global word of a k16 row off by one warp tile
    (
        "gemm_kernel.cuh",
        "nb * kWarps, n_tiles, 0, 0) + w * 4",
        "nb, n_tiles, 0, 0) + w * 4",
        "rows16",
    ),
    # pipeline: waiting for one group too few (reads a stage before it lands)
    ("gemm_kernel.cuh", "cp_async_wait<kStages - 2>();", "cp_async_wait<kStages - 1>();", "rows16"),
    # SiLU epilogue pairs gate with the gate tile instead of the up tile
    ("gemm_kernel.cuh", "* acc[mb][t + 4][2 * half];", "* acc[mb][t][2 * half];", "rows16"),
    # A rows of the second 16-row block (block_m 64) copied from the wrong rows
    (
        "gemm_kernel.cuh",
        "threadIdx.x) / 8 + i * (kThreads / 8);",
        "threadIdx.x) / 8 + i * 8;",
        "rows64",
    ),
    # split-K: the last part does not re-zero the workspace
    ("gemm_kernel.cuh", "__stcg(w, 0.0f);", "(void)w;", "split"),
    # split-K: K parts drop the remainder
    (
        "gemm_kernel.cuh",
        "kt_end = (part + 1) * k_tiles / splits;",
        "kt_end = kt_begin + k_tiles / splits;",
        "split_uneven",
    ),
    # schedule: the last tile of an expert claims a full block_m rows
    ("schedule.cuh", "min(block_m, cnt[e] - start)", "block_m", "rows16"),
]


def _scenario(binary, workdir, name):
    if name == "rows16":
        res, ref = rows_case(binary, workdir, "ct", 32, torch.bfloat16, 16)
    elif name == "rows64":
        e, h, i = 2, 128, 128
        ex = make_experts("ct", 64, torch.bfloat16, e, h, i, seed=14)
        x = torch.randn(40, h, generator=torch.Generator().manual_seed(15)).bfloat16()
        ids = torch.zeros(40, 1, dtype=torch.int32)
        res = run_emulated(binary, workdir, x, ex.w13, ex.w2, ids=ids, wts=torch.ones(40, 1))
        ref = moe_int4_mlp_reference(x, ids, torch.ones(40, 1), ex.w13, ex.w2)
    elif name == "split":
        res, ref = split_case(binary, workdir, 16, num_sms=8, per_sm=4)
        assert torch.all(res["split_ws"] == 0)
    else:  # w13 K = 1152: 18 k-tiles in 4 parts (4, 5, 4, 5)
        e, h, i = 1, 1152, 256
        ex = make_experts("ct", 32, torch.bfloat16, e, h, i, seed=16)
        x = torch.randn(1, h, generator=torch.Generator().manual_seed(17)).bfloat16()
        ids, wts = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
        res = run_emulated(binary, workdir, x, ex.w13, ex.w2, ids=ids, wts=wts, num_sms=3)
        ref = moe_int4_mlp_reference(x, ids, wts, ex.w13, ex.w2)
    check_close(res["out"], ref)


@pytest.mark.parametrize("scenario", ["rows16", "rows64", "split", "split_uneven"])
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
    for fn in (*names, "mma_16816"):
        assert re.search(rf"\b{fn}\b", real_ops) and re.search(rf"\b{fn}\b", emu_ops), fn
