"""Transports behind :class:`pcie_a2a.Buffer`: one interface (:class:`Transport`), one
implementation per backend, chosen once, at construction, by :func:`open_transport`.

* ``cpu`` (:mod:`.cpu`): the C++ shared-memory transport, the oracle.
* ``cuda`` (:mod:`.cuda`): CUDA IPC peer-to-peer or host-staged; NOT YET RUN ON A GPU.
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


def choose_backend(backend: str) -> str:
    """The backend a Buffer asked for as ``backend`` runs on, or a ValueError saying why
    it cannot."""
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"backend: got {backend!r}; allowed: 'auto', 'cpu', 'cuda'")
    if backend == "auto":
        # The CUDA transport has run only on the CPU model of CUDA, never on a GPU
        # (README): until it has, "auto" stays on the CPU transport and "cuda" is an
        # explicit opt-in.
        backend = env.backend() or "cpu"
    if backend == "cuda" and not _native.cuda_available():
        raise ValueError(
            f"backend='cuda' is not available here: {_native.cuda_unavailable_reason()}; "
            "use backend='cpu'"
        )
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
    # (its own segment names, IPC handles, pair plan, directions and probe).
    del prefix, check_all
    from pcie_a2a.transport.cuda import CudaTransport

    return CudaTransport(spec.group, spec.rank, spec.world, spec.hidden, spec.max_tokens,
                         spec.num_topk, spec.payload, spec.dtype, spec.placement,
                         device=None, timeout_s=spec.timeout_s,
                         pair_direction=spec.pair_direction)  # fmt: skip


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
