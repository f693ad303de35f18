"""The plan as text, as JSON (``pcie_a2a.configplan`` version 1) and as a PNG of tok/s
against concurrency per configuration (the style of ``pcie-a2a bench``'s plot)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import launch
from .api import PlanResult
from .predict import TERMS
from .run import CONCURRENCIES, Result
from .stacks import GIB, STACKS

FORMAT = "pcie_a2a.configplan"
VERSION = 1
_BREAKDOWN_AT = (1, 128)


def _table(head: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    width = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]

    def fmt(r: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, width))
        ).rstrip()

    return [fmt(head), "  ".join("-" * w for w in width), *(fmt(r) for r in rows)]


def _tok(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _chunks(p: PlanResult) -> dict[str, int]:
    return {
        fw: next(s for s in STACKS.values() if s.framework == fw).prefill_chunk(p.gpu)[0]
        for fw in ("sglang", "vllm")
    }


def commands(p: PlanResult, r: Result) -> dict[str, str]:
    model_id = p.model.hf_id or p.model.name
    return launch.commands(
        r.config, model_id, p.inputs.context, p.inputs.kv_dtype == "fp8", _chunks(p)
    )


def _model_line(p: PlanResult) -> str:
    m = p.model
    att = f"MLA {m.heads} heads" if m.attention == "mla" else f"GQA {m.heads}/{m.kv_heads} heads"
    shared = " (+1 shared)" if m.shared_intermediate else ""
    fmts = ", ".join(f"{part} {f.label}" for part, f in m.formats)
    return (
        f"{m.layers} layers ({m.moe_layers} MoE), hidden {m.hidden}, {att}, {m.experts} experts "
        f"top-{m.top_k}{shared}; {fmts}; {m.total_weight_bytes() / 1e9:.1f} GB of weights"
        + (f"; {m.extra_note}" if m.extra_note else "")
    )


def calibration_lines(stack) -> list[str]:
    fixed = "" if stack.fit_expert else " (fixed at 0, not fitted; see docs/plan.md)"
    lines = [
        f"stack {stack.name}: {stack.description}",
        f"  fitted on its {len(stack.points)} calibration numbers only (Kimi K2.6 INT4, 8x RTX "
        f"PRO 6000, context 0): layer_us = {stack.layer_us:.1f} µs per layer and step, "
        f"expert_us = {stack.expert_us:.1f} µs per expert GEMM{fixed}",
    ]
    for label, meas, pred in stack.residuals:
        lines.append(
            f"  residual  {label}: measured {meas:.1f}, model {pred:.1f} tok/s "
            f"({(pred / meas - 1) * 100:+.1f}%)"
        )
    return lines


def text(p: PlanResult) -> str:
    inp, g = p.inputs, p.gpu
    out = [
        f"pcie-a2a plan: {p.model.name} on {p.num_gpus} x {g.name} ({g.memory_gib:g} GiB, "
        f"{g.bandwidth_gbps:g} GB/s, PCIe Gen{g.pcie_gen})",
        f"  model: {_model_line(p)}",
        f"  {p.topology_note}"
        + (f"; pair numbers from {p.measured.probe_source}" if p.measured.probe else ""),
        f"  context {inp.context} tokens per request, KV cache {inp.kv_dtype}, routing: "
        f"{p.routing.source}"
        + (f", {inp.redundant} redundant expert slots" if inp.redundant else ""),
        "",
        *calibration_lines(p.stack),
        "",
    ]
    modelled = [r for r in p.results if r.modelled]
    head = ["configuration", "SGLang", "vLLM", "KV holds"]
    head += [f"C={c}" for c in CONCURRENCIES] + ["peak", "@C", "TPOT C=1", "TPOT C=128", "prefill"]
    rows = []
    for r in modelled:
        row = [
            r.config.name + ("" if r.runs else "  (x)"),
            "ok" if not r.reasons["sglang"] else "no",
            "ok" if not r.reasons["vllm"] else "no",
            str(r.memory.max_requests) if r.memory.fits else "OOM",
        ]
        row += [_tok(r.steps[c].tok_s) + ("*" if c > r.c_max else "") for c in CONCURRENCIES]
        row += [_tok(r.peak_tok_s) if r.peak_c else "-", str(r.peak_c) if r.peak_c else "-"]
        row += [f"{r.steps[1].tpot_us / 1e3:.1f} ms", f"{r.steps[128].tpot_us / 1e3:.1f} ms"]
        row += [_tok(r.prefill.tok_s) if r.prefill else "-"]
        rows.append(row)
    out.append(
        f"decode tok/s of the whole box at concurrency C (requests of {inp.context} tokens), "
        f"peak over C up to what the stack batches and the KV cache holds; prefill = tok/s of "
        f"one chunk; (x) = cannot run, shown for reference; * = more requests than the stack "
        "batches or the KV cache holds (they would queue)"
    )
    out += _table(head, rows)
    for c in _BREAKDOWN_AT:
        out += [
            "",
            f"decode step at C={c}, ms (attention, experts, shared expert, "
            "communication, imbalance, other = dense/router/embedding/LM head, overhead)",
        ]
        hb = ["configuration", *TERMS, "step", "TPOT"]
        rb = []
        for r in modelled:
            s = r.steps[c]
            rb.append(
                [
                    r.config.name,
                    *(f"{s.terms[t] / 1e3:.2f}" for t in TERMS),
                    f"{s.total_us / 1e3:.2f}",
                    f"{s.tpot_us / 1e3:.2f}",
                ]
            )
        out += _table(hb, rb)
    bad = [r for r in p.results if not r.runs]
    if bad:
        out += ["", "cannot run (configurations users try, with the reason):"]
        for r in bad:
            out.append(f"  {r.config.name}: {r.why_not()}")
    out += ["", *recommendation_lines(p)]
    out += ["", "where the numbers come from:", *provenance_lines(p)]
    if p.notes:
        out += ["", "notes:", *(f"  - {n}" for n in p.notes)]
    return "\n".join(out) + "\n"


def recommendation_lines(p: PlanResult) -> list[str]:
    rec = p.recommendation
    if rec.best is None:
        return [f"recommendation: none ({rec.note})"]
    b, lat = rec.best, rec.latency
    out = [
        f"recommendation (highest peak throughput): {b.config.name}: {b.peak_tok_s:.0f} tok/s at "
        f"C={b.peak_c}, {b.steps[1].tok_s:.1f} tok/s at C=1",
    ]
    if rec.note:
        out.append(f"  {rec.note}")
    if lat is not None and lat is not b:
        out.append(
            f"  lowest latency (C=1): {lat.config.name}: {lat.steps[1].tok_s:.1f} tok/s, "
            f"TPOT {lat.steps[1].tpot_us / 1e3:.1f} ms"
        )
    cmds = commands(p, b)
    for fw in ("sglang", "vllm"):
        if b.reasons[fw]:
            out.append(f"  {fw}: cannot launch it: {'; '.join(b.reasons[fw])}")
        else:
            out.append(f"  {fw}: {cmds[fw]}")
    ours = [r for r in p.results if r.runs and r.config.comm == "pcie_a2a"]
    if ours and b.config.comm != "pcie_a2a":
        o = max(ours, key=lambda r: r.peak_tok_s)
        cmd = commands(p, o)
        out.append(
            f"best with pcie_a2a: {o.config.name}: {o.peak_tok_s:.0f} tok/s peak "
            f"({o.peak_tok_s / b.peak_tok_s:.2f}x the recommendation), {o.steps[1].tok_s:.1f} at C=1"
        )
        for fw in ("sglang", "vllm"):
            if not o.reasons[fw]:
                out.append(f"  {fw}: {cmd[fw]}")
    if ours:
        out.append(
            "  pcie_a2a rows are predictions of its CUDA transport (topology planner) with the "
            "stack's CUDA-graph overhead; today's integrations need --disable-cuda-graph / "
            "--enforce-eager and stage tokens through host memory (docs/sglang.md, docs/vllm.md, "
            "known limits), which is not modelled; nothing of pcie_a2a has run on a GPU yet"
        )
    return out


def provenance_lines(p: PlanResult) -> list[str]:
    """Which numbers are measured, derived from measurements, or modelled, by term."""
    t = p.tables
    seen: dict[tuple[str, str], list[str]] = {}
    for r in p.results:
        for s in r.steps.values():
            for term, (kind, src) in s.sources.items():
                lst = seen.setdefault((kind, term), [])
                if src not in lst:
                    lst.append(src)
    out = []
    order = {k: i for i, k in enumerate(("measured", "predicted", "derived", "model", "none"))}
    for (kind, term), srcs in sorted(seen.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        more = f" (+{len(srcs) - 1} more)" if len(srcs) > 1 else ""
        out.append(f"  {kind:9s} {term}: {srcs[0]}{more}")
    out += [
        f"  model     compute terms: roofline on the GPU table ({p.gpu.source})",
        f"            memory efficiency {t.memory_efficiency:g} ({t.memory_efficiency_source}); "
        f"tensor efficiency {t.tensor_efficiency:g} ({t.tensor_efficiency_source})",
        f"            expert GEMM efficiency by rows per expert: {t.gemm_efficiency.source}",
        f"  fitted    overhead: {p.stack.name} layer_us, expert_us (above)",
        f"  model     weights: {p.model.source}",
    ]
    if t.overrides:
        out.append(f"  tables replaced from {t.overrides}")
    return out


# ---- JSON -----------------------------------------------------------------------------------


def _step_doc(s) -> dict[str, Any]:
    return {
        "concurrency": s.concurrency,
        "tok_s": s.tok_s,
        "tpot_ms": s.tpot_us / 1e3,
        "step_ms": s.total_us / 1e3,
        "terms_ms": {k: v / 1e3 for k, v in s.terms.items()},
        "micro_batches": s.micro_batches,
        "sources": {k: {"kind": kd, "source": src} for k, (kd, src) in s.sources.items()},
    }


def to_doc(p: PlanResult) -> dict[str, Any]:
    t = p.tables
    configs = []
    for r in p.results:
        c = r.config
        m = r.memory
        configs.append(
            {
                "name": c.name,
                "layout": {
                    "tp": c.tp,
                    "pp": c.pp,
                    "attn_dp": c.attn_dp,
                    "attn_tp": c.attn_tp,
                    "ep": c.ep,
                    "moe_tp": c.moe_tp,
                    "comm": c.comm,
                    "redundant": c.redundant,
                    "payload": c.payload,
                    "gpus": c.gpus,
                    "tried": c.tried,
                },
                "runs": r.runs,
                "frameworks": {
                    fw: {
                        "ok": not r.reasons[fw],
                        "reasons": r.reasons[fw],
                        "launch": commands(p, r)[fw] if not r.reasons[fw] else None,
                    }
                    for fw in ("sglang", "vllm")
                },
                "why_not": r.why_not(),
                "memory": {
                    "fits": m.fits,
                    "weights_gib": m.weights / GIB,
                    "buffers_gib": m.buffers / GIB,
                    "activations_gib": m.activations / GIB,
                    "budget_gib": m.budget / GIB,
                    "budget": m.budget_note,
                    "kv_free_gib": m.kv_free / GIB,
                    "kv_per_request_gib": m.kv_per_request / GIB,
                    "max_requests": m.max_requests,
                },
                "decode": {str(k): _step_doc(s) for k, s in r.steps.items()} or None,
                "peak": {"concurrency": r.peak_c, "tok_s": r.peak_tok_s} if r.modelled else None,
                "max_concurrency": r.c_max,
                "curve": [[c_, v] for c_, v in r.curve],
                "prefill": (
                    {"chunk": r.prefill_chunk, **_step_doc(r.prefill)} if r.prefill else None
                ),
            }
        )
    rec = p.recommendation
    s = p.stack
    return {
        "format": FORMAT,
        "version": VERSION,
        "inputs": {k: getattr(p.inputs, k) for k in p.inputs.__dataclass_fields__},
        "model": {
            "name": p.model.name,
            "hf_id": p.model.hf_id,
            "source": p.model.source,
            "layers": p.model.layers,
            "moe_layers": p.model.moe_layers,
            "weight_bytes": p.model.total_weight_bytes(),
            "formats": {k: f.label for k, f in p.model.formats},
        },
        "gpu": {
            "key": p.gpu.key,
            "name": p.gpu.name,
            "memory_gib": p.gpu.memory_gib,
            "bandwidth_gbps": p.gpu.bandwidth_gbps,
            "tflops": dict(p.gpu.tflops),
            "pcie_gen": p.gpu.pcie_gen,
            "source": p.gpu.source,
        },
        "num_gpus": p.num_gpus,
        "topology": p.topology_note,
        "probe": p.measured.probe_source or None,
        "routing": p.routing.source,
        "stack": {
            "name": s.name,
            "framework": s.framework,
            "description": s.description,
            "fitted": {"layer_us": s.layer_us, "expert_us": s.expert_us},
            "expert_us_fitted": s.fit_expert,
            "calibration": [
                {"point": lab, "measured_tok_s": m, "model_tok_s": pr, "residual": pr / m - 1}
                for lab, m, pr in s.residuals
            ],
            "sources": sorted({pt.source for pt in s.points}),
        },
        "constants": {
            "memory_efficiency": [t.memory_efficiency, t.memory_efficiency_source],
            "tensor_efficiency": [t.tensor_efficiency, t.tensor_efficiency_source],
            "gemm_efficiency": [
                list(map(list, t.gemm_efficiency.points)),
                t.gemm_efficiency.source,
            ],
            "activation_passes": [t.activation_passes, t.activation_passes_source],
            "pcie_a2a_call_us": [t.pcie_a2a_call_us, t.pcie_a2a_call_source],
            "custom_ar_max_bytes": [t.custom_ar_max_bytes, t.custom_ar_max_source],
            "tuned_nccl_busbw_gbps": [t.tuned_nccl_busbw_gbps, t.tuned_nccl_source],
            "pp_send_floor_us": [t.pp_send_floor_us, t.pp_send_floor_source],
            "nccl8": {op: [list(map(list, c.points)), c.source] for op, c in t.nccl8.items()},
            "custom_ar8": [list(map(list, t.custom_ar8.points)), t.custom_ar8.source],
        },
        "configurations": configs,
        "recommendation": {
            "throughput": rec.best.config.name if rec.best else None,
            "latency": rec.latency.config.name if rec.latency else None,
            "ties": [r.config.name for r in rec.ties],
            "note": rec.note,
            "launch": commands(p, rec.best) if rec.best else None,
        },
        "notes": list(p.notes),
    }


def to_json(p: PlanResult) -> str:
    return json.dumps(to_doc(p), indent=1) + "\n"


def plot(path: Path, p: PlanResult) -> str | None:
    """Writes a PNG (tok/s vs concurrency per configuration); returns why not, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); pip install matplotlib"
    shown = [r for r in p.results if r.curve]
    if not shown:
        return "no configuration has a curve"
    fig, ax = plt.subplots(figsize=(10, 6.5))
    colors = plt.get_cmap("tab20")
    style = {"tp": "-", "allreduce": "--", "ag-rs": "-.", "a2a-nccl": ":", "pcie_a2a": "-"}
    for i, r in enumerate(shown):
        xs, ys = zip(*r.curve)
        ax.plot(
            xs,
            ys,
            marker="o" if r.config.comm == "pcie_a2a" else ".",
            ls=style[r.config.comm],
            color=colors(i % 20),
            alpha=1.0 if r.runs else 0.35,
            label=r.config.name + ("" if r.runs else " (cannot run)"),
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"concurrency (requests of {p.inputs.context} tokens)")
    ax.set_ylabel("predicted decode tok/s (whole box)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(
        f"pcie-a2a plan: {p.model.name} on {p.num_gpus} x {p.gpu.name}, stack {p.stack.name}",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
