"""The CPU backend of :class:`pcie_a2a.AllReduce`: processes on one host, one POSIX
shared-memory segment each (``csrc/core/allreduce_shm.h``), the oracle of the CUDA kernels
and a CPU tensor-parallel all-reduce."""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from pcie_a2a.allreduce.decisions import PairDecisions


def native():
    return importlib.import_module("pcie_a2a._allreduce")


def _release(tx: Any, names: list[str]) -> None:
    """Unmaps and removes every segment name of the group that may still exist."""
    if tx is not None:
        tx.close()
    try:
        mod = native()
    except ImportError:  # interpreter shutdown
        return
    for name in names:
        mod.ShmAllReduce.unlink_name(name)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class CpuBackend:
    """One rank's shared-memory all-reduce. Construction is collective: ``check_all(error,
    what)`` gathers every rank's error (or None) and raises on every rank if any failed."""

    device = torch.device("cpu")
    kind = "cpu"

    def __init__(
        self,
        prefix: str,
        rank: int,
        world: int,
        max_bytes: int,
        end_barrier: bool,
        decisions: PairDecisions,
        check_all: Callable[[str | None, str], None],
    ):
        mod = native()
        names = [mod.ShmAllReduce.segment_name(prefix, r) for r in range(world)]
        self._finalizer = weakref.finalize(self, _release, None, names)
        self.active, self.why_inactive = True, ""
        tx, error = None, None
        try:
            tx = mod.ShmAllReduce(
                prefix, rank, world, max_bytes, 1 if end_barrier else 2, end_barrier
            )
            tx.set_directions(decisions.pull_matrix())
        except Exception as exc:  # reported to every rank
            error = f"rank {rank}: {exc}"
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, tx, names)
        self._guard(check_all, error, "creating shared memory")
        try:
            tx.attach_peers()
        except Exception as exc:
            error = f"rank {rank}: {exc}"
        self._guard(check_all, error, "attaching peers")
        tx.unlink_own()  # every rank has mapped it: the name is no longer needed
        self._tx = tx
        self.segment_bytes = tx.segment_bytes
        self.numa_warning = tx.numa_warning

    def _guard(self, check_all, error, what) -> None:
        try:
            check_all(error, what)
        except Exception:
            self._finalizer()
            raise

    def run(self, seq: int, algo: int, dtype: int, x, residual, out, timeout_s: float) -> None:
        self._tx.run(seq, algo, dtype, _ptr(x), x.numel(), _ptr(residual), _ptr(out), timeout_s)

    def rmsnorm(self, r, residual, weight, eps: float, dtype: int, normed, residual_out) -> None:
        hidden = weight.numel()
        native().rmsnorm_rows(
            _ptr(r),
            _ptr(residual),
            _ptr(weight),
            r.numel() // hidden,
            hidden,
            float(eps),
            dtype,
            _ptr(normed),
            _ptr(residual_out),
        )

    def abort(self, seq: int, timeout_s: float) -> None:
        self._tx.abort(seq, timeout_s)

    def check(self) -> None:
        """The CPU path raises inside the call itself; nothing is pending."""

    def last_bytes(self) -> list[int]:
        return list(self._tx.last_bytes())

    def close(self) -> None:
        self._finalizer()
        self._tx = None
