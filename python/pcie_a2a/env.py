"""Every ``PCIE_A2A_*`` environment knob, read in this one module.

Each knob is read when it is asked for (not at import), so tests and launchers can set
it per process. Bad values raise ValueError naming the variable, the value and what is
allowed.
"""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def get_bool(name: str) -> bool | None:
    """Tri-state boolean: None when unset."""
    value = _get(name)
    if value is None:
        return None
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: expected one of 1/0, true/false, yes/no, on/off")


def get_float(name: str, default: float) -> float:
    value = _get(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number") from None


def backend() -> str | None:
    """PCIE_A2A_BACKEND: force the transport used by ``backend="auto"`` (cpu or cuda)."""
    value = _get("PCIE_A2A_BACKEND")
    if value is not None and value not in ("cpu", "cuda"):
        raise ValueError(f"PCIE_A2A_BACKEND={value!r}: expected 'cpu' or 'cuda'")
    return value


def timeout_s(default: float) -> float:
    """PCIE_A2A_TIMEOUT_S: default per-call timeout of a Buffer in seconds."""
    return get_float("PCIE_A2A_TIMEOUT_S", default)


def shm_dir() -> str:
    """Where POSIX shared memory segments appear (for leak checks); Linux: /dev/shm."""
    return _get("PCIE_A2A_SHM_DIR") or "/dev/shm"


def topo_file() -> str | None:
    """PCIE_A2A_TOPO_FILE: read the topology from this file instead of the live machine."""
    return _get("PCIE_A2A_TOPO_FILE")


def p2p() -> bool | None:
    """PCIE_A2A_P2P: force peer-to-peer on (1) or off (0) for every pair."""
    return get_bool("PCIE_A2A_P2P")


def p2p_level() -> str | None:
    """PCIE_A2A_P2P_LEVEL: farthest path class allowed for P2P (NV, PIX, PXB, PHB, NODE, SYS)."""
    value = _get("PCIE_A2A_P2P_LEVEL")
    allowed = ("NV", "PIX", "PXB", "PHB", "NODE", "SYS")
    if value is not None and value.upper() not in allowed:
        raise ValueError(f"PCIE_A2A_P2P_LEVEL={value!r}: expected one of {', '.join(allowed)}")
    return None if value is None else value.upper()


# Pairs below this stay on warp stores; see csrc/cuda/transport/cuda_transport.cuh. A guess
# until measured on a PCIe box (benchmarks/bench_cuda_one_gpu.py --copy-engine compares).
COPY_ENGINE_MIN_BYTES_DEFAULT = 256 * 1024


def copy_engine_min_bytes() -> int | None:
    """PCIE_A2A_COPY_ENGINE_MIN_BYTES: normal-mode pairs moving at least this many bytes go
    through the copy engine (cudaMemcpyAsync); ``off`` (or -1) keeps every pair on warp
    stores. Default 256 KiB (not yet measured)."""
    value = _get("PCIE_A2A_COPY_ENGINE_MIN_BYTES")
    if value is None:
        return COPY_ENGINE_MIN_BYTES_DEFAULT
    if value.lower() in ("off", "none", "-1"):
        return None
    try:
        parsed = int(value)
    except ValueError:
        parsed = -1
    if parsed < 0:
        raise ValueError(
            f"PCIE_A2A_COPY_ENGINE_MIN_BYTES={value!r}: expected a byte count >= 0 or 'off'"
        )
    return parsed


# ---- framework integrations (pcie_a2a.integrations) ---------------------------------------
def get_int(name: str, default: int, minimum: int = 1) -> int:
    value = _get(name)
    if value is None:
        return default
    try:
        parsed = int(value)
    except ValueError:
        parsed = minimum - 1
    if parsed < minimum:
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")
    return parsed


def max_tokens_per_rank(default: int) -> int:
    """PCIE_A2A_MAX_TOKENS_PER_RANK: most tokens one rank passes to one MoE call (integrations)."""
    return get_int("PCIE_A2A_MAX_TOKENS_PER_RANK", default)


def payload() -> str | None:
    """PCIE_A2A_PAYLOAD: ``fp8`` for the FP8 dispatch payload; None: the dtype of x."""
    value = (_get("PCIE_A2A_PAYLOAD") or "").lower()
    if value in ("", "auto"):
        return None
    if value not in ("bf16", "fp16", "fp8"):
        raise ValueError(f"PCIE_A2A_PAYLOAD={value!r}: expected bf16, fp16 or fp8")
    return value


def is_one(name: str) -> bool:
    """A switch that is on only when set to 1 (e.g. PCIE_A2A_SGLANG_SKIP_VERSION_CHECK)."""
    return _get(name) == "1"


def sglang_enabled() -> bool:
    """PCIE_A2A_SGLANG=0 leaves SGLang's ``customized`` a2a backend to another plugin."""
    return _get("PCIE_A2A_SGLANG") != "0"


def sglang_output_format(allowed: tuple[str, ...]) -> str:
    """PCIE_A2A_SGLANG_FORMAT: what the SGLang dispatcher emits (default ``standard``)."""
    value = (_get("PCIE_A2A_SGLANG_FORMAT") or "standard").lower()
    if value not in allowed:
        raise ValueError(f"PCIE_A2A_SGLANG_FORMAT={value!r}: expected one of {', '.join(allowed)}")
    return value


def vllm_enabled() -> bool:
    """PCIE_A2A_VLLM=1 selects pcie_a2a's prepare/finalize in vLLM (off by default)."""
    return _get("PCIE_A2A_VLLM") == "1"
