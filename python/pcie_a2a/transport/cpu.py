"""The CPU transport behind ``Buffer(backend="cpu")``: the C++ shared-memory transport
(``csrc/core/shm_transport.h``, one POSIX segment per rank, mapped by every peer), the
oracle every other transport is compared with.

The binding takes raw pointers; this passes tensors as ``data_ptr()``. Calls block where
the protocol waits and raise a peer's failure in the call itself, so :meth:`check` has
nothing to do. Byte statistics are counted on the host after each call. Each ordered pair
pushes (the sender stores rows into the receiver's segment) or pulls (the receiver reads
them from the sender's own segment), as ``pair_direction`` says (csrc/core/wire_format.h).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pcie_a2a import _native
from pcie_a2a.transport.base import Transport, pair_decisions


def _ptr(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr()
    return 0 if arg is None else arg


def _release(transport, names: list[str]) -> None:
    """Unmaps and removes every name of the group that may still exist (idempotent)."""
    if transport is not None:
        transport.close()
    try:
        native = _native.transport()
    except ImportError:  # interpreter shutdown
        return
    for name in names:
        native.ShmTransport.unlink_name(name)


class CpuTransport(Transport):
    """One rank's shared-memory transport. Construction is collective over ``group``
    (``check_all`` reports a local failure to every rank); ``prefix`` names the group's
    segments (every rank passes the same)."""

    device = torch.device("cpu")

    def __init__(self, group: dist.ProcessGroup, rank: int, world: int, hidden: int,
                 max_tokens: int, num_topk: int, payload: int, dtype: int, *, prefix: str,
                 check_all: Callable[[str | None, str], None],
                 pair_direction: tuple[tuple[str, ...], ...], timeout_s: float):  # fmt: skip
        native = _native.transport()
        self.rank, self.world = rank, world
        self.pair_direction = pair_direction  # [src][dst], checked by Buffer
        self.direction_reasons: Any = "Buffer(pair_direction=...)"  # _open_cpu: per pair
        names = [native.ShmTransport.segment_name(prefix, r) for r in range(world)]
        self._finalizer = weakref.finalize(self, _release, None, names)
        tx, error = None, None
        try:
            pull = [int(d == "pull") for row in pair_direction for d in row]
            tx = native.ShmTransport(prefix, rank, world, hidden, max_tokens, num_topk, payload,
                                     dtype, pull, timeout_s)  # fmt: skip
        except Exception as exc:  # reported to every rank below
            error = f"rank {rank}: {exc}"
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, tx, names)
        self._checked(check_all, error, "creating shared memory")
        try:
            tx.attach_peers()
        except Exception as exc:
            error = f"rank {rank}: {exc}"
        self._checked(check_all, error, "attaching peers")
        tx.unlink_own()  # everyone has mapped it: the name is no longer needed
        self._tx = tx
        self.numa_warning = tx.numa_warning
        self.numa_node = tx.numa_node
        self.numa_bound = bool(tx.numa_bound)
        self._last, self._total, self._calls = [0] * world, [0] * world, 0

    def _checked(self, check_all, error: str | None, what: str) -> None:
        try:
            check_all(error, what)
        except Exception:
            self._finalizer()
            raise

    # ---- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        self._finalizer()  # nothing to wait for: a peer's segment outlives its unmap

    def abandon(self) -> None:
        self._finalizer()

    def check(self) -> None:
        return None  # the calls raise themselves

    # ---- dispatch / combine: the binding with tensors as pointers ---------------------
    def _call(self, name: str, *args: Any) -> Any:
        return getattr(self._tx, name)(*(_ptr(a) for a in args))

    def dispatch_send(self, *args) -> None:
        self._call("dispatch_send", *args)

    def wait(self, seq, op, timeout_s) -> list[int]:
        return self._tx.wait(seq, op, timeout_s)

    def ll_recv_counts(self, seq, op, timeout_s) -> torch.Tensor:
        return torch.tensor(self._tx.wait(seq, op, timeout_s), dtype=torch.int32)

    def unpack_rows(self, *args) -> None:
        self._call("unpack_rows", *args)

    def unpack_expert_major(self, *args) -> None:
        self._call("unpack_expert_major", *args)

    def combine_send(self, seq, op, parity, rows, counts, row_base, counts_host=None,
                     row_base_host=None) -> None:  # fmt: skip
        del counts_host, row_base_host  # the host reads the tensors directly
        self._call("combine_send", seq, op, parity, rows, counts, row_base)

    def combine_send_expert_major(self, seq, op, parity, y, counts, row_base, expert_pos,
                                  row_experts, row_weights) -> None:  # fmt: skip
        rows = torch.empty(y.shape[1], y.shape[2], dtype=y.dtype)
        self._call("reduce_expert_major", y, counts, expert_pos, row_experts, row_weights,
                   y.shape[0], rows)  # fmt: skip
        self._call("combine_send", seq, op, parity, rows, counts, row_base)

    def combine_recv(self, *args) -> None:
        self._call("combine_recv", *args)

    def combine_recv_fp32(self, *args) -> None:
        """combine_recv into a float32 ``out`` (the fp32 sums, not rounded to the dtype)."""
        self._call("combine_recv_fp32", *args)

    def abort(self, seq, op, timeout_s) -> None:
        self._tx.abort(seq, op, timeout_s)

    # ---- statistics and decisions ------------------------------------------------------
    def record(self) -> None:
        self._last = list(self._tx.last_bytes())
        self._total = [a + b for a, b in zip(self._total, self._last)]
        self._calls += 1

    def byte_stats(self) -> tuple[list[int], list[int], int]:
        return list(self._last), list(self._total), self._calls

    def decisions(self) -> dict[str, Any]:
        w = self.world
        return pair_decisions(
            self.rank,
            w,
            "CPU transport: one shared-memory segment per rank, no GPU topology to plan",
            None,
            [["shm"] * w for _ in range(w)],
            [],  # the C++ transport sends to rank + 1, rank + 2, ...
            [list(row) for row in self.pair_direction],
            "cpu",
            self.direction_reasons,
        )
