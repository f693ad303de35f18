"""Will a (tokens, payload) config fit in this machine's memory? Estimates, not promises.

Per rank: the transport's shared-memory segment (2 parities x world sources x tokens
slots, for dispatch and for combine; see csrc/core/wire_format.h), plus the largest
working set of the three methods (the per-expert baseline holds four [T*k, H] bf16
tensors, the others a few [world*T, H] ones), plus chunked fp32 temporaries.

``--backend cuda``: the same per-rank bytes are device memory (the CUDA transport's device
segment has the shm segment's layout; the working sets live on the GPU), times the ranks
sharing a GPU, against that GPU's free memory (``torch.cuda.mem_get_info``, measured by
every rank on its own GPU once its CUDA context exists). Host staging segments (pairs
without P2P) are not estimated: a /dev/shm too small for them fails at Buffer creation
with the transport's error.
"""

from __future__ import annotations

import os

from pcie_a2a import env
from pcie_a2a.buffer_memory import transport_memory

CHUNK_ROWS = 2048  # rows per chunk of the stand-in expert and of weighted sums


def segment_bytes(world: int, tokens: int, hidden: int, topk: int, payload: str) -> int:
    """The transport's receive segment: the Buffer's own formula (buffer_memory.py)."""
    return transport_memory("cpu", world, hidden, tokens, topk, payload).segment


def estimate(cfg: dict, world: int, tokens: int, payload: str) -> dict:
    h, k = cfg["hidden"], cfg["topk"]
    shm = segment_bytes(world, tokens, h, k, payload)
    per_expert = int(tokens * k * 2 * h * 4.5)  # send, recv (skew margin), y, back
    gathered = world * tokens * h * 4  # all-gathered x and partial outputs, or ours' rows
    per_rank = shm + 2 * tokens * h + max(per_expert, gathered) + CHUNK_ROWS * h * 16 + (64 << 20)
    return {"world": world, "shm_per_rank": shm, "bytes_per_rank": per_rank}


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _shm_free() -> int | None:
    try:
        st = os.statvfs(env.shm_dir())
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def why_not(need: dict) -> str | None:
    """A message when the config would not fit (skip it), else None."""
    world, gib = need["world"], 1 << 30
    total = world * need["bytes_per_rank"]
    avail = _mem_available()
    if avail is not None and total > 0.85 * avail:
        return (
            f"needs ~{total / gib:.1f} GiB of memory for {world} ranks, "
            f"{avail / gib:.1f} GiB available"
        )
    shm = world * need["shm_per_rank"]
    free = _shm_free()
    if free is not None and shm > free:
        return (
            f"needs ~{shm / gib:.1f} GiB of shared memory in {env.shm_dir()}, "
            f"{free / gib:.1f} GiB free"
        )
    return None


def why_not_gpu(need: dict, free: int, sharing: int, device: int) -> str | None:
    """A message when ``sharing`` ranks of this config would not fit in GPU ``device``'s
    ``free`` bytes (skip it), else None."""
    gib = 1 << 30
    total = sharing * need["bytes_per_rank"]
    if total > 0.85 * free:
        return (
            f"needs ~{total / gib:.1f} GiB of GPU {device} memory for {sharing} "
            f"rank{'s' if sharing != 1 else ''}, {free / gib:.1f} GiB free"
        )
    return None
