"""Dispatch/combine benchmark: a thin wrapper around ``pcie-a2a bench`` (same code, same
options; see docs/benchmarks.md for the columns and the numbers measured so far).

Default (a Kimi K2 decode step: hidden 7168, 384 experts, top-8, 128 tokens per rank,
bf16 and fp8 payloads, uniform routing, 4 spawned CPU ranks on gloo)::

    PYTHONPATH=python python benchmarks/bench_dispatch.py

The sweep in docs/benchmarks.md::

    PYTHONPATH=python python benchmarks/bench_dispatch.py --tokens 1,16,128,512,4096

On GPUs, Buffer(backend="cuda") against NCCL baselines (one rank per GPU; see
docs/benchmarks.md for what runs when ranks share a GPU)::

    PYTHONPATH=python python benchmarks/bench_dispatch.py --backend cuda --world 8

Under torchrun (one rank per process; --world is ignored)::

    PYTHONPATH=python torchrun --nproc-per-node 4 benchmarks/bench_dispatch.py
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    try:
        import pcie_a2a  # noqa: F401
    except ImportError:  # run from a checkout without PYTHONPATH
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from pcie_a2a.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
