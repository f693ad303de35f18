"""The compiled SASS of the INT4 MoE GEMM meets its budget (scripts/sass_report.py).

On the built extension (CI builds sm_90 and sm_120 cubins) plus sm_89 cubins compiled
here from the generated instantiations (device code only): every instantiation's main
loop costs at most 600 instructions per warp per 64-deep k-tile, has no nested loop, and
nothing spills; and the grid model's instruction and register costs are not below what
was compiled. Needs cuobjdump (CUDA toolkit, or the nvidia-cuda-cuobjdump wheel that
.ci/run installs); no GPU. The parser tests below show the check fails on bad SASS.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

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


def _loop(n_other: int, hmma: int = 32, extra: list[str] | None = None) -> list[str]:
    body = ["MOV R1, R2"]  # 0x0: before the loop
    head = len(body)
    body += ["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * hmma
    body += ["LOP3.LUT R3, R3, 0xf000f, R5, 0xea, !PT"] * n_other
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
    assert S.problems(rows, 600) == []


def test_unrolled_loop_is_scaled_to_one_k_tile():
    rows = _rows(_sass(_loop(600, hmma=64)))  # two k-tiles per trip
    assert rows[0].loop.per_k_tile == (64 + 600 + 1) / 2


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
    no_loop = _rows(_sass(["HMMA.16816.F32.BF16 R4, R8, R12, R4", "EXIT"]))
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
        pytest.skip("cuobjdump not found (CUDA toolkit or pip install nvidia-cuda-cuobjdump)")
    so = _so()
    nvcc = S.find_tool("nvcc")
    if so is None and nvcc is None:
        pytest.skip("neither a built _moe_int4 nor nvcc to compile its SASS")
    archs = ["sm_89"] if nvcc else []
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
        assert r.loop.per_k_tile <= GM.NEW_INSTR_PER_K_TILE[r.block_m], (r.arch, r.variant)
        assert r.regs <= GM.NEW_REGS[r.block_m], (r.arch, r.variant)
        if r.block_m == 16:  # decode: two CTAs per sm_89/120 SM, four per sm_90 SM
            assert r.ctas_per_sm == (4 if r.arch == "sm_90" else 2), (r.arch, r.variant)
