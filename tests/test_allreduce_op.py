"""The torch.library ops of pcie_a2a.AllReduce: schema and fake kernels (opcheck), tracing
by torch.compile without graph breaks, shapes under FakeTensorMode."""

from __future__ import annotations

import pytest
import torch

import pcie_a2a
from pcie_a2a.allreduce import reference as R


@pytest.fixture
def ar(single_rank_group):
    comm = pcie_a2a.AllReduce(None, 1 << 14, torch.bfloat16)
    yield comm
    comm.close()


def test_opcheck(ar):
    x = torch.randn(4, 64).bfloat16()
    res = torch.randn(4, 64).bfloat16()
    w = (torch.rand(64) + 0.5).bfloat16()
    torch.library.opcheck(torch.ops.pcie_a2a.all_reduce.default, (x, ar.handle, res))
    torch.library.opcheck(torch.ops.pcie_a2a.all_reduce.default, (x, ar.handle, None))
    out = torch.empty_like(x)
    torch.library.opcheck(torch.ops.pcie_a2a.all_reduce_out.default, (x, out, ar.handle, res))
    torch.library.opcheck(
        torch.ops.pcie_a2a.all_reduce_rmsnorm.default, (x, ar.handle, res, w, 1e-6)
    )


def test_compiled_graph_calls_the_op_and_matches_eager(ar):
    w = (torch.rand(64) + 0.5).bfloat16()

    def layer(x, residual):
        h = ar.all_reduce(x * 2, residual=residual)
        normed, res_out = ar.all_reduce_rmsnorm(h, w, 1e-6, residual=residual)
        return normed + 1, res_out

    x, res = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = compiled(x, res)
    want = layer(x, res)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    h = R.add_residual(x * 2, res)  # one rank: the all-reduce is the identity
    n, r = R.add_rmsnorm(h, res, w, 1e-6)
    assert torch.equal(want[0], n + 1) and torch.equal(want[1], r)


def test_fake_tensors_get_shapes_without_communicating(ar):
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = dict(ar.stats()["calls"])
    with FakeTensorMode():
        x = torch.empty(5, 128, dtype=torch.bfloat16)
        y = torch.ops.pcie_a2a.all_reduce(x, ar.handle, None)
        n, r = torch.ops.pcie_a2a.all_reduce_rmsnorm(
            x, ar.handle, x, torch.empty(128, dtype=torch.bfloat16), 1e-5
        )
    assert y.shape == n.shape == r.shape == (5, 128) and y.dtype == torch.bfloat16
    assert ar.stats()["calls"] == calls, "the fake kernels must not run the all-reduce"
