#!/usr/bin/env python3
"""Per-kernel device time of one rank's dispatch and combine (world 1, one GPU), through
the public Buffer API with backend="cuda".

One process, one rank: nothing time-slices, so these are this GPU's own kernel times (the
rank still packs, sends to itself and unpacks: every kernel of the path runs), not PCIe
numbers. For each payload and call (low-latency rows, low-latency expert-major, normal)
it prints the median wall time of dispatch and combine, and from torch.profiler the
kernels per call with their device time, plus the host<->device copies per call (each
device-to-host copy is a host synchronisation the caller waits on). Every call's combine
is checked: with y = the received rows and world 1, out[t] = x[t] for each routed token.

``--small`` (a few tokens, two calls per op, no profiler) is what gpu_check runs under
compute-sanitizer; ``--backend cpu`` runs the same calls and checks on the CPU transport
(how the CPU tests check this script). Needs a GPU and the CUDA build; without them exits 2
and says why.

    PYTHONPATH=python python3 scripts/gpu_kernel_breakdown.py [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("pcie_a2a") is None:  # not installed: the source tree's build
    sys.path.insert(0, str(ROOT / "python"))

FULL = dict(tokens=128, hidden=7168, experts=384, topk=8)  # Kimi K2 decode step, one rank
SMALL = dict(tokens=16, hidden=1024, experts=16, topk=4)
OPS = ("ll_rows", "ll_expert_major", "normal")


def unavailable_reason() -> str:
    try:
        from pcie_a2a import cuda_unavailable_reason
    except ImportError as exc:
        return f"pcie_a2a does not import: {exc}"
    reason = cuda_unavailable_reason()
    if reason:
        return reason
    try:
        from pcie_a2a import _cuda_transport  # noqa: F401
    except ImportError as exc:
        return f"pcie_a2a._cuda_transport is not in this build: {exc}"
    return ""


def short_name(name: str, width: int = 64) -> str:
    """A kernel's name without its template arguments and parameter list (copies and
    sets keep theirs: "Memcpy DtoH (Device -> Pageable)")."""
    if name.startswith(("Memcpy", "Memset")):
        return name[:width]
    out, depth = [], 0
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    text = re.sub(r"^(void|static)\s+", "", "".join(out).strip())
    return text[:width] or name[:width]


def aggregate(events, calls: int) -> list[dict]:
    """Device-side profiler events -> one row per kernel (or copy): count per call, mean
    and total device microseconds per call, largest first. `events` need ``name``,
    ``device_type`` ("CUDA" in its name) and ``time_range.elapsed_us()``."""
    rows: dict[str, dict] = {}
    for e in events:
        if "CUDA" not in str(getattr(e, "device_type", "")):
            continue
        key = short_name(e.name)
        r = rows.setdefault(key, {"name": key, "count": 0, "total_us": 0.0})
        r["count"] += 1
        r["total_us"] += float(e.time_range.elapsed_us())
    out = []
    for r in rows.values():
        out.append({"name": r["name"], "per_call": r["count"] / calls,
                    "mean_us": r["total_us"] / r["count"], "us_per_call": r["total_us"] / calls})  # fmt: skip
    return sorted(out, key=lambda r: -r["us_per_call"])


def copies_per_call(rows: list[dict]) -> tuple[float, float]:
    dtoh = sum(
        r["per_call"] for r in rows if "DtoH" in r["name"] or "Device -> Pageable" in r["name"]
    )
    htod = sum(r["per_call"] for r in rows if "HtoD" in r["name"])
    return dtoh, htod


def kernels_per_call(rows: list[dict]) -> float:
    return sum(r["per_call"] for r in rows if not r["name"].startswith(("Memcpy", "Memset")))


def _inputs(cfg: dict, seed: int, dev):
    import torch

    g = torch.Generator().manual_seed(seed)
    t, h, e, k = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"]
    x = (torch.randn(t, h, generator=g) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    if t > 3:
        ids[3, :] = -1  # one token routed nowhere
    w = torch.rand(t, k, generator=g)
    return x.to(dev), ids.to(dev), w.to(dev)


def _call(buf, op: str, x, ids, w):
    if op == "ll_rows":
        d = buf.low_latency_dispatch(x, ids, w)
        return d, lambda: buf.low_latency_combine(d.x, d.handle)
    if op == "ll_expert_major":
        d = buf.low_latency_dispatch(x, ids, w, layout="expert_major")
        y = d.x  # unweighted expert outputs: the combine applies the weights
        return d, lambda: buf.low_latency_combine(y, d.handle)
    d = buf.dispatch(x, ids, w)
    return d, lambda: buf.combine(d.x, d.handle)


def _check(op: str, payload: str, x, ids, w, out) -> None:
    import torch

    routed = (ids >= 0).any(dim=1)
    want = x.float().clone()
    if op == "ll_expert_major":  # the combine weighted each expert's copy of x
        want = want * torch.where(ids >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)
    want[~routed] = 0
    got = out.float()
    if payload == "bf16" and op != "ll_expert_major":
        ok = torch.equal(got, want.to(torch.bfloat16).float())
    else:  # fp8 wire, or an fp32 weighted sum rounded to bf16
        tol = 0.07 if payload == "fp8" else 0.01
        ok = bool(((got - want).abs() <= tol * want.abs() + 0.02 * want.abs().amax()).all())
    if not ok:
        raise AssertionError(f"{payload} {op}: combine result differs from the input rows")


def run_op(buf, op: str, payload: str, cfg: dict, warmup: int, iters: int, profile: bool) -> dict:
    import torch

    x, ids, w = _inputs(cfg, 1, buf.device)
    sync = torch.cuda.synchronize if buf.device.type == "cuda" else (lambda: None)
    times = {"dispatch": [], "combine": []}
    for i in range(warmup + iters):
        sync()
        t0 = time.perf_counter()
        _, combine = _call(buf, op, x, ids, w)
        sync()
        t1 = time.perf_counter()
        out = combine()
        sync()
        t2 = time.perf_counter()
        buf.check()
        _check(op, payload, x, ids, w, out)
        if i >= warmup:
            times["dispatch"].append((t1 - t0) * 1e6)
            times["combine"].append((t2 - t1) * 1e6)
    res = {f"{k}_wall_us": statistics.median(v) for k, v in times.items()}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof_ctx

        with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                _, combine = _call(buf, op, x, ids, w)
                combine()
            torch.cuda.synchronize()
        rows = aggregate(prof.events(), iters)
        res["kernels"] = rows
        res["kernels_per_call"] = kernels_per_call(rows)
        res["dtoh_per_call"], res["htod_per_call"] = copies_per_call(rows)
        res["device_us_per_call"] = sum(r["us_per_call"] for r in rows)
    return res


def table(results: list[dict]) -> list[str]:
    lines = ["kernel breakdown, world 1 (one process: no time-slicing; NOT PCIe numbers)"]
    for r in results:
        head = (f"{r['payload']:>4} {r['op']:<16} dispatch {r['dispatch_wall_us']:8.1f} us, "
                f"combine {r['combine_wall_us']:8.1f} us wall (median)")  # fmt: skip
        if "kernels" in r:
            head += (f"; {r['kernels_per_call']:.0f} kernels, {r['dtoh_per_call']:.0f} DtoH + "
                     f"{r['htod_per_call']:.0f} HtoD copies, {r['device_us_per_call']:.1f} us on the "
                     "device per dispatch+combine")  # fmt: skip
        lines.append(head)
        for k in r.get("kernels", [])[:8]:
            lines.append(f"       {k['name']:<64} x{k['per_call']:<4.1f} {k['mean_us']:8.1f} us")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shapes, 2 calls, no profiler")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--backend", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cuda = args.backend == "cuda"
    if args.iters < 1 or args.warmup < 0:
        p.error(f"--iters {args.iters} / --warmup {args.warmup}: need iters >= 1, warmup >= 0")
    reason = unavailable_reason() if cuda else ""
    if reason:
        print(f"gpu_kernel_breakdown: needs a GPU and a CUDA build: {reason}", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    import pcie_a2a

    cfg = SMALL if args.small else FULL
    iters, warmup = (2, 1) if args.small else (args.iters, args.warmup)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    results = []
    try:
        for payload in ("bf16", "fp8"):
            buf = pcie_a2a.Buffer(None, cfg["experts"], cfg["hidden"], cfg["tokens"], payload=payload,
                                  num_topk=cfg["topk"], backend=args.backend, timeout_s=10.0)  # fmt: skip
            try:
                for op in OPS:
                    res = run_op(
                        buf, op, payload, cfg, warmup, iters, profile=cuda and not args.small
                    )
                    results.append({"payload": payload, "op": op, **res})
            finally:
                if cuda:
                    torch.cuda.synchronize()
                buf.close()
    finally:
        dist.destroy_process_group()
    for line in table(results):
        print(line)
    for r in results:
        if "kernels" in r:
            print(f"summary: {r['payload']} {r['op']}: {r['kernels_per_call']:.0f} kernels, "
                  f"{r['dtoh_per_call']:.0f} DtoH copies per dispatch+combine")  # fmt: skip
    if args.small:
        print(f"summary: {len(results)} calls checked")
    if args.json:
        gpu = torch.cuda.get_device_name(0) if cuda else "none (CPU transport)"
        args.json.write_text(json.dumps({"config": cfg, "gpu": gpu,
                                         "results": results}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
