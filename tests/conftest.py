import os
from pathlib import Path

import pytest

SHM = Path(os.environ.get("PCIE_A2A_SHM_DIR", "/dev/shm"))


def _owner_alive(name: str) -> bool:
    # Segment names are pcie_a2a.<pid of rank 0 at creation>_<random>.r<rank>
    try:
        pid = int(name.split(".")[1].split("_")[0])
    except (IndexError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def orphaned_segments() -> set[str]:
    """pcie_a2a segments whose creating process is gone: leaks, whoever made them.

    Segments of live processes are ignored so that concurrent test runs on one machine
    do not see (or remove) each other's working segments.
    """
    if not SHM.exists():
        return set()
    return {p.name for p in SHM.glob("pcie_a2a.*") if not _owner_alive(p.name)}


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Every test must leave no segment behind once its processes are gone."""
    before = orphaned_segments()
    yield
    leaked = orphaned_segments() - before
    for name in leaked:  # clean up so one leak does not fail every later test
        (SHM / name).unlink(missing_ok=True)
    assert not leaked, f"shared-memory segments leaked: {sorted(leaked)}"


@pytest.fixture(scope="session")
def single_rank_group():
    """A gloo group of one rank in the pytest process, for single-process Buffer tests."""
    import torch.distributed as dist

    from dist_utils import free_port

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    yield None


def pytest_configure(config):
    # The first tier of the GPU checks (scripts/gpu_check.sh): -m "gpu and smoke".
    config.addinivalue_line("markers", "smoke: first-tier GPU checks, run before the rest")
