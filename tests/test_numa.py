"""NUMA-bound staging memory (native _numa): bind + first touch + verify on this machine's
node 0, the clean fallback when mbind is refused, and argument errors."""

from __future__ import annotations

import mmap
import os
import warnings

import numpy as np
import pytest

_numa = pytest.importorskip("pcie_a2a._numa", reason="native _numa module not built")

from pcie_a2a.topology import alloc_staging  # noqa: E402

PAGE = _numa.page_size()


def test_machine_facts():
    assert _numa.num_nodes() >= 1
    assert _numa.node_exists(0) and not _numa.node_exists(_numa.num_nodes() + 64)
    assert 0 <= _numa.node_of_current_cpu() < _numa.num_nodes()


def test_binds_and_verifies_on_node_0():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a successful bind must not warn
        buf = alloc_staging(3 * PAGE + 100, 0)
    assert (buf.bound, buf.node, buf.warning) == (True, 0, "")
    assert buf.nbytes == 3 * PAGE + 100 and buf.mapped_nbytes == 4 * PAGE
    assert buf.address % PAGE == 0
    assert [buf.node_of(k * PAGE) for k in range(4)] == [0, 0, 0, 0]
    view = np.frombuffer(buf, dtype=np.uint8)
    assert view.shape == (3 * PAGE + 100,) and not view.any()  # touched, still zero
    view[:] = 7
    assert int(np.frombuffer(buf, dtype=np.uint8).sum()) == 7 * (3 * PAGE + 100)


def test_refused_mbind_warns_and_leaves_memory_unbound():
    with pytest.warns(
        RuntimeWarning, match=r"mbind\(MPOL_BIND, node 0\).*refused.*EPERM.*CAP_SYS_NICE"
    ):
        buf = _numa.NumaBuffer(2 * PAGE, 0, simulate_refusal=True)
    assert buf.bound is False and buf.requested_node == 0
    assert "left unbound" in buf.warning
    assert buf.node == _numa.node_of_address(buf.address) >= 0  # first-touch placement
    np.frombuffer(buf, dtype=np.uint8)[:] = 1  # still usable memory


def test_unbound_request_just_touches():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buf = _numa.NumaBuffer(PAGE, -1)
    assert buf.bound is False and buf.warning == "" and buf.node >= 0


def test_bind_and_touch_on_a_shared_dev_shm_mapping():
    path = f"/dev/shm/pa2a_numa_test_{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4 * PAGE)
        m = mmap.mmap(fd, 4 * PAGE, mmap.MAP_SHARED)
        view = np.frombuffer(m, dtype=np.uint8)
        addr = view.ctypes.data
        r = _numa.bind_and_touch(addr, 4 * PAGE, 0)
        assert (r.bound, r.node, r.warning) == (True, 0, "")
        assert _numa.node_of_address(addr + 3 * PAGE) == 0
        with pytest.warns(RuntimeWarning, match="refused"):
            refused = _numa.bind_and_touch(addr, PAGE, 0, simulate_refusal=True)
        assert refused.bound is False
        del view
        m.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_argument_errors():
    with pytest.raises(
        ValueError, match=r"node=999 does not exist; this machine has \d+ NUMA node"
    ):
        _numa.NumaBuffer(PAGE, 999)
    with pytest.raises(ValueError, match="bytes must be > 0"):
        _numa.NumaBuffer(0, 0)
    with pytest.raises(ValueError, match="nbytes=0: expected a positive integer"):
        alloc_staging(0, 0)
    buf = _numa.NumaBuffer(PAGE, 0)
    with pytest.raises(ValueError, match="is not aligned to the page size"):
        _numa.bind_and_touch(buf.address + 8, 64, 0)
    with pytest.raises(ValueError, match="outside the buffer"):
        buf.node_of(PAGE)
