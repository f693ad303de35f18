"""Reading a topology from a file (any supported format) or from the live machine."""

from __future__ import annotations

import os
import re

from .. import env
from . import probe_cache
from .errors import TopologyError
from .live import discover
from .model import Topology
from .nccl_log import topology_from_nccl_paths, topology_from_nccl_tests
from .nccl_xml import parse_xml
from .nvidia_smi import parse_topo
from .p2p_bandwidth import p2p_test_topology, parse_p2p_test
from .probe import Probe
from .text import body_lines

# Markers that only these tools print; none of them occurs in `nvidia-smi topo -m` text, so
# testing them before the "GPU0" test keeps topo -m files on the parser they always had.
_P2P_TEST = re.compile(
    r"P2P=(?:Enabled|Disabled)|P2P Connectivity Matrix|Peer-to-Peer\) GPU Bandwidth Latency Test"
    r"|^\s*D\\D\s+\d|CAN(?:NOT)? Access Peer"
)
_NCCL_INFO = re.compile(r"\bNCCL INFO\b")
_NCCL_TESTS = re.compile(r"^#\s*Rank\s+\d+\s+.*\bdevice\s+\d+\s+\[|^#\s+size\s+count\s+type")


def load_probe(path: str) -> Probe:
    """A probe from a file: our JSON (version 1 or 2) or p2pBandwidthLatencyTest output."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("{"):
        return Probe.from_json(text, path)
    return parse_p2p_test(text, path)


def _format(text: str) -> str:
    first = next((line.strip() for _, line in body_lines(text) if line.strip()), "")
    if first.startswith("{"):
        return "json"
    if first.startswith("<"):
        return "xml"
    lines = [line for _, line in body_lines(text)]
    # p2pBandwidthLatencyTest first: author pages append nccl-tests runs to its tables.
    if any(_P2P_TEST.search(line) for line in lines):
        return "p2p-test"
    if any(_NCCL_INFO.search(line) for line in lines):
        return "nccl-log"
    if any(_NCCL_TESTS.search(line.strip()) for line in lines):
        return "nccl-tests"
    if "GPU0" in text:
        return "topo"
    return ""


def parse_with_probe(text: str, source: str = "<text>") -> tuple[Topology, Probe | None]:
    """A Topology from text in any supported format, told apart by its content, and the
    measurements the text carries (p2pBandwidthLatencyTest output), else None:

    * ``{`` first: our JSON; ``<`` first: NCCL topology XML;
    * p2pBandwidthLatencyTest output (P2P=Enabled/Disabled headings, ``D\\D`` headers);
    * NCCL_DEBUG=INFO lines (``NCCL INFO``);
    * nccl-tests output (its ``# Using devices`` list or result header);
    * otherwise ``nvidia-smi topo -m`` text (a header naming GPU0..)."""
    kind = _format(text)
    if kind == "json":
        return Topology.from_json(text, source), None
    if kind == "xml":
        return parse_xml(text, source), None
    if kind == "p2p-test":
        return p2p_test_topology(text, source)
    if kind == "nccl-log":
        return topology_from_nccl_paths(text, source), None
    if kind == "nccl-tests":
        return topology_from_nccl_tests(text, source), None
    if kind == "topo":
        return parse_topo(text, source), None
    raise TopologyError(
        f"{source}: not a topology file: expected `nvidia-smi topo -m` text (a header line "
        'naming GPU0..), NCCL topology XML (<system version="1">), pcie_a2a JSON, '
        "p2pBandwidthLatencyTest output, NCCL_DEBUG=INFO lines or nccl-tests output"
    )


def parse(text: str, source: str = "<text>") -> Topology:
    """A Topology from text in any supported format (see :func:`parse_with_probe`)."""
    return parse_with_probe(text, source)[0]


def load_with_probe(path: str | os.PathLike) -> tuple[Topology, Probe | None]:
    with open(path, encoding="utf-8") as f:
        return parse_with_probe(f.read(), os.fspath(path))


def load(path: str | os.PathLike) -> Topology:
    return load_with_probe(path)[0]


def current_with_probe(sysfs_root: str = "/sys") -> tuple[Topology, Probe | None]:
    """The topology to plan with and the measurements to plan with:

    * topology: PCIE_A2A_TOPO_FILE when set, else live discovery;
    * probe: PCIE_A2A_PROBE_FILE when set (a recorded ``pcie-a2a probe`` JSON or
      p2pBandwidthLatencyTest output); else the topology file's own measurements; else,
      on the live machine, the probe cached for its fingerprint (:mod:`.probe_cache`;
      PCIE_A2A_PROBE_CACHE=0 skips it); else None (the plan's per-class defaults).

    The CUDA transport's ``topology_rank_transfers`` calls this, so a ``Buffer`` plans with the
    machine's probe once ``pcie-a2a probe`` has run on it."""
    path = env.topo_file()
    topo, probe = load_with_probe(path) if path else (discover(sysfs_root), None)
    recorded = env.probe_file()
    if recorded:
        return topo, load_probe(recorded)
    if probe is None and not path and env.probe_cache():
        probe = cached_probe(topo)
    return topo, probe


def cached_probe(topo: Topology) -> Probe | None:
    """The probe cached for this machine's fingerprint, if any (needs NVML to name the
    GPUs by UUID)."""
    bus_ids = [g.bus_id for g in topo.gpus]
    if not bus_ids or None in bus_ids:
        return None
    ident = probe_cache.machine_identity([b for b in bus_ids if b])
    if ident is None:
        return None
    return probe_cache.lookup(probe_cache.fingerprint(*ident))


def current(sysfs_root: str = "/sys") -> Topology:
    """PCIE_A2A_TOPO_FILE when set, else live discovery."""
    return current_with_probe(sysfs_root)[0]
