"""Bad input raises a clear exception naming the argument, on the rank that passed it;
its peers raise PeerAbortedError at once (no hang), and the Buffer stays usable."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_ok, run_ranks

E, H, M, K = 8, 128, 8, 4


def _good(t=4):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    return x, ids, torch.rand(t, K, generator=g)


def _dispatch_args(case):
    x, ids, w = _good()
    if case == "x-dtype":
        x = x.float()
    elif case == "x-hidden":
        x = torch.zeros(4, H + 8, dtype=torch.bfloat16)
    elif case == "x-noncontig":
        x = torch.zeros(H, 4, dtype=torch.bfloat16).t()
    elif case == "x-too-many-tokens":
        x, ids, w = _good(M + 1)
    elif case == "x-not-tensor":
        x = x.tolist()
    elif case == "x-device":
        x = torch.empty(4, H, dtype=torch.bfloat16, device="meta")
    elif case == "ids-out-of-range":
        ids[1, 2] = E
    elif case == "ids-below-minus-one":
        ids[0, 0] = -2
    elif case == "ids-repeated":
        ids[2, 1] = ids[2, 0]
    elif case == "ids-float":
        ids = ids.float()
    elif case == "ids-too-wide":
        ids = torch.cat([ids, ids[:, :1] * 0 - 1], dim=1)
        w = torch.rand(4, K + 1)
    elif case == "ids-rows":
        ids = ids[:3].contiguous()
    elif case == "weights-shape":
        w = w[:, :2].contiguous()
    elif case == "weights-dtype":
        w = w.to(torch.bfloat16)
    return x, ids, w


# (case, call, exception type, fragment of the message)
DISPATCH_CASES = [
    ("x-dtype", TypeError, "x.dtype"),
    ("x-hidden", ValueError, "x.shape"),
    ("x-noncontig", ValueError, "non-contiguous"),
    ("x-too-many-tokens", ValueError, "max_tokens_per_rank=8"),
    ("x-not-tensor", TypeError, "x: got list"),
    ("x-device", ValueError, "x.device"),
    ("ids-out-of-range", ValueError, "expert id 8"),
    ("ids-below-minus-one", ValueError, "expert id -2"),
    ("ids-repeated", ValueError, "each expert at most once"),
    ("ids-float", TypeError, "topk_ids.dtype"),
    ("ids-too-wide", ValueError, "num_topk=4"),
    ("ids-rows", ValueError, "topk_ids.shape"),
    ("weights-shape", ValueError, "topk_weights.shape"),
    ("weights-dtype", TypeError, "topk_weights.dtype"),
]


OUT_CASES = {  # a caller's `out=` tensor for combine that does not fit the call
    "out-shape": lambda: torch.empty(5, H, dtype=torch.bfloat16),
    "out-dtype": lambda: torch.empty(4, H, dtype=torch.float16),
    "out-not-tensor": lambda: [[0.0] * H] * 4,
}


def _table(rank, world):
    import pcie_a2a

    seen = []
    with pcie_a2a.Buffer(None, E, H, M, num_topk=K, timeout_s=20) as buf:
        for case, _, _ in DISPATCH_CASES:
            for call in ("dispatch", "low_latency_dispatch"):
                args = _dispatch_args(case) if rank == 0 else _good()
                try:
                    getattr(buf, call)(*args)
                    seen.append((case, call, "no error"))
                except Exception as exc:
                    seen.append((case, call, type(exc).__name__, str(exc)))
        # combine-side mistakes, after a good dispatch
        res = buf.dispatch(*_good())
        ll = buf.low_latency_dispatch(*_good(), layout="rows")
        for case in ("y-shape", "y-dtype", "ll-handle", "not-handle", *OUT_CASES):
            y = res.x.clone()
            handle = res.handle
            out = None
            if rank == 0 and case in OUT_CASES:
                out = OUT_CASES[case]()
            elif rank == 0:
                if case == "y-shape":
                    y = torch.zeros(y.shape[0] + 1, H, dtype=torch.bfloat16)
                elif case == "y-dtype":
                    y = y.half()
                elif case == "ll-handle":
                    handle = ll.handle
                else:
                    handle = object()
            try:
                buf.combine(y, handle, out=out)
                seen.append((case, "combine", "no error"))
            except Exception as exc:
                seen.append((case, "combine", type(exc).__name__, str(exc)))
        try:
            buf.low_latency_dispatch(*_good(), layout="columns" if rank == 0 else "rows")
            seen.append(("layout", "low_latency_dispatch", "no error"))
        except Exception as exc:
            seen.append(("layout", "low_latency_dispatch", type(exc).__name__, str(exc)))
        # still usable on every rank after all of that
        res = buf.dispatch(*_good())
        out = buf.combine(res.x.clone(), res.handle)
        assert out.shape == (4, H)
        # a good `out=` (NaN first: every row must be written) is the result, bit for bit
        res = buf.dispatch(*_good())
        mine = torch.full((4, H), float("nan"), dtype=torch.bfloat16)
        got = buf.combine(res.x.clone(), res.handle, out=mine)
        assert got.data_ptr() == mine.data_ptr() and torch.equal(mine, out)
        ll = buf.low_latency_dispatch(*_good(), layout="rows")
        plain = buf.low_latency_combine(ll.x.clone(), ll.handle)
        ll = buf.low_latency_dispatch(*_good(), layout="rows")
        mine = torch.full((4, H), float("nan"), dtype=torch.bfloat16)
        got = buf.low_latency_combine(ll.x.clone(), ll.handle, out=mine)
        assert got.data_ptr() == mine.data_ptr() and torch.equal(mine, plain)
    return seen


COMBINE_CASES = [
    ("y-shape", ValueError, "y.shape"),
    ("y-dtype", TypeError, "y.dtype"),
    ("ll-handle", ValueError, "low_latency_combine"),
    ("not-handle", TypeError, "handle: got object"),
    ("out-shape", ValueError, "out.shape"),
    ("out-dtype", TypeError, "out.dtype"),
    ("out-not-tensor", TypeError, "out: got list"),
    ("layout", ValueError, "layout"),
]


def test_bad_inputs_raise_clear_errors_and_peers_abort():
    rank0, rank1 = run_ok(2, _table, timeout=120)
    expected = [
        (c, call, t, f)
        for c, t, f in DISPATCH_CASES
        for call in ("dispatch", "low_latency_dispatch")
    ]
    expected += [
        (c, "combine" if c != "layout" else "low_latency_dispatch", t, f)
        for c, t, f in COMBINE_CASES
    ]
    assert len(rank0) == len(expected)
    for got, (case, call, exc_type, fragment) in zip(rank0, expected):
        assert got[:3] == (case, call, exc_type.__name__), got
        assert fragment in got[3], (case, got[3])
    for got in rank1:
        assert got[2] == "PeerAbortedError", got
        assert "rank 0 aborted" in got[3]


def _mismatch_args(rank, world, which):
    import pcie_a2a

    kwargs = {"hidden": H, "payload": "bf16", "num_experts": E}
    if rank == 1:
        if which == "hidden":
            kwargs["hidden"] = 2 * H
        elif which == "payload":
            kwargs["payload"] = "fp8"
        else:
            kwargs["num_experts"] = 2 * E
    pcie_a2a.Buffer(None, kwargs["num_experts"], kwargs["hidden"], M, payload=kwargs["payload"])


@pytest.mark.parametrize("which", ["hidden", "payload", "num_experts"])
def test_buffer_arguments_that_differ_between_ranks(which):
    outcomes = run_ranks(2, _mismatch_args, which, timeout=60)
    for o in outcomes:
        assert o.error_type == "ValueError", o
        assert f"'{which}' differs between ranks" in o.error


def _call_mismatch(rank, world):
    import pcie_a2a

    with pcie_a2a.Buffer(None, E, H, M, num_topk=K, timeout_s=20) as buf:
        fn = buf.dispatch if rank == 0 else buf.low_latency_dispatch
        try:
            fn(*_good())
        except pcie_a2a.PeerError as exc:
            msg = str(exc)
        try:
            buf.dispatch(*_good())
        except RuntimeError as exc:
            return msg, str(exc)
    return msg, "no error"


def test_calls_that_differ_between_ranks_are_detected():
    (m0, after0), (m1, after1) = run_ok(2, _call_mismatch, timeout=60)
    assert "rank 1 is in low_latency_dispatch while rank 0 is in dispatch" in m0
    assert "rank 0 is in dispatch while rank 1 is in low_latency_dispatch" in m1
    assert "failed earlier" in after0 and "failed earlier" in after1


@pytest.mark.parametrize(
    "kwargs, exc_type, fragment",
    [
        ({"payload": "int4"}, ValueError, "payload"),
        ({"payload": "fp16"}, ValueError, "payload"),
        ({"dtype": torch.float32}, TypeError, "dtype"),
        ({"hidden": 100}, ValueError, "hidden: got 100"),
        ({"hidden": 136, "payload": "fp8"}, ValueError, "multiple of 128"),
        ({"placement": "not a placement"}, ValueError, "placement"),
        ({"max_tokens_per_rank": 0}, ValueError, "max_tokens_per_rank"),
        ({"timeout_s": -1}, ValueError, "timeout_s"),
        ({"backend": "mpi"}, ValueError, "backend"),
        ({"placement": [(0, 0)] * 8}, ValueError, "share rank 0 local index 0"),
    ],
)
def test_constructor_rejects_bad_arguments(single_rank_group, kwargs, exc_type, fragment):
    import pcie_a2a

    args = {"num_experts": 8, "hidden": 128, "max_tokens_per_rank": 8} | kwargs
    with pytest.raises(exc_type, match=fragment):
        pcie_a2a.Buffer(
            None,
            args.pop("num_experts"),
            args.pop("hidden"),
            args.pop("max_tokens_per_rank"),
            **args,
        )


def test_contiguous_placement_needs_divisible_experts():
    from pcie_a2a import Placement

    with pytest.raises(ValueError, match="num_experts=7 is not divisible by world=2"):
        Placement.contiguous(7, 2)
