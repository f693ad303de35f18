"""Turns raw per-iteration stamps into statistics, the printed table, JSON and a plot."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from pcie_a2a.bench import arms

PHASES = ("dispatch", "combine", "disp+comb", "d+e+c")
BASELINES = ("a2a", "ag_rs")
OURS = "pcie_a2a"
# largest acceptable max|out - expected| / max|expected| per payload of ours (baselines: bf16)
TOLERANCE = {"bf16": 0.02, "fp8": 0.15}
EXPERT_NOTE = (
    "expert = pcie_a2a.reference.scale_expert (a cheap stand-in: real Kimi-sized "
    "bf16 experts do not fit on a CPU box)"
)
EXPERT_NOTE_GPU = (
    "expert = pcie_a2a.reference.scale_expert on the rank's GPU (a cheap stand-in for "
    "real experts, the same as in CPU runs)"
)


def expert_note(backend: str) -> str:
    return EXPERT_NOTE_GPU if backend == "cuda" else EXPERT_NOTE


def machine(world: int, backend: str = "cpu", pg_backend: str = "gloo") -> dict:
    """The box, torch, and with ``backend == "cuda"`` the GPUs and CUDA/NCCL versions."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    mem = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    out = {
        "cpu": model,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gib": None if mem is None else round(mem, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": backend,
        "process_group": pg_backend,
        "world": world,
        "os": platform.platform(),
        "load_avg_1m_at_end": load(),
    }
    if backend == "cuda":
        from pcie_a2a.bench.device import gpu_info

        out |= gpu_info()
    return out


def machine_lines(mach: dict, torchrun: bool, baselines_na: str | None) -> list[str]:
    """The header lines that state the machine (the GPU line only with --backend cuda)."""
    lines = [
        f"machine: {mach['cpu']}, {mach['cores']} cores ({mach['usable_cores']} usable), "
        f"{mach['memory_gib']} GiB, torch {mach['torch']}, backend {mach['backend']}, "
        f"process group {mach['process_group']}, world {mach['world']}"
        f"{' (torchrun)' if torchrun else ''}; load avg (1 min) "
        f"{mach['load_avg_1m_at_start']} at start, {mach['load_avg_1m_at_end']} at end"
    ]
    if mach["backend"] == "cuda":
        names = Counter(mach["gpus"])
        gpus = ", ".join(f"{n} x {name}" for name, n in names.items()) or "none"
        lines.append(
            f"gpus: {mach['gpu_count']} visible ({gpus}); CUDA {mach['cuda']}, "
            f"NCCL {mach['nccl']}; ranks use GPU rank % {mach['gpu_count']}"
        )
    if baselines_na:
        lines.append(f"baselines a2a, ag_rs: {baselines_na}; no speedups")
    return lines


def load() -> float | None:
    """1-minute load average (other work on the box skews the numbers)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def summarize(raw: dict) -> list[dict]:
    """Per config and method: p50/p99/mean µs, wire bytes and GB/s per phase, speedups."""
    out = []
    for res in raw["results"]:
        if "skipped" in res:
            out.append(dict(res))
            continue
        methods = {}
        for name, m in res["methods"].items():
            ns = np.asarray(m["ns"], dtype=np.float64).reshape(-1, len(PHASES))
            d_bytes, c_bytes = m["wire_bytes"]
            wire = {
                "dispatch": d_bytes,
                "combine": c_bytes,
                "disp+comb": d_bytes + c_bytes,
                "d+e+c": d_bytes + c_bytes,
            }
            phases = {}
            for i, ph in enumerate(PHASES):
                us = ns[:, i] / 1e3
                p50 = float(np.percentile(us, 50))
                phases[ph] = {
                    "p50_us": p50,
                    "p99_us": float(np.percentile(us, 99)),
                    "mean_us": float(us.mean()),
                    "wire_bytes": wire[ph],
                    "gbps": wire[ph] / (p50 * 1e3) if p50 > 0 else 0.0,
                    "samples_us": [round(float(v), 2) for v in us],
                }
            methods[name] = {"max_rel_err": m["max_rel_err"], "phases": phases}
        # the --direction arms and ar_ep go to "arms" (bench/arms.py), ratios to ours
        extra = {n: methods.pop(n) for n in list(methods) if n not in (OURS, *BASELINES)}
        ours = methods[OURS]["phases"]
        for base in BASELINES:
            if base not in methods:  # did not run (ranks share a GPU): say so, no ratio
                methods[base] = {"unavailable": raw.get("baselines_na") or "did not run"}
                continue
            methods[OURS].setdefault("speedup", {})[f"vs_{base}"] = {
                ph: methods[base]["phases"][ph]["p50_us"] / max(ours[ph]["p50_us"], 1e-9)
                for ph in PHASES
            }
        entry = {k: res[k] for k in ("tokens", "payload", "routing", "iters", "ranks_per_token")}
        entry["methods"] = methods
        if "internode" in res:  # --nodes N (bench/nodes.py)
            entry["internode"] = res["internode"]
        unavailable = res.get("unavailable_arms", {})
        if extra or unavailable:
            entry["arms"] = arms.summarize(ours, extra, unavailable)
        out.append(entry)
    return out


def _mb(b: float) -> str:
    return f"{b / 1e6:.3g}"


def _note_row(res: dict, method: str, text: str) -> tuple:
    """A table row carrying text instead of numbers (from the ``phase`` column on)."""
    return (str(res["tokens"]), res["payload"], res["routing"], method, text, *[""] * 6)


def table(summary: list[dict]) -> str:
    head = (
        "tokens",
        "payload",
        "routing",
        "method",
        "phase",
        "p50 µs",
        "p99 µs",
        "GB/s",
        "wire MB/rank",
        "vs a2a",
        "vs ag_rs",
    )
    rows = []
    for res in summary:
        if rows:
            rows.append(None)
        if "skipped" in res:
            rows.append(_note_row(res, "SKIPPED", res["skipped"]))
            continue
        for name, m in res["methods"].items():
            if "unavailable" in m:
                rows.append(_note_row(res, name, m["unavailable"]))
                continue
            for ph, s in m["phases"].items():
                sp = m.get("speedup", {})  # absent for the baselines, or with no baselines
                rows.append(
                    (
                        str(res["tokens"]),
                        res["payload"],
                        res["routing"],
                        name,
                        ph,
                        f"{s['p50_us']:.0f}",
                        f"{s['p99_us']:.0f}",
                        f"{s['gbps']:.2f}",
                        _mb(s["wire_bytes"]),
                        f"{sp['vs_a2a'][ph]:.2f}x" if "vs_a2a" in sp else "-",
                        f"{sp['vs_ag_rs'][ph]:.2f}x" if "vs_ag_rs" in sp else "-",
                    )
                )
    real = [r for r in rows if r is not None and r[5]]  # measured rows set the widths
    width = [max([len(h)] + [len(r[i]) for r in real]) for i, h in enumerate(head)]
    left = 5  # text columns are left-aligned, numbers right-aligned

    def fmt(r):
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, width, strict=True))
        ).rstrip()

    lines = [fmt(head), "  ".join("-" * w for w in width)]
    for r in rows:
        if r is None:
            lines.append("")
        elif not r[5]:  # SKIPPED config, or a baseline that did not run: text from "phase"
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:4], width)) + "  " + r[4])
        else:
            lines.append(fmt(r))
    return "\n".join(lines)


def checks(summary: list[dict]) -> list[str]:
    """Lines for outputs that disagree with the expected result (empty when all agree)."""
    bad = []
    for res in summary:
        for name, m in res.get("methods", {}).items():
            if "unavailable" in m:
                continue
            tol = TOLERANCE[res["payload"]] if name == OURS else TOLERANCE["bf16"]
            if not m["max_rel_err"] <= tol:
                bad.append(
                    f"CHECK FAILED: tokens={res['tokens']} payload={res['payload']} "
                    f"routing={res['routing']} {name}: max rel err "
                    f"{m['max_rel_err']:.3g} > {tol}"
                )
    return bad


def target_lines(summary: list[dict]) -> list[str]:
    out = []
    for res in summary:
        if "methods" in res:
            ours = res["methods"][OURS]["phases"]["disp+comb"]["p50_us"]
            head = (
                f"tokens={res['tokens']:<5} payload={res['payload']:<4} "
                f"routing={res['routing']:<7}: dispatch+combine p50 {ours:.0f} µs"
            )
            a2a = res["methods"]["a2a"]
            if "unavailable" in a2a:
                out.append(f"{head}; a2a {a2a['unavailable']} (no ratio)")
                continue
            base = a2a["phases"]["disp+comb"]["p50_us"]
            ratio = base / max(ours, 1e-9)
            out.append(
                f"{head} vs a2a {base:.0f} µs = {ratio:.3f}x "
                f"({'meets' if ratio >= 2 else 'misses'} the 2x target)"
            )
    return out


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def plot(path: Path, summary: list[dict], title: str) -> str | None:
    """Writes a PNG (p50 vs tokens per phase); returns why it was skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); pip install matplotlib"
    done = [r for r in summary if "methods" in r]
    if not done:
        return "no measured configs"
    lines: dict[tuple, list] = {}
    first_payload = done[0]["payload"]
    for res in done:
        for name, m in res["methods"].items():
            if "unavailable" in m:
                continue
            if name != OURS and res["payload"] != first_payload:
                continue  # baselines are bf16 whatever our payload: plot them once
            label = f"{name} {res['payload']}" if name == OURS else name
            lines.setdefault((label, res["routing"]), []).append(res)
    labels = sorted({label for label, _ in lines})
    color = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    style = {"uniform": "-", "zipf": "--", "kimi": ":"}
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    axes = axes.ravel()
    for ax, ph in zip(axes, PHASES, strict=True):
        for (label, routing), pts in sorted(lines.items()):
            pts = sorted(pts, key=lambda r: r["tokens"])
            key = label.split()[0]
            ax.plot(
                [r["tokens"] for r in pts],
                [r["methods"][key]["phases"][ph]["p50_us"] for r in pts],
                marker="o" if key == OURS else "s",
                color=color[label],
                ls=style.get(routing, "-"),
                label=f"{label} ({routing})",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("p50 µs (slowest rank)")
        ax.set_title(ph)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def outputs(args, stem: str = "bench") -> tuple[Path, Path | None]:
    """The JSON and PNG paths (--json/--plot, else bench_results/<stem>-<time>.*)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    js = Path(args.json) if args.json else Path("bench_results") / f"{stem}-{stamp}.json"
    if args.plot and args.plot.lower() == "none":
        return js, None
    return js, Path(args.plot) if args.plot else Path("bench_results") / f"{stem}-{stamp}.png"


def command() -> str:
    argv = sys.argv[1:]
    if "bench" in argv:  # pcie-a2a bench ..., python -m pcie_a2a bench ...
        argv = argv[argv.index("bench") + 1 :]
    return " ".join(["pcie-a2a", "bench", *(shlex.quote(a) for a in argv)])
