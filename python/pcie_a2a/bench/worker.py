"""What every rank runs: the sweep, the correctness check and the shared timing loop.

For each (tokens, payload) one :class:`pcie_a2a.Buffer` is created and closed before the
next. For each routing, every method runs once untimed (its output is checked against
the fp32 expectation and its wire bytes recorded), ``warmup`` times (fewer once a quarter
of ``max_seconds`` is spent), then ``iters`` times (fewer when ``max_seconds`` would be
exceeded, estimated from the last warmup iteration, but at least ``min_iters``). One
timed iteration runs the three methods back to back, each after a barrier, in an order
rotated per iteration. A phase's latency in an iteration is its slowest rank's; p50/p99
are over iterations.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import pcie_a2a
from pcie_a2a.bench import memory
from pcie_a2a.bench.methods import (
    AllGatherReduceScatter,
    Ours,
    PerExpertA2A,
    all_gather,
    expected_output,
    reduce_scatter,
    reduce_scatter_works,
)
from pcie_a2a.bench.routing import RoutingSpec, make_routing, ranks_per_token


def _progress(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _bcast(obj, group):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def run_sweep(cfg: dict, group=None, emit=None) -> dict | None:
    """Runs the whole sweep on this rank; rank 0 returns the raw results, others None.

    ``emit(kind, value)`` (rank 0) streams ``("meta", {...})`` and then each config's
    ``("result", {...})`` as it completes, so a later crash keeps the finished configs.
    """
    torch.set_num_threads(cfg["threads"])
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    has_rs = reduce_scatter_works(group)
    reduce = f"{reduce_scatter.__name__}" if has_rs else f"{all_gather.__name__} + local sum"
    emit = emit if rank == 0 and emit is not None else (lambda kind, value: None)
    emit("meta", {"ag_rs_reduce": reduce})
    combos = [(t, p) for t in cfg["tokens"] for p in cfg["payloads"]]
    total = len(combos) * len(cfg["routings"])
    done, results, start = 0, [], time.monotonic()
    for tokens, payload in combos:
        need = memory.estimate(cfg, world, tokens, payload)
        why = _bcast(memory.why_not(need) if rank == 0 else None, group)
        if why:
            for routing in cfg["routings"]:
                done += 1
                _progress(
                    rank,
                    f"{done}/{total} tokens={tokens} payload={payload} "
                    f"routing={routing}: SKIPPED ({why})",
                )
                skipped = {"tokens": tokens, "payload": payload, "routing": routing, "skipped": why}
                results.append(skipped)
                emit("result", skipped)
            continue
        buf = pcie_a2a.Buffer(
            group,
            cfg["experts"],
            cfg["hidden"],
            tokens,
            payload=payload,
            num_topk=cfg["topk"],
            backend="cpu",
            timeout_s=cfg["call_timeout"],
        )
        try:
            methods = [
                Ours(buf, cfg["mode"] == "low_latency"),
                PerExpertA2A(group, world, rank, cfg["experts"]),
                AllGatherReduceScatter(group, world, rank, cfg["experts"], has_rs),
            ]
            for routing in cfg["routings"]:
                done += 1
                label = f"{done}/{total} tokens={tokens} payload={payload} routing={routing}"
                _progress(rank, f"{label} ...")
                t_cfg = time.monotonic()
                res = _run_config(cfg, group, rank, world, methods, tokens, routing)
                if rank == 0:
                    res.update(tokens=tokens, payload=payload, routing=routing)
                    results.append(res)
                    emit("result", res)
                    _progress(
                        rank,
                        f"{label}: {res['iters']} iters in "
                        f"{time.monotonic() - t_cfg:.2f} s "
                        f"(sweep {time.monotonic() - start:.0f} s)",
                    )
        finally:
            buf.close()
    if rank != 0:
        return None
    return {"results": results, "ag_rs_reduce": reduce}


def _run_config(cfg, group, rank, world, methods, tokens, routing) -> dict:
    spec = RoutingSpec(
        routing,
        cfg["experts"],
        cfg["topk"],
        cfg["seed"],
        cfg["zipf_s"],
        cfg["n_group"],
        cfg["topk_group"],
    )
    ids, w = make_routing(spec, tokens, rank)
    g = torch.Generator().manual_seed(cfg["seed"] * 7 + rank)
    x = torch.randn(tokens, cfg["hidden"], generator=g).to(torch.bfloat16)
    want = expected_output(x, ids, w, cfg["experts"] // world)
    scale = float(want.abs().max()) if want.numel() else 1.0
    errors, wires = [], []
    for m in methods:  # untimed: correctness and wire bytes
        out, _ = m.step(x, ids, w, record=True)
        err = float((out.float() - want).abs().max()) / max(scale, 1e-12) if out.numel() else 0.0
        errors.append(err)
        wires.append(m.wire)
    per_iter, warm_start = 0.0, time.perf_counter()
    for i in range(cfg["warmup"]):
        t0 = time.perf_counter()
        for m in methods:
            dist.barrier(group)
            m.step(x, ids, w)
        per_iter = time.perf_counter() - t0
        # long configs stop warming up after a quarter of --max-seconds (ranks agree)
        spent = time.perf_counter() - warm_start
        cap = cfg["max_seconds"] > 0 and spent > cfg["max_seconds"] / 4
        if i + 1 < cfg["warmup"] and _bcast(cap if rank == 0 else None, group):
            break
    iters = cfg["iters"]
    if cfg["max_seconds"] > 0 and per_iter > 0:
        iters = max(cfg["min_iters"], min(iters, int(cfg["max_seconds"] / per_iter)))
    iters = _bcast(iters, group)
    marks = torch.zeros(len(methods), iters, 4, dtype=torch.int64)
    for it in range(iters):
        shift = it % len(methods)
        for i in list(range(shift, len(methods))) + list(range(shift)):
            dist.barrier(group)
            _, stamps = methods[i].step(x, ids, w)
            marks[i, it] = torch.tensor(stamps)
    # phases per rank: dispatch, combine, dispatch+combine, dispatch+expert+combine
    d = marks[..., 1] - marks[..., 0]
    c = marks[..., 3] - marks[..., 2]
    phases = torch.stack([d, c, d + c, marks[..., 3] - marks[..., 0]], dim=-1)
    every = [torch.empty_like(phases) for _ in range(world)]
    dist.all_gather(every, phases, group=group)
    local = torch.tensor(
        [[e, *wb] for e, wb in zip(errors, wires, strict=True)], dtype=torch.float64
    )
    checks = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(checks, local, group=group)
    fanout = torch.tensor([ranks_per_token(ids, cfg["experts"], world)], dtype=torch.float64)
    fanouts = [torch.empty_like(fanout) for _ in range(world)]
    dist.all_gather(fanouts, fanout, group=group)
    if rank != 0:
        return {}
    slowest = torch.stack(every).amax(dim=0)  # [methods, iters, phases], ns
    checks_t = torch.stack(checks)  # [world, methods, 3]
    return {
        "iters": iters,
        "ranks_per_token": float(torch.stack(fanouts).mean()),
        "methods": {
            m.name: {
                "ns": slowest[i].tolist(),
                "max_rel_err": float(checks_t[:, i, 0].max()),
                "wire_bytes": [float(checks_t[:, i, 1].mean()), float(checks_t[:, i, 2].mean())],
            }
            for i, m in enumerate(methods)
        },
    }
