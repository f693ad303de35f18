"""The known-answer check every Buffer on CUDA runs before its first call.

The CUDA transport has run only on the CPU model of CUDA, so "P2P supported" and even the
bootstrap probe (one pattern per pair in the header) are not proof that rows arrive whole
through every path a Buffer will use. Before the Buffer returns, every rank runs the same
short sequence through the transport's own calls: a normal dispatch + combine with warp
stores, the same with pairs big enough for the copy engine (when the Buffer can reach its
threshold), and a low-latency dispatch + combine. Every row carries a value that is a
function of (source rank, source token, channel); combine partials one of (expert rank,
source, token, channel). The receiver compares on the device (no payload comes back to the
host), counts wrong, missing and extra rows per source into one small int32 tensor, and
that tensor is read once at the end. The verdicts are gathered, so every rank raises the
same error naming the pair, its path (P2P push, P2P pull, host-staged, copy engine) and the
ways out. A timeout or a peer's failure inside the check is caught and reported the same
way. Never a fallback: a failing Buffer is not built.

Values are small integers, exact in bf16/fp16 and, for the fp8 payload, every 128-channel
group holds +-7 so its scale is 1/64 and every value is exact in e4m3. Per call this is a
few thousand rows at most: on a GPU box the whole check should take a few milliseconds (it
has not run on one; the CUDA execution model runs it, with seeded faults).

:func:`rank_steps` is one rank's share, as steps; :func:`run` drives one rank (a Buffer
over a process group) and :func:`run_in_process` drives the W transports of
``CudaTransport.in_process`` (every rank's step before any rank's next step).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pcie_a2a.transport.cuda.common import (
    _OP_COMBINE,
    _OP_DISPATCH,
    _OP_LL_COMBINE,
    _OP_LL_DISPATCH,
    STAGED,
)

WAYS_OUT = (
    "ways out: PCIE_A2A_P2P=0 (every pair staged through host memory), "
    "PCIE_A2A_BACKEND=cpu (the CPU shared-memory transport); PCIE_A2A_SELFTEST=0 skips this "
    "check and is unsafe (a broken path then gives wrong rows without an error)"
)
# bad[...] columns, per source (receiver side) or per expert rank (combine, source side)
_WRONG, _MISSING, _META, _COMBINE = 0, 1, 2, 3


def _x_value(src, tok, chan, fp8: bool):
    if fp8:  # 15 consecutive channels hold -7..7: every group's amax is 7 (scale 1/64)
        return (src * 3 + tok * 5 + chan) % 15 - 7
    return (src * 37 + tok * 11 + chan) % 251 - 125


def _y_value(dst, src, tok, chan):
    return (dst * 7 + src * 5 + tok * 3 + chan) % 31 - 15


class _CallRouting:
    """The routing of one call, the same on every rank (each rank builds every rank's)."""

    def __init__(self, world: int, tokens: int, ranks_per_token: int, shift: int):
        self.world, self.tokens, self.k = world, tokens, ranks_per_token
        self.shift = shift

    def dests(self, src: int, tok: int) -> list[int]:
        return [(src + tok + self.shift + j) % self.world for j in range(self.k)]


def _targets(placement) -> list[tuple[int, int] | None]:
    """Per rank, (global expert, its local index) of an expert whose only replica is there
    (None: there is none, and no token of the check goes to that rank)."""
    out: list[tuple[int, int] | None] = [None] * placement.world
    for e, reps in enumerate(placement.replicas):
        if len(reps) == 1 and out[reps[0][0]] is None:
            out[reps[0][0]] = (e, reps[0][1])
    return out


def _phases(t) -> list[tuple[str, int, _CallRouting]]:
    w, m = t.world, t.max_tokens
    k = max(1, min(t.num_topk, w, 16))  # sums of <= 16 partials of |y| <= 15: exact in bf16
    small = min(m, w + 1)
    out = [("normal mode", _OP_DISPATCH, _CallRouting(w, small, k, 0))]
    limit = t.copy_engine_min_bytes
    slot = t._tx().dispatch_slot_bytes
    if limit is not None and m * slot >= max(limit, 1):
        rows = math.ceil(max(limit, 1) / slot) + 1  # per pair, over the threshold
        out.append(("normal mode, copy-engine sized", _OP_DISPATCH,
                    _CallRouting(w, min(m, math.ceil(rows * w / k)), k, 1)))  # fmt: skip
    out.append(("low-latency mode", _OP_LL_DISPATCH, _CallRouting(w, min(m, 2 * w), k, 2)))
    out.append(
        ("low-latency mode, expert-major", _OP_LL_DISPATCH, _CallRouting(w, min(m, 2 * w), k, 3))
    )
    return out


def _inputs(t, routing: _CallRouting, targets, fp8: bool):
    r, dev = t.rank, t.device
    ids = torch.full((routing.tokens, t.num_topk), -1, dtype=torch.int32)
    mask = torch.zeros(routing.tokens, t.world, dtype=torch.bool)
    for tok in range(routing.tokens):
        j = 0
        for d in routing.dests(r, tok):
            if targets[d] is not None:
                ids[tok, j], mask[tok, d], j = targets[d][0], True, j + 1
    tok = torch.arange(routing.tokens, device=dev).unsqueeze(1)
    chan = torch.arange(t.hidden, device=dev).unsqueeze(0)
    x = _x_value(r, tok, chan, fp8).to(t.dtype)
    w = torch.where(ids >= 0, 0.5, 0.0).to(torch.float32)
    return x, ids.to(dev), w.to(dev), mask.to(dev)


def _expected_hits(t, routing: _CallRouting, targets) -> torch.Tensor:
    """[world, tokens]: 1 where source s's token reaches this rank."""
    hits = torch.zeros(t.world, routing.tokens, dtype=torch.int32)
    for s, tok in itertools.product(range(t.world), range(routing.tokens)):
        if any(d == t.rank and targets[d] is not None for d in routing.dests(s, tok)):
            hits[s, tok] = 1
    return hits.to(t.device)


def _check_rows(t, bad, routing, targets, fp8, x, src, tok, ids, ws):
    """Compares received rows on the device; rows with src -1 are empty slots."""
    w = t.world
    used = src >= 0
    ok_meta = used & (src < w) & (tok >= 0) & (tok < routing.tokens)
    # a row whose header is out of range is charged to the unknown source (row w of bad)
    who = torch.where(ok_meta, src, torch.full_like(src, w)).long()
    s_, t_ = src.clamp(0, w - 1).long(), tok.clamp(0, max(routing.tokens - 1, 0)).long()
    chan = torch.arange(t.hidden, device=t.device).unsqueeze(0)
    want = _x_value(s_.unsqueeze(1), t_.unsqueeze(1), chan, fp8).to(x.dtype)
    wrong = (x != want).any(dim=1) & used
    me = targets[t.rank]
    # one expert per (token, rank): the row carries that expert's local id and weight only
    bad_meta = (ids[:, 0] != (-1 if me is None else me[1])) | (ws[:, 0] != 0.5)
    if ids.shape[1] > 1:
        bad_meta |= (ids[:, 1:] != -1).any(dim=1)
    bad_meta = (bad_meta | ~ok_meta) & used
    one = torch.ones_like(who, dtype=torch.int32)
    bad[:, _WRONG].index_add_(0, who, one * wrong)
    bad[:, _META].index_add_(0, who, one * bad_meta)
    hits = torch.zeros(w, routing.tokens, dtype=torch.int32, device=t.device)
    if routing.tokens:
        hits.index_put_((s_, t_), (one * ok_meta), accumulate=True)
    diff = (hits != _expected_hits(t, routing, targets)).sum(dim=1, dtype=torch.int32)
    bad[:w, _MISSING] += diff


def _combine_rows(t, src, tok):
    chan = torch.arange(t.hidden, device=t.device).unsqueeze(0)
    y = _y_value(t.rank, src.long().unsqueeze(1), tok.long().unsqueeze(1), chan)
    return y.to(t.dtype)


def _check_combine(t, bad, mask, out, weight: float):
    tok = torch.arange(out.shape[0], device=t.device).unsqueeze(1)
    chan = torch.arange(t.hidden, device=t.device).unsqueeze(0)
    want = torch.zeros(out.shape, dtype=torch.float32, device=t.device)
    for d in range(t.world):
        want += mask[:, d : d + 1] * _y_value(d, t.rank, tok, chan).float() * weight
    wrong = (out != want.to(out.dtype)).any(dim=1)
    # every expert rank the wrong token visited is a suspect; the report names the most hit
    bad[: t.world, _COMBINE] += (mask & wrong.unsqueeze(1)).sum(dim=0, dtype=torch.int32)


def _expert_major(t, bad, routing, targets, fp8, counts) -> None:
    """The DeepEP-shaped receive ``[E_local, world * max_tokens, H]``: each row's source
    comes from ``layout_range`` (begin << 32 | count per expert and source), its token from
    ``src_info``; then the same checks as the rows layout, and the fused, weighted combine
    of ``y[e, i] = value(this rank, source, token, channel)``."""
    w, m, dev, e_n = t.world, t.max_tokens, t.device, t.num_local_experts
    cap, k = w * m, t.num_topk
    xo = torch.empty(e_n, cap, t.hidden, dtype=t.dtype, device=dev)
    per_expert = torch.zeros(e_n, dtype=torch.int32, device=dev)
    src_info = torch.full((e_n, cap), -1, dtype=torch.int32, device=dev)
    layout_range = torch.zeros(e_n, w, dtype=torch.int64, device=dev)
    expert_pos = torch.empty(cap, k, dtype=torch.int32, device=dev)
    row_experts = torch.full((cap, k), -1, dtype=torch.int32, device=dev)
    row_weights = torch.zeros(cap, k, dtype=torch.float32, device=dev)
    t.unpack_expert_major(None, counts, e_n, xo, None, None, per_expert, src_info, layout_range,
                          expert_pos, row_experts, row_weights)  # fmt: skip
    begin, count = (layout_range >> 32).unsqueeze(2), (layout_range & 0xFFFFFFFF).unsqueeze(2)
    i = torch.arange(cap, device=dev).view(1, 1, cap)
    inside = (i >= begin) & (i < begin + count)  # [E, world, cap]
    ranks = torch.arange(w, device=dev).view(1, w, 1)
    valid = (i.view(1, cap) < per_expert.view(e_n, 1)) & (inside.sum(dim=1) == 1)
    src = torch.where(valid, (inside * ranks).sum(dim=1), -1).to(torch.int32)
    tok = torch.where(valid, src_info, -1)
    # the row's "ids": the local expert it sits in; its weight is checked by the combine
    expert = torch.arange(e_n, device=dev, dtype=torch.int32).view(e_n, 1).expand(e_n, cap)
    ids = expert.reshape(-1, 1)
    ws = torch.full((e_n * cap, 1), 0.5, dtype=torch.float32, device=dev)
    _check_rows(t, bad, routing, targets, fp8, xo.view(-1, t.hidden), src.view(-1), tok.view(-1),
                ids, ws)  # fmt: skip
    chan = torch.arange(t.hidden, device=dev).view(1, 1, -1)
    y = _y_value(t.rank, src.long().unsqueeze(2), tok.long().unsqueeze(2), chan).to(t.dtype)
    t.combine_send_expert_major(None, _OP_LL_COMBINE, None, y, counts, None, expert_pos,
                                row_experts, row_weights)  # fmt: skip


def rank_steps(t, placement, fp8: bool, report: dict) -> Iterator[None]:
    """One rank's share of the check, as steps: the driver runs step n of every rank before
    step n + 1 of any (a send before the receives that wait for it). ``report`` gets
    ``bad`` (a device int32 [phases, world + 1, 4]), ``phases`` and ``ce`` (the ranks each
    copy-engine phase moved with the copy engine)."""
    targets = _targets(placement)
    phases = _phases(t)
    bad = torch.zeros(len(phases), t.world + 1, 4, dtype=torch.int32, device=t.device)
    report.update(bad=bad, phases=[p[0] for p in phases], ce={})
    w, m, dev = t.world, t.max_tokens, t.device
    for i, (name, op, routing) in enumerate(phases):
        x, ids, wt, mask = _inputs(t, routing, targets, fp8)
        send_token = torch.empty(w * m, dtype=torch.int32, device=dev)
        send_count = torch.empty(w, dtype=torch.int32, device=dev)
        t.dispatch_send(None, op, None, x, routing.tokens, ids, wt, t.num_topk, None,
                        send_token, send_count)  # fmt: skip
        if op == _OP_DISPATCH and "copy-engine" in name:
            report["ce"][i] = t.last_copy_engine_ranks
        yield
        k = t.num_topk
        if op == _OP_DISPATCH:
            host = t.wait(None, op, t.timeout_s)
            counts = torch.tensor(host, dtype=torch.int32, device=dev)
            bases = [0, *itertools.accumulate(host[:-1])]
            row_base = torch.tensor(bases, dtype=torch.int64, device=dev)
            shape: tuple[int, ...] = (sum(host),)
        else:
            counts, row_base, host, bases = t.ll_counts(), None, None, None
            shape = (w * m,)
        if "expert-major" in name:
            _expert_major(t, bad[i], routing, targets, fp8, counts)
        else:
            xo = torch.empty(*shape, t.hidden, dtype=t.dtype, device=dev)
            src = torch.full(shape, -1, dtype=torch.int32, device=dev)
            tok = torch.full(shape, -1, dtype=torch.int32, device=dev)
            ids_o = torch.full((*shape, k), -1, dtype=torch.int32, device=dev)
            ws_o = torch.zeros(*shape, k, dtype=torch.float32, device=dev)
            per_expert = torch.zeros(t.num_local_experts, dtype=torch.int32, device=dev)
            # low latency: the receive kernel waits for the flags and writes counts itself
            t.unpack_rows(None, counts, row_base, xo, None, None, src, tok, ids_o, ws_o,
                          t.num_local_experts, per_expert)  # fmt: skip
            _check_rows(t, bad[i], routing, targets, fp8, xo, src, tok, ids_o, ws_o)
            y = _combine_rows(t, src, tok)
            combine = _OP_COMBINE if op == _OP_DISPATCH else _OP_LL_COMBINE
            if op == _OP_DISPATCH:
                t.combine_send(None, combine, None, y, counts, row_base, host, bases)
            else:
                t.combine_send(None, combine, None, y, counts, None)
        yield
        out = torch.empty(routing.tokens, t.hidden, dtype=t.dtype, device=dev)
        combine = _OP_COMBINE if op == _OP_DISPATCH else _OP_LL_COMBINE
        t.combine_recv(None, combine, None, t.timeout_s, send_token, send_count, routing.tokens,
                       out, sync=True)  # fmt: skip
        # the expert-major combine applies the routing weights (0.5) on the expert's rank
        _check_combine(t, bad[i], mask, out, 0.5 if "expert-major" in name else 1.0)
        yield


def _path(t_pair: list[list[int]], direction, s: int, d: int) -> str:
    if t_pair[s][d] == STAGED:
        return "host-staged"
    return f"P2P {direction[s][d]}"


def verdict(reports: list[dict], pair_transport, pair_direction) -> str:
    """The error every rank raises ("" when every rank passed), from every rank's report
    (``bad`` as a nested list, ``phases``, ``ce``, ``error``)."""
    lines = []
    for r, rep in enumerate(reports):
        if rep.get("error"):
            lines.append(f"rank {r}: {rep['error']}")
        for i, name in enumerate(rep.get("phases", [])):
            rows = rep["bad"][i] if rep.get("bad") else []
            for s, (wrong, missing, meta, _) in enumerate(rows):
                if not (wrong or missing or meta):
                    continue
                if s == len(reports):
                    lines.append(f"{name}: rank {r} received {wrong + meta} rows whose header "
                                 "names no valid source token")  # fmt: skip
                    continue
                ce = r in reports[s].get("ce", {}).get(i, [])
                path = _path(pair_transport, pair_direction, s, r)
                path += ", copy engine" if ce else ""
                what = [f"{n} {label}" for n, label in ((wrong, "with wrong bytes"),
                        (missing, "missing or extra"), (meta, "with wrong ids/weights")) if n]  # fmt: skip
                lines.append(f"{name} dispatch: rank {s} -> rank {r} ({path}): rows "
                             + ", ".join(what))  # fmt: skip
            comb = [row[_COMBINE] for row in rows[: len(reports)]]
            if any(comb):
                top = max(comb)
                sus = [d for d, n in enumerate(comb) if n == top]
                pairs = ", ".join(f"rank {d} -> rank {r} ({_path(pair_transport, pair_direction, d, r)})"
                                  for d in sus)  # fmt: skip
                lines.append(f"{name} combine: {top} tokens of rank {r} summed wrong partials; "
                             f"the pair(s) they all came through: {pairs}")  # fmt: skip
    if not lines:
        return ""
    return ("pcie_a2a CUDA self-test failed (a known-answer dispatch + combine before the "
            "Buffer's first call): " + "; ".join(lines) + ". " + WAYS_OUT)  # fmt: skip


def _finish(t, report: dict, error: str | None) -> dict:
    out = {"phases": report.get("phases", []), "ce": report.get("ce", {}), "error": error}
    bad = report.get("bad")
    out["bad"] = bad.tolist() if bad is not None else []  # the one read of the check
    return out


def run(t, placement, fp8: bool, gather: Callable[[Any], list], timeout_s: float) -> None:
    """One rank of a process group: runs its share, gathers every rank's report and raises
    the same RuntimeError on every rank when any pair failed."""
    saved, t.timeout_s = t.timeout_s, min(t.timeout_s, timeout_s)
    report: dict = {}
    error = None
    try:
        for _ in rank_steps(t, placement, fp8, report):
            pass
        t.check()
    except Exception as exc:  # every failure reaches every rank through the gather
        error = f"{type(exc).__name__}: {exc}"
    finally:
        t.timeout_s = saved
    reports = gather(_finish(t, report, error))
    msg = verdict(reports, t.pair_transport, t.pair_direction)
    if msg:
        raise RuntimeError(msg)
    t.mark_self_tested()


def run_in_process(transports: list, placement, fp8: bool, timeout_s: float = 5.0) -> str:
    """The same check over the W transports of ``CudaTransport.in_process``; returns the
    verdict ("" when every pair passed) instead of raising."""
    saved = [t.timeout_s for t in transports]
    reports: list[dict] = [{} for _ in transports]
    errors: list[str | None] = [None] * len(transports)
    steps = []
    for t, rep in zip(transports, reports):
        t.timeout_s = min(t.timeout_s, timeout_s)
        steps.append(rank_steps(t, placement, fp8, rep))
    live = list(range(len(transports)))
    try:
        while live:
            for r in list(live):
                try:
                    next(steps[r])
                except StopIteration:
                    live.remove(r)
                except Exception as exc:
                    errors[r] = f"{type(exc).__name__}: {exc}"
                    live.remove(r)
        for r, t in enumerate(transports):
            if errors[r] is None:
                try:
                    t.check()
                except Exception as exc:
                    errors[r] = f"{type(exc).__name__}: {exc}"
    finally:
        for t, s in zip(transports, saved):
            t.timeout_s = s
    done = [_finish(t, rep, e) for t, rep, e in zip(transports, reports, errors)]
    t0 = transports[0]
    return verdict(done, t0.pair_transport, t0.pair_direction)
