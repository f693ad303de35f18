"""GPU tests of the in-process harness (``CudaTransport.in_process``): W transports in one
process on GPU 0, each on its own stream, the peer tables built from each other's device
pointers (no IPC). Separate processes on one GPU time-slice (their kernels never run at the
same time), so this is the single-GPU stand-in for real concurrency: senders and spinning
receivers side by side, polling contention, and co-residency of several groups' kernels.

* exactness: every rank's rows and combined output equal pcie_a2a.reference, rows and
  expert-major layouts, P2P, staged and mixed pairs, 50 calls with fresh data each;
* issue order that needs the receive-grid cap: each rank's receive is launched right after
  its own send, before the next rank's send, so a receive grid that filled the GPU with
  spinning blocks would starve the later sends (until the deadline);
* two groups (two "Buffers") on their own streams at once.

The same harness runs on the CPU in tests/test_cuda_backend_emulated.py and in the C++
emulation (``inprocess`` scenarios of tests/test_cuda_transport_emulation.py). Smoke subset:
``-m "gpu and smoke"``.
"""

from __future__ import annotations

import pytest
import torch

from pcie_a2a import cuda_available, cuda_unavailable_reason

try:
    import cuda_transport_cases as C
except ImportError:  # pragma: no cover - run from another directory
    from tests import cuda_transport_cases as C


def _skip_reason() -> str:
    if not cuda_available():
        return cuda_unavailable_reason()
    try:
        from pcie_a2a import _cuda_transport  # noqa: F401
    except ImportError as exc:
        return f"pcie_a2a._cuda_transport is not in this build: {exc}"
    return ""


_REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_REASON), reason=_REASON or "n/a")]


def _group(case: C.Case):
    from pcie_a2a.transport.cuda import CudaTransport

    torch.cuda.set_device(0)
    txs = CudaTransport.in_process(
        case.world, case.hidden, case.max_tokens, case.num_topk, C.PAYLOADS[case.payload],
        C.DTYPES[case.dtype][1], C.placement(case), device=0, timeout_s=20.0,
        pair_transport=C.pair_plan(case), pair_direction=C.pair_direction(case),
    )  # fmt: skip
    streams = [torch.cuda.Stream(device=0) for _ in txs]
    return txs, streams


def _buffers(t, case: C.Case, layout: str) -> dict:
    dev = t.device
    w, m, k, h = case.world, case.max_tokens, case.num_topk, case.hidden
    dtype = C.DTYPES[case.dtype][0]
    b = dict(
        send_token=torch.empty(w * m, dtype=torch.int32, device=dev),
        send_count=torch.empty(w, dtype=torch.int32, device=dev),
        counts=torch.empty(w, dtype=torch.int32, device=dev),
        out=torch.empty(m, h, dtype=dtype, device=dev),
        td=t.new_ticket(),
        tc=t.new_ticket(),
    )
    if layout == "rows":
        b.update(
            xo=torch.empty(w * m, h, dtype=dtype, device=dev),
            src_rank=torch.empty(w * m, dtype=torch.int32, device=dev),
            src_token=torch.empty(w * m, dtype=torch.int32, device=dev),
            ids_o=torch.empty(w * m, k, dtype=torch.int32, device=dev),
            ws_o=torch.empty(w * m, k, dtype=torch.float32, device=dev),
            per_expert=torch.empty(t.num_local_experts, dtype=torch.int32, device=dev),
        )
    else:
        e, cap = t.num_local_experts, w * m
        b.update(
            xo=torch.empty(e, cap, h, dtype=dtype, device=dev),
            per_expert=torch.empty(e, dtype=torch.int32, device=dev),
            src_info=torch.empty(e, cap, dtype=torch.int32, device=dev),
            layout_range=torch.empty(e, w, dtype=torch.int64, device=dev),
            expert_pos=torch.empty(cap, k, dtype=torch.int32, device=dev),
            row_experts=torch.empty(cap, k, dtype=torch.int32, device=dev),
            row_weights=torch.empty(cap, k, dtype=torch.float32, device=dev),
        )
    return b


def _send(t, b, x, ids, w):
    t.dispatch_send_async(b["td"], 3, x, ids, w, b["send_token"], b["send_count"])


def _recv(t, b, layout):
    if layout == "rows":
        t.recv_rows_async(b["td"], b["counts"], b["xo"], None, None, b["src_rank"],
                          b["src_token"], b["ids_o"], b["ws_o"], b["per_expert"])  # fmt: skip
    else:
        t.recv_expert_major_async(b["td"], b["counts"], b["xo"], None, None, b["per_expert"],
                                  b["src_info"], b["layout_range"], b["expert_pos"],
                                  b["row_experts"], b["row_weights"])  # fmt: skip


def _combine(t, b, r, layout):
    if layout == "rows":
        b["y"] = C.rows_fn(b["xo"], r)
        t.combine_send_async(b["tc"], 4, b["y"], b["counts"])
    else:
        b["y"] = torch.stack([C.em_fn(b["xo"][e], e) for e in range(t.num_local_experts)]) \
            if t.num_local_experts else b["xo"]  # fmt: skip
        t.combine_send_async(b["tc"], 4, b["y"], b["counts"], None, b["expert_pos"],
                             b["row_experts"], b["row_weights"])  # fmt: skip


def _step(txs, streams, case, layout, step, interleave=False):
    """One dispatch + combine of every rank. interleave: each rank's receive right after its
    own send (before the next rank's send): needs the receive-grid cap to make progress."""
    dev = txs[0].device
    ins = [tuple(v.to(dev) for v in C.inputs(case, r, step)) for r in range(case.world)]
    bufs = [_buffers(t, case, layout) for t in txs]
    for r, (t, s, b) in enumerate(zip(txs, streams, bufs)):
        with torch.cuda.stream(s):
            _send(t, b, *ins[r])
            if interleave:
                _recv(t, b, layout)
    if not interleave:
        for t, s, b in zip(txs, streams, bufs):
            with torch.cuda.stream(s):
                _recv(t, b, layout)
    for r, (t, s, b) in enumerate(zip(txs, streams, bufs)):
        with torch.cuda.stream(s):
            _combine(t, b, r, layout)
    for r, (t, s, b) in enumerate(zip(txs, streams, bufs)):
        with torch.cuda.stream(s):
            n = ins[r][0].shape[0]
            t.combine_recv_async(b["tc"], b["send_token"], b["send_count"], n, b["out"][:n])
    return ins, bufs


def _check(txs, case, layout, step, ins, bufs):
    torch.cuda.synchronize()
    for r, (t, b) in enumerate(zip(txs, bufs)):
        t.check()
        n = ins[r][0].shape[0]
        got = {k: v.cpu() for k, v in b.items() if isinstance(v, torch.Tensor)}
        if layout == "rows":
            C.check_ll_rows(case, r, step, got, n)
        else:
            C.check_expert_major(case, r, step, got)
            want = C.combined(case, step, C.em_partials(case, step))[r]
            assert torch.equal(C.bits(got["out"][:n]), C.bits(want)), f"rank {r} combine"


CASES = [
    pytest.param(C.Case("ip_rows_p2p_4", 4, "ll_rows", experts=16, seed=80), marks=pytest.mark.smoke),
    C.Case("ip_rows_mixed_fp8_4", 4, "ll_rows", payload="fp8", transport="mixed", experts=16, seed=81),
    pytest.param(C.Case("ip_em_staged_2", 2, "ll_em", transport="staged", seed=82), marks=pytest.mark.smoke),
    C.Case("ip_em_p2p_8", 8, "ll_em", experts=16, topk=4, max_tokens=16, seed=83),
    C.Case("ip_rows_pull_mixed_4", 4, "ll_rows", direction="mixed", experts=16, seed=87),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_in_process_exact_over_many_calls(case):
    from pcie_a2a.transport.cuda import CudaTransport

    layout = "rows" if case.mode == "ll_rows" else "em"
    txs, streams = _group(case)
    try:
        for step in range(50):  # fresh data each call: both parities reused ~25 times
            ins, bufs = _step(txs, streams, case, layout, step % 7)
            _check(txs, case, layout, step % 7, ins, bufs)
    finally:
        torch.cuda.synchronize()
        assert CudaTransport.close_in_process(txs) == [True] * case.world


@pytest.mark.smoke
def test_receive_grids_leave_room_for_the_peers_sends():
    """Each rank's receive is launched before the next rank's send: only capped receive
    grids (max_recv_blocks, one block per SM) leave the later sends room to run."""
    from pcie_a2a.transport.cuda import CudaTransport

    case = C.Case("ip_interleaved_4", 4, "ll_rows", experts=16, max_tokens=128, seed=84)
    txs, streams = _group(case)
    try:
        for step in range(5):
            ins, bufs = _step(txs, streams, case, "rows", step, interleave=True)
            _check(txs, case, "rows", step, ins, bufs)
    finally:
        torch.cuda.synchronize()
        assert CudaTransport.close_in_process(txs) == [True] * case.world


def test_two_groups_on_their_own_streams_at_once():
    """Two groups (two Buffers' worth of transports) issued interleaved: both exact."""
    from pcie_a2a.transport.cuda import CudaTransport

    ca = C.Case("ip_group_a", 2, "ll_rows", seed=85)
    cb = C.Case("ip_group_b", 2, "ll_rows", transport="staged", seed=86)
    ga, gb = _group(ca), _group(cb)
    try:
        for step in range(10):
            a = _step(*ga, ca, "rows", step, interleave=True)
            b = _step(*gb, cb, "rows", step, interleave=True)
            _check(ga[0], ca, "rows", step, *a)
            _check(gb[0], cb, "rows", step, *b)
    finally:
        torch.cuda.synchronize()
        assert CudaTransport.close_in_process(ga[0]) == [True, True]
        assert CudaTransport.close_in_process(gb[0]) == [True, True]
