"""A /dev/shm too small for a Buffer is a clear error, not a SIGBUS (issue 10 section 3,
issue 15 section 3): both transports and the CPU all-reduce reserve a segment's space
(posix_fallocate after the NUMA bind) before touching its pages, and say what is needed and
how to get it.

Docker's default /dev/shm is 64 MiB; ``ftruncate`` succeeds whatever the free space, and
before the reservation the first page touch past it killed the process (exit 135, no
message). These tests give a child process a private mount namespace with a small tmpfs on
/dev/shm (``unshare -m``, root only; skipped with the reason elsewhere). The CUDA transport's
host staging segment: tests/test_cuda_transport_emulation.py (same helper).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def in_small_shm(
    script: str, size: str = "16m", timeout: float = 300
) -> subprocess.CompletedProcess:
    """Runs `script` with python in a mount namespace whose /dev/shm is a `size` tmpfs."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to give a child a small private /dev/shm")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs /dev/shm"],
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs on /dev/shm here: {probe.stderr.strip()}")
    import pcie_a2a

    # the pcie_a2a this test imported (the source tree in a dev build, site-packages in CI)
    pkg = str(Path(pcie_a2a.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pkg, str(ROOT / "tests")]))
    cmd = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "{sys.executable}" -c "$0"'
    return subprocess.run(["unshare", "-m", "sh", "-c", cmd, script], capture_output=True,
                          text=True, env=env, timeout=timeout)  # fmt: skip


_BUFFERS = textwrap.dedent(
    """
    import json
    import torch, torch.distributed as dist
    from dist_utils import free_port
    import pcie_a2a
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    out = {}
    try:  # a Kimi-sized decode Buffer: ~470 MB of segment for one rank
        pcie_a2a.Buffer(None, 384, 7168, 4096, backend="cpu")
        out["big"] = "created"
    except RuntimeError as exc:
        out["big"] = str(exc)
    with pcie_a2a.Buffer(None, 8, 128, 8, num_topk=2, backend="cpu") as buf:  # fits: works
        x = torch.randn(4, 128).to(torch.bfloat16)
        ids = torch.tensor([[0, 1], [2, -1], [3, 4], [5, 6]])
        res = buf.dispatch(x, ids, torch.rand(4, 2))
        out["small"] = list(res.x.shape)
    print(json.dumps(out))
    """
)


def _outcome_in_small_shm(script: str) -> dict:
    """The JSON line `script` prints last, run in a 16 MiB /dev/shm; exit 135 is a SIGBUS."""
    r = in_small_shm(script)
    assert r.returncode == 0, f"exit {r.returncode} (135: SIGBUS)\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_cpu_transport_says_dev_shm_is_too_small():
    out = _outcome_in_small_shm(_BUFFERS)
    msg = out["big"]
    assert msg.startswith("Buffer bootstrap failed while creating shared memory"), msg
    for part in ("/dev/shm is too small", "bytes (", "--shm-size=", "--ipc=host", "MiB free"):
        assert part in msg, (part, msg)
    assert out["small"] == [4, 128]  # a segment that fits is reserved and used


_ALLREDUCE = textwrap.dedent(
    """
    import json
    import torch, torch.distributed as dist
    from dist_utils import free_port
    import pcie_a2a
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    out = {}
    try:  # 2 x 32 MiB of segment: more than the 16 MiB /dev/shm
        pcie_a2a.AllReduce(None, 32 << 20, backend="cpu")
        out["big"] = "created"
    except RuntimeError as exc:
        out["big"] = str(exc)
    with pcie_a2a.AllReduce(None, 1 << 16, backend="cpu") as ar:  # fits: works
        x = torch.randn(4096).to(torch.bfloat16)
        out["small"] = torch.equal(ar.all_reduce(x.clone()), x)
    print(json.dumps(out))
    """
)


def test_cpu_allreduce_says_dev_shm_is_too_small():
    """The all-reduce's segments take the same reservation (before it: SIGBUS, exit 135)."""
    out = _outcome_in_small_shm(_ALLREDUCE)
    msg = out["big"]
    for part in ("/dev/shm is too small", "an all-reduce of this size", "--shm-size=", "max_bytes"):
        assert part in msg, (part, msg)
    assert out["small"] is True  # a segment that fits is reserved and used
