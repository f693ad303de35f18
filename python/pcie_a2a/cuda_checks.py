"""What the CUDA transport checks about the machine before it moves a byte, as plain
functions of the facts (so every message is tested on the CPU): the driver floor of this
build, compute modes and MPS, and the bootstrap probe that every pair of ranks can really
write into its peer ("P2P supported" is not "P2P works").

Every check runs on data every rank has gathered, so every rank reaches the same verdict
and raises the same error: no rank is left waiting in a collective for the timeout.
"""

from __future__ import annotations

import os

from pcie_a2a import env

# cudaComputeMode
COMPUTE_DEFAULT, COMPUTE_PROHIBITED, COMPUTE_EXCLUSIVE_PROCESS = 0, 2, 3

# The oldest driver (R-branch) each CUDA major version of a statically linked runtime needs,
# and the floor of the GPUs this project targets (Blackwell: RTX PRO 6000, RTX 5090).
# https://docs.nvidia.com/deploy/cuda-compatibility/ (minor version compatibility: a CUDA
# 12.x runtime runs on any R525+ driver; CUDA 13 needs R580).
DRIVER_FLOOR = {12: 525, 13: 580}
BLACKWELL_DRIVER_FLOOR = 570


def _version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def driver_floor_problem(driver_version: int, runtime_version: int) -> str:
    """Why this build cannot run on this driver ("" when it can). Versions are CUDA's
    encoding (1000 * major + 10 * minor), as cudaDriverGetVersion and CUDART_VERSION give
    them; driver_version 0 means no driver was found."""
    rt_major = runtime_version // 1000
    floor = DRIVER_FLOOR.get(rt_major, 0)
    if driver_version == 0:
        return (
            "no NVIDIA driver was found (cudaDriverGetVersion returned 0); this build's static "
            f"CUDA {_version(runtime_version)} runtime needs driver R{floor} or newer"
        )
    if driver_version // 1000 >= rt_major:
        return ""
    return (
        f"the NVIDIA driver supports CUDA {_version(driver_version)} but this build links the "
        f"CUDA {_version(runtime_version)} runtime statically, which needs driver R{floor} or "
        f"newer; update the driver, or use a build made with CUDA 12.8/12.9 "
        f"(PCIE_A2A_CUDA_TOOLKIT=/usr/local/cuda-12.8 at build time), which runs on drivers "
        f"R{DRIVER_FLOOR[12]} and newer (R{BLACKWELL_DRIVER_FLOOR}+ on RTX 50-series / RTX PRO "
        "6000)"
    )


def explain_cuda_error(text: str) -> str:
    """A CUDA error message with what a user can do about it (unchanged when unknown)."""
    if "cudaErrorDevicesUnavailable" in text:
        return (
            f"{text} (the GPU is in EXCLUSIVE_PROCESS or PROHIBITED compute mode and another "
            "process already holds it; ranks sharing one GPU need the DEFAULT compute mode "
            "(nvidia-smi -i N -c DEFAULT) or the MPS control daemon)"
        )
    if "cudaErrorInsufficientDriver" in text:
        return (
            f"{text} (the NVIDIA driver is older than this build's static CUDA runtime needs; "
            "pcie_a2a.cuda_unavailable_reason() says which driver it needs)"
        )
    return text


def mps_running(pipe_dir: str | None = None) -> str | None:
    """The MPS control daemon's pipe directory when one is running, else None."""
    d = pipe_dir or env.mps_pipe_directory()
    return d if os.path.exists(os.path.join(d, "control")) else None


def environment_problems(
    uuids: list[str], reports: list[dict], mps_dir: str | None
) -> tuple[list[str], list[str]]:
    """(errors, warnings) about compute modes and MPS. uuids[r], reports[r]: rank r's
    device and its ``device_report`` (compute_mode, host_register, ...)."""
    errors, warnings = [], []
    on_device: dict[str, list[int]] = {}
    for r, u in enumerate(uuids):
        on_device.setdefault(u, []).append(r)
    for u, ranks in on_device.items():
        mode = reports[ranks[0]]["compute_mode"]
        if mode == COMPUTE_PROHIBITED:
            errors.append(
                f"GPU {u} (ranks {ranks}) is in PROHIBITED compute mode: no process may use it "
                "(nvidia-smi -i N -c DEFAULT)"
            )
        elif mode == COMPUTE_EXCLUSIVE_PROCESS and len(ranks) > 1 and mps_dir is None:
            errors.append(
                f"ranks {ranks} share GPU {u}, which is in EXCLUSIVE_PROCESS compute mode: "
                "only one process may use it. Set the DEFAULT compute mode "
                "(nvidia-smi -i N -c DEFAULT), run one rank per GPU, or start the MPS control "
                "daemon (nvidia-cuda-mps-control -d)"
            )
    if mps_dir is not None:
        warnings.append(
            f"MPS is running (pipe directory {mps_dir}): ranks on one GPU are MPS clients and "
            "their kernels share its SMs concurrently. A CUDA_MPS_ACTIVE_THREAD_PERCENTAGE "
            "below 100 caps the SMs each rank gets (the receive kernels spin while they wait); "
            "if opening a peer's memory through CUDA IPC fails under MPS, PCIE_A2A_P2P=0 "
            "stages the pairs through host memory"
        )
    return errors, warnings


PROBE_CAUSES = (
    "'P2P supported' is not 'P2P works': likely causes are the IOMMU not in pass-through "
    "mode (boot with iommu=pt or amd_iommu=pt), ACS redirecting peer traffic to the root "
    "complex (ACS enabled on the PCIe switches or root ports), or a BAR1 too small for the "
    "mappings (256 MB on cards without resizable BAR; nvidia-smi -q -d MEMORY shows BAR1). "
    "PCIE_A2A_P2P=0 stages every pair through host memory instead"
)


def probe_failures(
    statuses: list[list[int]],
    plan: list[list[int]],
    bus_ids: list[str | None],
    timeout_s: float,
    staged: int = 1,
) -> str:
    """The error message of a failed bootstrap probe ("" when every pair worked).
    statuses[r][s]: what receiver r saw of source s (0 ok, 1 nothing within timeout_s, 2
    wrong bytes); plan[s][d]: how s reaches d (``staged`` for host staging)."""
    bad = []
    for r, row in enumerate(statuses):
        for s, st in enumerate(row):
            if s == r or st == 0:
                continue
            how = "staged through host memory" if plan[s][r] == staged else "P2P over CUDA IPC"
            what = (
                f"nothing arrived within {timeout_s:g} s"
                if st == 1
                else "the bytes that arrived were wrong"
            )
            where = f"GPU {bus_ids[s] or '?'} -> GPU {bus_ids[r] or '?'}"
            bad.append(f"rank {s} -> rank {r} ({how}, {where}): {what}")
    if not bad:
        return ""
    return (
        "CUDA transport bootstrap: the probe written through the protocol's own stores "
        "(16-byte pattern, system-scope fence, release store) did not arrive: "
        + "; ".join(bad)
        + ". "
        + PROBE_CAUSES
    )
