"""The one interface between :class:`pcie_a2a.Buffer` and a transport.

Buffer owns the API (argument checks, call numbering, parity, hooks, handles); a
transport owns the memory and the protocol of one rank. Every backend-specific choice is
made here, behind these methods, so Buffer has no backend branches: what differs is what
a method does, not whether Buffer calls it.

Calls, in order, for one dispatch (normal or low-latency) and one combine::

    check()                                   before every call (earlier async failures)
    dispatch_send(seq, op, parity, ...)       the send half (DeepEP's send)
    wait(seq, op, timeout_s)                  normal mode: counts on the host
    ll_recv_counts(seq, op, timeout_s)        low latency: counts (a device tensor on CUDA)
    unpack_rows(...) / unpack_expert_major(...)   the receive half
    record()                                  after each completed call (byte statistics)
    combine_send(...) / combine_send_expert_major(...)
    combine_recv(...)
    abort(seq, op, timeout_s)                 bad input: peers raise PeerAbortedError

``seq`` is the call number (mod 2**32), ``op`` 1..4 (dispatch, combine, LL dispatch,
LL combine), ``parity`` the region half of the call (the reuse invariant of
``csrc/core/wire_format.h``). Tensors are on :attr:`device`. Protocol failures raise the
native PeerError / PeerTimeoutError / PeerAbortedError.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from pcie_a2a.topology.ranks import default_send_order


class Transport(abc.ABC):
    """What Buffer calls on a transport (see the module comment for the order)."""

    #: where this transport's tensors live
    device: torch.device
    numa_warning: str = ""
    numa_node: int = -1
    numa_bound: bool = False
    #: [src][dst] "push"/"pull" as used (resolve_pair_direction), and why, per pair
    pair_direction: tuple[tuple[str, ...], ...]
    direction_reasons: Any = ""

    # ---- lifecycle ---------------------------------------------------------------------
    @abc.abstractmethod
    def close(self) -> None:
        """The collective close (every rank, after its last call)."""

    @abc.abstractmethod
    def abandon(self) -> None:
        """The non-collective release (garbage collection, interpreter exit)."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raises a failure recorded asynchronously (nothing to do where calls raise)."""

    # ---- dispatch ----------------------------------------------------------------------
    @abc.abstractmethod
    def dispatch_send(self, seq, op, parity, x, num_tokens, topk_ids, topk_weights, topk,
                      placement, send_token, send_count) -> None:  # fmt: skip
        """Sends each token once per destination rank. ``placement``: the native host
        table (a transport with its own device copy ignores it)."""

    @abc.abstractmethod
    def wait(self, seq, op, timeout_s) -> list[int]:
        """Normal mode: blocks until every source's rows of this call arrived; their
        counts on the host."""

    @abc.abstractmethod
    def ll_recv_counts(self, seq, op, timeout_s) -> torch.Tensor:
        """Low-latency mode: the per-source counts as an int32 tensor (on CUDA a tensor the
        receive kernel fills, with no host synchronisation)."""

    def calls_made(self) -> tuple[int, int, int]:
        """(calls, dispatch calls, combine calls) made before the Buffer's first call (a
        start-up self-test's): the Buffer numbers its calls after them."""
        return 0, 0, 0

    def ids_checked_on_device(self, op: int) -> bool:
        """Whether this transport's kernels check ``topk_ids`` of call ``op`` themselves
        (then Buffer skips the host check, which would synchronise)."""
        del op
        return False

    @abc.abstractmethod
    def unpack_rows(self, parity, counts, row_base, x_out, fp8_out, scales_out, src_rank,
                    src_token, topk_ids, topk_weights, num_local_experts,
                    expert_count) -> None:  # fmt: skip
        """The receive half into the rows layout."""

    @abc.abstractmethod
    def unpack_expert_major(self, parity, counts, num_local_experts, x_out, fp8_out,
                            scales_out, expert_count, src_info, layout_range, expert_pos,
                            row_experts, row_weights) -> None:  # fmt: skip
        """The receive half into DeepEP's low-latency expert-major layout."""

    def output(self, shape: tuple[int, ...], dtype: torch.dtype, fill: int) -> torch.Tensor:
        """An output tensor of the receive half: filled with ``fill`` where the transport
        writes only rows it has (CPU); a transport whose kernels write every element returns
        it uninitialised (one launch fewer)."""
        return torch.full(shape, fill, dtype=dtype, device=self.device)

    # ---- combine -----------------------------------------------------------------------
    @abc.abstractmethod
    def combine_send(self, seq, op, parity, rows, counts, row_base, counts_host=None,
                     row_base_host=None) -> None:  # fmt: skip
        """Sends one weighted, summed row per received row back to its source.
        ``counts_host``/``row_base_host``: the same on the host when the caller has them."""

    @abc.abstractmethod
    def combine_send_expert_major(self, seq, op, parity, y, counts, row_base, expert_pos,
                                  row_experts, row_weights) -> None:  # fmt: skip
        """Low-latency expert-major combine: ``y [E_local, world * max_tokens, H]``
        unweighted; the weighted fp32 pre-reduction per row, then the send."""

    @abc.abstractmethod
    def combine_recv(self, seq, op, parity, timeout_s, send_token, send_count, num_tokens,
                     out) -> None:  # fmt: skip
        """Sums (fp32, ascending rank order) the partials of each token into ``out``."""

    @abc.abstractmethod
    def abort(self, seq, op, timeout_s) -> None:
        """Makes every peer raise PeerAbortedError for this call, and still receives it."""

    # ---- statistics and decisions ------------------------------------------------------
    def record(self) -> None:
        """Called after each completed call (a transport that counts on the device keeps
        its own statistics and does nothing here)."""
        return None

    @abc.abstractmethod
    def byte_stats(self) -> tuple[list[int], list[int], int]:
        """(last, total, calls): bytes written into each rank's memory in the last call
        and in total, and the number of calls."""

    @abc.abstractmethod
    def decisions(self) -> dict[str, Any]:
        """Per rank pair what this transport does and why (see :func:`pair_decisions`)."""


def resolve_pair_direction(
    world: int,
    explicit: Any,
    planned: Any = None,
    env_direction: str | None = None,
    staged: list[list[bool]] | None = None,
) -> tuple[tuple[tuple[str, ...], ...], list[list[str]]]:
    """How every ordered pair [src][dst] moves its rows ("push"/"pull") and why. The first
    that applies: a rank's own rows and host-staged pairs (``staged[s][d]``) push; an
    explicit ``Buffer(pair_direction=...)`` (checked by Buffer); the topology plan's
    ``RankTransfers.pair_direction`` (``planned``, which already folds in PCIE_A2A_DIRECTION and
    PCIE_A2A_PAIRS); ``env_direction`` (PCIE_A2A_DIRECTION, for a transport without a
    plan); push. Every rank computes the same from the same gathered inputs."""
    out = [["push"] * world for _ in range(world)]
    why = [[""] * world for _ in range(world)]
    for s in range(world):
        for d in range(world):
            if s == d:
                why[s][d] = "a rank's own rows: push"
            elif staged is not None and staged[s][d]:
                why[s][d] = "host-staged pair: push (pull reads a peer's GPU memory over P2P)"
            elif explicit is not None:
                out[s][d], why[s][d] = explicit[s][d], "explicit Buffer(pair_direction=...)"
            elif planned:
                out[s][d], why[s][d] = planned[s][d], "topology plan (RankTransfers.pair_direction)"
            elif env_direction is not None:
                out[s][d], why[s][d] = env_direction, f"PCIE_A2A_DIRECTION={env_direction}"
            else:
                why[s][d] = "default: push (no plan, no PCIE_A2A_DIRECTION)"
    return tuple(tuple(r) for r in out), why


def pair_decisions(
    rank: int,
    world: int,
    source: str,
    plan: dict[str, Any] | None,
    path: list[list[str]],
    send_order: list[list[int]],
    direction: str | list[list[str]],
    engine: str,
    reason: str | list[list[str]],
) -> dict[str, Any]:
    """The ``Buffer.stats()["decisions"]`` record, the same shape for every backend.

    ``pairs``: one entry per ordered pair this rank sends on (src = this rank): the path,
    direction, engine and phase the transport *uses*, and its reason; ``planned``: the
    topology plan's decision for the pair (``RankTransfers.to_dict()``), when there is a plan.
    ``plan``: the whole plan record (None without one), ``source``: where it came from.
    """
    planned = {(p["src"], p["dst"]): p for p in (plan or {}).get("pairs", [])}
    order = send_order[rank] if send_order else list(default_send_order(world)[rank])
    pairs = []
    for d in range(world):
        if d == rank:
            continue
        entry = {
            "src": rank,
            "dst": d,
            "path": path[rank][d],
            "direction": direction if isinstance(direction, str) else direction[rank][d],
            "engine": engine,
            "phase": order.index(d) if d in order else -1,
            "reason": reason if isinstance(reason, str) else reason[rank][d],
        }
        if (rank, d) in planned:
            entry["planned"] = planned[(rank, d)]
        pairs.append(entry)
    return {"source": source, "plan": plan, "send_order": list(order), "pairs": pairs}
