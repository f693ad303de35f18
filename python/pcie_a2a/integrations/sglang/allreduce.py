"""SGLang: its tensor-parallel all-reduce on :class:`pcie_a2a.AllReduce` when
``PCIE_A2A_ALLREDUCE=1``.

SGLang's slot for a custom all-reduce is ``GroupCoordinator.ca_comm``: ``all_reduce``
resolves the method ``"ca"`` when ``ca_comm.should_custom_ar(x)`` (also under torch.compile,
through its outplace op) and ``graph_capture`` enters ``ca_comm.capture()``. Its own
CustomAllreduce switches itself off on PCIe boxes with more than two GPUs, which is the case
this fills. Two hooks (registered by the plugin's ``register()``, applied by SGLang):

* after ``GroupCoordinator.__init__`` of the ``tp`` group (and ``attention_tp``, the
  attention's own TP group under DP attention) with 2+ ranks, unless SGLang's
  ``--disable-custom-all-reduce`` turned custom all-reduce off for it: our communicator
  replaces ``ca_comm`` (a RuntimeError at launch for what it cannot do: a group across
  machines, more than 16 ranks, no CUDA build on a GPU group, an SGLang without
  ``ca_comm``);
* around ``GroupCoordinator.all_reduce``: CPU tensors, which SGLang sends to its shared
  memory kernel or gloo before it ever asks ``ca_comm``, go to ours below the crossover
  (CPU tensor parallelism and the CPU tests);
* before ``GroupCoordinator.destroy`` (which drops ``ca_comm`` without closing it): ours
  is closed, after a bounded barrier, while its group still exists.

Anything declined (above the crossover, not bf16/fp16) stays on SGLang's NCCL path.
SGLang 0.5.23 calls the fused all-reduce + RMSNorm of ``ca_comm`` only on ROCm; on CUDA its
layernorm fuses through FlashInfer, so there only the all-reduce is ours.
"""

from __future__ import annotations

import logging
from typing import Any

from pcie_a2a import env
from pcie_a2a.integrations import _allreduce

logger = logging.getLogger("pcie_a2a.integrations.sglang")

TARGET = "sglang.srt.distributed.parallel_state.GroupCoordinator"
TP_GROUPS = ("tp", "attention_tp")


def _is_tp(coordinator: Any) -> bool:
    return str(getattr(coordinator, "unique_name", "")).split(":")[0] in TP_GROUPS


def install(result: Any, coordinator: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ``GroupCoordinator.__init__``."""
    if not env.allreduce_enabled() or not _is_tp(coordinator) or coordinator.world_size < 2:
        return None
    if not getattr(coordinator, "use_custom_allreduce", True):
        logger.info(
            "pcie_a2a all-reduce: %s keeps NCCL (--disable-custom-all-reduce)",
            coordinator.unique_name,
        )
        return None
    if not hasattr(coordinator, "ca_comm"):
        raise _allreduce.refuse(
            "SGLang", "this SGLang's GroupCoordinator has no ca_comm slot to put it in"
        )
    ours = _allreduce.make(
        "SGLang", coordinator.cpu_group, coordinator.device_group, coordinator.device
    )
    theirs, coordinator.ca_comm = coordinator.ca_comm, ours
    if theirs is not None and hasattr(theirs, "close"):
        theirs.close()
    return None


def destroy(coordinator: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of ``GroupCoordinator.destroy``."""
    ca = getattr(coordinator, "ca_comm", None)
    if isinstance(ca, _allreduce.CustomAllreduce):
        ca.close()
        coordinator.ca_comm = None
    return None


def all_reduce(original, coordinator: Any, input_: Any, *args: Any, **kwargs: Any):
    """AROUND hook of ``GroupCoordinator.all_reduce`` (CPU tensors only)."""
    ca = getattr(coordinator, "ca_comm", None)
    if (
        isinstance(ca, _allreduce.CustomAllreduce)
        and getattr(input_, "is_cpu", False)
        and ca.should_custom_ar(input_)
    ):
        return ca.custom_all_reduce(input_)
    return original(coordinator, input_, *args, **kwargs)


def register_hooks(registry: Any, hook_type: Any) -> None:
    """The three hooks (called from the plugin's register()); each does nothing unless
    ``PCIE_A2A_ALLREDUCE=1`` put our communicator on the group."""
    registry.register(f"{TARGET}.__init__", install, hook_type.AFTER)
    registry.register(f"{TARGET}.all_reduce", all_reduce, hook_type.AROUND)
    registry.register(f"{TARGET}.destroy", destroy, hook_type.BEFORE)
