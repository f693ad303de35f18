"""``pcie-a2a bench --op allreduce``: pcie_a2a.AllReduce (one-shot and two-shot) against
``torch.distributed.all_reduce`` (NCCL with ``--backend cuda``, gloo on the CPU) in one
process group and one timing loop, sizes 1 KB to 4 MB per rank, worlds 2, 4 and 8, bf16 and
fp16, with and without the fused residual add; medians, the crossover, JSON and a plot.

The crossover of a (world, dtype, fused) group is the largest size up to which the better
of ours beats the baseline at every measured size; ``PCIE_A2A_ALLREDUCE_TABLE=<this JSON>``
makes AllReduce hand over there (pcie_a2a.allreduce.tuning). See docs/allreduce.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pcie_a2a.bench import device

KB = 1024
DEFAULTS = {
    "sizes": ",".join(str(KB << i) for i in range(13)),  # 1 KB .. 4 MB
    "worlds": "2,4,8",
    "dtypes": "bf16,fp16",
    "fused": "no,yes",
    "iters": 30,
    "warmup": 3,
    "inner": 10,
    "max_seconds": 10.0,
}
QUICK = {
    "sizes": f"{KB},{16 * KB},{64 * KB}",
    "worlds": "2",
    "dtypes": "bf16",
    "fused": "no,yes",
    "iters": 3,
    "warmup": 1,
    "inner": 2,
    "max_seconds": 5.0,
}


def add_options(p: argparse.ArgumentParser) -> None:
    """The options of ``--op allreduce`` (the dispatch bench ignores them)."""
    g = p.add_argument_group("--op allreduce")
    g.add_argument(
        "--sizes", help=f"bytes per rank, comma list (default 1 KB..4 MB: {DEFAULTS['sizes']})"
    )
    g.add_argument(
        "--worlds", help="comma list of world sizes, each spawned in turn (default 2,4,8)"
    )
    g.add_argument("--dtypes", help="comma list of bf16, fp16 (default both)")
    g.add_argument(
        "--fused",
        help="comma list of no, yes: without / with the fused residual add (default both)",
    )
    g.add_argument("--inner", type=int, help="calls per timed sample (default 10)")


def _bad(option: str, got, allowed: str) -> SystemExit:
    print(f"pcie-a2a bench: error: {option}: got {got!r}; allowed: {allowed}", file=sys.stderr)
    return SystemExit(2)


def _ints(option: str, text: str) -> list[int]:
    try:
        vals = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise _bad(option, text, "a comma list of positive ints") from None
    if not vals or min(vals) < 1:
        raise _bad(option, text, "a comma list of positive ints")
    return sorted(set(vals))


def _names(option: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    vals = [s.strip() for s in text.split(",") if s.strip()]
    if not vals or any(v not in allowed for v in vals):
        raise _bad(option, text, "a comma list of " + ", ".join(allowed))
    return list(dict.fromkeys(vals))


def resolve(args: argparse.Namespace, torchrun_world: int | None) -> dict:
    base = QUICK if args.quick else DEFAULTS
    val = {
        k: getattr(args, k, None) if getattr(args, k, None) is not None else base[k] for k in base
    }
    sizes = _ints("--sizes", str(val["sizes"]))
    if any(s % 16 for s in sizes):
        raise _bad("--sizes", val["sizes"], "byte counts that are multiples of 16")
    worlds = [torchrun_world] if torchrun_world else _ints("--worlds", str(val["worlds"]))
    if max(worlds) > 16:
        raise _bad("--worlds", val["worlds"], "world sizes up to 16")
    for opt in ("iters", "inner"):
        if val[opt] < 1:
            raise _bad(f"--{opt}", val[opt], "a positive int")
    if val["warmup"] < 0 or val["max_seconds"] < 0:
        raise _bad("--warmup/--max-seconds", (val["warmup"], val["max_seconds"]), ">= 0")
    if args.backend not in device.BACKENDS:
        raise _bad("--backend", args.backend, ", ".join(device.BACKENDS))
    return {
        "op": "allreduce",
        "backend": args.backend,
        "sizes": sizes,
        "worlds": worlds,
        "dtypes": _names("--dtypes", str(val["dtypes"]), ("bf16", "fp16")),
        "fused": [v == "yes" for v in _names("--fused", str(val["fused"]), ("no", "yes"))],
        "iters": val["iters"],
        "warmup": val["warmup"],
        "inner": val["inner"],
        "max_seconds": val["max_seconds"],
        "min_iters": min(3, val["iters"]),
        "seed": args.seed,
        "threads": args.threads,
        "timeout": args.timeout,
        "pg_timeout": 300,
        "call_timeout": 120.0,
        "sweep_module": "pcie_a2a.bench.allreduce_worker",
    }


# ---- results -------------------------------------------------------------------------------
def crossover(results: list[dict]) -> list[dict]:
    """Per (backend, world, dtype, fused): the largest size up to which ours (the better of
    one-shot and two-shot) beats the baseline at every size, and the largest size up to
    which one-shot is no slower than two-shot (what pcie_a2a.allreduce.tuning reads)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["world"], r["dtype"], r["fused"]), []).append(r)
    out = []
    for (world, dtype, fused), rows in sorted(groups.items()):
        rows = sorted(rows, key=lambda r: r["bytes"])
        ours_up_to, one_up_to, measured = 0, 0, True
        for r in rows:
            m = r["methods"]
            ours = min(m["one_shot"]["p50_us"], m["two_shot"]["p50_us"])
            if "unavailable" in m["baseline"]:
                measured = False
                break
            if ours <= m["baseline"]["p50_us"] and ours_up_to == _prev(rows, r):
                ours_up_to = r["bytes"]
        for r in rows:
            m = r["methods"]
            if m["one_shot"]["p50_us"] <= m["two_shot"]["p50_us"] and one_up_to == _prev(rows, r):
                one_up_to = r["bytes"]
        row = {
            "backend": rows[0]["backend"],
            "world": world,
            "dtype": {"bf16": "bfloat16", "fp16": "float16"}[dtype],
            "fused": fused,
            "one_shot_up_to_bytes": one_up_to,
            "largest_bytes": rows[-1]["bytes"],
        }
        if measured:
            row["ours_up_to_bytes"] = ours_up_to
        else:
            row["ours_up_to_bytes"] = None
            row["note"] = rows[0]["methods"]["baseline"]["unavailable"]
        out.append(row)
    return out


def _prev(rows: list[dict], r: dict) -> int:
    i = rows.index(r)
    return 0 if i == 0 else rows[i - 1]["bytes"]


def _size(b: int) -> str:
    return f"{b // (1 << 20)} MB" if b >= 1 << 20 and b % (1 << 20) == 0 else f"{b / KB:g} KB"


def table(results: list[dict]) -> str:
    head = (
        "world",
        "dtype",
        "fused",
        "size",
        "one-shot",
        "two-shot",
        "baseline",
        "best/base",
        "default route",
    )
    rows = []
    for r in sorted(results, key=lambda r: (r["world"], r["dtype"], r["fused"], r["bytes"])):
        m = r["methods"]
        base = m["baseline"].get("p50_us")
        best = min(m["one_shot"]["p50_us"], m["two_shot"]["p50_us"])
        rows.append((
            str(r["world"]), r["dtype"], "add" if r["fused"] else "-", _size(r["bytes"]),
            f"{m['one_shot']['p50_us']:.1f}", f"{m['two_shot']['p50_us']:.1f}",
            "n/a" if base is None else f"{base:.1f}",
            "-" if base is None else f"{base / max(best, 1e-9):.2f}x", r["default_route"],
        ))  # fmt: skip
    width = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, width)), "  ".join("-" * w for w in width)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, width)) for row in rows]
    return "\n".join(lines)


def checks(results: list[dict]) -> list[str]:
    bad = []
    for r in results:
        for name, m in r["methods"].items():
            if "unavailable" in m:
                continue
            limit = 0.0 if name != "baseline" else 0.02
            if not m["error"] <= limit:
                what = (
                    "not bit-exact"
                    if name != "baseline"
                    else f"max rel err {m['error']:.3g} > {limit}"
                )
                bad.append(
                    f"CHECK FAILED: world {r['world']} {r['dtype']} {r['bytes']} B fused={r['fused']} {name}: {what}"
                )
    return bad


def crossover_lines(cross: list[dict], backend: str) -> list[str]:
    base = "NCCL" if backend == "cuda" else "gloo"
    out = []
    for c in cross:
        head = (
            f"crossover world {c['world']} {c['dtype']} {'fused add' if c['fused'] else 'plain'}:"
        )
        if c["ours_up_to_bytes"] is None:
            out.append(
                f"{head} no baseline ({c['note']}); one-shot up to {_size(c['one_shot_up_to_bytes'])}"
            )
        elif c["ours_up_to_bytes"] == 0:
            out.append(f"{head} {base} is faster at every size measured")
        else:
            top = c.get("largest_bytes")
            ours = (
                f"ours faster at every size measured (to {_size(top)})"
                if c["ours_up_to_bytes"] == top
                else f"ours up to {_size(c['ours_up_to_bytes'])} (then {base})"
            )
            one = c["one_shot_up_to_bytes"]
            out.append(
                f"{head} {ours}; "
                + (f"one-shot up to {_size(one)}" if one else "two-shot from the smallest size")
            )
    return out


def plot(path: Path, results: list[dict], title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); pip install matplotlib"
    panels = sorted({(r["world"], r["dtype"]) for r in results})
    if not panels:
        return "no measured configs"
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, (world, dtype) in zip(axes.ravel(), panels):
        for fused, ls in ((False, "-"), (True, "--")):
            pts = sorted((r for r in results if (r["world"], r["dtype"], r["fused"]) == (world, dtype, fused)),
                         key=lambda r: r["bytes"])  # fmt: skip
            if not pts:
                continue
            for name, color in (("one_shot", "C0"), ("two_shot", "C1"), ("baseline", "C3")):
                ys = [r["methods"][name].get("p50_us") for r in pts]
                if None in ys:
                    continue
                label = f"{name}{' + add' if fused else ''}"
                ax.plot([r["bytes"] for r in pts], ys, ls=ls, marker="o", color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("p50 µs (slowest rank)")
        ax.set_title(f"world {world}, {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.ravel()[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(args: argparse.Namespace) -> int:
    import os

    from pcie_a2a.bench import report, runner

    torchrun = runner.under_torchrun()
    cfg = resolve(args, int(os.environ["WORLD_SIZE"]) if torchrun else None)
    js, png = report.outputs(args, "bench-allreduce")
    load_start = report.load()
    results, errors = [], []
    for world in cfg["worlds"]:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun else world
        spec = device.run_spec_here(cfg["backend"], local_world)
        wcfg = cfg | {
            "pg_backend": spec.pg_backend,
            "device_count": spec.device_count,
            "local_world": local_world,
            "baselines_na": spec.baselines_na,
        }
        try:
            raw = runner.run(wcfg, world)
        except runner.BenchError as exc:
            print(f"pcie-a2a bench: error: world {world}: {exc}", file=sys.stderr)
            errors.append(f"world {world}: {exc}")
            raw = exc.partial
        if raw is None:  # a torchrun rank other than 0
            return 0
        for r in raw["results"]:
            r["backend"] = cfg["backend"]
        results += raw["results"]
    if not results:
        return 1
    mach = report.machine(
        max(cfg["worlds"]), cfg["backend"], "nccl" if cfg["backend"] == "cuda" else "gloo"
    )
    mach["load_avg_1m_at_start"] = load_start
    for line in report.machine_lines(mach, torchrun, None):
        print(line)
    base = "NCCL all_reduce" if cfg["backend"] == "cuda" else "gloo all_reduce"
    print(
        f"all-reduce per rank; p50 µs of the slowest rank per iteration, {cfg['inner']} calls per "
        f"sample; baseline = {base} (+ x + residual when fused); best/base = baseline / the "
        "better of one-shot and two-shot; default route = what AllReduce picks by default"
    )
    print()
    print(table(results))
    print()
    cross = crossover(results)
    bad = checks(results)
    for line in crossover_lines(cross, cfg["backend"]) + bad:
        print(line)
    doc = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "op": "allreduce",
        "command": report.command(),
        "machine": mach,
        "config": cfg,
        "crossover": cross,
        "results": results,
    }
    if errors:
        doc["error"] = "; ".join(errors)
    report.write_json(js, doc)
    print(f"\nJSON: {js}")
    if png is not None:
        why = plot(
            png,
            results,
            f"pcie-a2a bench --op allreduce, backend {cfg['backend']}, {mach['cpu'] if cfg['backend'] == 'cpu' else mach.get('gpus')}",
        )
        print(f"plot: {png}" if why is None else f"plot skipped: {why}")
    return 1 if errors or bad else 0
