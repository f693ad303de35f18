"""Parsers against the published dumps in shared/fixtures/topology (vendored copy in
tests/fixtures/topology): nvidia-smi topo -m / -p2p, NCCL XML, p2pBandwidthLatencyTest,
NCCL path logs, our JSON; and the errors garbled input gives."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from pcie_a2a.topology import (
    P2PStatus,
    Topology,
    TopologyError,
    load,
    parse,
    parse_p2p_matrix,
    parse_p2p_test,
    parse_topo,
    parse_xml,
)
from pcie_a2a.topology.nccl_log import parse_nccl_paths, parse_nccl_tests
from topology_fixtures import FIXTURES, SHARED, VENDORED


def fx(name: str) -> Path:
    return FIXTURES / name


def all_fixtures() -> list[str]:
    return sorted(p.name for p in FIXTURES.iterdir() if p.name != "README.md")


def classes_of(text: str) -> list[list[str]]:
    return [row.split() for row in text.strip().splitlines()]


# Published matrices, typed in from the fixtures (GPU rows only).
PUBLISHED = {
    "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt": """
        X PIX NODE NODE SYS SYS SYS SYS
        PIX X NODE NODE SYS SYS SYS SYS
        NODE NODE X PIX SYS SYS SYS SYS
        NODE NODE PIX X SYS SYS SYS SYS
        SYS SYS SYS SYS X PIX NODE NODE
        SYS SYS SYS SYS PIX X NODE NODE
        SYS SYS SYS SYS NODE NODE X PIX
        SYS SYS SYS SYS NODE NODE PIX X""",
    "8x-rtxpro6000-threadripper-3switch-pxb.topo.txt": """
        X PIX PXB PXB NODE NODE NODE NODE
        PIX X PXB PXB NODE NODE NODE NODE
        PXB PXB X PIX NODE NODE NODE NODE
        PXB PXB PIX X NODE NODE NODE NODE
        NODE NODE NODE NODE X PIX PXB PXB
        NODE NODE NODE NODE PIX X PXB PXB
        NODE NODE NODE NODE PXB PXB X PIX
        NODE NODE NODE NODE PXB PXB PIX X""",
    "8x-rtx4090-dual-xeon-broadcom-pix.topo.txt": """
        X PIX PIX PIX SYS SYS SYS SYS
        PIX X PIX PIX SYS SYS SYS SYS
        PIX PIX X PIX SYS SYS SYS SYS
        PIX PIX PIX X SYS SYS SYS SYS
        SYS SYS SYS SYS X PIX PIX PIX
        SYS SYS SYS SYS PIX X PIX PIX
        SYS SYS SYS SYS PIX PIX X PIX
        SYS SYS SYS SYS PIX PIX PIX X""",
    "8x-rtxpro6000-dual-epyc9124-direct.topo.txt": """
        X NODE NODE NODE SYS SYS SYS SYS
        NODE X NODE NODE SYS SYS SYS SYS
        NODE NODE X NODE SYS SYS SYS SYS
        NODE NODE NODE X SYS SYS SYS SYS
        SYS SYS SYS SYS X NODE NODE NODE
        SYS SYS SYS SYS NODE X NODE NODE
        SYS SYS SYS SYS NODE NODE X NODE
        SYS SYS SYS SYS NODE NODE NODE X""",
    "8x-rtx4090-dual-socket-all-sys.topo.txt": "\n".join(
        " ".join("X" if i == j else "SYS" for j in range(8)) for i in range(8)
    ),
    "8x-a100-pcie-nvlink-bridge-pairs.topo.txt": """
        X NV12 NODE NODE NODE NODE NODE NODE
        NV12 X NODE NODE NODE NODE NODE NODE
        NODE NODE X NV12 NODE NODE NODE NODE
        NODE NODE NV12 X NODE NODE NODE NODE
        NODE NODE NODE NODE X NV12 NODE NODE
        NODE NODE NODE NODE NV12 X NODE NODE
        NODE NODE NODE NODE NODE NODE X NV12
        NODE NODE NODE NODE NODE NODE NV12 X""",
    "8x-a100-dgx-nvswitch.topo.txt": """
        X NV12 NV12 NV12
        NV12 X NV12 NV12
        NV12 NV12 X NV12
        NV12 NV12 NV12 X""",
    "4x-l40s-dual-socket.topo.txt": """
        X NODE SYS SYS
        NODE X SYS SYS
        SYS SYS X NODE
        SYS SYS NODE X""",
    "4x-rtx4090-a6000-mixed-single-socket-phb.topo.txt": """
        X PHB PHB PHB
        PHB X PHB PHB
        PHB PHB X PHB
        PHB PHB PHB X""",
    "6x-rtx4090-2023-driver.topo.txt": """
        X PHB SYS SYS SYS SYS
        PHB X SYS SYS SYS SYS
        SYS SYS X SYS SYS SYS
        SYS SYS SYS X PHB SYS
        SYS SYS SYS PHB X SYS
        SYS SYS SYS SYS SYS X""",
    "2x-rtx5090-threadripper3975wx.topo-p2p.txt": "X PHB\nPHB X",
    "5x-rtx50series-epyc-patched.topo-p2p.txt": """
        X NODE NODE NODE NODE
        NODE X NODE NODE NODE
        NODE NODE X NODE NODE
        NODE NODE NODE X PHB
        NODE NODE NODE PHB X""",
}

# NUMA Affinity column (or the author's "NUMA n" column); where the source has none, the
# node its SYS boundary / CPU Affinity implies.
NUMA = {
    "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt": [0, 0, 0, 0, 1, 1, 1, 1],
    "8x-rtxpro6000-threadripper-3switch-pxb.topo.txt": [0] * 8,
    "8x-rtx4090-dual-xeon-broadcom-pix.topo.txt": [0, 0, 0, 0, 1, 1, 1, 1],
    "8x-rtxpro6000-dual-epyc9124-direct.topo.txt": [0, 0, 0, 0, 1, 1, 1, 1],
    "8x-rtx4090-dual-socket-all-sys.topo.txt": [0, 0, 0, 0, 1, 1, 1, 1],
    "8x-a100-pcie-nvlink-bridge-pairs.topo.txt": [0, 0, 0, 0, 1, 1, 1, 1],
    "8x-a100-dgx-nvswitch.topo.txt": [3, 3, 1, 1],
    "4x-l40s-dual-socket.topo.txt": [0, 0, 1, 1],
    "4x-rtx4090-a6000-mixed-single-socket-phb.topo.txt": [0, 0, 0, 0],
    "6x-rtx4090-2023-driver.topo.txt": [0] * 6,
    "2x-rtx5090-threadripper3975wx.topo-p2p.txt": [0, 0],
    "5x-rtx50series-epyc-patched.topo-p2p.txt": [0] * 5,
}

# Published matrices that no single PCIe tree reproduces with their own NUMA column: every
# GPU on its own host bridge yet SYS within a node (go-gpuallocator#17; nccl#814's markdown
# paste has one CPU set for all), and NODE across nodes under a Slurm cgroup (dask-cuda#1381).
ANOMALOUS = {
    "8x-rtx4090-dual-socket-all-sys.topo.txt",
    "6x-rtx4090-2023-driver.topo.txt",
    "8x-a100-pcie-nvlink-bridge-pairs.topo.txt",
}


def test_vendored_copy_matches_shared():
    if not SHARED.is_dir():
        pytest.skip("shared/fixtures/topology is not beside this checkout")
    names = sorted(p.name for p in SHARED.iterdir())
    assert sorted(p.name for p in VENDORED.iterdir()) == names
    _, mismatch, errors = filecmp.cmpfiles(SHARED, VENDORED, names, shallow=False)
    assert mismatch == [] and errors == []


@pytest.mark.parametrize("name", all_fixtures())
def test_every_fixture_parses(name):
    text = fx(name).read_text()
    if name.endswith((".topo.txt", ".topo-p2p.txt")):
        topo = load(fx(name))
        assert topo.num_gpus >= 2
    elif name.endswith(".xml.txt"):
        assert parse_xml(text, name).num_gpus == 4
    elif name.endswith(".p2p.txt"):
        assert len(parse_p2p_test(text, name).pairs) >= 30
    elif name.endswith(".nccl-paths.txt"):
        assert len(parse_nccl_paths(text, name)) >= 20
    elif name.endswith(".nccl-allreduce.txt"):
        assert len(parse_nccl_tests(text, name)) >= 20
    else:
        pytest.fail(f"no parser for fixture {name}")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_classes_equal_published_matrix(name):
    topo = load(fx(name))
    assert [list(r) for r in topo.classes] == classes_of(PUBLISHED[name])
    assert [g.numa_node for g in topo.gpus] == NUMA[name]


@pytest.mark.parametrize("name", sorted(set(PUBLISHED) - ANOMALOUS))
def test_inferred_tree_reproduces_published_classes(name):
    """The PCIe tree inferred from the matrix gives back every non-NVLink class."""
    topo = load(fx(name))
    n = topo.num_gpus
    for i in range(n):
        for j in range(n):
            if not topo.classes[i][j].startswith("NV"):
                assert topo.tree_class(i, j) == topo.classes[i][j], (i, j)


@pytest.mark.parametrize("name", sorted(ANOMALOUS))
def test_anomalous_matrices_are_kept_and_noted(name):
    topo = load(fx(name))
    assert any("do not fit one PCIe tree" in note for note in topo.notes)


def test_inferred_tree_shapes():
    tr = load(fx("8x-rtxpro6000-threadripper-3switch-pxb.topo.txt"))
    # Two root switches, each with two leaf switches of two GPUs.
    assert len(tr.root_ports) == 2 and len(tr.switches) == 6
    _, chain = tr.ancestry(0)
    assert len(chain) == 2 and tr.ancestry(1)[1] == chain and tr.ancestry(2)[1][0] == chain[0]
    bc = load(fx("8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.topo.txt"))
    assert len(bc.switches) == 4 and len({r.host_bridge for r in bc.root_ports}) == 4
    assert [bc.socket_of_node(g.numa_node) for g in bc.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    direct = load(fx("8x-rtxpro6000-dual-epyc9124-direct.topo.txt"))
    assert direct.switches == () and len(direct.root_ports) == 8


def test_nics_and_legend():
    l40s = load(fx("4x-l40s-dual-socket.topo.txt"))
    assert [(n.index, n.name, n.numa_node) for n in l40s.nics] == [
        (0, "mlx5_0", 1),
        (1, "mlx5_1", 1),
    ]
    assert [list(r) for r in l40s.nic_classes] == [["SYS", "SYS", "NODE", "NODE"]] * 2
    xeon = load(fx("8x-rtx4090-dual-xeon-broadcom-pix.topo.txt"))
    assert [(n.name, n.numa_node) for n in xeon.nics] == [("mlx5_bond_0", 0)]
    assert xeon.numa_nodes[0].cpus == "0-35,72-107" and xeon.numa_nodes[1].cpus == "36-71,108-143"


def test_truncated_rows_keep_complete_gpus():
    dgx = load(fx("8x-a100-dgx-nvswitch.topo.txt"))
    assert dgx.num_gpus == 4
    assert any("GPU4, GPU5, GPU6, GPU7" in note for note in dgx.notes)
    assert len(dgx.nics) == 12


def test_p2p_blocks():
    gns = load(fx("2x-rtx5090-threadripper3975wx.topo-p2p.txt"))
    assert gns.p2p_status(0, 1) == P2PStatus.DISABLED == gns.p2p_status(1, 0)
    ok = load(fx("5x-rtx50series-epyc-patched.topo-p2p.txt"))
    assert all(
        ok.p2p_status(i, j) == P2PStatus.SUPPORTED for i in range(5) for j in range(5) if i != j
    )
    plain = load(fx("4x-l40s-dual-socket.topo.txt"))
    assert plain.p2p_status(0, 1) == P2PStatus.UNKNOWN
    standalone = " \tGPU0\tGPU1\tGPU2\n GPU0\tX\tCNS\tDR\n GPU1\tCNS\tX\tU\n GPU2\tDR\tU\tX\n"
    m = parse_p2p_matrix(standalone)
    assert m[0][1] == P2PStatus.UNSUPPORTED and m[0][2] == P2PStatus.DISABLED
    assert m[1][2] == P2PStatus.UNKNOWN


def test_old_format_soc_and_markdown():
    old = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tSOC\t0-7\nGPU1\tSOC\t X \t8-15\n"
    topo = parse_topo(old, "old.txt")
    assert topo.classes[0][1] == "SYS"
    assert [g.numa_node for g in topo.gpus] == [0, 1]  # from the CPU Affinity sets
    md = load(fx("6x-rtx4090-2023-driver.topo.txt"))
    assert md.num_gpus == 6 and md.classes[3][4] == "PHB"


def test_nccl_xml_azure():
    topo = parse_xml(fx("4x-a100-pcie-azure-ncv4.nccl-topo.xml.txt").read_text(), "azure")
    assert [g.bus_id for g in topo.gpus] == [f"000{k}:00:00.0" for k in range(1, 5)]
    assert [g.numa_node for g in topo.gpus] == [0, 1, 2, 3]
    assert all(topo.classes[i][j] == "SYS" for i in range(4) for j in range(4) if i != j)
    assert all(g.link_gen is None and g.link_width is None for g in topo.gpus)  # VM: unknown
    assert [n.name for n in topo.nics] == ["eth0"]
    assert sum("nvlink to itself" in note for note in topo.notes) == 4


SWITCHED_XML = """<system version="1">
  <cpu numaid="0" affinity="0000ffff" arch="x86_64" vendor="AuthenticAMD">
    <pci busid="0000:21:00.0" class="0x060400" vendor="0x1f18" link_speed="32.0 GT/s PCIe" link_width="16">
      <pci busid="0000:24:00.0" class="0x060400" link_speed="32.0 GT/s PCIe" link_width="16">
        <pci busid="0000:25:00.0" class="0x030000" link_speed="32.0 GT/s PCIe" link_width="16">
          <gpu dev="0" sm="120" rank="0" gdr="1"/>
        </pci>
        <pci busid="0000:26:00.0" class="0x030000" link_speed="32.0 GT/s PCIe" link_width="16">
          <gpu dev="1" sm="120" rank="1" gdr="1">
            <nvlink target="0000:41:00.0" count="4" tclass="0x030000"/>
          </gpu>
        </pci>
      </pci>
      <pci busid="0000:29:00.0" class="0x060400" link_speed="16.0 GT/s PCIe" link_width="8">
        <pci busid="0000:2a:00.0" class="0x030000" link_speed="16.0 GT/s PCIe" link_width="16">
          <gpu dev="2" sm="120" rank="2" gdr="1"/>
        </pci>
      </pci>
    </pci>
    <pci busid="0000:41:00.0" class="0x030000" link_speed="32.0 GT/s PCIe" link_width="16">
      <gpu dev="3" sm="120" rank="3" gdr="1"/>
    </pci>
    <vendorthing x="1"/>
  </cpu>
</system>
"""


def test_nccl_xml_switch_hierarchy_and_nvlink():
    topo = parse_xml(SWITCHED_XML, "switched.xml")
    c = [list(r) for r in topo.classes]
    assert c[0][1] == "PIX" and c[0][2] == "PXB" and c[1][2] == "PXB"
    assert c[1][3] == c[3][1] == "NV4" and c[0][3] == "PHB"
    assert topo.gpus[2].link_gen == 4 and topo.gpus[2].link_width == 16
    assert {s.id: (s.link_gen, s.link_width) for s in topo.switches}["0000:29:00.0"] == (4, 8)


def test_json_round_trips_exactly():
    for name in [*sorted(PUBLISHED), "4x-a100-pcie-azure-ncv4.nccl-topo.xml.txt"]:
        topo = load(fx(name))
        text = topo.to_json()
        again = Topology.from_json(text, name)
        assert again == topo
        assert again.to_json() == text
        assert parse(text) == topo


def test_p2p_bandwidth_test_values():
    bc = parse_p2p_test(fx("8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx.p2p.txt").read_text())
    assert bc.get(0, 1).p2p_gbps == 51.0  # bidir 102 / 2
    assert bc.get(0, 4).p2p_gbps == 47.0 and bc.get(0, 4).p2p_us == 1.35  # Src-> columns
    old = parse_p2p_test(fx("6x-rtx4090-2023-driver.p2p.txt").read_text())
    assert old.get(0, 1).p2p_gbps == 9.90 and old.get(0, 1).staged_gbps == 20.10
    h100 = parse_p2p_test(fx("8x-h100-sxm-nvswitch.p2p.txt").read_text())
    assert h100.get(0, 6).p2p_gbps == 375.94  # the truncated row keeps what it has
    assert h100.get(0, 7).p2p_gbps is None and h100.get(1, 2).p2p_gbps is None
    assert h100.get(0, 1).p2p_possible is True
    mixed = parse_p2p_test(fx("9x-rtx5090-rtxpro6000-dual-epyc9575f-patched.p2p.txt").read_text())
    m = mixed.get(0, 1)
    assert (m.p2p_gbps, m.staged_gbps, m.p2p_us, m.staged_us) == (
        111.17 / 2,
        56.70 / 2,
        0.38,
        14.31,
    )


def test_nccl_paths_show_p2p_rerouted_through_cpu():
    paths = parse_nccl_paths(fx("8x-rtx4090-dual-xeon-broadcom-pix.nccl-paths.txt").read_text())
    # GPUs behind one switch (topo -m: PIX) appear as PHB: NCCL found P2P disabled.
    assert paths[("ce000", "cf000")] == (4, 24.0, "PHB")
    assert paths[("ce000", "4e000")] == (5, 10.0, "SYS")


def test_nccl_tests_small_message_floor():
    rows = parse_nccl_tests(fx("8x-rtx5090-dual-epyc9575f-patched.nccl-allreduce.txt").read_text())
    assert rows[0] == (8, 25.47, 0.00, 0.00)
    assert rows[-1] == (134217728, 5355.16, 25.06, 43.86)
    assert min(t for size, t, _, _ in rows) == 24.52


@pytest.mark.parametrize(
    "text, where, expected",
    [
        (
            "\tGPU0\tGPU1\nGPU0\t X \tPIZ\nGPU1\tPIX\t X \n",
            "bad.txt:2",
            "'PIZ' is not a path class",
        ),
        ("\tGPU0\tGPU1\nGPU0\t PIX \tX\nGPU1\tPIX\t X \n", "bad.txt:2", "GPU0/GPU0: expected X"),
        ("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tPXB\t X \n", "bad.txt", "a path class is symmetric"),
        (
            "\tGPU0\tGPU1\tNUMA Affinity\nGPU0\t X \tPIX\tzero\nGPU1\tPIX\t X \t0\n",
            "bad.txt:2",
            "expected a node number",
        ),
        ("# header\nhello world\n", "bad.txt", "not a topology file"),
        (
            '# h\n<system version="1">\n  <cpu numaid="0">\n</system>\n',
            "bad.txt:4",
            "mismatched tag",
        ),
        ('<system version="7"></system>\n', "bad.txt:1", "expected version 1"),
        ('<system version="1"><cpu numaid="x"/></system>\n', "bad.txt:1", "expected an integer"),
        ('{"format": "pcie_a2a.topology",\n "version": 1,,}', "bad.txt:2", "invalid JSON"),
        ('{"format": "other", "version": 1}', "bad.txt", "expected format"),
    ],
)
def test_garbled_input_names_file_line_and_expectation(tmp_path, text, where, expected):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(TopologyError) as info:
        load(path)
    msg = str(info.value)
    assert f"{tmp_path}/{where}" in msg or msg.startswith(f"{tmp_path}/{where}")
    assert expected in msg


def test_garbled_p2p_test_row():
    with pytest.raises(TopologyError, match=r"x.txt:3: row 0: 'abc' is not a number"):
        parse_p2p_test(
            "Unidirectional P2P=Enabled Bandwidth Matrix (GB/s)\n D\\D 0 1\n 0 abc 1.0\n", "x.txt"
        )
