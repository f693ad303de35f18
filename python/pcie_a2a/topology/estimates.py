"""Planning numbers: what one pair can expect, and what a shared link can carry.

Every bandwidth is GB/s (1e9 B/s) *per direction with both directions busy*, because an
all-to-all keeps both directions of every link loaded; that is half of the bidirectional
figure of p2pBandwidthLatencyTest. Latencies are the p2pBandwidthLatencyTest write latency.
Sources are the public measurements collected in shared/research/topology_numa.md
(section 3); a measured probe (:mod:`.probe`) replaces them per pair.
"""

from __future__ import annotations

# (GB/s, µs) for direct P2P, by PCIe generation and path class.
P2P_TABLE: dict[int, dict[str, tuple[float, float]]] = {
    5: {
        # Broadcom PEX890xx (ACS off) 102-104 GB/s bidir, 0.71-0.74 µs; Microchip
        # Switchtec 103-105, 0.45-0.53 (voipmonitor/rtx6kpro asus-esc8000a-e13p and
        # wrx90-cpayne-microchip-switches pages).
        "PIX": (51.5, 0.6),
        # Microchip root+leaf switches, cross-leaf: 103-105 bidir, 0.45-0.53 µs (same page).
        "PXB": (51.5, 0.5),
        # 9x RTX 5090/PRO 6000 on 2x EPYC 9575F, patched driver: 110.8-111.5 bidir,
        # 0.35-0.45 µs (aikitoria/open-gpu-kernel-modules README).
        "PHB": (55.5, 0.4),
        # 2x EPYC 9124 direct attach, same socket: 112.3 bidir, 0.44-0.45 µs
        # (rtx6kpro epyc9124-direct-attach).
        "NODE": (56.0, 0.45),
        # Cross socket: 75-88 bidir on 2x Genoa, 93-96 on the Broadcom Turin box, 64 on
        # 2x EPYC 9374F; 0.5 µs (Genoa) to 1.36 µs (Broadcom) (same pages).
        "SYS": (40.0, 1.0),
    },
    4: {
        # 6x RTX 4090 tinybox, patched driver: 50.1-51.2 bidir (tinygrad open-gpu-kernel-
        # modules README). No public Gen4 latency: hop latency does not depend on the lane
        # rate (~0.4-0.5 µs per hop class in every Gen5 source), so the Gen5 values are used.
        "PIX": (25.0, 0.6),
        "PXB": (25.0, 0.5),
        "PHB": (25.0, 0.4),
        "NODE": (25.0, 0.45),
        # No public Gen4 cross-socket P2P figure: Gen5's SYS/NODE ratio (40/56) applied.
        "SYS": (18.0, 1.0),
    },
    3: {
        # No public PCIe 3.0 P2P measurement in our notes: Gen4 halved (the lane rate).
        "PIX": (12.5, 0.6),
        "PXB": (12.5, 0.5),
        "PHB": (12.5, 0.4),
        "NODE": (12.5, 0.45),
        "SYS": (9.0, 1.0),
    },
}

# (GB/s, µs) for host-staged copies (P2P off), by PCIe generation, any path class.
STAGED_TABLE: dict[int, tuple[float, float]] = {
    # 9x RTX 5090/PRO 6000, 2x EPYC 9575F, P2P=Disabled: 56.3-57.5 bidir, 14.0-14.4 µs
    # (aikitoria README). Unidirectional is 43: the host side limits once both directions run.
    5: (28.5, 14.0),
    # 6x RTX 4090, P2P off: 21-30.6 bidir (NVIDIA/nccl#814); 3x RTX 4090: 25.6-26.2
    # (tinygrad/open-gpu-kernel-modules#6). Latency: the Gen5 figure (no Gen4 source).
    4: (13.0, 14.0),
    # 8x RTX 3090, PCIe 3.0, P2P off: 6.1-8.6 bidir, 11.6-20.7 µs (NVIDIA/nccl#1127).
    3: (4.3, 15.0),
}

# NVLink: HGX H100 NV18 measured 371-377 GB/s unidirectional (NVIDIA/nccl#1264), about
# 20.8 per link. Latency: no figure in our notes; taken as a PCIe P2P write.
NVLINK_GBPS_PER_LINK = 20.8
NVLINK_US = 0.5

# Capacity of one x16 link per direction, by generation. Gen5: all cross-switch flows behind
# a flat switch share ~53 GB/s (one x16 uplink; rtx6kpro wrx90-cpayne-2switch-flat).
# Gen4: ~25 (tinybox bidir/2). Gen3: Gen4 halved. Narrower links scale by width/16.
LINK_X16_GBPS: dict[int, float] = {3: 12.5, 4: 25.0, 5: 53.0}

# The CPU socket interconnect, per direction. Derived from the 2x EPYC 9124 direct-attach box:
# 184.6 GB/s aggregate with all 8 GPUs reading all peers, 32 of the 56 flows crossing sockets,
# so ~105 GB/s over the socket link, ~53 per direction; rounded down to 50 because that box
# had only 4 of 24 DDR5 channels populated and other boxes were lower (rtx6kpro pages).
SOCKET_LINK_GBPS = 50.0


def clamp_gen(gen: int) -> int:
    """Generations without a table row use the nearest one (Gen6 plans as Gen5)."""
    return min(max(gen, 3), 5)


def p2p_estimate(gen: int, path_class: str) -> tuple[float, float]:
    if path_class.startswith("NV") and path_class[2:].isdigit():
        return NVLINK_GBPS_PER_LINK * int(path_class[2:]), NVLINK_US
    return P2P_TABLE[clamp_gen(gen)][path_class]


def staged_estimate(gen: int) -> tuple[float, float]:
    return STAGED_TABLE[clamp_gen(gen)]


def link_capacity(gen: int, width: int | None) -> float:
    return LINK_X16_GBPS[clamp_gen(gen)] * (width or 16) / 16
