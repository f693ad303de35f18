"""The live builder on synthetic sysfs trees built in a temporary directory (no hardware),
on this machine's real /sys, and the optional CUDA / NVML hooks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pcie_a2a.topology import P2PStatus, TransferOptions, discover, live, plan_transfers


def write(path: Path, **files: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (path / name).write_text(value + "\n")


def device(
    sysfs: Path,
    chain: list[str],
    cls: str,
    vendor: str,
    node: int,
    gen: str = "32.0",
    width: int = 16,
    **extra: str,
) -> Path:
    """One PCI function at devices/<chain...>, with its bus/pci/devices symlink."""
    path = sysfs / "devices" / Path(*chain)
    write(
        path,
        **{
            "class": cls,
            "vendor": vendor,
            "device": "0x2bb5" if vendor == "0x10de" else "0xc030",
            "numa_node": str(node),
            "max_link_speed": f"{gen} GT/s PCIe",
            "max_link_width": str(width),
            "current_link_speed": "2.5 GT/s PCIe",  # idle GPUs train down to Gen1
            "current_link_width": str(width),
            **extra,
        },
    )
    link = sysfs / "bus/pci/devices" / chain[-1]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(path, link.parent))
    return path


def numa(sysfs: Path, nodes: dict[int, tuple[str, int]]) -> None:
    ids = sorted(nodes)
    for node, (cpulist, package) in nodes.items():
        dist = " ".join("10" if other == node else "32" for other in ids)
        write(sysfs / f"devices/system/node/node{node}", cpulist=cpulist, distance=dist)
        first = int(cpulist.split("-")[0].split(",")[0])
        write(sysfs / f"devices/system/cpu/cpu{first}/topology", physical_package_id=str(package))


BRIDGE, GPU, NV = "0x060400", "0x030200", "0x10de"


def two_socket_box(sysfs: Path) -> None:
    """2 sockets, 2 Broadcom switches per socket, 2 GPUs per switch, each switch on its own
    host bridge; GPU5 reports numa_node -1 (its bridges know); a NIC and a BMC VGA."""
    numa(sysfs, {0: ("0-7", 0), 1: ("8-15", 1)})
    for k, bus in enumerate((0x00, 0x40, 0x80, 0xC0)):
        node = 0 if bus < 0x80 else 1
        hb = f"pci0000:{bus:02x}"
        rp = f"0000:{bus:02x}:01.1"
        up = f"0000:{bus + 1:02x}:00.0"
        device(sysfs, [hb, rp], BRIDGE, "0x1022", node)
        device(sysfs, [hb, rp, up], BRIDGE, "0x1000", node)
        for d in range(2):
            down = f"0000:{bus + 2:02x}:{d:02x}.0"
            gpu = f"0000:{bus + 3 + d:02x}:00.0"
            device(sysfs, [hb, rp, up, down], BRIDGE, "0x1000", node)
            device(sysfs, [hb, rp, up, down, gpu], GPU, NV, -1 if 2 * k + d == 5 else node)
    nic = device(sysfs, ["pci0000:00", "0000:00:03.1"], BRIDGE, "0x1022", 0)
    eth = device(sysfs, ["pci0000:00", "0000:00:03.1", "0000:05:00.0"], "0x020000", "0x15b3", 0)
    (eth / "net/eth0").mkdir(parents=True)
    assert nic.exists()
    device(sysfs, ["pci0000:00", "0000:00:07.1", "0000:08:00.0"], "0x030000", "0x1a03", 0)


def flat_switch_box(sysfs: Path) -> None:
    """One socket, one Gen4 switch with 8 GPUs below it; GPU7 trained to x8."""
    numa(sysfs, {0: ("0-31", 0)})
    hb, rp, up = "pci0000:00", "0000:00:01.1", "0000:01:00.0"
    device(sysfs, [hb, rp], BRIDGE, "0x1022", 0, gen="16.0")
    device(sysfs, [hb, rp, up], BRIDGE, "0x10b5", 0, gen="16.0")
    for d in range(8):
        down = f"0000:02:{d:02x}.0"
        device(sysfs, [hb, rp, up, down], BRIDGE, "0x10b5", 0, gen="16.0")
        device(
            sysfs,
            [hb, rp, up, down, f"0000:{3 + d:02x}:00.0"],
            GPU,
            NV,
            0,
            gen="16.0",
            width=8 if d == 7 else 16,
        )


def test_two_sockets_two_switches_each(tmp_path):
    two_socket_box(tmp_path)
    t = discover(tmp_path, use_nvml=False, use_cuda=False)
    assert t.num_gpus == 8
    assert [g.bus_id for g in t.gpus] == [
        "0000:03:00.0",
        "0000:04:00.0",
        "0000:43:00.0",
        "0000:44:00.0",
        "0000:83:00.0",
        "0000:84:00.0",
        "0000:c3:00.0",
        "0000:c4:00.0",
    ]
    assert [g.numa_node for g in t.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert any("0000:84:00.0: numa_node is -1; took node 1" in note for note in t.notes)
    assert [(n.id, n.socket, n.cpus, n.distances) for n in t.numa_nodes] == [
        (0, 0, "0-7", (10, 32)),
        (1, 1, "8-15", (32, 10)),
    ]
    assert sorted(s.id for s in t.switches) == [
        "0000:01:00.0",
        "0000:41:00.0",
        "0000:81:00.0",
        "0000:c1:00.0",
    ]
    assert {s.vendor for s in t.switches} == {"0x1000"}
    assert [g.parent for g in t.gpus][:2] == ["0000:01:00.0"] * 2
    assert (t.gpus[0].link_gen, t.gpus[0].link_width, t.gpus[0].current_link_gen) == (5, 16, 1)
    row0 = list(t.classes[0])
    assert row0 == ["X", "PIX", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]
    assert t.classes[4][5] == "PIX" and t.classes[5][6] == "NODE"
    assert [n.name for n in t.nics] == ["eth0"] and t.nics[0].numa_node == 0
    assert all(s == P2PStatus.UNKNOWN for r in t.p2p for s in r)

    p = plan_transfers(t, options=TransferOptions(default_link_gen=4))
    assert p.pair(0, 1).transport == "p2p" and p.pair(0, 1).gbps == 51.5  # Gen5 from sysfs
    assert p.pair(0, 4).transport == "staged" and p.pair(0, 4).staging_node == 1
    cross = [sum(1 for a, b in enumerate(r) if a < 4 <= b) for r in p.rounds]
    assert max(cross) == 3 and sum(cross) == 16


def test_flat_single_switch(tmp_path):
    flat_switch_box(tmp_path)
    t = discover(tmp_path, use_nvml=False, use_cuda=False)
    assert t.num_gpus == 8 and len(t.switches) == 1 and len(t.root_ports) == 1
    assert all(t.classes[i][j] == "PIX" for i in range(8) for j in range(8) if i != j)
    assert [g.link_width for g in t.gpus] == [16] * 7 + [8]
    assert t.switches[0].link_gen == 4 and t.switches[0].vendor == "0x10b5"
    p = plan_transfers(t)
    assert all(q.transport == "p2p" for q in p.pairs)
    # Everything stays below the switch: no shared link is used at all.
    assert p.max_shared_load == 0
    assert p.pair(0, 7).links == ("GPU0^", "GPU7v")
    assert p.link("GPU7v").capacity_gbps == 12.5  # Gen4 x8


def test_gpu_directly_on_host_bridge(tmp_path):
    """VMs put each GPU straight on its own PCI domain's root bus (Azure NC A100 v4)."""
    numa(tmp_path, {0: ("0-3", 0), 1: ("4-7", 0)})
    device(tmp_path, ["pci0001:00", "0001:00:00.0"], GPU, NV, 0)
    device(tmp_path, ["pci0002:00", "0002:00:00.0"], GPU, NV, 1)
    t = discover(tmp_path, use_nvml=False, use_cuda=False)
    assert [r.id for r in t.root_ports] == ["pci0001:00", "pci0002:00"]
    assert t.classes[0][1] == "SYS"
    assert [n.socket for n in t.numa_nodes] == [0, 0]  # one socket, two nodes (NPS2-like)


def has_nvidia_gpu() -> bool:
    for dev in Path("/sys/bus/pci/devices").glob("*"):
        try:
            if (dev / "vendor").read_text().strip() == "0x10de" and (
                dev / "class"
            ).read_text().startswith("0x03"):
                return True
        except OSError:
            continue
    return False


@pytest.mark.skipif(has_nvidia_gpu(), reason="this machine has an NVIDIA GPU")
def test_this_machine_without_gpus_gives_an_empty_list():
    t = discover()
    assert t.num_gpus == 0 and t.classes == () and len(t.numa_nodes) >= 1
    assert discover("/nonexistent-sysfs").num_gpus == 0
    p = plan_transfers(t)
    assert p.pairs == () and p.rounds == ()


def test_optional_hooks_absent_here():
    assert live.nvml_info(["0000:01:00.0"]) is None  # no libnvidia-ml on this machine
    import torch

    if not torch.cuda.is_available():
        assert live.cuda_peer_matrix() is None and live.cuda_bus_ids() is None


def test_cuda_peer_hook_sets_p2p_status(tmp_path, monkeypatch):
    flat_switch_box(tmp_path)
    import torch

    class Props:
        def __init__(self, i: int) -> None:
            self.pci_bus_id, self.pci_device_id, self.pci_domain_id = 3 + i, 0, 0

    # CUDA order reversed against bus order: pairs must be matched by bus id.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props(7 - i))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: {i, j} != {0, 1})
    t = discover(tmp_path, use_nvml=False, use_cuda=True)
    # CUDA devices 0 and 1 are bus 0a and 09: GPU7 and GPU6 in bus order.
    assert t.p2p_status(7, 6) == P2PStatus.UNSUPPORTED == t.p2p_status(6, 7)
    assert t.p2p_status(0, 1) == P2PStatus.SUPPORTED
    assert any("cudaDeviceCanAccessPeer" in note for note in t.notes)
    assert plan_transfers(t).pair(6, 7).transport == "staged"
