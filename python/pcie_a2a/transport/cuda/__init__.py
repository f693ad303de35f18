"""The CUDA transport (peer-to-peer over CUDA IPC, or staged through pinned host memory)
behind ``Buffer(backend="cuda")``: the :class:`pcie_a2a.transport.Transport` interface.

NOT YET RUN ON A GPU: everything here and in ``csrc/cuda/transport`` runs in CI only on
the CPU model of CUDA; the GPU transport tests run by ``scripts/gpu_check.sh`` are the
first GPU check (see docs/cuda_transport.md).

:class:`CudaTransport` implements the methods the Buffer calls on every transport
(:mod:`pcie_a2a.transport.base`), taking CUDA tensors on this transport's device.
Normal mode synchronises once per dispatch (``wait`` returns the counts on the host; the
copy-engine path adds one on the sender) and not in combine (a peer's failure is raised
by the next call's :meth:`check`). The low-latency calls (``device_side``) never touch the host:
counts stay on the device, the kernels check the ids and write every output element, and
failures land in the error word that :meth:`check` (and the next call) raises; so
``Buffer.low_latency_dispatch``/``low_latency_combine`` can be captured in a CUDA graph.
The ``*_async`` methods are the same low-latency calls with the tensors given.

Construction is collective over ``group`` (every rank constructs with the same
arguments): IPC handles and the pair plan are exchanged with ``all_gather_object``, and
every local step reaches the next gather with its error, so a failure on one rank is
raised on every rank. :meth:`CudaTransport.in_process` builds the W transports of a
group in one process instead (the single-GPU stand-in for concurrency).

The package, by role: :mod:`.common` (pair codes, tensor checks, device names),
:mod:`.planning` (rank 0's topology plan, kept per process; each sender's pair row),
:mod:`.bootstrap` (the collective construction), :mod:`.transport` (the class: lifecycle
and the calls Buffer makes), :mod:`.calls` (the graph-capturable ``*_async`` calls),
:mod:`.in_process` (the harness), :mod:`.selftest` (the known-answer check every Buffer on
CUDA runs before its first call).

``native``, ``_device``, ``device_uuid``, ``cuda_bus_id`` and ``topology_rank_transfers`` are
looked up here, on the package, when they are used: the tests and the CPU model of CUDA
replace them on this module.
"""

from __future__ import annotations

from pcie_a2a.topology.live import cuda_bus_id
from pcie_a2a.transport.cuda.common import (  # noqa: F401  (tests)
    P2P,
    PULL,
    STAGED,
    _aligned,
    _check,
    _device,
    device_uuid,
    native,
)
from pcie_a2a.transport.cuda.planning import (
    clear_plan_cache,
    outgoing_pairs,
    plan_on_rank0,
    topology_rank_transfers,
)
from pcie_a2a.transport.cuda.transport import CudaTransport

__all__ = [
    "P2P",
    "PULL",
    "STAGED",
    "CudaTransport",
    "clear_plan_cache",
    "cuda_bus_id",
    "device_uuid",
    "native",
    "outgoing_pairs",
    "plan_on_rank0",
    "topology_rank_transfers",
]
