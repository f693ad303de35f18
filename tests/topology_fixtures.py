"""Where the real-box topology dumps are: the project's shared/fixtures/topology when it
sits beside this checkout (the source of truth), else the vendored copy in
tests/fixtures/topology (test_topology_parsers checks the two are equal)."""

from __future__ import annotations

from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared/fixtures/topology"
VENDORED = Path(__file__).resolve().parent / "fixtures/topology"
FIXTURES = SHARED if SHARED.is_dir() else VENDORED
