"""Diagnosis lines from sysfs (IOMMU mode, ACS state, BAR1 size) on synthetic trees, and
from measurements (kernel P2P behind the copy engine, the write collapse)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from pcie_a2a.topology.diagnosis import PlatformFacts, acs_control, diagnose, platform_facts
from pcie_a2a.topology.model import Gpu, P2PStatus, Topology
from pcie_a2a.topology.probe import PairMeasurement, PatternMeasurement, Probe

GPU = "0000:03:00.0"
CHAIN = ["pci0000:00", "0000:00:01.1", "0000:01:00.0", "0000:02:00.0", GPU]


def config(acs_ctl: int | None, readable: bool = True) -> bytes:
    """A config space: 64 bytes when unreadable (no root), else 4 KiB with an extended
    capability list AER (0x0001) at 0x100 -> ACS (0x000D) at 0x148 when acs_ctl is given."""
    if not readable:
        return bytes(64)
    space = bytearray(4096)
    nxt = 0x148 if acs_ctl is not None else 0
    space[0x100:0x104] = struct.pack("<I", 0x0001 | (1 << 16) | (nxt << 20))
    if acs_ctl is not None:
        space[0x148:0x14C] = struct.pack("<I", 0x000D | (1 << 16))
        space[0x14C:0x14E] = struct.pack("<H", 0x5F)  # capability register
        space[0x14E:0x150] = struct.pack("<H", acs_ctl)
    return bytes(space)


def tree(root: Path, bridge_config: bytes, iommu_type: str | None, bar1: int) -> None:
    path = root / "devices"
    for part in CHAIN:
        path = path / part
        path.mkdir(parents=True, exist_ok=True)
        if part.startswith("0000:"):
            link = root / "bus/pci/devices" / part
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(path, link.parent))
            (path / "config").write_bytes(bridge_config if part != GPU else config(None))
    gpu = path
    res = ["0x00000000f0000000 0x00000000f1ffffff 0x0000000000040200"]
    res.append(f"0x0000380000000000 0x{0x380000000000 + bar1 - 1:016x} 0x000000000014220c")
    (gpu / "resource").write_text("\n".join(res + ["0x0 0x0 0x0"] * 4) + "\n")
    if iommu_type is not None:
        group = root / "kernel/iommu_groups/7"
        group.mkdir(parents=True)
        (group / "type").write_text(iommu_type + "\n")
        (gpu / "iommu_group").symlink_to(os.path.relpath(group, gpu))


def test_acs_control_walks_the_extended_capabilities():
    assert acs_control(config(0x1D)) == 0x1D
    assert acs_control(config(None)) is None
    assert acs_control(config(0x1D, readable=False)) is None
    looped = bytearray(config(None))
    looped[0x100:0x104] = struct.pack("<I", 0x0001 | (0x100 << 20))  # next points to itself
    assert acs_control(bytes(looped)) is None


def test_translating_iommu_acs_redirect_and_small_bar1(tmp_path):
    tree(tmp_path, config(0b01101), "DMA-FQ", 256 << 20)  # SrcValid, ReqRedir, CmpltRedir
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cmdline").write_text("BOOT_IMAGE=/vmlinuz root=/dev/sda1\n")
    facts = platform_facts(tmp_path, tmp_path / "proc", [GPU])
    assert facts.iommu == "translated" and "DMA-FQ" in facts.iommu_evidence
    assert facts.acs["0000:00:01.1"] == ("SrcValid", "ReqRedir", "CmpltRedir")
    assert facts.bar1 == {GPU: 256 << 20}
    lines = diagnose(one_gpu_topology(), None, facts)
    assert any(line.startswith("IOMMU is translating") and "iommu=pt" in line for line in lines)
    assert any(
        "ACS redirect is on at 0000:00:01.1, 0000:01:00.0, 0000:02:00.0" in line for line in lines
    )
    assert any(
        line.startswith("BAR1 is 256 MiB on 0000:03:00.0: no resizable BAR") for line in lines
    )


def test_passthrough_acs_off_and_large_bar1(tmp_path):
    tree(tmp_path, config(0x01), "identity", 32 << 30)
    facts = platform_facts(tmp_path, tmp_path / "proc", [GPU])
    lines = diagnose(one_gpu_topology(), None, facts)
    assert facts.iommu == "passthrough"
    assert "ACS redirect off on the 3 bridges above the GPUs" in lines
    assert "BAR1 32 GiB (resizable BAR)" in lines


def test_unreadable_acs_and_iommu_off_from_the_command_line(tmp_path):
    tree(tmp_path, config(None, readable=False), None, 32 << 30)
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cmdline").write_text("root=/dev/sda1 amd_iommu=off quiet\n")
    facts = platform_facts(tmp_path, tmp_path / "proc", [GPU])
    assert (facts.iommu, facts.iommu_evidence) == ("off", "kernel command line amd_iommu=off")
    lines = diagnose(one_gpu_topology(), None, facts)
    assert any(
        line.startswith("ACS state unknown: reading the bridges' extended config space needs root")
        for line in lines
    )


def test_nothing_in_sysfs_is_unknown_not_an_error(tmp_path):
    facts = platform_facts(tmp_path, tmp_path, ["0000:99:00.0"])
    assert facts == PlatformFacts()
    assert diagnose(one_gpu_topology(), None, facts) == []


def one_gpu_topology() -> Topology:
    return Topology(
        gpus=(Gpu(index=0, bus_id=GPU),), classes=(("X",),), p2p=((P2PStatus.UNKNOWN,),)
    )


def two_gpu_topology(cls: str) -> Topology:
    return Topology(
        gpus=(Gpu(index=0), Gpu(index=1)),
        classes=(("X", cls), (cls, "X")),
        p2p=((P2PStatus.UNKNOWN,) * 2,) * 2,
    )


@pytest.mark.parametrize(("kernel", "ce", "flagged"), [(3.7, 56.0, True), (40.0, 56.0, False)])
def test_kernel_p2p_behind_the_copy_engine(kernel, ce, flagged):
    m = PairMeasurement(store_gbps=kernel, load_gbps=kernel, ce_gbps=ce)
    lines = diagnose(two_gpu_topology("NODE"), Probe(pairs={(0, 1): m, (1, 0): m}))
    hit = [line for line in lines if "ForceP2P" in line]
    assert bool(hit) == flagged
    if flagged:
        assert hit[0].startswith(
            "kernel-issued P2P is 15x slower than the copy engine on 2 pairs (NODE;"
        )
        assert "The operator may set the nvidia module option" in hit[0]


def test_collapse_line_needs_both_patterns():
    def pat(k, mode, agg):
        return PatternMeasurement(
            name=f"switch sw0 to {k} root complex{'es' if k > 1 else ''} {mode}", kind="switch_roots",
            mode=mode, flows=((0, 1),), flow_gbps=(agg,), aggregate_gbps=agg, switch="sw0", roots=k,
        )  # fmt: skip

    probe = Probe(patterns=(pat(1, "store", 36.8), pat(2, "store", 2.7), pat(2, "load", 51.1)))
    lines = diagnose(two_gpu_topology("NODE"), probe)
    assert lines == [
        "posted-write collapse on switch sw0: writing into 2 root complexes at once ran 2.7 GB/s "
        "against 36.8 into one; reads on the same pattern 51.1. The plan pulls its cross-root "
        "pairs where reads are faster and pushes the rest one root complex at a time (not "
        "fixable by iommu, ACS or driver settings; field_2026 s4)."
    ]
    mild = Probe(patterns=(pat(1, "store", 36.8), pat(2, "store", 30.0)))
    assert diagnose(two_gpu_topology("NODE"), mild) == []
