"""What every rank runs: the sweep, the correctness check and the shared timing loop.

For each (tokens, payload) one :class:`pcie_a2a.Buffer` is created and closed before the
next. For each routing, every method runs once untimed (its output is checked against
the fp32 expectation and its wire bytes recorded), ``warmup`` times (fewer once a quarter
of ``max_seconds`` is spent), then ``iters`` times (fewer when ``max_seconds`` would be
exceeded, estimated from the last warmup iteration, but at least ``min_iters``). One
timed iteration runs the three methods back to back, each after a barrier, in an order
rotated per iteration. A phase's latency in an iteration is its slowest rank's; p50/p99
are over iterations.

With ``backend == "cuda"`` x, the routing and the expert live on the rank's GPU (the
runner has made it the current device), stamps are taken after ``torch.cuda.synchronize``
and the statistics travel on the group's device (NCCL needs CUDA tensors). When ranks
share a GPU only ``pcie_a2a`` runs (``cfg["baselines_na"]`` says why; see bench/device.py).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import pcie_a2a
from pcie_a2a.bench import arms, device, memory, nccl_ep, nodes
from pcie_a2a.bench.methods import (
    AllGatherReduceScatter,
    AllReduceEP,
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


def _gather(t: torch.Tensor, group, comm: torch.device) -> torch.Tensor:
    """``all_gather`` of a small stats tensor on the group's device; [world, ...] on CPU."""
    t = t.to(comm)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return torch.stack(out).cpu()


def _why_not(cfg: dict, group, rank: int, world: int, dev, tokens: int, payload: str):
    """Why this config would not fit (every rank gets the same answer), or None."""
    need = memory.estimate(cfg, world, tokens, payload)
    if dev.type != "cuda":  # host memory and /dev/shm, judged by rank 0
        return _bcast(memory.why_not(need) if rank == 0 else None, group)
    # device memory, judged on every GPU: each rank measures its own after the others
    # have freed the previous config's tensors, and counts the ranks sharing its GPU
    torch.cuda.empty_cache()
    dist.barrier(group)
    free, _ = torch.cuda.mem_get_info(dev)
    sharing = device.ranks_on_device(cfg["local_world"], cfg["device_count"], dev.index)
    whys: list = [None] * world
    dist.all_gather_object(whys, memory.why_not_gpu(need, free, sharing, dev.index), group=group)
    return next((w for w in whys if w), None)


def run_sweep(cfg: dict, group=None, emit=None) -> dict | None:
    """Runs the whole sweep on this rank; rank 0 returns the raw results, others None.

    ``emit(kind, value)`` (rank 0) streams ``("meta", {...})`` and then each config's
    ``("result", {...})`` as it completes, so a later crash keeps the finished configs.
    """
    torch.set_num_threads(cfg["threads"])
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cuda = cfg["backend"] == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        torch.zeros(1, device=dev)  # create the context now, not inside the memory check
    comm = dev if cfg["pg_backend"] == "nccl" else torch.device("cpu")
    clock = device.make_clock(dev)
    na = cfg["baselines_na"]
    has_rs = na is None and reduce_scatter_works(group, comm)
    reduce = f"{reduce_scatter.__name__}" if has_rs else f"{all_gather.__name__} + local sum"
    reduce = na or reduce
    emit = emit if rank == 0 and emit is not None else (lambda kind, value: None)
    emit("meta", {"ag_rs_reduce": reduce, "baselines_na": na})
    nccl_ep_why = nccl_ep.unavailable_reason() if cfg["backend"] == "cuda" else ""
    combos = [(t, p) for t in cfg["tokens"] for p in cfg["payloads"]]
    total = len(combos) * len(cfg["routings"])
    done, results, start = 0, [], time.monotonic()
    for tokens, payload in combos:
        why = _why_not(cfg, group, rank, world, dev, tokens, payload)
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

        def make_buffer(tokens=tokens, payload=payload, pair_direction=None):
            return pcie_a2a.Buffer(
                group,
                cfg["experts"],
                cfg["hidden"],
                tokens,
                payload=payload,
                num_topk=cfg["topk"],
                backend=cfg["backend"],
                timeout_s=cfg["call_timeout"],
                pair_direction=pair_direction,
            )

        buf = make_buffer()
        forced: list = []
        try:
            ll = cfg["mode"] == "low_latency"
            forced, unavailable = arms.direction_buffers(make_buffer, cfg["directions"], group)
            methods = [Ours(buf, ll, clock)]
            methods += [Ours(b, ll, clock, arms.arm_name(d)) for d, b in forced]
            if na is None:
                methods += [
                    PerExpertA2A(group, world, rank, cfg["experts"], clock),
                    AllGatherReduceScatter(group, world, rank, cfg["experts"], has_rs, clock),
                    AllReduceEP(group, world, rank, cfg["experts"], clock),
                ]
            else:
                unavailable[arms.AR_EP] = na
            if cfg["backend"] == "cuda":  # NCCL's own EP: beside the NCCL baselines
                unavailable[nccl_ep.ARM] = nccl_ep_why
            for routing in cfg["routings"]:
                done += 1
                label = f"{done}/{total} tokens={tokens} payload={payload} routing={routing}"
                _progress(rank, f"{label} ...")
                t_cfg = time.monotonic()
                res = _run_config(cfg, group, (rank, world, dev, comm), methods, tokens, routing)
                if rank == 0:
                    res.update(tokens=tokens, payload=payload, routing=routing)
                    res["unavailable_arms"] = dict(unavailable)
                    results.append(res)
                    emit("result", res)
                    _progress(
                        rank,
                        f"{label}: {res['iters']} iters in "
                        f"{time.monotonic() - t_cfg:.2f} s "
                        f"(sweep {time.monotonic() - start:.0f} s)",
                    )
        finally:
            for _, b in forced:
                b.close()
            buf.close()
    if rank != 0:
        return None
    return {"results": results, "ag_rs_reduce": reduce, "baselines_na": na}


def _internode(cfg, group, comm, where, methods, ids) -> dict:
    """--nodes N: ``{"internode": {arm: [dispatch, combine]}}``, bytes per rank per call to
    other nodes (mean over ranks): pcie_a2a measured, the flat a2a counted from the
    routing (bench/nodes.py); ``{}`` with one node."""
    if cfg.get("nodes", 1) < 2:
        return {}
    rank, world = where
    per_node = world // cfg["nodes"]
    flat = nodes.flat_bytes(ids, cfg["experts"], world, rank, per_node, cfg["hidden"])
    mine = {"pcie_a2a": methods[0].internode, nodes.FLAT: flat}
    arms_ = [n for n in mine if n == "pcie_a2a" or any(m.name == n for m in methods)]
    local = torch.tensor([mine[n] for n in arms_], dtype=torch.float64)
    every = _gather(local, group, comm).mean(dim=0)
    return {"internode": {n: every[i].tolist() for i, n in enumerate(arms_)}}


def _run_config(cfg, group, where, methods, tokens, routing) -> dict:
    rank, world, dev, comm = where
    spec = RoutingSpec(
        routing,
        cfg["experts"],
        cfg["topk"],
        cfg["seed"],
        cfg["zipf_s"],
        cfg["n_group"],
        cfg["topk_group"],
    )
    ids_cpu, w_cpu = make_routing(spec, tokens, rank)  # generated on the host: same everywhere
    g = torch.Generator().manual_seed(cfg["seed"] * 7 + rank)
    x_cpu = torch.randn(tokens, cfg["hidden"], generator=g).to(torch.bfloat16)
    e_local = cfg["experts"] // world
    want = expected_output(x_cpu, ids_cpu, w_cpu, e_local)
    # the replicated arm (ar_ep) gets rank 0's tokens on every rank
    ids_rep, w_rep = make_routing(spec, tokens, 0)
    x_rep = torch.randn(
        tokens, cfg["hidden"], generator=torch.Generator().manual_seed(cfg["seed"] * 7)
    ).to(torch.bfloat16)
    want_rep = expected_output(x_rep, ids_rep, w_rep, e_local)
    inputs = {
        False: (x_cpu.to(dev), ids_cpu.to(dev), w_cpu.to(dev)),
        True: (x_rep.to(dev), ids_rep.to(dev), w_rep.to(dev)),
    }
    errors, wires = [], []
    for m in methods:  # untimed: correctness and wire bytes
        out, _ = m.step(*inputs[m.replicated], record=True)
        out = out.float().cpu()
        ref = want_rep if m.replicated else want
        scale = float(ref.abs().max()) if ref.numel() else 1.0
        err = float((out - ref).abs().max()) / max(scale, 1e-12) if out.numel() else 0.0
        errors.append(err)
        wires.append(m.wire)
    per_iter, warm_start = 0.0, time.perf_counter()
    for i in range(cfg["warmup"]):
        t0 = time.perf_counter()
        for m in methods:
            dist.barrier(group)
            m.step(*inputs[m.replicated])
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
            _, stamps = methods[i].step(*inputs[methods[i].replicated])
            marks[i, it] = torch.tensor(stamps)
    # phases per rank: dispatch, combine, dispatch+combine, dispatch+expert+combine
    d = marks[..., 1] - marks[..., 0]
    c = marks[..., 3] - marks[..., 2]
    phases = torch.stack([d, c, d + c, marks[..., 3] - marks[..., 0]], dim=-1)
    every = _gather(phases, group, comm)
    local = torch.tensor(
        [[e, *wb] for e, wb in zip(errors, wires, strict=True)], dtype=torch.float64
    )
    checks_t = _gather(local, group, comm)  # [world, methods, 3]
    fanout = ranks_per_token(ids_cpu, cfg["experts"], world)
    fanouts = _gather(torch.tensor([fanout], dtype=torch.float64), group, comm)
    internode = _internode(cfg, group, comm, (rank, world), methods, ids_cpu)
    if rank != 0:
        return {}
    slowest = every.amax(dim=0)  # [methods, iters, phases], ns
    return internode | {
        "iters": iters,
        "ranks_per_token": float(fanouts.mean()),
        "methods": {
            m.name: {
                "ns": slowest[i].tolist(),
                "max_rel_err": float(checks_t[:, i, 0].max()),
                "wire_bytes": [float(checks_t[:, i, 1].mean()), float(checks_t[:, i, 2].mean())],
            }
            for i, m in enumerate(methods)
        },
    }
