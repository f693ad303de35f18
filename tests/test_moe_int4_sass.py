"""The compiled SASS of the INT4 MoE GEMM meets its budget (scripts/sass_report.py).

On the built extension (CI builds sm_90 and sm_120 cubins; any other arch list works) plus
sm_89 cubins compiled here when the extension has none (device code only): every
instantiation's main loop costs at most 600 instructions per warp per 64-deep k-tile, has
no nested loop, waits for STAGES - 2 copy groups, issues one stage's async copies per
k-tile and no MEMBAR, nothing spills, and the prologue reaches its first weight copy
within the grid model's budget without a subroutine call; the grid model's costs are not
below what was compiled. Two mutants of one instantiation, compiled here with nvcc
(``cp_async_wait<0>``, a ``__threadfence()`` per k-tile), must fail the check. Needs
cuobjdump (CUDA toolkit, or the nvidia-cuda-cuobjdump wheel that .ci/run installs) and
nvcc; no GPU. They skip without them, and fail under PCIE_A2A_REQUIRE_NATIVE_TOOLS=1 (CI).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from native_emulation import mutate, skip_or_fail

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sass_report", ROOT / "scripts" / "sass_report.py")
S = importlib.util.module_from_spec(_spec)
sys.modules["sass_report"] = S
_spec.loader.exec_module(S)
GM = S.GM

KERNEL = "_ZN4pa2a8moe_int420moe_int4_gemm_kernelI13__nv_bfloat16Li16ELb0ELb1EEEvNS0_10GemmParamsE"


def _sass(body: list[str], name: str = KERNEL, arch: str = "sm_120") -> str:
    lines = [f"\tarch = {arch}", f"\t\tFunction : {name}"]
    for i, ins in enumerate(body):
        lines.append(f"        /*{16 * i:04x}*/                   {ins} ;   /* 0x0 */")
    return "\n".join(lines)


WEIGHT_COPY = "LDGSTS.E.BYPASS.128 [R87+0x900], desc[UR12][R106.64]"
ROW_COPY = "LDGSTS.E.BYPASS.128 [R17], desc[UR12][R6.64], P0"


def _loop(
    n_other: int,
    hmma: int = 32,
    extra: list[str] | None = None,
    wait: str = "DEPBAR.LE SB0, 0x2",
    copies: int = 6,
    prologue: list[str] | None = None,
) -> list[str]:
    """A kernel: a prologue (default: one LDG whose result addresses the first weight copy),
    then a loop of `hmma` HMMA, a wait, `copies` LDGSTS and `n_other` other instructions."""
    body = prologue or ["LDG.E R106, desc[UR12][R2.64]", "MOV R107, RZ", WEIGHT_COPY]
    head = len(body)
    body += [wait] + ["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * hmma
    body += [ROW_COPY] + [WEIGHT_COPY] * (copies - 1)
    body += ["LOP3.LUT R3, R3, 0xf000f, R5, 0xea, !PT"] * (n_other - 1 - copies)
    body += extra or []
    body.append(f"@P0 BRA 0x{16 * head:x}")
    body.append("EXIT")
    return body


def _rows(text: str, regs: int = 120):
    funcs = S.parse_sass(text)
    for f in funcs:
        f.regs = regs
    return S.report(funcs)


def test_parser_counts_a_loop_per_k_tile():
    rows = _rows(_sass(_loop(300)))
    assert len(rows) == 1 and rows[0].variant == "bf16 m16 sym g32"
    lp = rows[0].loop
    assert lp.found and lp.hmma == 32 and lp.per_k_tile == 32 + 300 + 1
    assert (lp.wait_depth, lp.copies_per_k_tile, lp.membars) == (2, 6, 0)
    pr = rows[0].prologue
    assert pr.found and (pr.instructions, pr.loads, pr.dependent_loads, pr.calls) == (2, 1, 1, 0)
    assert S.problems(rows, 600) == []


def test_unrolled_loop_is_scaled_to_one_k_tile():
    rows = _rows(_sass(_loop(600, hmma=64, copies=12)))  # two k-tiles per trip
    assert rows[0].loop.per_k_tile == (64 + 600 + 1) / 2
    assert rows[0].loop.copies_per_k_tile == 6


def _problem(text: str, **kw) -> list[str]:
    return S.problems(_rows(_sass(_loop(300, **kw))), 600)


def test_check_fails_on_the_pipeline_and_prologue_mutants():
    assert any("waits until 0 copy groups" in p for p in _problem("", wait="DEPBAR.LE SB0, 0x0"))
    assert any("waits for no copy group" in p for p in _problem("", wait="NOP"))
    assert any("MEMBAR in the main loop" in p for p in _problem("", extra=["MEMBAR.SC.GPU"]))
    assert any("5 async copies" in p for p in _problem("", copies=5))
    assert any("7 async copies" in p for p in _problem("", copies=7))
    slow = ["MOV R1, R2"] * (GM.PROLOGUE_INSTR + 1) + [WEIGHT_COPY]
    assert any("before the first weight copy" in p for p in _problem("", prologue=slow))
    call = ["CALL.REL.NOINC 0xe100", WEIGHT_COPY]
    assert any("subroutine call" in p for p in _problem("", prologue=call))
    # a zero-fill (activation) or guarded copy is not the first weight copy
    skipped = ["LDG.E R6, desc[UR12][R2.64]", ROW_COPY, "@!P2 " + WEIGHT_COPY, WEIGHT_COPY]
    assert _rows(_sass(_loop(300, prologue=skipped)))[0].prologue.instructions == 3
    chain = ["LDG.E R4, desc[UR12][R2.64]", "LDG.E R106, desc[UR12][R4.64]", WEIGHT_COPY]
    assert _rows(_sass(_loop(300, prologue=chain)))[0].prologue.dependent_loads == 2


def test_check_fails_over_budget_nested_loop_and_spills():
    over = _rows(_sass(_loop(700)))
    assert any("> 600" in p for p in S.problems(over, 600))
    nested = _loop(100)
    # a backward branch between the loop's own instructions, around no HMMA (e.g. a copy
    # loop whose trip count the static count cannot know)
    nested.insert(40, f"@P1 BRA 0x{16 * 36:x}")
    assert any("nested" in p for p in S.problems(_rows(_sass(nested)), 600))
    spill = _rows(_sass(_loop(100, extra=["STL [R1], R2"])))
    assert any("spills" in p for p in S.problems(spill, 600))
    no_loop = _rows(_sass([WEIGHT_COPY, "HMMA.16816.F32.BF16 R4, R8, R12, R4", "EXIT"]))
    assert any("no main loop" in p for p in S.problems(no_loop, 600))


def _so():
    try:
        import pcie_a2a._moe_int4  # noqa: F401
    except ImportError:
        return None
    return S.default_so()


@pytest.fixture(scope="module")
def compiled_rows():
    cuobjdump = S.find_tool("cuobjdump")
    if cuobjdump is None:
        skip_or_fail("cuobjdump not found (CUDA toolkit or pip install nvidia-cuda-cuobjdump)")
    so = _so()
    nvcc = S.find_tool("nvcc")
    if so is None and nvcc is None:
        skip_or_fail("neither a built _moe_int4 nor nvcc to compile its SASS")
    archs = ["sm_89"] if nvcc else []  # (not again when the extension has sm_89)
    return S.collect(so, archs, cuobjdump, nvcc, jobs=2)


def test_compiled_gemm_meets_the_budget(compiled_rows):
    rows = compiled_rows
    print("\n" + S.format_rows(rows))
    assert S.problems(rows, S.BUDGET) == []
    n_variants = 12  # dtype x (block_m 16 x zero points + block_m 64) x group 32
    for arch in {r.arch for r in rows}:
        assert len([r for r in rows if r.arch == arch]) == n_variants, arch


def test_grid_model_costs_are_not_below_the_sass(compiled_rows):
    for r in compiled_rows:
        where = (r.arch, r.variant)
        assert r.loop.per_k_tile <= GM.INSTR_PER_K_TILE[r.block_m], where
        assert r.regs <= GM.REGS[r.block_m], where
        assert r.prologue.instructions <= GM.PROLOGUE_INSTR, where
        assert r.prologue.dependent_loads <= GM.PROLOGUE_DEPENDENT_LOADS, where
        arch = GM.ARCHS.get(r.arch)
        if r.block_m == 16 and arch is not None:
            # decode: the compiled registers cost no CTA against the model's (two per
            # sm_89/120 SM, four per sm_90 SM)
            assert r.ctas_per_sm == GM.ctas_per_sm(arch, 16, GM.REGS[16]), where
            documented = {"sm_90": 4, "sm_89": 2, "sm_120": 2}
            assert r.ctas_per_sm == documented.get(r.arch, r.ctas_per_sm), where


# Plausible slips that keep the results right and ruin the bandwidth: the emulation cannot
# see them, only the SASS check.
SASS_MUTANTS = [
    ("sm_90", "cp_async_wait<kStages - 2>();  // stage", "cp_async_wait<0>();  // stage", "waits until 0"),
    (
        "sm_120",
        "      cta.compute_stage(st_use, acc);\n",
        "      cta.compute_stage(st_use, acc);\n      __threadfence();\n",
        "MEMBAR in the main loop",
    ),
]  # fmt: skip
MUTANT_VARIANT = "bf16_m16_sym_g32"


def test_sass_check_fails_on_seeded_mutants(tmp_path):
    """One instantiation compiled three times: unchanged (passes), and with each mutant
    (the check must name it)."""
    cuobjdump, nvcc = S.find_tool("cuobjdump"), S.find_tool("nvcc")
    if cuobjdump is None or nvcc is None:
        skip_or_fail("nvcc and cuobjdump are needed to compile and read the mutants")

    def rows(n: int):
        tree = tmp_path / f"m{n}" / "csrc"
        shutil.copytree(S.ROOT / "csrc", tree, ignore=shutil.ignore_patterns("transport"))
        arch = SASS_MUTANTS[max(n, 0)][0]
        if n >= 0:
            _, old, new, _ = SASS_MUTANTS[n]
            mutate(tree / "cuda" / "moe_int4" / "gemm_kernel.cuh", old, new, f"sass mutant {n}")
        return S.collect(None, [arch], cuobjdump, nvcc, 1, tree, MUTANT_VARIANT)

    with ThreadPoolExecutor(max_workers=2) as pool:
        clean, *mutants = pool.map(rows, range(-1, len(SASS_MUTANTS)))
    assert len(clean) == 1 and S.problems(clean, S.BUDGET) == []
    for (arch, _, _, message), got in zip(SASS_MUTANTS, mutants, strict=True):
        assert len(got) == 1 and got[0].arch == arch
        bad = S.problems(got, S.BUDGET)
        assert any(message in b for b in bad), (arch, message, bad)
