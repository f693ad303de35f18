#!/usr/bin/env python3
"""Benchmark the fused INT4 expert MLP (pcie_a2a.quant.moe_int4_mlp) on one GPU.

Shape: Kimi K2 (hidden 7168, expert intermediate 2048, 48 local experts = 384 / EP8, INT4
symmetric group 32); ``--model qwen3-30b-a3b`` for hidden 2048 / 768 / 16 experts.

Routing like decode (``decode`` points): ``A`` active experts with ``m`` rows each, in the
low-latency rows layout: a static receive buffer of ``--ll-rows`` rows (world x
max_tokens, default 1024) of which ``A * m`` carry one local expert id and the rest only
``-1`` slots. Sweep A over 1..48 and m over 1..16. Prefill (``prefill`` points): every
expert with m = 64..1024 rows, normal rows layout, block_m from the rows-per-expert
estimate (64) and forced 16.

Per point, medians over ``--iters`` (>= 100) CUDA-graph replays, each after an L2 flush
that only reads (a sum over 2x the L2 size: no dirty lines written back inside the timed
region):
  * ``us``, and the weight bytes of the touched experts (int4 + scales) / time as GB/s,
    side by side with the floors: the spec bandwidth (``--spec-gbs`` or a table of the
    target GPUs), the measured read-only bandwidth (torch.sum over 1 GiB) and the measured
    copy bandwidth (1 GiB device-to-device: read + write bytes / time);
  * the bf16 baseline (torch bmm on bf16 weights of the same experts) and its own GB/s;
  * vLLM's ``fused_marlin_moe`` on the same experts and rows when vLLM is importable with
    its CUDA ops (else a line says why it was skipped);
  * a per-kernel breakdown (torch.profiler, one eager call) of the first point of each
    sweep and with ``--breakdown`` of every point.
The machine (GPU name, SMs, driver, torch) is printed first and stored in ``--json``.
``--quick`` is the reduced run gpu_check uses (A in 1, 8, 48; m in 1, 4; one prefill point;
well under a minute on an H200).

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
SPEC_GBPS = {  # name substring -> spec DRAM bandwidth
    "RTX PRO 6000": 1792,
    "5090": 1792,
    "4090": 1008,
    "L40S": 864,
    "H200": 4800,
    "H100": 3350,
}
ACTIVE = (1, 2, 4, 8, 12, 16, 17, 24, 32, 48)
DECODE_ROWS = (1, 2, 4, 8, 16)
PREFILL_ROWS = (64, 256, 1024)


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


class Timer:
    """Median microseconds of CUDA-graph replays of fn, each after a read-only L2 flush."""

    def __init__(self, dev, iters: int, use_graph: bool):
        l2 = torch.cuda.get_device_properties(dev).L2_cache_size or (64 << 20)
        self.flush_buf = torch.ones(max(2 * l2, 64 << 20) // 4, dtype=torch.int32, device=dev)
        self.sink = torch.empty((), dtype=torch.int64, device=dev)
        self.iters = iters
        self.use_graph = use_graph
        self.capture_stream = torch.cuda.Stream(dev)  # every point's graph captures here

    def flush(self) -> None:
        torch.sum(self.flush_buf, 0, dtype=torch.int64, out=self.sink)  # reads only

    def __call__(self, fn) -> float:
        fn()
        run = fn
        if self.use_graph:
            # moe_int4_mlp keeps its zeroed workspace per stream and allocates it (zeroed)
            # on first use: a warm-up call on the capture stream keeps that first-use
            # zeroing out of the graph (else the first point's replays all include it).
            self.capture_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.capture_stream):
                fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.capture_stream):
                fn()
            run = graph.replay
        torch.cuda.synchronize()
        times = []
        for _ in range(self.iters):
            self.flush()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return statistics.median(times)


def _best_seconds(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e-3)
    return best


def floors(dev) -> dict:
    """Measured read-only and copy bandwidth (GB/s) over 1 GiB."""
    n = 1 << 30
    src = torch.ones(n // 4, dtype=torch.int32, device=dev)
    dst = torch.empty_like(src)
    sink = torch.empty((), dtype=torch.int64, device=dev)
    read = n / _best_seconds(lambda: torch.sum(src, 0, dtype=torch.int64, out=sink)) / 1e9
    copy = 2 * n / _best_seconds(lambda: dst.copy_(src)) / 1e9
    return dict(read_GBps=read, copy_GBps=copy)


def machine(dev) -> dict:
    p = torch.cuda.get_device_properties(dev)
    name = torch.cuda.get_device_name(dev)
    spec = next((v for k, v in SPEC_GBPS.items() if k in name), None)
    return dict(
        gpu=name,
        sms=p.multi_processor_count,
        cc=f"{p.major}.{p.minor}",
        l2_MB=(p.L2_cache_size or 0) / 2**20,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        spec_GBps=spec,
    )


def decode_routing(a: int, m: int, ll_rows: int, topk: int, dev):
    """Low-latency rows layout: rows [0, a*m) carry one local expert (r % a) in a random
    slot, every other slot and every other row is -1."""
    r = max(ll_rows, a * m)
    ids = torch.full((r, topk), -1, dtype=torch.int32)
    g = torch.Generator().manual_seed(a * 1000 + m)
    slot = torch.randint(0, topk, (a * m,), generator=g)
    ids[torch.arange(a * m), slot] = (torch.arange(a * m) % a).to(torch.int32)
    wts = torch.rand(r, topk, generator=g) * (ids >= 0)
    return ids.to(dev), wts.to(dev)


def prefill_routing(e: int, m: int, topk: int, dev):
    """Normal rows layout, every expert m rows: row r holds experts (r * topk + j) % e."""
    rows = -(-m * e // topk)
    slot = torch.arange(rows * topk).view(rows, topk)
    ids = (slot % e).to(torch.int32)
    ids[slot >= m * e] = -1
    return ids.to(dev), (torch.rand(rows, topk) * (ids >= 0)).to(dev)


def grouped(ids: torch.Tensor, wts: torch.Tensor):
    """The routed pairs grouped per active expert: (rows [A, m_max], weights [A, m_max, 1],
    pair indices into ids.flatten(), active experts). Padding slots have weight 0."""
    k = ids.shape[1]
    flat = ids.flatten().long()
    pair = torch.nonzero(flat >= 0).flatten()
    ex = flat[pair]
    order = torch.argsort(ex, stable=True)
    pair, ex = pair[order], ex[order]
    active, counts = torch.unique(ex, return_counts=True)
    slot = torch.searchsorted(active, ex)
    pos = torch.arange(len(ex), device=ids.device) - (torch.cumsum(counts, 0) - counts)[slot]
    m_max = int(counts.max())
    rows = torch.zeros(len(active), m_max, dtype=torch.long, device=ids.device)
    w = torch.zeros(len(active), m_max, 1, dtype=torch.float32, device=ids.device)
    rows[slot, pos] = pair // k
    w[slot, pos, 0] = wts.flatten()[pair]
    return rows, w, pair, active


class Dense:
    """bf16/fp16 baseline: the same MLP with 16-bit weights of the active experts."""

    def __init__(self, e, h, i, dtype, dev):
        self.w13 = torch.randn(e, h, 2 * i, device=dev, dtype=dtype) * 0.02
        self.w2 = torch.randn(e, i, h, device=dev, dtype=dtype) * 0.02
        self.i = i

    def bytes(self, n_active: int) -> int:
        return n_active * (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()

    def fn(self, x, ids, wts):
        rows, w, _, active = grouped(ids, wts)  # routing bookkeeping is not timed
        xe = x[rows]
        every = len(active) == self.w13.shape[0]
        w13 = self.w13 if every else self.w13[active]
        w2 = self.w2 if every else self.w2[active]

        def run():
            gu = torch.bmm(xe, w13)
            hh = torch.nn.functional.silu(gu[..., : self.i]) * gu[..., self.i :]
            y = torch.bmm(hh, w2).float() * w
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            out.index_add_(0, rows.flatten(), y.flatten(0, 1))
            return out.to(x.dtype)

        return run


def vllm_marlin(cfg, dtype, dev):
    """fused_marlin_moe on random GPTQ-format experts, or (None, why)."""
    try:
        import vllm._custom_ops as ops
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_moe_permute_scales,
        )
        from vllm.scalar_type import scalar_types
    except Exception as exc:
        return None, f"vLLM not importable with its CUDA ops: {type(exc).__name__}: {exc}"
    e, h, i, g = cfg["experts"], cfg["hidden"], cfg["intermediate"], cfg["group"]
    try:

        def repack(q, k, n):
            try:
                return ops.gptq_marlin_moe_repack(q, k, n, 4)
            except TypeError:
                perm = torch.empty((e, 0), dtype=torch.int32, device=dev)
                return ops.gptq_marlin_moe_repack(q, perm, k, n, 4)

        q13 = torch.randint(-(2**31), 2**31 - 1, (e, h // 8, 2 * i), dtype=torch.int32, device=dev)
        q2 = torch.randint(-(2**31), 2**31 - 1, (e, i // 8, h), dtype=torch.int32, device=dev)
        w1, w2 = repack(q13, h, 2 * i), repack(q2, i, h)
        s1 = (torch.rand(e, h // g, 2 * i, device=dev) * 0.01).to(dtype)
        s2 = (torch.rand(e, i // g, h, device=dev) * 0.01).to(dtype)
        s1 = marlin_moe_permute_scales(s1, h, 2 * i, g)
        s2 = marlin_moe_permute_scales(s2, i, h, g)
    except Exception as exc:
        return None, f"vLLM Marlin weight preparation failed: {type(exc).__name__}: {exc}"

    def make(x, ids, wts):
        # vLLM takes the routed rows only (no -1 slots): its best case.
        _, _, pair, _ = grouped(ids, wts)
        k = ids.shape[1]
        xs = x[pair // k].contiguous()
        tid = ids.flatten()[pair].view(-1, 1).contiguous()
        tw = wts.flatten()[pair].view(-1, 1).contiguous()

        def run():
            return fused_marlin_moe(
                xs, w1, w2, None, None, s1, s2, tw, tid, scalar_types.uint4b8.id
            )

        return run

    return make, ""


def breakdown(fn) -> list[tuple[str, float]]:
    """(kernel, microseconds) of one eager call, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for ev in prof.events():
        dt = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0.0)
        if dt and getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type):
            out.append((ev.name[:60], float(dt)))
    return out


def check(dev, dtype) -> None:
    """The op on the GPU against the CPU reference, low-latency layout with -1 rows."""
    from pcie_a2a.quant import PackedInt4Experts, moe_int4_mlp, moe_int4_mlp_reference, random_int4

    g = torch.Generator().manual_seed(0)
    e, h, i = 8, 512, 256
    parts = [
        random_int4(e, n, k, group_size=32, scale_dtype=dtype, generator=g, scale=0.05)
        for n, k in ((i, h), (i, h), (h, i))
    ]
    ex = PackedInt4Experts.from_weights(*parts, dtype).to(dev)
    ids, wts = decode_routing(5, 3, 64, 4, "cpu")
    x = torch.randn(ids.shape[0], h, generator=g).to(dtype)
    ref = moe_int4_mlp_reference(x, ids, wts, ex.w13, ex.w2).float()
    out = moe_int4_mlp(x.to(dev), ids.to(dev), wts.to(dev), ex.w13, ex.w2).float().cpu()
    routed = (ids >= 0).any(1)
    rel = ((out[routed] - ref[routed]).abs().mean() / ref[routed].abs().mean()).item()
    print(f"check: mean relative error vs CPU reference {rel:.2e} (bound 1e-2)")
    if not rel < 1e-2:
        refuse(f"correctness check failed: {rel:.3e}")


def run_point(kind, a, m, ids, wts, x, w13, w2, ex_bytes, dense, marlin, timer, fl, args, bd):
    from pcie_a2a.quant import moe_int4_mlp

    kw = {}
    if kind == "prefill":
        kw = dict(rows_per_expert=m) if args.block_m is None else dict(block_m=args.block_m)
    elif args.block_m is not None:
        kw = dict(block_m=args.block_m)

    def int4():
        return moe_int4_mlp(x, ids, wts, w13, w2, **kw)

    t4 = timer(int4)
    wbytes = a * ex_bytes
    gbs = wbytes / (t4 * 1e-6) / 1e9
    res = dict(kind=kind, active=a, rows_per_expert=m, int4_us=t4, weight_bytes=wbytes)
    res.update(GBps=gbs, pct_read=100 * gbs / fl["read_GBps"], pct_copy=100 * gbs / fl["copy_GBps"])
    if fl.get("spec_GBps"):
        res["pct_spec"] = 100 * gbs / fl["spec_GBps"]
    line = (
        f"{kind:7s} A={a:2d} m={m:4d} int4 {t4:8.1f} us {gbs:6.0f} GB/s "
        f"({res['pct_read']:5.1f}% read, {res['pct_copy']:5.1f}% copy"
        + (f", {res['pct_spec']:5.1f}% spec)" if "pct_spec" in res else ")")
    )
    if kind == "prefill" and args.block_m is None:
        t16 = timer(lambda: moe_int4_mlp(x, ids, wts, w13, w2, block_m=16))
        res["int4_bm16_us"] = t16
        line += f" | bm16 {t16:8.1f} us"
    if dense is not None:
        tb = timer(dense.fn(x, ids, wts))
        res.update(bf16_us=tb, bf16_GBps=dense.bytes(a) / (tb * 1e-6) / 1e9, speedup_bf16=tb / t4)
        line += f" | bf16 {tb:8.1f} us {res['bf16_GBps']:5.0f} GB/s x{tb / t4:5.2f}"
    if marlin is not None:
        try:
            tv = timer(marlin(x, ids, wts))
            res.update(vllm_marlin_us=tv, vs_vllm=tv / t4)
            line += f" | vLLM {tv:8.1f} us x{tv / t4:5.2f}"
        except Exception as exc:  # vLLM signatures drift between versions
            res["vllm_error"] = f"{type(exc).__name__}: {exc}"[:300]
            line += " | vLLM failed (see json)"
    if args.breakdown or bd:
        try:
            res["kernels"] = breakdown(int4)
        except Exception as exc:  # the profiler is optional
            res["kernels_error"] = f"{type(exc).__name__}: {exc}"[:300]
    print(line, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="kimi-k2")
    ap.add_argument("--active", type=int, nargs="*", default=list(ACTIVE))
    ap.add_argument("--rows", type=int, nargs="*", default=list(DECODE_ROWS))
    ap.add_argument("--prefill-rows", type=int, nargs="*", default=list(PREFILL_ROWS))
    ap.add_argument("--ll-rows", type=int, default=1024, help="low-latency buffer rows")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--block-m", type=int, choices=[16, 64], default=None)
    ap.add_argument("--spec-gbs", type=float, help="spec bandwidth if the GPU is not in the table")
    ap.add_argument("--no-graph", action="store_true", help="time eager launches")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 baseline")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's fused_marlin_moe")
    ap.add_argument("--breakdown", action="store_true", help="per-kernel times of every point")
    ap.add_argument("--quick", action="store_true", help="reduced run (gpu_check)")
    ap.add_argument("--check", action="store_true", help="verify against the CPU reference")
    ap.add_argument("--json", help="write results to this file")
    args = ap.parse_args()
    if args.quick:
        args.active, args.rows, args.prefill_rows = [1, 8, 48], [1, 4], [256]
    if args.iters < 100:
        refuse(f"--iters {args.iters}: medians need at least 100 iterations")
    if not torch.cuda.is_available():
        refuse("no CUDA GPU is visible to torch; this benchmark needs one (nothing was run)")
    try:
        import pcie_a2a._moe_int4  # noqa: F401
    except ImportError as exc:
        refuse(f"pcie_a2a._moe_int4 is not built (build with nvcc): {exc}")
    cfg = MODELS[args.model]
    e, h, i, grp = cfg["experts"], cfg["hidden"], cfg["intermediate"], cfg["group"]
    for a in args.active:
        if not 1 <= a <= e:
            refuse(f"--active {a}: allowed 1..{e}")
    for m in [*args.rows, *args.prefill_rows]:
        if m < 1:
            refuse(f"rows per expert {m}: must be >= 1")
    dev = torch.device("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    info = machine(dev)
    if args.spec_gbs:
        info["spec_GBps"] = args.spec_gbs
    fl = floors(dev)
    fl["spec_GBps"] = info["spec_GBps"]
    print(f"machine: {info}")
    print(
        f"floors: spec {info['spec_GBps']} GB/s, read-only {fl['read_GBps']:.0f} GB/s, "
        f"copy {fl['copy_GBps']:.0f} GB/s; {args.model}, {args.dtype}, {args.iters} iterations"
    )
    if args.check:
        check(dev, dtype)
    w13 = random_packed(e, 2 * i, h, grp, dtype, True, dev)
    w2 = random_packed(e, h, i, grp, dtype, False, dev)
    ex_bytes = (w13.nbytes + w2.nbytes) // e
    dense = None if args.no_bf16 else Dense(e, h, i, dtype, dev)
    marlin = None
    if not args.no_vllm:
        marlin, why = vllm_marlin(cfg, dtype, dev)
        if marlin is None:
            print(f"vLLM fused_marlin_moe: skipped ({why})")
    timer = Timer(dev, args.iters, not args.no_graph)
    results = []
    for n, (a, m) in enumerate((a, m) for a in args.active for m in args.rows):
        ids, wts = decode_routing(a, m, args.ll_rows, args.topk, dev)
        x = torch.randn(ids.shape[0], h, device=dev, dtype=dtype)
        pt = (a, m, ids, wts, x, w13, w2, ex_bytes, dense, marlin, timer, fl, args, n == 0)
        results.append(run_point("decode", *pt))
    for n, m in enumerate(args.prefill_rows):
        ids, wts = prefill_routing(e, m, args.topk, dev)
        x = torch.randn(ids.shape[0], h, device=dev, dtype=dtype)
        pt = (e, m, ids, wts, x, w13, w2, ex_bytes, dense, marlin, timer, fl, args, n == 0)
        results.append(run_point("prefill", *pt))
    for r in results:
        if "kernels" in r:
            print(f"kernels ({r['kind']} A={r['active']} m={r['rows_per_expert']}):")
            for name, us in r["kernels"]:
                print(f"    {us:9.1f} us  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, floors=fl, args=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
    main()
