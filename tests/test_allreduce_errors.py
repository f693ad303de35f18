"""Bad input, peers that abort, disagree, skip a call or die: clear exceptions naming the
argument or the peer, never a hang; and nothing left behind."""

from __future__ import annotations

import os

import pytest
import torch

import pcie_a2a
from dist_utils import run_ranks

BAD = [
    # (what rank 1 passes, the exception it gets, the message)
    ("float32", TypeError, r"x.dtype: got torch.float32; allowed: torch.bfloat16"),
    ("strided", ValueError, r"x: got a non-contiguous tensor; allowed: a contiguous tensor"),
    ("residual_shape", ValueError, r"residual.shape: got \[8\]; allowed: \[4096\] \(the shape of x\)"),
    ("out_dtype", TypeError, r"out.dtype: got torch.float16"),
]  # fmt: skip


def _bad_input(rank: int, world: int) -> list[str]:
    """Rank 1 passes each bad input in turn; after each, every rank makes a good call."""
    x = torch.ones(4096, dtype=torch.bfloat16)
    got = []
    with pcie_a2a.AllReduce(None, 1 << 16, torch.bfloat16, timeout_s=30) as ar:
        for kind, _, _ in BAD:
            try:
                if rank == 1:
                    args = {
                        "float32": ((x.float(),), {}),
                        "strided": ((torch.ones(8192, dtype=torch.bfloat16)[::2],), {}),
                        "residual_shape": ((x,), {"residual": torch.ones(8, dtype=torch.bfloat16)}),
                        "out_dtype": ((x,), {"out": torch.empty(4096, dtype=torch.float16)}),
                    }[kind]
                    ar.all_reduce(*args[0], **args[1])
                else:
                    ar.all_reduce(x)
                got.append("no error")
            except (TypeError, ValueError, pcie_a2a.PeerAbortedError) as exc:
                got.append(f"{type(exc).__name__}: {exc}")
            # the skipped call was skipped everywhere: the next one works on every rank
            y = ar.all_reduce(x)
            assert float(y[0]) == world, float(y[0])
    return got


def test_bad_input_raises_here_and_aborts_the_call_for_the_peers():
    import re

    out = [o.unwrap() for o in run_ranks(3, _bad_input)]
    for i, (kind, exc, msg) in enumerate(BAD):
        assert out[1][i].startswith(exc.__name__) and re.search(msg, out[1][i]), (kind, out[1][i])
        call = 2 * i + 1  # each bad call is followed by a good one
        for r in (0, 2):
            want = f"PeerAbortedError: rank 1 aborted all-reduce call {call}"
            assert out[r][i].startswith(want), (kind, out[r][i])


def _peer_failures(rank: int, world: int, how: str) -> str:
    x = torch.ones(4096 if not (how == "size" and rank == 2) else 2048, dtype=torch.bfloat16)
    ar = pcie_a2a.AllReduce(None, 1 << 16, torch.bfloat16, timeout_s=60.0)
    ar.all_reduce(x[:2048])  # one good call first, with room for a loaded machine
    ar.timeout_s = 1.0  # then the deadline under test
    if how == "skip" and rank == 2:
        import time

        time.sleep(3)  # rank 2 does not come to call 2 (alive, just absent)
        return "skipped"
    if how == "exit" and rank == 2:
        os._exit(0)  # dies without a word
    try:
        ar.all_reduce(x)
        return "no error"
    except pcie_a2a.PeerError as exc:
        msg = f"{type(exc).__name__}: {exc}"
    # a communicator that saw a peer fail refuses further calls
    try:
        ar.all_reduce(x)
    except RuntimeError as exc:
        msg += f" | then: {exc}"
    ar.close()
    return msg


def test_a_peer_that_skips_a_call_is_a_timeout_naming_it():
    out = run_ranks(3, _peer_failures, "skip")
    for r in (0, 1):
        msg = out[r].unwrap()
        assert msg.startswith("PeerTimeoutError"), msg
        assert (
            f"rank {r} timed out after 1 s in all-reduce call 2 (scatter) waiting for rank(s) 2"
            in msg
        ), msg
        assert "failed earlier and cannot be used" in msg, msg


def test_a_peer_that_exits_is_named():
    out = run_ranks(3, _peer_failures, "exit")
    for r in (0, 1):
        msg = out[r].unwrap()
        assert msg.startswith("PeerError") and "rank 2 (pid" in msg and "exited before" in msg, msg


def test_ranks_that_disagree_on_the_size_get_an_error_naming_the_peer():
    out = run_ranks(3, _peer_failures, "size")
    msgs = [o.unwrap() for o in out]
    assert any(
        "rank 2 all-reduces 2048 bfloat16 (one-shot) in call 2 while rank" in m for m in msgs
    ), msgs
    assert all(m.startswith("PeerError") for m in msgs), msgs


CONSTRUCT = [
    ("differs", "ValueError: AllReduce argument 'max_bytes' differs between ranks: [4096, 8192]"),
    ("max_bytes", "ValueError: max_bytes: got 100; allowed: a multiple of 16 bytes"),
    ("dtype", "TypeError: dtype: got torch.float32; allowed: torch.bfloat16, torch.float16"),
    ("algorithm", "ValueError: algorithm: got 'three_shot'; allowed: auto, one_shot, two_shot, fallback"),
    ("backend", "ValueError: backend='cuda' is not available here"),
    ("direction", "ValueError: pair_direction[1][1]: a rank cannot pull from itself"),
    ("handover", "ValueError: handover_bytes: got -1; allowed: None or an int >= 0"),
]  # fmt: skip


def _construct(rank: int, world: int) -> list[str]:
    out = []
    for case, _ in CONSTRUCT:
        kwargs = {"max_bytes": 1 << 12, "dtype": torch.bfloat16}
        if case == "differs":
            kwargs["max_bytes"] = 1 << (12 + rank)
        elif case == "max_bytes":
            kwargs["max_bytes"] = 100
        elif case == "dtype":
            kwargs["dtype"] = torch.float32
        elif case == "algorithm":
            kwargs["algorithm"] = "three_shot"
        elif case == "backend":
            kwargs["backend"] = "cuda"
        elif case == "direction":
            kwargs["pair_direction"] = [["push", "pull"], ["pull", "pull"]]
        elif case == "handover":
            kwargs["handover_bytes"] = -1
        try:
            pcie_a2a.AllReduce(None, **kwargs).close()
            out.append("no error")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_bad_construction_is_refused_with_the_argument_named():
    out = [o.unwrap() for o in run_ranks(2, _construct)]
    for i, (case, want) in enumerate(CONSTRUCT):
        if case == "backend" and pcie_a2a.cuda_available():
            continue  # a GPU is present: backend='cuda' is available
        assert all(o[i].startswith(want) for o in out), (case, [o[i] for o in out])


def test_closed_and_single_rank(single_rank_group):
    ar = pcie_a2a.AllReduce(None, 1 << 12, torch.float16)
    x = torch.randn(64).half()
    res = torch.randn(64).half()
    assert torch.equal(ar.all_reduce(x), x)  # one rank: the identity
    assert torch.equal(ar.all_reduce(x, residual=res), x + res)
    # not a tensor: refused locally (its size is unknown, so the peers cannot be told
    # which call to skip; they would time out naming this rank)
    with pytest.raises(TypeError, match="x: got list; allowed: a torch.Tensor"):
        ar.all_reduce([1.0] * 64)
    with pytest.raises(TypeError, match="residual: got int"):
        ar.all_reduce(x, residual=3)
    ar.close()
    ar.close()
    with pytest.raises(RuntimeError, match="this AllReduce is closed"):
        ar.all_reduce(x)
    with pytest.raises(RuntimeError, match="closed or was never created"):
        torch.ops.pcie_a2a.all_reduce(x, ar.handle, None)
