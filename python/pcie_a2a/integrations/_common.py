"""Framework-independent pieces shared by the SGLang and vLLM adapters: version gates,
the per-process Buffer cache, and the one decision of where tokens move.

:func:`device_resident` is that decision. A device-resident Buffer (the CUDA transport)
takes the framework's tensors where they are and returns rows on the same device: no
``.cpu()``, no ``.to(device)``, and its low-latency calls never read the device from the
host. Otherwise (the CPU transport: CPU servers, ``PCIE_A2A_BACKEND=cpu``) the adapters
stage device tensors through host memory with :func:`to_host` and copy the results back:
four blocking device-host copies per MoE call, the cost docs/sglang.md and docs/vllm.md
state."""

from __future__ import annotations

import re
import threading
import warnings
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.distributed as dist

from pcie_a2a import env
from pcie_a2a.buffer import Buffer
from pcie_a2a.placement import Placement

DEFAULT_MAX_TOKENS_PER_RANK = 4096


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: ``"0.5.23.post1"`` -> ``(0, 5, 23)``."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    if not m:
        raise ValueError(f"cannot read a version number from {text!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def check_version(
    package: str,
    installed: str | None,
    minimum: tuple[int, ...],
    below: tuple[int, ...],
    skip_env: str,
) -> str:
    """Raises ImportError unless ``minimum <= installed < below``; returns the version.

    ``installed=None`` reads the installed distribution's version. Setting the environment
    variable ``skip_env`` to 1 turns the error into a warning (at your own risk).
    """
    if installed is None:
        try:
            installed = version(package)
        except PackageNotFoundError as exc:
            raise ImportError(f"pcie_a2a.integrations: {package} is not installed") from exc
    lo, hi = ".".join(map(str, minimum)), ".".join(map(str, below))
    v = parse_version(installed)
    if minimum <= v < below:
        return installed
    msg = (
        f"pcie_a2a supports {package} >={lo},<{hi}; {package} {installed} is installed. "
        f"Install a supported {package} release, or set {skip_env}=1 to try anyway."
    )
    if env.is_one(skip_env):
        warnings.warn(msg, stacklevel=2)
        return installed
    raise ImportError(msg)


def max_tokens_per_rank(default: int = DEFAULT_MAX_TOKENS_PER_RANK) -> int:
    return env.max_tokens_per_rank(default)


def payload() -> str | None:
    """``PCIE_A2A_PAYLOAD``: ``fp8`` for the FP8 dispatch payload; default: the dtype of x."""
    return env.payload()


#: why a GPU server spanning nodes is refused (SGLang's and vLLM's launch)
MULTI_NODE_CUDA = (
    "the multi-node Buffer runs only the CPU transport in this release (the NCCL stage "
    "between nodes and the per-node CUDA kernels are not built); PCIE_A2A_BACKEND=cpu runs "
    "it with tokens staged through host memory (slow, no CUDA graphs), docs/internode.md"
)


_BUFFERS: dict[tuple, Buffer] = {}
_LOCK = threading.Lock()


def shared_buffer(
    group: dist.ProcessGroup | None,
    num_experts: int,
    hidden: int,
    num_topk: int,
    dtype: torch.dtype,
    max_tokens: int,
    placement: Placement | None = None,
) -> Buffer:
    """One Buffer per (group, shape, placement) and process, shared by every MoE layer:
    layers run one after another, so they can reuse the same regions (as DeepEP's one
    global buffer). ``placement`` None: contiguous blocks.

    Creating it is collective over ``group``: every rank must ask for the same key in the
    same order (true for layers built and run in model order).
    """
    pay = payload() or {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "bf16")
    where = None if placement is None else tuple(tuple(r) for r in placement.replicas)
    key = (id(group), num_experts, hidden, num_topk, dtype, max_tokens, pay, where)
    with _LOCK:
        buf = _BUFFERS.get(key)
        if buf is None:
            buf = Buffer(
                group,
                num_experts,
                hidden,
                max_tokens,
                dtype=dtype,
                payload=pay,
                num_topk=num_topk,
                placement=placement,
            )
            _BUFFERS[key] = buf
        return buf


def close_buffers() -> None:
    """Closes every cached Buffer of this process (tests; process shutdown)."""
    with _LOCK:
        for buf in _BUFFERS.values():
            buf.close()
        _BUFFERS.clear()


_WARNED: set[str] = set()


def device_resident(buf: Buffer) -> bool:
    """Whether ``buf`` moves the framework's tensors where they are (the CUDA transport:
    rows stay on the device, low-latency calls never synchronise with the host) or only
    host tensors (the CPU transport). The adapters branch on this and nothing else."""
    flag = getattr(buf, "device_resident", None)  # the Buffer's own answer, where it has one
    if flag is None:
        flag = bool(getattr(buf._transport, "device_side", False))
    return bool(flag)


def to_host(t: torch.Tensor | None, what: str) -> torch.Tensor | None:
    """Host staging for a Buffer that is not :func:`device_resident`: device tensors go
    through host memory (correct, slow: a blocking copy each way; warns once per process)."""
    if t is None or t.device.type == "cpu":
        return t
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(
            f"pcie_a2a: {what} is on {t.device} but the Buffer runs the CPU transport "
            "(PCIE_A2A_BACKEND=cpu or a CPU build): tokens are staged through host memory, "
            "which is slow",
            stacklevel=3,
        )
    return t.cpu()


def stage_in(buf: Buffer, t: torch.Tensor | None, what: str) -> torch.Tensor | None:
    """``t`` as ``buf`` takes it: as it is on a device-resident Buffer, else on the host."""
    return t if device_resident(buf) else to_host(t, what)


def stage_out(buf: Buffer, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A result of ``buf`` where the framework wants it: as it is on a device-resident
    Buffer (already there), else copied back from the host."""
    return t if device_resident(buf) else t.to(device)


def check_topk_ids_width(num_topk: int, got: int, framework: str) -> None:
    if got > num_topk:
        raise ValueError(
            f"pcie_a2a ({framework}): the router returned top-{got} but the layer was "
            f"configured for top-{num_topk}"
        )


def dispatch(buf: Buffer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, layout=None):
    """``buf.dispatch`` (or the low-latency one with ``layout``), naming the environment
    variable to raise when a call carries more tokens than the buffers were sized for
    (the Buffer itself tells the peers, so no rank hangs)."""
    try:
        if layout is None:
            return buf.dispatch(x, ids, w)
        return buf.low_latency_dispatch(x, ids, w, layout=layout)
    except ValueError as exc:
        if x.shape[0] > buf.max_tokens_per_rank:
            raise ValueError(
                f"pcie_a2a: this rank passed {x.shape[0]} tokens to one MoE call but the "
                f"buffers hold {buf.max_tokens_per_rank}; set PCIE_A2A_MAX_TOKENS_PER_RANK "
                f"to at least {x.shape[0]} (e.g. the chunked-prefill size)"
            ) from exc
        raise
