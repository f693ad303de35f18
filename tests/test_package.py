"""The package imports and reports its capabilities on a machine without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pcie_a2a


def test_cuda_availability_is_reported_with_a_reason():
    available = pcie_a2a.cuda_available()
    assert isinstance(available, bool)
    reason = pcie_a2a.cuda_unavailable_reason()
    assert (reason == "") == available
    if not available:
        assert len(reason) > 10


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
