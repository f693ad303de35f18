"""The CUDA transport (peer-to-peer over CUDA IPC, or staged through pinned host memory)
behind ``Buffer(backend="cuda")``: the :class:`pcie_a2a.transport.Transport` interface.
(``pcie_a2a.cuda_backend``, its old name, is this module.)

NOT YET RUN ON A GPU: everything here and in ``csrc/cuda/transport`` runs in CI only on
the CPU model of CUDA (tests/test_cuda_transport_emulation.py); ``tests/test_cuda_transport.py``
and ``scripts/gpu_check.sh`` are the first GPU check (see docs/cuda_transport.md).

:class:`CudaTransport` implements the methods the Buffer calls on every transport
(:mod:`pcie_a2a.transport.base`), taking CUDA tensors on this transport's device. Normal mode synchronises where the
CPU transport would block (``wait`` returns the counts on the host, ``combine_recv``
raises a peer's failure). The low-latency calls (``device_side``) never touch the host:
counts stay on the device, the kernels check the ids and write every output element, and
failures land in the error word that :meth:`check` (and the next call) raises; so
``Buffer.low_latency_dispatch``/``low_latency_combine`` can be captured in a CUDA graph.
The ``*_async`` methods are the same low-latency calls with the tensors given.

Construction is collective over ``group`` (every rank constructs with the same
arguments): IPC handles and the pair plan are exchanged with ``all_gather_object``, and
every local step reaches the next gather with its error, so a failure on one rank is
raised on every rank. :meth:`CudaTransport.in_process` builds the W transports of a
group in one process instead (the single-GPU stand-in for concurrency).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pcie_a2a import cuda_checks, env
from pcie_a2a.placement import Placement
from pcie_a2a.topology.live import cuda_bus_id
from pcie_a2a.topology.ranks import default_send_order
from pcie_a2a.transport.base import Transport, pair_decisions, resolve_pair_direction

P2P, STAGED, PULL = 0, 1, 2  # PULL: a P2P pair whose receiver reads the rows (pull.cuh)
_OP_DISPATCH, _OP_COMBINE, _OP_LL_DISPATCH, _OP_LL_COMBINE = 1, 2, 3, 4
_FAMILY = {_OP_DISPATCH: 0, _OP_LL_DISPATCH: 0, _OP_COMBINE: 1, _OP_LL_COMBINE: 1}


def native():
    """The compiled module (ImportError when the build has no CUDA)."""
    from pcie_a2a import _cuda_transport

    return _cuda_transport


def _ptr(t: torch.Tensor | int | None) -> int:
    if t is None:
        return 0
    if isinstance(t, int):
        return t
    return t.data_ptr()


def _check(t, name: str, device, dtypes: tuple, shape: tuple, align: int = 16) -> None:
    """Raises ValueError/TypeError naming the tensor, what it is and what is allowed
    (None in `shape`: any size; `align`: bytes, 16 for rows stored as vectors)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if t.device != device:
        raise ValueError(f"{name}.device: got {t.device}, expected {device}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}.dtype: got {t.dtype}, expected {want}")
    if t.dim() != len(shape) or any(w is not None and g != w for g, w in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name}.shape: got {list(t.shape)}, expected {want}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: got a non-contiguous tensor, expected a contiguous one")
    if align and t.numel() and t.data_ptr() % align:
        raise ValueError(
            f"{name}: got data at address {t.data_ptr():#x}, expected {align}-byte alignment "
            "(the kernels move rows as 16-byte vectors; .clone() gives an aligned copy)"
        )


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """The eager path accepts any contiguous tensor (as the CPU transport does): a view at
    an odd offset is copied to a fresh, aligned allocation."""
    return t.clone() if t.numel() and t.data_ptr() % 16 else t


def _release(tx: Any, names: list[str]) -> None:
    """The non-collective close (garbage collection, interpreter exit, a failed bootstrap):
    closes the imports and frees this rank's memory only if every peer's close mark is
    already there; else the device segment is left to the process exit (freeing memory a
    peer still has mapped is undefined behaviour)."""
    if tx is not None:
        tx.close()
    try:
        mod = native()
    except ImportError:  # interpreter shutdown
        return
    for name in names:
        mod.CudaTransport.unlink_name(name)


def _nonce(prefix: str) -> int:
    """The bootstrap's number every rank derives from the shared prefix: the probe pattern
    and the close mark (a fresh segment never holds it)."""
    return int.from_bytes(hashlib.blake2b(prefix.encode(), digest_size=8).digest(), "little") | 1


def _device(index: int | None) -> torch.device:
    """The torch device of a transport on CUDA device `index` (None: the current one)."""
    return torch.device("cuda", torch.cuda.current_device() if index is None else index)


def device_uuid(index: int) -> str:
    """A name of CUDA device `index` that every process agrees on, whatever its
    CUDA_VISIBLE_DEVICES: the device UUID (PCI location as a fallback)."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    pci = tuple(getattr(props, f, None) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    return f"pci:{pci}" if None not in pci else f"index:{index}"


def topology_rank_plan(bus_ids: list[str | None]) -> tuple[Any, str]:
    """The planner's decisions for these ranks (:class:`pcie_a2a.topology.ranks.RankPlan`)
    from PCIE_A2A_TOPO_FILE or the live machine, and a line saying where they come from;
    (None, why) when there is no usable topology (then CUDA peer access decides)."""
    from pcie_a2a.topology import PlanOptions, TopologyError, plan
    from pcie_a2a.topology.ranks import plan_ranks
    from pcie_a2a.topology.sources import current_with_probe

    if None in bus_ids:
        return None, "no topology plan: torch does not report the devices' PCI addresses"
    try:
        topo, probe = current_with_probe()
        rp = plan_ranks(topo, plan(topo, options=PlanOptions.from_env(probe=probe)), bus_ids)
    except (TopologyError, ValueError, OSError) as exc:
        return None, f"no topology plan ({exc}); pairs follow CUDA peer access"
    return rp, f"topology plan from {topo.source}, ranks matched {rp.how}"


def plan_on_rank0(explicit: bool, bus_ids: list[str | None]) -> tuple[Any, str, str | None]:
    """Rank 0's share of the bootstrap: (plan, note, error). Every exception is caught and
    travels through the next gather as the error, so every rank raises it instead of the
    other ranks waiting in the gather for the process group's timeout."""
    if explicit:
        return None, "explicit plan", None
    try:
        rp, note = topology_rank_plan(bus_ids)
    except Exception as exc:  # travels to every rank
        return None, "", f"{type(exc).__name__}: {exc}"
    return rp, note, None


def outgoing_pairs(
    rank: int,
    uuids: list[str],
    p2p: bool | None,
    visible: list[str],
    can_access: Callable[[int, int], bool],
) -> list[int]:
    """How `rank` reaches every rank (its row of the pair plan): P2P or STAGED.

    ``uuids[r]``: rank r's device (:func:`device_uuid`); ``visible``: the UUIDs of the
    devices this process sees, by local index; ``can_access(i, j)``: CUDA peer access
    between local indices. ``p2p`` is PCIE_A2A_P2P: False stages every pair through host
    memory, True forces P2P; None uses P2P for ranks on the same device (IPC) and where
    CUDA reports peer access. A peer whose device this process cannot see (one GPU per
    process through CUDA_VISIBLE_DEVICES) cannot be opened through IPC: staged.
    """
    mine = uuids[rank]
    row = []
    for d, theirs in enumerate(uuids):
        if d == rank or (theirs == mine and p2p is not False):
            row.append(P2P)
        elif p2p is not None:
            row.append(P2P if p2p else STAGED)
        elif mine in visible and theirs in visible:
            ok = can_access(visible.index(mine), visible.index(theirs))
            row.append(P2P if ok else STAGED)
        else:
            row.append(STAGED)
    return row


class CudaTransport(Transport):
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
        mod = native()
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
        self.device = _device(device)
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

    # ---- bootstrap ---------------------------------------------------------------------
    def _bootstrap(self, mod, placement, pair_transport, send_order, staging_numa, probe_s,
                   pair_direction=None):  # fmt: skip
        rank, world = self.rank, self.world
        idx = self.device.index
        # 1. Who is where: every local step catches its error and reaches the gather.
        error, info = None, None
        try:
            uid = f"{os.getpid()}_{secrets.token_hex(6)}"
            info = (device_uuid(idx), cuda_bus_id(idx), uid, mod.device_report(idx or 0))
        except Exception as exc:  # reported to every rank
            error = f"rank {rank}: {cuda_checks.explain_cuda_error(str(exc))}"
        gathered = self._check_all(error, "querying the devices", info)
        uuids, bus_ids = [g[0] for g in gathered], [g[1] for g in gathered]
        self._prefix = f"pcie_a2a.{gathered[0][2]}"
        self.nonce = _nonce(self._prefix)
        self._names = [mod.CudaTransport.segment_name(self._prefix, r) for r in range(world)]
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, None, self._names)
        # 2. Compute modes and MPS: the same verdict on every rank (gathered facts).
        errors, notes = cuda_checks.environment_problems(
            uuids, [g[3] for g in gathered], cuda_checks.mps_running()
        )
        if errors:
            raise RuntimeError("CUDA transport cannot start: " + "; ".join(errors))
        for note in notes:
            warnings.warn(f"pcie_a2a rank {rank}: {note}", stacklevel=4)
        self.environment_warnings = notes
        # 3. The topology planner decides P2P vs staged, the send order and the staging node
        # (rank 0 plans, everyone uses its plan); CUDA peer access has the last word. The
        # gather is unconditional (collective) and carries rank 0's error to every rank.
        explicit = pair_transport is not None and send_order is not None
        mine = plan_on_rank0(explicit, bus_ids) if rank == 0 else None
        rp, note, plan_error = self._gather(mine)[0]
        if plan_error:
            raise RuntimeError(
                f"CUDA transport bootstrap failed while rank 0 planned the pairs: {plan_error}"
            )
        self.topology_plan, self.topology_note = rp, note
        if pair_transport is None:
            # Each sender decides its own row (only it can ask CUDA about its peers);
            # every rank then uses the same gathered plan.
            error, row = None, None
            try:
                row = self._own_row(uuids, rp)
            except Exception as exc:
                error = f"rank {rank}: {exc}"
            plan = self._check_all(error, "checking CUDA peer access", row)
        else:
            code = {"p2p": P2P, "staged": STAGED, P2P: P2P, STAGED: STAGED}
            plan = [[code[v] for v in row] for row in pair_transport]
        for s in range(world):
            plan[s][s] = P2P
        self.pair_transport = plan
        self._resolve_directions(pair_direction, rp)
        if send_order is not None:
            self.send_order = [list(o) for o in send_order]
        elif rp is not None:
            self.send_order = [list(o) for o in rp.send_order]
        else:
            self.send_order = [list(o) for o in default_send_order(world)]
        if staging_numa is None and rp is not None:
            staging_numa = rp.staging_numa[rank]
        need_host = any(plan[s][rank] == STAGED for s in range(world) if s != rank)
        # 4. Regions (the space in /dev/shm is reserved: too small is an error naming it).
        tx, error, handle = None, None, b""
        try:
            tx = self._construct(mod, need_host, staging_numa, self._with_pull())
            handle = tx.ipc_handle()
        except Exception as exc:  # reported to every rank below
            error = f"rank {rank}: {cuda_checks.explain_cuda_error(str(exc))}"
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, tx, self._names)
        handles = self._check_all(error, "creating device and host regions", handle)
        try:
            codes = self._pair_codes()
            tx.open_peers(handles, codes[rank], [codes[s][rank] for s in range(world)],
                          self.send_order[rank], self.nonce)  # fmt: skip
            tx.set_placement(*placement.csr(), *placement.choice_csr(rank))
        except Exception as exc:
            error = f"rank {rank}: {exc}"
        self._check_all(error, "opening peers")
        # 5. Every pair really works: a pattern through the protocol's own stores.
        status = None
        try:
            status = tx.probe_peers(probe_s)
        except Exception as exc:
            error = f"rank {rank}: {exc}"
        statuses = self._check_all(error, "probing the pairs", status)
        failed = cuda_checks.probe_failures(statuses, plan, bus_ids, probe_s, STAGED)
        if failed:
            self._finalizer()
            raise RuntimeError(failed)
        tx.unlink_own()
        self._native = tx
        self.numa_warning = tx.numa_warning

    def _own_row(self, uuids: list[str], rp: Any) -> list[int]:
        visible = [device_uuid(i) for i in range(torch.cuda.device_count())]
        row = outgoing_pairs(
            self.rank, uuids, env.p2p(), visible, torch.cuda.can_device_access_peer
        )
        if rp is None:
            return row
        return [
            P2P if row[d] == P2P and rp.pair_transport[self.rank][d] == "p2p" else STAGED
            for d in range(self.world)
        ]

    def _resolve_directions(self, explicit: Any, rp: Any) -> None:
        """Push or pull per pair (the same on every rank: the plan was gathered from rank 0,
        the P2P/staged plan from every sender); staged pairs push."""
        w = self.world
        staged = [[self.pair_transport[s][d] == STAGED for d in range(w)] for s in range(w)]
        planned = list(rp.pair_direction) if rp is not None and rp.pair_direction else None
        self.pair_direction, self.direction_reasons = resolve_pair_direction(
            w, explicit, planned, None, staged
        )

    def _pair_codes(self) -> list[list[int]]:
        """The native pair plan: P2P, STAGED, or PULL for a pulled P2P pair."""
        return [
            [PULL if self.pair_direction[s][d] == "pull" else v for d, v in enumerate(row)]
            for s, row in enumerate(self.pair_transport)
        ]

    def _with_pull(self) -> bool:
        return any("pull" in row for row in self.pair_direction)

    def _construct(self, mod, need_host: bool, staging_numa: int | None, with_pull: bool):
        return mod.CudaTransport(
            self._prefix,
            self.rank,
            self.world,
            self.hidden,
            self.max_tokens,
            self.num_topk,
            self.payload,
            self.dtype_code,
            self.device.index or 0,
            self.num_local_experts,
            need_host,
            -1 if staging_numa is None else int(staging_numa),
            env.recv_blocks() or 0,
            env.pdl(),
            with_pull,
            self.timeout_s,
        )

    @classmethod
    def in_process(
        cls,
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
        pair_direction: Any = None,
    ) -> list[CudaTransport]:
        """All W ranks' transports in this process (no process group, no IPC): the tables
        take each other's pointers. Give each rank its own stream; issue every rank's send
        before the receives (a receive kernel waits for the peers' sends). The single-GPU
        stand-in for real concurrency: separate processes on one GPU time-slice, these
        kernels run side by side. Close them with :meth:`close_in_process`."""
        mod = native()
        code = {"p2p": P2P, "staged": STAGED, P2P: P2P, STAGED: STAGED}
        plan = [[P2P] * world for _ in range(world)]
        if pair_transport is not None:
            plan = [[code[v] for v in row] for row in pair_transport]
        for s in range(world):
            plan[s][s] = P2P
        order = send_order if send_order is not None else default_send_order(world)
        prefix = f"pcie_a2a.{os.getpid()}_{secrets.token_hex(6)}"
        out: list[CudaTransport] = []
        for r in range(world):
            t = cls.__new__(cls)
            t._setup(r, world, hidden, max_tokens, num_topk, payload, dtype, placement, device,
                     timeout_s, None)  # fmt: skip
            t.pair_transport, t.send_order, t.nonce = plan, [list(o) for o in order], _nonce(prefix)
            t._resolve_directions(pair_direction, None)
            t._prefix = prefix
            t._names = [mod.CudaTransport.segment_name(prefix, q) for q in range(world)]
            need_host = any(plan[s][r] == STAGED for s in range(world) if s != r)
            t._native = t._construct(mod, need_host, None, t._with_pull())
            t._finalizer.detach()
            t._finalizer = weakref.finalize(t, _release, t._native, t._names)
            out.append(t)
        natives = [t._native for t in out]
        for r, t in enumerate(out):
            codes = t._pair_codes()
            t._native.open_local(natives, codes[r], [codes[s][r] for s in range(world)],
                                 t.send_order[r], t.nonce)  # fmt: skip
            t._native.set_placement(*placement.csr(), *placement.choice_csr(r))
            t._native.unlink_own()
        return out

    @staticmethod
    def close_in_process(transports: list[CudaTransport]) -> list[bool]:
        """Closes the transports of :meth:`in_process`: every one's imports first, then
        every one's memory (each waits for the others' close marks). True per transport
        when all of its memory was freed."""
        for t in transports:
            if t._native is not None:
                t._native.close_imports()
        done = []
        for t in transports:
            tx, t._native = t._native, None
            if tx is None:
                done.append(True)
                continue
            t._finalizer.detach()
            done.append(tx.free_own(t.timeout_s))
            _release(None, t._names)
        return done

    # ---- bootstrap helpers -------------------------------------------------------------
    def _gather(self, obj: Any) -> list:
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _check_all(self, error: str | None, what: str, payload: Any = None) -> list:
        gathered = self._gather((error, payload))
        errors = [e for e, _ in gathered if e]
        if errors:
            self._finalizer()
            raise RuntimeError(
                f"CUDA transport bootstrap failed while {what}: " + "; ".join(errors)
            )
        return [p for _, p in gathered]

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

    # ---- graph-capturable (async) low-latency API ----------------------------------------
    def dispatch_send_async(self, ticket, op, x, topk_ids, topk_weights, send_token, send_count):
        """Begins a dispatch call and pushes one row per (token, destination rank).
        x [T, H] contiguous, 16-byte aligned, in the transport's dtype; topk_ids int32 or
        int64 [T, k]; topk_weights fp32 [T, k]; outputs send_token int32
        [world * max_tokens], send_count int32 [world]. The ids' values are checked on the
        device (looking at them here would synchronise): ids outside [-1, num_experts) and
        an expert a token lists twice are skipped and raised as ValueError by the next
        :meth:`check` (the Buffer's next call)."""
        self._launch_dispatch(ticket, op, x, topk_ids, topk_weights, send_token, send_count)
        self._advance(None, op, None)  # after the launch: a refused call consumes no number

    def _check_send_inputs(self, x, topk_ids, topk_weights) -> None:
        """What the kernels cannot check and the graph path does not get from the Buffer:
        device, dtype, shape, contiguity and alignment (16 bytes for vector loads)."""
        _check(x, "x", self.device, (self.dtype,), (None, self.hidden))
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"x.shape[0]: got {x.shape[0]}, expected <= {self.max_tokens}")
        t = x.shape[0]
        ids_t = (torch.int32, torch.int64)
        align = 8 if getattr(topk_ids, "dtype", None) == torch.int64 else 4
        _check(topk_ids, "topk_ids", self.device, ids_t, (t, None), align=align)
        if topk_ids.shape[1] > self.num_topk:
            raise ValueError(
                f"topk_ids.shape[1]: got {topk_ids.shape[1]}, expected <= {self.num_topk}"
            )
        shape = tuple(topk_ids.shape)
        _check(topk_weights, "topk_weights", self.device, (torch.float32,), shape, align=4)

    def _launch_dispatch(
        self, ticket, op, x, topk_ids, topk_weights, send_token, send_count, min_bytes=None
    ):
        """Warp stores, or (min_bytes given) the copy-engine path for pairs that large."""
        self._check_send_inputs(x, topk_ids, topk_weights)
        args = [
            _ptr(ticket),
            op,
            _ptr(x),
            x.shape[0],
            _ptr(topk_ids),
            _ptr(topk_weights),
            topk_ids.shape[1],
            _ptr(send_token),
            _ptr(send_count),
        ]
        ids64 = topk_ids.dtype == torch.int64
        if min_bytes is None:
            self._tx().dispatch_send(*args, self._stream(), ids64)
        else:
            self._tx().dispatch_send_ce(*args, min_bytes, self._stream(), ids64)
        self._last_counts = ("send", send_count)

    def recv_rows_async(
        self,
        ticket,
        counts,
        x_out,
        fp8_out,
        scales_out,
        src_rank,
        src_token,
        topk_ids,
        topk_weights,
        expert_count,
        *,
        wait=True,
        row_base=None,
    ):
        """Rows layout. wait=True (low latency): acquires each flag on the device, writes
        counts [world]; outputs [world * max_tokens, ...], every element written (rows past
        a count: ids -1, weights 0, src -1; x unspecified). wait=False: counts come from
        :meth:`wait` and row_base int64 [world] gives compacted output rows."""
        self._tx().unpack_rows(
            _ptr(ticket),
            wait,
            _ptr(counts),
            _ptr(row_base),
            _ptr(x_out),
            _ptr(fp8_out),
            _ptr(scales_out),
            _ptr(src_rank),
            _ptr(src_token),
            _ptr(topk_ids),
            _ptr(topk_weights),
            _ptr(expert_count),
            self.timeout_s,
            self._stream(),
        )

    def recv_expert_major_async(
        self,
        ticket,
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
    ):
        """Expert-major layout ``[E_local, world * max_tokens, H]`` (DeepEP LL layout); every
        output but x is written whole (src_info -1 past each expert's count)."""
        self._tx().unpack_expert_major(
            _ptr(ticket),
            _ptr(counts),
            _ptr(x_out),
            _ptr(fp8_out),
            _ptr(scales_out),
            _ptr(expert_count),
            _ptr(src_info),
            _ptr(layout_range),
            _ptr(expert_pos),
            _ptr(row_experts),
            _ptr(row_weights),
            self.timeout_s,
            self._stream(),
        )

    def combine_send_async(
        self,
        ticket,
        op,
        y,
        recv_count,
        row_base=None,
        expert_pos=None,
        row_experts=None,
        row_weights=None,
    ):
        """Begins a combine call. Rows layout: y rows (row_base None: [world * max_tokens]).
        Expert-major (expert_pos given): y [E_local, world * max_tokens, H] unweighted; the
        weighted fp32 pre-reduction is fused into the push."""
        self._launch_combine(
            ticket, op, y, recv_count, row_base, expert_pos, row_experts, row_weights
        )
        self._advance(None, op, None)

    def _launch_combine(
        self, ticket, op, y, recv_count, row_base, expert_pos, row_experts, row_weights
    ):
        rank = y.dim() if isinstance(y, torch.Tensor) else 1
        _check(y, "y", self.device, (self.dtype,), (None,) * (rank - 1) + (self.hidden,))
        self._tx().combine_send(
            _ptr(ticket),
            op,
            _ptr(y),
            _ptr(recv_count),
            _ptr(row_base),
            _ptr(expert_pos),
            _ptr(row_experts),
            _ptr(row_weights),
            self._stream(),
        )
        self._last_counts = ("recv", recv_count)

    def combine_recv_async(self, ticket, send_token, send_count, num_tokens, out):
        self._tx().combine_recv(
            _ptr(ticket),
            _ptr(send_token),
            _ptr(send_count),
            num_tokens,
            _ptr(out),
            self.timeout_s,
            self._stream(),
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
        sync: bool | None = None,
    ) -> None:
        """sync (default: normal mode only) waits for the stream and raises a peer's
        failure now; the low-latency combine leaves that to the next :meth:`check`."""
        del seq, parity
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
        if sync if sync is not None else op not in (_OP_LL_COMBINE,):
            self._sync_stream()
            tx.check()

    def byte_stats(self) -> tuple[list[int], list[int], int]:
        """(last, total, calls): bytes this rank pushed into each rank's segment in the last
        send and in total, as the send kernels counted them on the device (graph replays
        included). Waits for this transport's last call (call it when you want numbers)."""
        tx = self._tx()
        st = tx.stats()
        slots = (tx.dispatch_slot_bytes, tx.combine_slot_bytes)
        last = [n * slots[st["last_family"]] + 16 for n in st["last_rows"]]
        d_rows, c_rows = st["total_rows"]
        total = [d * slots[0] + c * slots[1] + 16 * st["calls"] for d, c in zip(d_rows, c_rows)]
        return last, total, st["calls"]

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
