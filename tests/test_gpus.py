"""The one GPU table (pcie_a2a/gpus.py): its numbers are the datasheets', and the plan, the
balancer's cost and the INT4 kernel's grid model read it rather than keep their own."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from pcie_a2a import gpus
from pcie_a2a.balance import cost
from pcie_a2a.quant import grid_model as G

ROOT = Path(__file__).resolve().parents[1]

# key: (DRAM GB/s, dense bf16 TFLOP/s, SMs, L2 MB), as the vendors publish them
# (RTX Blackwell, Ada and Hopper whitepapers; L40S and H100/H200 datasheets; A6000: GA102
# whitepaper, no grid-model entry). SMs = CUDA cores / 128.
DATASHEETS = [
    ("rtx-pro-6000", 1792, 500.0, 24064 // 128, 128),
    ("rtx-5090", 1792, 209.5, 21760 // 128, 96),
    ("rtx-4090", 1008, 165.2, 16384 // 128, 72),
    ("l40s", 864, 362.05, 18176 // 128, 96),
    ("h100-pcie", 2000, 756.5, 14592 // 128, 50),
    ("h200", 4800, 989.5, 16896 // 128, 50),
    ("a6000", 768, 154.8, None, None),
]


@pytest.mark.parametrize(("key", "gbps", "bf16", "sms", "l2"), DATASHEETS)
def test_every_reader_sees_the_datasheet(key, gbps, bf16, sms, l2):
    g = gpus.get_gpu(key)
    assert (g.bandwidth_gbps, g.peak_tflops("bf16"), g.sms, g.l2_mb) == (gbps, bf16, sms, l2)
    assert cost.GPUS[key] == (gbps, bf16)
    grid = G.GPUS.get(key.replace("-", "_"))
    if sms is None:
        assert grid is None and not g.grid_modelled
    else:
        assert (grid.bw_gbs, grid.sms, grid.l2_mb, grid.arch) == (gbps, sms, l2, g.arch)
        assert g.grid_source, key


def test_the_grid_model_loaded_by_path_reads_the_same_table():
    """scripts/sass_report.py loads grid_model.py by path, without the package."""
    spec = importlib.util.spec_from_file_location(
        "_test_grid_by_path", ROOT / "python" / "pcie_a2a" / "quant" / "grid_model.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    assert {k: tuple(vars(v).values()) for k, v in mod.GPUS.items()} == {
        k: tuple(vars(v).values()) for k, v in G.GPUS.items()
    }


def test_no_other_module_keeps_gpu_numbers():
    """A DRAM bandwidth of the table written as a literal anywhere else in the package is a
    second table in the making (768, the A6000's, is also a model width: left out)."""
    figures = {str(g.bandwidth_gbps) for g in gpus.GPUS.values() if g.bandwidth_gbps != 768}
    pattern = re.compile(r"(?<![\w.])(" + "|".join(sorted(figures)) + r")(\.0)?(?![\w.])")
    hits = []
    for path in sorted((ROOT / "python" / "pcie_a2a").rglob("*.py")):
        if path.name == "gpus.py" and path.parent.name == "pcie_a2a":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, hits


def test_unknown_gpu_is_named():
    with pytest.raises(ValueError, match=r"--gpu: got 'b200'; allowed: rtx-pro-6000"):
        gpus.get_gpu("b200")
