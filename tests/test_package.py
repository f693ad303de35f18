"""The package imports and reports its capabilities on a machine without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pcie_a2a


class _FakeCuda:
    """A stand-in for the compiled pcie_a2a._cuda: what its device query answers."""

    def __init__(self, count: int, err: str):
        self._answer = (count, err)

    def device_count(self):
        return self._answer


@pytest.mark.parametrize(
    ("module", "want"),
    [
        (ImportError("No module named 'pcie_a2a._cuda'"),
         "the CUDA extension pcie_a2a._cuda is not in this build (built without nvcc, or with "
         "PCIE_A2A_WITH_CUDA=0): No module named 'pcie_a2a._cuda'"),
        (_FakeCuda(0, "cudaErrorNoDevice"), "no usable CUDA driver or device: cudaErrorNoDevice"),
        (_FakeCuda(0, ""), "no CUDA device is visible"),
    ],
)  # fmt: skip
def test_each_cause_of_no_cuda_has_its_reason(monkeypatch, module, want):
    from pcie_a2a import _native

    def fake_import(name):
        assert name == "pcie_a2a._cuda"
        if isinstance(module, Exception):
            raise module
        return module

    monkeypatch.setattr(_native.importlib, "import_module", fake_import)
    _native._cuda_module.cache_clear()
    _native._cuda_status.cache_clear()
    try:
        assert (_native.cuda_available(), _native.cuda_unavailable_reason()) == (False, want)
    finally:
        monkeypatch.undo()
        _native._cuda_module.cache_clear()
        _native._cuda_status.cache_clear()
    assert (pcie_a2a.cuda_unavailable_reason() == "") == pcie_a2a.cuda_available()


_BLOCK_TORCH_AND_EXTENSION = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch" or (name.startswith("pcie_a2a._") and name != "pcie_a2a._native"):
            raise ImportError("unavailable in this test: " + name)
sys.meta_path.insert(0, Block())
from pcie_a2a.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["topo", "--from", "{fixtures}/4x-l40s-dual-socket.topo.txt"],
        ["plan", "--model", "kimi-k2.6", "--gpus", "8"],
        ["balance", "--help"],
        ["bench", "--help"],
    ],
)
def test_pure_python_tools_run_without_torch_or_the_extension(argv):
    """``pcie-a2a topo``, ``plan`` and ``balance`` are pure Python: the package must import
    and run them with torch and every compiled module unimportable."""
    from topology_fixtures import FIXTURES

    argv = [a.format(fixtures=FIXTURES) for a in argv]
    out = subprocess.run([sys.executable, "-c", _BLOCK_TORCH_AND_EXTENSION, *argv],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "unavailable in this test" not in out.stderr
    assert out.stdout.strip()


def test_command_line_lists_its_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "pcie_a2a", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "bench" in out.stdout and "topo" in out.stdout


def test_cuda_backend_request_is_a_clear_error_without_the_transport(single_rank_group):
    import pytest

    if pcie_a2a.cuda_available():
        pytest.skip("a GPU is present: the CUDA backend is exercised by the GPU tests")
    with pytest.raises(ValueError, match="backend='cuda'"):
        pcie_a2a.Buffer(None, 8, 128, 4, backend="cuda")
