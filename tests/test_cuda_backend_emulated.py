"""``Buffer(backend="cuda")`` and ``pcie_a2a.transport.cuda`` run without a GPU: the real
binding, host code and kernels compiled against the CUDA execution model
(tests/cuda_emu_module.py), on CPU tensors, one fresh process per case.

* The low-latency calls' cost, counted: host synchronisations (``.tolist()``, ``.item()``,
  ``.cpu()``, stream and device syncs in Python; blocking runtime calls in C++) and launches
  (the torch ops a GPU would run as kernels, plus the transport's stream operations), for one
  ``low_latency_dispatch`` + ``low_latency_combine`` in the rows and expert-major layouts.
  Targets (issue 10): 0 syncs, at most 4 launches. Print them with
  ``python -m pytest -q -s tests/test_cuda_backend_emulated.py -k counts``.
* Those two calls captured in a graph (the emulated runtime's) and replayed with new inputs.
* Bad ids found on the device and raised by the next call; the Buffer stays usable.
* The in-process harness (``CudaTransport.in_process``): W transports in one process, each
  on its own stream, tables built from each other's pointers.

World 1 for the Buffer (one process: the transport's own segment), 2-3 for the in-process
harness; every result is compared bit for bit with the CPU reference.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks
from native_emulation import compiler, skip_or_fail

try:
    import cuda_transport_cases as C
except ImportError:  # pragma: no cover
    from tests import cuda_transport_cases as C

E, H, M, K = 8, 256, 12, 4
LAUNCH_TARGET = 4


@pytest.fixture(scope="session")
def emu_so(tmp_path_factory) -> str:
    if compiler() is None:
        skip_or_fail("no host C++ compiler to build the emulated CUDA module")
    if sys.platform != "linux":
        pytest.skip("the emulated runtime maps its arena the Linux way")
    import cuda_emu_module

    return str(cuda_emu_module.build(tmp_path_factory.mktemp("cuda_emu_module")))


# ---- counting ------------------------------------------------------------------------------
# aten ops that never launch a kernel on a GPU (allocation, views, metadata)
_NO_KERNEL = {
    "empty", "empty_strided", "view", "_unsafe_view", "as_strided", "alias", "detach",
    "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze", "squeeze",
    "_reshape_alias", "reshape", "lift_fresh",
}  # fmt: skip


@contextmanager
def counted():
    """Counts what Python does that a GPU would pay for: host synchronisations and the
    torch ops that would launch a kernel (names recorded)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = {"syncs": [], "launches": []}

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in ("_local_scalar_dense", "_to_copy") or name.startswith("item"):
                seen["syncs"].append(name)
            elif name not in _NO_KERNEL:
                seen["launches"].append(name)
            return func(*args, **(kwargs or {}))

    originals = {}

    def spy(owner, attr):
        fn = getattr(owner, attr)
        originals[(owner, attr)] = fn

        def wrapper(*a, **k):
            seen["syncs"].append(attr)
            return fn(*a, **k)

        setattr(owner, attr, wrapper)

    for owner, attr in ((torch.Tensor, "tolist"), (torch.Tensor, "item"), (torch.Tensor, "cpu"),
                        (torch.Tensor, "numpy"), (torch.cuda, "synchronize")):  # fmt: skip
        spy(owner, attr)
    try:
        with Mode():
            yield seen
    finally:
        for (owner, attr), fn in originals.items():
            setattr(owner, attr, fn)


def _inputs(step: int, ids64: bool = False):
    g = torch.Generator().manual_seed(7 + step)
    t = M - 2
    x = (torch.randn(t, H, generator=g) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).int()
    ids[::3, -1] = -1
    w = torch.rand(t, K, generator=g)
    return x, ids.long() if ids64 else ids, w


def _expert(res, layout: str) -> torch.Tensor:
    if layout == "rows":
        return (res.x.float() * 0.5).to(torch.bfloat16)
    return (res.x.float() * 2).to(torch.bfloat16)


def _valid(res, layout) -> torch.Tensor:
    n = res.recv_count if layout == "rows" else res.tokens_per_expert
    return torch.cat([res.x[i, : int(c)] for i, c in enumerate(n)]).view(torch.int16)


def _cpu_reference(layout: str, steps: int):
    """The same calls through the CPU transport (the oracle)."""
    import pcie_a2a

    out = []
    with pcie_a2a.Buffer(None, E, H, M, num_topk=K, backend="cpu") as buf:
        for step in range(steps):
            x, ids, w = _inputs(step)
            r = buf.low_latency_dispatch(x, ids, w, layout=layout)
            y = buf.low_latency_combine(_expert(r, layout), r.handle)
            out.append((_valid(r, layout), r.tokens_per_expert_list, y.view(torch.int16)))
    return out


def _rank_counts(rank: int, world: int, so: str) -> dict:
    import cuda_emu_module

    import pcie_a2a

    hooks = cuda_emu_module.install(Path(so))
    got = {}
    for layout in ("rows", "expert_major"):
        want = _cpu_reference(layout, 3)
        with pcie_a2a.Buffer(None, E, H, M, num_topk=K, backend="cuda") as buf:
            assert buf._transport.ids_checked_on_device(3)  # LL calls stay on the device
            for step in range(3):  # the first call warms up; both parities and reuse
                x, ids, w = _inputs(step, ids64=step == 2)
                l0, s0, _ = hooks.counts()
                with counted() as py:
                    r = buf.low_latency_dispatch(x, ids, w, layout=layout)
                    y_in = None
                    py_mid = (list(py["syncs"]), list(py["launches"]))
                l1, s1, _ = hooks.counts()
                y_in = _expert(r, layout)  # the experts: not the transport's cost
                l2, s2, _ = hooks.counts()
                with counted() as py2:
                    y = buf.low_latency_combine(y_in, r.handle)
                l3, s3, _ = hooks.counts()
                v, tpe, out = want[step]
                assert torch.equal(_valid(r, layout), v), f"{layout} step {step}: rows"
                assert r.tokens_per_expert_list == tpe, f"{layout} step {step}: per expert"
                assert torch.equal(y.view(torch.int16), out), f"{layout} step {step}: combine"
                got[layout] = {
                    "syncs": (s1 - s0) + (s3 - s2) + len(py_mid[0]) + len(py2["syncs"]),
                    "launches": (l1 - l0) + (l3 - l2) + len(py_mid[1]) + len(py2["launches"]),
                    "torch_ops": py_mid[1] + py2["launches"],
                    "python_syncs": py_mid[0] + py2["syncs"],
                }
            stats = buf.stats()
            assert stats["calls"] == 6 and stats["last_bytes_per_rank"][0] > 16, stats
    assert not cuda_emu_module.leaks(hooks)
    return got


def test_low_latency_counts(emu_so, capsys):
    """One low_latency_dispatch + low_latency_combine on the CUDA backend: 0 host syncs and
    at most 4 launches, in both layouts (and the results equal the CPU transport's)."""
    got = run_ranks(1, _rank_counts, emu_so, timeout=300)[0].unwrap()
    with capsys.disabled():
        for layout, c in got.items():
            print(f"\n{layout}: host syncs: {c['syncs']}, launches: {c['launches']}"
                  f"  (torch ops {c['torch_ops']}, python syncs {c['python_syncs']})")  # fmt: skip
    for layout, c in got.items():
        assert c["syncs"] == 0, (layout, c)
        assert c["launches"] <= LAUNCH_TARGET, (layout, c)


# ---- graph capture -------------------------------------------------------------------------
def _rank_graph(rank: int, world: int, so: str) -> None:
    """Buffer.low_latency_dispatch and low_latency_combine themselves captured (two graphs:
    the experts run between them) and replayed with new inputs copied into the captured ones."""
    import cuda_emu_module

    import pcie_a2a

    hooks = cuda_emu_module.install(Path(so))
    stream = cuda_emu_module.EMU_STREAM.current
    for layout in ("rows", "expert_major"):
        want = _cpu_reference(layout, 4)
        with pcie_a2a.Buffer(None, E, H, M, num_topk=K, backend="cuda") as buf:
            x, ids, w = (t.clone() for t in _inputs(0))
            r = buf.low_latency_dispatch(x, ids, w, layout=layout)  # eager warm-up
            buf.low_latency_combine(_expert(r, layout), r.handle)
            hooks.begin_capture(stream)
            res = buf.low_latency_dispatch(x, ids, w, layout=layout)
            g_dispatch = hooks.end_capture(stream)
            y = torch.zeros_like(_expert(res, layout))
            hooks.begin_capture(stream)
            out = buf.low_latency_combine(y, res.handle)
            g_combine = hooks.end_capture(stream)
            for step in range(1, 4):
                nx, nids, nw = _inputs(step)
                x.copy_(nx)
                ids.copy_(nids)
                w.copy_(nw)
                hooks.launch(g_dispatch, stream)
                y.copy_(_expert(res, layout))
                hooks.launch(g_combine, stream)
                buf.check()
                v, tpe, o = want[step]
                assert torch.equal(_valid(res, layout), v), f"{layout} replay {step}: rows"
                assert res.tokens_per_expert.tolist() == tpe
                assert torch.equal(out.view(torch.int16), o), f"{layout} replay {step}: combine"
            hooks.destroy_graph(g_dispatch)
            hooks.destroy_graph(g_combine)
    assert not cuda_emu_module.leaks(hooks)


def test_low_latency_calls_captured_and_replayed(emu_so):
    run_ranks(1, _rank_graph, emu_so, timeout=300)[0].unwrap()


# ---- ids checked on the device -------------------------------------------------------------
def _rank_bad_ids(rank: int, world: int, so: str) -> str:
    import cuda_emu_module

    import pcie_a2a

    cuda_emu_module.install(Path(so))
    with pcie_a2a.Buffer(None, E, H, M, num_topk=K, backend="cuda") as buf:
        x, ids, w = _inputs(0)
        ids[1, 0] = E + 5  # past the experts
        ids[2, 1] = ids[2, 0]  # an expert twice
        first = buf._transport.calls_made()[0] + 1  # the Buffer's calls follow the self-test's
        r = buf.low_latency_dispatch(x, ids, w)  # no host look at the ids: it runs
        # The next call raises (here the combine: the emulated kernel has already run) and
        # is aborted on the wire, as a ValueError of the host check is.
        with pytest.raises(
            ValueError, match=rf"topk_ids of low_latency_dispatch \(call {first}\)"
        ) as info:
            buf.low_latency_combine(_expert(r, "rows"), r.handle)
        x, ids, w = _inputs(1)
        r = buf.low_latency_dispatch(x, ids, w)  # usable: the word was cleared
        y = buf.low_latency_combine(_expert(r, "rows"), r.handle)
        assert torch.equal(y.view(torch.int16), _cpu_reference("rows", 2)[1][2])
        return str(info.value)


def test_bad_ids_are_found_on_the_device_and_raised_next(emu_so):
    msg = run_ranks(1, _rank_bad_ids, emu_so, timeout=300)[0].unwrap()
    assert "outside [-1, 8)" in msg and "listed twice" in msg, msg


# ---- the in-process harness ----------------------------------------------------------------
def _rank_in_process(rank: int, world: int, so: str, case: C.Case) -> None:
    import cuda_emu_module

    from pcie_a2a.transport.cuda import CudaTransport

    hooks = cuda_emu_module.install(Path(so))
    txs = CudaTransport.in_process(
        case.world, case.hidden, case.max_tokens, case.num_topk, C.PAYLOADS[case.payload],
        C.DTYPES[case.dtype][1], C.placement(case), pair_transport=C.pair_plan(case),
        pair_direction=C.pair_direction(case),
    )  # fmt: skip
    want = C.pair_direction(case)
    assert [[list(r) for r in t.pair_direction] for t in txs] == [want] * case.world
    pulled = [
        sum(1 << d for d in range(case.world) if want[r][d] == "pull") for r in range(case.world)
    ]
    assert [t._native.pull_send_mask for t in txs] == pulled
    for t in txs:
        t.emu_stream = hooks.stream()
    w, m, k = case.world, case.max_tokens, case.num_topk
    dtype = C.DTYPES[case.dtype][0]
    for step in range(3):
        ins = [C.inputs(case, r, step) for r in range(w)]
        bufs = []
        for r, t in enumerate(txs):  # every send first: each receive waits for all of them
            b = dict(
                send_token=torch.empty(w * m, dtype=torch.int32),
                send_count=torch.empty(w, dtype=torch.int32),
                counts=torch.empty(w, dtype=torch.int32),
                xo=torch.empty(w * m, case.hidden, dtype=dtype),
                src_rank=torch.empty(w * m, dtype=torch.int32),
                src_token=torch.empty(w * m, dtype=torch.int32),
                ids_o=torch.empty(w * m, k, dtype=torch.int32),
                ws_o=torch.empty(w * m, k, dtype=torch.float32),
                per_expert=torch.empty(t.num_local_experts, dtype=torch.int32),
                out=torch.empty(case.max_tokens, case.hidden, dtype=dtype),
                td=t.new_ticket(),
                tc=t.new_ticket(),
            )
            x, ids, wt = ins[r]
            t.dispatch_send_async(b["td"], 3, x, ids, wt, b["send_token"], b["send_count"])
            bufs.append(b)
        for t, b in zip(txs, bufs):
            t.recv_rows_async(b["td"], b["counts"], b["xo"], None, None, b["src_rank"],
                              b["src_token"], b["ids_o"], b["ws_o"], b["per_expert"])  # fmt: skip
        for r, (t, b) in enumerate(zip(txs, bufs)):
            t.check()
            b["y"] = C.rows_fn(b["xo"], r)
            t.combine_send_async(b["tc"], 4, b["y"], b["counts"])
        for r, (t, b) in enumerate(zip(txs, bufs)):
            n = ins[r][0].shape[0]
            t.combine_recv_async(b["tc"], b["send_token"], b["send_count"], n, b["out"][:n])
            t.check()
            C.check_ll_rows(case, r, step, b, n)
    assert CudaTransport.close_in_process(txs) == [True] * w
    for t in txs:
        hooks.destroy_stream(t.emu_stream)
    assert not cuda_emu_module.leaks(hooks)


@pytest.mark.parametrize(
    "case",
    [C.Case("inproc_p2p_3", 3, "ll_rows", experts=9, seed=70),
     C.Case("inproc_mixed_fp8_2", 2, "ll_rows", payload="fp8", transport="mixed", seed=71),
     # pulled P2P pairs beside pushed and host-staged (push) ones, three calls (parity reuse)
     C.Case("inproc_pull_mixed_3", 3, "ll_rows", experts=9, transport="mixed",
            direction="mixed", seed=72),
     C.Case("inproc_pull_all_2", 2, "ll_rows", direction="pull", seed=73)],
    ids=lambda c: c.name,
)  # fmt: skip
def test_in_process_transports(emu_so, case):
    run_ranks(1, _rank_in_process, emu_so, case, timeout=300)[0].unwrap()


def test_the_counter_sees_launches_and_syncs():
    """counted() is what the launch/sync targets rest on: it must see both (no emulation)."""
    t = torch.ones(4)
    with counted() as seen:
        torch.empty(3)  # an allocation: no kernel
        u = torch.zeros(3)  # a fill kernel on a GPU
        (t + 1).tolist()  # a kernel and a synchronisation
        _ = u[0].item()
    assert "tolist" in seen["syncs"] and "item" in seen["syncs"], seen
    assert {"zeros", "add"} <= set(seen["launches"]), seen
    assert "empty" not in seen["launches"], seen


# ---- the start-up self-test ----------------------------------------------------------------
# 0 -> 1 P2P pull, 1 -> 0 P2P push, 0 <-> 2 host-staged, 1 -> 2 P2P pull, 2 -> 1 P2P push
_ST_PLAN = [["p2p", "p2p", "staged"], ["p2p", "p2p", "p2p"], ["staged", "p2p", "p2p"]]
_ST_DIR = [["push", "pull", "push"], ["push", "push", "pull"], ["push", "push", "push"]]


def _corrupt(t, op: int, src: int) -> None:
    """A path that damages the rows of one source: one channel of each row it delivers."""
    orig = t.unpack_rows

    def unpack(parity, counts, row_base, x_out, *rest):
        orig(parity, counts, row_base, x_out, *rest)
        if t._dispatch_op == op:
            x_out.view(-1, x_out.shape[-1])[rest[2].view(-1) == src, 3] += 1

    t.unpack_rows = unpack


def _corrupt_expert_major(t, src: int) -> None:
    """The same damage in the expert-major receive: every row ``src`` delivers."""
    orig = t.unpack_expert_major

    def unpack(parity, counts, e_n, x_out, *rest):
        orig(parity, counts, e_n, x_out, *rest)
        layout_range = rest[4]
        for e in range(e_n):
            begin, count = int(layout_range[e, src]) >> 32, int(layout_range[e, src]) & 0xFFFFFFFF
            x_out[e, begin : begin + count, 5] += 1

    t.unpack_expert_major = unpack


def _silent(t, op: int) -> None:
    """A rank whose rows of ``op`` never arrive anywhere."""
    orig = t.dispatch_send
    t.dispatch_send = lambda seq, o, *a: None if o == op else orig(seq, o, *a)


def _rank_self_test(rank: int, world: int, so: str) -> dict:
    import cuda_emu_module

    import pcie_a2a
    from pcie_a2a.buffer_memory import dispatch_slot_bytes, segment_bytes
    from pcie_a2a.placement import Placement
    from pcie_a2a.transport.cuda import CudaTransport, selftest

    hooks = cuda_emu_module.install(Path(so))
    got = {}
    # world 1: the Buffer runs it before it returns (and numbers its calls after it)
    with pcie_a2a.Buffer(None, E, H, M, num_topk=K, backend="cuda") as buf:
        got["buffer_calls"] = buf._transport.calls_made()
        mem = buf.memory_bytes()
        assert mem["segment"] == buf._transport._native.segment_bytes, mem
        assert mem["device"] == mem["segment"] and mem["host"] == 0, mem  # no staged peer
        got["buffer_stats_calls"] = buf.stats()["calls"]
    orig = CudaTransport.unpack_rows

    def broken(self, parity, counts, row_base, x_out, *rest):
        orig(self, parity, counts, row_base, x_out, *rest)
        x_out.view(-1, x_out.shape[-1])[rest[2].view(-1) == 0, 0] += 1

    CudaTransport.unpack_rows = broken
    try:
        pcie_a2a.Buffer(None, E, H, M, num_topk=K, backend="cuda")
        got["buffer_fault"] = "not raised"
    except RuntimeError as exc:
        got["buffer_fault"] = str(exc)
    finally:
        CudaTransport.unpack_rows = orig
    # three in-process ranks over P2P push, pull and host-staged pairs
    placement = Placement.contiguous(9, 3)
    for fault in ("none", "staged_normal", "pull_ll", "push_ll", "staged_em", "silent_ll", "fp8"):
        txs = CudaTransport.in_process(
            3, H, 40, K, 2 if fault == "fp8" else 0, 0, placement, pair_transport=_ST_PLAN,
            pair_direction=_ST_DIR,
        )  # fmt: skip
        for t in txs:
            t.emu_stream = hooks.stream()
            # The copy-engine path copies device tickets to pinned host memory, which the
            # Python-level model cannot tell from torch CPU tensors: it runs in the native
            # emulation (tests/native/transport_emu), and its phase is checked below only
            # by name.
            t.copy_engine_min_bytes = None
        if fault == "staged_normal":
            _corrupt(txs[2], 1, 0)  # 0 -> 2: host-staged
        elif fault == "pull_ll":
            _corrupt(txs[1], 3, 0)  # 0 -> 1: P2P pull
        elif fault == "push_ll":
            _corrupt(txs[0], 3, 1)  # 1 -> 0: P2P push
        elif fault == "staged_em":
            _corrupt_expert_major(txs[2], 0)  # 0 -> 2: host-staged, expert-major receive
        elif fault == "silent_ll":
            _silent(txs[2], 3)
        payload = "fp8" if fault == "fp8" else "bf16"
        for t in txs:  # the memory formula is the allocator's (pulled pairs: the pull slots)
            want = segment_bytes(3, H, 40, K, payload, with_pull=True, staged_progress=True)
            assert t._native.segment_bytes == want, (t._native.segment_bytes, want)
            assert t._native.dispatch_slot_bytes == dispatch_slot_bytes(H, K, payload)
        got[fault] = selftest.run_in_process(txs, placement, fault == "fp8", timeout_s=1.0)
        got[fault + "_phases"] = [p[0] for p in selftest._phases(txs[0])]
        txs[0].copy_engine_min_bytes = 4096  # a pair of >= 8 rows would take it
        got[fault + "_ce_phases"] = [p[0] for p in selftest._phases(txs[0])]
        CudaTransport.close_in_process(txs)
        for t in txs:
            hooks.destroy_stream(t.emu_stream)
    assert not cuda_emu_module.leaks(hooks)
    return got


def test_self_test_passes_and_names_the_broken_pair(emu_so):
    """The known-answer check on the CUDA execution model: it passes on good paths (a world-1
    Buffer, three in-process ranks over push, pull and host-staged pairs, bf16 and fp8), and
    a row damaged on one pair, in one mode, or a rank that never sends, fails it with the
    pair, its path and the ways out named."""
    got = run_ranks(1, _rank_self_test, emu_so, timeout=300)[0].unwrap()
    phases = ["normal mode", "normal mode, copy-engine sized", "low-latency mode",
              "low-latency mode, expert-major"]  # fmt: skip
    assert got["none_phases"] == [phases[0], *phases[2:]], got["none_phases"]
    assert got["none_ce_phases"] == phases, got["none_ce_phases"]
    assert got["none"] == "" and got["fp8"] == "", (got["none"], got["fp8"])
    calls, d_calls, c_calls = got["buffer_calls"]
    assert calls >= 4 and d_calls == c_calls == calls // 2, got["buffer_calls"]
    assert got["buffer_stats_calls"] == 0  # the Buffer's statistics exclude the self-test
    for key, pair in (
        ("buffer_fault", "rank 0 -> rank 0 (P2P push"),
        ("staged_normal", "normal mode dispatch: rank 0 -> rank 2 (host-staged): rows"),
        ("pull_ll", "low-latency mode dispatch: rank 0 -> rank 1 (P2P pull): rows"),
        ("push_ll", "low-latency mode dispatch: rank 1 -> rank 0 (P2P push): rows"),
        ("staged_em", "expert-major dispatch: rank 0 -> rank 2 (host-staged): rows"),
    ):
        msg = got[key]
        assert pair in msg and "with wrong bytes" in msg, (key, msg)
        assert "PCIE_A2A_P2P=0" in msg and "PCIE_A2A_BACKEND=cpu" in msg, msg
    assert "low-latency mode dispatch: rank 0 -> rank 1" not in got["staged_normal"]
    msg = got["silent_ll"]
    assert "PeerTimeoutError" in msg and "rank 2" in msg and "PCIE_A2A_P2P=0" in msg, msg


# ---- normal mode in pieces on the CUDA transport -------------------------------------------
def _rank_pieces(rank: int, world: int, so: str) -> list[int]:
    import cuda_emu_module

    import pcie_a2a

    hooks = cuda_emu_module.install(Path(so))
    calls = []
    with (pcie_a2a.Buffer(None, E, H, 4, num_topk=K, backend="cuda",
                          max_dispatch_tokens=M) as pieces,
          pcie_a2a.Buffer(None, E, H, M, num_topk=K, backend="cpu") as whole):  # fmt: skip
        for step in range(2):
            x, ids, w = _inputs(step)  # M - 2 tokens: three pieces of 4
            a, b = pieces.dispatch(x, ids, w), whole.dispatch(x, ids, w)
            for u, v in zip((a.x.view(torch.int16), a.src_token, a.topk_ids, a.topk_weights,
                             a.tokens_per_expert), (b.x.view(torch.int16), b.src_token,
                             b.topk_ids, b.topk_weights, b.tokens_per_expert)):  # fmt: skip
                assert torch.equal(u, v), step
            ya = pieces.combine(_expert(a, "rows"), a.handle)
            yb = whole.combine(_expert(b, "rows"), b.handle)
            assert torch.equal(ya.view(torch.int16), yb.view(torch.int16)), step
            calls.append(pieces.stats()["calls"])
    assert not cuda_emu_module.leaks(hooks)
    return calls


def test_normal_mode_in_pieces_on_the_cuda_transport(emu_so):
    """A 10-token dispatch through a 4-token CUDA region (three pieces) equals one call of
    the CPU transport with a region for all of it."""
    calls = run_ranks(1, _rank_pieces, emu_so, timeout=300)[0].unwrap()
    assert calls == [6, 12], calls  # three pieces, dispatch and combine each, per step
