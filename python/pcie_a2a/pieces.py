"""Normal mode in pieces: a ``Buffer(max_tokens_per_rank=C, max_dispatch_tokens=T)`` moves a
dispatch of up to T tokens per rank through its C-token region as consecutive normal calls
of C tokens (the transport and the wire protocol are unchanged: each piece is an ordinary
call). This is what keeps a prefill Buffer's memory fixed: the region costs
``2 * world * C`` slots per direction whatever the chunk (docs/transport.md, "Memory").

Every rank must make the same number of calls, and a rank knows only its own token count,
so the number of pieces is agreed first: one all-reduce (MAX) of ``ceil(tokens / C)`` over
the Buffer's process group, the only use of the group after construction, on every
normal dispatch of a Buffer built with ``max_dispatch_tokens > max_tokens_per_rank`` (a
rank cannot know that its peers' calls are small). Normal mode already waits on the host
for its counts; this adds that one small collective and its wait.

The result is the one a single call would give: rows grouped by source rank (within a
source, in token order), ``src_token`` counted over the whole call, counts and
``tokens_per_expert`` summed. The combine splits ``y`` back into the pieces' rows, combines
each piece and concatenates the tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pcie_a2a.buffer import DispatchHandle, DispatchResult


@dataclass
class PiecesHandle(DispatchHandle):
    """The handle of a dispatch moved in pieces: each piece's own handle, and where each
    piece's received rows went in the result (``order``: result row -> concatenated row)."""

    pieces: list[DispatchHandle] = field(default_factory=list)
    order: torch.Tensor | None = None
    piece_rows: list[int] = field(default_factory=list)


def _agree(buf, n: int) -> int:
    """The largest piece count over the ranks (one all-reduce)."""
    on_device = dist.get_backend(buf.group) == "nccl"
    t = torch.tensor([n], dtype=torch.int64, device=buf.device if on_device else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=buf.group)
    return int(t.item())


def dispatch(buf, x, topk_ids, topk_weights, return_fp8: bool) -> DispatchResult:
    c = buf.max_tokens_per_rank
    tokens = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
    ok = tokens <= buf.max_dispatch_tokens
    n = _agree(buf, max(1, -(-tokens // c)) if ok else 1)
    if not ok:  # one call whose argument check raises and aborts it on the wire (the peers
        # raise PeerAbortedError in their first piece instead of waiting)
        return buf._dispatch_one(x, topk_ids, topk_weights, return_fp8, pieces=True)
    if n == 1:
        return buf._dispatch_one(x, topk_ids, topk_weights, return_fp8)
    parts = []
    for i in range(n):
        lo, hi = min(i * c, tokens), min((i + 1) * c, tokens)
        parts.append(buf._dispatch_one(x[lo:hi], topk_ids[lo:hi], topk_weights[lo:hi],
                                       return_fp8))  # fmt: skip
    return _merge(buf, parts, tokens, c)


def _merge(buf, parts: list[DispatchResult], tokens: int, c: int) -> DispatchResult:
    w = buf.world
    counts = [p.handle.recv_count_host for p in parts]
    rows = [sum(h) for h in counts]
    starts = [0, *itertools.accumulate(rows[:-1])]
    order: list[int] = []
    for s in range(w):  # grouped by source, then piece (token order within a source)
        for i, h in enumerate(counts):
            base = starts[i] + sum(h[:s])
            order.extend(range(base, base + h[s]))
    idx = torch.tensor(order, dtype=torch.int64, device=buf.device)

    def cat(name):
        vals = [getattr(p, name) for p in parts]
        if vals[0] is None:
            return None
        return torch.cat(vals)[idx]

    offset = torch.cat([torch.full((r,), i * c, dtype=torch.int32, device=buf.device)
                        for i, r in enumerate(rows)])  # fmt: skip
    src_token = (torch.cat([p.src_token for p in parts]) + offset)[idx]
    host = [sum(h[s] for h in counts) for s in range(w)]
    bases = [0, *itertools.accumulate(host[:-1])]
    recv = torch.tensor(host, dtype=torch.int32, device=buf.device)
    first = parts[0].handle
    handle = PiecesHandle(
        first.buffer_id, "normal", "rows", tokens, first.send_token, first.send_count, recv,
        torch.tensor(bases, dtype=torch.int64, device=buf.device), recv_count_host=host,
        row_base_host=bases, pieces=[p.handle for p in parts], order=idx, piece_rows=rows,
    )  # fmt: skip
    per_expert = torch.stack([p.tokens_per_expert for p in parts]).sum(dim=0, dtype=torch.int32)
    return DispatchResult(
        x=cat("x"), x_scales=cat("x_scales"), src_rank=cat("src_rank"), src_token=src_token,
        topk_ids=cat("topk_ids"), topk_weights=cat("topk_weights"), recv_count=recv,
        tokens_per_expert=per_expert, handle=handle,
    )  # fmt: skip


def combine(buf, y: torch.Tensor, handle: PiecesHandle, out=None) -> torch.Tensor:
    """``y`` rows in the merged order back into each piece's order, one combine per piece;
    with ``out``, each piece lands in its own rows of it (a row range of a contiguous
    tensor is contiguous)."""
    flat = torch.empty_like(y)
    flat[handle.order] = y
    parts = torch.split(flat, handle.piece_rows)
    if out is None:
        return torch.cat([buf._combine_one(p, handle.pieces[i]) for i, p in enumerate(parts)])
    lo = 0
    for i, part in enumerate(parts):
        n = handle.pieces[i].num_tokens
        buf._combine_one(part, handle.pieces[i], out[lo : lo + n])
        lo += n
    return out
