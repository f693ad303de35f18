"""The ``pcie-a2a bench`` command: see :mod:`pcie_a2a.bench.cli` and docs/benchmarks.md."""
