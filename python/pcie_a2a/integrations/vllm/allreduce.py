"""vLLM: its tensor-parallel all-reduce on :class:`pcie_a2a.AllReduce` when
``PCIE_A2A_ALLREDUCE=1``.

vLLM's slot for a custom all-reduce is the device communicator's ``ca_comm``:
``CudaCommunicator.all_reduce`` calls ``ca_comm.custom_all_reduce(x)`` when
``ca_comm.should_custom_ar(x)`` (after its quick/FlashInfer/AITER all-reduces, which do not
apply on an NVLink-less CUDA box unless asked for) and ``GroupCoordinator.graph_capture``
enters ``ca_comm.capture()``. vLLM's own CustomAllreduce switches itself off on PCIe boxes
with more than two GPUs, which is the case this fills. ``register()`` (called from the
plugin's entry point) wraps, on ``CudaCommunicator`` and on ``CpuCommunicator`` (vLLM's CPU
platform, for CPU tensor parallelism and the CPU tests):

* ``__init__``: for the ``tp`` group with 2+ ranks, unless vLLM's
  ``--disable-custom-all-reduce`` turned custom all-reduce off, our communicator becomes
  ``ca_comm`` (replacing and closing vLLM's own). What it cannot do raises a RuntimeError
  while vLLM builds its groups, at launch: a group across machines, more than 16 ranks, a
  GPU group without the CUDA build;
* ``all_reduce`` (``CpuCommunicator`` only, which has no ``ca_comm`` of its own): calls
  below the crossover go to ours;
* ``destroy`` (vLLM drops ``ca_comm`` without closing it): ours is closed first, after a
  bounded barrier, while its group still exists.

Unset or 0, ``register()`` patches nothing. Set, a vLLM whose classes moved is refused in
``register()`` itself (the user asked for something that cannot work), with every patch
undone.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

from pcie_a2a import env
from pcie_a2a.integrations import _allreduce

logger = logging.getLogger("vllm.pcie_a2a")

TP_GROUP = "tp"
_MODULES = {
    "CudaCommunicator": "vllm.distributed.device_communicators.cuda_communicator",
    "CpuCommunicator": "vllm.distributed.device_communicators.cpu_communicator",
}
_MARK = "__pcie_a2a_allreduce__"


def _custom_allreduce_allowed(comm: Any) -> bool:
    """vLLM's own switch (``--disable-custom-all-reduce``): the CUDA communicator keeps it
    as ``use_custom_allreduce``; the CPU one has none, so the process-wide flag decides."""
    if hasattr(comm, "use_custom_allreduce"):
        return bool(comm.use_custom_allreduce)
    from vllm.distributed import parallel_state

    return bool(getattr(parallel_state, "_ENABLE_CUSTOM_ALL_REDUCE", True))


def _install(comm: Any) -> None:
    if not env.allreduce_enabled() or comm.world_size < 2:
        return
    if str(getattr(comm, "unique_name", "")).split(":")[0] != TP_GROUP:
        return
    if not _custom_allreduce_allowed(comm):
        logger.info("pcie_a2a all-reduce: %s keeps vLLM's (--disable-custom-all-reduce)",
                    comm.unique_name)  # fmt: skip
        return
    ours = _allreduce.make("vLLM", comm.cpu_group, comm.device_group, comm.device)
    theirs = getattr(comm, "ca_comm", None)
    comm.ca_comm = ours
    if theirs is not None and hasattr(theirs, "close"):
        theirs.close()


def _wrap_init(original):
    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _install(self)

    setattr(__init__, _MARK, True)
    return __init__


def _wrap_cpu_all_reduce(original):
    @functools.wraps(original)
    def all_reduce(self, input_, *args: Any, **kwargs: Any):
        ca = getattr(self, "ca_comm", None)
        if isinstance(ca, _allreduce.CustomAllreduce) and ca.should_custom_ar(input_):
            return ca.custom_all_reduce(input_)
        return original(self, input_, *args, **kwargs)

    setattr(all_reduce, _MARK, True)
    return all_reduce


def _wrap_destroy(original):
    @functools.wraps(original)
    def destroy(self, *args: Any, **kwargs: Any):
        ca = getattr(self, "ca_comm", None)
        if isinstance(ca, _allreduce.CustomAllreduce):
            ca.close()
            self.ca_comm = None
        return original(self, *args, **kwargs)

    setattr(destroy, _MARK, True)
    return destroy


def register() -> bool:
    """Installs the wrappers when ``PCIE_A2A_ALLREDUCE=1`` (idempotent); True if installed.
    Raises the launch refusal when they cannot be installed."""
    if not env.allreduce_enabled():
        return False
    done: list[tuple[Any, str, Any]] = []
    try:
        for cls_name, module in _MODULES.items():
            cls = getattr(importlib.import_module(module), cls_name)
            wraps = [("__init__", _wrap_init), ("destroy", _wrap_destroy)]
            if cls_name == "CpuCommunicator":
                wraps.append(("all_reduce", _wrap_cpu_all_reduce))
            for name, wrap in wraps:
                current = cls.__dict__.get(name) or getattr(cls, name)
                if getattr(current, _MARK, False):
                    continue
                done.append((cls, name, cls.__dict__.get(name)))
                setattr(cls, name, wrap(current))
    except Exception as exc:
        for cls, name, old in reversed(done):
            if old is None:
                delattr(cls, name)
            else:
                setattr(cls, name, old)
        raise _allreduce.refuse(
            "vLLM", f"its device communicators cannot be hooked ({type(exc).__name__}: {exc})"
        ) from exc
    if done:
        logger.info("pcie_a2a all-reduce hooks installed on vLLM's CudaCommunicator and "
                    "CpuCommunicator (PCIE_A2A_ALLREDUCE=1)")  # fmt: skip
    return True
