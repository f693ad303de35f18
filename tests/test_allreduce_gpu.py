"""GPU tests of ``pcie_a2a.AllReduce(backend="cuda")`` (csrc/cuda/allreduce,
pcie_a2a.allreduce.cuda): eager calls and CUDA graph replay, every result compared bit for
bit with the fp32 rank-order reference (pcie_a2a.allreduce.reference) and across ranks.

NOT YET RUN ON A GPU (written before the first GPU window; scripts/gpu_check.sh runs it as
its ``allreduce`` step). Skips with the reason on a machine without a GPU or without the
``_allreduce_cuda`` module.

One GPU, several ranks: ``AllReduce`` needs a torch.distributed group with one process per
rank, so its ranks cannot live in one process (the in-process form, W ``CudaAllReduce`` on
one GPU opened by pointer, is what benchmarks/bench_allreduce_one_gpu.py times). Here each
rank is its own process on GPU 0 when there are fewer GPUs than ranks: CUDA IPC between
processes on one device takes the same open/store/flag path as P2P between devices, and the
processes time-slice the GPU (correctness, not speed). With ranks sharing a GPU, the
topology planner has no PCIe pair to decide on, so the test gives every pair push/P2P (what
the planner gives P2P pairs) and asserts that every call ran the kernels, none the
fallback.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

try:
    from dist_utils import run_ok
except ImportError:  # pragma: no cover - run from another directory
    from tests.dist_utils import run_ok


def _skip_reason() -> str:
    try:
        from pcie_a2a.allreduce import cuda
    except ImportError as exc:
        return f"pcie_a2a.allreduce.cuda does not import: {exc}"
    return cuda.unavailable_reason()


_REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_REASON), reason=_REASON or "n/a")]

SIZES = (8, 2056, 7168, 16 * 1024)  # one vector, ragged two-shot shards, 14 KB, 32 KB
REPLAYS = 12
GRAPH_CASES = {  # (algorithm, elements): ragged two-shot shards at 2056 and 7168
    2: (("one_shot", 7168), ("two_shot", 16 * 1024)),
    4: (("one_shot", 2056), ("two_shot", 7168)),
}


def _inputs(world: int, numel: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(numel, generator=g) * (r + 1)).to(dtype) for r in range(world)]
    return xs, torch.randn(numel, generator=g).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int16)


def _setup(rank: int, world: int) -> int:
    """This rank's device; ranks that share one get every pair P2P/push (see above)."""
    import pcie_a2a.allreduce.cuda as arc
    from pcie_a2a.allreduce import decisions as dec

    n = torch.cuda.device_count()
    device = rank % n
    torch.cuda.set_device(device)
    if n < world:
        arc.topology_decisions = lambda bus_ids, w: dec.all_push(w, "ranks share one GPU")
    return device


def _same_everywhere(t: torch.Tensor) -> bool:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, _bits(t).numpy().tobytes())
    return len(set(out)) == 1


def _eager(rank: int, world: int) -> int:
    import pcie_a2a
    from pcie_a2a.allreduce import reference as R

    device = _setup(rank, world)
    checks = 0
    for algo, dtype in itertools.product(("one_shot", "two_shot"), (torch.bfloat16, torch.float16)):
        with pcie_a2a.AllReduce(None, 1 << 16, dtype, backend="cuda", device=device,
                                algorithm=algo, timeout_s=30.0) as ar:  # fmt: skip
            stats = ar.stats()
            assert stats["active"], stats["why_inactive"]
            for size in SIZES:
                xs, res = _inputs(world, size, dtype, seed=size * 7 + checks)
                want = R.sum_in_rank_order(xs)
                x = xs[rank].to(device)
                r = res.to(device)
                got = ar.all_reduce(x)
                assert torch.equal(_bits(got), _bits(want)), (algo, dtype, size, "plain")
                assert torch.equal(_bits(x), _bits(xs[rank])), "the input changed"
                got = ar.all_reduce(x, residual=r)
                assert torch.equal(_bits(got), _bits(R.add_residual(want, res))), (algo, size)
                ar.all_reduce(x, out=x)  # in place
                assert torch.equal(_bits(x), _bits(want)), (algo, dtype, size, "in place")
                checks += 3
            hidden = 1024
            xs, res = _inputs(world, 4 * hidden, dtype, seed=99)
            weight = torch.randn(hidden, generator=torch.Generator().manual_seed(5)).to(dtype)
            normed, resid = ar.all_reduce_rmsnorm(
                xs[rank].view(4, hidden).to(device), weight.to(device), 1e-6,
                res.view(4, hidden).to(device),
            )  # fmt: skip
            want_n, want_r = R.add_rmsnorm(
                R.sum_in_rank_order(xs).view(4, hidden), res.view(4, hidden), weight, 1e-6
            )
            assert torch.equal(_bits(resid), _bits(want_r)) and torch.equal(
                _bits(normed), _bits(want_n)
            ), (algo, dtype, "rmsnorm")
            checks += 1
            assert _same_everywhere(got)
            ar.check()
            calls = ar.stats()["calls"]
            assert calls == {**dict.fromkeys(calls, 0), algo: 3 * len(SIZES) + 1}, calls
    return checks


@pytest.mark.parametrize("world", [2, 4])
def test_eager_calls_are_bit_exact(world):
    """One-shot and two-shot, bf16 and fp16: plain, with a residual, in place, and the
    fused add + RMSNorm."""
    counts = run_ok(world, _eager, timeout=180)
    assert all(c == counts[0] and c > 0 for c in counts), counts


def _graph(rank: int, world: int) -> int:
    device = _setup(rank, world)
    return sum(_replays(rank, world, device, algo, numel) for algo, numel in GRAPH_CASES[world])


def _replays(rank: int, world: int, device: int, algo: str, numel: int) -> int:
    """One call captured in a CUDA graph, replayed with new inputs copied into its static
    input each time: the kernel arguments are frozen, the call number and buffer parity
    move on the device, so every replay must give that replay's exact sum."""
    import pcie_a2a
    from pcie_a2a.allreduce import reference as R

    dtype = torch.bfloat16
    with pcie_a2a.AllReduce(None, 1 << 16, dtype, backend="cuda", device=device,
                            algorithm=algo, timeout_s=30.0) as ar:  # fmt: skip
        assert ar.stats()["active"], ar.stats()["why_inactive"]
        x = torch.empty(numel, dtype=dtype, device=device)
        res = torch.empty(numel, dtype=dtype, device=device)
        out = torch.empty(numel, dtype=dtype, device=device)
        xs, r0 = _inputs(world, numel, dtype, seed=1)
        x.copy_(xs[rank])
        res.copy_(r0)
        ar.all_reduce(x, out=out, residual=res)  # eager first: the op's first-use work
        assert torch.equal(_bits(out), _bits(R.add_residual(R.sum_in_rank_order(xs), r0)))
        dist.barrier()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            ar.all_reduce(x, out=out, residual=res)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for i in range(REPLAYS):
            xs, ri = _inputs(world, numel, dtype, seed=100 + i)
            x.copy_(xs[rank])
            res.copy_(ri)
            out.fill_(float("nan"))  # every element must be written by this replay
            graph.replay()
            torch.cuda.synchronize()
            want = R.add_residual(R.sum_in_rank_order(xs), ri)
            assert torch.equal(_bits(out), _bits(want)), (algo, numel, "replay", i)
        ar.check()
        assert _same_everywhere(out)
        calls = ar.stats()["calls"]
        assert calls["fallback"] == 0 and calls[algo] == 2, calls  # eager + capture
        del graph
    return REPLAYS


@pytest.mark.parametrize("world", [2, 4])
def test_graph_replay_with_new_inputs(world):
    got = run_ok(world, _graph, timeout=180)
    assert got == [REPLAYS * len(GRAPH_CASES[world])] * world, got
