#!/usr/bin/env python3
"""Benchmark the fused INT4 expert MLP (pcie_a2a.quant.moe_int4_mlp) on one GPU.

Shapes: Kimi K2 (hidden 7168, expert intermediate 2048, 48 local experts = 384 / EP8) and
Qwen3-30B-A3B (hidden 2048, expert intermediate 768, 16 local experts = 128 / EP8), with
1..256 rows per local expert. Every expert gets exactly ``m`` rows: rows are the dispatch
"rows" layout with ``topk = min(8, E)`` distinct local experts per row, assigned round
robin, so the per-row weighted reduction is exercised too.

Reported per point:
  * ``int4_us``   median time of the op (CUDA graph replay, L2 flushed before each run);
  * ``GB/s``      packed weight bytes of the touched experts (int4 + scales) / time, and
                  ``%copy``: that against the device's copy bandwidth measured here
                  (a device-to-device copy of 1 GiB: bytes read + written / time);
  * ``bf16_us``   the same MLP with bf16 weights through torch (one bmm for gate/up, SiLU*up,
                  one bmm for down, weight and sum), same experts, same process, same
                  graph/flush protocol; ``speedup`` = bf16_us / int4_us.
Weights are random bit patterns in the packed layout (timing does not depend on values);
``--check`` first compares the op against the CPU reference on a small problem.

Needs a CUDA GPU and the built extension: without them it prints why and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

MODELS = {
    "kimi-k2": dict(hidden=7168, intermediate=2048, experts=48, group=32),
    "qwen3-30b-a3b": dict(hidden=2048, intermediate=768, experts=16, group=128),
}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def refuse(msg: str) -> None:
    print(f"bench_moe_gemm: {msg}", file=sys.stderr)
    sys.exit(2)


def random_packed(e: int, n: int, k: int, group: int, dtype, gate_up: bool, dev):
    from pcie_a2a.quant.layout import PackedInt4Weight, padded_k, round_up

    k_pad = padded_k(k, group)
    n_pad = 2 * round_up(n // 2, 128) if gate_up else round_up(n, 256)
    geff = k_pad if group == -1 else group
    qweight = torch.randint(
        -(2**31), 2**31 - 1, (e, k_pad // 16, 2 * n_pad), dtype=torch.int32, device=dev
    )
    scales = (torch.rand(e, k_pad // geff, n_pad, device=dev) * 0.01).to(dtype)
    return PackedInt4Weight(
        qweight, scales, None, None, None, n, k, n_pad, k_pad, group, dtype, gate_up
    )


def timed(fn, iters: int, flush: torch.Tensor, use_graph: bool) -> float:
    """Median microseconds of fn() with L2 flushed before each run."""
    fn()
    torch.cuda.synchronize()
    run = fn
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    times = []
    for _ in range(iters):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def copy_bandwidth(dev) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write bytes)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e-3)
    return 2 * n / best / 1e9


def routing(m: int, e: int, dev):
    topk = min(8, e)
    r = (m * e + topk - 1) // topk
    slot = torch.arange(r * topk, device=dev).view(r, topk)
    ids = (slot % e).to(torch.int32)
    ids[slot >= m * e] = -1  # the last row may be partial
    wts = torch.rand(r, topk, device=dev) * (ids >= 0)
    return ids, wts


def check(dev, dtype) -> None:
    from pcie_a2a.quant import PackedInt4Experts, moe_int4_mlp, moe_int4_mlp_reference, random_int4

    g = torch.Generator().manual_seed(0)
    e, h, i = 8, 512, 256
    parts = [
        random_int4(e, n, k, group_size=32, scale_dtype=dtype, generator=g, scale=0.05)
        for n, k in ((i, h), (i, h), (h, i))
    ]
    ex = PackedInt4Experts.from_weights(*parts, dtype).to(dev)
    x = torch.randn(40, h, generator=g).to(dtype)
    ids, wts = routing(5, e, "cpu")
    x = x[: ids.shape[0]]
    ref = moe_int4_mlp_reference(x, ids, wts, ex.w13, ex.w2).float()
    out = moe_int4_mlp(x.to(dev), ids.to(dev), wts.to(dev), ex.w13, ex.w2).float().cpu()
    rel = ((out - ref).abs().mean() / ref.abs().mean()).item()
    print(f"check: mean relative error vs CPU reference {rel:.2e} (bound 1e-2)")
    if not rel < 1e-2:
        refuse(f"correctness check failed: {rel:.3e}")


def bench_model(name, cfg, rows, dtype, dev, iters, use_graph, flush, copy_bw, block_m):
    from pcie_a2a.quant import moe_int4_mlp

    e, h, i, grp = cfg["experts"], cfg["hidden"], cfg["intermediate"], cfg["group"]
    w13 = random_packed(e, 2 * i, h, grp, dtype, True, dev)
    w2 = random_packed(e, h, i, grp, dtype, False, dev)
    bytes_int4 = w13.nbytes + w2.nbytes
    d13 = torch.randn(e, h, 2 * i, device=dev, dtype=dtype) * 0.02  # bf16/fp16 baseline
    d2 = torch.randn(e, i, h, device=dev, dtype=dtype) * 0.02
    results = []
    for m in rows:
        ids, wts = routing(m, e, dev)
        x = torch.randn(ids.shape[0], h, device=dev, dtype=dtype)
        # Baseline input: rows grouped per expert, [E, m, H] (the gather is not timed).
        flat = ids.flatten()
        key = torch.where(flat < 0, e, flat)  # padding (-1) sorts last
        order = torch.argsort(key, stable=True)[: m * e]
        row_of = (order // ids.shape[1]).view(e, m)
        xe = x[row_of]
        we = wts.flatten()[order].view(e, m, 1)

        def int4(ids=ids, wts=wts, x=x):
            return moe_int4_mlp(x, ids, wts, w13, w2, block_m=block_m)

        def dense(xe=xe, we=we, row_of=row_of, x=x):
            gu = torch.bmm(xe, d13)
            hh = torch.nn.functional.silu(gu[..., :i]) * gu[..., i:]
            y = torch.bmm(hh, d2) * we
            out = torch.zeros(x.shape, dtype=torch.float32, device=dev)
            out.index_add_(0, row_of.flatten(), y.flatten(0, 1).float())
            return out.to(dtype)

        t4 = timed(int4, iters, flush, use_graph)
        tb = timed(dense, iters, flush, use_graph)
        gbs = bytes_int4 / (t4 * 1e-6) / 1e9
        res = dict(
            model=name,
            rows_per_expert=m,
            experts=e,
            int4_us=t4,
            bf16_us=tb,
            speedup=tb / t4,
            weight_GBps=gbs,
            pct_copy_bw=100 * gbs / copy_bw,
            weight_bytes=bytes_int4,
        )
        results.append(res)
        print(
            f"{name:14s} m={m:4d} int4 {t4:9.1f} us  bf16 {tb:9.1f} us  x{tb / t4:5.2f}  "
            f"{gbs:7.0f} GB/s ({res['pct_copy_bw']:5.1f}% of copy)",
            flush=True,
        )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=[*MODELS, "all"], default="all")
    ap.add_argument(
        "--rows",
        type=int,
        nargs="*",
        default=list(ROWS),
        help="rows per local expert (default 1..256)",
    )
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--block-m", type=int, choices=[16, 64], default=None)
    ap.add_argument("--no-graph", action="store_true", help="time eager launches")
    ap.add_argument("--check", action="store_true", help="verify against the CPU reference")
    ap.add_argument("--json", help="write results to this file")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        refuse("no CUDA GPU is visible to torch; this benchmark needs one (nothing was run)")
    try:
        import pcie_a2a._moe_int4  # noqa: F401
    except ImportError as exc:
        refuse(f"pcie_a2a._moe_int4 is not built (build with nvcc): {exc}")
    for m in args.rows:
        if m < 1:
            refuse(f"--rows {m}: rows per expert must be >= 1")
    dev = torch.device("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(dev)
    copy_bw = copy_bandwidth(dev)
    print(f"device: {name}; measured copy bandwidth {copy_bw:.0f} GB/s; dtype {args.dtype}")
    if args.check:
        check(dev, dtype)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    models = MODELS if args.model == "all" else {args.model: MODELS[args.model]}
    results = []
    for mname, cfg in models.items():
        results += bench_model(
            mname,
            cfg,
            args.rows,
            dtype,
            dev,
            args.iters,
            not args.no_graph,
            flush,
            copy_bw,
            args.block_m,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(device=name, copy_GBps=copy_bw, dtype=args.dtype, results=results), f, indent=1
            )


if __name__ == "__main__":
    main()
