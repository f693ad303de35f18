"""Every ``PCIE_A2A_*`` environment knob, read in this one module.

Each knob is read when it is asked for (not at import), so tests and launchers can set
it per process. Bad values raise ValueError naming the variable, the value and what is
allowed.
"""

from __future__ import annotations

import contextlib
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


def selftest() -> bool:
    """PCIE_A2A_SELFTEST=0: skip the known-answer dispatch + combine every Buffer on CUDA
    runs before its first call. UNSAFE: a broken path then returns wrong rows silently."""
    return get_bool("PCIE_A2A_SELFTEST") is not False


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


def local_world_size() -> int | None:
    """PCIE_A2A_LOCAL_WORLD_SIZE=L: ranks per node. Each host's ranks are split into nodes of
    L consecutive ranks, so one host can stand in for several nodes (tests, debugging); the
    inter-node path (pcie_a2a.internode) then runs between them. Unset: one node per host."""
    if _get("PCIE_A2A_LOCAL_WORLD_SIZE") is None:
        return None
    return get_int("PCIE_A2A_LOCAL_WORLD_SIZE", 0)


# ---- per-pair decisions and the calibration probe (pcie_a2a.topology) ----------------------
def _choice(
    name: str, allowed: tuple[str, ...], aliases: dict[str, str] | None = None
) -> str | None:
    """A lower-case choice among `allowed`; None when unset or ``auto``."""
    value = _get(name)
    if value is None or value.lower() == "auto":
        return None
    v = (aliases or {}).get(value.lower(), value.lower())
    if v not in allowed:
        raise ValueError(f"{name}={value!r}: expected auto or one of {', '.join(allowed)}")
    return v


def direction() -> str | None:
    """PCIE_A2A_DIRECTION: ``push`` or ``pull`` for every P2P pair (default auto: the plan
    decides per pair from the probe or the topology class)."""
    return _choice("PCIE_A2A_DIRECTION", ("push", "pull"))


@contextlib.contextmanager
def direction_forced(value: str | None):
    """Sets PCIE_A2A_DIRECTION to ``value`` ("push"/"pull"; None or "auto": unset) for the
    ``with`` block, then restores it (``pcie-a2a bench --direction`` builds one Buffer per
    direction in one process)."""
    if value not in (None, "auto", "push", "pull"):
        raise ValueError(f"PCIE_A2A_DIRECTION={value!r}: expected auto or one of push, pull")
    old = os.environ.get("PCIE_A2A_DIRECTION")
    if value in (None, "auto"):
        os.environ.pop("PCIE_A2A_DIRECTION", None)
    else:
        os.environ["PCIE_A2A_DIRECTION"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PCIE_A2A_DIRECTION", None)
        else:
            os.environ["PCIE_A2A_DIRECTION"] = old


def engine() -> str | None:
    """PCIE_A2A_ENGINE: ``sm`` (kernel-issued loads/stores) or ``copy_engine`` (``ce``) for
    every pair's payload (default auto: per pair from the probe)."""
    return _choice("PCIE_A2A_ENGINE", ("sm", "copy_engine"), {"ce": "copy_engine"})


def schedule() -> str | None:
    """PCIE_A2A_SCHEDULE: ``spread`` schedules for shared-link load only and ignores the
    posted-write collapse trigger (default auto: avoid the trigger for push, then spread)."""
    return _choice("PCIE_A2A_SCHEDULE", ("spread",))


_PAIR_CHOICES = {
    "push": ("direction", "push"),
    "pull": ("direction", "pull"),
    "p2p": ("path", "p2p"),
    "staged": ("path", "staged"),
    "sm": ("engine", "sm"),
    "ce": ("engine", "copy_engine"),
    "copy_engine": ("engine", "copy_engine"),
}


def pair_overrides() -> list[dict[str, object]]:
    """PCIE_A2A_PAIRS: per-pair decisions, ``SRC-DST:choice[+choice]`` separated by ``;``,
    ``,`` or blanks; SRC and DST are topology GPU indices or ``*``; choices: push, pull,
    p2p, staged, sm, ce (copy_engine). E.g. ``0-4:pull;*-7:staged+ce``. Later entries win.
    Returns ``[{"src": int | None, "dst": int | None, "path"/"direction"/"engine": str}]``."""
    value = _get("PCIE_A2A_PAIRS")
    if value is None:
        return []
    out: list[dict[str, object]] = []
    for entry in value.replace(",", ";").replace(" ", ";").split(";"):
        if not entry:
            continue
        pair, _, choices = entry.partition(":")
        ends = pair.split("-")
        ok = len(ends) == 2 and all(e == "*" or e.isdigit() for e in ends) and choices
        if not ok:
            raise ValueError(
                f"PCIE_A2A_PAIRS={value!r}: entry {entry!r}: expected SRC-DST:choice[+choice] "
                "with SRC and DST a GPU index or *"
            )
        item: dict[str, object] = {
            "src": None if ends[0] == "*" else int(ends[0]),
            "dst": None if ends[1] == "*" else int(ends[1]),
        }
        for c in choices.lower().split("+"):
            if c not in _PAIR_CHOICES:
                raise ValueError(
                    f"PCIE_A2A_PAIRS={value!r}: {c!r} in {entry!r}: expected one of "
                    f"{', '.join(_PAIR_CHOICES)}"
                )
            key, v = _PAIR_CHOICES[c]
            item[key] = v
        out.append(item)
    return out


def probe_file() -> str | None:
    """PCIE_A2A_PROBE_FILE: a recorded probe (``pcie-a2a probe`` JSON or
    p2pBandwidthLatencyTest output) to plan with instead of this machine's cached one."""
    return _get("PCIE_A2A_PROBE_FILE")


def probe_cache() -> bool:
    """PCIE_A2A_PROBE_CACHE=0: neither read nor write the per-machine probe cache."""
    return get_bool("PCIE_A2A_PROBE_CACHE") is not False


def cache_dir() -> str:
    """Where per-machine results are cached: $XDG_CACHE_HOME/pcie_a2a, else
    ~/.cache/pcie_a2a (the XDG base directory convention)."""
    base = _get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pcie_a2a")


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


def recv_blocks() -> int | None:
    """PCIE_A2A_RECV_BLOCKS: cap of every receive grid of the CUDA transport (blocks), so two
    Buffers on two streams cannot starve each other's send kernels. Default: one per SM."""
    return None if _get("PCIE_A2A_RECV_BLOCKS") is None else get_int("PCIE_A2A_RECV_BLOCKS", 0)


def pdl() -> bool:
    """PCIE_A2A_PDL: programmatic dependent launch of the CUDA transport's kernels on sm_90
    and newer (default on; 0 launches them plainly)."""
    value = get_bool("PCIE_A2A_PDL")
    return True if value is None else value


def mps_pipe_directory() -> str:
    """CUDA_MPS_PIPE_DIRECTORY (CUDA's own variable): where a running MPS control daemon
    keeps its pipes; default /tmp/nvidia-mps."""
    return _get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"


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


def require_native_tools() -> bool:
    """PCIE_A2A_REQUIRE_NATIVE_TOOLS=1 (CI): the tests that run the CUDA sources without a
    GPU (the CUDA execution model, the SASS checks) fail instead of skipping when a tool
    they need (host compiler, nvcc, cuobjdump) is missing."""
    return is_one("PCIE_A2A_REQUIRE_NATIVE_TOOLS")


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


# ---- the PCIe all-reduce (pcie_a2a.allreduce) -------------------------------------------
def allreduce_enabled() -> bool:
    """PCIE_A2A_ALLREDUCE=1 routes the frameworks' tensor-parallel all-reduce (below the
    crossover) to pcie_a2a.AllReduce; unset or 0 leaves them untouched."""
    return bool(get_bool("PCIE_A2A_ALLREDUCE"))


def allreduce_max_bytes() -> int | None:
    """PCIE_A2A_ALLREDUCE_MAX_BYTES: the handover size (bytes per rank) above which calls go
    to NCCL (gloo on the CPU); replaces the probe's and the defaults' crossover."""
    value = _get("PCIE_A2A_ALLREDUCE_MAX_BYTES")
    if value is None:
        return None
    parsed = get_int("PCIE_A2A_ALLREDUCE_MAX_BYTES", 0, minimum=0)
    if parsed % 16:
        raise ValueError(
            f"PCIE_A2A_ALLREDUCE_MAX_BYTES={value!r}: expected a multiple of 16 bytes (>= 0)"
        )
    return parsed


ALLREDUCE_ALGORITHMS = ("auto", "one_shot", "two_shot", "fallback")


def allreduce_algorithm() -> str:
    """PCIE_A2A_ALLREDUCE_ALGO: auto (by size, default), one_shot, two_shot or fallback
    (always NCCL/gloo)."""
    value = (_get("PCIE_A2A_ALLREDUCE_ALGO") or "auto").lower()
    if value not in ALLREDUCE_ALGORITHMS:
        raise ValueError(
            f"PCIE_A2A_ALLREDUCE_ALGO={value!r}: expected one of {', '.join(ALLREDUCE_ALGORITHMS)}"
        )
    return value


def allreduce_end_barrier() -> bool | None:
    """PCIE_A2A_ALLREDUCE_END_BARRIER=1: end-barrier mode (one buffer, every call ends with
    a barrier) instead of parity double-buffering."""
    return get_bool("PCIE_A2A_ALLREDUCE_END_BARRIER")


def allreduce_table() -> str | None:
    """PCIE_A2A_ALLREDUCE_TABLE: a `pcie-a2a bench --op allreduce` JSON whose measured
    crossover replaces the defaults for a matching world, dtype and backend."""
    return _get("PCIE_A2A_ALLREDUCE_TABLE")


def balance_gpus() -> list[int] | None:
    """PCIE_A2A_BALANCE_GPUS: the topology GPU of each EP rank of a node (``0,1,...``) for
    the balancer inside a serving engine; None: rank r is GPU r."""
    value = _get("PCIE_A2A_BALANCE_GPUS")
    if value is None:
        return None
    try:
        gpus = [int(v) for v in value.split(",")]
    except ValueError:
        gpus = []
    if not gpus or min(gpus) < 0:
        raise ValueError(
            f"PCIE_A2A_BALANCE_GPUS={value!r}: expected comma-separated GPU indices >= 0"
        )
    return gpus
