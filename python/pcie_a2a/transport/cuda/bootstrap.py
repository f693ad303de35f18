"""The collective bootstrap of one rank's CUDA transport (every rank constructs with the
same arguments): who is where, compute modes, rank 0's pair plan, regions, IPC handles and
the probe of every pair. Every local step catches its error and carries it through the next
``all_gather_object``, so a failure on one rank is raised on every rank at once."""

from __future__ import annotations

import os
import secrets
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from pcie_a2a import cuda_checks, env
from pcie_a2a.topology.ranks import default_send_order

# native, device_uuid and cuda_bus_id are looked up on the package (tests replace them there)
from pcie_a2a.transport.base import resolve_pair_direction
from pcie_a2a.transport.cuda.common import P2P, PULL, STAGED, _nonce, _release, package
from pcie_a2a.transport.cuda.planning import outgoing_pairs, plan_on_rank0


class Bootstrap:
    """The bootstrap half of :class:`pcie_a2a.transport.cuda.CudaTransport`."""

    def _bootstrap(self, mod, placement, pair_transport, send_order, staging_numa, probe_s,
                   pair_direction=None):  # fmt: skip
        rank, world = self.rank, self.world
        idx = self.device.index
        # 1. Who is where: every local step catches its error and reaches the gather.
        error, info = None, None
        try:
            uid = f"{os.getpid()}_{secrets.token_hex(6)}"
            info = (
                package().device_uuid(idx),
                package().cuda_bus_id(idx),
                uid,
                mod.device_report(idx or 0),
            )
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
        visible = [package().device_uuid(i) for i in range(torch.cuda.device_count())]
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
