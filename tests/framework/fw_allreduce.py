"""The all-reduce checks the SGLang and vLLM hook tests share, run inside each rank: calls
through the framework's own ``all_reduce`` entry point, each compared with the fixed
rank-order reference (exact for ours, to gloo's rounding for the hand-over) and counted by
route in the communicator's stats."""

from __future__ import annotations

import hashlib

# (elements, dtype name, expected route): one-shot (2 KB), two-shot (192 KB, above the CPU
# one-shot limit of a 2-rank group), and two calls ``should_custom_ar`` declines, so the
# framework's own path (NCCL, gloo here) runs them: 1.25 MiB (above the 1 MiB segment) and
# fp32 (not ours whatever the size).
CASES = (
    (1024, "bfloat16", "one_shot"),
    (96 * 1024, "float16", "two_shot"),
    (640 * 1024, "bfloat16", "framework"),
    (1024, "float32", "framework"),
)


def inputs(rank: int, world: int, n: int, dtype, seed: int):
    """Every rank's input (each rank rebuilds all of them for the reference)."""
    import torch

    xs = []
    for r in range(world):
        g = torch.Generator().manual_seed(1000 * seed + r)
        xs.append((torch.randn(n, generator=g) * (r + 1)).to(dtype))
    return xs


def digest(t) -> str:
    import torch

    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def run_cases(all_reduce, ca, rank: int, world: int) -> list[dict]:
    """``all_reduce(x)`` is the framework's entry point; ``ca`` our CustomAllreduce there."""
    import torch

    from pcie_a2a.allreduce import reference

    out = []
    for seed, (n, dtype_name, want_route) in enumerate(CASES):
        dtype = getattr(torch, dtype_name)
        xs = inputs(rank, world, n, dtype, seed)
        before = dict(ca.comm.stats()["calls"])
        x = xs[rank].clone()
        y = all_reduce(x)
        after = ca.comm.stats()["calls"]
        route = next((k for k in after if after[k] != before.get(k, 0)), "framework")
        ref = reference.sum_in_rank_order(xs)
        out.append(
            {
                "case": (n, dtype_name),
                "want": want_route,
                "route": route,
                "exact": bool(torch.equal(y, ref)),
                "close": bool(torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2)),
                "dtype": str(y.dtype),
                "digest": digest(y),
            }
        )
    return out


def check_cases(per_rank: list[list[dict]]) -> None:
    """Asserted in the pytest process: routes as expected, ours exact, every rank alike."""
    for cases in per_rank:
        for c in cases:
            assert c["route"] == c["want"], c
            assert c["close"], c
            if c["route"] in ("one_shot", "two_shot"):
                assert c["exact"], c  # bit-identical to the fixed rank-order fp32 sum
    for i, c in enumerate(per_rank[0]):
        assert {r[i]["digest"] for r in per_rank} == {c["digest"]}, c["case"]
