"""What a Buffer's transport allocates per rank, from the wire format's own formulas
(csrc/core/wire_format.h: ``dispatch_slot_layout``, ``combine_slot_bytes``,
``segment_layout``, ``add_staged_progress``), without building one: ``pcie-a2a plan`` and
``Buffer.memory_bytes()`` both call :func:`transport_memory`. They must equal what the
native transports really allocate (a test compares them with the live segments), or the
planner's memory check would pass configurations that do not fit.

Per rank:

* CPU transport: one shared-memory segment (host) of ``segment_layout``.
* CUDA transport: one device segment of ``segment_layout`` + the staged-progress region;
  a pinned host segment of the same size when some peer reaches this rank host-staged;
  the copy engine's pack buffer (``world * max_tokens`` dispatch slots, device) when a
  normal-mode pair can reach ``copy_engine_min_bytes`` (the start-up self-test reaches it,
  so it is allocated before the first call). Tables of a few KiB (peer table, device state,
  the placement) are not counted.

``with_pull``: some pair of the group pulls (then every segment also holds the pull send
slots, the same size again).
"""

from __future__ import annotations

from dataclasses import dataclass

_HEADER = 4096
_FLAG_LINE = 64
_ALIGN = 16
_FP8_GROUP = 128
_EARLY_LINE = 1088
_CHUNK_ROWS = 16
PAYLOADS = {"bf16": 0, "fp16": 1, "fp8": 2}


def _up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def dispatch_slot_bytes(hidden: int, num_topk: int, payload: str) -> int:
    """One dispatch row on the wire: header, local experts, weights, payload (+ fp8 scales)."""
    weights = _up(16 + 4 * num_topk, _ALIGN)
    off = _up(weights + 4 * num_topk, _ALIGN)
    if payload == "fp8":
        scales = _up(off + hidden, _ALIGN)
        return _up(scales + 4 * (hidden // _FP8_GROUP), _ALIGN)
    return _up(off + 2 * hidden, _ALIGN)


def combine_slot_bytes(hidden: int) -> int:
    """One combine row: the hidden vector in the dtype of x."""
    return _up(2 * hidden, _ALIGN)


def row_bytes(hidden: int, num_topk: int, payload: str) -> tuple[int, int]:
    """(dispatch, combine) bytes one row takes on the wire: what every model of the
    exchange (the plan, the topology planner's Kimi traffic, the balancer) counts."""
    if payload not in PAYLOADS:
        raise ValueError(f"payload: got {payload!r}; allowed: 'bf16', 'fp16', 'fp8'")
    return dispatch_slot_bytes(hidden, num_topk, payload), combine_slot_bytes(hidden)


def segment_bytes(world: int, hidden: int, max_tokens: int, num_topk: int, payload: str,
                  with_pull: bool = False, staged_progress: bool = False) -> int:  # fmt: skip
    """``segment_layout(...).total`` (``staged_progress``: with the CUDA transport's
    progress region appended)."""
    d, c = dispatch_slot_bytes(hidden, num_topk, payload), combine_slot_bytes(hidden)
    w, m = world, max_tokens
    dispatch_off = _up(_HEADER + 2 * w * _FLAG_LINE, 4096)
    combine_off = _up(dispatch_off + 2 * w * m * d, 4096)
    total = _up(combine_off + 2 * w * m * c, 4096)
    if with_pull:
        pull_dispatch = _up(total + 2 * w * _FLAG_LINE, 4096)
        pull_combine = _up(pull_dispatch + 2 * w * m * d, 4096)
        total = _up(pull_combine + 2 * w * m * c, 4096)
    if staged_progress:
        chunks = (m + _CHUNK_ROWS - 1) // _CHUNK_ROWS
        total = _up(total + 2 * w * _EARLY_LINE + 2 * w * chunks * 8, 4096)
    return total


@dataclass(frozen=True)
class TransportMemory:
    """Bytes one rank's transport holds, by region."""

    backend: str
    segment: int  # the receive segment (device on CUDA, shared host memory on CPU)
    host_staging: int  # CUDA: pinned host segment for host-staged peers (0 when none)
    copy_engine_pack: int  # CUDA: the copy engine's pack buffer (0 when unreachable)

    @property
    def device_bytes(self) -> int:
        return self.segment + self.copy_engine_pack if self.backend == "cuda" else 0

    @property
    def host_bytes(self) -> int:
        return self.host_staging if self.backend == "cuda" else self.segment

    def as_dict(self) -> dict[str, int | str]:
        return {"backend": self.backend, "device": self.device_bytes, "host": self.host_bytes,
                "segment": self.segment, "host_staging": self.host_staging,
                "copy_engine_pack": self.copy_engine_pack}  # fmt: skip


def transport_memory(
    backend: str,
    world: int,
    hidden: int,
    max_tokens: int,
    num_topk: int,
    payload: str = "bf16",
    *,
    with_pull: bool = False,
    host_staged_peers: bool = False,
    copy_engine_min_bytes: int | None = 256 * 1024,
) -> TransportMemory:
    """One rank's transport memory for a Buffer of these arguments (``max_tokens``: the
    transport's capacity per source, ``max_tokens_per_rank``). ``host_staged_peers``: some
    peer reaches this rank through host memory (CUDA). ``copy_engine_min_bytes``: the copy
    engine's threshold (None: off)."""
    if backend not in ("cpu", "cuda"):
        raise ValueError(f"backend: got {backend!r}; allowed: 'cpu', 'cuda'")
    if payload not in PAYLOADS:
        raise ValueError(f"payload: got {payload!r}; allowed: 'bf16', 'fp16', 'fp8'")
    cuda = backend == "cuda"
    seg = segment_bytes(world, hidden, max_tokens, num_topk, payload, with_pull, cuda)
    if not cuda:
        return TransportMemory("cpu", seg, 0, 0)
    slot = dispatch_slot_bytes(hidden, num_topk, payload)
    reach = copy_engine_min_bytes is not None and max_tokens * slot >= max(copy_engine_min_bytes, 1)
    pack = world * max_tokens * slot if reach else 0
    return TransportMemory("cuda", seg, seg if host_staged_peers else 0, pack)
