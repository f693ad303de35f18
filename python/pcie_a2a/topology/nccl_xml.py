"""Parser for NCCL topology XML (``NCCL_TOPO_DUMP_FILE`` / ``NCCL_TOPO_FILE``, version 1).

NCCL's tree is ``system > cpu(numaid) > pci > ... > pci > gpu``. NCCL cuts the sysfs path
two components at a time, so its ``pci`` bridges are switch upstream ports and root ports
never appear: a top-level ``pci`` under a ``cpu`` is either a switch or a directly attached
device. We give each top-level ``pci`` its own root port and each ``cpu`` one host bridge,
which reproduces NCCL's own reading (devices under one cpu meet at PHB).

Tolerated variants: RCCL writes ``version="2"`` and ``xgmi`` links (read like ``nvlink``);
VMs write ``link_speed=""`` / ``link_width="0"`` (unknown); the Azure NC A100 v4 file lists
an ``nvlink`` whose target is the GPU itself (ignored, with a note). Unknown elements and
attributes are skipped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from xml.parsers import expat

from .errors import parse_error
from .model import Gpu, Nic, NumaNode, RootPort, Switch, Topology, empty_p2p, gen_from_speed
from .text import body_lines

_VERSIONS = ("1", "2")
_NVSWITCH_CLASS = "0x068000"


@dataclass
class _El:
    tag: str
    attrs: dict[str, str]
    line: int
    children: list[_El] = field(default_factory=list)


def _parse_xml(text: str, source: str) -> _El:
    body = body_lines(text)
    offset = body[0][0] - 1 if body else 0
    xml = "\n".join(line for _, line in body)
    root: list[_El] = []
    stack: list[_El] = []
    p = expat.ParserCreate()

    def start(tag: str, attrs: dict[str, str]) -> None:
        el = _El(tag, attrs, p.CurrentLineNumber + offset)
        (stack[-1].children if stack else root).append(el)
        stack.append(el)

    def end(_tag: str) -> None:
        stack.pop()

    p.StartElementHandler = start
    p.EndElementHandler = end
    try:
        p.Parse(xml, True)
    except expat.ExpatError as exc:
        raise parse_error(
            source,
            exc.lineno + offset,
            f"malformed XML ({expat.errors.messages[exc.code]}); "
            'expected an NCCL topology document <system version="1">',
        ) from None
    if not root or root[0].tag != "system":
        line = root[0].line if root else None
        raise parse_error(source, line, 'expected the root element <system version="1">')
    if root[0].attrs.get("version") not in _VERSIONS:
        raise parse_error(
            source,
            root[0].line,
            f"<system version={root[0].attrs.get('version')!r}>: expected version 1 (NCCL) or "
            "2 (RCCL)",
        )
    return root[0]


def _int(el: _El, name: str, source: str, default: int | None = None) -> int | None:
    v = el.attrs.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v, 0)
    except ValueError:
        raise parse_error(
            source, el.line, f"<{el.tag} {name}={v!r}>: expected an integer"
        ) from None


def _class_of(el: _El) -> str:
    return el.attrs.get("class", "").lower()


def parse_xml(text: str, source: str = "<xml>") -> Topology:
    system = _parse_xml(text, source)
    gpus: list[dict] = []
    switches: list[Switch] = []
    ports: list[RootPort] = []
    numa: list[NumaNode] = []
    nics: list[Nic] = []
    links: list[tuple[str, str, int, str, int]] = []  # (gpu busid, target, count, tclass, line)
    notes: list[str] = []

    def walk(el: _El, parent: str, node: int | None) -> None:
        for child in el.children:
            if child.tag == "nic":
                for net in child.children:
                    if net.tag == "net":
                        nics.append(
                            Nic(index=len(nics), name=net.attrs.get("name"), numa_node=node)
                        )
                continue
            if child.tag != "pci":
                continue
            busid = child.attrs.get("busid", "").lower()
            if not busid:
                raise parse_error(
                    source, child.line, '<pci> without busid: expected busid="dddd:bb:dd.f"'
                )
            gen = gen_from_speed(child.attrs.get("link_speed"))
            width = _int(child, "link_width", source) or None
            here = parent
            if parent.startswith("hb:"):  # top level under a cpu: invent its root port
                here = f"rp:{busid}"
                ports.append(
                    RootPort(
                        id=here, host_bridge=parent, numa_node=node, link_gen=gen, link_width=width
                    )
                )
            gpu_el = next((c for c in child.children if c.tag == "gpu"), None)
            if gpu_el is not None or _class_of(child).startswith("0x03"):
                dev = _int(gpu_el, "dev", source) if gpu_el is not None else None
                gpus.append(
                    {
                        "dev": dev,
                        "bus_id": busid,
                        "numa_node": node,
                        "parent": here,
                        "link_gen": gen,
                        "link_width": width,
                    }
                )
                for link in gpu_el.children if gpu_el is not None else []:
                    if link.tag in ("nvlink", "xgmi"):
                        links.append(
                            (
                                busid,
                                link.attrs.get("target", "").lower(),
                                _int(link, "count", source, 1) or 1,
                                link.attrs.get("tclass", ""),
                                link.line,
                            )
                        )
            elif _class_of(child).startswith("0x0604"):
                switches.append(
                    Switch(
                        id=busid,
                        parent=here,
                        link_gen=gen,
                        link_width=width,
                        vendor=child.attrs.get("vendor"),
                    )
                )
                walk(child, busid, node)
            elif _class_of(child).startswith("0x02") or any(c.tag == "nic" for c in child.children):
                for nic in child.children:
                    for net in nic.children if nic.tag == "nic" else []:
                        if net.tag == "net":
                            nics.append(
                                Nic(
                                    index=len(nics),
                                    name=net.attrs.get("name"),
                                    bus_id=busid,
                                    numa_node=node,
                                )
                            )
            else:
                walk(child, here, node)

    cpus = [c for c in system.children if c.tag == "cpu"]
    for k, cpu in enumerate(cpus):
        numaid = _int(cpu, "numaid", source, -1)
        node = numaid if numaid is not None and numaid >= 0 else None
        if node is not None and all(n.id != node for n in numa):
            numa.append(NumaNode(id=node, socket=node, cpus=cpu.attrs.get("affinity")))
        walk(cpu, f"hb:{k:06d}", node)  # renamed hb0, hb1, ... below

    order = sorted(range(len(gpus)), key=lambda k: (gpus[k]["dev"] is None, gpus[k]["dev"] or 0, k))
    if [gpus[k]["dev"] for k in order] != list(range(len(gpus))):
        notes.append("GPU dev attributes are not 0..n-1: GPUs renumbered in dev/bus order")
    model = [
        Gpu(index=i, **{k: v for k, v in gpus[src].items() if k != "dev"})
        for i, src in enumerate(order)
    ]
    used = {p.host_bridge for p in ports}
    ports = [
        dataclasses.replace(p, host_bridge=f"hb{sorted(used).index(p.host_bridge)}") for p in ports
    ]
    base = Topology(
        gpus=tuple(model),
        classes=tuple(
            tuple("X" if i == j else "SYS" for j in range(len(model))) for i in range(len(model))
        ),
        p2p=empty_p2p(len(model)),
        switches=tuple(switches),
        root_ports=tuple(ports),
        numa_nodes=tuple(sorted(numa, key=lambda n: n.id)),
        nics=tuple(nics),
        source=source,
    )
    n = len(model)
    classes = [[base.tree_class(i, j) for j in range(n)] for i in range(n)]
    by_bus = {g.bus_id: g.index for g in model}
    nvswitch: dict[int, int] = {}
    for bus, target, count, tclass, line in links:
        a = by_bus[bus]
        if target == bus:
            notes.append(f"line {line}: GPU{a} has an nvlink to itself ({target}); ignored")
        elif target in by_bus:
            b = by_bus[target]
            classes[a][b] = classes[b][a] = f"NV{count}"
        elif tclass.lower() == _NVSWITCH_CLASS or target:
            nvswitch[a] = nvswitch.get(a, 0) + count
    for a in nvswitch:
        for b in nvswitch:
            if a != b:
                classes[a][b] = f"NV{min(nvswitch[a], nvswitch[b])}"
    notes.append("sockets are not shown by NCCL XML: each NUMA node is taken as its own socket")
    return dataclasses.replace(base, classes=tuple(tuple(r) for r in classes), notes=tuple(notes))
