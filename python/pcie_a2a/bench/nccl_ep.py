"""NCCL EP (NVIDIA/nccl ``contrib/nccl_ep``, NCCL 2.29+, CUDA 13): NCCL's own expert-parallel
dispatch/combine, the newest peer of pcie_a2a (its low-latency mode is a direct all-to-all
that may run over P2P on PCIe boxes). Python reaches it through the ``nccl_ep`` package
(ctypes bindings of ``libnccl_ep.so``: ``HAVE_NCCL_EP``, ``NCCLLibrary`` with
``ncclEpCreateGroup`` / ``ncclEpCreateHandle`` / ``ncclEpDispatch`` / ``ncclEpCombine``)
on top of an NCCL communicator (nccl4py's ``nccl`` package or torch's).

``pcie-a2a bench --backend cuda`` reports the arm ``nccl_ep`` in every config: "not
installed" with the reason when the package or its library is missing. When it imports,
the arm is still not timed: the C API's group and handle calls have changed signature
between releases (``ncclEpCreateGroup`` with and without a stream and allocator), and no
adapter here has run against a real library, so the bench says so rather than guess. The
timing arm (same inputs as a2a and ag_rs, the same ``expected_output`` check) is to be
written on the first box that has it installed.
"""

from __future__ import annotations

import importlib

ARM = "nccl_ep"


def status() -> tuple[bool, str]:
    """(importable with its library, why not / what was found). Never raises."""
    try:
        mod = importlib.import_module("nccl_ep")
    except ImportError as exc:
        return False, f"not installed (import nccl_ep: {exc})"
    except Exception as exc:  # a broken install: its library failed to load, say
        return False, f"not usable (import nccl_ep: {type(exc).__name__}: {exc})"
    if not getattr(mod, "HAVE_NCCL_EP", False):
        return False, "not installed (the nccl_ep package imports but finds no libnccl_ep.so)"
    version = getattr(mod, "__version__", "?")
    return True, f"nccl_ep {version}"


def unavailable_reason() -> str:
    """Why the bench does not time the NCCL EP arm here (always a reason today)."""
    ok, what = status()
    if not ok:
        return what
    return (
        f"installed ({what}) but not timed: its C API changed between releases and this "
        "bench has no adapter that has run against it (pcie_a2a/bench/nccl_ep.py)"
    )
