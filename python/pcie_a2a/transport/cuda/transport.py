"""``CudaTransport``: one rank's CUDA transport, its lifecycle and the calls the Buffer
makes (:mod:`pcie_a2a.transport.base`). The package docstring (:mod:`pcie_a2a.transport.cuda`)
says what runs where and how the roles are split; the bootstrap is :mod:`.bootstrap`, the
graph-capturable calls :mod:`.calls`. NOT YET RUN ON A GPU."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from pcie_a2a import env
from pcie_a2a.placement import Placement
from pcie_a2a.transport.base import Transport, pair_decisions
from pcie_a2a.transport.cuda.bootstrap import Bootstrap
from pcie_a2a.transport.cuda.calls import AsyncCalls
from pcie_a2a.transport.cuda.common import (
    _FAMILY,
    _OP_COMBINE,
    _OP_DISPATCH,
    _OP_LL_COMBINE,
    _OP_LL_DISPATCH,
    P2P,
    STAGED,
    _aligned,
    _ptr,
    _release,
    package,
)


class CudaTransport(Bootstrap, AsyncCalls, Transport):
    """CUDA dispatch/combine transport of one rank.

    Args:
        group: process group used to bootstrap (None: the default group).
        rank, world: this rank and the group size.
        hidden, max_tokens, num_topk: as in ``ShmTransport``.
        payload: wire payload code (0 bf16, 1 fp16, 2 fp8); dtype: 0 bf16, 1 fp16.
        placement: the :class:`Placement` (copied to the device once).
        device: CUDA device index (default: the current device).
        timeout_s: deadline of every device-side wait, and of :meth:`close`'s wait for the
            peers.
        pair_transport: optional ``[world][world]`` of "p2p"/"staged" (or 0/1), sender
            first; default: the topology plan (below).
        send_order: optional ``[world][world]`` destination order per sender; default:
            the planner's rounds, else ``rank + 1, rank + 2, ..., rank``.
        staging_numa: optional NUMA node of this rank's host staging memory (default:
            the topology plan's node for this receiver, else first touch).
        copy_engine_min_bytes: normal-mode pairs moving at least this many bytes use the
            copy engine (``cudaMemcpyAsync``), the rest warp stores; None disables it.
            Default: PCIE_A2A_COPY_ENGINE_MIN_BYTES (256 KiB). Low-latency calls always
            use warp stores (they must stay capturable and free of host synchronisation).
        probe_timeout_s: how long the bootstrap probe waits for every pair's pattern.
        pair_direction: optional ``[world][world]`` of "push"/"pull" (sender first); default:
            the topology plan's ``pair_direction``, push without a plan. A pulled P2P pair's
            sender stages its rows in its own segment and the receiver's SM loads them
            (``csrc/cuda/transport/pull.cuh``); host-staged pairs always push.
            ``pair_direction`` / ``direction_reasons`` hold what is used and why.

    Rank 0 plans the pairs with the topology planner (PCIE_A2A_TOPO_FILE or the live
    machine, PCIE_A2A_P2P / PCIE_A2A_P2P_LEVEL, ranks matched to GPUs by PCI address;
    :mod:`pcie_a2a.topology.ranks`) and every rank uses that plan where no explicit
    argument replaces it; a pair is P2P only if the plan and the sender's CUDA peer access
    both allow it. ``topology_note`` says where the plan came from. Every receive grid is
    capped at PCIE_A2A_RECV_BLOCKS blocks (default one per SM); PCIE_A2A_PDL=0 turns off
    programmatic dependent launch.
    """

    # Buffer: the low-latency calls keep counts on the device, the kernels check the ids and
    # write every output element, and the expert-major combine is fused (no host sync).
    device_side = True

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        world: int,
        hidden: int,
        max_tokens: int,
        num_topk: int,
        payload: int,
        dtype: int,
        placement: Placement,
        *,
        device: int | None = None,
        timeout_s: float = 30.0,
        pair_transport: list[list[Any]] | None = None,
        send_order: list[list[int]] | None = None,
        staging_numa: int | None = None,
        copy_engine_min_bytes: int | str | None = "env",
        probe_timeout_s: float = 5.0,
        pair_direction: Any = None,
    ):
        mod = package().native()
        self._setup(rank, world, hidden, max_tokens, num_topk, payload, dtype, placement,
                    device, timeout_s, copy_engine_min_bytes)  # fmt: skip
        self.group = group if group is not None else dist.group.WORLD
        self._bootstrap(mod, placement, pair_transport, send_order, staging_numa,
                        float(probe_timeout_s), pair_direction)  # fmt: skip

    def _setup(self, rank, world, hidden, max_tokens, num_topk, payload, dtype, placement,
               device, timeout_s, copy_engine_min_bytes) -> None:  # fmt: skip
        if copy_engine_min_bytes == "env":
            copy_engine_min_bytes = env.copy_engine_min_bytes()
        elif copy_engine_min_bytes is not None and (
            not isinstance(copy_engine_min_bytes, int) or copy_engine_min_bytes < 0
        ):
            raise ValueError(
                f"copy_engine_min_bytes: got {copy_engine_min_bytes!r}, expected an int >= 0 "
                "or None (warp stores only)"
            )
        self.copy_engine_min_bytes = copy_engine_min_bytes
        self._native = None
        self._finalizer = weakref.finalize(self, _release, None, [])
        self._names: list[str] = []
        self._prefix = ""
        self.group = None
        self.rank, self.world = rank, world
        self.hidden, self.max_tokens, self.num_topk = hidden, max_tokens, num_topk
        self.payload, self.dtype_code = payload, dtype
        self.dtype = torch.bfloat16 if dtype == 0 else torch.float16
        self.timeout_s = float(timeout_s)
        self.device = package()._device(device)
        self.num_local_experts = placement.num_local_experts(rank)
        self.numa_warning = ""
        self.environment_warnings: list[str] = []
        self.topology_plan, self.topology_note = None, "explicit plan"
        self._seq = 0
        self._calls = [0, 0]
        self._dispatch_ticket: torch.Tensor | None = None
        self._combine_ticket: torch.Tensor | None = None
        self._dispatch_op = 0
        self._combine_op = 0
        self._last_counts: tuple[str, torch.Tensor] | None = None
        self._counts_dev: torch.Tensor | None = None
        zeros = [0] * world
        self._stats_base = ((zeros, zeros), 0)

    @classmethod
    def in_process(cls, *args, **kwargs) -> list[CudaTransport]:
        """See :func:`pcie_a2a.transport.cuda.in_process.in_process`."""
        from pcie_a2a.transport.cuda.in_process import in_process

        return in_process(cls, *args, **kwargs)

    @staticmethod
    def close_in_process(transports: list[CudaTransport]) -> list[bool]:
        """See :func:`pcie_a2a.transport.cuda.in_process.close_in_process`."""
        from pcie_a2a.transport.cuda.in_process import close_in_process

        return close_in_process(transports)

    # ---- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Collective close: call it on every rank after the last call. Closes this rank's
        mappings of its peers, tells them so (a close mark in their memory), then waits (at
        most ``timeout_s``) for every peer's mark before freeing its own memory. A peer that
        never closes leaves this rank's device segment allocated until the process exits
        (with a warning): freeing memory a peer still has mapped is undefined behaviour."""
        tx, self._native = self._native, None
        if tx is None:
            return
        self._finalizer.detach()
        try:
            tx.close_imports()
            freed = tx.free_own(self.timeout_s)
        finally:
            _release(None, self._names)
        if not freed:
            warnings.warn(
                f"pcie_a2a rank {self.rank}: not every peer closed its CUDA transport within "
                f"{self.timeout_s:g} s; this rank's device segment stays allocated until the "
                "process exits (a peer may still have it mapped)",
                ResourceWarning,
                stacklevel=2,
            )

    def abandon(self) -> None:
        """The non-collective close (garbage collection, interpreter exit): no wait for the
        peers; memory a peer may still write into stays allocated until the process exits."""
        self._native = None
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._native is None

    def _tx(self):
        if self._native is None:
            raise RuntimeError("this CUDA transport is closed")
        return self._native

    def check(self) -> None:
        """Raises what a kernel recorded (PeerTimeoutError, PeerAbortedError, PeerError, or
        ValueError for this rank's bad topk_ids). Reads host-mapped memory: no sync."""
        self._tx().check()

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _sync_stream(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def new_ticket(self) -> torch.Tensor:
        """A device CallTicket (one per call in flight; keep it alive with the handle).
        Uninitialised: the send kernel of the call writes it."""
        return torch.empty(4, dtype=torch.int32, device=self.device)

    def _advance(self, seq: int | None, op: int, parity: int | None) -> None:
        fam = _FAMILY[op]
        self._seq += 1
        self._calls[fam] += 1
        if seq is not None and (seq != self._seq or parity not in (None, self._calls[fam] & 1)):
            raise RuntimeError(
                f"CUDA transport out of step: call {seq} (parity {parity}) but the host "
                f"counts call {self._seq} (parity {self._calls[fam] & 1})"
            )

    # ---- the ShmTransport interface (what Buffer calls) ----------------------------------
    # Normal mode (_OP_DISPATCH / _OP_COMBINE) synchronises like the CPU transport; the
    # low-latency ops never do (see device_side). The Buffer calls check() before each call
    # (an earlier call's problem is raised before the call consumes a number).
    def dispatch_send(
        self,
        seq,
        op,
        parity,
        x,
        num_tokens,
        topk_ids,
        topk_weights,
        topk,
        placement,
        send_token,
        send_count,
    ) -> None:
        del placement  # the device copy from construction is used
        if num_tokens != x.shape[0] or topk != topk_ids.shape[1]:
            raise ValueError("num_tokens/topk disagree with the tensors")
        x = _aligned(x)
        self._dispatch_ticket = self.new_ticket()
        slot = self._tx().dispatch_slot_bytes
        ce = op == _OP_DISPATCH and self._copy_engine_could_serve(num_tokens * slot)
        self._launch_dispatch(
            self._dispatch_ticket,
            op,
            x,
            topk_ids,
            topk_weights,
            send_token,
            send_count,
            self.copy_engine_min_bytes if ce else None,
        )
        self._dispatch_op = op
        self._advance(seq, op, parity)

    def _copy_engine_could_serve(self, largest_pair_bytes: int) -> bool:
        """Whether some pair may reach the copy-engine threshold (else skip its host sync)."""
        limit = self.copy_engine_min_bytes
        return limit is not None and largest_pair_bytes > 0 and largest_pair_bytes >= limit

    @property
    def last_copy_engine_ranks(self) -> list[int]:
        """Ranks the last normal-mode send moved with the copy engine."""
        mask = self._tx().last_ce_mask
        return [r for r in range(self.world) if (mask >> r) & 1]

    def _counts(self) -> torch.Tensor:
        if self._counts_dev is None:
            self._counts_dev = torch.zeros(self.world, dtype=torch.int32, device=self.device)
        return self._counts_dev

    def wait(self, seq, op, timeout_s) -> list[int]:
        """Host-synchronising wait for the current dispatch call's flags (normal mode)."""
        del seq, op
        tx = self._tx()
        counts = self._counts()
        tx.wait_counts(
            _ptr(self._dispatch_ticket), _ptr(counts), float(timeout_s), False, self._stream()
        )
        host = counts.tolist()  # synchronises the stream
        tx.check()
        return host

    def ll_counts(self) -> torch.Tensor:
        """The counts of a low-latency dispatch: a device tensor the receive kernel fills
        (no wait on the host)."""
        return torch.empty(self.world, dtype=torch.int32, device=self.device)

    def ll_recv_counts(self, seq, op, timeout_s) -> torch.Tensor:
        """Low latency: the counts tensor the receive kernel fills (no host wait)."""
        del seq, op, timeout_s
        return self.ll_counts()

    def ids_checked_on_device(self, op: int) -> bool:
        """The low-latency dispatch kernels check topk_ids (a host check would sync)."""
        return op == _OP_LL_DISPATCH

    def output(self, shape: tuple[int, ...], dtype: torch.dtype, fill: int) -> torch.Tensor:
        """The kernels write every element of their outputs: no fill launch."""
        del fill
        return torch.empty(*shape, dtype=dtype, device=self.device)

    def abort(self, seq, op, timeout_s: float | None = None) -> None:
        """Publishes abort flags for this call, then still receives it: waits for every
        peer's flag of the call (their rows or their own aborts), so that this rank does
        not send call n + 1 before it has received call n (the reuse invariant of
        core/wire_format.h). Only arrival counts here (a peer's abort or other call is not
        raised, as in the CPU transport); a peer that never sends raises PeerTimeoutError."""
        ticket = self.new_ticket()
        tx = self._tx()
        tx.abort(_ptr(ticket), op, _FAMILY[op], self._stream())
        self._advance(seq, op, None)
        if _FAMILY[op] == 0:
            self._dispatch_ticket = ticket
        else:
            self._combine_ticket = ticket
        wait_s = self.timeout_s if timeout_s is None else float(timeout_s)
        tx.wait_counts(_ptr(ticket), _ptr(self._counts()), wait_s, True, self._stream())
        self._sync_stream()
        tx.check()

    def unpack_rows(
        self,
        parity,
        counts,
        row_base,
        x_out,
        fp8_out,
        scales_out,
        src_rank,
        src_token,
        topk_ids,
        topk_weights,
        num_local_experts,
        expert_count,
    ) -> None:
        """Normal mode: counts from :meth:`wait`, compacted rows at row_base. Low latency:
        the kernel waits for the flags itself and writes counts (row (s, j) at s * M + j)."""
        del parity, num_local_experts
        ll = self._dispatch_op == _OP_LL_DISPATCH
        self.recv_rows_async(
            self._dispatch_ticket,
            counts,
            x_out,
            fp8_out,
            scales_out,
            src_rank,
            src_token,
            topk_ids,
            topk_weights,
            expert_count,
            wait=ll,
            row_base=None if ll else row_base,
        )

    def unpack_expert_major(
        self,
        parity,
        counts,
        num_local_experts,
        x_out,
        fp8_out,
        scales_out,
        expert_count,
        src_info,
        layout_range,
        expert_pos,
        row_experts,
        row_weights,
    ) -> None:
        del parity, num_local_experts
        self.recv_expert_major_async(
            self._dispatch_ticket,
            counts,
            x_out,
            fp8_out,
            scales_out,
            expert_count,
            src_info,
            layout_range,
            expert_pos,
            row_experts,
            row_weights,
        )

    def combine_send(
        self, seq, op, parity, y, counts, row_base, counts_host=None, row_base_host=None
    ) -> None:
        """``counts_host``/``row_base_host``: the same as lists, when the caller has them
        (else the copy-engine path reads them from the device)."""
        tx = self._tx()
        y = _aligned(y)
        self._combine_ticket = self.new_ticket()
        rows = y.shape[0] if y.dim() == 2 else 0
        if op == _OP_COMBINE and self._copy_engine_could_serve(rows * tx.combine_slot_bytes):
            tx.combine_send_ce(
                _ptr(self._combine_ticket),
                op,
                _ptr(y),
                _ptr(counts),
                _ptr(row_base),
                counts.tolist() if counts_host is None else counts_host,
                row_base.tolist() if row_base_host is None else row_base_host,
                self.copy_engine_min_bytes,
                self._stream(),
            )
            self._last_counts = ("recv", counts)
        else:
            ll = op == _OP_LL_COMBINE
            base = None if ll else row_base
            self._launch_combine(self._combine_ticket, op, y, counts, base, None, None, None)
        self._combine_op = op
        self._advance(seq, op, parity)

    def combine_send_expert_major(
        self, seq, op, parity, y, counts, row_base, expert_pos, row_experts, row_weights
    ) -> None:
        """Low-latency expert-major combine: y [E_local, world * max_tokens, H] unweighted;
        the weighted fp32 pre-reduction is fused into the push (one kernel). ``row_base``
        is implied (source s's rows start at s * max_tokens)."""
        del row_base
        self._combine_ticket = self.new_ticket()
        self._launch_combine(
            self._combine_ticket, op, y, counts, None, expert_pos, row_experts, row_weights
        )
        self._combine_op = op
        self._advance(seq, op, parity)

    def reduce_expert_major(
        self, y, counts, expert_pos, row_experts, row_weights, num_local_experts, rows_out
    ) -> None:
        del num_local_experts
        self._tx().reduce_expert_major(
            _ptr(y),
            _ptr(counts),
            _ptr(expert_pos),
            _ptr(row_experts),
            _ptr(row_weights),
            _ptr(rows_out),
            self._stream(),
        )

    def combine_recv(
        self,
        seq,
        op,
        parity,
        timeout_s,
        send_token,
        send_count,
        num_tokens,
        out,
        *,
        sync: bool = False,
    ) -> None:
        """No host synchronisation: a peer's failure lands in the error word that the next
        call's :meth:`check` raises (both modes; the combine's output is stream-ordered).
        ``sync=True`` (the self-test) waits for the stream and raises it now."""
        del seq, op, parity
        tx = self._tx()
        tx.combine_recv(
            _ptr(self._combine_ticket),
            _ptr(send_token),
            _ptr(send_count),
            num_tokens,
            _ptr(out),
            float(timeout_s),
            self._stream(),
        )
        if sync:
            self._sync_stream()
            tx.check()

    def byte_stats(self) -> tuple[list[int], list[int], int]:
        """(last, total, calls): bytes this rank pushed into each rank's segment in the last
        send and in total, as the send kernels counted them on the device (graph replays
        included), without the start-up self-test's calls. Waits for this transport's last
        call (call it when you want numbers)."""
        tx = self._tx()
        st = tx.stats()
        slots = (tx.dispatch_slot_bytes, tx.combine_slot_bytes)
        (base_d, base_c), base_calls = self._stats_base
        calls = st["calls"] - base_calls
        if calls == 0:
            return [0] * self.world, [0] * self.world, 0
        last = [n * slots[st["last_family"]] + 16 for n in st["last_rows"]]
        d_rows = [a - b for a, b in zip(st["total_rows"][0], base_d)]
        c_rows = [a - b for a, b in zip(st["total_rows"][1], base_c)]
        total = [d * slots[0] + c * slots[1] + 16 * calls for d, c in zip(d_rows, c_rows)]
        return last, total, calls

    def mark_self_tested(self) -> None:
        """The self-test's calls are not the caller's: statistics start after them."""
        st = self._tx().stats()
        self._stats_base = ((list(st["total_rows"][0]), list(st["total_rows"][1])), st["calls"])

    @property
    def host_staged_peers(self) -> bool:
        """Some peer reaches this rank through host memory (it has a pinned host segment)."""
        plan = self.pair_transport
        return any(plan[s][self.rank] == STAGED for s in range(self.world) if s != self.rank)

    def calls_made(self) -> tuple[int, int, int]:
        """(calls, dispatch calls, combine calls) this transport has made (the Buffer
        numbers its calls after the self-test's)."""
        return self._seq, self._calls[0], self._calls[1]

    def decisions(self) -> dict[str, Any]:
        """Per outgoing pair: the path used (the plan's, unless CUDA peer access or an
        explicit argument made it staged), the direction used and why (explicit, plan,
        default; staged pairs push), the phase in the send order, and the topology plan's
        decision (direction, engine, phase, reasons) where there was a plan."""
        rp = self.topology_plan
        names = {P2P: "p2p", STAGED: "staged"}
        path = [[names.get(v, str(v)) for v in row] for row in self.pair_transport]
        return pair_decisions(
            self.rank,
            self.world,
            self.topology_note,
            None if rp is None else rp.to_dict(),
            path,
            self.send_order,
            [list(row) for row in self.pair_direction],
            "sm (pulled pairs: the receiver's SM loads) or copy engine (pushed pairs in normal "
            "mode of at least copy_engine_min_bytes)",
            self.direction_reasons,
        )

    def last_bytes(self) -> list[int]:
        """Bytes this rank pushed into each rank's segment in the last send (synchronises)."""
        if self._last_counts is None:
            return [0] * self.world
        kind, counts = self._last_counts
        tx = self._tx()
        slot = tx.dispatch_slot_bytes if kind == "send" else tx.combine_slot_bytes
        return [int(n) * slot + 16 for n in counts.tolist()]
