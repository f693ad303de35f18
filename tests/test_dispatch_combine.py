"""Dispatch/combine on the CPU transport against the single-process reference.

Moved data (rows, source ids, local expert ids, weights, counts) is compared exactly.
Combine is compared exactly too: the reference sums the partials in fp32 in the same
ascending-rank order the transport uses, so any difference is a bug, not rounding; it is
also checked against an fp64 sum within one bf16 rounding. fp8 rows are compared
exactly with the torch reference quantiser and within e4m3's error bound to the input.

All cases of one world size run inside one spawned group (spawning costs seconds).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_utils import run_ok
from routing_cases import inputs, placement

E, H, M, K, INTER = 16, 256, 24, 4, 32

# (name, routing, placement, payload, mode, ranks with zero tokens)
CASES = [
    ("uniform-bf16-normal", "uniform", "contiguous", "bf16", "normal", ()),
    ("uniform-fp8-normal", "uniform", "contiguous", "fp8", "normal", ()),
    ("zipf-bf16-ll-rows", "zipf", "contiguous", "bf16", "ll_rows", ()),
    ("zipf-fp8-ll-expert-major", "zipf", "random", "fp8", "ll_expert_major", ()),
    ("one-expert-bf16-normal", "one_expert", "contiguous", "bf16", "normal", ()),
    ("one-expert-bf16-expert-major", "one_expert", "contiguous", "bf16", "ll_expert_major", ()),
    ("masked-bf16-normal-empty-rank", "masked", "random", "bf16", "normal", (1,)),
    ("masked-fp8-ll-rows-empty-rank", "masked", "contiguous", "fp8", "ll_rows", (0,)),
    ("uniform-bf16-redundant-normal", "uniform", "redundant", "bf16", "normal", ()),
    ("zipf-bf16-redundant-expert-major", "zipf", "redundant", "bf16", "ll_expert_major", ()),
    ("uniform-fp8-redundant-ll-rows", "uniform", "redundant", "fp8", "ll_rows", ()),
    ("all-empty-bf16-normal", "uniform", "contiguous", "bf16", "normal", "all"),
    ("zipf-bf16-choice-table-normal", "zipf", "table", "bf16", "normal", ()),
    ("uniform-fp8-choice-table-expert-major", "uniform", "table", "fp8", "ll_expert_major", ()),
]


def _expert_weights(world_placement, rank):
    from pcie_a2a.reference import make_expert_weights

    w13, w2 = make_expert_weights(E, H, INTER, torch.bfloat16, seed=5)
    local = world_placement.local_experts(rank)
    return w13[local], w2[local]


def _check_rows(res, exp, payload, x_by_source, rows_slice=None):
    """Exact comparison of received rows with the reference rows."""
    assert torch.equal(res.src_rank, exp.src_rank)
    assert torch.equal(res.src_token, exp.src_token)
    assert torch.equal(res.topk_ids, exp.topk_ids)
    assert torch.equal(res.topk_weights, exp.topk_weights)
    assert torch.equal(res.x, exp.x), "received rows differ from the reference"
    if payload == "fp8" and exp.x.shape[0]:
        orig = torch.stack(
            [x_by_source[s][t] for s, t in zip(exp.src_rank.tolist(), exp.src_token.tolist())]
        ).float()
        scale = orig.reshape(orig.shape[0], -1, 128).abs().amax(-1, keepdim=True) / 448
        bound = 0.0665 * orig.abs() + (scale * 2.0**-10).expand(-1, -1, 128).reshape(orig.shape)
        assert bool(((res.x.float() - orig).abs() <= bound + 1e-30).all())


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, tuple):
        return tuple(_cpu(o) for o in obj)
    if dataclasses.is_dataclass(obj) and type(obj).__name__ == "DispatchResult":
        moved = {f.name: _cpu(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **(moved | {"handle": obj.handle}))
    return obj


class _OnDevice:
    """Runs a Buffer on its device while the test compares on the CPU."""

    def __init__(self, buf):
        self.buf = buf

    def __getattr__(self, name):
        fn = getattr(self.buf, name)

        def call(*args, **kwargs):
            dev = self.buf.device
            args = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]
            return _cpu(fn(*args, **kwargs))

        return call


def _run_case(rank, world, case, seed, backend="cpu", **buffer_kwargs):
    import pcie_a2a
    from pcie_a2a import reference as ref

    name, kind, place_kind, payload, mode, empty = case
    empty_ranks = tuple(range(world)) if empty == "all" else empty
    pl = placement(place_kind, E, world)
    xs, ids, ws = inputs(world, E, H, M, K, kind, seed, empty_ranks)
    expected = ref.reference_dispatch(xs, ids, ws, pl, M, K, payload)
    exp = expected[rank]
    w13, w2 = _expert_weights(pl, rank)
    with pcie_a2a.Buffer(
        None, E, H, M, payload=payload, placement=pl, num_topk=K, backend=backend, **buffer_kwargs
    ) as real_buf:
        buf = _OnDevice(real_buf)
        per_rank, per_expert, in_rank = buf.get_dispatch_layout(ids[rank])
        exp_in_rank = torch.zeros(ids[rank].shape[0], world, dtype=torch.bool)
        for t in range(ids[rank].shape[0]):
            for e in ids[rank][t].tolist():
                if e >= 0:
                    exp_in_rank[t, pl.replica_for(e, rank * M + t, rank)[0]] = True
        assert torch.equal(in_rank, exp_in_rank)
        assert per_rank.tolist() == exp_in_rank.sum(0).tolist()
        valid = ids[rank][ids[rank] >= 0]
        assert per_expert.tolist() == torch.bincount(valid, minlength=E).tolist()

        if mode == "normal":
            res = buf.dispatch(xs[rank], ids[rank], ws[rank])
            _check_rows(res, exp, payload, xs)
            assert res.tokens_per_expert_list == exp.tokens_per_expert
            if payload == "fp8":  # the same rows again, as raw e4m3 bytes and scales
                raw = buf.dispatch(xs[rank], ids[rank], ws[rank], return_fp8=True)
                assert raw.x.dtype == torch.float8_e4m3fn
                orig = [xs[s][t] for s, t in zip(exp.src_rank.tolist(), exp.src_token.tolist())]
                if orig:
                    q, scales = ref.quantize_fp8(torch.stack(orig))
                    assert torch.equal(raw.x.view(torch.uint8), q.view(torch.uint8))
                    assert torch.equal(raw.x_scales, scales)
            y = ref.expert_forward(res.x, res.topk_ids, res.topk_weights, w13, w2)
            out = buf.combine(y, res.handle)
        elif mode == "ll_rows":
            res = buf.low_latency_dispatch(xs[rank], ids[rank], ws[rank], layout="rows")
            counts = res.recv_count.tolist()
            assert counts == [int((exp.src_rank == s).sum()) for s in range(world)]
            assert list(res.x.shape) == [world, M, H]
            valid_rows = torch.cat([torch.arange(s * M, s * M + c) for s, c in enumerate(counts)])

            class Flat:  # the valid rows of the static layout, in wire order
                x = res.x.reshape(world * M, H)[valid_rows]
                src_rank = res.src_rank.reshape(-1)[valid_rows]
                src_token = res.src_token.reshape(-1)[valid_rows]
                topk_ids = res.topk_ids.reshape(world * M, K)[valid_rows]
                topk_weights = res.topk_weights.reshape(world * M, K)[valid_rows]

            _check_rows(Flat, exp, payload, xs)
            assert res.tokens_per_expert_list == exp.tokens_per_expert
            y = torch.zeros(world * M, H, dtype=torch.bfloat16)
            y[valid_rows] = ref.expert_forward(Flat.x, Flat.topk_ids, Flat.topk_weights, w13, w2)
            out = buf.low_latency_combine(y.view(world, M, H), res.handle)
        else:
            res = buf.low_latency_dispatch(xs[rank], ids[rank], ws[rank], layout="expert_major")
            e_local, cap = pl.num_local_experts(rank), world * M
            assert list(res.x.shape) == [e_local, cap, H]
            assert res.tokens_per_expert_list == exp.tokens_per_expert
            # expert e's rows: the reference rows that carry e, in wire order
            pos_of = {}
            for e in range(e_local):
                rows = (exp.topk_ids == e).any(dim=1).nonzero().flatten()
                n = rows.numel()
                assert torch.equal(res.x[e, :n], exp.x[rows])
                assert torch.equal(res.src_info[e, :n], exp.src_token[rows])
                for s in range(world):
                    from_s = rows[exp.src_rank[rows] == s]
                    begin = int((exp.src_rank[rows] < s).sum())
                    assert int(res.layout_range[e, s]) == (begin << 32) | from_s.numel()
                for p, r in enumerate(rows.tolist()):
                    pos_of[(r, e)] = p
            y_em = ref.expert_forward_expert_major(res.x, res.tokens_per_expert, w13, w2)
            out = buf.low_latency_combine(y_em, res.handle)
            # the partial each row returns: routing-weighted sum of its experts' outputs, fp32
            partial = torch.zeros(exp.x.shape[0], H, dtype=torch.float32)
            for r in range(exp.x.shape[0]):
                for k in range(K):
                    e = int(exp.topk_ids[r, k])
                    if e >= 0:
                        partial[r] += (
                            float(exp.topk_weights[r, k]) * y_em[e, pos_of[(r, e)]].float()
                        )
            y = partial.to(torch.bfloat16)
        # everyone's partials, to build the reference combine locally
        ys = [None] * world
        import torch.distributed as dist

        dist.all_gather_object(ys, (y if mode != "ll_rows" else y[valid_rows]))
        want = ref.reference_combine(ys, expected, [x.shape[0] for x in xs], H)[rank]
        assert out.dtype == torch.bfloat16 and out.shape == (xs[rank].shape[0], H)
        assert torch.equal(out, want), f"{name}: combine differs from the fp32 reference"
        fp64 = torch.zeros(xs[rank].shape[0], H, dtype=torch.float64)
        for r in range(world):
            sel = expected[r].src_rank == rank
            fp64.index_add_(0, expected[r].src_token[sel].long(), ys[r][sel].double())
        torch.testing.assert_close(
            out.double(), fp64.to(torch.bfloat16).double(), rtol=2**-7, atol=1e-6
        )
    return name


def _all_cases(rank, world, backend="cpu"):
    if backend == "cuda":
        torch.cuda.set_device(0)  # every rank shares GPU 0: the IPC path
    done = []
    for i, case in enumerate(CASES):
        try:
            done.append(_run_case(rank, world, case, seed=1000 * world + i, backend=backend))
        except AssertionError as exc:
            raise AssertionError(f"case {case[0]} (world {world}): {exc}") from exc
    return done


@pytest.mark.parametrize("world", [2, 4, 8])
def test_dispatch_combine_matches_reference(world):
    results = run_ok(world, _all_cases, timeout=300)
    assert all(r == [c[0] for c in CASES] for r in results)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_cuda_buffer_matches_reference(world):
    """The same table through Buffer(backend="cuda"), ranks sharing GPU 0 over IPC."""
    import pcie_a2a

    if not pcie_a2a.cuda_available():
        pytest.skip(pcie_a2a.cuda_unavailable_reason())
    results = run_ok(world, _all_cases, "cuda", timeout=600)
    assert all(r == [c[0] for c in CASES] for r in results)
