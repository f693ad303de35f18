"""What every rank of ``pcie-a2a bench --op allreduce`` runs for one world: per dtype one
:class:`pcie_a2a.AllReduce` (ours at every size: the hand-over is what the bench measures),
per (size, fused) the three methods in one loop.

Methods: ``one_shot`` and ``two_shot`` (ours, forced), ``baseline`` (``dist.all_reduce`` on
the group: NCCL with ``--backend cuda`` and a GPU per rank, gloo on the CPU; plus ``x +
residual`` when fused). Each is checked once untimed (ours bit for bit against the fp32
rank-order reference, the baseline within bf16/fp16 rounding), warmed up, then timed: an
iteration runs the methods back to back in an order rotated per iteration, each after a
barrier, each ``inner`` calls in a row between two clock stamps (on a GPU the stamps follow
a device synchronisation, so a sample is completed work); a method's time in an iteration is
its slowest rank's, divided by ``inner``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import pcie_a2a
from pcie_a2a.allreduce import reference as R
from pcie_a2a.bench import device

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
METHODS = ("one_shot", "two_shot", "baseline")


def _progress(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _bcast(obj, group):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _inputs(world: int, numel: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(numel, generator=g).to(dtype) for _ in range(world)]
    return xs, torch.randn(numel, generator=g).to(dtype)


class _Method:
    def __init__(self, name, fn):
        self.name, self.fn = name, fn


def run_sweep(cfg: dict, group=None, emit=None) -> dict | None:
    """One world's sweep; rank 0 returns ``{"results": [...]}``, the others None."""
    torch.set_num_threads(cfg["threads"])
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cuda = cfg["backend"] == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    clock = device.make_clock(dev)
    na = cfg["baselines_na"]
    emit = emit if rank == 0 and emit is not None else (lambda kind, value: None)
    results = []
    sizes = cfg["sizes"]
    for dname in cfg["dtypes"]:
        dtype = DTYPES[dname]
        ar = pcie_a2a.AllReduce(
            group, max(sizes), dtype, backend=cfg["backend"], handover_bytes=max(sizes),
            timeout_s=cfg["call_timeout"],
        )  # fmt: skip
        try:
            for nbytes in sizes:
                for fused in cfg["fused"]:
                    t0 = time.monotonic()
                    res = _config(cfg, group, rank, world, dev, clock, ar, dtype, nbytes, fused, na)
                    if rank == 0:
                        res.update(world=world, dtype=dname, bytes=nbytes, fused=fused)
                        res["default_route"] = _default_route(cfg, world, dname, ar, nbytes)
                        results.append(res)
                        emit("result", res)
                        _progress(
                            rank,
                            f"world {world} {dname} {nbytes} B fused={fused}: {res['iters']} "
                            f"iters in {time.monotonic() - t0:.2f} s",
                        )
        finally:
            dist.barrier(group)
            ar.close()
    if rank != 0:
        return None
    return {"results": results}


def _default_route(cfg, world, dname, ar, nbytes) -> str:
    """The route a default AllReduce would take at this size (what users get): the
    thresholds of :mod:`pcie_a2a.allreduce.tuning` for this group, not the bench's forced
    hand-over."""
    from pcie_a2a.allreduce import tuning

    d = ar.decisions
    cls = "cpu" if cfg["backend"] == "cpu" else tuning.topology_class(d.path_classes)
    name = str(DTYPES[dname]).removeprefix("torch.")
    return tuning.choose(cfg["backend"], world, name, cls, d.measured, 1 << 40).route(nbytes)


def _config(cfg, group, rank, world, dev, clock, ar, dtype, nbytes, fused, na) -> dict:
    numel = nbytes // torch.empty((), dtype=dtype).element_size()
    xs, res = _inputs(world, numel, dtype, seed=cfg["seed"] + nbytes)
    want = R.add_residual(R.sum_in_rank_order(xs), res if fused else None)
    x, r = xs[rank].to(dev), res.to(dev) if fused else None
    out = torch.empty_like(x)
    scratch = torch.empty_like(x)

    def ours(algo):
        ar.algorithm = algo

        def fn():
            ar.all_reduce(x, out=out, residual=r)
            return out

        return fn

    def baseline():
        scratch.copy_(x)
        dist.all_reduce(scratch, group=group)
        if r is not None:
            scratch.add_(r)
        return scratch

    methods = [_Method("one_shot", ours("one_shot")), _Method("two_shot", ours("two_shot"))]
    if na is None:
        methods.append(_Method("baseline", baseline))
    errors = []
    for m in methods:  # untimed: correctness
        got = m.fn().cpu()
        if m.name == "baseline":
            err = float((got.float() - want.float()).abs().max()) / max(
                float(want.float().abs().max()), 1e-6
            )
            errors.append(err)
        else:
            errors.append(
                0.0 if torch.equal(got.view(torch.int16), want.view(torch.int16)) else 1.0
            )
    inner = cfg["inner"]
    per_iter, warm_start = 0.0, time.perf_counter()
    for i in range(cfg["warmup"]):
        t0 = time.perf_counter()
        for m in methods:
            dist.barrier(group)
            for _ in range(inner):
                m.fn()
        per_iter = time.perf_counter() - t0
        spent = time.perf_counter() - warm_start
        cap = cfg["max_seconds"] > 0 and spent > cfg["max_seconds"] / 4
        if i + 1 < cfg["warmup"] and _bcast(cap if rank == 0 else None, group):
            break
    iters = cfg["iters"]
    if cfg["max_seconds"] > 0 and per_iter > 0:
        iters = max(cfg["min_iters"], min(iters, int(cfg["max_seconds"] / per_iter)))
    iters = _bcast(iters, group)
    ns = torch.zeros(len(methods), iters, dtype=torch.int64)
    for it in range(iters):
        shift = it % len(methods)
        for i in list(range(shift, len(methods))) + list(range(shift)):
            dist.barrier(group)
            t0 = clock()
            for _ in range(inner):
                methods[i].fn()
            ns[i, it] = (clock() - t0) // inner
    comm = dev if cfg["pg_backend"] == "nccl" else torch.device("cpu")
    every = [torch.empty_like(ns).to(comm) for _ in range(world)]
    dist.all_gather(every, ns.to(comm), group=group)
    errs = [torch.empty(len(methods), dtype=torch.float64).to(comm) for _ in range(world)]
    dist.all_gather(errs, torch.tensor(errors, dtype=torch.float64).to(comm), group=group)
    if rank != 0:
        return {}
    slowest = torch.stack([e.cpu() for e in every]).amax(dim=0)  # [methods, iters]
    worst_err = torch.stack([e.cpu() for e in errs]).amax(dim=0)
    out = {"iters": iters, "inner": inner, "methods": {}}
    for i, m in enumerate(methods):
        us = slowest[i].double() / 1e3
        out["methods"][m.name] = {
            "p50_us": float(us.median()),
            "p99_us": float(torch.quantile(us, 0.99)),
            "samples_us": [round(float(v), 2) for v in us],
            "error": float(worst_err[i]),
        }
    if na is not None:
        out["methods"]["baseline"] = {"unavailable": na}
    return out
