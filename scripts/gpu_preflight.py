#!/usr/bin/env python3
"""Preflight of scripts/gpu_check.sh (about 15 s, before the build): what the machine is,
and whether the two things the CUDA transport stands on work with torch alone.

Host: kernel, cores, memory, /dev/shm size, ``ulimit -l``, NUMA nodes, MPS (a control or
server process, or its pipe directory). GPU: nvidia-smi's name, driver, compute mode,
compute capability, PCIe link (current/max), BAR1 size; nvcc; torch, its CUDA and the
devices it sees; peer access between GPUs. Build tools: cmake (>= 3.24), ninja (else
make), nvcc, a C++ compiler, pybind11, Python.h. Smokes, in one child process with a
deadline (a crash, a SIGBUS or a hang becomes a line, not a dead check) that imports torch
once: on a freshly booted machine several torch imports at once, plus the IPC smoke's
spawned child, took long enough to fail the smoke falsely. The spawned child gets
IPC_CHILD_S on its own:

* IPC: a second process opens a CUDA tensor of the first through torch's CUDA IPC, reads
  it, writes into it, and the first sees the write (the open/store path of P2P ranks).
* cudaHostRegister: a /dev/shm segment (reserved with posix_fallocate first: a full
  /dev/shm is an error, not a SIGBUS) pinned with cudaHostRegister, written by a GPU
  kernel through its device mapping and by a copy (the host-staged path).

Writes one JSON document (``--json``); prints the facts and a one-line ``summary``.
Exit status: 0 all good, 1 a problem (listed in ``problems``), 3 no usable GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import json
import mmap
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

SMOKE_BYTES = 8 << 20
IPC_CHILD_S = 30.0  # the IPC smoke's spawned child: its own torch import and CUDA context
SHM_MIN_BYTES = 256 << 20  # the staged tests' segments (tens of MiB per rank) must fit
CMAKE_MIN = (3, 24)
SMI_FIELDS = (
    "name,driver_version,compute_mode,compute_cap,memory.total,pcie.link.gen.current,"
    "pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,pci.bus_id"
)


def run(argv: list[str], timeout: float) -> tuple[int, str]:
    """(exit status, stdout+stderr); 127 when the program is missing, 124 on timeout."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]}: no answer within {timeout:.0f}s"
    except OSError as exc:
        return 126, f"{argv[0]}: {exc}"
    return p.returncode, (p.stdout + p.stderr).strip()


# ---- parsers (unit-tested on the CPU) --------------------------------------------------
def parse_smi_csv(text: str) -> list[dict]:
    keys = SMI_FIELDS.split(",")
    gpus = []
    for line in text.strip().splitlines():
        vals = [v.strip() for v in line.split(",")]
        if len(vals) == len(keys):
            gpus.append(dict(zip(keys, vals)))
    return gpus


def parse_bar1_mib(text: str) -> list[int]:
    """BAR1 totals (MiB) per GPU from ``nvidia-smi -q -d MEMORY``."""
    out = []
    for block in re.split(r"BAR1 Memory Usage", text)[1:]:
        m = re.search(r"Total\s*:\s*(\d+)\s*MiB", block)
        if m:
            out.append(int(m.group(1)))
    return out


def cuda_archs(gpus: list[dict]) -> str:
    """CMake CUDA architectures for the GPUs present: compute_cap 9.0 -> 90-real."""
    caps = sorted(
        {
            g.get("compute_cap", "")
            for g in gpus
            if re.fullmatch(r"\d+\.\d+", g.get("compute_cap", ""))
        }
    )
    return ";".join(f"{c.replace('.', '')}-real" for c in caps) or "native"


def version_tuple(text: str) -> tuple[int, ...]:
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(x) for x in m.groups() if x is not None) if m else ()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ---- host facts ------------------------------------------------------------------------
def host_facts() -> dict:
    st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        pass
    return {
        "kernel": platform.release(),
        "cores": os.cpu_count(),
        "mem_total_bytes": mem,
        "dev_shm_bytes": st.f_blocks * st.f_frsize if st else 0,
        "dev_shm_free_bytes": st.f_bavail * st.f_frsize if st else 0,
        "memlock": "unlimited" if soft == resource.RLIM_INFINITY else soft,
        "numa_nodes": len(glob.glob("/sys/devices/system/node/node[0-9]*")) or 1,
        "mps": mps_state(),
    }


def mps_state() -> str:
    procs = []
    for comm in glob.glob("/proc/[0-9]*/comm"):
        try:
            name = Path(comm).read_text().strip()
        except OSError:
            continue
        if name.startswith("nvidia-cuda-mps"):
            procs.append(name)
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    if procs:
        return "running (" + ", ".join(sorted(set(procs))) + ")"
    if os.path.exists(os.path.join(pipe, "control")):
        return f"pipe {pipe}/control exists, no MPS process seen"
    return "not running"


def build_tools(timeout: float) -> dict:
    tools: dict = {"missing": []}
    rc, out = run(["cmake", "--version"], timeout)
    tools["cmake"] = out.splitlines()[0].replace("cmake version ", "") if rc == 0 else None
    if rc != 0:
        tools["missing"].append("cmake")
    elif version_tuple(out) < CMAKE_MIN:
        tools["missing"].append(f"cmake >= {'.'.join(map(str, CMAKE_MIN))} (have {tools['cmake']})")
    rc, out = run(["ninja", "--version"], timeout)
    tools["ninja"] = out if rc == 0 else None
    if rc != 0 and shutil.which("make") is None:
        tools["missing"].append("ninja (or make)")
    nvcc = shutil.which("nvcc") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))), None)
    rc, out = run([nvcc, "--version"], timeout) if nvcc else (127, "")
    tools["nvcc"] = (re.search(r"release [\d.]+", out) or [out[-40:]])[0] if rc == 0 else None
    tools["nvcc_dir"] = os.path.dirname(nvcc) if nvcc and rc == 0 else None
    if rc != 0:
        tools["missing"].append("nvcc")
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    tools["cxx"] = run([cxx, "--version"], timeout)[1].splitlines()[0] if cxx else None
    if not cxx:
        tools["missing"].append("a C++ compiler")
    try:
        import pybind11

        tools["pybind11"] = pybind11.__version__
    except ImportError:
        tools["pybind11"] = None
        tools["missing"].append("pybind11")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    tools["python_h"] = str(header) if header.exists() else None
    if not header.exists():
        tools["missing"].append(f"Python.h (looked in {header.parent})")
    have = [f"{k} {tools[k]}" for k in ("cmake", "ninja", "nvcc", "pybind11") if tools.get(k)]
    tools["summary"] = ", ".join(have) + (", Python.h" if tools["python_h"] else "")
    return tools


def nvidia_smi(timeout: float) -> dict:
    rc, out = run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"], timeout)
    if rc != 0:
        return {"error": out or f"nvidia-smi exit {rc}", "gpus": []}
    gpus = parse_smi_csv(out)
    rc2, mem = run(["nvidia-smi", "-q", "-d", "MEMORY"], timeout)
    bar1 = parse_bar1_mib(mem) if rc2 == 0 else []
    for g, b in zip(gpus, bar1):
        g["bar1_mib"] = b
    _, topo = run(["nvidia-smi", "topo", "-m"], timeout)
    return {"gpus": gpus, "topo": topo}


# ---- smokes (child processes) ----------------------------------------------------------
def probe_torch() -> dict:
    """torch facts and the cudaHostRegister smoke (runs in a child process)."""
    import torch

    info: dict = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    info["cuda_available"] = torch.cuda.is_available()
    if not info["cuda_available"]:
        return info
    n = torch.cuda.device_count()
    info["devices"] = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        info["devices"].append({"name": p.name, "cc": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                                "memory_gib": round(p.total_memory / 2**30, 1)})  # fmt: skip
    info["peer_access"] = {f"{a}->{b}": torch.cuda.can_device_access_peer(a, b)
                           for a in range(n) for b in range(n) if a != b}  # fmt: skip
    info["host_register"] = host_register_smoke(torch)
    return info


def host_register_smoke(torch) -> str:
    path = f"/dev/shm/gpu_preflight_{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, SMOKE_BYTES)
        except OSError as exc:
            return f"FAILED: /dev/shm cannot hold {SMOKE_BYTES >> 20} MiB: {exc}"
        mm = mmap.mmap(fd, SMOKE_BYTES)
        try:
            return _register_and_write(torch, torch.frombuffer(mm, dtype=torch.uint8))
        finally:
            try:
                mm.close()
            except BufferError:  # a view still alive: the mapping goes with the process
                pass
    finally:
        os.close(fd)
        os.unlink(path)


def _register_and_write(torch, host) -> str:
    host.zero_()
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(host.data_ptr(), SMOKE_BYTES, 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        return f"FAILED: cudaHostRegister returned error {code}"
    try:
        pattern = (torch.arange(SMOKE_BYTES, device="cuda") % 251).to(torch.uint8)
        host.copy_(pattern)
        torch.cuda.synchronize()
        if not torch.equal(host, pattern.cpu()):
            return "FAILED: a copy into the registered memory differs"
        mapped = _device_view(torch, host)
        if mapped is None:
            return "ok (copy ok; device access not checked: torch would not wrap the pointer)"
        mapped.add_(1)  # a kernel writes the pinned host pages over the bus
        torch.cuda.synchronize()
        if not torch.equal(host, (pattern + 1).cpu()):
            return "FAILED: a kernel's writes through the device mapping are not seen"
        return "ok (copy ok, kernel writes through the device mapping seen)"
    finally:
        cudart.cudaHostUnregister(host.data_ptr())


def _device_view(torch, host):
    """A CUDA tensor over registered host memory (UVA: the host pointer is valid on the
    device), through __cuda_array_interface__; None when torch refuses it."""

    class View:
        def __init__(self):
            self.__cuda_array_interface__ = {
                "shape": (host.numel(),),
                "typestr": "|u1",
                "data": (host.data_ptr(), False),
                "version": 3,
            }

    try:
        return torch.as_tensor(View(), device="cuda")
    except Exception:
        return None


def _ipc_child(q_in, q_out) -> None:
    import torch

    t = q_in.get()
    s = int(t.sum(dtype=torch.int64))
    t.add_(1)
    torch.cuda.synchronize()
    q_out.put(s)
    q_in.get()  # wait until the parent has checked before dropping the mapping


def probe_ipc(timeout: float) -> str:
    import torch
    import torch.multiprocessing as mp

    if not torch.cuda.is_available():
        return "not run (no GPU)"
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    n = 1 << 20
    t = torch.arange(n, dtype=torch.int32, device="cuda")
    p = ctx.Process(target=_ipc_child, args=(q_in, q_out), daemon=True)
    p.start()
    try:
        q_in.put(t)
        got = q_out.get(timeout=timeout)
        torch.cuda.synchronize()
        if got != n * (n - 1) // 2:
            return f"FAILED: the child read sum {got}, expected {n * (n - 1) // 2}"
        if not torch.equal(t, torch.arange(1, n + 1, dtype=torch.int32, device="cuda")):
            return "FAILED: the child's writes are not visible to the parent"
        return "ok (child read and wrote the parent's tensor)"
    except Exception as exc:
        return f"FAILED: {type(exc).__name__}: {exc or 'no answer'} (child exit {p.exitcode})"
    finally:
        q_in.put(None)
        p.join(5)
        if p.is_alive():
            p.kill()


def child() -> int:
    out = probe_torch()
    out["ipc"] = probe_ipc(IPC_CHILD_S) if out.get("cuda_available") else "not run (no GPU)"
    print("PREFLIGHT_JSON " + json.dumps(out), flush=True)
    return 0


def run_child(timeout: float) -> dict:
    rc, out = run([sys.executable, __file__, "--child-torch"], timeout)
    for line in out.splitlines():
        if line.startswith("PREFLIGHT_JSON "):
            return json.loads(line.removeprefix("PREFLIGHT_JSON "))
    why = {124: "no answer (hang?)", -7: "SIGBUS (is /dev/shm too small?)", -11: "SIGSEGV"}.get(
        rc, f"exit {rc}"
    )
    last = out.strip().splitlines()[-1] if out.strip() else ""
    return {"error": f"{why}: {last}"[:300]}


# ---- main --------------------------------------------------------------------------------
def assess(doc: dict) -> tuple[list[str], str]:
    """(problems, reason there is no usable GPU or "")."""
    problems, tc = [], doc.get("torch_probe", {})
    gpus = doc.get("nvidia_smi", {}).get("gpus", [])
    if not gpus:
        return [], "nvidia-smi sees no GPU: " + doc.get("nvidia_smi", {}).get("error", "")
    if "error" in tc:
        return [f"torch probe: {tc['error']}"], ""
    if not tc.get("cuda_available"):
        return [], f"torch {tc.get('torch')} (CUDA {tc.get('torch_cuda')}) cannot use the GPU"
    for g in gpus:
        if g.get("compute_mode", "Default") != "Default":
            problems.append(f"compute mode {g['compute_mode']}: ranks cannot share the GPU")
    if doc["host"]["mps"].startswith("running"):
        problems.append("MPS is running: ranks share one context scheduler")
    drv = version_tuple(gpus[0].get("driver_version", ""))
    nvcc = version_tuple(doc["build_tools"].get("nvcc") or "")
    if nvcc[:1] == (13,) and drv and drv[0] < 580:
        problems.append(f"driver {gpus[0]['driver_version']} < 580: static cudart 13 will not load")
    for what in ("host_register",):
        if not str(tc.get(what, "")).startswith("ok"):
            problems.append(f"{what}: {tc.get(what, 'not run')}")
    if not str(tc.get("ipc", "")).startswith("ok"):
        problems.append(f"IPC: {tc.get('ipc', 'not run')}")
    if doc["host"]["dev_shm_bytes"] < SHM_MIN_BYTES:
        problems.append(
            f"/dev/shm is {human_bytes(doc['host']['dev_shm_bytes'])}: staged tests need more"
        )
    return problems, ""


def summary(doc: dict) -> str:
    h, gpus = doc["host"], doc["nvidia_smi"].get("gpus", [])
    tc = doc.get("torch_probe", {})
    parts = []
    if gpus:
        g = gpus[0]
        link = f"PCIe gen{g.get('pcie.link.gen.current')}/{g.get('pcie.link.gen.max')} x{g.get('pcie.link.width.current')}/{g.get('pcie.link.width.max')}"
        bar1 = f", BAR1 {g['bar1_mib']} MiB" if "bar1_mib" in g else ""
        parts.append(f"{g['name']} x{len(gpus)} (cc {g.get('compute_cap')}, {g.get('memory.total')}, "
                     f"driver {g.get('driver_version')}, {g.get('compute_mode')}, {link}{bar1})")  # fmt: skip
    else:
        parts.append("no GPU")
    parts.append(f"MPS {h['mps']}")
    parts.append(f"{h['cores']} cores, {h['numa_nodes']} NUMA node(s), /dev/shm {human_bytes(h['dev_shm_bytes'])}, "
                 f"memlock {h['memlock']}, kernel {h['kernel']}")  # fmt: skip
    parts.append(
        f"torch {tc.get('torch', '?')} (CUDA {tc.get('torch_cuda', '?')}), nvcc {doc['build_tools'].get('nvcc')}"
    )
    if tc.get("cuda_available"):
        parts.append(
            f"IPC {str(tc.get('ipc'))[:60]}, hostRegister {str(tc.get('host_register'))[:60]}"
        )
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=55.0,
                   help="seconds for the torch child (its import, the smokes and the IPC "
                   f"smoke's own {IPC_CHILD_S:.0f} s)")  # fmt: skip
    p.add_argument("--child-torch", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_torch:
        return child()
    t = max(3.0, args.timeout - 2)
    doc: dict = {"host": host_facts()}
    with cf.ThreadPoolExecutor(3) as pool:
        smi = pool.submit(nvidia_smi, min(t, 15))
        tools = pool.submit(build_tools, min(t, 15))
        torch_probe = pool.submit(run_child, t)
        doc["nvidia_smi"], doc["build_tools"] = smi.result(), tools.result()
        doc["torch_probe"] = torch_probe.result()
    gpus = doc["nvidia_smi"]["gpus"]
    problems, no_gpu = assess(doc)
    doc.update(
        problems=problems,
        no_gpu_reason=no_gpu,
        gpu_count=0 if no_gpu else len(gpus),
        gpu_name=gpus[0]["name"] if gpus else "",
        driver=gpus[0]["driver_version"] if gpus else "",
        cuda_archs=cuda_archs(gpus),
    )
    doc["summary"] = summary(doc)
    print(json.dumps(doc, indent=1))
    print(f"summary: {doc['summary']}")
    for prob in problems:
        print(f"PROBLEM: {prob}")
    if no_gpu:
        print(f"NO GPU: {no_gpu}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 3 if no_gpu else (1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
