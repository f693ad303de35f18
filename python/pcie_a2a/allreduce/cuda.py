"""The CUDA backend of :class:`pcie_a2a.AllReduce`: one device segment per rank exported with
CUDA IPC, the kernels of ``csrc/cuda/allreduce``.

NOT YET RUN ON A GPU: the kernels and the host class run in CI only in the CPU model of
CUDA; the GPU all-reduce test and ``benchmarks/bench_allreduce_one_gpu.py`` are the first
GPU checks.

Calls only enqueue on the current stream (capturable in a CUDA graph); a failure a kernel
saw (a peer that timed out, aborted or disagrees) is raised by the next call or by
:meth:`pcie_a2a.AllReduce.check`.

Pairs: every pair must be P2P (the planner's decision and CUDA peer access both); a group
with a host-staged pair hands every call to NCCL, said once in the log. Directions (push
or pull per pair) come from the planner (:mod:`pcie_a2a.allreduce.decisions`).
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from pcie_a2a.allreduce import decisions as dec


def native():
    return importlib.import_module("pcie_a2a._allreduce_cuda")


def unavailable_reason() -> str:
    """Why the CUDA backend cannot run here ("" when it can)."""
    try:
        mod = native()
    except ImportError as exc:
        return f"pcie_a2a._allreduce_cuda is not in this build (no nvcc at build time): {exc}"
    count, err = mod.device_count()
    if err or count == 0:
        return f"no usable CUDA device ({err or 'none visible'})"
    if not torch.cuda.is_available():
        return "torch was built without CUDA or cannot see the device"
    return ""


def device_uuid(index: int) -> str:
    """A name of CUDA device ``index`` every process agrees on, whatever its
    CUDA_VISIBLE_DEVICES (the UUID; the PCI location as a fallback)."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    pci = tuple(getattr(props, f, None) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    return f"pci:{pci}" if None not in pci else f"index:{index}"


def topology_decisions(bus_ids: list[str | None], world: int) -> dec.PairDecisions:
    """The planner's per-pair decisions for these ranks (PCIE_A2A_TOPO_FILE or the live
    machine, with its probe record when there is one), or all push when there is no plan."""
    from pcie_a2a.topology import TopologyError, TransferOptions, plan_transfers
    from pcie_a2a.topology.ranks import rank_transfers
    from pcie_a2a.topology.sources import current_with_probe

    if None in bus_ids:
        return dec.all_push(world, "no topology plan: torch does not report PCI addresses")
    try:
        topo, probe = current_with_probe()
        p = plan_transfers(topo, options=TransferOptions.from_env(probe=probe))
        rp = rank_transfers(topo, p, bus_ids)
    except (TopologyError, ValueError, OSError) as exc:
        return dec.all_push(world, f"no topology plan ({exc}): every pair pushes")
    return dec.from_rank_transfers(
        rp, p, f"topology plan from {topo.source}, ranks matched {rp.how}"
    )


def _peer_row(rank: int, uuids: list[str], visible: list[str], can_access) -> list[bool]:
    """Whether this rank's kernels can reach each rank's device memory (CUDA IPC needs peer
    access between the two devices, and the peer's device visible to this process)."""
    mine = uuids[rank]
    row = []
    for theirs in uuids:
        if theirs == mine:
            row.append(True)
        elif mine in visible and theirs in visible:
            row.append(bool(can_access(visible.index(mine), visible.index(theirs))))
        else:
            row.append(False)
    return row


def _release(tx: Any) -> None:
    if tx is not None:
        tx.close()


class CudaBackend:
    kind = "cuda"

    def __init__(
        self,
        group,
        rank: int,
        world: int,
        max_bytes: int,
        end_barrier: bool,
        explicit: dec.PairDecisions | None,
        check_all: Callable[[str | None, str], None],
        gather: Callable[[Any], list],
        device: int | None,
    ):
        from pcie_a2a.topology.live import cuda_bus_id

        mod = native()
        idx = torch.cuda.current_device() if device is None else int(device)
        self.device = torch.device("cuda", idx)
        self._tx = None
        self._finalizer = weakref.finalize(self, _release, None)
        visible = [device_uuid(i) for i in range(torch.cuda.device_count())]
        info = gather((device_uuid(idx), cuda_bus_id(idx)))
        uuids = [u for u, _ in info]
        reach = gather(_peer_row(rank, uuids, visible, torch.cuda.can_device_access_peer))
        mine = topology_decisions([b for _, b in info], world) if rank == 0 else None
        plan = gather(mine)[0]
        d = plan
        if explicit is not None:
            d = dec.PairDecisions(explicit.direction, plan.path, plan.path_classes, plan.measured,
                                  f"{explicit.source}; paths: {plan.source}")  # fmt: skip
        path = tuple(
            tuple(
                "p2p"
                if s == t or (d.path[s][t] == "p2p" and reach[s][t] and reach[t][s])
                else "staged"
                for t in range(world)
            )
            for s in range(world)
        )
        self.decisions = dec.PairDecisions(d.direction, path, d.path_classes, d.measured, d.source)
        staged = self.decisions.staged_pairs()
        self.active = not staged
        self.why_inactive = (
            ""
            if self.active
            else "no P2P between " + ", ".join(f"{s}->{t}" for s, t in staged[:8])
            + (" ..." if len(staged) > 8 else "")
            + " (planner or CUDA peer access): handed to NCCL"
        )  # fmt: skip
        self.segment_bytes = 0
        if not self.active:
            return
        tx, error = None, None
        try:
            tx = mod.CudaAllReduce(
                rank, world, max_bytes, 1 if end_barrier else 2, idx, end_barrier
            )
        except Exception as exc:
            error = f"rank {rank}: {exc}"
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, tx)
        self._guard(check_all, error, "allocating the device segment")
        handles = gather(tx.ipc_handle())
        try:
            tx.open_peers(handles, [0] * world, self.decisions.pull_matrix())
        except Exception as exc:
            error = f"rank {rank}: {exc}"
        self._guard(check_all, error, "opening the peers' segments")
        self._tx = tx
        self.segment_bytes = tx.segment_bytes

    def _guard(self, check_all, error, what) -> None:
        try:
            check_all(error, what)
        except Exception:
            self._finalizer()
            raise

    @staticmethod
    def _aligned(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if t is None or t.data_ptr() % 16 == 0 else t.clone()

    def run(self, seq: int, algo: int, dtype: int, x, residual, out, timeout_s: float) -> None:
        del seq  # the call number lives on the device (csrc/cuda/allreduce/device.cuh)
        xa, ra = self._aligned(x), self._aligned(residual)
        oa = out if out.data_ptr() % 16 == 0 else torch.empty_like(out)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._tx.run(
            algo, dtype, xa.data_ptr(), x.numel(), 0 if ra is None else ra.data_ptr(),
            oa.data_ptr(), timeout_s, stream,
        )  # fmt: skip
        if oa is not out:
            out.copy_(oa)

    def rmsnorm(self, r, residual, weight, eps: float, dtype: int, normed, residual_out) -> None:
        hidden = weight.numel()
        ra, wa = self._aligned(residual), self._aligned(weight)
        native().rmsnorm(
            dtype, r.data_ptr(), 0 if ra is None else ra.data_ptr(), wa.data_ptr(),
            r.numel() // hidden, hidden, float(eps), normed.data_ptr(), residual_out.data_ptr(),
            torch.cuda.current_stream(self.device).cuda_stream,
        )  # fmt: skip

    def abort(self, seq: int, timeout_s: float) -> None:
        del seq
        self._tx.abort(timeout_s, torch.cuda.current_stream(self.device).cuda_stream)

    def check(self) -> None:
        if self._tx is not None:
            self._tx.check()

    def last_bytes(self) -> list[int]:
        return list(self._tx.last_bytes())

    def close(self) -> None:
        self._finalizer()
        self._tx = None
