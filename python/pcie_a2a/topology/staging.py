"""NUMA-bound host staging memory from Python (the native ``_numa`` module).

A refused bind (containers without CAP_SYS_NICE) is a RuntimeWarning and unbound memory,
never an error: staging still works, only slower when the pages land on the wrong node.
"""

from __future__ import annotations

import importlib
from typing import Any


def _numa() -> Any:
    return importlib.import_module("pcie_a2a._numa")


def alloc_staging(nbytes: int, node: int, simulate_refusal: bool = False) -> Any:
    """An anonymous mapping of `nbytes` bound to NUMA `node` (-1: unbound), first-touched
    and verified. Supports the buffer protocol (``numpy.frombuffer``); ``.bound``, ``.node``
    and ``.warning`` say where it landed. `simulate_refusal` is for tests."""
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes={nbytes!r}: expected a positive integer")
    return _numa().NumaBuffer(nbytes, node, simulate_refusal)


def num_nodes() -> int:
    return int(_numa().num_nodes())
