"""Live discovery: sysfs, then NVML (dlopen, optional), then CUDA peer queries (optional).

Nothing is required: a machine without NVIDIA GPUs, without NVML or without CUDA gives a
smaller answer, never an error. The sysfs root is an argument so tests can build a fake
tree in a temporary directory.

What is read (the same files NCCL reads; research/topology_numa.md 1.2 and 4.3):
``bus/pci/devices/<bdf>`` resolved to its ``devices/pciDDDD:BB/<root port>/.../<bdf>``
chain; per device ``class``, ``vendor``, ``device``, ``numa_node``, ``max_link_*`` and
``current_link_*``; per node ``devices/system/node/node<N>/{cpulist,distance}``; the socket
of a node from ``devices/system/cpu/cpu<K>/topology/physical_package_id``.

Below the root port the bridges of a chain come in pairs, a switch's upstream port then one
of its downstream ports; unprivileged sysfs cannot tell them apart (the PCIe capability is
past the 64 config bytes a user may read), so the pairing is positional.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
from pathlib import Path

from .model import (
    Gpu,
    Nic,
    NumaNode,
    P2PStatus,
    RootPort,
    Switch,
    Topology,
    empty_p2p,
    gen_from_speed,
)

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_NVIDIA = "0x10de"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(path: Path) -> int | None:
    v = _read(path)
    try:
        return int(v, 0) if v is not None else None
    except ValueError:
        return None


def _min(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _cpus(cpulist: str | None) -> list[int]:
    out: list[int] = []
    for part in (cpulist or "").split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        elif part.strip():
            out.append(int(part))
    return out


def numa_nodes(sysfs_root: str | os.PathLike = "/sys") -> tuple[NumaNode, ...]:
    base = Path(sysfs_root) / "devices/system/node"
    ids = (
        sorted(int(p.name[4:]) for p in base.glob("node*") if p.name[4:].isdigit())
        if base.is_dir()
        else []
    )
    nodes = []
    for node in ids:
        cpulist = _read(base / f"node{node}/cpulist")
        dist = _read(base / f"node{node}/distance")
        cpus = _cpus(cpulist)
        pkg = (
            _int(Path(sysfs_root) / f"devices/system/cpu/cpu{cpus[0]}/topology/physical_package_id")
            if cpus
            else None
        )
        nodes.append(
            NumaNode(
                id=node,
                socket=pkg if pkg is not None else node,
                cpus=cpulist or None,
                distances=tuple(int(x) for x in dist.split()) if dist else None,
            )
        )
    return tuple(nodes)


def _link(dev: Path, parent: Path | None, kind: str) -> tuple[int | None, int | None]:
    """(generation, width) of a device's upstream link: the lower end of device and parent
    port, as NCCL does. `kind` is "max" (what it trains to) or "current" (idle GPUs sit at
    Gen1 and retrain under load, so the planner uses "max")."""
    gen = gen_from_speed(_read(dev / f"{kind}_link_speed"))
    width = _int(dev / f"{kind}_link_width")
    if parent is not None:
        gen = _min(gen, gen_from_speed(_read(parent / f"{kind}_link_speed")))
        width = _min(width, _int(parent / f"{kind}_link_width"))
    return gen, (width or None)


def discover(
    sysfs_root: str | os.PathLike = "/sys", use_nvml: bool = True, use_cuda: bool = True
) -> Topology:
    """The topology of this machine (or of a sysfs tree at `sysfs_root`)."""
    root = Path(sysfs_root)
    devdir = root / "bus/pci/devices"
    entries = sorted(p.name for p in devdir.iterdir()) if devdir.is_dir() else []
    nodes = numa_nodes(root)
    notes: list[str] = []
    gpus: list[Gpu] = []
    ports: dict[str, RootPort] = {}
    switches: dict[str, Switch] = {}
    nics: list[Nic] = []
    for bdf in entries:
        dev = devdir / bdf
        cls = (_read(dev / "class") or "").lower()
        if cls.startswith("0x02"):
            names = (
                [p.name for sub in ("net", "infiniband") for p in (dev / sub).glob("*")]
                if dev.exists()
                else []
            )
            node = _int(dev / "numa_node")
            nics.append(
                Nic(
                    index=len(nics),
                    name=names[0] if names else None,
                    bus_id=bdf,
                    numa_node=node if node is not None and node >= 0 else None,
                )
            )
            continue
        if (
            not (cls.startswith("0x0300") or cls.startswith("0x0302"))
            or _read(dev / "vendor") != _NVIDIA
        ):
            continue
        real = dev.resolve()
        parts = real.parts
        try:
            start = next(k for k, p in enumerate(parts) if p.startswith("pci") and p != "pci")
        except StopIteration:
            notes.append(f"{bdf}: {real} is not under devices/pciDDDD:BB; skipped")
            continue
        hb = parts[start]
        chain = [p for p in parts[start + 1 : -1] if _BDF.match(p)]
        paths = [Path(*parts[: start + 2 + k]) for k in range(len(chain))]
        if chain:
            rp_id = chain[0]
            gen, width = _link(paths[0], None, "max")
            rp_node = _int(paths[0] / "numa_node")
        else:
            rp_id, gen, width, rp_node = hb, None, None, None
        if rp_id not in ports:
            ports[rp_id] = RootPort(
                id=rp_id,
                host_bridge=hb,
                numa_node=rp_node if rp_node is not None and rp_node >= 0 else None,
                link_gen=gen,
                link_width=width,
                vendor=_read(paths[0] / "vendor") if chain else None,
            )
        parent = rp_id
        below = list(range(1, len(chain)))
        for k in below[::2]:  # switch upstream ports; the next bridge is its downstream port
            sw = chain[k]
            if sw not in switches:
                g2, w2 = _link(paths[k], paths[k - 1], "max")
                switches[sw] = Switch(
                    id=sw,
                    parent=parent,
                    link_gen=g2,
                    link_width=w2,
                    vendor=_read(paths[k] / "vendor"),
                )
            parent = sw
        up = paths[-1] if paths else None
        node = _int(dev / "numa_node")
        if node is None or node < 0:
            ups = [_int(p / "numa_node") for p in reversed(paths)]
            node = next((x for x in ups if x is not None and x >= 0), None)
            notes.append(
                f"{bdf}: numa_node is -1"
                + (f"; took node {node} from its bridges" if node is not None else "; unknown")
            )
        if node is None and len(nodes) == 1:
            node = nodes[0].id
        gen, width = _link(dev, up, "max")
        cgen, cwidth = _link(dev, up, "current")
        gpus.append(
            Gpu(
                index=len(gpus),
                bus_id=bdf,
                name=f"NVIDIA device {_read(dev / 'device')}",
                numa_node=node,
                parent=parent,
                link_gen=gen,
                link_width=width,
                current_link_gen=cgen,
                current_link_width=cwidth,
            )
        )
    n = len(gpus)
    topo = Topology(
        gpus=tuple(gpus),
        classes=tuple(tuple("X" if i == j else "SYS" for j in range(n)) for i in range(n)),
        p2p=empty_p2p(n),
        switches=tuple(switches.values()),
        root_ports=tuple(ports.values()),
        numa_nodes=nodes,
        nics=tuple(nics),
        source=f"live sysfs ({root})",
    )
    classes = tuple(tuple(topo.tree_class(i, j) for j in range(n)) for i in range(n))
    p2p = [list(r) for r in empty_p2p(n)]
    names = [g.name for g in gpus]
    if n and use_nvml:
        info = nvml_info([g.bus_id or "" for g in gpus])
        if info is not None:
            names = [nm or old for nm, old in zip(info[0], names, strict=True)]
            p2p = info[1]
            notes.append("P2P status from NVML (read and write)")
    if n and use_cuda and all(s == P2PStatus.UNKNOWN for r in p2p for s in r):
        peers = cuda_peer_matrix()
        order = cuda_bus_ids()
        if peers is not None and order is not None:
            pos = {b: k for k, b in enumerate(order)}
            for i in range(n):
                for j in range(n):
                    a, b = pos.get(gpus[i].bus_id or ""), pos.get(gpus[j].bus_id or "")
                    if i != j and a is not None and b is not None:
                        p2p[i][j] = P2PStatus.SUPPORTED if peers[a][b] else P2PStatus.UNSUPPORTED
            notes.append("P2P status from cudaDeviceCanAccessPeer")
    return Topology(
        gpus=tuple(dataclasses.replace(g, name=nm) for g, nm in zip(gpus, names, strict=True)),
        classes=classes,
        p2p=tuple(tuple(r) for r in p2p),
        switches=topo.switches,
        root_ports=topo.root_ports,
        numa_nodes=nodes,
        nics=topo.nics,
        source=topo.source,
        notes=tuple(notes),
    )


# ---- optional runtime sources -----------------------------------------------------------


def cuda_peer_matrix() -> list[list[bool]] | None:
    """cudaDeviceCanAccessPeer for every pair of CUDA devices (CUDA's order), through torch;
    None when torch or CUDA is unavailable."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    n = torch.cuda.device_count()
    return [
        [i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
        for i in range(n)
    ]


def cuda_bus_ids() -> list[str] | None:
    """PCI bus id of each CUDA device in CUDA's order (CUDA_VISIBLE_DEVICES and
    CUDA_DEVICE_ORDER change it, so pairs are matched by bus id, never by index)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    out = [cuda_bus_id(i) for i in range(torch.cuda.device_count())]
    return None if None in out else out


def cuda_bus_id(index: int) -> str | None:
    """PCI bus id ("0000:41:00.0") of CUDA device `index`, or None if torch lacks it."""
    import torch

    p = torch.cuda.get_device_properties(index)
    bus, dev, dom = (getattr(p, k, None) for k in ("pci_bus_id", "pci_device_id", "pci_domain_id"))
    if bus is None or dev is None:
        return None
    return f"{dom or 0:04x}:{bus:02x}:{dev:02x}.0"


_NVML_P2P_READ, _NVML_P2P_WRITE = 0, 1
# nvmlGpuP2PStatus_t: OK, CHIPSET_NOT_SUPPORTED, GPU_NOT_SUPPORTED, IOH_TOPOLOGY_NOT_SUPPORTED,
# DISABLED_BY_REGKEY, NOT_SUPPORTED, UNKNOWN (same mapping as nvidia_smi.P2P_LETTERS).
_NVML_STATUS = [
    P2PStatus.SUPPORTED,
    P2PStatus.UNSUPPORTED,
    P2PStatus.DISABLED,
    P2PStatus.UNSUPPORTED,
    P2PStatus.DISABLED,
    P2PStatus.UNSUPPORTED,
    P2PStatus.UNKNOWN,
]


def nvml_info(bus_ids: list[str]) -> tuple[list[str | None], list[list[P2PStatus]]] | None:
    """(names, P2P status matrix) from NVML, or None when libnvidia-ml cannot be loaded or
    initialised. The worse of READ and WRITE wins, as in NCCL."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    try:
        if lib.nvmlInit_v2() != 0:
            return None
    except AttributeError:
        return None
    try:
        handles = []
        for b in bus_ids:
            h = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByPciBusId_v2(b.encode(), ctypes.byref(h)) != 0:
                return None
            handles.append(h)
        names: list[str | None] = []
        for h in handles:
            buf = ctypes.create_string_buffer(96)
            names.append(buf.value.decode() if lib.nvmlDeviceGetName(h, buf, 96) == 0 else None)
        n = len(handles)
        rank = [P2PStatus.SUPPORTED, P2PStatus.UNKNOWN, P2PStatus.UNSUPPORTED, P2PStatus.DISABLED]
        mat = [[P2PStatus.UNKNOWN] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                worst = P2PStatus.SUPPORTED
                for idx in (_NVML_P2P_READ, _NVML_P2P_WRITE):
                    st = ctypes.c_int(6)
                    rc = lib.nvmlDeviceGetP2PStatus(handles[i], handles[j], idx, ctypes.byref(st))
                    s = (
                        _NVML_STATUS[st.value]
                        if rc == 0 and 0 <= st.value < 7
                        else P2PStatus.UNKNOWN
                    )
                    worst = max(worst, s, key=rank.index)
                mat[i][j] = worst
        return names, mat
    finally:
        with contextlib.suppress(Exception):
            lib.nvmlShutdown()


def nvml_identity(bus_ids: list[str]) -> tuple[list[str | None], str | None] | None:
    """(UUID of each GPU, driver version) from NVML, or None when NVML is unavailable."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    try:
        if lib.nvmlInit_v2() != 0:
            return None
    except AttributeError:
        return None
    try:
        buf = ctypes.create_string_buffer(96)
        driver = buf.value.decode() if lib.nvmlSystemGetDriverVersion(buf, 96) == 0 else None
        uuids: list[str | None] = []
        for b in bus_ids:
            h = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByPciBusId_v2(b.encode(), ctypes.byref(h)) != 0:
                uuids.append(None)
                continue
            u = ctypes.create_string_buffer(96)
            uuids.append(u.value.decode() if lib.nvmlDeviceGetUUID(h, u, 96) == 0 else None)
        return uuids, driver
    finally:
        with contextlib.suppress(Exception):
            lib.nvmlShutdown()


def driver_version(proc_root: str | os.PathLike = "/proc") -> str | None:
    """The NVIDIA kernel module's version from ``driver/nvidia/version`` ("NVRM version:
    NVIDIA UNIX x86_64 Kernel Module  580.65.06  ..."), None without the driver."""
    text = _read(Path(proc_root) / "driver/nvidia/version")
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text or "")
    return m.group(1) if m else None
