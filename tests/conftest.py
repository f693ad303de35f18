import os
from pathlib import Path

import pytest

SHM = Path(os.environ.get("PCIE_A2A_SHM_DIR", "/dev/shm"))


def _segments() -> set[str]:
    return {p.name for p in SHM.glob("pcie_a2a.*")} if SHM.exists() else set()


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Every test must leave /dev/shm as it found it."""
    before = _segments()
    yield
    leaked = _segments() - before
    for name in leaked:  # clean up so one leak does not fail every later test
        (SHM / name).unlink(missing_ok=True)
    assert not leaked, f"shared-memory segments leaked: {sorted(leaked)}"
