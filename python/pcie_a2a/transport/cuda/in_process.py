"""The in-process harness: all W ranks' CUDA transports in one process (no process group,
no IPC), the single-GPU stand-in for real concurrency."""

from __future__ import annotations

import os
import secrets
import weakref
from typing import Any

from pcie_a2a.placement import Placement
from pcie_a2a.topology.ranks import default_send_order
from pcie_a2a.transport.cuda.common import P2P, STAGED, _nonce, _release


def in_process(
    cls: type,
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
) -> list:
    """All W ranks' transports in this process (no process group, no IPC): the tables
    take each other's pointers. Give each rank its own stream; issue every rank's send
    before the receives (a receive kernel waits for the peers' sends). The single-GPU
    stand-in for real concurrency: separate processes on one GPU time-slice, these
    kernels run side by side. Close them with :meth:`close_in_process`."""
    from pcie_a2a.transport import cuda as pkg

    mod = pkg.native()
    code = {"p2p": P2P, "staged": STAGED, P2P: P2P, STAGED: STAGED}
    plan = [[P2P] * world for _ in range(world)]
    if pair_transport is not None:
        plan = [[code[v] for v in row] for row in pair_transport]
    for s in range(world):
        plan[s][s] = P2P
    order = send_order if send_order is not None else default_send_order(world)
    prefix = f"pcie_a2a.{os.getpid()}_{secrets.token_hex(6)}"
    out: list = []
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


def close_in_process(transports: list) -> list[bool]:
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
