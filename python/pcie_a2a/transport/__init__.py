"""Transports behind :class:`pcie_a2a.Buffer`: one interface (:class:`Transport`), one
implementation per backend, chosen once, at construction, by :func:`open_transport`.

* ``cpu`` (:mod:`.cpu`): the C++ shared-memory transport, the oracle.
* ``cuda`` (:mod:`.cuda`): CUDA IPC peer-to-peer or host-staged; NOT YET RUN ON A GPU.
  ``backend="auto"`` takes it when every rank has a CUDA device and the build has the
  kernels (:func:`choose_backend`); every Buffer on it runs a known-answer self-test first
  (:mod:`.cuda.selftest`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pcie_a2a import _native, env
from pcie_a2a.placement import Placement
from pcie_a2a.transport.base import Transport, pair_decisions, resolve_pair_direction

BACKENDS = ("cpu", "cuda")


@dataclass(frozen=True)
class TransportSpec:
    """What every transport is built from (Buffer's arguments, checked by Buffer)."""

    group: dist.ProcessGroup
    rank: int
    world: int
    hidden: int
    max_tokens: int
    num_topk: int
    payload: int  # wire code: 0 bf16, 1 fp16, 2 fp8
    dtype: int  # 0 bf16, 1 fp16
    placement: Placement
    timeout_s: float
    # [src][dst] "push" or "pull"; None: the transport decides (its plan, else env, else push)
    pair_direction: tuple[tuple[str, ...], ...] | None


def _vote(backend: str) -> tuple:
    """This rank's facts for the choice: (asked, PCIE_A2A_BACKEND or None, its error,
    whether the CUDA transport can run here, why not)."""
    forced, error = None, None
    try:
        forced = env.backend()
    except ValueError as exc:  # reaches every rank through the gather
        error = str(exc)
    ok = _native.cuda_available()
    return backend, forced, error, ok, "" if ok else _native.cuda_unavailable_reason()


def choose_backend(backend: str, gather: Callable[[Any], list] | None = None) -> str:
    """The backend a Buffer asked for as ``backend`` runs on, decided the same way on every
    rank: ``gather(obj)`` returns every rank's ``obj`` (None: this rank alone). ``"auto"``
    is ``PCIE_A2A_BACKEND`` when set, else the CUDA transport when every rank has a CUDA
    device and the build has the kernels, else the CPU transport when no rank has; a group
    split between the two is an error (never a silent choice). A ValueError or RuntimeError
    says why a choice cannot run."""
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"backend: got {backend!r}; allowed: 'auto', 'cpu', 'cuda'")
    votes = gather(_vote(backend)) if gather is not None else [_vote(backend)]
    errors = [f"rank {r}: {v[2]}" for r, v in enumerate(votes) if v[2]]
    if errors:
        raise ValueError("; ".join(errors))
    asked = [v[0] for v in votes]
    if len(set(asked)) > 1:
        raise ValueError(f"Buffer argument 'backend' differs between ranks: {asked}; every "
                         "rank must pass the same value")  # fmt: skip
    without = [(r, v[4]) for r, v in enumerate(votes) if not v[3]]
    if backend == "auto":
        forced = [v[1] for v in votes]
        if len(set(forced)) > 1:
            raise ValueError(f"PCIE_A2A_BACKEND differs between ranks: {forced}; set the same "
                             "value (or none) on every rank")  # fmt: skip
        if forced[0]:
            backend = forced[0]
        elif not without:
            backend = "cuda"
        elif len(without) == len(votes):
            backend = "cpu"
        else:
            why = "; ".join(f"rank {r}: {reason}" for r, reason in without)
            raise RuntimeError(
                f"backend='auto': ranks {[r for r, _ in without]} of {len(votes)} cannot run "
                f"the CUDA transport ({why}) while the others can; every rank must run the "
                "same transport: fix those ranks, or set PCIE_A2A_BACKEND=cpu on every rank "
                "(the CPU transport moves the rows through host memory)"
            )
    if backend == "cuda" and without:
        if len(votes) == 1:
            raise ValueError(
                f"backend='cuda' is not available here: {without[0][1]}; use backend='cpu'"
            )
        why = "; ".join(f"rank {r}: {reason}" for r, reason in without)
        raise ValueError(f"backend='cuda' is not available on every rank ({why}); use "
                         "backend='cpu' (or PCIE_A2A_BACKEND=cpu with backend='auto')")  # fmt: skip
    return backend


def _open_cpu(spec: TransportSpec, prefix: str, check_all) -> Transport:
    from pcie_a2a.transport.cpu import CpuTransport

    # No topology to plan: explicit, else PCIE_A2A_DIRECTION for every pair, else push.
    direction, reasons = resolve_pair_direction(spec.world, spec.pair_direction, None,
                                                env.direction())  # fmt: skip
    t = CpuTransport(spec.group, spec.rank, spec.world, spec.hidden, spec.max_tokens,
                     spec.num_topk, spec.payload, spec.dtype, prefix=prefix, check_all=check_all,
                     pair_direction=direction, timeout_s=spec.timeout_s)  # fmt: skip
    t.direction_reasons = reasons
    return t


def _open_cuda(spec: TransportSpec, prefix: str, check_all) -> Transport:
    # NOT YET RUN ON A GPU (see docs/cuda_transport.md). The transport bootstraps itself
    # (its own segment names, IPC handles, pair plan, directions and probe), then proves
    # every path with the known-answer self-test before the Buffer's first call.
    del prefix, check_all
    from pcie_a2a.transport.cuda import CudaTransport, selftest

    t = CudaTransport(spec.group, spec.rank, spec.world, spec.hidden, spec.max_tokens,
                      spec.num_topk, spec.payload, spec.dtype, spec.placement,
                      device=None, timeout_s=spec.timeout_s,
                      pair_direction=spec.pair_direction)  # fmt: skip
    if env.selftest():
        try:
            selftest.run(t, spec.placement, spec.payload == 2, t._gather, SELFTEST_TIMEOUT_S)
        except BaseException:
            t.close()  # collective: every rank raises the same verdict here
            raise
    return t


# How long the self-test waits for a peer: a path that never delivers fails start-up in
# seconds, not after the Buffer's call timeout.
SELFTEST_TIMEOUT_S = 5.0


_OPENERS: dict[str, Callable[..., Transport]] = {"cpu": _open_cpu, "cuda": _open_cuda}


def open_transport(
    backend: str, spec: TransportSpec, prefix: str, check_all: Callable[[str | None, str], Any]
) -> Transport:
    """Builds this rank's transport of ``backend`` (collective over ``spec.group``).
    ``prefix``: a name every rank agrees on; ``check_all(error, what)`` raises on every
    rank when any rank's local step failed."""
    return _OPENERS[backend](spec, prefix, check_all)


__all__ = [
    "BACKENDS",
    "Transport",
    "TransportSpec",
    "choose_backend",
    "open_transport",
    "pair_decisions",
]
