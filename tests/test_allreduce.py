"""pcie_a2a.AllReduce on CPU ranks (the shared-memory implementation, the oracle of the
kernels): every case is compared bit for bit with the fp32 rank-order reference and across
ranks; the hand-over to gloo above the crossover; the fused residual add and RMSNorm."""

from __future__ import annotations

import hashlib
import itertools

import pytest
import torch
import torch.distributed as dist

import pcie_a2a
from dist_utils import run_ok
from pcie_a2a.allreduce import reference as R

DTYPES = (torch.bfloat16, torch.float16)


def _inputs(world: int, numel: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(numel, generator=g) * (r + 1)).to(dtype) for r in range(world)]
    return xs, torch.randn(numel, generator=g).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _same_everywhere(t: torch.Tensor) -> bool:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, _digest(t))
    return len(set(out)) == 1


def _directions(world: int, kind: str):
    if kind == "push":
        return None
    return [
        [("pull" if s != d and (s + d) % 2 else "push") for d in range(world)] for s in range(world)
    ]


SIZES = (8, 64, 2048, 2056, 8 * 777, 4096 * 8)  # one vector .. several blocks, ragged shards


def _cases(rank: int, world: int) -> int:
    """Every algorithm x direction x barrier x dtype x size x (plain, residual, in place,
    out aliasing the residual); returns how many checks ran."""
    n = 0
    for algo, direction, barrier in itertools.product(
        ("one_shot", "two_shot"), ("push", "alternate"), (False, True)
    ):
        with pcie_a2a.AllReduce(
            None, 1 << 16, torch.bfloat16, algorithm=algo, end_barrier=barrier,
            pair_direction=_directions(world, direction),
        ) as ar:  # fmt: skip
            fp16 = pcie_a2a.AllReduce(None, 1 << 16, torch.float16, algorithm=algo)
            for dtype, size in itertools.product(DTYPES, SIZES):
                comm = ar if dtype == torch.bfloat16 else fp16
                xs, res = _inputs(world, size, dtype, seed=size + 17 * n)
                want = R.sum_in_rank_order(xs)
                x = xs[rank].clone()
                got = comm.all_reduce(x)
                assert torch.equal(_bits(got), _bits(want)), (algo, direction, barrier, dtype, size)
                assert torch.equal(x, xs[rank]), "the input changed"
                got = comm.all_reduce(x, residual=res)
                assert torch.equal(_bits(got), _bits(R.add_residual(want, res)))
                comm.all_reduce(x, out=x)  # in place
                assert torch.equal(_bits(x), _bits(want))
                r = res.clone()
                comm.all_reduce(xs[rank], out=r, residual=r)  # out aliases the residual
                assert torch.equal(_bits(r), _bits(R.add_residual(want, res)))
                n += 4
            assert _same_everywhere(got)
            stats = comm.stats()
            assert stats["calls"][algo] == 4 * len(SIZES) and stats["calls"]["fallback"] == 0
            fp16.close()
    return n


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_case_is_bit_exact_and_identical_on_every_rank(world):
    counts = run_ok(world, _cases, timeout=300)
    assert all(c == counts[0] and c > 0 for c in counts)


def _eight(rank: int, world: int) -> None:
    with pcie_a2a.AllReduce(None, 1 << 15, torch.bfloat16) as ar:
        for size, residual in ((8, False), (7168, True), (16 * 1024, True)):  # 16 KB, 14 KB, 32 KB
            xs, res = _inputs(world, size, torch.bfloat16, seed=size)
            got = ar.all_reduce(xs[rank], residual=res if residual else None)
            want = R.add_residual(R.sum_in_rank_order(xs), res if residual else None)
            assert torch.equal(_bits(got), _bits(want)), size
        st = ar.stats()
        # the CPU defaults for 8 ranks: one-shot to 32 KB, two-shot above
        assert st["calls"] == {"one_shot": 3, "two_shot": 0, "fallback": 0}, st
        assert st["thresholds"]["source"].startswith("defaults for cpu, world 8")


def test_eight_ranks():
    run_ok(8, _eight, timeout=300)


def _handover(rank: int, world: int) -> dict:
    """Ours up to handover_bytes, gloo above (and for sizes that are not whole vectors)."""
    with pcie_a2a.AllReduce(None, 1 << 16, torch.bfloat16, handover_bytes=4096,
                            one_shot_max_bytes=1024) as ar:  # fmt: skip
        routes = {}
        for size in (8, 512, 2048, 2056, 4000, 3):
            xs, res = _inputs(world, size, torch.bfloat16, seed=size)
            routes[size] = ar.route(size)
            assert ar.should_use(xs[rank]) == (routes[size] != "fallback")
            got = ar.all_reduce(xs[rank], residual=res)
            want = R.add_residual(R.sum_in_rank_order(xs), res)
            if routes[size] == "fallback":  # gloo's order: close, and the same on every rank
                torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            else:
                assert torch.equal(_bits(got), _bits(want)), size
            assert _same_everywhere(got)
        empty = ar.all_reduce(torch.empty(0, dtype=torch.bfloat16))
        assert empty.shape == (0,)
        routes["stats"] = ar.stats()["calls"]
        return routes


def test_handover_above_the_crossover_goes_to_gloo():
    routes = run_ok(2, _handover)[0]
    assert [routes[s] for s in (8, 512, 2048, 2056, 4000, 3)] == [
        "one_shot", "one_shot", "two_shot", "fallback", "fallback", "fallback",
    ]  # fmt: skip
    assert routes["stats"] == {"one_shot": 2, "two_shot": 1, "fallback": 4}


def _norm(rank: int, world: int) -> None:
    eps = 1e-6
    for dtype, algo in itertools.product(DTYPES, ("one_shot", "two_shot", "fallback")):
        with pcie_a2a.AllReduce(None, 1 << 16, dtype, algorithm=algo) as ar:
            for rows, hidden, residual in ((1, 7168, True), (3, 2304, True), (2, 64, False)):
                xs, res = _inputs(world, rows * hidden, dtype, seed=rows * hidden)
                xs = [x.reshape(rows, hidden) for x in xs]
                res = res.reshape(rows, hidden) if residual else None
                w = (torch.rand(hidden, generator=torch.Generator().manual_seed(hidden)) + 0.5).to(
                    dtype
                )
                normed, res_out = ar.all_reduce_rmsnorm(xs[rank], w, eps, residual=res)
                r = R.sum_in_rank_order(xs) if algo != "fallback" else None
                if r is not None:  # ours: exactly the fixed-order reference
                    want_n, want_r = R.add_rmsnorm(r, res, w, eps)
                    assert torch.equal(_bits(normed), _bits(want_n)), (dtype, algo, rows, hidden)
                    assert torch.equal(_bits(res_out), _bits(want_r))
                # and an RMSNorm by any order: within the dtype's rounding
                z = sum(x.float() for x in xs) + (0 if res is None else res.float())
                plain = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * w.float()
                torch.testing.assert_close(normed.float(), plain, rtol=3e-2, atol=3e-2)
                assert _same_everywhere(normed)


def test_fused_add_rmsnorm():
    run_ok(3, _norm, timeout=300)
