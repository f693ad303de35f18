"""``InternodeBuffer``: the Buffer of a group that spans nodes (CPU backend).

Rank ``g`` is local rank ``l`` of node ``n``. Its *rail* is the ranks with local index
``l`` on every node (one gloo group each); its node's ranks share an inner :class:`Buffer`
over pcie_a2a's own CPU transport.

Dispatch:

1. The source resolves every top-k slot to its replica (rank, local expert) exactly as the
   flat wire layer would (the token's global index ``rank * max_tokens + t``, the choice
   table of the source), so the rows land where a flat Buffer would put them.
2. Rail hop (gloo ``all_to_all_single``): for every other node, one row per token with an
   expert there, to the rank of the same local index on that node. The row is the flat
   wire row (``buffer_memory.dispatch_slot_bytes``): token index, that node's experts as
   *virtual ids* (``offset of the rank in its node + local expert``) and weights, the
   payload (fp8 bytes and scales with ``payload="fp8"``).
3. The proxy lays out its own tokens and every node's rows in one input of
   ``num_nodes * max_tokens`` rows, row ``node * max_tokens + token``, and dispatches it
   through the inner Buffer, whose placement holds the virtual experts. The index of a
   received row therefore says its source node and token; with the proxy's local index it
   names the source rank, and the rows are put back in the flat order (source rank, then
   token). fp8 rows are dequantised by the proxy and quantised again by the inner Buffer:
   that gives the source's bytes and scales back exactly (the row's largest element is
   unchanged by the bf16 round trip, and no other element moves by half an e4m3 step).
   With ``dtype=float16`` that holds unless a dequantised value falls in fp16's subnormal
   range, where the round trip can move it: such a row can then differ from the flat
   Buffer's (bf16, the default, has no such range in practice; the tests use bf16).

Combine reverses it: the inner combine sums the node's partials of each proxy row in fp32
(kept in fp32: ``combine_recv_fp32``), the proxy sends each remote token's node sum back
over the rail once (fp32), and the source adds the nodes' sums in node order and rounds to
the dtype once. The flat Buffer sums all partials in ascending rank order; over consecutive
ranks the terms are the same, grouped by node, so results equal the flat Buffer's whenever
the sums are exact (and differ by fp32 rounding otherwise).

Failures. Every rail exchange starts with a 16-byte header per peer (status, rows, culprit
rank), so a rank whose own stage failed still tells its rail peers why instead of leaving
them waiting; a rank that must give up its inner call aborts it (its node's ranks raise
PeerAbortedError there) and the node's ranks that took part in the abort exchange what they
know, so every surviving rank names the rank that failed and its node.
"""

from __future__ import annotations

import datetime
import itertools
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pcie_a2a import _native
from pcie_a2a.buffer import (
    _OP_COMBINE,
    _OP_DISPATCH,
    Buffer,
    DispatchHandle,
    DispatchResult,
    _check_same_config,
    _fail,
)
from pcie_a2a.buffer_memory import dispatch_slot_bytes
from pcie_a2a.internode.nodes import NodeLayout
from pcie_a2a.placement import Placement
from pcie_a2a.reference import dequantize_fp8, quantize_fp8

_OK, _ABORTED, _FAILED, _TIMED_OUT = 0, 1, 2, 3
HEADER_BYTES = 16  # int32 status, rows, culprit rank, 0: one per peer and rail exchange
_ALIGN = 16


def _up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class _RowFormat:
    """Byte offsets of a dispatch row on the rail (the flat wire row's layout)."""

    hidden: int
    topk: int
    fp8: bool
    ids: int = 16
    weights: int = 0
    payload: int = 0
    scales: int = 0
    size: int = 0

    def __post_init__(self) -> None:
        self.weights = _up(16 + 4 * self.topk, _ALIGN)
        self.payload = _up(self.weights + 4 * self.topk, _ALIGN)
        self.scales = _up(self.payload + self.hidden, _ALIGN)
        self.size = dispatch_slot_bytes(self.hidden, self.topk, "fp8" if self.fp8 else "bf16")


@dataclass
class InternodeHandle(DispatchHandle):
    """A dispatch's handle on a multi-node Buffer: the flat handle's fields (counts as a
    flat Buffer has them) plus what the hierarchical combine needs."""

    inner: DispatchHandle | None = None  # the inner (node) Buffer's handle
    order: torch.Tensor | None = None  # result row i is the inner Buffer's row order[i]
    sent: list[torch.Tensor] = field(default_factory=list)  # [node]: tokens sent there
    received: list[torch.Tensor] = field(default_factory=list)  # [node]: its tokens, as received
    slot: torch.Tensor | None = None  # low-latency rows: flat row i is slot s * max_tokens + j


class _NoTransport:
    """What Buffer.__init__ reads of a transport; the data moves in the inner Buffer and
    on the rails."""

    device = torch.device("cpu")


def _native_errors():
    t = _native.transport()
    return t.PeerError, t.PeerTimeoutError, t.PeerAbortedError


class InternodeBuffer(Buffer):
    """A :class:`Buffer` over several nodes (see the module docstring). Made by
    ``Buffer(group, ...)`` when the group spans nodes; normal-mode ``dispatch``/``combine``
    on the CPU backend; low-latency calls run on the same path. Not yet: the CUDA
    backend, ``pair_direction`` and ``max_dispatch_tokens`` (each refused with an error
    naming it)."""

    _nodes: NodeLayout

    # ---- construction ------------------------------------------------------------------
    def _bootstrap(self) -> None:
        nodes = self._nodes
        _check_same_config(self._gather(self._config()))
        where = f"Buffer across {nodes.num_nodes} nodes of {nodes.local_size} ranks"
        if self.backend != "cpu":
            raise RuntimeError(
                f"{where}: backend {self.backend!r} is not available across nodes yet: the "
                "CUDA inter-node stage (NCCL send/recv between nodes, kernels packing rows "
                "per node) is not built; pass backend='cpu' with CPU tensors"
            )
        if self.pair_direction is not None:
            raise _fail(ValueError, "pair_direction", "a table",
                        f"None in a {where} (the node's transport decides)")  # fmt: skip
        if self.max_dispatch_tokens != self.max_tokens_per_rank:
            raise _fail(ValueError, "max_dispatch_tokens", self.max_dispatch_tokens,
                        f"None or max_tokens_per_rank in a {where} (no pieces yet)")  # fmt: skip
        n_nodes, local = nodes.num_nodes, nodes.local_size
        me = self.rank
        self._node, self._local = nodes.node_of(me), nodes.local_index(me)
        self._rail = nodes.rail(self._local)
        granks = self._granks = dist.get_process_group_ranks(self.group)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # new_group is collective over the default group: every rank makes every group
        mine = []
        for members in [*nodes.ranks, *(nodes.rail(i) for i in range(local))]:
            g = dist.new_group([granks[r] for r in members], timeout=timeout, backend="gloo")
            if me in members:
                mine.append(g)
        self._node_group, self._rail_group = mine
        self._subgroups = mine
        # virtual experts: node n's ranks' local experts, numbered rank by rank
        offset = [0] * self.world
        inner_replicas: list[list[list[tuple[int, int]]]] = []
        for n, members in enumerate(nodes.ranks):
            reps: list[list[tuple[int, int]]] = []
            for p, g in enumerate(members):
                offset[g] = len(reps)
                reps += [[(p, j)] for j in range(self.placement.num_local_experts(g))]
            if not reps:
                raise _fail(ValueError, "placement", f"no expert on node {n}",
                            "at least one expert on every node")  # fmt: skip
            inner_replicas.append(reps)
        self._tables(offset)
        inner = object.__new__(Buffer)  # one node: the flat Buffer
        Buffer.__init__(
            inner, self._node_group, len(inner_replicas[self._node]), self.hidden,
            n_nodes * self.max_tokens_per_rank, dtype=self.dtype, payload=self.payload,
            placement=Placement(inner_replicas[self._node], local), backend="cpu",
            timeout_s=self.timeout_s, num_topk=self.num_topk,
        )  # fmt: skip
        self._inner = inner
        self._format = _RowFormat(self.hidden, self.num_topk, self.payload == "fp8")
        self._rail_last = [0] * n_nodes  # bytes sent to each node's rail peer, last call
        self._rail_total = [0] * n_nodes
        self._calls = 0
        self._transport = _NoTransport()
        self._closed = False

    def _tables(self, offset: list[int]) -> None:
        """The source's replica choice as tensors: slot (t, k) -> (rank, virtual id)."""
        pl, s = self.placement, self.rank
        cands = []
        for e, reps in enumerate(pl.replicas):
            cand = pl.choice[s][e] if pl.choice is not None else list(range(len(reps)))
            cands.append([reps[j] for j in cand])
        width = max(len(c) for c in cands)
        self._cand_n = torch.tensor([len(c) for c in cands], dtype=torch.int64)
        self._cand_rank = torch.zeros(len(cands), width, dtype=torch.int64)
        self._cand_vid = torch.zeros(len(cands), width, dtype=torch.int64)
        for e, c in enumerate(cands):
            for i, (r, j) in enumerate(c):
                self._cand_rank[e, i] = r
                self._cand_vid[e, i] = offset[r] + j
        node_of = [self._nodes.node_of(r) for r in range(self.world)]
        self._node_of = torch.tensor([*node_of, -1], dtype=torch.int64)  # [-1]: no expert

    def _resolve(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(destination rank, virtual id) of every slot, -1 where the slot is empty."""
        t = ids.shape[0]
        e = ids.long().clamp(min=0)
        token = self.rank * self.max_tokens_per_rank + torch.arange(t, dtype=torch.int64)
        pick = (token.unsqueeze(1) % self._cand_n[e]).unsqueeze(-1)
        rank = self._cand_rank[e].gather(-1, pick).squeeze(-1) if t else e
        vid = self._cand_vid[e].gather(-1, pick).squeeze(-1) if t else e
        empty = ids < 0
        return rank.masked_fill(empty, -1), vid.masked_fill(empty, -1)

    # ---- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        if not self._closed:
            try:
                self._final_stats = self.stats()
            except Exception:
                self._final_stats = None
            self._closed = True
            self._inner.close()
            for g in self._subgroups:
                dist.destroy_process_group(g)
            self._subgroups = []

    def check(self) -> None:
        self._check_usable()

    def memory_bytes(self) -> dict[str, int | str]:
        """The node's transport (:meth:`Buffer.memory_bytes` of the inner Buffer); the rail
        rows are tensors of the call."""
        self._check_usable()
        return self._inner.memory_bytes()

    def stats(self) -> dict:
        """As :meth:`Buffer.stats`, indexed by the group's ranks: bytes into node peers
        through the node's transport, plus the rail rows and headers to other nodes, which
        ``last_internode_bytes`` / ``internode_bytes`` (total) count alone;
        ``last_intranode_bytes`` / ``intranode_bytes`` the node's part (without the local
        copy). ``nodes``: each node's ranks."""
        if self._closed:
            if getattr(self, "_final_stats", None) is None:
                raise RuntimeError("this Buffer is closed")
            return self._final_stats
        inner = self._inner.stats()
        last, total = [0] * self.world, [0] * self.world
        for p, g in enumerate(self._nodes.ranks[self._node]):
            last[g] += inner["last_bytes_per_rank"][p]
            total[g] += inner["total_bytes_per_rank"][p]
        for n, g in enumerate(self._rail):
            last[g] += self._rail_last[n]
            total[g] += self._rail_total[n]
        me = self.rank
        return {
            "calls": self._calls,
            "last_bytes_per_rank": last,
            "total_bytes_per_rank": total,
            "last_wire_bytes": sum(b for r, b in enumerate(last) if r != me),
            "total_wire_bytes": sum(b for r, b in enumerate(total) if r != me),
            "last_internode_bytes": sum(self._rail_last),
            "internode_bytes": sum(self._rail_total),
            "last_intranode_bytes": inner["last_wire_bytes"],
            "intranode_bytes": inner["total_wire_bytes"],
            "nodes": [list(m) for m in self._nodes.ranks],
            "numa_node": inner["numa_node"],
            "numa_bound": inner["numa_bound"],
            "decisions": inner["decisions"],
        }

    # ---- low-latency mode: the normal path, laid out statically ----------------------
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        layout: str = "rows",
        return_fp8: bool = False,
        return_recv_hook: bool = False,
    ):
        """:meth:`Buffer.low_latency_dispatch`'s layouts and results, built on the normal
        path (across nodes the CPU backend has no separate low-latency protocol). With
        ``return_recv_hook`` the whole call runs now and the hook returns its result."""
        res = self._dispatch_one(x, topk_ids, topk_weights, return_fp8, layout=layout)
        out = self._ll_rows(res) if layout == "rows" else self._ll_expert_major(res)
        return self._with_hook(lambda: out, return_recv_hook, "low_latency_dispatch", self._seq)

    def low_latency_combine(
        self,
        y: torch.Tensor,
        handle: DispatchHandle,
        *,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
    ):
        """:meth:`Buffer.low_latency_combine` (``rows``: weighted rows ``[world, max_tokens,
        H]``; ``expert_major``: unweighted expert outputs, weighted and summed per row in
        fp32 here) on the normal path; with ``return_recv_hook`` the hook returns ``out``."""
        res = self._combine_one(y, handle, out, mode="low_latency")
        return self._with_hook(lambda: res, return_recv_hook, "low_latency_combine", self._seq)

    def _ll_rows(self, res: DispatchResult) -> DispatchResult:
        w, m, k = self.world, self.max_tokens_per_rank, self.num_topk
        handle = res.handle
        slot = handle.slot
        xo = torch.zeros(w * m, *res.x.shape[1:], dtype=res.x.dtype)
        xo[slot] = res.x
        scales = None
        if res.x_scales is not None:
            scales = torch.zeros(w * m, res.x_scales.shape[1], dtype=torch.float32)
            scales[slot] = res.x_scales
            scales = scales.view(w, m, -1)
        src_rank = torch.full((w * m,), -1, dtype=torch.int32)
        src_token = torch.full((w * m,), -1, dtype=torch.int32)
        ids = torch.full((w * m, k), -1, dtype=torch.int32)
        ws = torch.zeros(w * m, k, dtype=torch.float32)
        src_rank[slot], src_token[slot] = res.src_rank, res.src_token
        ids[slot], ws[slot] = res.topk_ids, res.topk_weights
        handle.mode, handle.layout = "low_latency", "rows"
        handle.row_base = torch.arange(w, dtype=torch.int64) * m
        return DispatchResult(
            x=xo.view(w, m, -1), x_scales=scales, src_rank=src_rank.view(w, m),
            src_token=src_token.view(w, m), topk_ids=ids.view(w, m, k),
            topk_weights=ws.view(w, m, k), recv_count=res.recv_count,
            tokens_per_expert=res.tokens_per_expert, handle=handle,
        )  # fmt: skip

    def _ll_expert_major(self, res: DispatchResult) -> DispatchResult:
        rows = self._ll_rows(res)
        w, m = self.world, self.max_tokens_per_rank
        e_local, cap = self.num_local_experts, w * m
        handle = res.handle
        handle.layout = "expert_major"
        ids, src = res.topk_ids, res.src_rank.long()
        handle.row_experts, handle.row_weights = ids, res.topk_weights
        xe = torch.zeros(e_local, cap, *res.x.shape[1:], dtype=res.x.dtype)
        scales = None
        if res.x_scales is not None:
            scales = torch.zeros(e_local, cap, res.x_scales.shape[1], dtype=torch.float32)
        src_info = torch.full((e_local, cap), -1, dtype=torch.int32)
        layout_range = torch.zeros(e_local, w, dtype=torch.int64)
        handle.expert_pos = torch.full(tuple(ids.shape), -1, dtype=torch.int64)
        for e in range(e_local):
            mine = (ids == e).any(dim=1).nonzero().flatten()  # in the flat row order
            n = mine.numel()
            xe[e, :n] = res.x[mine]
            if scales is not None:
                scales[e, :n] = res.x_scales[mine]
            src_info[e, :n] = res.src_token[mine]
            slot = (ids[mine] == e).int().argmax(dim=1)
            handle.expert_pos[mine, slot] = torch.arange(n)
            count = torch.bincount(src[mine], minlength=w)
            layout_range[e] = ((torch.cumsum(count, 0) - count) << 32) | count
        return DispatchResult(
            x=xe, x_scales=scales, src_rank=None, src_token=None, topk_ids=rows.topk_ids,
            topk_weights=rows.topk_weights, recv_count=res.recv_count,
            tokens_per_expert=res.tokens_per_expert, handle=handle, src_info=src_info,
            layout_range=layout_range,
        )  # fmt: skip

    def _rows_of(self, y: torch.Tensor, handle: InternodeHandle) -> torch.Tensor:
        """A low-latency combine's input as the normal combine's rows (flat order)."""
        w, m, h = self.world, self.max_tokens_per_rank, self.hidden
        if handle.layout == "rows":
            return self._check_y(y, (w, m, h)).view(w * m, h)[handle.slot]
        y = self._check_y(y, (self.num_local_experts, w * m, h))
        ids, ws = handle.row_experts, handle.row_weights
        acc = torch.zeros(ids.shape[0], h, dtype=torch.float32)
        for k in range(ids.shape[1]):  # slot order, as the flat pre-reduction sums
            rows = (ids[:, k] >= 0).nonzero().flatten()
            if rows.numel():
                part = y[ids[rows, k].long(), handle.expert_pos[rows, k]].float()
                acc[rows] += ws[rows, k : k + 1] * part
        return acc.to(self.dtype)

    # ---- calls -------------------------------------------------------------------------
    def _start(self) -> None:
        self._check_usable()
        if self._pending_hook is not None:
            what, seq = self._pending_hook
            raise RuntimeError(f"call the receive hook of {what} (call {seq}) before starting "
                               "another call on this Buffer")  # fmt: skip
        self._seq += 1
        self._rail_last = [0] * self._nodes.num_nodes

    def _count_call(self) -> None:
        self._calls += 1
        self._rail_total = [a + b for a, b in zip(self._rail_total, self._rail_last)]

    def _dispatch_one(self, x, topk_ids, topk_weights, return_fp8, pieces=False, layout="rows"):
        del pieces  # refused at construction
        self._start()
        bad = None
        try:
            self._check_options(layout, return_fp8)
            x = self._check_x(x)
            ids = self._check_topk_ids(topk_ids, x.shape[0])
            w = self._check_weights(topk_weights, ids).contiguous()
        except (TypeError, ValueError) as exc:
            bad = exc
        n_nodes, me_n, m = self._nodes.num_nodes, self._node, self.max_tokens_per_rank
        sent: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * n_nodes
        rows: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * n_nodes
        if bad is None:
            dest, vid = self._resolve(ids)
            dnode = self._node_of[dest]
            for n in range(n_nodes):
                if n != me_n:
                    sent[n] = (dnode == n).any(dim=1).nonzero().flatten()
                    rows[n] = self._pack(x, sent[n], vid, w, dnode == n)
        status = (_ABORTED, self.rank) if bad is not None else (_OK, -1)
        got, problem = self._rail_exchange("dispatch", status, rows, self._format.size, bad)
        if problem is not None:
            self._abort_inner(_OP_DISPATCH, problem)
            self._raise(problem)
        # the proxy's input: row n * m + t is token t of node n's rank on this rail
        k = self.num_topk
        big = n_nodes * m
        x_in = torch.zeros(big, self.hidden, dtype=self.dtype)
        ids_in = torch.full((big, k), -1, dtype=torch.int32)
        w_in = torch.zeros(big, k, dtype=torch.float32)
        t_own = x.shape[0]
        here = dnode == me_n
        base = me_n * m
        x_in[base : base + t_own] = x
        ids_in[base : base + t_own, : ids.shape[1]] = torch.where(here, vid, -1).to(torch.int32)
        w_in[base : base + t_own, : ids.shape[1]] = torch.where(here, w, 0.0)
        received = [torch.empty(0, dtype=torch.int64)] * n_nodes
        for n, (_, _, data) in enumerate(got):
            if n != me_n and data.numel():
                tok, r_ids, r_w, r_x = self._unpack(data)
                received[n] = tok
                x_in[n * m + tok] = r_x
                ids_in[n * m + tok] = r_ids
                w_in[n * m + tok] = r_w
        res = self._inner_call(self._inner._dispatch_one, x_in, ids_in, w_in, return_fp8)
        # back to the flat order: source rank, then token
        proxy = res.src_rank.long()
        node = res.src_token.long() // m
        token = res.src_token.long() % m
        ranks = torch.tensor(self._nodes.ranks, dtype=torch.int64)
        src = ranks[node, proxy] if proxy.numel() else proxy
        order = torch.sort(src * m + token, stable=True).indices
        counts_host = torch.bincount(src, minlength=self.world).tolist()
        bases = [0, *itertools.accumulate(counts_host[:-1])]
        send_token = torch.zeros(self.world * m, dtype=torch.int32)
        send_count = torch.zeros(self.world, dtype=torch.int32)
        for d in range(self.world):  # as a flat Buffer's handle has them
            toks = (dest == d).any(dim=1).nonzero().flatten()
            send_token[d * m : d * m + toks.numel()] = toks.to(torch.int32)
            send_count[d] = toks.numel()
        counts = torch.tensor(counts_host, dtype=torch.int32)
        handle = InternodeHandle(
            self._id, "normal", "rows", t_own, send_token, send_count, counts,
            torch.tensor(bases, dtype=torch.int64), recv_count_host=counts_host,
            row_base_host=bases, inner=res.handle, order=order, sent=sent, received=received,
        )  # fmt: skip
        src_sorted = src[order]
        handle.slot = src_sorted * m + (
            torch.arange(src_sorted.numel()) - torch.tensor(bases, dtype=torch.int64)[src_sorted]
        )
        self._count_load(ids)
        self._count_call()
        return DispatchResult(
            x=res.x[order],
            x_scales=None if res.x_scales is None else res.x_scales[order],
            src_rank=src[order].to(torch.int32),
            src_token=token[order].to(torch.int32),
            topk_ids=res.topk_ids[order],
            topk_weights=res.topk_weights[order],
            recv_count=counts,
            tokens_per_expert=res.tokens_per_expert,
            handle=handle,
        )

    def _combine_one(self, y, handle, out=None, mode="normal") -> torch.Tensor:
        self._start()
        bad = None
        try:
            handle = self._check_handle(handle, mode)
            if mode == "low_latency":
                y = self._rows_of(y, handle)
            y = self._check_y(y, (sum(handle.recv_count_host), self.hidden))
            out = self._check_out(out, handle.num_tokens)
        except (TypeError, ValueError) as exc:
            bad = exc
        n_nodes, me_n, m, h = (
            self._nodes.num_nodes,
            self._node,
            self.max_tokens_per_rank,
            self.hidden,
        )
        node_sum = None
        status, problem = (_OK, -1), bad
        if bad is not None:
            self._abort_inner(_OP_COMBINE, bad)
            status = (_ABORTED, self.rank)
        else:
            y_in = torch.empty_like(y)
            y_in[handle.order] = y
            try:
                node_sum = self._inner_call(self._inner_combine_fp32, y_in, handle.inner)
            except _native_errors()[0] as exc:
                problem = exc
                status = (self._status_of(exc), getattr(exc, "culprit", -1))
        rows = [torch.empty(0, dtype=torch.uint8)] * n_nodes
        if node_sum is not None:
            for n in range(n_nodes):
                if n != me_n:
                    back = node_sum[n * m + handle.received[n]]
                    rows[n] = back.contiguous().view(torch.uint8).flatten()
        got, problem = self._rail_exchange("combine", status, rows, 4 * h, problem)
        if problem is not None:
            self._raise(problem)
        acc = torch.zeros(handle.num_tokens, h, dtype=torch.float32)
        for n in range(n_nodes):  # node order: the flat sum's ranks, grouped by node
            if n == me_n:
                acc += node_sum[me_n * m : me_n * m + handle.num_tokens]
                continue
            back = got[n][2].view(torch.float32).view(-1, h)
            if back.shape[0] != handle.sent[n].numel():
                raise self._error(
                    _FAILED, self._rail[n],
                    f"returned {back.shape[0]} rows in combine (call {self._seq}) but "
                    f"{self._nodes.describe(self.rank)} sent {handle.sent[n].numel()} rows to "
                    "its node: every rank must combine the handles of the same dispatch",
                )  # fmt: skip
            acc.index_add_(0, handle.sent[n], back)
        if out is None:
            out = torch.empty(handle.num_tokens, h, dtype=self.dtype)
        out.copy_(acc)
        self._count_call()
        return out

    def _inner_combine_fp32(self, y_in: torch.Tensor, inner_handle: DispatchHandle):
        """The inner Buffer's combine, with the node's sums kept in fp32."""
        inner = self._inner
        seq, parity = inner._begin(_OP_COMBINE)
        handle = inner._guard(seq, _OP_COMBINE, inner._check_handle, inner_handle, "normal")
        tx = inner._transport
        tx.combine_send(
            seq & 0xFFFFFFFF, _OP_COMBINE, parity, y_in, handle.recv_count, handle.row_base,
            handle.recv_count_host, handle.row_base_host,
        )  # fmt: skip
        acc = torch.empty(handle.num_tokens, self.hidden, dtype=torch.float32)
        inner._protocol(
            tx.combine_recv_fp32, seq & 0xFFFFFFFF, _OP_COMBINE, parity, inner.timeout_s,
            handle.send_token, handle.send_count, handle.num_tokens, acc,
        )  # fmt: skip
        inner._record()
        return acc

    # ---- the rail hop ------------------------------------------------------------------
    def _pack(self, x, toks, vid, w, on_node) -> torch.Tensor:
        """Rail rows of tokens ``toks``: index, that node's virtual ids and weights, payload."""
        f, cnt, k = self._format, toks.numel(), self.num_topk
        buf = torch.zeros(cnt, f.size, dtype=torch.uint8)
        if cnt == 0:
            return buf.flatten()
        i32, f32 = buf.view(torch.int32), buf.view(torch.float32)
        mask = on_node[toks]
        i32[:, 0] = toks.to(torch.int32)
        k_in = vid.shape[1]
        ids = torch.full((cnt, k), -1, dtype=torch.int32)
        ids[:, :k_in] = torch.where(mask, vid[toks], -1).to(torch.int32)
        i32[:, f.ids // 4 : f.ids // 4 + k] = ids
        ws = torch.zeros(cnt, k, dtype=torch.float32)
        ws[:, :k_in] = torch.where(mask, w[toks], 0.0)
        f32[:, f.weights // 4 : f.weights // 4 + k] = ws
        h = self.hidden
        if f.fp8:
            q, scales = quantize_fp8(x[toks])  # bit for bit the native quantiser
            buf[:, f.payload : f.payload + h] = q.view(torch.uint8)
            f32[:, f.scales // 4 : f.scales // 4 + h // 128] = scales
        else:
            buf.view(torch.int16)[:, f.payload // 2 : f.payload // 2 + h] = x[toks].view(
                torch.int16
            )
        return buf.flatten()

    def _unpack(self, data: torch.Tensor):
        f, k, h = self._format, self.num_topk, self.hidden
        buf = data.view(-1, f.size)
        i32, f32 = buf.view(torch.int32), buf.view(torch.float32)
        tok = i32[:, 0].long()
        ids = i32[:, f.ids // 4 : f.ids // 4 + k]
        ws = f32[:, f.weights // 4 : f.weights // 4 + k]
        if f.fp8:
            q = buf[:, f.payload : f.payload + h].contiguous().view(torch.float8_e4m3fn)
            scales = f32[:, f.scales // 4 : f.scales // 4 + h // 128]
            x = dequantize_fp8(q, scales, self.dtype)
        else:
            x = buf.view(torch.int16)[:, f.payload // 2 : f.payload // 2 + h].view(self.dtype)
        return tok, ids, ws, x

    def _rail_exchange(self, what, status, rows, row_bytes, problem):
        """One exchange with every other node's rank on this rail: a header each way, then
        the rows. Returns ([node] -> (status, culprit, bytes), the problem to raise): the
        caller's own ``problem`` first, then a failed hop, then one a peer reports."""
        n_nodes, me_n = self._nodes.num_nodes, self._node
        pos = [dist.get_group_rank(self._rail_group, self._granks[g]) for g in self._rail]
        by_pos = sorted(range(n_nodes), key=lambda n: pos[n])
        hdr = torch.zeros(n_nodes, 4, dtype=torch.int32)
        for n in range(n_nodes):
            if n != me_n:
                hdr[pos[n]] = torch.tensor([status[0], rows[n].numel() // row_bytes, status[1], 0])
        got_hdr = torch.empty_like(hdr)
        try:
            dist.all_to_all_single(got_hdr, hdr, group=self._rail_group)
            in_sizes = [0 if n == me_n else int(got_hdr[pos[n], 1]) * row_bytes for n in by_pos]
            out_sizes = [0 if n == me_n else rows[n].numel() for n in by_pos]
            send = torch.cat([rows[n] for n in by_pos])
            recv = torch.empty(sum(in_sizes), dtype=torch.uint8)
            dist.all_to_all_single(recv, send, in_sizes, out_sizes, group=self._rail_group)
        except RuntimeError as exc:
            return None, problem or self._rail_error(what, exc)
        for n in range(n_nodes):
            if n != me_n:
                self._rail_last[n] += HEADER_BYTES + rows[n].numel()
        pieces = dict(zip(by_pos, torch.split(recv, in_sizes)))
        got = [
            (int(got_hdr[pos[n], 0]), int(got_hdr[pos[n], 2]), pieces[n]) for n in range(n_nodes)
        ]
        if problem is None:
            for n, (st, culprit, _) in enumerate(got):
                if n != me_n and st != _OK:
                    problem = self._error(
                        st, culprit, f"{_VERB[st]} in {what} (call {self._seq}); reported to "
                        f"{self._nodes.describe(self.rank)} over the rail by "
                        f"{self._nodes.describe(self._rail[n])}",
                    )  # fmt: skip
                    break
        return got, problem

    def _rail_error(self, what: str, exc: Exception) -> Exception:
        others = [g for n, g in enumerate(self._rail) if n != self._node]
        kind = _TIMED_OUT if "timed out" in str(exc).lower() else _FAILED
        text = (
            f"{_VERB[kind]}: the inter-node hop of {what} (call {self._seq}) from "
            f"{self._nodes.describe(self.rank)} failed (gloo: {str(exc).splitlines()[0][:300]})"
        )
        if len(others) == 1:
            return self._error(kind, others[0], text)
        names = "; ".join(self._nodes.describe(g) for g in others)
        return self._error(kind, -1, f"one of {names} {text}")

    def _error(self, kind: int, culprit: int, text: str) -> Exception:
        peer, timeout, aborted = _native_errors()
        cls = {_TIMED_OUT: timeout, _ABORTED: aborted}.get(kind, peer)
        name = self._nodes.describe(culprit) if 0 <= culprit < self.world else ""
        exc = cls(f"{name} {text}".strip())
        exc.culprit = culprit
        return exc

    @staticmethod
    def _status_of(exc: Exception) -> int:
        _, timeout, aborted = _native_errors()
        if isinstance(exc, aborted):
            return _ABORTED
        return _TIMED_OUT if isinstance(exc, timeout) else _FAILED

    def _raise(self, problem: Exception):
        peer, _, aborted = _native_errors()
        if isinstance(problem, peer) and not isinstance(problem, aborted):
            self._failed = str(problem)
        raise problem

    # ---- the node's stage --------------------------------------------------------------
    def _abort_inner(self, op: int, problem: Exception) -> None:
        """This rank skips the inner call: its node's ranks raise PeerAbortedError there,
        then learn why (:meth:`_why`)."""
        inner = self._inner
        try:
            seq, _ = inner._begin(op)
            inner._protocol(inner._transport.abort, seq & 0xFFFFFFFF, op, inner.timeout_s)
        except Exception:  # a node peer that failed too: ours is the error
            pass
        culprit = getattr(problem, "culprit", self.rank)
        kind = self._status_of(problem) if isinstance(problem, _native_errors()[0]) else _ABORTED
        text = str(problem)
        if kind == _ABORTED and not isinstance(problem, _native_errors()[0]):
            text = f"{self._nodes.describe(self.rank)} raised on bad input: {problem}"
        self._why((kind, culprit, text))

    def _why(self, mine):
        """The node's ranks that took part in an aborted inner call say what they know."""
        out: list = [None] * self._nodes.local_size
        try:
            dist.all_gather_object(out, mine, group=self._node_group)
        except Exception:  # a node peer is gone: each keeps its own error
            return []
        return [o for o in out if o]

    def _inner_call(self, fn, *args):
        peer, _, aborted = _native_errors()
        try:
            return fn(*args)
        except aborted as exc:
            known = self._why(None)
            if known:
                kind, culprit, text = known[0]
                if culprit >= 0 and text.startswith(self._nodes.describe(culprit)):
                    text = text[len(self._nodes.describe(culprit)) :].lstrip()
                raise self._error(kind, culprit, f"{text} (told by a rank of node {self._node} "
                                  "that gave up its part of the call)") from exc  # fmt: skip
            raise self._globalize(exc) from exc
        except peer as exc:
            raise self._globalize(exc) from exc

    def _globalize(self, exc: Exception) -> Exception:
        """A node transport error with the node's local rank numbers as group ranks."""
        members = self._nodes.ranks[self._node]
        msg = str(exc)
        waiting = re.search(r"waiting for rank\(s\) (\d+)", msg)
        first = waiting or re.search(r"\brank (\d+)", msg)
        culprit = members[int(first.group(1))] if first else -1

        def one(mt: re.Match) -> str:
            return f"rank {members[int(mt.group(1))]}"

        def many(mt: re.Match) -> str:
            return "rank(s) " + ", ".join(str(members[int(v)]) for v in mt.group(1).split(", "))

        msg = re.sub(r"rank\(s\) (\d+(?:, \d+)*)", many, msg)
        msg = re.sub(r"\brank (\d+)", one, msg)
        new = type(exc)(f"{msg} [{self._nodes.describe(culprit)}]" if culprit >= 0 else msg)
        new.culprit = culprit
        return new


_VERB = {_ABORTED: "aborted (it raised on bad input)", _FAILED: "failed or exited",
         _TIMED_OUT: "timed out"}  # fmt: skip
