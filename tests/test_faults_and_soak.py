"""A rank that dies makes its peers raise within timeout_s + 2 s, naming it; nothing is
left in /dev/shm (checked by conftest); and a long run of calls with random delays and
token counts stays exact."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from dist_utils import run_ranks

E, H, M, K = 12, 128, 16, 4
TIMEOUT = 6.0


def _inputs(rank, t, seed):
    g = torch.Generator().manual_seed(seed * 97 + rank)
    # small integers: every partial sum is exact in bf16 and fp32, so results are exact
    x = torch.randint(-8, 9, (t, H), generator=g).to(torch.bfloat16)
    ids = (
        torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
        if t
        else torch.empty(0, K, dtype=torch.int64)
    )
    ids[torch.rand(ids.shape, generator=g) < 0.2] = -1
    return x, ids, torch.rand(t, K, generator=g)


def _die_in(rank, world, where):
    import pcie_a2a

    buf = pcie_a2a.Buffer(None, E, H, M, num_topk=K, timeout_s=TIMEOUT)
    x, ids, w = _inputs(rank, 5, 0)
    victim = world - 1
    if where == "dispatch" and rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    res = buf.dispatch(x, ids, w)
    if where == "combine" and rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        buf.combine(res.x.clone(), res.handle)
    except pcie_a2a.PeerError as exc:
        return time.monotonic() - start, type(exc).__name__, str(exc)
    finally:
        buf.close()
    return None


def _die_in_dispatch(rank, world):
    import pcie_a2a

    buf = pcie_a2a.Buffer(None, E, H, M, num_topk=K, timeout_s=TIMEOUT)
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        buf.dispatch(*_inputs(rank, 5, 0))
    except pcie_a2a.PeerError as exc:
        return time.monotonic() - start, type(exc).__name__, str(exc)
    finally:
        buf.close()
    return None


@pytest.mark.parametrize("where", ["dispatch", "combine"])
def test_killed_rank_makes_peers_raise(where):
    world = 3
    fn = _die_in_dispatch if where == "dispatch" else _die_in
    args = () if where == "dispatch" else (where,)
    outcomes = run_ranks(world, fn, *args, timeout=60)
    assert outcomes[-1].error_type in ("Died", "Hang") and not outcomes[-1].ok
    for o in outcomes[:-1]:
        elapsed, kind, msg = o.unwrap()
        assert elapsed < TIMEOUT + 2, elapsed
        assert f"rank {world - 1}" in msg, msg
        assert kind in ("PeerError", "PeerTimeoutError")


def _silent_rank(rank, world):
    """Rank 1 is alive but never calls: rank 0 times out, naming rank 1 and the call."""
    import pcie_a2a

    with pcie_a2a.Buffer(None, E, H, M, num_topk=K, timeout_s=2.0) as buf:
        if rank == 1:
            time.sleep(4)
            return None
        start = time.monotonic()
        try:
            buf.dispatch(*_inputs(rank, 3, 0))
        except pcie_a2a.PeerTimeoutError as exc:
            assert isinstance(exc, TimeoutError)
            return time.monotonic() - start, str(exc)
    return None


def test_silent_rank_times_out_with_its_name():
    outcomes = run_ranks(2, _silent_rank, timeout=60)
    elapsed, msg = outcomes[0].unwrap()
    assert 2.0 <= elapsed < 4.0
    assert "timed out after 2 s in dispatch (call 1) waiting for rank(s) 1" in msg


def _soak(rank, world, calls):
    import pcie_a2a

    g = torch.Generator().manual_seed(1234 + rank)
    checked = 0
    checksum = 0.0
    with pcie_a2a.Buffer(None, E, H, M, num_topk=K, timeout_s=60) as buf:
        for i in range(calls // 2):
            if torch.rand(1, generator=g).item() < 0.05:
                time.sleep(float(torch.rand(1, generator=g)) * 2e-3)
            t = int(torch.randint(0, M + 1, (1,), generator=g))
            x, ids, w = _inputs(rank, t, i)
            ll = i % 3 == 2
            if ll:
                res = buf.low_latency_dispatch(x, ids, w)
                out = buf.low_latency_combine(res.x.clone(), res.handle)
            else:
                res = buf.dispatch(x, ids, w)
                out = buf.combine(res.x.clone(), res.handle)  # identity experts
            _, _, in_rank = buf.get_dispatch_layout(ids)
            want = x.float() * in_rank.sum(1, keepdim=True).float()
            assert torch.equal(out.float(), want), f"call {i}: combine is not exact"
            checked += out.numel()
            checksum += float(out.float().sum())
    return checked, checksum


def test_soak_2000_calls_random_delays_and_sizes():
    results = [o.unwrap() for o in run_ranks(4, _soak, 2000, timeout=400)]
    assert all(checked > 0 for checked, _ in results)
