"""Which GPUs share a switch uplink and which CPU root complex each GPU hangs off: the facts
the posted-write collapse depends on (research/field_2026.md section 4).

The trigger, as measured on the ASUS ESC8000A-E13P (Broadcom PEX890xx, 2x EPYC 9575F): two
or more GPUs behind the same switch *writing* at the same time to GPUs behind two or more
different root complexes; two flows fell from 36.8 to 2.7 GB/s while reads on the same
pattern ran at 51.1. The c-payne Microchip PM50100 box (Threadripper PRO 7955WX, 16 GPUs
in 4 switches) collapsed the same way; the same silicon with 2 GPUs per virtual switch and
only two root ports (our 3-switch Threadripper fixture) did not: from each switch there is
only one other root complex to write to, so the trigger cannot occur. A root switch above
both root complexes avoids it, and so does NCCL's ring order (one destination root complex
per switch at a time).

Here a flow a -> b *leaves its switch* when a and b hang off different root ports: its
source switch is the topmost switch above a (the one whose uplink goes into the root
port), and its destination root complex is b's host bridge. Flows between GPUs under one
switch hierarchy turn around inside it and never reach a root complex.
"""

from __future__ import annotations

from .model import Topology

# PCI vendor ids (sysfs ``vendor``) of the switch families in the collapse reports, and of
# the hosts they were on.
BROADCOM_IDS = ("0x1000", "0x10b5")  # LSI/Broadcom, PLX (Broadcom's PEX line)
MICROCHIP_IDS = ("0x11f8", "0x1f18")  # PMC-Sierra/Microsemi/Microchip Switchtec, c-payne
AMD_ID, INTEL_ID = "0x1022", "0x8086"
VENDOR_NAMES = {
    **{v: "Broadcom/PLX" for v in BROADCOM_IDS},
    **{v: "Microchip" for v in MICROCHIP_IDS},
    AMD_ID: "AMD",
    INTEL_ID: "Intel",
}
# Names accepted for `topo --switch-vendor / --cpu-vendor` hints, as vendor ids.
VENDOR_HINTS = {
    "broadcom": BROADCOM_IDS[0],
    "plx": BROADCOM_IDS[1],
    "microchip": MICROCHIP_IDS[0],
    "amd": AMD_ID,
    "intel": INTEL_ID,
}


def root_complex(topo: Topology, g: int) -> str | None:
    """The host bridge of GPU g's root port (None when the source shows no tree)."""
    port, _ = topo.ancestry(g)
    return port.host_bridge if port is not None else None


def top_switch(topo: Topology, g: int) -> str | None:
    """The switch directly below GPU g's root port (None: the GPU is on the root port)."""
    _, switches = topo.ancestry(g)
    return switches[0].id if switches else None


def leaves_switch(topo: Topology, a: int, b: int) -> bool:
    """Whether flow a -> b goes up a's topmost switch uplink into a root complex."""
    pa, pb = topo.ancestry(a)[0], topo.ancestry(b)[0]
    return pa is not None and pb is not None and pa.id != pb.id and top_switch(topo, a) is not None


def shared_switches(topo: Topology) -> dict[str, tuple[int, ...]]:
    """Topmost switches with two or more GPUs below: their uplink carries several flows."""
    out: dict[str, list[int]] = {}
    for g in range(topo.num_gpus):
        sw = top_switch(topo, g)
        if sw is not None:
            out.setdefault(sw, []).append(g)
    return {sw: tuple(gs) for sw, gs in out.items() if len(gs) >= 2}


def destination_roots(topo: Topology, switch: str) -> dict[str, tuple[int, ...]]:
    """Root complex -> GPUs that the GPUs below `switch` reach through its uplink."""
    below = set(shared_switches(topo).get(switch, ()))
    src = next(iter(below), None)
    out: dict[str, list[int]] = {}
    if src is None:
        return {}
    for b in range(topo.num_gpus):
        if b not in below and leaves_switch(topo, src, b):
            rc = root_complex(topo, b)
            if rc is not None:
                out.setdefault(rc, []).append(b)
    return {rc: tuple(gs) for rc, gs in sorted(out.items())}


def trigger_possible(topo: Topology, switch: str) -> bool:
    """Two or more GPUs below `switch` can write to two or more root complexes at once."""
    return (
        len(shared_switches(topo).get(switch, ())) >= 2
        and len(destination_roots(topo, switch)) >= 2
    )


def trigger_switch(topo: Topology, a: int, b: int) -> str | None:
    """The shared source switch of flow a -> b when pushing on it can take part in the
    collapse trigger, else None."""
    sw = top_switch(topo, a)
    if sw is None or not leaves_switch(topo, a, b) or not trigger_possible(topo, sw):
        return None
    return sw


def collapse_class(topo: Topology, switch: str) -> tuple[bool | None, str]:
    """Whether `switch` belongs to a class with a reported write collapse: (True: Broadcom
    or Microchip switch writing into AMD root complexes; False: a known other vendor or an
    Intel host; None: the source does not say), and the words for a reason."""
    sw = next(s for s in topo.switches if s.id == switch)
    hosts = {
        p.vendor
        for g in range(topo.num_gpus)
        for p in [topo.ancestry(g)[0]]
        if p is not None and p.host_bridge in destination_roots(topo, switch)
    }
    sw_name = VENDOR_NAMES.get(sw.vendor or "", sw.vendor)
    host_names = sorted(VENDOR_NAMES.get(h or "", h or "?") for h in hosts)
    if sw.vendor is None or None in hosts or not hosts:
        missing = "switch vendor" if sw.vendor is None else "CPU (root port) vendor"
        return None, f"{missing} not in the source"
    prone = sw.vendor in BROADCOM_IDS + MICROCHIP_IDS and hosts == {AMD_ID}
    return prone, f"{sw_name} switch into {'/'.join(host_names)} root complexes"


def with_vendor_hints(
    topo: Topology, cpu: str | None = None, switch: str | None = None
) -> Topology:
    """`topo` with the vendors its source does not show filled in from hints (names of
    VENDOR_HINTS: ``amd``/``intel`` for root ports, ``broadcom``/``plx``/``microchip`` for
    switches). Vendors the source shows are kept. Raises ValueError for unknown names."""
    import dataclasses

    def vid(name: str | None, allowed: tuple[str, ...], what: str) -> str | None:
        if name is None:
            return None
        if name.lower() not in allowed:
            raise ValueError(f"{what}={name!r}: expected one of {', '.join(allowed)}")
        return VENDOR_HINTS[name.lower()]

    cpu_id = vid(cpu, ("amd", "intel"), "cpu vendor")
    sw_id = vid(switch, ("broadcom", "plx", "microchip"), "switch vendor")
    notes = list(topo.notes)
    if cpu_id and any(p.vendor is None for p in topo.root_ports):
        notes.append(f"root port (CPU) vendor not in the source: {cpu} given")
    if sw_id and any(s.vendor is None for s in topo.switches):
        notes.append(f"switch vendor not in the source: {switch} given")
    return dataclasses.replace(
        topo,
        root_ports=tuple(
            dataclasses.replace(p, vendor=p.vendor or cpu_id) for p in topo.root_ports
        ),
        switches=tuple(dataclasses.replace(s, vendor=s.vendor or sw_id) for s in topo.switches),
        notes=tuple(notes),
    )
