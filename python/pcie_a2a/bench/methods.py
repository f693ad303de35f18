"""The three things the benchmark times, each as ``step(x, ids, w) -> (out, marks)``.

``marks`` are four stamps of the method's ``clock`` (``perf_counter_ns``; on a GPU after
``torch.cuda.synchronize``, see :func:`pcie_a2a.bench.device.make_clock`): start, dispatch
done, expert done, combine done. Every method works on the device of ``x`` (CPU or the
rank's GPU) with the process group it is given (gloo or NCCL). ``wire`` gives the bytes this rank sends across links (self traffic excluded) for
dispatch and combine: measured by the transport for ours, analytic for the baselines.

* ``pcie_a2a``: :class:`pcie_a2a.Buffer` dispatch, stand-in expert, combine.
* ``a2a``: what EP users write today with ``torch.distributed``: per-expert rows (a
  token is sent once per *expert*, bf16), counts exchanged first with a small
  ``all_to_all_single``, rows with a second one, the expert, the reverse
  ``all_to_all_single`` and a weighted sum at the source.
* ``ag_rs``: ``all_gather_into_tensor`` of x (and of the routing), every rank runs its
  local experts over all tokens, ``reduce_scatter_tensor`` of the partial outputs (or
  all-gather + local sum where the backend lacks reduce-scatter).
* ``ar_ep``: what SGLang's ``--ep`` with ``--moe-a2a-backend none`` does at decode: the
  tokens are replicated on every rank (no dispatch), each rank runs its local experts over
  all of them, and the MoE output ``[tokens, hidden]`` bf16 is ``all_reduce``d (the
  combine phase). Its inputs are the same on every rank (``replicated``).
* ``pcie_a2a[push]`` / ``pcie_a2a[pull]``: :class:`Ours` on a Buffer built with
  PCIE_A2A_DIRECTION forced (``--direction``; bench/arms.py).

The stand-in expert is :func:`pcie_a2a.reference.scale_expert` with *local* expert ids,
so the three produce the same output up to rounding (checked before timing).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pcie_a2a.bench.memory import CHUNK_ROWS
from pcie_a2a.reference import scale_expert

now = time.perf_counter_ns  # the CPU clock; GPU runs pass device.make_clock(...)
# torch >= 2.13 renamed the tensor collectives (the old names warn); use what exists.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def expert(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``scale_expert`` in row chunks (bounds its fp32 temporaries at 4096 tokens)."""
    if x.shape[0] <= CHUNK_ROWS:
        return scale_expert(x, ids, w)
    y = torch.empty_like(x)
    for i in range(0, x.shape[0], CHUNK_ROWS):
        j = i + CHUNK_ROWS
        y[i:j] = scale_expert(x[i:j], ids[i:j], w[i:j])
    return y


def weighted_sum(rows: torch.Tensor, token: torch.Tensor, w: torch.Tensor, t: int):
    """``out[token[i]] += w[i] * rows[i]`` in fp32, in row chunks; returns rows' dtype."""
    acc = torch.zeros(t, rows.shape[1], dtype=torch.float32, device=rows.device)
    for i in range(0, rows.shape[0], CHUNK_ROWS):
        j = i + CHUNK_ROWS
        acc.index_add_(0, token[i:j], rows[i:j].float() * w[i:j].unsqueeze(1))
    return acc.to(rows.dtype)


def expected_output(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, e_local: int):
    """fp32 ground truth of every method: ``x * sum_k w_k (1 + local_id_k / 64)``."""
    factor = (w * (1 + (ids % e_local).float() / 64)).sum(dim=1, keepdim=True)
    return x.float() * factor


class Ours:
    name = "pcie_a2a"
    replicated = False

    def __init__(self, buf, low_latency: bool, clock=now, name: str = "pcie_a2a"):
        self.name = name
        self.buf = buf
        self.low_latency = low_latency
        self.clock = clock
        self.wire = (0, 0)
        self.internode = (0, 0)  # of wire: bytes to other nodes (multi-node Buffer)

    def step(self, x, ids, w, record: bool = False):
        buf, h, now = self.buf, x.shape[1], self.clock
        t0 = now()
        if self.low_latency:
            r = buf.low_latency_dispatch(x, ids, w, layout="rows")
        else:
            r = buf.dispatch(x, ids, w)
        t1 = now()
        d_stats = buf.stats() if record else {}
        d_bytes = d_stats.get("last_wire_bytes", 0)
        if self.low_latency:
            k = r.topk_ids.shape[-1]
            y = expert(r.x.view(-1, h), r.topk_ids.view(-1, k), r.topk_weights.view(-1, k))
            y = y.view(r.x.shape)
        else:
            y = expert(r.x, r.topk_ids, r.topk_weights)
        t2 = now()
        combine = buf.low_latency_combine if self.low_latency else buf.combine
        out = combine(y, r.handle)
        t3 = now()
        if record:
            c_stats = buf.stats()
            self.wire = (d_bytes, c_stats["last_wire_bytes"])
            self.internode = (
                d_stats.get("last_internode_bytes", 0),
                c_stats.get("last_internode_bytes", 0),
            )
        return out, (t0, t1, t2, t3)


class PerExpertA2A:
    name = "a2a"
    replicated = False

    def __init__(self, group, world: int, rank: int, num_experts: int, clock=now):
        self.group, self.world, self.rank = group, world, rank
        self.e_local = num_experts // world
        self.num_experts = num_experts
        self.clock = clock
        self.wire = (0, 0)

    def step(self, x, ids, w, record: bool = False):
        t, k = ids.shape
        world, e_local, h, now = self.world, self.e_local, x.shape[1], self.clock
        t0 = now()
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send_split = counts.view(world, e_local).sum(1).tolist()
        recv_split = recv_counts.view(world, e_local).sum(1).tolist()
        rows = x.index_select(0, token)
        recv = x.new_empty(sum(recv_split), h)
        dist.all_to_all_single(recv, rows, recv_split, send_split, group=self.group)
        t1 = now()
        local = torch.arange(e_local, device=x.device).repeat(world)
        local = local.repeat_interleave(recv_counts)
        y = expert(recv, local.unsqueeze(1), torch.ones(local.shape[0], 1, device=x.device))
        t2 = now()
        back = x.new_empty(rows.shape[0], h)
        dist.all_to_all_single(back, y, send_split, recv_split, group=self.group)
        out = weighted_sum(back, token, w.reshape(-1)[order], t)
        t3 = now()
        if record:
            me = self.rank
            meta = 8 * e_local * (world - 1)
            row = 2 * h
            sent = sum(n for d, n in enumerate(send_split) if d != me)
            got = sum(n for s, n in enumerate(recv_split) if s != me)
            self.wire = (meta + sent * row, got * row)
        return out, (t0, t1, t2, t3)


def reduce_scatter_works(group, device: torch.device | None = None) -> bool:
    """Whether the backend can reduce-scatter bf16 tensors on ``device`` (collective: call
    on every rank)."""
    world = dist.get_world_size(group)
    try:
        out = torch.empty(1, dtype=torch.bfloat16, device=device)
        ones = torch.ones(world, dtype=torch.bfloat16, device=device)
        reduce_scatter(out, ones, group=group)
        return float(out) == world
    except (RuntimeError, NotImplementedError, ValueError):
        return False


class AllGatherReduceScatter:
    name = "ag_rs"
    replicated = False

    def __init__(self, group, world: int, rank: int, num_experts: int, has_rs: bool, clock=now):
        self.group, self.world, self.rank = group, world, rank
        self.e_local = num_experts // world
        self.has_rs = has_rs
        self.clock = clock
        self.wire = (0, 0)

    def step(self, x, ids, w, record: bool = False):
        t, k = ids.shape
        world, h, now = self.world, x.shape[1], self.clock
        t0 = now()
        gx = x.new_empty(world * t, h)
        all_gather(gx, x, group=self.group)
        meta = torch.cat([ids.float(), w], dim=1)  # ids < 2**24 are exact in fp32
        gmeta = meta.new_empty(world * t, 2 * k)
        all_gather(gmeta, meta, group=self.group)
        t1 = now()
        lo = self.rank * self.e_local
        gids = gmeta[:, :k].long()
        mine = (gids >= lo) & (gids < lo + self.e_local)
        local = torch.where(mine, gids - lo, torch.full_like(gids, -1))
        partial = expert(gx, local, torch.where(mine, gmeta[:, k:], 0.0))
        t2 = now()
        if self.has_rs:
            out = x.new_empty(t, h)
            reduce_scatter(out, partial, group=self.group)
        else:
            every = partial.new_empty(world, world * t, h)
            all_gather(every, partial, group=self.group)
            mine_rows = every[:, self.rank * t : (self.rank + 1) * t]
            out = mine_rows.float().sum(dim=0).to(x.dtype)
        t3 = now()
        if record:
            peers = world - 1
            combine_rows = t if self.has_rs else world * t
            self.wire = (peers * t * (2 * h + 8 * k), peers * combine_rows * 2 * h)
        return out, (t0, t1, t2, t3)


class AllReduceEP:
    """SGLang's EP without an all-to-all (``--moe-a2a-backend none``): replicated tokens,
    local experts over all of them, ``all_reduce`` of the output (see the module comment)."""

    name = "ar_ep"
    replicated = True  # x, ids, w are the same on every rank

    def __init__(self, group, world: int, rank: int, num_experts: int, clock=now):
        self.group, self.world, self.rank = group, world, rank
        self.e_local = num_experts // world
        self.clock = clock
        self.wire = (0, 0)

    def step(self, x, ids, w, record: bool = False):
        now = self.clock
        t0 = now()
        t1 = t0  # no dispatch: the tokens are already on every rank
        lo = self.rank * self.e_local
        mine = (ids >= lo) & (ids < lo + self.e_local)
        local = torch.where(mine, ids - lo, torch.full_like(ids, -1))
        out = expert(x, local, torch.where(mine, w, 0.0))
        t2 = now()
        dist.all_reduce(out, group=self.group)
        t3 = now()
        if record:  # a ring all-reduce sends 2 (W - 1) / W of the tensor per rank
            self.wire = (0, 2 * (self.world - 1) * out.numel() * out.element_size() // self.world)
        return out, (t0, t1, t2, t3)
