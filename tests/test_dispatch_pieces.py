"""Normal mode in pieces (pcie_a2a.pieces): a Buffer whose region holds C tokens per source
moves a dispatch of up to max_dispatch_tokens through it as C-token calls, and returns
exactly what one call through a region big enough for the whole dispatch returns (the
oracle: a second Buffer with max_tokens_per_rank = the whole dispatch). CPU transport; the
CUDA transport takes the same calls (pieces are ordinary normal-mode calls)."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks

E, H, K, C, T_MAX = 12, 128, 4, 5, 17
TOKENS = (17, 3, 0)  # per rank: several pieces, one piece, nothing


def _inputs(rank: int, n: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = (torch.randn(n, H, generator=g) * 3).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else (
        torch.empty(0, K, dtype=torch.int64))  # fmt: skip
    if n:
        ids[::4, -1] = -1
    return x, ids, torch.rand(n, K, generator=g)


def _expert(res) -> torch.Tensor:
    w = (res.topk_weights * (res.topk_ids >= 0)).sum(dim=1, keepdim=True)
    return (res.x.float() * w).to(torch.bfloat16)


def _fields(res):
    return [res.x.view(torch.int16), res.src_rank, res.src_token, res.topk_ids,
            res.topk_weights, res.recv_count, res.tokens_per_expert]  # fmt: skip


def _rank(rank: int, world: int) -> dict:
    import pcie_a2a

    out = {}
    with (pcie_a2a.Buffer(None, E, H, C, num_topk=K, backend="cpu",
                          max_dispatch_tokens=T_MAX) as pieces,
          pcie_a2a.Buffer(None, E, H, T_MAX, num_topk=K, backend="cpu") as whole):  # fmt: skip
        for step in range(2):
            x, ids, w = _inputs(rank, TOKENS[(rank + step) % world], step)
            a, b = pieces.dispatch(x, ids, w), whole.dispatch(x, ids, w)
            for i, (u, v) in enumerate(zip(_fields(a), _fields(b))):
                assert torch.equal(u, v), (step, i)
            ya, yb = pieces.combine(_expert(a), a.handle), whole.combine(_expert(b), b.handle)
            assert torch.equal(ya.view(torch.int16), yb.view(torch.int16)), step
        out["memory"] = pieces.memory_bytes()["segment"]
        out["calls"] = pieces.stats()["calls"]
        # more than max_dispatch_tokens: a clear error here, PeerAbortedError at the peers
        x, ids, w = _inputs(rank, T_MAX + 1 if rank == 0 else 2, 9)
        try:
            pieces.dispatch(x, ids, w)
            out["bad"] = "no error"
        except Exception as exc:
            out["bad"] = f"{type(exc).__name__}: {exc}"
        x, ids, w = _inputs(rank, 7, 3)  # still usable
        a, b = pieces.dispatch(x, ids, w), whole.dispatch(x, ids, w)
        assert torch.equal(a.x.view(torch.int16), b.x.view(torch.int16))
        assert torch.equal(
            pieces.combine(_expert(a), a.handle), whole.combine(_expert(b), b.handle)
        )
    with pcie_a2a.Buffer(None, E, H, C, num_topk=K, backend="cpu") as small:
        out["small_memory"] = small.memory_bytes()["segment"]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_pieces_equal_one_call_and_keep_the_region(world):
    got = [o.unwrap() for o in run_ranks(world, _rank, timeout=180)]
    for r, g in enumerate(got):
        assert g["memory"] == g["small_memory"], g  # the region of C tokens, not T_MAX
        # step 0: ceil(17 / 5) = 4 pieces (dispatch + combine each); step 1 as many
        assert g["calls"] == 2 * 4 * 2, g
        if r == 0:
            assert (
                "x.shape[0] (num_tokens): got 18; allowed: at most max_dispatch_tokens=17"
                in g["bad"]
            )
        else:
            assert g["bad"].startswith("PeerAbortedError"), g["bad"]


def test_max_dispatch_tokens_is_checked(single_rank_group):
    import pcie_a2a

    with pytest.raises(ValueError, match=r"max_dispatch_tokens: got 3; allowed: None or an int >= "
                                         r"max_tokens_per_rank \(4\)"):  # fmt: skip
        pcie_a2a.Buffer(None, 8, 128, 4, backend="cpu", max_dispatch_tokens=3)
