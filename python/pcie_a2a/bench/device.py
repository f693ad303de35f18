"""Where each rank runs, and which process group it uses, for ``--backend cpu|cuda``.

The decisions are pure functions of (backend, GPUs visible, ranks on this node) so they
are tested without a GPU:

* ``cpu``: gloo; tensors on the host; the CPU shared-memory transport.
* ``cuda``: rank r uses GPU ``r % device_count``. With a GPU per rank the group is NCCL,
  so the baselines are what GPU users run (``all_to_all_single`` and all-gather +
  reduce-scatter on NCCL). NCCL cannot put two ranks of one communicator on one GPU, so
  when ranks share a GPU the group is gloo, used only for bootstrap, barriers and the
  statistics, and the baselines do not run: a gloo "baseline" of CUDA tensors would be
  staged through the host and would say nothing about what users run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BACKENDS = ("cpu", "cuda")


@dataclass(frozen=True)
class DeviceRunSpec:
    backend: str  # "cpu" | "cuda": the pcie_a2a transport
    pg_backend: str  # "gloo" | "nccl": the torch.distributed group
    device_count: int  # GPUs visible to torch (0 for cpu)
    local_world: int  # ranks on this machine
    baselines_na: str | None  # why the baselines cannot run, or None


def na_reason(local_world: int, device_count: int) -> str:
    gpus = f"{device_count} GPU" + ("" if device_count == 1 else "s")
    return f"n/a: NCCL needs one GPU per rank; {local_world} ranks share {gpus}"


def run_spec(backend: str, device_count: int, local_world: int) -> DeviceRunSpec:
    """The process-group backend and whether the baselines can run."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: got {backend!r}; allowed: {', '.join(BACKENDS)}")
    if local_world < 1:
        raise ValueError(f"local_world: got {local_world}; allowed: a positive int")
    if backend == "cpu":
        return DeviceRunSpec("cpu", "gloo", device_count, local_world, None)
    if device_count < 1:
        raise ValueError(f"device_count: got {device_count}; allowed: >= 1 with backend cuda")
    if device_count >= local_world:
        return DeviceRunSpec("cuda", "nccl", device_count, local_world, None)
    return DeviceRunSpec(
        "cuda", "gloo", device_count, local_world, na_reason(local_world, device_count)
    )


def rank_device(local_rank: int, device_count: int) -> int:
    """The GPU index of a rank (round robin when ranks outnumber GPUs)."""
    return local_rank % device_count


def ranks_on_device(local_world: int, device_count: int, device: int) -> int:
    """How many of this machine's ranks share GPU ``device`` (for the memory check)."""
    return sum(1 for r in range(local_world) if rank_device(r, device_count) == device)


def cuda_unusable() -> str | None:
    """Why ``--backend cuda`` cannot run here (one line), or None."""
    from pcie_a2a import cuda_available, cuda_unavailable_reason

    if not cuda_available():
        why = cuda_unavailable_reason()
    else:
        try:
            from pcie_a2a import _cuda_transport  # noqa: F401
        except ImportError as exc:
            why = f"the CUDA transport (pcie_a2a._cuda_transport) is not in this build: {exc}"
        else:
            return None
    return " ".join(why.split())  # the message must stay on one line


def make_clock(device: torch.device) -> Callable[[], int]:
    """``perf_counter_ns``; on a GPU after ``torch.cuda.synchronize`` so that a stamp
    marks completed work, not work enqueued."""
    if device.type != "cuda":
        return time.perf_counter_ns
    import torch

    def clock() -> int:
        torch.cuda.synchronize(device)
        return time.perf_counter_ns()

    return clock


def gpu_info() -> dict:
    """GPU names, count and the CUDA/NCCL versions torch uses (for the report)."""
    import torch

    count = torch.cuda.device_count()
    nccl = None
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(str(p) for p in v) if isinstance(v, tuple) else str(v)
    except (AttributeError, RuntimeError):
        pass
    return {
        "gpu_count": count,
        "gpus": [torch.cuda.get_device_name(i) for i in range(count)],
        "cuda": torch.version.cuda,
        "nccl": nccl,
    }


def run_spec_here(backend: str, local_world: int) -> DeviceRunSpec:
    """Where the ranks run; exits 2 with one line when ``--backend cuda`` cannot run here
    (checked after the other options, so a bad option is reported first)."""
    if backend == "cpu":
        return run_spec("cpu", 0, local_world)
    why = cuda_unusable()
    if why:  # one line, no traceback: the usual answer on a box without a GPU
        print(
            f"pcie-a2a bench: error: --backend: got 'cuda', which cannot run here ({why}); "
            "allowed here: cpu",
            file=sys.stderr,
        )
        raise SystemExit(2)
    import torch

    return run_spec("cuda", torch.cuda.device_count(), local_world)
