"""The all-reduce protocol driven directly in one process (two ranks' CPU implementations
attached to each other, calls split into their send and finish halves): the ownership
invariant of csrc/core/allreduce_wire.h and what breaks it, flags with call numbers, the
chunking every rank agrees on, and the segments' lifecycle."""

from __future__ import annotations

import itertools
import os
import stat
import uuid

import pytest
import torch

from pcie_a2a import _native
from pcie_a2a.allreduce import reference as R
from pcie_a2a.allreduce.cpu import native

BF16, ONE_SHOT, TWO_SHOT = 0, 1, 2
N = 2048  # one block


def _pair(buffers: int, end_barrier: bool, world: int = 2, max_bytes: int = 1 << 14):
    mod = native()
    prefix = f"pcie_a2a.{os.getpid()}_{uuid.uuid4().hex[:8]}"
    ranks = [
        mod.ShmAllReduce(prefix, r, world, max_bytes, buffers, end_barrier) for r in range(world)
    ]
    for r in ranks:
        r.attach_peers()
    for r in ranks:
        r.unlink_own()
    return ranks


def _x(value: float) -> torch.Tensor:
    return torch.full((N,), value, dtype=torch.bfloat16)


def _half(tx, half: str, seq: int, x: torch.Tensor, out: torch.Tensor, timeout: float = 5.0):
    getattr(tx, half)(seq, ONE_SHOT, BF16, x.data_ptr(), x.numel(), 0, out.data_ptr(), timeout)


@pytest.mark.parametrize(
    "buffers, barrier, expect",
    [(2, False, "correct"), (1, False, "corrupted"), (1, True, "blocked")],
    ids=["parity", "no-parity-no-barrier", "end-barrier"],
)
def test_ownership_invariant_and_what_breaks_it(buffers, barrier, expect):
    """Rank 1 is slow: it has sent call 1 but not yet summed it when rank 0 finishes call 1
    and sends call 2. With two buffers call 2 lands in the other one and rank 1 sums call 1
    right; with one buffer and no barrier rank 1 sums rank 0's call-2 data as if it were
    call 1's (the corruption a barrier-free fused all-reduce showed under graph replay);
    with the end barrier rank 0 cannot even finish call 1 before rank 1 has read it."""
    r0, r1 = _pair(buffers, barrier)
    try:
        out0, out1 = torch.empty(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16)
        _half(r0, "send", 1, _x(1.0), out0)
        _half(r1, "send", 1, _x(10.0), out1)
        if expect == "blocked":
            with pytest.raises(_native.transport().PeerTimeoutError, match="end barrier"):
                _half(r0, "finish", 1, _x(1.0), out0, timeout=0.3)
            return
        _half(r0, "finish", 1, _x(1.0), out0)
        assert float(out0[0]) == 11.0
        _half(r0, "send", 2, _x(100.0), out0)  # rank 0 runs on into call 2
        _half(r1, "finish", 1, _x(10.0), out1)  # the slow rank finally reads call 1
        got = float(out1[0])
        assert got == (11.0 if expect == "correct" else 110.0)
    finally:
        r0.close()
        r1.close()


def test_flags_carry_the_call_number():
    """A flag of call 1 never satisfies a wait for call 3 (same parity): no reset needed."""
    r0, r1 = _pair(2, False)
    try:
        out = torch.empty(N, dtype=torch.bfloat16)
        _half(r0, "send", 1, _x(1.0), out)
        _half(r1, "run", 1, _x(2.0), out)
        with pytest.raises(
            _native.transport().PeerTimeoutError,
            match=r"call 3 \(scatter\) waiting for rank\(s\) 0",
        ):
            _half(r1, "run", 3, _x(2.0), out, timeout=0.2)
    finally:
        r0.close()
        r1.close()


def test_the_flag_tag_names_a_disagreeing_peer():
    r0, r1 = _pair(2, False)
    try:
        out = torch.empty(N, dtype=torch.bfloat16)
        x = _x(1.0)
        r0.send(1, TWO_SHOT, BF16, x.data_ptr(), N, 0, out.data_ptr(), 5.0)
        with pytest.raises(
            _native.transport().PeerError,
            match=r"rank 0 all-reduces 2048 bfloat16 \(two-shot\) in call 1 while rank 1 all-reduces 2048 bfloat16 \(one-shot\)",
        ):
            _half(r1, "run", 1, x, out)
    finally:
        r0.close()
        r1.close()


def _good_call(r0, r1, seq: int) -> None:
    """Call seq on both ranks (rank 0 sends first, finishes last): 3 + 4 everywhere."""
    out0, out1 = torch.empty(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16)
    _half(r0, "send", seq, _x(3.0), out0)
    _half(r1, "run", seq, _x(4.0), out1)
    _half(r0, "finish", seq, _x(3.0), out0)
    assert float(out0[0]) == float(out1[0]) == 7.0


def test_abort_is_seen_by_the_peer_and_the_next_call_works():
    r0, r1 = _pair(2, False)
    try:
        out1 = torch.empty(N, dtype=torch.bfloat16)
        with pytest.raises(
            _native.transport().PeerTimeoutError, match="call 1 .scatter. waiting for rank.s. 1"
        ):
            r0.abort(1, 0.2)  # rank 1 has not begun call 1 yet (one thread drives both)
        with pytest.raises(
            _native.transport().PeerAbortedError, match="rank 0 aborted all-reduce call 1"
        ):
            _half(r1, "run", 1, _x(1.0), out1)
        _good_call(r0, r1, 2)
    finally:
        r0.close()
        r1.close()


def test_an_aborted_call_ends_only_when_every_peer_has_begun_it():
    """Rank 0 has sent call 1 but not read it; rank 1 finishes call 1 and aborts call 2. Were
    the abort to return at once, rank 1's call 3 (call 1's parity) would overwrite the flag
    and data rank 0 is about to read: so the abort waits for rank 0 to begin call 2, which
    rank 0 does only after finishing call 1."""
    r0, r1 = _pair(2, False)
    try:
        out0, out1 = torch.empty(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16)
        _half(r0, "send", 1, _x(1.0), out0)
        _half(r1, "run", 1, _x(10.0), out1)
        with pytest.raises(
            _native.transport().PeerTimeoutError,
            match=r"rank 1 timed out after 0.2 s in all-reduce call 2 \(scatter\) waiting for rank\(s\) 0",
        ):
            r1.abort(2, 0.2)
        _half(r0, "finish", 1, _x(1.0), out0)
        assert float(out0[0]) == float(out1[0]) == 11.0
        with pytest.raises(
            _native.transport().PeerAbortedError, match="rank 1 aborted all-reduce call 2"
        ):
            _half(r0, "run", 2, _x(1.0), out0)
        r1.abort(2, 5.0)  # rank 0 has begun call 2 now: returns at once
        _good_call(r0, r1, 3)
    finally:
        r0.close()
        r1.close()


@pytest.mark.parametrize("world", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("nvec", [1, 255, 256, 257, 4097, 16385, 1 << 20])
def test_chunks_cover_every_vector_once_in_order(world, nvec):
    mod = native()
    blocks, one = mod.chunks(ONE_SHOT, nvec, world)
    assert 1 <= blocks <= mod.MAX_BLOCKS and len(one) == blocks
    assert one[0][0] == 0 and one[-1][1] == nvec
    assert all(a[1] == b[0] for a, b in itertools.pairwise(one)), (
        "one-shot chunks must tile [0, nvec)"
    )
    blocks, two = mod.chunks(TWO_SHOT, nvec, world)
    assert 1 <= blocks <= mod.MAX_BLOCKS and len(two) == world * blocks
    pieces = [(lo, hi) for lo, hi in two if hi > lo]  # shard by shard, piece by piece
    assert pieces[0][0] == 0 and pieces[-1][1] == nvec
    assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces)), "two-shot pieces must tile"


def test_segment_layout_and_private_segments():
    mod = native()
    # header 4 KiB + flags (3 phases x 2 parities x 64 blocks x world x 8 B, page aligned)
    # + data (buffers x world x max_bytes) + gather (buffers x max_bytes)
    w, m = 4, 1 << 16
    flags = -(-(4096 + 3 * 2 * 64 * w * 8) // 4096) * 4096
    assert mod.segment_bytes(w, m, 2) == flags + 2 * w * m + 2 * m
    assert mod.segment_bytes(w, m, 1) == flags + w * m + m
    prefix = f"pcie_a2a.{os.getpid()}_{uuid.uuid4().hex[:8]}"
    tx = mod.ShmAllReduce(prefix, 0, 1, m, 2, False)
    path = "/dev/shm" + mod.ShmAllReduce.segment_name(prefix, 0)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    tx.close()
    assert not os.path.exists(path)
    tx.close()  # twice is fine


def test_bad_native_arguments_are_value_errors():
    mod = native()
    prefix = f"pcie_a2a.{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with pytest.raises(ValueError, match="max_bytes must be a positive multiple of 16"):
        mod.ShmAllReduce(prefix, 0, 1, 100, 2, False)
    with pytest.raises(ValueError, match=r"world size must be in \[1, 16\]"):
        mod.ShmAllReduce(prefix, 0, 17, 1 << 10, 2, False)
    with pytest.raises(ValueError, match="buffers must be 1 or 2"):
        mod.ShmAllReduce(prefix, 0, 1, 1 << 10, 3, False)
    (tx,) = _pair(2, False, world=1, max_bytes=1 << 10)
    try:
        x = _x(1.0)
        with pytest.raises(
            ValueError, match="numel must be a multiple of 8 with 2 \\* numel <= max_bytes = 1024"
        ):
            _half(tx, "run", 1, x, x)  # 4096 bytes > 1024
        with pytest.raises(ValueError, match="directions need world\\^2 = 1"):
            tx.set_directions([0, 1])
    finally:
        tx.close()


def test_host_rmsnorm_matches_the_torch_reference_exactly():
    g = torch.Generator().manual_seed(3)
    for dtype, code in ((torch.bfloat16, 0), (torch.float16, 1)):
        for rows, hidden in ((1, 7168), (4, 2056), (2, 8)):
            r = torch.randn(rows, hidden, generator=g).to(dtype)
            res = torch.randn(rows, hidden, generator=g).to(dtype)
            w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
            normed, res_out = torch.empty_like(r), torch.empty_like(r)
            native().rmsnorm_rows(r.data_ptr(), res.data_ptr(), w.data_ptr(), rows, hidden, 1e-6,
                                  code, normed.data_ptr(), res_out.data_ptr())  # fmt: skip
            want_n, want_r = R.add_rmsnorm(r, res, w, 1e-6)
            assert torch.equal(normed.view(torch.int16), want_n.view(torch.int16)), (dtype, hidden)
            assert torch.equal(res_out.view(torch.int16), want_r.view(torch.int16))
