"""Loading of the compiled modules, and what the build and the machine can do.

The C++ core (``_transport``) is always built. The CUDA module (``_cuda``) is built only
when nvcc was found at build time; importing the package never requires a GPU or driver.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


def transport() -> ModuleType:
    return importlib.import_module("pcie_a2a._transport")


@functools.lru_cache(maxsize=1)
def _cuda_module() -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module("pcie_a2a._cuda"), ""
    except ImportError as exc:
        return None, (
            "the CUDA extension pcie_a2a._cuda is not in this build (built without nvcc, "
            f"or with PCIE_A2A_WITH_CUDA=0): {exc}"
        )


def cuda_module() -> ModuleType | None:
    return _cuda_module()[0]


@functools.lru_cache(maxsize=1)
def _cuda_status() -> tuple[bool, str]:
    mod, why = _cuda_module()
    if mod is None:
        return False, why
    if hasattr(mod, "driver_version"):  # the driver floor of this build's static runtime
        from pcie_a2a.cuda_checks import driver_floor_problem

        problem = driver_floor_problem(mod.driver_version(), mod.cuda_runtime_version)
        if problem:
            return False, problem
    count, err = mod.device_count()
    if err:
        return False, f"no usable CUDA driver or device: {err}"
    if count == 0:
        return False, "no CUDA device is visible"
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "torch was built without CUDA or cannot see the device"
    return True, ""


def cuda_available() -> bool:
    """True when the CUDA kernels are built and a CUDA device is usable from torch."""
    return _cuda_status()[0]


def cuda_unavailable_reason() -> str:
    """Why :func:`cuda_available` is False ("" when it is True)."""
    return _cuda_status()[1]
