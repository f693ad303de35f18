"""Stress of the low-latency path through the public Buffer API: STEPS dispatch + combine
calls with fresh data every step, so each of the two parities of the receive regions is
reused STEPS / 2 times, on IPC pairs (ranks sharing GPU 0) and on host-staged pairs
(``PCIE_A2A_P2P=0``), with ``Buffer(backend="cuda")`` (scripts/gpu_check.sh's stress step).

Every row describes itself: channels 0-4 hold (source, token % 25, token // 25, step % 25,
step // 25 % 25) and the others a function of all three, so a row left over from an
earlier call of the same parity, a row put in another source's slots or a row of the
wrong token is named in the failure (source, token, step it holds against what was due).
Token counts (0 to max_tokens), routing and weights change every step; every fifth step
uses the receive hooks. Counts, metadata and rows are compared exactly with
pcie_a2a.reference, and so is the combine: each rank returns its rows times (rank + 1),
and with |value| <= 25 every product and fp32 sum is exact in bf16.

The same loop runs on the CPU transport (fewer steps) and the checker is fed corrupted
results (stale step, swapped rows, wrong counts, a changed sum) so both can fail here.
"""

from __future__ import annotations

import os

import pytest
import torch

from dist_utils import run_ranks
from pcie_a2a.placement import Placement
from pcie_a2a.reference import reference_combine, reference_dispatch

E, H, M, K, TOPK = 16, 256, 32, 4, 3
STEPS = 200
WORLD = 4


def num_tokens(src: int, step: int) -> int:
    return (7 * step + 5 * src) % (M + 1)  # 0 .. M, different for every source and step


def pattern(src: int, step: int, t: int) -> torch.Tensor:
    """x [t, H] of source `src` at `step`: self-describing rows, |value| <= 25."""
    tok = torch.arange(t).unsqueeze(1)
    ch = torch.arange(H).unsqueeze(0)
    v = (src * 7 + tok * 3 + step * 5 + ch) % 51 - 25
    v[:, 0] = src
    v[:, 1] = tok[:, 0] % 25
    v[:, 2] = tok[:, 0] // 25
    v[:, 3] = step % 25
    v[:, 4] = (step // 25) % 25
    return v.to(torch.bfloat16)


def decode(rows: torch.Tensor) -> torch.Tensor:
    """[n, 3] (source, token, step mod 625) of pattern rows."""
    c = rows[:, :5].float().round().long()
    return torch.stack([c[:, 0], c[:, 1] + 25 * c[:, 2], c[:, 3] + 25 * c[:, 4]], dim=1)


def routing(src: int, step: int, t: int):
    g = torch.Generator().manual_seed(100_003 * step + src)
    ids = (
        torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(t)])
        if t
        else torch.empty(0, TOPK, dtype=torch.int64)
    )
    ids[torch.rand(ids.shape, generator=g) < 0.15] = -1
    w = torch.randint(1, 9, (t, TOPK), generator=g).float() / 8  # exact weights
    return ids, w


def step_inputs(world: int, step: int):
    xs, ids, ws = [], [], []
    for s in range(world):
        t = num_tokens(s, step)
        xs.append(pattern(s, step, t))
        i, w = routing(s, step, t)
        ids.append(i)
        ws.append(w)
    return xs, ids, ws


def expected(world: int, step: int):
    xs, ids, ws = step_inputs(world, step)
    exp = reference_dispatch(xs, ids, ws, Placement.contiguous(E, world), M, K, "bf16")
    ys = [(e.x.float() * (r + 1)).to(torch.bfloat16) for r, e in enumerate(exp)]
    outs = reference_combine(ys, exp, [x.shape[0] for x in xs], H)
    return exp, outs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def check_step(rank: int, world: int, step: int, got: dict) -> None:
    """Raises AssertionError naming the first thing that differs. `got` holds CPU tensors
    of one low-latency rows dispatch (x [world, M, H], recv_count, src_token, topk_ids,
    topk_weights, tokens_per_expert) and its combine (out [T, H])."""
    exp_all, outs = expected(world, step)
    exp = exp_all[rank]
    where = f"step {step}, rank {rank}"
    counts = [int((exp.src_rank == s).sum()) for s in range(world)]
    assert got["recv_count"].tolist() == counts, (
        f"{where}: recv_count {got['recv_count'].tolist()} != {counts}"
    )
    for s in range(world):
        n = counts[s]
        sel = (exp.src_rank == s).nonzero().flatten()
        rows = got["x"][s, :n]
        if n:
            holds = decode(rows)
            due = torch.stack(
                [torch.full((n,), s), exp.src_token[sel].long(), torch.full((n,), step % 625)], 1
            )
            bad = (holds != due).any(dim=1).nonzero().flatten()
            if bad.numel():
                i = int(bad[0])
                h, d = holds[i].tolist(), due[i].tolist()
                raise AssertionError(f"{where}: row {i} from source {s} holds (source {h[0]}, token {h[1]}, "
                                     f"step {h[2]}); due (source {d[0]}, token {d[1]}, step {d[2]})")  # fmt: skip
        assert torch.equal(_bits(rows), _bits(exp.x[sel])), f"{where}: rows from source {s} differ"
        assert torch.equal(got["src_token"][s, :n], exp.src_token[sel]), (
            f"{where}: src_token from {s}"
        )
        assert torch.equal(got["topk_ids"][s, :n], exp.topk_ids[sel]), f"{where}: topk_ids from {s}"
        assert torch.equal(got["topk_weights"][s, :n], exp.topk_weights[sel]), (
            f"{where}: weights from {s}"
        )
        assert bool((got["topk_ids"][s, n:] == -1).all()), (
            f"{where}: unused rows of {s} not marked -1"
        )
    assert got["tokens_per_expert"].tolist() == exp.tokens_per_expert, f"{where}: tokens_per_expert"
    assert torch.equal(_bits(got["out"]), _bits(outs[rank])), f"{where}: combined output differs"


def _stress_rank(rank: int, world: int, backend: str, staged: bool, steps: int) -> int:
    import torch.distributed as dist

    import pcie_a2a

    if staged:
        os.environ["PCIE_A2A_P2P"] = "0"  # every pair through pinned host memory
    dev = torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    buf = pcie_a2a.Buffer(None, E, H, M, num_topk=K, backend=backend, timeout_s=20.0)
    try:
        for step in range(steps):
            t = num_tokens(rank, step)
            ids, w = routing(rank, step, t)
            x, ids, w = pattern(rank, step, t).to(dev), ids.to(dev), w.to(dev)
            hook = step % 5 == 4
            res = buf.low_latency_dispatch(x, ids, w, return_recv_hook=hook)
            if hook:
                res = res()
            y = (res.x.float() * (rank + 1)).to(torch.bfloat16)
            out = buf.low_latency_combine(y, res.handle, return_recv_hook=hook)
            if hook:
                out = out()
            got = {"x": res.x, "recv_count": res.recv_count, "src_token": res.src_token,
                   "topk_ids": res.topk_ids, "topk_weights": res.topk_weights,
                   "tokens_per_expert": res.tokens_per_expert, "out": out}  # fmt: skip
            check_step(rank, world, step, {k: v.cpu() for k, v in got.items()})
        if backend == "cuda":
            torch.cuda.synchronize()
        dist.barrier()  # every rank's last call is done before anyone frees its segment
    finally:
        buf.close()
    return steps


def _cuda_reason() -> str:
    from pcie_a2a import cuda_available, cuda_unavailable_reason

    if not cuda_available():
        return cuda_unavailable_reason()
    try:
        from pcie_a2a import _cuda_transport  # noqa: F401
    except ImportError as exc:
        return f"pcie_a2a._cuda_transport is not in this build: {exc}"
    return ""


_REASON = _cuda_reason()


@pytest.mark.gpu
@pytest.mark.skipif(bool(_REASON), reason=_REASON or "n/a")
@pytest.mark.parametrize("pairs", ["ipc", "staged"])
def test_cuda_low_latency_stress(pairs):
    outcomes = run_ranks(WORLD, _stress_rank, "cuda", pairs == "staged", STEPS, timeout=120)
    assert [o.unwrap() for o in outcomes] == [STEPS] * WORLD


def test_cpu_transport_runs_the_same_stress():
    """The loop and its checks on the CPU transport: 24 calls, both parities reused."""
    outcomes = run_ranks(2, _stress_rank, "cpu", False, 24, timeout=120)
    assert [o.unwrap() for o in outcomes] == [24, 24]


# ---- the checker catches what the stress is for -------------------------------------------
def perfect(rank: int, world: int, step: int) -> dict:
    """What a correct transport returns to `rank` (rows layout), built from the reference."""
    exp_all, outs = expected(world, step)
    exp = exp_all[rank]
    g = torch.Generator().manual_seed(7)
    got = {
        "x": torch.randn(world, M, H, generator=g).to(torch.bfloat16),  # unused rows: junk
        "src_token": torch.full((world, M), -1, dtype=torch.int32),
        "topk_ids": torch.full((world, M, K), -1, dtype=torch.int32),
        "topk_weights": torch.zeros(world, M, K),
        "tokens_per_expert": torch.tensor(exp.tokens_per_expert, dtype=torch.int32),
        "out": outs[rank].clone(),
    }
    counts = []
    for s in range(world):
        sel = (exp.src_rank == s).nonzero().flatten()
        n = sel.numel()
        counts.append(n)
        got["x"][s, :n] = exp.x[sel]
        got["src_token"][s, :n] = exp.src_token[sel]
        got["topk_ids"][s, :n] = exp.topk_ids[sel]
        got["topk_weights"][s, :n] = exp.topk_weights[sel]
    got["recv_count"] = torch.tensor(counts, dtype=torch.int32)
    return got


def _busy_source(rank: int, world: int, step: int) -> int:
    counts = perfect(rank, world, step)["recv_count"].tolist()
    return max(range(world), key=lambda s: counts[s])


def _stale(got, rank, world, step):  # a row of the call two steps back (same parity)
    s = _busy_source(rank, world, step)
    tok = int(got["src_token"][s, 0])
    got["x"][s, 0] = pattern(s, step - 2, max(tok + 1, num_tokens(s, step - 2)))[tok]


def _swapped(got, rank, world, step):
    s = _busy_source(rank, world, step)
    got["x"][s, [0, 1]] = got["x"][s, [1, 0]]


def _other_source(got, rank, world, step):
    s = _busy_source(rank, world, step)
    tok = int(got["src_token"][s, 0])
    got["x"][s, 0] = pattern((s + 1) % world, step, M)[tok]


def _count(got, rank, world, step):
    got["recv_count"][_busy_source(rank, world, step)] -= 1


def _sum(got, rank, world, step):
    got["out"][0, 7] += 1


def _unmarked(got, rank, world, step):
    s = _busy_source(rank, world, step)
    got["topk_ids"][s, int(got["recv_count"][s])] = 0


MUTATIONS = {
    "stale_step": (_stale, r"holds \(source"),
    "swapped_rows": (_swapped, r"holds \(source"),
    "other_source": (_other_source, r"holds \(source"),
    "recv_count": (_count, "recv_count"),
    "combine_sum": (_sum, "combined output differs"),
    "unused_row": (_unmarked, "not marked -1"),
}


def test_checker_accepts_a_correct_result():
    for step in (0, 2, 9):
        check_step(1, WORLD, step, perfect(1, WORLD, step))


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_checker_catches(name):
    step, rank = 9, 1
    fn, needle = MUTATIONS[name]
    got = perfect(rank, WORLD, step)
    fn(got, rank, WORLD, step)
    with pytest.raises(AssertionError, match=needle):
        check_step(rank, WORLD, step, got)


def test_patterns_change_every_step_and_source():
    a = pattern(1, 9, M)
    assert not torch.equal(a, pattern(1, 7, M)) and not torch.equal(a, pattern(2, 9, M))
    assert decode(a)[5].tolist() == [1, 5, 9]
    assert decode(pattern(3, 624, M))[31].tolist() == [3, 31, 624]
    assert {num_tokens(0, s) for s in range(STEPS)} == set(range(M + 1))  # 0 .. M all occur
