"""Turns raw per-iteration stamps into statistics, the printed table, JSON and a plot."""

from __future__ import annotations

import contextlib
import json
import os
import platform
from pathlib import Path

import numpy as np
import torch

PHASES = ("dispatch", "combine", "disp+comb", "d+e+c")
BASELINES = ("a2a", "ag_rs")
OURS = "pcie_a2a"
# largest acceptable max|out - expected| / max|expected| per payload of ours (baselines: bf16)
TOLERANCE = {"bf16": 0.02, "fp8": 0.15}
EXPERT_NOTE = (
    "expert = pcie_a2a.reference.scale_expert (a cheap stand-in: real Kimi-sized "
    "bf16 experts do not fit on a CPU box)"
)


def machine(world: int) -> dict:
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
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gib": None if mem is None else round(mem, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": "gloo (CPU)",
        "world": world,
        "os": platform.platform(),
        "load_avg_1m_at_end": load(),
    }


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
        ours = methods[OURS]["phases"]
        for base in BASELINES:
            methods[OURS].setdefault("speedup", {})[f"vs_{base}"] = {
                ph: methods[base]["phases"][ph]["p50_us"] / max(ours[ph]["p50_us"], 1e-9)
                for ph in PHASES
            }
        out.append(
            {k: res[k] for k in ("tokens", "payload", "routing", "iters", "ranks_per_token")}
            | {"methods": methods}
        )
    return out


def _mb(b: float) -> str:
    return f"{b / 1e6:.3g}"


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
            rows.append(
                (
                    str(res["tokens"]),
                    res["payload"],
                    res["routing"],
                    "SKIPPED",
                    res["skipped"],
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                )
            )
            continue
        for name, m in res["methods"].items():
            for ph, s in m["phases"].items():
                sp = m.get("speedup")
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
                        f"{sp['vs_a2a'][ph]:.2f}x" if sp else "-",
                        f"{sp['vs_ag_rs'][ph]:.2f}x" if sp else "-",
                    )
                )
    real = [r for r in rows if r is not None and r[3] != "SKIPPED"]
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
        elif r[3] == "SKIPPED":
            lines.append("  ".join(r[:4]) + ": " + r[4])
        else:
            lines.append(fmt(r))
    return "\n".join(lines)


def checks(summary: list[dict]) -> list[str]:
    """Lines for outputs that disagree with the expected result (empty when all agree)."""
    bad = []
    for res in summary:
        for name, m in res.get("methods", {}).items():
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
            base = res["methods"]["a2a"]["phases"]["disp+comb"]["p50_us"]
            ratio = base / max(ours, 1e-9)
            out.append(
                f"tokens={res['tokens']:<5} payload={res['payload']:<4} "
                f"routing={res['routing']:<7}: dispatch+combine p50 {ours:.0f} µs vs "
                f"a2a {base:.0f} µs = {ratio:.3f}x "
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
        for name in res["methods"]:
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
