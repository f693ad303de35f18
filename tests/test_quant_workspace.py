"""The INT4 kernel's persistent workspace under CUDA graphs (issue 20 §3), on the CPU: a
growth never frees what an earlier graph points at, nothing grows inside a capture, and
eager calls size the graph workspace a later capture uses."""

from __future__ import annotations

import pytest
import torch

from pcie_a2a.quant import moe as M


def _ws(capturing, mirror=None):
    zeros = lambda *s, dtype: torch.zeros(*s, dtype=dtype)  # noqa: E731
    return M.Workspace(zeros, torch.zeros(1, dtype=torch.int32), capturing, mirror)


def test_growth_keeps_the_buffer_an_earlier_graph_points_at():
    ws = _ws(lambda: False)
    small = ws.get("row_cnt", 8, torch.int32)
    small_ptr = small.data_ptr()
    big = ws.get("row_cnt", 64, torch.int32)
    assert big.numel() == 64 and big.data_ptr() != small_ptr
    assert any(t.data_ptr() == small_ptr for t in ws.retired)  # still alive
    assert ws.get("row_cnt", 16, torch.int32) is big  # fits: no new allocation


def test_no_allocation_inside_a_capture():
    state = {"capturing": False}
    graph = _ws(lambda: state["capturing"])
    eager = _ws(lambda: state["capturing"], mirror=graph)
    eager.get("split_ws16", 4096, torch.float32)  # an eager call sizes both
    sized = graph.get("split_ws16", 4096, torch.float32)
    state["capturing"] = True
    assert graph.get("split_ws16", 4096, torch.float32) is sized  # sized before: fine
    with pytest.raises(RuntimeError, match="inside a CUDA-graph capture.*reserve_graph_workspace"):
        graph.get("split_ws16", 8192, torch.float32)
    with pytest.raises(RuntimeError, match="'row_cnt'"):
        graph.get("row_cnt", 1, torch.int32)
