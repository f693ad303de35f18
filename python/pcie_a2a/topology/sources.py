"""Reading a topology from a file (any supported format) or from the live machine."""

from __future__ import annotations

import os

from .. import env
from .errors import TopologyError
from .live import discover
from .model import Topology
from .nccl_xml import parse_xml
from .nvidia_smi import parse_topo
from .text import body_lines


def parse(text: str, source: str = "<text>") -> Topology:
    """A Topology from text in any supported format, told apart by its first body line:
    ``{`` our JSON, ``<`` NCCL topology XML, otherwise ``nvidia-smi topo -m`` text."""
    first = next((line.strip() for _, line in body_lines(text) if line.strip()), "")
    if first.startswith("{"):
        return Topology.from_json(text, source)
    if first.startswith("<"):
        return parse_xml(text, source)
    if "GPU0" in text:
        return parse_topo(text, source)
    raise TopologyError(
        f"{source}: not a topology file: expected `nvidia-smi topo -m` text (a header line "
        'naming GPU0..), NCCL topology XML (<system version="1">) or pcie_a2a JSON'
    )


def load(path: str | os.PathLike) -> Topology:
    with open(path, encoding="utf-8") as f:
        return parse(f.read(), os.fspath(path))


def current(sysfs_root: str = "/sys") -> Topology:
    """PCIE_A2A_TOPO_FILE when set, else live discovery."""
    path = env.topo_file()
    return load(path) if path else discover(sysfs_root)
