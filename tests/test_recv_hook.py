"""Send and receive halves of the low-latency calls (``return_recv_hook``, as in DeepEP):
the hook's results equal the one-shot call's exactly, a new call with a hook outstanding is
refused with a clear error (the reuse invariant of csrc/core/wire_format.h), a hook runs
once, and ``Buffer.check``."""

from __future__ import annotations

import pytest
import torch

import pcie_a2a
from dist_utils import run_ok

E, H, M, K = 8, 128, 6, 3


def _inputs(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    t = M - rank  # ranks send different token counts
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).int()
    ids[::3, -1] = -1
    return x, ids, torch.rand(t, K, generator=g)


def _expert(r, layout):
    """A stand-in expert: rows layout weights and sums already; expert-major is unweighted."""
    if layout == "rows":
        return (r.x.float() * 0.5).to(torch.bfloat16)
    return (r.x.float() * 2).to(torch.bfloat16)


def _valid(r, layout) -> torch.Tensor:
    """The received rows that are defined (rows past a count are unspecified), as bits."""
    n = r.recv_count if layout == "rows" else r.tokens_per_expert
    return torch.cat([r.x[i, : int(c)] for i, c in enumerate(n)]).view(torch.int16)


def _step(buf, layout, step, rank, hook):
    x, ids, w = _inputs(rank, step)
    if hook:
        h = buf.low_latency_dispatch(x, ids, w, layout=layout, return_recv_hook=True)
        assert callable(h)
        r = h()
        c = buf.low_latency_combine(_expert(r, layout), r.handle, return_recv_hook=True)
        return r, c()
    r = buf.low_latency_dispatch(x, ids, w, layout=layout)
    return r, buf.low_latency_combine(_expert(r, layout), r.handle)


def _rank_same_results(rank: int, world: int) -> None:
    with pcie_a2a.Buffer(None, E, H, M, num_topk=K, backend="cpu") as buf:
        for layout in ("rows", "expert_major"):
            for step in range(3):  # both parities and the reuse of the first
                want_r, want_out = _step(buf, layout, step, rank, hook=False)
                got_r, got_out = _step(buf, layout, step, rank, hook=True)
                assert torch.equal(got_r.recv_count, want_r.recv_count)
                assert torch.equal(_valid(got_r, layout), _valid(want_r, layout))
                assert got_r.tokens_per_expert_list == want_r.tokens_per_expert_list
                assert torch.equal(got_out.view(torch.int16), want_out.view(torch.int16))


def test_hook_results_equal_the_one_shot_call():
    run_ok(2, _rank_same_results)


def _rank_misuse(rank: int, world: int) -> str:
    with pcie_a2a.Buffer(None, E, H, M, num_topk=K, backend="cpu") as buf:
        x, ids, w = _inputs(rank, 0)
        hook = buf.low_latency_dispatch(x, ids, w, return_recv_hook=True)
        with pytest.raises(RuntimeError, match=r"call the receive hook of low_latency_dispatch "
                           r"\(call 1\) before starting another call") as info:  # fmt: skip
            buf.low_latency_dispatch(x, ids, w)
        r = hook()
        with pytest.raises(RuntimeError, match=r"receive hook of .* \(call 1\) was already called"):
            hook()
        buf.check()  # nothing recorded: the refused call never started
        out = buf.low_latency_combine(_expert(r, "rows"), r.handle)  # the Buffer is in step
        assert out.shape == x.shape
        buf.close()
        with pytest.raises(RuntimeError, match="closed"):
            buf.check()
        return str(info.value)


def test_a_call_with_a_hook_outstanding_is_refused_and_the_buffer_stays_in_step():
    msgs = run_ok(2, _rank_misuse)
    assert all("one Buffer each" in m for m in msgs)
