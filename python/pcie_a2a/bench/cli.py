"""``pcie-a2a bench``: dispatch / combine / dispatch+expert+combine of :class:`pcie_a2a.Buffer`
against the torch.distributed baselines (per-expert ``all_to_all_single`` and
all-gather + reduce-scatter), in the same process group and timing loop.

Defaults: a Kimi K2 decode step (hidden 7168, 384 experts, top-8, 128 tokens per rank) on
4 spawned CPU ranks (gloo), payloads bf16 and fp8, uniform routing. --backend cuda runs
Buffer(backend="cuda") on GPUs against NCCL baselines (a GPU per rank; where ranks share
a GPU only pcie_a2a runs). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from pcie_a2a.bench import arms, device, nodes
from pcie_a2a.bench.routing_spec import ROUTINGS, RoutingSpec, check_spec

PAYLOADS = ("bf16", "fp8")
MODES = ("normal", "low_latency")
DEFAULTS = {
    "tokens": "128",
    "hidden": 7168,
    "experts": 384,
    "topk": 8,
    "iters": 50,
    "warmup": 5,
    "max_seconds": 30.0,
}
QUICK = {
    "tokens": "4,32",
    "hidden": 256,
    "experts": 32,
    "topk": 4,
    "iters": 5,
    "warmup": 1,
    "max_seconds": 5.0,
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="benchmark dispatch/combine against baselines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = DEFAULTS
    p.add_argument(
        "--op",
        default="dispatch",
        choices=("dispatch", "allreduce"),
        help="dispatch (dispatch/combine, default) or allreduce (pcie_a2a.AllReduce vs "
        "NCCL/gloo all_reduce; docs/allreduce.md)",
    )
    p.add_argument(
        "--world", type=int, default=4, help="ranks to spawn (default 4; ignored under torchrun)"
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="split the ranks into N nodes of world/N (PCIE_A2A_LOCAL_WORLD_SIZE; CPU only): "
        "pcie_a2a runs through the multi-node Buffer, and the report adds the inter-node "
        "bytes of pcie_a2a and of the flat a2a (default 1)",
    )
    p.add_argument(
        "--backend",
        default="cpu",
        help="cpu (CPU transport, gloo baselines; default) or cuda (Buffer(backend='cuda') "
        "on GPU rank %% device_count, NCCL baselines when every rank has its own GPU)",
    )
    p.add_argument(
        "--tokens",
        help=f"tokens per rank, comma list (default {d['tokens']}; e.g. 1,16,128,512,4096)",
    )
    p.add_argument("--hidden", type=int, help=f"hidden size (default {d['hidden']})")
    p.add_argument("--experts", type=int, help=f"global experts (default {d['experts']})")
    p.add_argument("--topk", type=int, help=f"experts per token (default {d['topk']})")
    p.add_argument(
        "--payload",
        default="bf16,fp8",
        help="comma list of bf16, fp8 (default both; the baselines always move bf16)",
    )
    p.add_argument(
        "--routing",
        default="uniform",
        help=f"comma list of {', '.join(ROUTINGS)} (default uniform)",
    )
    p.add_argument(
        "--mode",
        default="normal",
        help="normal (dispatch/combine) or "
        "low_latency (low_latency_dispatch rows layout / low_latency_combine)",
    )
    p.add_argument(
        "--direction",
        default="auto",
        help="comma list of auto, push, pull (or all): besides pcie_a2a with the plan's "
        "per-pair directions (auto, always run), a pcie_a2a arm per forced direction "
        "(PCIE_A2A_DIRECTION) in the same loop; a direction the transport does not "
        "implement is reported as not run (default auto)",
    )
    p.add_argument(
        "--iters",
        type=int,
        help=f"timed iterations per config (default "
        f"{d['iters']}, fewer if --max-seconds is reached)",
    )
    p.add_argument("--warmup", type=int, help=f"untimed iterations (default {d['warmup']})")
    p.add_argument(
        "--max-seconds",
        type=float,
        help="cap on timed seconds per config, "
        f"estimated from the warmup; at least 5 iterations (default "
        f"{d['max_seconds']:.0f}; 0: no cap)",
    )
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent (default 1.0)")
    p.add_argument("--n-group", type=int, default=8, help="kimi routing: expert groups (8)")
    p.add_argument("--topk-group", type=int, default=4, help="kimi routing: groups per token (4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--json", help="JSON output (default bench_results/bench-<time>.json)")
    p.add_argument(
        "--plot", help="PNG output (default bench_results/bench-<time>.png; 'none' to skip)"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="whole-sweep deadline in s")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny shapes for tests (hidden 256, 32 experts, top-4, tokens 4,32, 5 iters)",
    )
    from pcie_a2a.bench import allreduce

    allreduce.add_options(p)
    p.set_defaults(func=main)
    return p


def _bad(option: str, got, allowed: str) -> SystemExit:
    print(f"pcie-a2a bench: error: {option}: got {got!r}; allowed: {allowed}", file=sys.stderr)
    return SystemExit(2)


def _list(option: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    for s in items:
        if s not in allowed:
            raise _bad(option, s, ", ".join(allowed))
    if not items:
        raise _bad(option, text, "a comma list of " + ", ".join(allowed))
    return list(dict.fromkeys(items))


def resolve(args: argparse.Namespace, world: int) -> dict:
    """Validated configuration passed to every rank (errors name the option)."""
    base = QUICK if args.quick else DEFAULTS
    val = {k: getattr(args, k) if getattr(args, k) is not None else base[k] for k in base}
    try:
        tokens = [int(s) for s in str(val["tokens"]).split(",") if s.strip()]
    except ValueError:
        raise _bad("--tokens", val["tokens"], "a comma list of positive ints") from None
    if not tokens or min(tokens) < 1:
        raise _bad("--tokens", val["tokens"], "a comma list of positive ints")
    for opt in ("hidden", "experts", "topk", "iters"):
        if val[opt] < 1:
            raise _bad(f"--{opt}", val[opt], "a positive int")
    if args.threads < 1:
        raise _bad("--threads", args.threads, "a positive int")
    if val["warmup"] < 0 or val["max_seconds"] < 0:
        raise _bad("--warmup/--max-seconds", (val["warmup"], val["max_seconds"]), ">= 0")
    if args.world < 1:
        raise _bad("--world", args.world, "a positive int")
    if val["experts"] % world:
        raise _bad("--experts", val["experts"], f"a multiple of the world size ({world})")
    if val["hidden"] % 8:
        raise _bad("--hidden", val["hidden"], "a multiple of 8")
    payloads = _list("--payload", args.payload, PAYLOADS)
    if "fp8" in payloads and val["hidden"] % 128:
        raise _bad("--hidden", val["hidden"], "a multiple of 128 with --payload fp8")
    if args.mode not in MODES:
        raise _bad("--mode", args.mode, ", ".join(MODES))
    if args.backend not in device.BACKENDS:
        raise _bad("--backend", args.backend, ", ".join(device.BACKENDS))
    why = nodes.why_not(args.nodes, world, args.backend)
    if why:
        print(f"pcie-a2a bench: error: {why}", file=sys.stderr)
        raise SystemExit(2)
    routings = _list("--routing", args.routing, ROUTINGS)
    for r in routings:
        why = check_spec(
            RoutingSpec(
                r,
                val["experts"],
                val["topk"],
                args.seed,
                args.zipf_s,
                args.n_group,
                args.topk_group,
            )
        )
        if why:
            print(f"pcie-a2a bench: error: {why}", file=sys.stderr)
            raise SystemExit(2)
    out = {"nodes": args.nodes} if args.nodes > 1 else {}
    return out | {
        "backend": args.backend,
        "tokens": sorted(set(tokens)),
        "payloads": payloads,
        "routings": routings,
        "hidden": val["hidden"],
        "experts": val["experts"],
        "topk": val["topk"],
        "mode": args.mode,
        "directions": arms.parse_directions(args.direction),
        "iters": val["iters"],
        "warmup": val["warmup"],
        "max_seconds": val["max_seconds"],
        "min_iters": min(5, val["iters"]),
        "seed": args.seed,
        "zipf_s": args.zipf_s,
        "n_group": args.n_group,
        "topk_group": args.topk_group,
        "threads": args.threads,
        "timeout": args.timeout,
        "pg_timeout": 300,
        "call_timeout": 120.0,
    }


def main(args: argparse.Namespace) -> int:
    if args.op == "allreduce":
        from pcie_a2a.bench import allreduce

        return allreduce.main(args)
    from pcie_a2a.bench import report, runner

    torchrun = runner.under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.world
    cfg = resolve(args, world)
    # ranks on this machine: the GPUs they share are this machine's
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun else world
    spec = device.run_spec_here(args.backend, local_world)
    cfg |= {
        "pg_backend": spec.pg_backend,
        "device_count": spec.device_count,
        "local_world": local_world,
        "baselines_na": spec.baselines_na,
    }
    js, png = report.outputs(args)
    error = None
    load_start = report.load()
    try:
        raw = runner.run(cfg, world)
    except runner.BenchError as exc:
        print(f"pcie-a2a bench: error: {exc}", file=sys.stderr)
        error, raw = str(exc), exc.partial
        if not raw["results"]:
            return 1
        print("pcie-a2a bench: reporting the configs that finished", file=sys.stderr)
    if raw is None:  # a torchrun rank other than 0
        return 0
    mach = report.machine(world, cfg["backend"], cfg["pg_backend"])
    mach["load_avg_1m_at_start"] = load_start
    raw.setdefault("baselines_na", cfg["baselines_na"])
    summary = report.summarize(raw)
    for line in report.machine_lines(mach, torchrun, cfg["baselines_na"]):
        print(line)
    print(
        f"shape: hidden {cfg['hidden']}, {cfg['experts']} experts, top-{cfg['topk']}, "
        f"mode {cfg['mode']}; ag_rs combine: {raw['ag_rs_reduce']}"
    )
    print(
        f"{report.expert_note(cfg['backend'])}; latency = slowest rank per iteration, p50/p99 over "
        "iterations; GB/s = wire bytes per rank / p50; vs X = X p50 / pcie_a2a p50"
    )
    print()
    print(report.table(summary))
    print()
    failed = report.checks(summary) + arms.checks(summary, report.TOLERANCE)
    for line in report.target_lines(summary) + arms.lines(summary) + failed:
        print(line)
    if cfg.get("nodes", 1) > 1:
        print()
        for line in nodes.lines(summary, cfg, world, torchrun):
            print(line)
    for name, why in _not_run(summary).items():
        print(f"pcie-a2a bench: {name}: not run: {why}", file=sys.stderr)
    doc = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": report.command(),
        "machine": mach,
        "config": cfg,
        "ag_rs_reduce": raw["ag_rs_reduce"],
        "expert": report.expert_note(cfg["backend"]),
        "results": summary,
    }
    if cfg.get("nodes", 1) > 1:
        n = cfg["nodes"]
        doc["nodes"] = {"count": n, "ranks_per_node": world // n, "simulated": not torchrun}
    if error:
        doc["error"] = error
    report.write_json(js, doc)
    print(f"\nJSON: {js}")
    if png is not None:
        why = report.plot(
            png,
            summary,
            f"pcie-a2a bench, world {world}, hidden "
            f"{cfg['hidden']}, {cfg['experts']} experts, top-{cfg['topk']}, "
            f"{_plot_machine(mach)}",
        )
        print(f"plot: {png}" if why is None else f"plot skipped: {why}")
    return 1 if error or failed else 0


def _not_run(summary: list[dict]) -> dict[str, str]:
    """The arms that did not run (a forced direction the transport lacks), once each."""
    out: dict[str, str] = {}
    for res in summary:
        for name, a in res.get("arms", {}).items():
            if "unavailable" in a:
                out.setdefault(name, a["unavailable"])
    return out


def _plot_machine(mach: dict) -> str:
    if mach["backend"] == "cuda":
        gpus = ", ".join(sorted(set(mach["gpus"])))
        return f"{mach['gpu_count']} x {gpus}, {mach['process_group']}"
    return f"{mach['cpu']} ({mach['cores']} cores), {mach['process_group']}"
