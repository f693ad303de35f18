"""Diagnosis lines a person can act on: what the probe measured that is worse than the
hardware allows, and the platform settings that explain it.

From sysfs (all optional, a fake tree in tests):

* IOMMU: ``kernel/iommu_groups/<n>/type`` of each GPU's group (``identity`` = pass-through;
  ``DMA``/``DMA-FQ`` = translating) and the kernel command line (``iommu=pt``,
  ``amd_iommu=off``, ...). A translating IOMMU is the common cause of P2P probes that hang
  or fail (vllm RFC 51513); ``iommu=pt`` is the usual fix.
* ACS: the ACS capability (extended capability 0x000D) of every bridge above a GPU, read
  from ``config`` (needs root: an unprivileged read returns 64 bytes). Request or
  completion redirect on a switch port sends same-switch peer traffic up to the root
  complex (the Broadcom box ran ~50 instead of ~103 GB/s bidirectional with ACS on).
* BAR1: the size of each GPU's BAR1 (``resource`` line 1). 256 MiB means no resizable BAR:
  peer mappings of large buffers fail or thrash.

From the probe: kernel-issued P2P far below the copy engine on the same pair (the driver
routing kernel peer loads/stores through system memory unless the operator sets
``NVreg_RegistryDwords="ForceP2P=0x11;RMForceP2PType=1;RMPcieP2PType=2"``; field_2026 s5),
and the posted-write collapse on a switch. The package never sets a driver option; it
names the option as the operator's choice.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .directions import CE_MARGIN
from .model import Topology
from .probe import Probe, switch_pattern_name

FORCE_P2P = 'NVreg_RegistryDwords="ForceP2P=0x11;RMForceP2PType=1;RMPcieP2PType=2"'
ACS_CAP_ID = 0x000D
ACS_BITS = {0: "SrcValid", 1: "TransBlk", 2: "ReqRedir", 3: "CmpltRedir", 4: "UpstreamFwd"}
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@dataclass(frozen=True)
class PlatformFacts:
    iommu: str = "unknown"  # "off", "passthrough", "translated", "unknown"
    iommu_evidence: str = ""
    acs: dict[str, tuple[str, ...] | None] = field(default_factory=dict)  # bridge -> bits on
    acs_unreadable: tuple[str, ...] = ()  # bridges whose extended config space was not readable
    bar1: dict[str, int] = field(default_factory=dict)  # GPU bus id -> BAR1 bytes


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def acs_control(config: bytes) -> int | None:
    """The ACS control register from a device's config space bytes, None when the space
    is not readable past 256 bytes or has no ACS capability."""
    if len(config) <= 0x100:
        return None
    off, seen = 0x100, set()
    while off and off + 8 <= len(config) and off not in seen:
        seen.add(off)
        header = int.from_bytes(config[off : off + 4], "little")
        if header in (0, 0xFFFFFFFF):
            return None
        if header & 0xFFFF == ACS_CAP_ID:
            return int.from_bytes(config[off + 6 : off + 8], "little")
        off = (header >> 20) & 0xFFC
    return None


def _bridges(sysfs: Path, bdf: str) -> list[str]:
    real = (sysfs / "bus/pci/devices" / bdf).resolve()
    return [p for p in real.parts[:-1] if _BDF.match(p)]


def platform_facts(
    sysfs_root: str | os.PathLike = "/sys",
    proc_root: str | os.PathLike = "/proc",
    bus_ids: Sequence[str] = (),
) -> PlatformFacts:
    """IOMMU mode, ACS state of the bridges above the GPUs, BAR1 sizes (see the module
    comment). Missing files give "unknown", never an error."""
    sysfs = Path(sysfs_root)
    cmdline = _read(Path(proc_root) / "cmdline") or ""
    types = {}
    for b in bus_ids:
        group = sysfs / "bus/pci/devices" / b / "iommu_group"
        t = _read(group / "type") if group.exists() else None
        if t is not None:
            types[b] = t
    off_flag = re.search(r"\b(?:amd_iommu|intel_iommu|iommu)=off\b", cmdline)
    pt_flag = re.search(r"\biommu=pt\b|\biommu\.passthrough=1\b", cmdline)
    if types:
        translated = sorted(b for b, t in types.items() if t.upper().startswith("DMA"))
        if translated:
            iommu = "translated"
            evidence = f"IOMMU group type {types[translated[0]]} for GPU {translated[0]}"
        else:
            iommu, evidence = "passthrough", "IOMMU groups of the GPUs are identity"
    elif off_flag:
        iommu, evidence = "off", f"kernel command line {off_flag.group()}"
    elif pt_flag:
        iommu, evidence = "passthrough", f"kernel command line {pt_flag.group()}"
    elif (sysfs / "class/iommu").is_dir() and not any((sysfs / "class/iommu").iterdir()):
        iommu, evidence = "off", "no IOMMU registered (class/iommu is empty)"
    else:
        iommu, evidence = "unknown", ""
    acs: dict[str, tuple[str, ...] | None] = {}
    unreadable = []
    bar1 = {}
    for b in bus_ids:
        for br in _bridges(sysfs, b):
            if br in acs or br in unreadable:
                continue
            try:
                config = (sysfs / "bus/pci/devices" / br / "config").read_bytes()
            except OSError:
                continue
            ctl = acs_control(config)
            if ctl is None:
                if len(config) <= 0x100:
                    unreadable.append(br)
                continue
            acs[br] = tuple(name for bit, name in ACS_BITS.items() if ctl >> bit & 1)
        res = _read(sysfs / "bus/pci/devices" / b / "resource")
        if res:
            lines = res.splitlines()
            if len(lines) > 1:
                start, end = (int(x, 16) for x in lines[1].split()[:2])
                if end > start:
                    bar1[b] = end - start + 1
    return PlatformFacts(iommu, evidence, acs, tuple(unreadable), bar1)


def _pairs_text(pairs: list[tuple[int, int]], limit: int = 6) -> str:
    shown = " ".join(f"{a}->{b}" for a, b in pairs[:limit])
    return shown + (f" (+{len(pairs) - limit} more)" if len(pairs) > limit else "")


def diagnose(topo: Topology, probe: Probe | None, facts: PlatformFacts | None = None) -> list[str]:
    """The diagnosis lines for `topo` measured by `probe` (in topology GPU indices) on a
    platform with `facts`."""
    out: list[str] = []
    if probe is not None:
        slow: list[tuple[int, int]] = []
        worst = (1.0, 0.0, 0.0)
        for (a, b), m in sorted(probe.pairs.items()):
            kernel = m.store_gbps if m.store_gbps is not None else m.load_gbps
            if kernel is None or m.ce_gbps is None or m.ce_gbps <= 0:
                continue
            if kernel < CE_MARGIN * m.ce_gbps:
                slow.append((a, b))
                ratio = kernel / m.ce_gbps
                if ratio < worst[0]:
                    worst = (ratio, kernel, m.ce_gbps)
        if slow:
            classes = sorted({topo.classes[a][b] for a, b in slow if a < topo.num_gpus})
            out.append(
                f"kernel-issued P2P is {1 / worst[0]:.0f}x slower than the copy engine on "
                f"{len(slow)} pairs ({'/'.join(classes)}; worst {worst[1]:.1f} vs "
                f"{worst[2]:.1f} GB/s: {_pairs_text(slow)}): the driver routes kernel peer "
                "loads and stores through system memory. The operator may set the nvidia "
                f"module option {FORCE_P2P} (then reload the driver and run pcie-a2a probe "
                "again); pcie_a2a never sets it. Until then these pairs use the copy engine."
            )
        for p in probe.patterns:
            if p.kind != "switch_roots" or p.mode != "store" or (p.roots or 0) < 2:
                continue
            base = probe.pattern(switch_pattern_name(p.switch or "", 1, "store"))
            reads = probe.pattern(switch_pattern_name(p.switch or "", p.roots or 0, "load"))
            if base is not None and p.aggregate_gbps < 0.5 * base.aggregate_gbps:
                read = f"; reads on the same pattern {reads.aggregate_gbps:.1f}" if reads else ""
                out.append(
                    f"posted-write collapse on switch {p.switch}: writing into {p.roots} root "
                    f"complexes at once ran {p.aggregate_gbps:.1f} GB/s against "
                    f"{base.aggregate_gbps:.1f} into one{read}. The plan pulls its cross-root "
                    "pairs where reads are faster and pushes the rest one root complex at a "
                    "time (not fixable by iommu, ACS or driver settings; field_2026 s4)."
                )
        a2a = {p.mode: p for p in probe.patterns if p.kind == "all_to_all"}
        if "store" in a2a and "load" in a2a:
            w, r = a2a["store"].aggregate_gbps, a2a["load"].aggregate_gbps
            faster = "reads" if r > w else "writes"
            out.append(f"all-to-all: writes {w:.1f} GB/s, reads {r:.1f} GB/s ({faster} faster)")
    if facts is not None:
        if facts.iommu == "translated":
            out.append(
                f"IOMMU is translating ({facts.iommu_evidence}): peer-to-peer transfers can "
                "fail, hang or slow down; iommu=pt (amd_iommu=pt / intel_iommu=on iommu=pt) on "
                "the kernel command line is the usual fix"
            )
        elif facts.iommu in ("off", "passthrough"):
            out.append(f"IOMMU {facts.iommu} ({facts.iommu_evidence})")
        redirect = sorted(
            br for br, bits in facts.acs.items() if bits and {"ReqRedir", "CmpltRedir"} & set(bits)
        )
        if redirect:
            out.append(
                f"ACS redirect is on at {', '.join(redirect[:4])}"
                + (f" (+{len(redirect) - 4} more)" if len(redirect) > 4 else "")
                + ": peer traffic below these bridges is sent up to the root complex "
                "(disable ACS ReqRedir/CmpltRedir, e.g. setpci, or the BIOS option)"
            )
        elif facts.acs:
            out.append(f"ACS redirect off on the {len(facts.acs)} bridges above the GPUs")
        elif facts.acs_unreadable:
            out.append(
                "ACS state unknown: reading the bridges' extended config space needs root "
                "(a PIX pair running near root-port speed is the symptom of ACS redirect)"
            )
        small = sorted(b for b, size in facts.bar1.items() if size <= 256 << 20)
        if small:
            out.append(
                f"BAR1 is {facts.bar1[small[0]] >> 20} MiB on {', '.join(small[:4])}: no "
                "resizable BAR, so peers cannot map large buffers (enable Resizable BAR / "
                "Above 4G decoding in the BIOS)"
            )
        elif facts.bar1:
            sizes = sorted(set(facts.bar1.values()))
            out.append(
                "BAR1 " + ", ".join(f"{s / (1 << 30):g} GiB" for s in sizes) + " (resizable BAR)"
            )
    return out
