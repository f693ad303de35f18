"""The plan as text, as JSON (``pcie_a2a.configplan`` version 1) and as a PNG of tok/s
against concurrency per configuration (the style of ``pcie-a2a bench``'s plot)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import launch
from .api import PlanResult
from .comm import link_gbps
from .nodes import multinode_flags
from .predict import TERMS
from .run import CONCURRENCIES, Result, under_cap
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


def commands(p: PlanResult, r: Result, kv_dtype: str | None = None) -> dict[str, str]:
    model_id = p.model.hf_id or p.model.name
    kv = kv_dtype or p.inputs.kv_dtype
    return launch.commands(r.config, model_id, p.max_model_len, kv == "fp8", _chunks(p), p.stack)


def _band(p: PlanResult, v: float, unit: str = "tok/s") -> str:
    """A predicted figure with its band (the stack's leave-one-out range)."""
    lo, hi = p.stack.band
    return f"{_tok(v)} {unit} (predicted; {_tok(v * lo)}-{_tok(v * hi)})"


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
    lo, hi = stack.band
    lines = [f"stack {stack.name}: {stack.description}"]
    for part in stack.parts():
        lines.append(f"  part {part.name}: {part.value}: {part.cost}")
    if stack.like:
        lines.append(f"  host costs and band: those of {stack.like} (this stack has no numbers)")
    else:
        lines.append(
            f"  fitted on its {len(stack.points)} calibration numbers only (Kimi K2.6 INT4, 8x "
            f"RTX PRO 6000, context 0): step_us = {stack.step_us:.0f} µs per forward pass, "
            f"request_us = {stack.request_us:.1f} µs per request"
        )
    for label, meas, pred in stack.residuals:
        lines.append(
            f"  in-sample {label}: measured {meas:.1f}, fitted model {pred:.1f} tok/s "
            f"({(pred / meas - 1) * 100:+.1f}%)"
        )
    for label, meas, pred in stack.loo:
        lines.append(
            f"  held out  {label}: measured {meas:.1f}, predicted without it {pred:.1f} tok/s "
            f"({(pred / meas - 1) * 100:+.1f}%)"
        )
    lines.append(
        f"  band on every predicted figure: x{lo:.2f} to x{hi:.2f} (the measured values "
        "relative to the leave-one-out predictions)"
    )
    for n in stack.notes:
        lines.append(f"  note: {n}")
    return lines


def text(p: PlanResult) -> str:
    inp, g = p.inputs, p.gpu
    out = [
        f"pcie-a2a plan: {p.model.name} on {p.num_gpus} x {g.name} ({g.memory_gib:g} GiB, "
        f"{g.bandwidth_gbps:g} GB/s, PCIe Gen{g.pcie_gen}); every throughput and time below "
        "is predicted",
        *(f"  assumed: {a}" for a in p.assumed),
        f"  model: {_model_line(p)}",
        f"  {p.topology_note}"
        + (f"; pair numbers from {p.measured.probe_source}" if p.measured.probe else ""),
        f"  context {inp.context} + output {inp.output} tokens per request (decode reads "
        f"{p.env.context} on average, holds {p.max_model_len}), KV cache {inp.kv_dtype}, "
        f"TPOT cap {inp.max_tpot_ms:g} ms, routing: {p.routing.source}"
        + (f", {inp.redundant} redundant expert slots" if inp.redundant else ""),
        "",
        *calibration_lines(p.stack),
        "",
    ]
    modelled = [r for r in p.results if r.modelled]
    head = ["configuration", "SGLang", "vLLM", "KV holds"]
    head += [f"C={c}" for c in CONCURRENCIES] + ["peak", "@C", "TPOT C=1", "TPOT C=128"]
    head += [f"TPOT<={inp.max_tpot_ms:g}ms", "@C", "prefill"]
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
        cc, ct = under_cap(r, inp.max_tpot_ms)
        row += [_tok(ct) if cc else "-", str(cc) if cc else "-"]
        row += [_tok(r.prefill.tok_s) if r.prefill else "-"]
        rows.append(row)
    lo, hi = p.stack.band
    out.append(
        f"predicted decode tok/s of the whole box at concurrency C, each figure with a band "
        f"of x{lo:.2f}..x{hi:.2f} (held-out residuals above); peak over C up to what the stack "
        f"batches and the KV cache holds; TPOT<={inp.max_tpot_ms:g}ms = the best C whose time "
        "per output token stays under the cap; prefill = tok/s of one chunk; (x) = cannot "
        "run, shown for reference; * = more requests than the stack batches or the KV cache "
        "holds (they would queue)"
    )
    out += _table(head, rows)
    for c in _BREAKDOWN_AT:
        out += [
            "",
            f"predicted decode step at C={c}, ms (attention, experts, shared expert, "
            "communication, imbalance, other = dense/router/embedding/LM head, launch = "
            "kernels x launch gap, framework = host time per forward pass and request; "
            "bubble = the average pipeline stage's idle time)",
        ]
        hb = ["configuration", *TERMS, "bubble", "step", "TPOT"]
        rb = []
        for r in modelled:
            s = r.steps[c]
            rb.append(
                [
                    r.config.name,
                    *(f"{s.terms[t] / 1e3:.2f}" for t in TERMS),
                    f"{s.bubble_us / 1e3:.2f}",
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
    if p.asked is not None:
        out += ["", *asked_lines(p)]
    out += ["", *recommendation_lines(p)]
    if p.nodes is not None:
        out += ["", *nodes_lines(p)]
    out += ["", "where the numbers come from:", *provenance_lines(p)]
    if p.notes:
        out += ["", "notes:", *(f"  - {n}" for n in p.notes)]
    return "\n".join(out) + "\n"


def _launch_lines(p: PlanResult, r: Result, kv_dtype: str | None = None) -> list[str]:
    cmds = commands(p, r, kv_dtype)
    out = []
    for fw in ("sglang", "vllm"):
        if r.reasons[fw]:
            out.append(f"  {fw}: cannot launch it: {'; '.join(r.reasons[fw])}")
        else:
            out.append(f"  {fw}: {cmds[fw]}")
    return out


def recommendation_lines(p: PlanResult) -> list[str]:
    rec = p.recommendation
    cap = rec.cap_ms
    out: list[str] = []
    if rec.best is None:
        out.append(f"throughput recommendation: none ({rec.note})")
    else:
        b = rec.best
        c, tok = under_cap(b, cap)
        out.append(
            f"throughput recommendation (TPOT <= {cap:g} ms): {b.config.name}: "
            f"{_band(p, tok)} at C={c}, TPOT {c / tok * 1e3:.1f} ms"
        )
        if rec.note:
            out.append(f"  {rec.note}")
        out += _launch_lines(p, b)
    lat = rec.latency
    if lat is not None:
        s1 = lat.steps[1]
        out.append(
            f"latency choice (lowest TPOT at C=1): {lat.config.name}: "
            f"{_band(p, s1.tpot_us / 1e3, 'ms')} per output token, {_tok(s1.tok_s)} tok/s"
        )
        if rec.latency_ties:
            names = ", ".join(
                f"{r.config.name} {r.steps[1].tpot_us / 1e3:.1f} ms" for r in rec.latency_ties[:6]
            )
            out.append(f"  a tie (inside its band, the model cannot rank them): {names}")
        out += _launch_lines(p, lat)
    b = rec.best
    ours = [r for r in p.results if r.runs and r.config.comm == "pcie_a2a"]
    if ours and b is not None and b.config.comm != "pcie_a2a":
        o = max(ours, key=lambda r: under_cap(r, cap)[1])
        oc, ot = under_cap(o, cap)
        bt = under_cap(b, cap)[1]
        if oc:
            out.append(
                f"best with pcie_a2a: {o.config.name}: {_band(p, ot)} at C={oc} under the cap "
                f"({ot / bt:.2f}x the recommendation), {_tok(o.steps[1].tok_s)} at C=1"
            )
            out += _launch_lines(p, o)
    if ours:
        out.append(
            "  pcie_a2a rows are predictions of its CUDA transport (topology planner), run eager "
            "as their launch lines are (--disable-cuda-graph / --enforce-eager); today's "
            "integrations also stage tokens through host memory (docs/sglang.md, docs/vllm.md), "
            "which is not modelled; nothing of pcie_a2a has run on a GPU yet"
        )
    return out


def node_commands(p: PlanResult, r: Result) -> dict[str, str]:
    """A configuration spanning the nodes: each node's line (NODE_RANK 0..N-1)."""
    n = p.nodes.nodes
    return {fw: f"{line} {multinode_flags(fw, n)}" for fw, line in commands(p, r).items()}


def nodes_lines(p: PlanResult) -> list[str]:
    """The ``--nodes N --nic SPEC`` section: the inter-node hop, its bytes per MoE layer,
    the configurations that span the nodes (or why not) and N boxes side by side."""
    q = p.nodes
    t = p.tables
    cap = p.inputs.max_tpot_ms
    out = [
        f"across {q.nodes} nodes (--nodes {q.nodes} --nic {q.nic.spec}): {q.gpus} x "
        f"{p.gpu.name}, {q.per_node} per node; every figure below is predicted",
        *(f"  assumed: {a}" for a in q.assumed),
        f"  NIC: {q.gbps:.1f} GB/s per node and direction ({q.gbps_kind}: {q.gbps_source})",
        f"  NCCL round across nodes: {t.internode_latency_us:g} µs ({t.internode_latency_source})",
        "",
        "bytes of one MoE layer per decode step leaving the busiest node, per exchange "
        "(multi-node Buffer: a row per (token, other node) out, "
        f"{p.model.hidden * 4:,} B fp32 back, 16 B header per peer; flat: a bf16 row per "
        "(token, expert) each way, or pcie_a2a's row per (token, rank)), and their times in µs "
        "(hop = NCCL rounds + wire + host bounce; node = the node's own exchange)",
    ]
    head = ["C", "tokens/rank", "nodes/token", "dispatch B", "combine B", "flat/expert B"]
    head += ["flat/rank B", "hop disp", "hop comb", "node", "layer", "flat/expert", "flat/rank"]
    rows = []
    for lt in q.traffic:
        d, c = lt.dispatch_hop, lt.combine_hop
        rows.append(
            [
                str(lt.concurrency),
                str(lt.tokens_per_rank),
                f"{lt.node_rows:.3f}",
                f"{lt.dispatch_bytes:,.0f}",
                f"{lt.combine_bytes:,.0f}",
                f"{lt.flat_expert_bytes:,.0f}",
                f"{sum(lt.flat_rank_bytes):,.0f}",
                f"{d.latency_us:.0f}+{d.wire_us:.1f}+{d.bounce_us:.1f}",
                f"{c.latency_us:.0f}+{c.wire_us:.1f}+{c.bounce_us:.1f}",
                f"{lt.intra_us:.1f}",
                f"{lt.layer_us:.1f}",
                f"{lt.flat_expert_hop_us:.1f}",
                f"{lt.flat_rank_hop_us:.1f}",
            ]
        )
    if not q.traffic:
        rows = []
        out.append(
            f"  none: {p.model.experts} experts do not split over {q.gpus} EP ranks (no EP across "
            "the nodes)"
        )
    else:
        out += _table(head, rows)
        out.append(
            "  (layer = both hops + the node's exchange + 2 pcie_a2a calls; the flat columns are "
            "their inter-node hops only, both ways, one NCCL round each)"
        )
    out += [
        "",
        f"configurations spanning the {q.nodes} nodes: predicted decode tok/s of all "
        f"{q.gpus} GPUs (band x{p.stack.band[0]:.2f}..x{p.stack.band[1]:.2f}); (x) = cannot "
        "run today, shown for reference",
    ]
    head = ["configuration", "SGLang", "vLLM", "KV holds"]
    head += [f"C={c}" for c in CONCURRENCIES] + ["TPOT C=1", f"TPOT<={cap:g}ms", "@C"]
    rows = []
    for r in q.results:
        if not r.modelled:
            continue
        cc, ct = under_cap(r, cap)
        rows.append(
            [
                r.config.name + ("" if r.runs else "  (x)"),
                "ok" if not r.reasons["sglang"] else "no",
                "ok" if not r.reasons["vllm"] else "no",
                str(r.memory.max_requests) if r.memory.fits else "OOM",
                *(_tok(r.steps[c].tok_s) + ("*" if c > r.c_max else "") for c in CONCURRENCIES),
                f"{r.steps[1].tpot_us / 1e3:.1f} ms",
                _tok(ct) if cc else "-",
                str(cc) if cc else "-",
            ]
        )
    out += _table(head, rows)
    out += ["", "cannot run across nodes:"]
    for r in q.results:
        if not r.runs:
            out.append(f"  {r.config.name}: {r.why_not()}")
    out += [f"  {name}: {why}" for name, why in q.refused]
    out += [f"  not evaluated: {n}" for n in q.not_evaluated]
    ok = [r for r in q.results if r.runs and under_cap(r, cap)[0]]
    if q.replicas is not None:
        name, c, tok = q.replicas
        out.append(
            f"{q.nodes} separate boxes, each running the one-box recommendation {name}: "
            f"{q.nodes} x {_tok(tok)} = {_tok(q.nodes * tok)} tok/s under {cap:g} ms (C={c} each)"
        )
    if ok:
        best = max(ok, key=lambda r: under_cap(r, cap)[1])
        c, tok = under_cap(best, cap)
        out.append(
            f"best spanning the nodes that runs today: {best.config.name} across "
            f"{q.nodes} nodes: {_band(p, tok)} at C={c} (one line per node, NODE_RANK 0.."
            f"{q.nodes - 1}, HEAD_IP node 0's address)"
        )
        cmds = node_commands(p, best)
        out += [f"  {fw}: {cmds[fw]}" for fw in ("sglang", "vllm") if not best.reasons[fw]]
    return out


def _nodes_doc(p: PlanResult) -> dict[str, Any] | None:
    q = p.nodes
    if q is None:
        return None
    t = p.tables

    def hop_doc(h) -> dict[str, float]:
        return {"latency_us": h.latency_us, "wire_us": h.wire_us, "bounce_us": h.bounce_us}

    return {
        "nodes": q.nodes,
        "gpus_per_node": q.per_node,
        "nic": {
            "spec": q.nic.spec,
            "count": q.nic.count,
            "gbit": q.nic.gbit,
            "kind": q.nic.kind,
            "gdr": q.nic.gdr,
            "line_gbps": q.nic.line_gbps,
            "nccl_gbps": q.gbps,
            "kind_of_number": q.gbps_kind,
            "source": q.gbps_source,
            "round_us": [t.internode_latency_us, t.internode_latency_source],
            "host_link_gbps": None if q.nic.gdr else link_gbps(p.gpu),
        },
        "assumed": list(q.assumed),
        "moe_layer": [
            {
                "concurrency": lt.concurrency,
                "tokens_per_rank": lt.tokens_per_rank,
                "nodes_per_token": lt.node_rows,
                "dispatch_bytes": lt.dispatch_bytes,
                "combine_bytes": lt.combine_bytes,
                "flat_expert_bytes_each_way": lt.flat_expert_bytes,
                "flat_rank_bytes": list(lt.flat_rank_bytes),
                "dispatch_hop": hop_doc(lt.dispatch_hop),
                "combine_hop": hop_doc(lt.combine_hop),
                "node_exchange_us": lt.intra_us,
                "calls_us": lt.call_us,
                "layer_us": lt.layer_us,
                "flat_expert_hop_us": lt.flat_expert_hop_us,
                "flat_rank_hop_us": lt.flat_rank_hop_us,
            }
            for lt in q.traffic
        ],
        "configurations": [
            _config_doc(p, r, node_commands(p, r) if r.modelled else None) for r in q.results
        ],
        "refused": [{"name": n, "reason": w} for n, w in q.refused],
        "not_evaluated": list(q.not_evaluated),
        "replicas": (
            dict(zip(("configuration", "concurrency", "tok_s_per_box"), q.replicas))
            if q.replicas
            else None
        ),
    }


def asked_lines(p: PlanResult) -> list[str]:
    a = p.asked
    out = [f"--config {a.flags!r} ({a.framework} flags):"]
    if a.config is None:
        return [*out, f"  not evaluated: {a.refused}", *(f"  {n}" for n in a.notes)]
    r = a.result
    out.append(
        f"  = {a.config.name} on {a.config.gpus} of the box's {p.num_gpus} GPUs"
        + (f", KV cache {a.kv_dtype}" if a.kv_dtype != p.inputs.kv_dtype else "")
    )
    out += [f"  {n}" for n in a.notes]
    if r is None or not r.modelled:
        why = "; ".join(r.reasons[a.framework]) if r is not None else a.refused
        return [*out, f"  {a.framework} cannot run it: {why}"]
    fw = a.framework
    mem = r.mem(fw)
    if not r.reasons[fw] and mem.fits:
        out.append(f"  {fw} runs it")
    else:
        why = "; ".join(r.reasons[fw]) or "out of memory"
        out.append(f"  {fw} cannot run it: {why} (predicted anyway, for reference)")
    out.append(f"  memory per GPU ({fw}'s layout and budget): {mem.summary()}")
    curve = ", ".join(f"C={c} {_tok(v)}" for c, v in r.curve)
    lo, hi = p.stack.band
    out.append(f"  predicted tok/s (band x{lo:.2f}..x{hi:.2f}): {curve}")
    peak = f"peak {_band(p, r.peak_tok_s)} at C={r.peak_c}" if r.peak_c else "no peak (no KV room)"
    out.append(f"  C=1: {_band(p, r.steps[1].tpot_us / 1e3, 'ms')} per output token; {peak}")
    c, tok = under_cap(r, p.inputs.max_tpot_ms)
    if c:
        out.append(f"  under TPOT {p.inputs.max_tpot_ms:g} ms: {_band(p, tok)} at C={c}")
    else:
        out.append(f"  under TPOT {p.inputs.max_tpot_ms:g} ms: no concurrency meets the cap")
    if not r.reasons[fw] and mem.fits:
        out += _launch_lines(p, r, a.kv_dtype)
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
    order = {
        k: i for i, k in enumerate(("measured", "predicted", "derived", "model", "assumed", "none"))
    }
    for (kind, term), srcs in sorted(seen.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        more = f" (+{len(srcs) - 1} more)" if len(srcs) > 1 else ""
        out.append(f"  {kind:9s} {term}: {srcs[0]}{more}")
    out += [
        f"  model     compute terms (experts: as their line above says): roofline on the GPU "
        f"table ({p.gpu.source})",
        f"            memory efficiency {t.memory_efficiency:g} ({t.memory_efficiency_source}); "
        f"tensor efficiency {t.tensor_efficiency:g} ({t.tensor_efficiency_source})",
        f"            expert GEMM efficiency by rows per expert: {t.gemm_efficiency.source}",
        f"  model     kernel launches: counted kernels per layer x gap, graphs "
        f"{t.kernel_gap_graph_us:g} µs ({t.kernel_gap_graph_source}); eager "
        f"{t.kernel_gap_eager_us:g} µs ({t.kernel_gap_eager_source})",
        f"  fitted    framework host time: {p.stack.name} step_us, request_us (above)",
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
        "bubble_ms": s.bubble_us / 1e3,
        "micro_batches": s.micro_batches,
        "rows_per_request": s.rows_per_request,
        "tokens_per_step": s.tokens_per_step,
        "bytes_read": dict(s.bytes_read),
        "sources": {k: {"kind": kd, "source": src} for k, (kd, src) in s.sources.items()},
    }


def _config_doc(p: PlanResult, r: Result, launch: dict[str, str] | None = None) -> dict:
    c = r.config
    m = r.memory
    launch = commands(p, r) if launch is None else launch
    return {
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
                "launch": launch[fw] if not r.reasons[fw] else None,
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
        "under_tpot_cap": (
            dict(zip(("concurrency", "tok_s"), under_cap(r, p.inputs.max_tpot_ms)))
            if r.modelled
            else None
        ),
        "max_concurrency": r.c_max,
        "curve": [[c_, v] for c_, v in r.curve],
        "prefill": ({"chunk": r.prefill_chunk, **_step_doc(r.prefill)} if r.prefill else None),
    }


def to_doc(p: PlanResult) -> dict[str, Any]:
    t = p.tables
    configs = [_config_doc(p, r) for r in p.results]
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
            "fitted": {"step_us": s.step_us, "request_us": s.request_us},
            "like": s.like or None,
            "mtp": (
                {
                    "draft_tokens": s.mtp.draft_tokens,
                    "accept_len": s.mtp.accept_len,
                    "method": s.mtp.method,
                    "source": s.mtp.source,
                }
                if s.mtp
                else None
            ),
            "parts": [
                {"name": pt.name, "value": pt.value, "cost": pt.cost, "source": pt.source}
                for pt in s.parts()
            ],
            "env": list(s.env),
            "flags": {k: list(v) for k, v in s.flags.items()},
            "calibration": [
                {"point": lab, "measured_tok_s": m, "model_tok_s": pr, "residual": pr / m - 1}
                for lab, m, pr in s.residuals
            ],
            "leave_one_out": [
                {"point": lab, "measured_tok_s": m, "predicted_tok_s": pr, "residual": pr / m - 1}
                for lab, m, pr in s.loo
            ],
            "band": {"low": s.band[0], "high": s.band[1]},
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
        "assumed": list(p.assumed),
        "max_model_len": p.max_model_len,
        "recommendation": {
            "max_tpot_ms": rec.cap_ms,
            "throughput": rec.best.config.name if rec.best else None,
            "latency": rec.latency.config.name if rec.latency else None,
            "ties": [r.config.name for r in rec.ties],
            "latency_ties": [r.config.name for r in rec.latency_ties],
            "note": rec.note,
            "launch": commands(p, rec.best) if rec.best else None,
            "latency_launch": commands(p, rec.latency) if rec.latency else None,
        },
        "asked": _asked_doc(p),
        "nodes": _nodes_doc(p),
        "notes": list(p.notes),
    }


def _asked_doc(p: PlanResult) -> dict[str, Any] | None:
    a = p.asked
    if a is None:
        return None
    r = a.result
    return {
        "flags": a.flags,
        "framework": a.framework,
        "configuration": a.config.name if a.config else None,
        "refused": a.refused or None,
        "notes": a.notes,
        "runs": bool(r and r.runs),
        "why_not": r.why_not() if r is not None else a.refused,
        "curve": [[c, v] for c, v in r.curve] if r is not None else [],
        "max_requests": r.memory.max_requests if r is not None else None,
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
