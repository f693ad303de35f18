"""What the SGLang and vLLM all-reduce hooks share: the frameworks' custom all-reduce
interface on :class:`pcie_a2a.AllReduce`, and the launch-time checks.

Both frameworks keep a custom all-reduce in a ``ca_comm`` slot (SGLang's GroupCoordinator,
vLLM's CudaCommunicator) and ask it, per call, ``should_custom_ar(x)`` before calling
``custom_all_reduce(x)``; anything it declines goes to their NCCL path. So the hooks put a
:class:`CustomAllreduce` there for the tensor-parallel group when ``PCIE_A2A_ALLREDUCE=1``:
calls below the crossover (and of bf16/fp16, whole 16-byte vectors) are ours, the rest
stays with NCCL. Unset or 0, nothing is touched.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket

import torch
import torch.distributed as dist

from pcie_a2a import env

logger = logging.getLogger("pcie_a2a.integrations.allreduce")

DEFAULT_MAX_BYTES = 1 << 20  # segment capacity per rank; the hand-over is usually far below


class CustomAllreduce:
    """The frameworks' custom all-reduce interface on a :class:`pcie_a2a.AllReduce`.

    Besides the all-reduce, vLLM's ``CudaCommunicator`` forwards ``custom_all_gather`` and
    ``custom_reduce_scatter`` to whatever sits in ``ca_comm`` (sequence-parallel models,
    DeepSeek-V4's logits gather), and some models read ``fully_connected`` or the MNNVL
    multicast pointer to pick fused kernels. Their contract lets a custom communicator
    decline a call by returning None, after which vLLM runs its own NCCL collective: ours
    declines both (pcie_a2a has no all-gather or reduce-scatter), and reports no NVLink
    and no multicast, so no model picks a kernel that needs vLLM's own communicator."""

    #: vLLM: every GPU pair NVLink-connected (what its fused kernels need); PCIe here
    fully_connected = False
    #: vLLM: the MNNVL Lamport all-gather multicast buffer; none here
    mnnvl_lamport_ag_multicast_ptr = 0

    def __init__(self, comm):
        self.comm = comm
        # A group without P2P between every pair hands everything to NCCL (logged once by
        # AllReduce): then the framework should not even ask.
        self.disabled = not comm.stats()["active"]

    def should_custom_all_gather(self, inp: torch.Tensor) -> bool:
        return False

    def should_custom_reduce_scatter(self, inp: torch.Tensor) -> bool:
        return False

    def custom_all_gather(self, inp: torch.Tensor) -> None:
        """Declined (None): the framework's NCCL all-gather runs."""
        return None

    def custom_reduce_scatter(self, inp: torch.Tensor) -> None:
        """Declined (None): the framework's NCCL reduce-scatter runs."""
        return None

    def should_custom_ar(self, inp: torch.Tensor) -> bool:
        return not self.disabled and self.comm.should_use(inp)

    def custom_all_reduce(self, inp: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(inp)

    def fused_allreduce_rmsnorm(self, inp, residual, weight, eps):
        """(normed, residual_out), or None when the call is not ours (SGLang's optional
        fused entry point)."""
        if not self.should_custom_ar(inp) or weight.dtype != inp.dtype:
            return None
        return self.comm.all_reduce_rmsnorm(inp, weight, eps, residual=residual)

    @contextlib.contextmanager
    def capture(self):
        """CUDA-graph capture needs nothing from us: the kernels keep the call number on the
        device and move data through fixed segments, so replays are safe as they are."""
        yield

    def close(self) -> None:
        """Collective (the frameworks destroy every rank's groups together): a barrier,
        bounded by the communicator's timeout and naming a missing peer, so that no rank
        releases segments a peer may still read; then the segments go. Safe twice."""
        if self.comm.closed:
            return
        try:
            dist.monitored_barrier(
                self.comm.group, timeout=datetime.timedelta(seconds=self.comm.timeout_s)
            )
        except Exception as exc:  # a dead peer must not keep us from releasing ours
            logger.warning("pcie_a2a all-reduce: closing without the final barrier: %s", exc)
        finally:
            self.comm.close()


def refuse(framework: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"pcie_a2a: PCIE_A2A_ALLREDUCE=1 asks {framework} to run its tensor-parallel "
        f"all-reduce on pcie_a2a, which cannot work here: {why}. Unset PCIE_A2A_ALLREDUCE "
        "(or set it to 0) to keep the framework's own all-reduce."
    )


def make(framework: str, cpu_group, device_group, device: torch.device) -> CustomAllreduce:
    """The communicator of one tensor-parallel group (collective over ``cpu_group``), or a
    RuntimeError at launch for what pcie_a2a cannot do."""
    from pcie_a2a.allreduce import AllReduce

    world = dist.get_world_size(cpu_group)
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=cpu_group)
    if len(set(hosts)) != 1:
        raise refuse(framework, f"the group spans several machines ({', '.join(sorted(set(hosts)))}); "
                     "its segments are shared memory and CUDA IPC, inside one machine")  # fmt: skip
    if world > 16:
        raise refuse(framework, f"the group has {world} ranks; at most 16 are supported")
    backend = "cuda" if device.type == "cuda" else "cpu"
    if backend == "cuda":
        from pcie_a2a.allreduce.cuda import unavailable_reason

        why = unavailable_reason()
        if why:
            raise refuse(framework, why)
    elif device.type != "cpu":
        raise refuse(framework, f"the group's device is {device}; supported: cuda, cpu")
    max_bytes = max(DEFAULT_MAX_BYTES, env.allreduce_max_bytes() or 0)
    comm = AllReduce(
        cpu_group,
        max_bytes,
        (torch.bfloat16, torch.float16),
        backend=backend,
        device=device.index if backend == "cuda" else None,
        fallback_group=device_group if device_group is not None else cpu_group,
    )
    t = comm.thresholds
    logger.info(
        "pcie_a2a all-reduce for %s's tensor-parallel group (%d ranks, %s): ours up to %d bytes "
        "(one-shot up to %d), NCCL above; thresholds: %s",
        framework, world, backend, t.handover, t.one_shot_max, t.source,
    )  # fmt: skip
    return CustomAllreduce(comm)
