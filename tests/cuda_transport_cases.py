"""Inputs and exact expectations of the CUDA transport's tests, shared by the GPU tests
(tests/test_cuda_transport.py) and the CPU emulation of the same kernels and host code
(tests/test_cuda_transport_emulation.py).

Every rank rebuilds every rank's inputs from (case, rank, step), so each can compute the
whole single-process reference (pcie_a2a.reference) locally. The checks take CPU tensors
and compare bit for bit: the kernels move bytes and sum partials in fp32 in the CPU's
order with the CPU's rounding (ascending rank, no FMA contraction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pcie_a2a.placement import Placement
from pcie_a2a.reference import quantize_fp8, reference_combine, reference_dispatch

DTYPES = {"bf16": (torch.bfloat16, 0), "fp16": (torch.float16, 1)}
PAYLOADS = {"bf16": 0, "fp16": 1, "fp8": 2}
CE_MIN_ROWS = 8  # copy_engine="mixed": pairs of at least this many rows use the copy engine


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    mode: str  # normal | ll_rows | ll_em (the GPU table; the emulation lists its steps)
    dtype: str = "bf16"
    payload: str = "bf16"
    hidden: int = 256
    experts: int = 8
    topk: int = 3
    num_topk: int = 4
    max_tokens: int = 24
    raw_fp8: bool = False
    transport: str = "auto"  # auto | staged | mixed
    direction: str = "push"  # push | pull (every P2P pair) | mixed (P2P pairs alternate)
    placement: str = "contiguous"  # contiguous | redundant | table | random | sparse
    copy_engine: str = "off"  # off | all | mixed (normal mode)
    spread: bool = False  # rank r on GPU r % device_count (multi-GPU cases)
    seed: int = 0
    order: str = "default"  # default (rank + 1, ...) | reversed


def placement(case: Case) -> Placement:
    if case.placement == "redundant":
        base = Placement.contiguous(case.experts, case.world)
        return Placement.with_redundant(base, {0: [case.world - 1], 1: [1 % case.world]})
    if case.placement == "table":  # redundant copies and a per-(source, expert) choice table
        from routing_cases import with_choice_table

        base = Placement.random_permutation(case.experts, case.world, seed=case.seed)
        hot = {0: list(range(case.world)), 1: [0, case.world - 1], 2: [1 % case.world]}
        return with_choice_table(Placement.with_redundant(base, hot))
    if case.placement == "random":
        return Placement.random_permutation(case.experts, case.world, seed=case.seed)
    if case.placement == "sparse":  # the last rank holds no expert (world >= 2)
        n = case.world - 1
        return Placement([[(e % n, e // n)] for e in range(case.experts)], case.world)
    return Placement.contiguous(case.experts, case.world)


def tokens(case: Case, rank: int) -> int:
    if case.world > 2:
        return [case.max_tokens, 0, 7, case.max_tokens - 1][rank % 4]
    return [case.max_tokens, 5][rank]


def inputs(case: Case, rank: int, step: int = 0):
    """x [T, H], topk_ids int32 [T, topk] (some -1, token 3 routed nowhere), weights."""
    dtype = DTYPES[case.dtype][0]
    g = torch.Generator().manual_seed(10_000 * case.seed + 100 * step + rank)
    t = tokens(case, rank)
    x = (torch.randn(t, case.hidden, generator=g) * 3).to(dtype)
    ids = torch.empty(t, case.topk, dtype=torch.int32)
    for i in range(t):
        ids[i] = torch.randperm(case.experts, generator=g)[: case.topk]
    ids[::5, -1] = -1  # some tokens use fewer experts
    if t > 3:
        ids[3, :] = -1  # a token sent nowhere
    w = torch.rand(t, case.topk, generator=g)
    return x, ids, w


def all_inputs(case: Case, step: int = 0):
    return [inputs(case, r, step) for r in range(case.world)]


def expected(case: Case, step: int = 0):
    xs, ids, ws = zip(*all_inputs(case, step))
    return reference_dispatch(
        list(xs),
        list(ids),
        list(ws),
        placement(case),
        case.max_tokens,
        case.num_topk,
        case.payload,
    )


def rows_fn(x: torch.Tensor, rank: int) -> torch.Tensor:
    """The stand-in expert of the rows layouts: exact elementwise, same on CPU and GPU."""
    return (x.float() * (rank + 1) / 4).to(x.dtype)


def em_fn(x: torch.Tensor, e: int) -> torch.Tensor:
    return (x.float() * (1 + e / 8)).to(x.dtype)


def pre_reduced(exp, dtype) -> torch.Tensor:
    """CPU model of the fused expert-major pre-reduction: fp32, k order, mul then add."""
    out = torch.zeros(exp.x.shape[0], exp.x.shape[1], dtype=dtype)
    for i in range(exp.x.shape[0]):
        acc = torch.zeros(exp.x.shape[1], dtype=torch.float32)
        for k in range(exp.topk_ids.shape[1]):
            e = int(exp.topk_ids[i, k])
            if e >= 0:
                acc = acc + float(exp.topk_weights[i, k]) * em_fn(exp.x[i], e).float()
        out[i] = acc.to(dtype)
    return out


def pair_plan(case: Case):
    """[sender][receiver] of "p2p"/"staged" (None: the transport's default)."""
    if case.transport == "mixed":
        return [
            ["staged" if (s + d) % 2 else "p2p" for d in range(case.world)]
            for s in range(case.world)
        ]
    if case.transport == "staged":
        return [
            ["p2p" if s == d else "staged" for d in range(case.world)] for s in range(case.world)
        ]
    return None


def pair_direction(case: Case) -> list[list[str]]:
    """[sender][receiver] of "push"/"pull": the diagonal and host-staged pairs push."""
    plan = pair_plan(case) or [["p2p"] * case.world for _ in range(case.world)]
    w = case.world

    def pulls(s: int, d: int) -> bool:
        if s == d or plan[s][d] != "p2p" or case.direction == "push":
            return False
        return case.direction == "pull" or (s + 2 * d) % 3 != 0

    return [["pull" if pulls(s, d) else "push" for d in range(w)] for s in range(w)]


def send_order(case: Case) -> list[list[int]]:
    w = case.world
    if case.order == "reversed":
        return [[(s - i) % w for i in range(w)] for s in range(w)]
    return [[(s + i) % w for i in range(1, w + 1)] for s in range(w)]


def ce_min_bytes(case: Case, slot_bytes: int) -> int | None:
    return {"off": None, "all": 0, "mixed": CE_MIN_ROWS * slot_bytes}[case.copy_engine]


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def combined(case: Case, step: int, ys) -> list[torch.Tensor]:
    """What combine returns to every rank, given each rank's returned rows in wire order."""
    exp_all = expected(case, step)
    return reference_combine(ys, exp_all, [tokens(case, r) for r in range(case.world)], case.hidden)


def raw_fp8_rows(case: Case, exp, step: int = 0):
    """The wire bytes of the rows `exp` lists: torch's quantisation of their source rows."""
    xs, _, _ = zip(*all_inputs(case, step))
    src = [quantize_fp8(x) if x.shape[0] else None for x in xs]
    pairs = list(zip(exp.src_rank.tolist(), exp.src_token.tolist()))
    if not pairs:
        return None, None
    return (
        torch.stack([src[s][0][t] for s, t in pairs]),
        torch.stack([src[s][1][t] for s, t in pairs]),
    )


def assert_rows(case: Case, exp, got_x=None, got_fp8=None, got_scales=None, step: int = 0):
    """Received rows, in the reference's order: 16-bit rows, or raw fp8 bytes and scales."""
    if got_fp8 is not None:
        want_q, want_s = raw_fp8_rows(case, exp, step)
        if want_q is not None:
            assert torch.equal(bits(got_fp8), want_q.view(torch.uint8)), "raw fp8 rows differ"
            assert torch.equal(got_scales.cpu(), want_s), "fp8 scales differ"
        return
    assert torch.equal(bits(got_x), bits(exp.x)), "received rows differ from the reference"


def check_ll_rows(case: Case, rank: int, step: int, b: dict, num_tokens: int) -> None:
    """The low-latency rows layout ([world * max_tokens] rows, unused ones marked) and its
    combine; `b` holds CPU tensors: counts, xo (or fp8 and scales), src_rank, src_token,
    ids_o, ws_o, per_expert, out."""
    m = case.max_tokens
    exp_all = expected(case, step)
    exp = exp_all[rank]
    counts = b["counts"].tolist()
    src = exp.src_rank
    assert counts == [int((src == s).sum()) for s in range(case.world)], "counts differ"
    for s in range(case.world):
        sel = (src == s).nonzero().flatten()
        n = counts[s]
        if "fp8" in b:
            q, sc = raw_fp8_rows(case, exp, step)
            if n:
                assert torch.equal(bits(b["fp8"][s * m : s * m + n]), q[sel].view(torch.uint8))
                assert torch.equal(b["scales"][s * m : s * m + n], sc[sel])
        else:
            assert torch.equal(bits(b["xo"][s * m : s * m + n]), bits(exp.x[sel])), "rows differ"
        assert torch.equal(b["src_token"][s * m : s * m + n].cpu(), exp.src_token[sel])
        assert torch.equal(b["ids_o"][s * m : s * m + n].cpu(), exp.topk_ids[sel])
        assert torch.equal(b["ws_o"][s * m : s * m + n].cpu(), exp.topk_weights[sel])
        assert bool((b["src_rank"][s * m : s * m + n] == s).all()), "src_rank differs"
        assert bool((b["ids_o"][s * m + n : (s + 1) * m] == -1).all()), "unused rows not marked"
        assert bool((b["ws_o"][s * m + n : (s + 1) * m] == 0).all()), "unused weights not 0"
        assert bool((b["src_rank"][s * m + n : (s + 1) * m] == -1).all()), "unused src not -1"
        assert bool((b["src_token"][s * m + n : (s + 1) * m] == -1).all()), "unused tok not -1"
    assert b["per_expert"].tolist() == exp.tokens_per_expert
    if "out" not in b:  # dispatch only
        return
    ys = [rows_fn(e.x, r) for r, e in enumerate(exp_all)]
    want = combined(case, step, ys)[rank]
    assert torch.equal(bits(b["out"][:num_tokens]), bits(want)), "combined output differs"


def expert_lists(exp, e_local: int) -> list[list[int]]:
    """Rows (indices into the reference rows) of each local expert, in wire order."""
    lists: list[list[int]] = [[] for _ in range(e_local)]
    for i in range(exp.x.shape[0]):
        for kk in range(exp.topk_ids.shape[1]):
            e = int(exp.topk_ids[i, kk])
            if e >= 0:
                lists[e].append(i)
    return lists


def check_expert_major(case: Case, rank: int, step: int, b: dict) -> None:
    """The expert-major receive: per_expert, x [E, cap, H] (or raw fp8), src_info,
    layout_range; `b` holds CPU tensors."""
    exp = expected(case, step)[rank]
    e_local = placement(case).num_local_experts(rank)
    lists = expert_lists(exp, e_local)
    assert b["per_expert"].tolist() == [len(v) for v in lists], "tokens per expert differ"
    q = raw_fp8_rows(case, exp, step) if "fp8" in b else None
    for e, rows in enumerate(lists):
        if rows:
            if q is not None:
                assert torch.equal(bits(b["fp8"][e, : len(rows)]), q[0][rows].view(torch.uint8))
                assert torch.equal(b["scales"][e, : len(rows)].cpu(), q[1][rows])
            else:
                assert torch.equal(bits(b["xo"][e, : len(rows)]), bits(exp.x[rows]))
            assert torch.equal(b["src_info"][e, : len(rows)].cpu(), exp.src_token[rows])
        assert bool((b["src_info"][e, len(rows) :] == -1).all())
        begin = 0
        for s in range(case.world):
            n = sum(1 for i in rows if int(exp.src_rank[i]) == s)
            assert int(b["layout_range"][e, s]) == (begin << 32) | n, "layout_range differs"
            begin += n


def em_partials(case: Case, step: int) -> list[torch.Tensor]:
    """Each rank's returned rows of the expert-major combine (the fused pre-reduction)."""
    dtype = DTYPES[case.dtype][0]
    return [pre_reduced(ex, dtype) for ex in expected(case, step)]
