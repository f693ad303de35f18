"""Helpers for the framework test group (SGLang and vLLM on the CPU transport).

Imported by the test modules in the pytest process *and* in the spawned rank processes,
so everything here must work without pytest's conftest machinery.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
STUBS = HERE.parent / "stubs"
REQUIRE_ENV = "PCIE_A2A_REQUIRE_FRAMEWORKS"


def add_torchvision_stub() -> bool:
    """Puts tests/stubs on sys.path when no real torchvision is importable."""
    if str(STUBS) in sys.path:
        return True
    if importlib.util.find_spec("torchvision") is not None:
        return False
    sys.path.insert(0, str(STUBS))
    return True


def import_framework(name: str):
    """Imports ``name`` or skips the calling module (fails instead when the environment
    variable PCIE_A2A_REQUIRE_FRAMEWORKS=1, so CI cannot skip silently)."""
    import pytest

    add_torchvision_stub()
    try:
        return importlib.import_module(name)
    except Exception as exc:
        reason = (
            f"{name} is not importable ({type(exc).__name__}: {exc}); install it with "
            "scripts/install_framework_test_deps.sh"
        )
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
        pytest.skip(reason, allow_module_level=True)


def make_entry_point_dist(group: str, name: str, value: str) -> str:
    """A throwaway ``*.dist-info`` declaring one entry point, in a fresh temp dir that is
    returned (put it on sys.path): the same discovery path as ``pip install pcie-a2a``
    without touching the environment's site-packages."""
    root = tempfile.mkdtemp(prefix="pcie_a2a_ep_")
    atexit.register(shutil.rmtree, root, True)  # only the creating process removes it
    # one distribution name per group: importlib.metadata keeps only the first
    # distribution of a given name on sys.path
    dist = "pcie_a2a_fwtest_" + "".join(c if c.isalnum() else "_" for c in group)
    info = Path(root) / f"{dist}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {value}\n")
    return root


def declare_entry_point(group: str, value: str, env_name: str) -> None:
    """Makes ``pcie_a2a = value`` discoverable in ``group`` for this process and for the
    rank processes it spawns: the dist-info directory made once is passed down through
    ``env_name`` (spawned children import the test module again)."""
    if not os.environ.get(env_name):
        os.environ[env_name] = make_entry_point_dist(group, "pcie_a2a", value)
    if os.environ[env_name] not in sys.path:
        sys.path.append(os.environ[env_name])


def moe_problem(rank: int, world: int, num_experts: int, top_k: int, hidden: int, seed: int):
    """Per-rank tokens and routes (rank 1 of 3+ ranks sends no tokens), plus the global
    expert weights every rank can rebuild."""
    import torch

    from pcie_a2a.reference import make_expert_weights

    g = torch.Generator().manual_seed(seed * 1000 + rank)
    t = 0 if (world >= 3 and rank == 1) else 5 + 3 * rank
    x = (torch.randn(t, hidden, generator=g) * 0.5).to(torch.bfloat16)
    logits = torch.randn(t, num_experts, generator=g)
    w, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).float()
    w13, w2 = make_expert_weights(num_experts, hidden, 32, torch.bfloat16, seed=seed)
    return x, ids.to(torch.int32), w, w13, w2


def dense_reference(x, ids, w, w13, w2):
    """What the MoE must return for this rank's tokens: fp32 sum over the global experts."""
    import torch

    from pcie_a2a.reference import expert_forward

    return expert_forward(x, ids.long(), w, w13, w2).to(torch.float32)
