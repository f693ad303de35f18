"""The Python-level emulation of the CUDA backend: ``pcie_a2a._cuda_transport`` built from
the real binding (csrc/bindings/cuda_transport.cu), the real host code and the real kernels,
compiled with the host compiler against the CUDA execution model (tests/native/emu), so
that ``pcie_a2a.transport.cuda`` and ``Buffer(backend="cuda")`` run unchanged on CPU tensors.

What it is for: the Python host code's cost, counted (host synchronisations and kernel
launches of ``Buffer.low_latency_dispatch``/``low_latency_combine``, including the torch
ops a GPU would launch), capture of those calls in a graph and replay with new inputs, and
the in-process harness (``CudaTransport.in_process``). The device memory the kernels touch
is plain host memory here (one process; the segments come from the emulated runtime's arena
and the tensors are torch CPU tensors), streams and graphs are the emulated runtime's.

``install()`` must run in a fresh process (tests spawn one per case): it puts the module in
``sys.modules`` and points the few torch.cuda touch points of transport.cuda/buffer at the CPU.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from native_emulation import MODEL_FLAGS, TRANSPORT_PTX_HOOKS, compiler

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
EMU = ROOT / "tests" / "native" / "transport_emu"
KERNELS = ("kernels_send.cu", "kernels_recv.cu", "kernels_combine.cu", "kernels_control.cu")


def _units() -> list[tuple[Path, list[str]]]:
    t = CSRC / "cuda" / "transport"
    return [
        *((t / k, ["-x", "c++", "-fdata-sections"]) for k in KERNELS),
        (t / "cuda_transport.cu", ["-x", "c++"]),
        (CSRC / "core" / "dispatch_layout.cpp", []),
        (CSRC / "core" / "numa_memory.cpp", []),
        (CSRC / "bindings" / "cuda_transport.cu", ["-x", "c++"]),
        (EMU / "py_hooks.cpp", []),
    ]


def build(out: Path) -> Path:
    """Compiles the module into ``out`` (-O1, no sanitizer: it is loaded into Python)."""
    import pybind11

    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no host C++ compiler")
    out.mkdir(parents=True, exist_ok=True)
    flags = ["-std=c++17", "-fPIC", "-O1", "-fno-strict-aliasing", "-ffp-contract=off"]
    flags += ["-Wno-unknown-pragmas", "-iquote", str(EMU / "override"), "-I", str(EMU / "include")]
    flags += [*MODEL_FLAGS, TRANSPORT_PTX_HOOKS]
    flags += ["-I", str(CSRC), "-I", pybind11.get_include()]
    flags += ["-I", sysconfig.get_paths()["include"], "-fvisibility=default"]

    def compile_one(unit):
        src, extra = unit
        obj = out / (src.parent.name + "_" + src.name.split(".")[0] + ".o")
        if "kernels_" in src.name:  # emu_shared.ld collects the kernels_*.o statics
            obj = out / (src.name.split(".")[0] + ".o")
        r = subprocess.run([cxx, *flags, *extra, "-c", str(src), "-o", str(obj)],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"emulated module build failed ({src.name}):\n{r.stderr[-4000:]}")
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objs = list(pool.map(compile_one, _units()))
    so = out / ("_cuda_transport" + sysconfig.get_config_var("EXT_SUFFIX"))
    link = [cxx, "-shared", *map(str, objs), "-o", str(so), "-lrt", "-lpthread"]
    r = subprocess.run([*link, f"-Wl,-T,{EMU / 'emu_shared.ld'}"], capture_output=True, text=True)
    if r.returncode != 0:  # a linker without INSERT scripts: shared memory starts zeroed
        r = subprocess.run(link, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"emulated module link failed:\n{r.stderr[-4000:]}")
    return so


class Hooks:
    """The emulated runtime's counters, streams and graphs (py_hooks.cpp)."""

    def __init__(self, so: Path):
        lib = ctypes.CDLL(str(so))
        lib.emu_stream_create.restype = ctypes.c_void_p
        lib.emu_leak_report.restype = ctypes.c_char_p
        for name in ("emu_stream_destroy", "emu_begin_capture", "emu_graph_destroy"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
        lib.emu_end_capture.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        lib.emu_graph_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib = lib

    def counts(self) -> tuple[int, int, int]:
        """(launches, host syncs, launches with PDL) so far."""
        a = (ctypes.c_ulonglong * 3)()
        self.lib.emu_counts(a)
        return a[0], a[1], a[2]

    def stream(self) -> int:
        return self.lib.emu_stream_create()

    def destroy_stream(self, s: int) -> None:
        assert self.lib.emu_stream_destroy(s) == 0

    def begin_capture(self, s: int) -> None:
        assert self.lib.emu_begin_capture(s) == 0

    def end_capture(self, s: int) -> int:
        g = ctypes.c_void_p()
        assert self.lib.emu_end_capture(s, ctypes.byref(g)) == 0
        return g.value

    def launch(self, graph: int, s: int) -> None:
        assert self.lib.emu_graph_launch(graph, s) == 0

    def destroy_graph(self, graph: int) -> None:
        assert self.lib.emu_graph_destroy(graph) == 0

    def leak_report(self) -> str:
        return self.lib.emu_leak_report().decode()


def install(so: Path) -> Hooks:
    """Makes this process's pcie_a2a use the emulated module on CPU tensors. Returns the
    hooks; ``transport.cuda.CudaTransport._stream`` returns ``EMU_STREAM.current`` (set it per
    rank for the in-process harness)."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("pcie_a2a._cuda_transport", so)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pcie_a2a._cuda_transport"] = mod
    spec.loader.exec_module(mod)
    hooks = Hooks(so)

    from pcie_a2a import _native
    from pcie_a2a.transport import cuda as cuda_backend

    cpu = torch.device("cpu")
    _native.cuda_available = lambda: True
    cuda_backend._device = lambda index: cpu
    cuda_backend.device_uuid = lambda index: "GPU-emulated-0"
    cuda_backend.cuda_bus_id = lambda index: None
    EMU_STREAM.current = hooks.stream()
    cuda_backend.CudaTransport._stream = lambda self: getattr(
        self, "emu_stream", EMU_STREAM.current
    )
    cuda_backend.CudaTransport._sync_stream = lambda self: None  # the model runs work at once
    return hooks


def leaks(hooks: Hooks) -> str:
    """What the process still holds in the emulated runtime once install()'s stream is gone
    ("" when nothing)."""
    if EMU_STREAM.current:
        hooks.destroy_stream(EMU_STREAM.current)
        EMU_STREAM.current = 0
    return hooks.leak_report()


class _Stream:
    current: int = 0


EMU_STREAM = _Stream()
