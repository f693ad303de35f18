"""``Buffer``: the expert-parallel communicator (dispatch and combine).

Mirrors DeepEP's Buffer where the semantics overlap (``get_dispatch_layout``, normal
``dispatch``/``combine``, ``low_latency_dispatch``/``low_latency_combine`` with the
expert-major layout), with two PCIe-driven differences:

* a token travels once per destination *rank*, carrying its local expert ids and weights
  there (``topk_ids``/``topk_weights`` of the received rows are *local* expert indices);
* combine takes one row per received row, already weighted and summed over that rank's
  experts (pre-reduction on the expert's rank); the source sums the partials in fp32.

The process group is used to bootstrap (exchange segment names, check that every rank
passed the same arguments, choose the backend, the CUDA self-test's verdict) and, only in a
Buffer with ``max_dispatch_tokens > max_tokens_per_rank``, for one all-reduce of the piece
count per normal dispatch; data moves through the transport.
"""

from __future__ import annotations

import itertools
import os
import secrets
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pcie_a2a import _native, env
from pcie_a2a.placement import Placement
from pcie_a2a.transport import TransportSpec, choose_backend, open_transport

_DTYPES = {torch.bfloat16: 0, torch.float16: 1}
_PAYLOADS = {"bf16": 0, "fp16": 1, "fp8": 2}
_OP_DISPATCH, _OP_COMBINE, _OP_LL_DISPATCH, _OP_LL_COMBINE = 1, 2, 3, 4
_LAYOUTS = ("rows", "expert_major")
# Identity of a Buffer in its handles. Not id(): CPython reuses a freed object's address,
# so a Buffer created after another was closed and freed often has the same id(); the old
# Buffer's handles (send_token sized world * its max_tokens, ...) then passed the check and
# the native combine indexed them with the new Buffer's sizes, reading past their end
# (found by AddressSanitizer). A process-wide counter never repeats.
_BUFFER_IDS = itertools.count(1)


@dataclass
class DispatchHandle:
    """What combine needs from a dispatch. Treat as opaque."""

    buffer_id: int
    mode: str  # "normal" | "low_latency"
    layout: str  # "rows" | "expert_major"
    num_tokens: int
    send_token: torch.Tensor  # [world * max_tokens] int32: token sent in slot j to rank d
    send_count: torch.Tensor  # [world] int32
    recv_count: torch.Tensor  # [world] int32: rows received from each source
    row_base: torch.Tensor  # [world] int64: first output row of each source
    expert_pos: torch.Tensor | None = None  # expert_major: [world * max_tokens, num_topk]
    row_experts: torch.Tensor | None = None
    row_weights: torch.Tensor | None = None
    # normal mode: recv_count and row_base as the host knows them (no device round trip)
    recv_count_host: list[int] | None = None
    row_base_host: list[int] | None = None


@dataclass
class DispatchResult:
    """Rows received by this rank.

    Normal mode (``dispatch``): ``x [R, H]`` compacted, rows grouped by source rank.
    Low-latency ``rows`` layout: ``x [world, max_tokens, H]``; rows past
    ``recv_count[s]`` are unspecified (their ``topk_ids`` are -1).
    Low-latency ``expert_major``: ``x [E_local, world * max_tokens, H]`` with
    ``tokens_per_expert`` rows valid per expert, ``src_info`` and ``layout_range`` as in
    DeepEP's low-latency layout; ``src_rank``/``src_token``/``topk_*`` describe rows.
    """

    x: torch.Tensor
    x_scales: torch.Tensor | None  # fp32 [..., H/128] when the fp8 payload is returned raw
    src_rank: torch.Tensor | None  # int32
    src_token: torch.Tensor | None  # int32
    topk_ids: torch.Tensor | None  # int32, local expert ids, -1 padded
    topk_weights: torch.Tensor | None  # fp32, 0 padded
    recv_count: torch.Tensor  # [world] int32 rows from each source rank
    tokens_per_expert: torch.Tensor  # [E_local] int32
    handle: DispatchHandle
    src_info: torch.Tensor | None = None  # expert_major: [E_local, cap] int32 source token
    layout_range: torch.Tensor | None = None  # expert_major: [E_local, world] int64
    _tokens_per_expert_list: list[int] | None = None

    @property
    def tokens_per_expert_list(self) -> list[int]:
        """``tokens_per_expert`` on the host. Computed when first asked for: on the CUDA
        backend that reads the device (a synchronisation), so the dispatch itself never does."""
        if self._tokens_per_expert_list is None:
            self._tokens_per_expert_list = self.tokens_per_expert.tolist()
        return self._tokens_per_expert_list


def _fail(kind: type[Exception], arg: str, got: Any, allowed: str) -> Exception:
    return kind(f"{arg}: got {got}; allowed: {allowed}")


class Buffer:
    """Dispatch/combine communicator for one expert-parallel group.

    Args:
        group: torch.distributed process group (bootstrap only). None: the default group.
        num_experts: global number of experts.
        hidden: hidden size H of a token.
        max_tokens_per_rank: most tokens a rank passes to one call (sizes the regions).
        dtype: dtype of x and of combine rows (bfloat16 or float16).
        payload: ``"bf16"``/``"fp16"`` (the dtype of x) or ``"fp8"`` (e4m3 plus one fp32
            scale per 128 channels, quantised by the sender).
        placement: a :class:`Placement`, or a list giving each expert's ``(rank, local)``
            (or a list of them for redundant copies). Default: contiguous blocks.
        backend: ``"auto"`` (``PCIE_A2A_BACKEND``; else ``"cuda"`` when every rank has a
            CUDA device and the build has the kernels, ``"cpu"`` when no rank has; decided
            collectively), ``"cpu"``, or ``"cuda"``. A Buffer on CUDA runs a known-answer
            dispatch + combine over every pair's path before it returns and raises on every
            rank when a pair fails (``PCIE_A2A_SELFTEST=0`` skips it: unsafe). The CUDA
            transport has not yet run on a GPU (see the README). On a GPU machine,
            ``"auto"`` means CUDA tensors: pass ``"cpu"`` to move CPU tensors.
        timeout_s: per-call deadline; a peer that does not arrive raises PeerTimeoutError.
            Default: ``PCIE_A2A_TIMEOUT_S`` or 30 s.
        num_topk: largest top-k a call may pass (expert slots per row on the wire).
        pair_direction: ``[world][world]`` of ``"push"``/``"pull"``, sender first (as
            ``RankTransfers.pair_direction``): how the rows of each ordered pair move, in dispatch
            (token's rank -> expert's rank) and combine (expert's rank -> token's rank).
            Pull runs on both backends (CUDA: P2P pairs; host-staged pairs always push).
            Default (None or empty): the transport decides, the same on every rank: CUDA
            takes the topology plan's ``pair_direction`` (gathered from rank 0; push
            without a plan), CPU pushes unless ``PCIE_A2A_DIRECTION`` says otherwise. After
            construction ``pair_direction`` holds what is used; ``stats()["decisions"]``
            gives each pair's direction with its reason (explicit, plan, env, default).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Buffer:
        # A group spanning several nodes gets the hierarchical Buffer (same API). Finding
        # the nodes is collective (the ranks' host names); Buffer.__new__(Buffer) without
        # arguments makes a bare object, as pickling and some tests do.
        if cls is Buffer and (args or kwargs) and dist.is_available() and dist.is_initialized():
            from pcie_a2a.internode import nodes_of_group

            group = args[0] if args else kwargs.get("group")
            nodes = nodes_of_group(group if group is not None else dist.group.WORLD)
            if nodes.num_nodes > 1:
                from pcie_a2a.internode.buffer import InternodeBuffer

                obj = super().__new__(InternodeBuffer)
                obj._nodes = nodes
                return obj
        return super().__new__(cls)

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_experts: int,
        hidden: int,
        max_tokens_per_rank: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        payload: str = "bf16",
        placement: Placement | list | None = None,
        backend: str = "auto",
        timeout_s: float | None = None,
        num_topk: int = 8,
        pair_direction: list[list[str]] | None = None,
        max_dispatch_tokens: int | None = None,
    ):
        self._transport = None
        self._closed = True
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Buffer needs an initialised torch.distributed process group")
        group = group if group is not None else dist.group.WORLD
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        for name, value in (
            ("num_experts", num_experts),
            ("hidden", hidden),
            ("max_tokens_per_rank", max_tokens_per_rank),
            ("num_topk", num_topk),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _fail(ValueError, name, repr(value), "a positive int")
        if max_dispatch_tokens is None:
            max_dispatch_tokens = max_tokens_per_rank
        if (
            not isinstance(max_dispatch_tokens, int)
            or isinstance(max_dispatch_tokens, bool)
            or max_dispatch_tokens < max_tokens_per_rank
        ):
            raise _fail(ValueError, "max_dispatch_tokens", repr(max_dispatch_tokens),
                        f"None or an int >= max_tokens_per_rank ({max_tokens_per_rank})")  # fmt: skip
        if dtype not in _DTYPES:
            raise _fail(TypeError, "dtype", dtype, "torch.bfloat16, torch.float16")
        if payload not in _PAYLOADS:
            raise _fail(ValueError, "payload", repr(payload), "'bf16', 'fp16', 'fp8'")
        if (
            payload in ("bf16", "fp16")
            and payload != {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        ):
            raise _fail(
                ValueError,
                "payload",
                repr(payload),
                f"'fp8' or the dtype of x ({'bf16' if dtype == torch.bfloat16 else 'fp16'})",
            )
        if hidden % 8:
            raise _fail(ValueError, "hidden", hidden, "a multiple of 8 (16-byte rows)")
        if payload == "fp8" and hidden % 128:
            raise _fail(ValueError, "hidden", hidden, "a multiple of 128 with payload='fp8'")
        if timeout_s is None:
            timeout_s = env.timeout_s(30.0)
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise _fail(ValueError, "timeout_s", repr(timeout_s), "a positive number of seconds")
        if placement is None:
            placement = Placement.contiguous(num_experts, self.world)
        elif not isinstance(placement, Placement):
            placement = Placement(placement, self.world)
        if placement.num_experts != num_experts or placement.world != self.world:
            raise _fail(
                ValueError,
                "placement",
                f"{placement.num_experts} experts on {placement.world} ranks",
                f"{num_experts} experts on {self.world} ranks",
            )
        # None: "auto" until the transport resolved it (see _bootstrap)
        self.pair_direction = _check_pair_direction(pair_direction, self.world)
        self.backend = choose_backend(backend, self._gather)  # collective: one verdict
        self.num_experts = num_experts
        self.hidden = hidden
        self.max_tokens_per_rank = max_tokens_per_rank
        self.max_dispatch_tokens = max_dispatch_tokens
        self.dtype = dtype
        self.payload = payload
        self.placement = placement
        self.timeout_s = float(timeout_s)
        self.num_topk = num_topk
        self.num_local_experts = placement.num_local_experts(self.rank)
        self._id = next(_BUFFER_IDS)  # see _BUFFER_IDS
        self._pending_hook: tuple[str, int] | None = None  # (call, seq) sent, not received
        self._seq = 0
        self._dispatch_calls = 0
        self._combine_calls = 0
        self._failed: str | None = None
        # Off by default: counting costs a few elementwise launches per dispatch, which the
        # low-latency path (0 host syncs, 4 launches) does not pay unless asked. The MoE
        # layer turns it on for its load window.
        self.count_expert_load = False
        self._x_limit = max_tokens_per_rank  # _check_x's bound (a piece-moving call raises it)
        self._load: torch.Tensor | None = None  # see expert_load()
        self._bootstrap()
        self.device = self._transport.device
        m = self.max_tokens_per_rank
        self._ll_row_base = torch.arange(self.world, dtype=torch.int64, device=self.device) * m

    # ---- construction ------------------------------------------------------------------
    def _config(self) -> dict:
        return {
            "num_experts": self.num_experts,
            "hidden": self.hidden,
            "max_tokens_per_rank": self.max_tokens_per_rank,
            "max_dispatch_tokens": self.max_dispatch_tokens,
            "dtype": str(self.dtype),
            "payload": self.payload,
            "num_topk": self.num_topk,
            "placement": self.placement.replicas,
            "replica_choice": self.placement.choice,
            "backend": self.backend,
            # auto: every rank must also see the same PCIE_A2A_DIRECTION (CPU resolves it)
            "pair_direction": self.pair_direction or ("auto", env.direction()),
            "wire_version": _native.transport().WIRE_VERSION,
        }

    def _gather(self, obj: Any) -> list:
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _bootstrap(self) -> None:
        uid = f"{os.getpid()}_{secrets.token_hex(6)}"
        gathered = self._gather((self._config(), uid))
        _check_same_config([g[0] for g in gathered])
        spec = TransportSpec(
            self.group, self.rank, self.world, self.hidden, self.max_tokens_per_rank,
            self.num_topk, _PAYLOADS[self.payload], _DTYPES[self.dtype], self.placement,
            self.timeout_s, self.pair_direction,
        )  # fmt: skip
        transport = open_transport(
            self.backend, spec, f"pcie_a2a.{gathered[0][1]}", self._check_all
        )
        # Garbage collection and interpreter exit cannot close collectively: abandon()
        # releases what no peer can still write into and leaves the rest to the process exit.
        self._finalizer = weakref.finalize(self, transport.abandon)
        # the self-test's calls came first: this Buffer's numbering continues after them
        self._seq, self._dispatch_calls, self._combine_calls = transport.calls_made()
        self.pair_direction = tuple(tuple(r) for r in transport.pair_direction)  # resolved
        if transport.numa_warning:
            warnings.warn(f"pcie_a2a rank {self.rank}: {transport.numa_warning}", stacklevel=4)
        self._transport = transport
        self._closed = False

    def _check_all(self, error: str | None, what: str) -> None:
        """Raises on every rank when any rank's local bootstrap step failed."""
        errors = [e for e in self._gather(error) if e]
        if errors:
            raise RuntimeError(f"Buffer bootstrap failed while {what}: " + "; ".join(errors))

    # ---- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Releases the shared memory (and, on the CUDA backend, device memory and IPC
        mappings). Safe to call twice; later calls raise.

        Call it on every rank after the last call. On the CPU backend it returns at once.
        On the CUDA backend it is collective: each rank closes its mappings of its peers and
        then waits (at most ``timeout_s``) until every peer has done the same before it
        frees the memory they wrote into; a peer that never closes leaves that memory
        allocated until the process exits (freeing memory a peer still has mapped is
        undefined behaviour). A Buffer dropped without close() (or alive at interpreter
        exit) is released the same way without waiting."""
        if not self._closed:
            try:  # stats() stays readable after close (the counts of the last calls)
                self._final_stats = self.stats()
            except Exception:  # a failed transport: close anyway
                self._final_stats = None
            self._closed = True
            self._finalizer.detach()
            self._transport.close()
            self._transport = None

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this Buffer is closed")
        if self._failed is not None:
            raise RuntimeError(
                f"this Buffer failed earlier and cannot be used: {self._failed}; "
                "close it and create a new one on every rank"
            )

    def check(self) -> None:
        """Raises a failure recorded asynchronously: on the CUDA backend a kernel that saw a
        peer time out, abort or disagree writes an error word that this (or the next call)
        turns into PeerTimeoutError / PeerAbortedError / PeerError. The CPU transport
        raises in the call itself, so there this only checks that the Buffer is usable."""
        self._check_usable()
        self._protocol(self._transport.check)

    # ---- stats -------------------------------------------------------------------------
    def stats(self) -> dict:
        """Bytes this rank wrote into each rank's memory, in the last call and in total,
        and the transport's per-pair decisions.

        Entry ``[self.rank]`` is the local copy; ``*_wire_bytes`` exclude it (bytes that
        cross a link). ``last_internode_bytes`` / ``internode_bytes`` (last call / total):
        the part sent to other nodes, 0 in a group on one node. ``decisions``: for each pair this rank sends on, the path, direction,
        engine and phase the transport uses and why, with the topology plan's decision for
        the pair where there is a plan (:func:`pcie_a2a.transport.pair_decisions`).
        """
        if self._closed:
            if getattr(self, "_final_stats", None) is None:
                raise RuntimeError("this Buffer is closed")
            return self._final_stats
        me = self.rank
        # the CUDA transport's send kernels count on the device (graph replays too)
        last, total, calls = self._transport.byte_stats()
        return {
            "calls": calls,
            "last_bytes_per_rank": list(last),
            "total_bytes_per_rank": list(total),
            "last_wire_bytes": sum(b for r, b in enumerate(last) if r != me),
            "total_wire_bytes": sum(b for r, b in enumerate(total) if r != me),
            "last_internode_bytes": 0,  # one node (see pcie_a2a.internode)
            "internode_bytes": 0,
            "numa_node": self._transport.numa_node,
            "numa_bound": bool(self._transport.numa_bound),
            "decisions": self._transport.decisions(),
        }

    def memory_bytes(self) -> dict[str, int | str]:
        """What this rank's transport holds: ``device`` and ``host`` bytes (per GPU on CUDA)
        and the regions they are made of, from the wire format's formulas
        (:func:`pcie_a2a.buffer_memory.transport_memory`, which ``pcie-a2a plan`` uses
        without building a Buffer) with this Buffer's pair decisions (pulled pairs,
        host-staged peers, the copy-engine threshold). Tensors the calls return are the
        caller's and not counted."""
        from pcie_a2a.buffer_memory import transport_memory

        self._check_usable()
        t = self._transport
        return transport_memory(
            self.backend, self.world, self.hidden, self.max_tokens_per_rank, self.num_topk,
            self.payload, with_pull=any("pull" in row for row in self.pair_direction),
            host_staged_peers=bool(getattr(t, "host_staged_peers", False)),
            copy_engine_min_bytes=getattr(t, "copy_engine_min_bytes", None),
        ).as_dict()  # fmt: skip

    def expert_load(self) -> torch.Tensor:
        """Tokens this rank sent to each global expert (``[num_experts]`` int64) in the
        dispatch calls since the last call of this method, which starts a new count.

        Counted where ``topk_ids`` live: on the host with the CPU backend, as a device
        tensor with the CUDA backend (an ``index_add_`` on the call's stream, no host
        synchronisation: the caller reads it when it wants the numbers). Replicas are not
        told apart: these are logical (global) expert ids, what the balancer takes.
        Needs ``count_expert_load = True`` (off by default; it adds three elementwise
        launches to every dispatch); ids outside ``[0, num_experts)`` are not counted."""
        if not self.count_expert_load:
            raise RuntimeError(
                "Buffer.expert_load(): counting is off; set buffer.count_expert_load = True "
                "before the dispatch calls to be counted (the MoE layer does)"
            )
        load = self._load
        if load is None:
            load = torch.zeros(self.num_experts, dtype=torch.int64, device=self.device)
        self._load = None
        return load

    def _count_load(self, ids: torch.Tensor) -> None:
        if not self.count_expert_load:
            return
        if self._load is None:
            self._load = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device)
        flat = ids.reshape(-1).long()
        # Bad ids are the transport's to report (on the device for CUDA): never index with one.
        valid = (flat >= 0) & (flat < self.num_experts)
        self._load.index_add_(0, flat * valid, valid.long())

    def _record(self) -> None:
        self._transport.record()

    # ---- layout ------------------------------------------------------------------------
    def get_dispatch_layout(
        self, topk_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(num_tokens_per_rank [world] int32, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, world] bool), as in DeepEP. Local: no communication."""
        self._check_usable()
        ids = self._check_topk_ids(topk_ids, None).cpu()  # host index math, any backend
        t = ids.shape[0]
        per_rank = torch.empty(self.world, dtype=torch.int32)
        per_expert = torch.empty(self.num_experts, dtype=torch.int32)
        in_rank = torch.empty(t, self.world, dtype=torch.uint8)
        _native.transport().dispatch_layout(
            ids.data_ptr(),
            t,
            ids.shape[1],
            self._placement_table(),
            self.world,
            self.rank,
            self.max_tokens_per_rank,
            per_rank.data_ptr(),
            per_expert.data_ptr(),
            in_rank.data_ptr(),
        )
        dev = self.device
        return per_rank.to(dev), per_expert.to(dev), in_rank.bool().to(dev)

    def _placement_table(self):
        if not hasattr(self, "_placement_native"):
            self._placement_native = _native.transport().Placement(
                *self.placement.csr(), self.world, *self.placement.choice_csr(self.rank)
            )
        return self._placement_native

    # ---- validation --------------------------------------------------------------------
    def _check_tensor(self, t: Any, name: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise _fail(TypeError, name, type(t).__name__, "a torch.Tensor")
        if t.device != self.device:
            raise _fail(
                ValueError,
                f"{name}.device",
                t.device,
                f"{self.device} (this Buffer uses the {self.backend} backend)",
            )
        if not t.is_contiguous():
            raise _fail(
                ValueError,
                name,
                f"a non-contiguous tensor with strides {t.stride()}",
                "a contiguous tensor (call .contiguous())",
            )
        return t

    def _check_x(self, x: Any) -> torch.Tensor:
        x = self._check_tensor(x, "x")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise _fail(ValueError, "x.shape", tuple(x.shape), f"[num_tokens, {self.hidden}]")
        if x.dtype != self.dtype:
            raise _fail(TypeError, "x.dtype", x.dtype, f"{self.dtype} (the Buffer's dtype)")
        limit = self._x_limit
        if x.shape[0] > limit:
            name = (
                "max_dispatch_tokens" if limit > self.max_tokens_per_rank else "max_tokens_per_rank"
            )
            raise _fail(ValueError, "x.shape[0] (num_tokens)", x.shape[0],
                        f"at most {name}={limit}")  # fmt: skip
        return x

    def _check_topk_ids(
        self, topk_ids: Any, num_tokens: int | None, on_device: bool = False
    ) -> torch.Tensor:
        """on_device: the values are the kernels' to check (no host synchronisation); int64
        ids go to them as they are."""
        ids = self._check_tensor(topk_ids, "topk_ids")
        if ids.dtype not in (torch.int32, torch.int64):
            raise _fail(TypeError, "topk_ids.dtype", ids.dtype, "torch.int64 or torch.int32")
        if ids.dim() != 2 or (num_tokens is not None and ids.shape[0] != num_tokens):
            raise _fail(
                ValueError,
                "topk_ids.shape",
                tuple(ids.shape),
                f"[{'num_tokens' if num_tokens is None else num_tokens}, k]",
            )
        if ids.shape[1] > self.num_topk:
            raise _fail(
                ValueError,
                "topk_ids.shape[1] (k)",
                ids.shape[1],
                f"at most num_topk={self.num_topk} (a Buffer argument)",
            )
        if on_device:
            return ids
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < -1 or hi >= self.num_experts:
                bad = lo if lo < -1 else hi
                raise _fail(
                    ValueError,
                    "topk_ids",
                    f"expert id {bad}",
                    f"-1 (no expert) or [0, {self.num_experts})",
                )
            srt = ids.sort(dim=1).values
            dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
            if bool(dup.any()):
                row = int(dup.any(dim=1).nonzero()[0])
                raise _fail(
                    ValueError,
                    "topk_ids",
                    f"row {row} = {ids[row].tolist()}",
                    "each expert at most once per token",
                )
        return ids.to(torch.int32).contiguous()

    def _check_weights(self, w: Any, ids: torch.Tensor) -> torch.Tensor:
        w = self._check_tensor(w, "topk_weights")
        if w.dtype != torch.float32:
            raise _fail(TypeError, "topk_weights.dtype", w.dtype, "torch.float32")
        if tuple(w.shape) != tuple(ids.shape):
            raise _fail(
                ValueError,
                "topk_weights.shape",
                tuple(w.shape),
                f"the shape of topk_ids {tuple(ids.shape)}",
            )
        return w

    # ---- dispatch ----------------------------------------------------------------------
    def _begin(self, op: int) -> tuple[int, int]:
        self._check_usable()
        if self._pending_hook is not None:
            what, seq = self._pending_hook
            raise RuntimeError(
                f"call the receive hook of {what} (call {seq}) before starting another call "
                "on this Buffer: a rank must receive call n before it sends call n + 1 (its "
                "peers reuse the memory of call n - 1 for it); overlap two micro-batches "
                "with one Buffer each"
            )
        self._seq += 1
        if op in (_OP_DISPATCH, _OP_LL_DISPATCH):
            self._dispatch_calls += 1
            parity = self._dispatch_calls & 1
        else:
            self._combine_calls += 1
            parity = self._combine_calls & 1
        # A problem an earlier call's kernels recorded (CUDA: a host-mapped word, no sync;
        # CPU: nothing, its calls raise). Bad ids of this rank raise ValueError and abort
        # this call on the wire, as the host check's ValueError does; a peer's failure
        # marks the Buffer failed.
        self._guard(self._seq, op, self._protocol, self._transport.check)
        return self._seq, parity

    def _guard(self, seq: int, op: int, fn, *args):
        """Runs a validation step; on bad input tells the peers before raising."""
        try:
            return fn(*args)
        except (TypeError, ValueError) as exc:
            self._abort(seq, op, exc)
            raise

    def _abort(self, seq: int, op: int, exc: Exception) -> None:
        """Makes every peer raise PeerAbortedError for this call instead of waiting."""
        try:
            self._protocol(self._transport.abort, seq & 0xFFFFFFFF, op, self.timeout_s)
        except Exception as abort_exc:
            raise exc from abort_exc

    def _protocol(self, fn, *args):
        native = _native.transport()
        try:
            return fn(*args)
        except native.PeerAbortedError:
            raise  # the peer raised on bad input; every rank skipped this call together
        except (native.PeerError, native.PeerTimeoutError) as exc:
            self._failed = str(exc)
            raise

    def _send_rows(self, seq: int, op: int, parity: int, x, topk_ids, topk_weights):
        num_tokens, send_token, send_count = self._send_half(
            seq, op, parity, x, topk_ids, topk_weights
        )
        return (num_tokens, send_token, send_count, *self._receive_counts(seq, op))

    def _receive_counts(self, seq: int, op: int) -> tuple[torch.Tensor, list[int]]:
        counts = self._protocol(self._transport.wait, seq & 0xFFFFFFFF, op, self.timeout_s)
        return torch.tensor(counts, dtype=torch.int32, device=self.device), counts

    def _with_hook(self, receive, return_recv_hook: bool, what: str, seq: int):
        """``receive()`` now, or a hook that runs it once, later (DeepEP's
        ``return_recv_hook``): the send half has been issued; the peers' rows or partials
        arrive while the caller computes, and the hook waits for them."""
        if not return_recv_hook:
            return receive()
        self._pending_hook = (what, seq)

        def hook():
            if self._pending_hook != (what, seq):
                raise RuntimeError(f"the receive hook of {what} (call {seq}) was already called")
            self._pending_hook = None
            return receive()

        return hook

    def _send_half(self, seq: int, op: int, parity: int, x, topk_ids, topk_weights):
        x = self._guard(seq, op, self._check_x, x)
        on_device = self._transport.ids_checked_on_device(op)
        ids = self._guard(seq, op, self._check_topk_ids, topk_ids, x.shape[0], on_device)
        w = self._guard(seq, op, self._check_weights, topk_weights, ids).contiguous()
        m = self.max_tokens_per_rank
        send_token = torch.empty(self.world * m, dtype=torch.int32, device=self.device)
        send_count = torch.empty(self.world, dtype=torch.int32, device=self.device)
        self._transport.dispatch_send(
            seq & 0xFFFFFFFF,
            op,
            parity,
            x,
            x.shape[0],
            ids,
            w,
            ids.shape[1],
            self._placement_table(),
            send_token,
            send_count,
        )
        self._count_load(ids)
        return x.shape[0], send_token, send_count

    def _check_options(self, layout: str, return_fp8: bool) -> None:
        if layout not in _LAYOUTS:
            raise _fail(ValueError, "layout", repr(layout), "'rows', 'expert_major'")
        if return_fp8 and self.payload != "fp8":
            raise _fail(ValueError, "return_fp8", True, "False unless payload='fp8'")

    def _payload_outputs(self, shape: tuple[int, ...], return_fp8: bool):
        if return_fp8:
            q = torch.empty(*shape, self.hidden, dtype=torch.uint8, device=self.device)
            s = torch.empty(*shape, self.hidden // 128, dtype=torch.float32, device=self.device)
            return q, s, None, q, s
        x = torch.empty(*shape, self.hidden, dtype=self.dtype, device=self.device)
        return x, None, x, None, None

    def dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        return_fp8: bool = False,
    ) -> DispatchResult:
        """Normal mode: sends each token once to every rank holding one of its experts.

        Args:
            x: ``[T, H]`` in the Buffer dtype, ``T <= max_tokens_per_rank`` (may be 0).
            topk_ids: ``[T, k]`` int64/int32 global expert ids, -1 = no expert.
            topk_weights: ``[T, k]`` float32 routing weights.
            return_fp8: with payload='fp8', return the received rows as e4m3 bytes
                (``x`` as float8_e4m3fn) and ``x_scales`` instead of dequantising.
        Returns: :class:`DispatchResult` with compacted rows grouped by source rank.
        With ``T > max_tokens_per_rank`` (``max_dispatch_tokens`` allows up to that), the
        call moves in pieces (:mod:`pcie_a2a.pieces`) and returns the same result.
        """
        if self.max_dispatch_tokens > self.max_tokens_per_rank:
            from pcie_a2a import pieces

            self._check_usable()
            return pieces.dispatch(self, x, topk_ids, topk_weights, return_fp8)
        return self._dispatch_one(x, topk_ids, topk_weights, return_fp8)

    def _dispatch_one(self, x, topk_ids, topk_weights, return_fp8, pieces=False):
        """One normal call (``pieces``: the call of a piece-moving Buffer whose x holds more
        than max_dispatch_tokens: the check then names that limit)."""
        self._x_limit = self.max_dispatch_tokens if pieces else self.max_tokens_per_rank
        try:
            return self._dispatch_call(x, topk_ids, topk_weights, return_fp8)
        finally:
            self._x_limit = self.max_tokens_per_rank

    def _dispatch_call(self, x, topk_ids, topk_weights, return_fp8):
        seq, parity = self._begin(_OP_DISPATCH)
        self._guard(seq, _OP_DISPATCH, self._check_options, "rows", return_fp8)
        num_tokens, send_token, send_count, counts, host = self._send_rows(
            seq, _OP_DISPATCH, parity, x, topk_ids, topk_weights
        )
        bases = [0, *itertools.accumulate(host[:-1])]
        row_base = torch.tensor(bases, dtype=torch.int64, device=self.device)
        result = self._unpack_rows(parity, counts, row_base, (sum(host),), return_fp8)
        handle = DispatchHandle(
            self._id, "normal", "rows", num_tokens, send_token, send_count, counts, row_base,
            recv_count_host=host, row_base_host=bases,
        )  # fmt: skip
        return self._finish_rows(result, counts, handle, return_fp8)

    def _unpack_rows(self, parity, counts, row_base, shape, return_fp8):
        k = self.num_topk
        xo, scales, x_dst, q_dst, s_dst = self._payload_outputs(shape, return_fp8)
        src_rank = torch.empty(*shape, dtype=torch.int32, device=self.device)
        src_token = torch.empty(*shape, dtype=torch.int32, device=self.device)
        ids = self._filled((*shape, k), torch.int32, -1)
        ws = self._filled((*shape, k), torch.float32, 0)
        per_expert = self._filled((self.num_local_experts,), torch.int32, 0)
        self._transport.unpack_rows(
            parity,
            counts,
            row_base,
            x_dst,
            q_dst,
            s_dst,
            src_rank,
            src_token,
            ids,
            ws,
            self.num_local_experts,
            per_expert,
        )
        if return_fp8:
            xo = xo.view(torch.float8_e4m3fn)
        return xo, scales, src_rank, src_token, ids, ws, per_expert

    def _finish_rows(self, unpacked, counts, handle, return_fp8) -> DispatchResult:
        xo, scales, src_rank, src_token, ids, ws, per_expert = unpacked
        self._record()
        return DispatchResult(
            x=xo,
            x_scales=scales,
            src_rank=src_rank,
            src_token=src_token,
            topk_ids=ids,
            topk_weights=ws,
            recv_count=counts,
            tokens_per_expert=per_expert,
            handle=handle,
        )

    def _filled(self, shape: tuple[int, ...], dtype: torch.dtype, value: int) -> torch.Tensor:
        """An output of the receive half, ``value`` wherever no row lands (the transport
        decides whether it must fill it: see Transport.output)."""
        return self._transport.output(shape, dtype, value)

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
        """Low-latency mode: static shapes (a fixed capacity of max_tokens_per_rank rows per
        source), for decode steps and CUDA graphs.

        ``layout="rows"``: ``x [world, max_tokens, H]``, ``recv_count[s]`` rows valid.
        ``layout="expert_major"``: ``x [E_local, world * max_tokens, H]`` plus
        ``tokens_per_expert``, ``src_info`` and ``layout_range`` (DeepEP's LL layout).

        Returns the :class:`DispatchResult`; with ``return_recv_hook=True`` only the send
        half runs now and a hook is returned: calling it (once) receives and returns the
        result, so the caller can compute in between. No other call of this Buffer may
        start before the hook is called.

        On the CUDA backend this (and :meth:`low_latency_combine`) never synchronises with
        the host, so both can be captured in a CUDA graph and replayed with new inputs:
        ``recv_count`` stays on the device (``tokens_per_expert_list`` reads it when asked
        for), the GPU checks ``topk_ids`` (an id outside [-1, E) or repeated in a token is
        skipped and raised as ValueError by the next call or :meth:`check`), and a peer's
        failure is raised the same way. int64 ids are read as they are.
        """
        seq, parity = self._begin(_OP_LL_DISPATCH)
        self._guard(seq, _OP_LL_DISPATCH, self._check_options, layout, return_fp8)
        sent = self._send_half(seq, _OP_LL_DISPATCH, parity, x, topk_ids, topk_weights)

        def receive() -> DispatchResult:
            counts = self._protocol(
                self._transport.ll_recv_counts, seq & 0xFFFFFFFF, _OP_LL_DISPATCH, self.timeout_s
            )
            return self._ll_unpack(parity, layout, return_fp8, *sent, counts)

        return self._with_hook(receive, return_recv_hook, "low_latency_dispatch", seq)

    def _ll_unpack(self, parity, layout, return_fp8, num_tokens, send_token, send_count, counts):
        w, m = self.world, self.max_tokens_per_rank
        row_base = self._ll_row_base
        handle = DispatchHandle(
            self._id, "low_latency", layout, num_tokens, send_token, send_count, counts, row_base
        )
        if layout == "rows":
            unpacked = self._unpack_rows(parity, counts, row_base, (w, m), return_fp8)
            return self._finish_rows(unpacked, counts, handle, return_fp8)
        e_local, cap, k = self.num_local_experts, w * m, self.num_topk
        xo, scales, x_dst, q_dst, s_dst = self._payload_outputs((e_local, cap), return_fp8)
        per_expert = self._filled((e_local,), torch.int32, 0)
        src_info = self._filled((e_local, cap), torch.int32, -1)
        layout_range = self._filled((e_local, w), torch.int64, 0)
        handle.expert_pos = torch.empty(cap, k, dtype=torch.int32, device=self.device)
        handle.row_experts = self._filled((cap, k), torch.int32, -1)
        handle.row_weights = self._filled((cap, k), torch.float32, 0)
        self._transport.unpack_expert_major(
            parity,
            counts,
            e_local,
            x_dst,
            q_dst,
            s_dst,
            per_expert,
            src_info,
            layout_range,
            handle.expert_pos,
            handle.row_experts,
            handle.row_weights,
        )
        if return_fp8:
            xo = xo.view(torch.float8_e4m3fn)
        self._record()
        return DispatchResult(
            x=xo,
            x_scales=scales,
            src_rank=None,
            src_token=None,
            topk_ids=handle.row_experts.view(w, m, k),
            topk_weights=handle.row_weights.view(w, m, k),
            recv_count=counts,
            tokens_per_expert=per_expert,
            handle=handle,
            src_info=src_info,
            layout_range=layout_range,
        )

    # ---- combine -----------------------------------------------------------------------
    def _check_handle(self, handle: Any, mode: str) -> DispatchHandle:
        if not isinstance(handle, DispatchHandle):
            raise _fail(
                TypeError,
                "handle",
                type(handle).__name__,
                "the handle of a DispatchResult of this Buffer",
            )
        if handle.buffer_id != self._id:
            raise _fail(
                ValueError,
                "handle",
                "a handle of another Buffer",
                "the handle of a DispatchResult of this Buffer",
            )
        if handle.mode != mode:
            other = "low_latency_combine" if handle.mode == "low_latency" else "combine"
            raise _fail(
                ValueError,
                "handle",
                f"a {handle.mode}-mode handle",
                f"a {mode}-mode handle (use {other} for this one)",
            )
        return handle

    def _check_rows(self, t: Any, name: str, shape: tuple[int, ...], rows_are: str):
        t = self._check_tensor(t, name)
        if tuple(t.shape) != shape:
            raise _fail(ValueError, f"{name}.shape", tuple(t.shape), f"{list(shape)}: {rows_are}")
        if t.dtype != self.dtype:
            raise _fail(TypeError, f"{name}.dtype", t.dtype, f"{self.dtype} (the Buffer's dtype)")
        return t

    def _check_y(self, y: Any, shape: tuple[int, ...]) -> torch.Tensor:
        return self._check_rows(y, "y", shape, "one row per received row of the dispatch")

    def _check_out(self, out: Any, num_tokens: int) -> torch.Tensor | None:
        if out is None:
            return None
        shape = (num_tokens, self.hidden)
        return self._check_rows(out, "out", shape, "one row per token of the dispatch")

    def _combine(self, seq, op, parity, rows, handle: DispatchHandle, hook=False, out=None):
        # recv_count_host (normal mode): a copy-engine path sizes its copies on the host
        self._transport.combine_send(
            seq & 0xFFFFFFFF, op, parity, rows, handle.recv_count, handle.row_base,
            handle.recv_count_host, handle.row_base_host,
        )  # fmt: skip
        return self._combine_receive(seq, op, parity, handle, hook, out)

    def _combine_receive(self, seq, op, parity, handle: DispatchHandle, hook: bool, out=None):
        def receive() -> torch.Tensor:
            # every row is written (a token routed nowhere gets zeros), so a caller's
            # tensor needs no clearing and an empty one is as good
            dst = out
            if dst is None:
                dst = torch.empty(handle.num_tokens, self.hidden, dtype=self.dtype,
                                  device=self.device)  # fmt: skip
            self._protocol(
                self._transport.combine_recv,
                seq & 0xFFFFFFFF,
                op,
                parity,
                self.timeout_s,
                handle.send_token,
                handle.send_count,
                handle.num_tokens,
                dst,
            )
            self._record()
            return dst

        return self._with_hook(receive, hook, "low_latency_combine", seq)

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Returns ``[T, H]`` in the Buffer dtype: for each token, the fp32 sum (in ascending
        rank order) of the rows its destination ranks return.

        ``y [R, H]``: one row per received row of the dispatch, already weighted by the
        routing weights and summed over that rank's local experts of the row.
        ``out``: a contiguous ``[T, H]`` tensor of the Buffer's dtype and device (not ``y``)
        that receives the result, which is then returned (no allocation, no copy).
        """
        from pcie_a2a.pieces import PiecesHandle

        if isinstance(handle, PiecesHandle):
            self._check_usable()
            self._check_handle(handle, "normal")
            y = self._check_y(y, (sum(handle.recv_count_host), self.hidden))
            out = self._check_out(out, handle.num_tokens)
            from pcie_a2a import pieces

            return pieces.combine(self, y, handle, out)
        return self._combine_one(y, handle, out)

    def _combine_one(self, y, handle, out=None) -> torch.Tensor:
        seq, parity = self._begin(_OP_COMBINE)
        handle = self._guard(seq, _OP_COMBINE, self._check_handle, handle, "normal")
        host = handle.recv_count_host
        total = sum(host) if host is not None else int(handle.recv_count.sum())
        y = self._guard(seq, _OP_COMBINE, self._check_y, y, (total, self.hidden))
        out = self._guard(seq, _OP_COMBINE, self._check_out, out, handle.num_tokens)
        return self._combine(seq, _OP_COMBINE, parity, y, handle, out=out)

    def low_latency_combine(
        self,
        y: torch.Tensor,
        handle: DispatchHandle,
        *,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
    ):
        """Low-latency combine. With the ``rows`` layout ``y [world, max_tokens, H]`` holds
        weighted, summed rows as in :meth:`combine`. With ``expert_major``,
        ``y [E_local, world * max_tokens, H]`` holds *unweighted* expert outputs: this rank
        applies the routing weights and sums each row's experts (fp32) before sending.
        ``return_recv_hook=True``: sends now, returns a hook that receives and returns the
        output (as in :meth:`low_latency_dispatch`). ``out`` as in :meth:`combine`
        (DeepEP's ``low_latency_combine(out=)``): the result lands there, with or without
        a hook.
        """
        seq, parity = self._begin(_OP_LL_COMBINE)
        op = _OP_LL_COMBINE
        handle = self._guard(seq, op, self._check_handle, handle, "low_latency")
        w, m = self.world, self.max_tokens_per_rank
        if handle.layout == "rows":
            y = self._guard(seq, op, self._check_y, y, (w, m, self.hidden))
            out = self._guard(seq, op, self._check_out, out, handle.num_tokens)
            return self._combine(seq, op, parity, y, handle, return_recv_hook, out)
        y = self._guard(seq, op, self._check_y, y, (self.num_local_experts, w * m, self.hidden))
        out = self._guard(seq, op, self._check_out, out, handle.num_tokens)
        # CUDA: the weighted pre-reduction fused into the push (one kernel); CPU: reduce, send
        self._transport.combine_send_expert_major(
            seq & 0xFFFFFFFF,
            op,
            parity,
            y,
            handle.recv_count,
            handle.row_base,
            handle.expert_pos,
            handle.row_experts,
            handle.row_weights,
        )
        return self._combine_receive(seq, op, parity, handle, return_recv_hook, out)


def _check_same_config(configs: list[dict]) -> None:
    """Raises (on every rank: each has the same gathered list) when ranks disagree."""
    for key, mine in configs[0].items():
        values = [c[key] for c in configs]
        if any(v != mine for v in values):
            shown = values if key not in ("placement", "replica_choice") else "(differs)"
            raise ValueError(
                f"Buffer argument {key!r} differs between ranks: {shown}; "
                "every rank must pass the same value"
            )


def _check_pair_direction(direction: Any, world: int) -> tuple[tuple[str, ...], ...] | None:
    if direction is None or (isinstance(direction, (list, tuple)) and len(direction) == 0):
        return None  # auto: the transport decides (RankTransfers's "no decision" is empty too)
    rows = [list(r) for r in direction] if isinstance(direction, (list, tuple)) else None
    if rows is None or len(rows) != world or any(len(r) != world for r in rows):
        raise _fail(
            ValueError, "pair_direction", repr(direction), f"[{world}][{world}] of 'push'/'pull'"
        )
    for s, row in enumerate(rows):
        for d, v in enumerate(row):
            if v not in ("push", "pull") or (s == d and v != "push"):
                allowed = "'push' (a rank never pulls from itself)" if s == d else "'push', 'pull'"
                raise _fail(ValueError, f"pair_direction[{s}][{d}]", repr(v), allowed)
    return tuple(tuple(r) for r in rows)
