"""GPU tests of the CUDA transport (csrc/cuda/transport, pcie_a2a.transport.cuda).

Several processes share GPU 0: CUDA IPC between processes on one device exercises the
same open/store/flag path as P2P between devices, and PCIE_A2A_P2P=0 (or an explicit pair
plan) forces the host-staged path. Data movement is compared exactly against
pcie_a2a.reference; the combine sums are exact too, because the kernels add in the
CPU's order with the CPU's rounding (fp32, ascending rank, no FMA contraction).

Case table (what each case reaches):
  normal        dispatch_send + wait_counts (host counts) + unpack_rows(wait=False),
                combine_send (rows) + combine_recv
  ll_rows       dispatch_send + unpack_rows(wait=True) (device-side flag acquire)
  ll_em         dispatch_send + em_count + em_scatter, combine_send with the fused
                expert-major pre-reduction
  fp8 / raw     the quantise-on-send path (quantize_fp8_group per group) and the
                dequantise-on-receive or raw-bytes unpack
  staged/mixed  host-staged regions (shm + cudaHostRegister), and both kinds in one call
  ce_*          normal mode through the copy engine: count_destinations + host read,
                local pack, cudaMemcpyAsync per pair + publish_one; "all" sends every
                non-empty pair by copy engine, "mixed" only pairs of >= 8 rows (both
                kinds in one call); the ranks it used are checked against the counts
"""

from __future__ import annotations

import os

import pytest
import torch

from pcie_a2a import cuda_available, cuda_unavailable_reason

try:
    import cuda_transport_cases as C
    from dist_utils import run_ranks
except ImportError:  # pragma: no cover - run from another directory
    from tests import cuda_transport_cases as C
    from tests.dist_utils import run_ranks

Case = C.Case


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


SMOKE = pytest.mark.smoke  # the first tier of scripts/gpu_check.sh: -m "gpu and smoke"
CASES = [
    pytest.param(Case("normal_bf16_2", 2, "normal"), marks=SMOKE),
    Case("normal_fp16_4", 4, "normal", dtype="fp16", payload="fp16", seed=1),
    pytest.param(Case("normal_fp8_2", 2, "normal", payload="fp8", seed=2), marks=SMOKE),
    Case("normal_fp8_raw_2", 2, "normal", payload="fp8", raw_fp8=True, seed=3),
    pytest.param(Case("ll_rows_bf16_4", 4, "ll_rows", seed=4), marks=SMOKE),
    Case("ll_rows_fp8_2", 2, "ll_rows", dtype="fp16", payload="fp8", seed=5),
    pytest.param(Case("ll_em_bf16_2", 2, "ll_em", seed=6), marks=SMOKE),
    Case("ll_em_bf16_4_redundant", 4, "ll_em", experts=16, placement="redundant", seed=7),
    Case("ll_em_fp8_4", 4, "ll_em", payload="fp8", experts=16, topk=4, seed=8),
    pytest.param(Case("staged_normal_2", 2, "normal", transport="staged", seed=9), marks=SMOKE),
    Case("staged_ll_em_2", 2, "ll_em", transport="staged", payload="fp8", seed=10),
    pytest.param(Case("mixed_ll_rows_4", 4, "ll_rows", transport="mixed", seed=11), marks=SMOKE),
    Case("mixed_normal_4", 4, "normal", transport="mixed", experts=16, seed=12),
    pytest.param(Case("ce_all_normal_bf16_2", 2, "normal", copy_engine="all", seed=13), marks=SMOKE),
    Case("ce_all_normal_fp8_4", 4, "normal", payload="fp8", copy_engine="all", seed=14),
    Case("ce_mixed_normal_4", 4, "normal", copy_engine="mixed", experts=16, seed=15),
    Case("ce_all_staged_mixed_4", 4, "normal", transport="mixed", copy_engine="all", seed=16),
    # pulled P2P pairs (csrc/cuda/transport/pull.cuh), alone and beside pushed/staged ones
    pytest.param(Case("pull_ll_rows_2", 2, "ll_rows", direction="pull", seed=17), marks=SMOKE),
    Case("pull_normal_mixed_4", 4, "normal", direction="mixed", experts=16, seed=18),
    Case("pull_ll_em_fp8_4", 4, "ll_em", payload="fp8", transport="mixed", direction="mixed",
         experts=16, seed=19),
]  # fmt: skip


# ---- inputs and references: tests/cuda_transport_cases.py (shared with the emulation) ----


def _plan(case: Case):
    return C.pair_plan(case) if case.transport == "mixed" else None


def _make(case: Case, rank: int, timeout_s: float = 30.0):
    from pcie_a2a.transport.cuda import CudaTransport

    if case.transport == "staged":
        os.environ["PCIE_A2A_P2P"] = "0"
    device = rank % torch.cuda.device_count() if case.spread else 0
    torch.cuda.set_device(device)
    return CudaTransport(
        None, rank, case.world, case.hidden, case.max_tokens, case.num_topk,
        C.PAYLOADS[case.payload], C.DTYPES[case.dtype][1], C.placement(case), device=device,
        timeout_s=timeout_s, pair_transport=_plan(case), copy_engine_min_bytes=None,
        pair_direction=C.pair_direction(case) if case.direction != "push" else None,
    )  # fmt: skip


def _check_copy_engine(tx, case: Case, counts: list[int], slot_bytes: int) -> None:
    """The ranks the last normal-mode send gave to the copy engine are exactly the pairs
    at or over the threshold (so a silently disabled path fails here)."""
    limit = C.ce_min_bytes(case, slot_bytes)
    want = [
        r for r, n in enumerate(counts) if limit is not None and n > 0 and n * slot_bytes >= limit
    ]
    assert tx.last_copy_engine_ranks == want


def _cpu(b: dict) -> dict:
    return {k: v.cpu() for k, v in b.items()}


# ---- one rank's work per mode ------------------------------------------------------------
def _run_normal(tx, case: Case, rank: int, step: int, seq: int):
    dev = tx.device
    dtype = C.DTYPES[case.dtype][0]
    x, ids, w = (t.to(dev) for t in C.inputs(case, rank, step))
    exp_all = C.expected(case, step)
    exp = exp_all[rank]
    m, world, k = case.max_tokens, case.world, case.num_topk
    send_token = torch.empty(world * m, dtype=torch.int32, device=dev)
    send_count = torch.empty(world, dtype=torch.int32, device=dev)
    parity_d = (step + 1) & 1
    tx.copy_engine_min_bytes = C.ce_min_bytes(case, tx._tx().dispatch_slot_bytes)
    tx.dispatch_send(
        seq, 1, parity_d, x, x.shape[0], ids, w, ids.shape[1], None, send_token, send_count
    )
    _check_copy_engine(tx, case, send_count.tolist(), tx._tx().dispatch_slot_bytes)
    counts = tx.wait(seq, 1, 30.0)
    counts_t = torch.tensor(counts, dtype=torch.int32, device=dev)
    row_base = torch.zeros(world, dtype=torch.int64, device=dev)
    row_base[1:] = torch.cumsum(counts_t, 0)[:-1]
    total = sum(counts)
    assert total == exp.x.shape[0]
    xo = torch.empty(total, case.hidden, dtype=dtype, device=dev)
    q = torch.empty(total, case.hidden, dtype=torch.uint8, device=dev) if case.raw_fp8 else None
    sc = (
        torch.empty(total, case.hidden // 128, dtype=torch.float32, device=dev)
        if case.raw_fp8
        else None
    )
    src_rank = torch.empty(total, dtype=torch.int32, device=dev)
    src_token = torch.empty(total, dtype=torch.int32, device=dev)
    ids_o = torch.empty(total, k, dtype=torch.int32, device=dev)
    ws_o = torch.empty(total, k, dtype=torch.float32, device=dev)
    per_expert = torch.empty(tx.num_local_experts, dtype=torch.int32, device=dev)
    tx.unpack_rows(parity_d, counts_t, row_base, None if q is not None else xo, q, sc, src_rank,
                   src_token, ids_o, ws_o, tx.num_local_experts, per_expert)  # fmt: skip
    torch.cuda.synchronize()
    tx.check()
    assert torch.equal(src_rank.cpu(), exp.src_rank)
    assert torch.equal(src_token.cpu(), exp.src_token)
    assert torch.equal(ids_o.cpu(), exp.topk_ids)
    assert torch.equal(ws_o.cpu(), exp.topk_weights)
    assert per_expert.tolist() == exp.tokens_per_expert
    C.assert_rows(case, exp, xo, q, sc, step)
    if case.raw_fp8:
        xo = torch.stack([exp.x[i] for i in range(total)]).to(dev) if total else xo
    y = C.rows_fn(xo, rank)
    tx.copy_engine_min_bytes = C.ce_min_bytes(case, tx._tx().combine_slot_bytes)
    tx.combine_send(seq + 1, 2, (step + 1) & 1, y, counts_t, row_base)
    _check_copy_engine(tx, case, counts, tx._tx().combine_slot_bytes)
    out = torch.empty(x.shape[0], case.hidden, dtype=dtype, device=dev)
    tx.combine_recv(seq + 1, 2, (step + 1) & 1, 30.0, send_token, send_count, x.shape[0], out)
    want = C.combined(case, step, [C.rows_fn(e.x, r) for r, e in enumerate(exp_all)])
    assert torch.equal(C.bits(out), C.bits(want[rank])), "combined output differs"


def _ll_buffers(tx, case: Case):
    dev = tx.device
    m, world, k = case.max_tokens, case.world, case.num_topk
    dtype = C.DTYPES[case.dtype][0]
    return dict(
        send_token=torch.empty(world * m, dtype=torch.int32, device=dev),
        send_count=torch.empty(world, dtype=torch.int32, device=dev),
        counts=torch.empty(world, dtype=torch.int32, device=dev),
        xo=torch.empty(world * m, case.hidden, dtype=dtype, device=dev),
        src_rank=torch.empty(world * m, dtype=torch.int32, device=dev),
        src_token=torch.empty(world * m, dtype=torch.int32, device=dev),
        ids_o=torch.empty(world * m, k, dtype=torch.int32, device=dev),
        ws_o=torch.empty(world * m, k, dtype=torch.float32, device=dev),
        per_expert=torch.empty(tx.num_local_experts, dtype=torch.int32, device=dev),
        y=torch.empty(world * m, case.hidden, dtype=dtype, device=dev),
        out=torch.empty(case.max_tokens, case.hidden, dtype=dtype, device=dev),
    )


def _ll_rows_calls(tx, b, x, ids, w, rank):
    td, tc = tx.new_ticket(), tx.new_ticket()
    tx.dispatch_send_async(td, 3, x, ids, w, b["send_token"], b["send_count"])
    tx.recv_rows_async(td, b["counts"], b["xo"], None, None, b["src_rank"], b["src_token"],
                       b["ids_o"], b["ws_o"], b["per_expert"])  # fmt: skip
    b["y"].copy_(C.rows_fn(b["xo"], rank))
    tx.combine_send_async(tc, 4, b["y"], b["counts"])
    tx.combine_recv_async(tc, b["send_token"], b["send_count"], x.shape[0], b["out"][: x.shape[0]])
    return td, tc


def _run_ll_rows(tx, case: Case, rank: int, step: int):
    dev = tx.device
    x, ids, w = (t.to(dev) for t in C.inputs(case, rank, step))
    b = _ll_buffers(tx, case)
    _ll_rows_calls(tx, b, x, ids, w, rank)
    torch.cuda.synchronize()
    tx.check()
    C.check_ll_rows(case, rank, step, _cpu(b), x.shape[0])


def _run_ll_em(tx, case: Case, rank: int, step: int):
    dev = tx.device
    dtype = C.DTYPES[case.dtype][0]
    x, ids, w = (t.to(dev) for t in C.inputs(case, rank, step))
    m, world, k, e_local = case.max_tokens, case.world, case.num_topk, tx.num_local_experts
    cap = world * m
    send_token = torch.empty(world * m, dtype=torch.int32, device=dev)
    send_count = torch.empty(world, dtype=torch.int32, device=dev)
    counts = torch.empty(world, dtype=torch.int32, device=dev)
    xo = torch.zeros(e_local, cap, case.hidden, dtype=dtype, device=dev)
    per_expert = torch.empty(e_local, dtype=torch.int32, device=dev)
    src_info = torch.empty(e_local, cap, dtype=torch.int32, device=dev)
    layout_range = torch.empty(e_local, world, dtype=torch.int64, device=dev)
    expert_pos = torch.empty(cap, k, dtype=torch.int32, device=dev)
    row_experts = torch.empty(cap, k, dtype=torch.int32, device=dev)
    row_weights = torch.empty(cap, k, dtype=torch.float32, device=dev)
    td, tc = tx.new_ticket(), tx.new_ticket()
    tx.dispatch_send_async(td, 3, x, ids, w, send_token, send_count)
    tx.recv_expert_major_async(td, counts, xo, None, None, per_expert, src_info, layout_range,
                               expert_pos, row_experts, row_weights)  # fmt: skip
    torch.cuda.synchronize()
    tx.check()
    got = dict(per_expert=per_expert, xo=xo, src_info=src_info, layout_range=layout_range)
    C.check_expert_major(case, rank, step, _cpu(got))
    # combine: unweighted expert outputs; the push pre-reduces them (fp32, weighted)
    y = torch.zeros_like(xo)
    for e in range(e_local):
        y[e] = C.em_fn(xo[e], e)
    tx.combine_send_async(tc, 4, y, counts, None, expert_pos, row_experts, row_weights)
    out = torch.empty(x.shape[0], case.hidden, dtype=dtype, device=dev)
    tx.combine_recv_async(tc, send_token, send_count, x.shape[0], out)
    torch.cuda.synchronize()
    tx.check()
    want = C.combined(case, step, C.em_partials(case, step))
    assert torch.equal(C.bits(out), C.bits(want[rank])), "expert-major combine differs"


def _rank_case(rank: int, world: int, case: Case) -> str:
    tx = _make(case, rank)
    try:
        for step in range(3):  # three calls: both parities, and reuse of parity 0
            if case.mode == "normal":
                _run_normal(tx, case, rank, step, 2 * step + 1)
            elif case.mode == "ll_rows":
                _run_ll_rows(tx, case, rank, step)
            else:
                _run_ll_em(tx, case, rank, step)
        torch.cuda.synchronize()
        import torch.distributed as dist

        dist.barrier()
        return tx.numa_warning
    finally:
        tx.close()


def _name(c) -> str:
    return (c.values[0] if hasattr(c, "values") else c).name


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_correctness_table(case: Case):
    for o in run_ranks(case.world, _rank_case, case, timeout=240):
        o.unwrap()


# Several GPUs: rank r on GPU r % n, pairs P2P where CUDA reports peer access, else staged
# (the default plan); with 4 ranks on 2 GPUs one call mixes same-device IPC and cross-device.
MULTI_GPU_CASES = [
    Case("multi_normal_bf16_2", 2, "normal", spread=True, seed=20),
    Case("multi_ll_rows_fp8_4", 4, "ll_rows", payload="fp8", spread=True, seed=21),
    Case("multi_ll_em_bf16_4", 4, "ll_em", experts=16, spread=True, seed=22),
    Case("multi_ce_normal_4", 4, "normal", copy_engine="all", spread=True, seed=23),
    Case("multi_staged_normal_2", 2, "normal", transport="staged", spread=True, seed=24),
]


def _gpu_count() -> int:
    return torch.cuda.device_count() if not _REASON else 0


@pytest.mark.skipif(_gpu_count() < 2, reason="needs at least 2 GPUs")
@pytest.mark.parametrize("case", MULTI_GPU_CASES, ids=[c.name for c in MULTI_GPU_CASES])
def test_multi_gpu_table(case: Case):
    for o in run_ranks(case.world, _rank_case, case, timeout=240):
        o.unwrap()


# ---- CUDA graph: capture the low-latency path once, replay with new inputs ---------------
def _rank_graph(rank: int, world: int, case: Case) -> None:
    import torch.distributed as dist

    tx = _make(case, rank)
    try:
        dev = torch.device("cuda", 0)
        x0, ids0, w0 = (t.to(dev) for t in C.inputs(case, rank, 0))
        x_s, ids_s, w_s = x0.clone(), ids0.clone(), w0.clone()
        b = _ll_buffers(tx, case)
        _ll_rows_calls(tx, b, x_s, ids_s, w_s, rank)  # eager warm-up: loads the kernels
        torch.cuda.synchronize()
        tx.check()
        C.check_ll_rows(case, rank, 0, _cpu(b), x_s.shape[0])
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            _ll_rows_calls(tx, b, x_s, ids_s, w_s, rank)
        for step in range(1, 4):
            x, ids, w = (t.to(dev) for t in C.inputs(case, rank, step))
            x_s.copy_(x)
            ids_s.copy_(ids)
            w_s.copy_(w)
            g.replay()
            torch.cuda.synchronize()
            tx.check()
            C.check_ll_rows(case, rank, step, _cpu(b), x_s.shape[0])
        dist.barrier()
    finally:
        tx.close()


@SMOKE
def test_cuda_graph_replay_with_new_inputs():
    # the token count is part of the captured shapes, so every rank keeps its own T fixed
    case = Case("graph", 2, "ll_rows", seed=20)
    for o in run_ranks(2, _rank_graph, case, timeout=240):
        o.unwrap()


# ---- failures: a rank that never calls, a rank that aborts --------------------------------
def _rank_never_calls(rank: int, world: int, case: Case) -> str:
    import torch.distributed as dist

    from pcie_a2a._transport import PeerTimeoutError

    tx = _make(case, rank, timeout_s=2.0)
    try:
        msg = ""
        if rank == 0:
            dev = torch.device("cuda", 0)
            x, ids, w = (t.to(dev) for t in C.inputs(case, rank, 0))
            b = _ll_buffers(tx, case)
            td = tx.new_ticket()
            tx.dispatch_send_async(td, 3, x, ids, w, b["send_token"], b["send_count"])
            tx.recv_rows_async(td, b["counts"], b["xo"], None, None, b["src_rank"],
                               b["src_token"], b["ids_o"], b["ws_o"], b["per_expert"])  # fmt: skip
            torch.cuda.synchronize()  # returns: the kernel gives up at its deadline
            with pytest.raises(PeerTimeoutError) as info:
                tx.check()
            msg = str(info.value)
        dist.barrier()
        return msg
    finally:
        tx.close()


@SMOKE
def test_rank_that_never_calls_raises_not_hangs():
    case = Case("timeout", 2, "ll_rows")
    msgs = [o.unwrap() for o in run_ranks(2, _rank_never_calls, case, timeout=120)]
    assert "rank 1" in msgs[0] and "call 1" in msgs[0]


def _rank_abort(rank: int, world: int, case: Case) -> None:
    """Rank 0 aborts call 1; rank 1 raises PeerAbortedError for it; then both make a
    complete dispatch + combine (calls 2, 3), checked exactly, on the same transport."""
    import torch.distributed as dist

    from pcie_a2a._transport import PeerAbortedError

    tx = _make(case, rank, timeout_s=20.0)
    try:
        dev = tx.device
        if rank == 0:
            tx.abort(1, 1)
        else:
            x, ids, w = (t.to(dev) for t in C.inputs(case, rank, 0))
            st = torch.empty(case.world * case.max_tokens, dtype=torch.int32, device=dev)
            sc = torch.empty(case.world, dtype=torch.int32, device=dev)
            tx.dispatch_send(1, 1, 1, x, x.shape[0], ids, w, ids.shape[1], None, st, sc)
            with pytest.raises(PeerAbortedError, match="rank 0 aborted"):
                tx.wait(1, 1, 20.0)
        torch.cuda.synchronize()
        dist.barrier()
        # the next calls work (dispatch call 2 uses parity 0: the abort took parity 1)
        _run_ll_rows(tx, case, rank, 1)
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        tx.close()


def test_abort_reaches_the_peer_and_the_buffer_stays_usable():
    for o in run_ranks(2, _rank_abort, Case("abort", 2, "normal"), timeout=120):
        o.unwrap()


def _rank_abort_silent_peer(rank: int, world: int, case: Case) -> str:
    """Rank 0 aborts while rank 1 never calls: the abort's wait must raise a timeout
    naming rank 1 (its own abort flag must not hide the missing peer)."""
    import torch.distributed as dist

    from pcie_a2a._transport import PeerTimeoutError

    tx = _make(case, rank, timeout_s=2.0)
    try:
        msg = ""
        if rank == 0:
            with pytest.raises(PeerTimeoutError) as info:
                tx.abort(1, 1, 2.0)
            msg = str(info.value)
        dist.barrier()
        return msg
    finally:
        tx.close()


def test_abort_with_a_silent_peer_times_out_naming_it():
    case = Case("abort_silent", 2, "normal")
    msgs = [o.unwrap() for o in run_ranks(2, _rank_abort_silent_peer, case, timeout=120)]
    assert "rank 1" in msgs[0] and "call 1" in msgs[0], msgs[0]


# ---- lifecycle ---------------------------------------------------------------------------
def _settled_free() -> int:
    """Free device memory once torch's cache is empty on every rank: each rank synchronises
    and empties its own cache, then all meet, so no rank reads while another still holds
    cached blocks (with both ranks on one GPU, device-wide free memory counts both)."""
    import torch.distributed as dist

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dist.barrier()
    free = torch.cuda.mem_get_info(0)[0]
    dist.barrier()
    return free


def _rank_create_close(rank: int, world: int, case: Case) -> tuple[int, int]:
    import warnings

    warnings.simplefilter("error", ResourceWarning)  # a segment left allocated fails here
    torch.cuda.set_device(0)
    # Warm up: CUDA context, module loading, torch's allocator and the test's own tensors.
    tx = _make(case, rank)
    _run_ll_rows(tx, case, rank, 0)
    tx.close()
    free0, shm0 = _settled_free(), _rss_shmem()
    for _ in range(10):
        tx = _make(case, rank)
        _run_ll_rows(tx, case, rank, 0)
        tx.close()  # collective: waits for the peer's close mark before freeing
    free1 = _settled_free()
    return free0 - free1, _rss_shmem() - shm0


def _rss_shmem() -> int:
    """Bytes of shared memory this process has mapped and touched (host segments)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("transport", ["auto", "staged"])
def test_repeated_create_close_leaks_nothing(transport: str):
    # max_tokens 512 x hidden 4096: a device segment is ~34 MiB (and the host segment of
    # the staged case as big), so even one leaked segment over ten rounds shows
    case = Case("leak", 2, "ll_rows", transport=transport, max_tokens=512, hidden=4096)
    leaked = [o.unwrap() for o in run_ranks(2, _rank_create_close, case, timeout=240)]
    # warmed up and emptied before both readings: what is left is the transport's
    assert max(d for d, _ in leaked) < 16 << 20, f"device memory not returned: {leaked}"
    assert max(h for _, h in leaked) < 16 << 20, f"host segments still mapped: {leaked}"


# ---- Buffer: the low-latency calls themselves captured and replayed ------------------------
def _rank_buffer_graph(rank: int, world: int, layout: str) -> None:
    """Buffer.low_latency_dispatch, the experts and Buffer.low_latency_combine captured in one
    CUDA graph, replayed with new inputs copied into the captured ones: exact every time."""
    import pcie_a2a

    torch.cuda.set_device(0)
    case = Case(f"buffer_graph_{layout}", world, "ll_rows", seed=30)
    dev = torch.device("cuda", 0)
    w_, m = case.world, case.max_tokens
    with pcie_a2a.Buffer(None, case.experts, case.hidden, m, num_topk=case.num_topk,
                         backend="cuda") as buf:  # fmt: skip
        x, ids, wt = (t.to(dev) for t in C.inputs(case, rank, 0))

        def layer():
            res = buf.low_latency_dispatch(x, ids, wt, layout=layout)
            if layout == "rows":
                y = C.rows_fn(res.x, rank)
            else:
                y = torch.stack([C.em_fn(res.x[e], e) for e in range(res.x.shape[0])])
            return res, buf.low_latency_combine(y, res.handle)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # eager warm-up, as torch asks before a capture
            layer()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            res, out = layer()
        for step in range(1, 5):
            nx, nids, nw = (t.to(dev) for t in C.inputs(case, rank, step))
            x.copy_(nx)
            ids.copy_(nids)
            wt.copy_(nw)
            g.replay()
            torch.cuda.synchronize()
            buf.check()
            exp_all = C.expected(case, step)
            n = x.shape[0]
            if layout == "rows":
                want = C.combined(case, step, [C.rows_fn(e.x, r) for r, e in enumerate(exp_all)])
                counts = res.recv_count.cpu().tolist()
                rows = res.x.view(w_ * m, -1).cpu()
                sel = [s * m + j for s in range(w_) for j in range(counts[s])]
                assert torch.equal(C.bits(rows[sel]), C.bits(exp_all[rank].x)), f"step {step}"
            else:
                want = C.combined(case, step, C.em_partials(case, step))
                got = dict(per_expert=res.tokens_per_expert, xo=res.x, src_info=res.src_info,
                           layout_range=res.layout_range)  # fmt: skip
                C.check_expert_major(case, rank, step, {k: v.cpu() for k, v in got.items()})
            assert torch.equal(C.bits(out[:n]), C.bits(want[rank])), f"step {step}: combine"


@SMOKE
@pytest.mark.parametrize("layout", ["rows", "expert_major"])
def test_buffer_low_latency_calls_captured_and_replayed(layout):
    for o in run_ranks(2, _rank_buffer_graph, layout, timeout=240):
        o.unwrap()
