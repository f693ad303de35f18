"""The one GPU table: memory, memory bandwidth, dense tensor throughput per dtype, PCIe
generation, the SM count, L2 and clock the INT4 kernel's grid model needs, and where each
number comes from. ``pcie-a2a plan`` (:mod:`.configplan`), the balancer's cost
(:mod:`.balance.cost`) and the grid model (:mod:`.quant.grid_model`) all read it.

Tensor throughput is the *dense* (no 2:4 sparsity) peak with fp32 accumulation, the mode
serving kernels use; a dtype the GPU has no tensor-core path for is absent (the kernels then
run that weight format on the bf16 path: FP8 weights as W8A16 Marlin on Ampere). Memory is
the marketed capacity read as GiB (the chips are binary-sized); the serving frameworks'
reserves (:mod:`.configplan.stacks`) come off it.

The grid model's fields (``arch`` to ``dram_latency_us``) are None for a GPU whose
architecture the model has no occupancy table for. SM counts and L2 sizes are the
whitepapers'; the clock is an estimate of the sustained SM clock under a memory-bound load,
below the spec boost clock named in ``grid_source``, and the DRAM latency under load is an
estimate too (no measurement on these GPUs).

No imports from the package: scripts load the grid model, and with it this file, by path
(without torch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    memory_gib: float
    bandwidth_gbps: float  # DRAM, GB/s (1e9)
    tflops: tuple[tuple[str, float], ...]  # dense tensor TFLOPS by compute dtype
    pcie_gen: int
    p2p: str  # what the stock driver allows between two of these boards
    source: str
    names: tuple[str, ...] = ()  # substrings of the marketing name that identify it
    arch: str | None = None  # compute capability as the kernels' sm_XY
    sms: int | None = None
    l2_mb: int | None = None
    clock_ghz: float | None = None  # sustained SM clock under load (estimate)
    dram_latency_us: float | None = None  # under load (estimate)
    grid_source: str = ""

    def peak_tflops(self, dtype: str) -> float:
        table = dict(self.tflops)
        return table.get(dtype, table["bf16"])

    def has(self, dtype: str) -> bool:
        return dtype in dict(self.tflops)

    @property
    def grid_modelled(self) -> bool:
        """Whether the INT4 kernel's grid model has this GPU's SMs, L2 and clock."""
        return self.arch is not None


GPUS: dict[str, Gpu] = {
    g.key: g
    for g in (
        Gpu(
            "rtx-pro-6000",
            "NVIDIA RTX PRO 6000 Blackwell (Server / Workstation Edition)",
            96,
            1792,
            (("bf16", 500.0), ("fp8", 1000.0), ("fp4", 2000.0)),
            5,
            "supported by the stock driver",
            "NVIDIA RTX PRO 6000 Blackwell announcement (GTC 2025) and spec pages: 96 GB "
            "GDDR7 (32 x 3 GB chips, clamshell), 512-bit at 28 Gbps = 1792 GB/s, the same on "
            "all three editions; 4000 AI TOPS = FP4 with 2:4 sparsity, so dense FP4 2000, FP8 "
            "1000, BF16 500 (Blackwell tensor-core ratios 1:2:4; fp32 accumulate at full rate "
            "on the professional part); PCIe Gen5 x16",
            ("rtx pro 6000", "rtx 6000 pro", "rtxpro6000", "rtx6kpro"),
            "sm_120",
            188,
            128,
            2.4,
            0.8,
            "NVIDIA RTX Blackwell GPU architecture whitepaper / RTX PRO 6000 Blackwell spec page: "
            "188 SMs (24,064 CUDA cores), 128 MB L2, boost 2.617 GHz (2.4 sustained: estimate); "
            "GDDR7 latency under load 0.8 us (estimate)",
        ),
        Gpu(
            "rtx-5090",
            "NVIDIA GeForce RTX 5090",
            32,
            1792,
            (("bf16", 209.5), ("fp8", 419.0), ("fp4", 1676.0)),
            5,
            "disabled by the stock driver (GeForce); patched open kernel modules enable it",
            "NVIDIA RTX Blackwell GPU architecture whitepaper (RTX 5090): 32 GB GDDR7, 1792 "
            "GB/s, peak FP16/BF16 tensor with FP32 accumulate 209.5 dense, FP8 with FP32 "
            "accumulate 419 dense, 3352 AI TOPS (FP4 sparse); PCIe Gen5 x16; P2P: "
            "research/topology_numa.md (GeForce GNS)",
            ("5090",),
            "sm_120",
            170,
            96,
            2.4,
            0.8,
            "NVIDIA RTX Blackwell GPU architecture whitepaper (RTX 5090): 170 SMs (21,760 CUDA "
            "cores), 96 MB L2 (98,304 KB), boost 2.41 GHz (2.4 sustained: estimate); GDDR7 latency"
            " under load 0.8 us (estimate)",
        ),
        Gpu(
            "rtx-4090",
            "NVIDIA GeForce RTX 4090",
            24,
            1008,
            (("bf16", 165.2), ("fp8", 330.3)),
            4,
            "disabled by the stock driver (GeForce); patched open kernel modules enable it",
            "NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): 24 GB GDDR6X, 1008 GB/s, "
            "FP16/BF16 tensor with FP32 accumulate 165.2 dense, FP8 with FP32 accumulate 330.3 "
            "dense; PCIe Gen4 x16",
            ("4090",),
            "sm_89",
            128,
            72,
            2.5,
            0.8,
            "NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): 128 SMs (16,384 CUDA cores), "
            "72 MB L2 (73,728 KB), boost 2.52 GHz (2.5 sustained: estimate); GDDR6X latency under "
            "load 0.8 us (estimate)",
        ),
        Gpu(
            "l40s",
            "NVIDIA L40S",
            48,
            864,
            (("bf16", 362.05), ("fp8", 733.0)),
            4,
            "supported by the stock driver where the platform allows it",
            "NVIDIA L40S datasheet: 48 GB GDDR6 with ECC, 864 GB/s, BF16 tensor 362.05 dense "
            "(733 sparse), FP8 733 dense (1466 sparse); PCIe Gen4 x16",
            ("l40s",),
            "sm_89",
            142,
            96,
            2.4,
            0.8,
            "NVIDIA L40S datasheet / Ada whitepaper (AD102): 142 SMs (18,176 CUDA cores), 96 MB "
            "L2, boost 2.52 GHz (2.4 sustained: estimate); GDDR6 latency under load 0.8 us "
            "(estimate)",
        ),
        Gpu(
            "a6000",
            "NVIDIA RTX A6000",
            48,
            768,
            (("bf16", 154.8),),
            4,
            "supported by the stock driver",
            "NVIDIA Ampere GA102 architecture whitepaper (RTX A6000): 48 GB GDDR6, 768 GB/s, "
            "FP16/BF16 tensor with FP32 accumulate 154.8 dense (309.7 sparse); no FP8 tensor "
            "cores; PCIe Gen4 x16",
            ("a6000",),
        ),
        Gpu(
            "h100-pcie",
            "NVIDIA H100 PCIe",
            80,
            2000,
            (("bf16", 756.5), ("fp8", 1513.0)),
            5,
            "supported by the stock driver",
            "NVIDIA H100 datasheet (PCIe): 80 GB HBM2e, 2000 GB/s, BF16 tensor 1513 with "
            "sparsity (756.5 dense), FP8 3026 with sparsity (1513 dense); PCIe Gen5 x16",
            ("h100 pcie", "h100-pcie", "h100"),
            "sm_90",
            114,
            50,
            1.6,
            0.7,
            "NVIDIA H100 Tensor Core GPU architecture whitepaper (H100 PCIe): 114 SMs (14,592 CUDA"
            " cores), 50 MB L2, boost 1.755 GHz (1.6 sustained: estimate); HBM latency under load "
            "0.7 us (estimate)",
        ),
        Gpu(
            "h200",
            "NVIDIA H200 (SXM)",
            141,
            4800,
            (("bf16", 989.5), ("fp8", 1979.0)),
            5,
            "supported by the stock driver (NVLink/NVSwitch on HGX boards)",
            "NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, BF16 tensor 1979 with "
            "sparsity (989.5 dense), FP8 3958 with sparsity (1979 dense); PCIe Gen5 x16 host "
            "link",
            ("h200",),
            "sm_90",
            132,
            50,
            1.8,
            0.7,
            "NVIDIA H100 Tensor Core GPU architecture whitepaper (H100 SXM5, the die the H200 "
            "shares): 132 SMs (16,896 CUDA cores), 50 MB L2, boost 1.98 GHz (1.8 sustained: "
            "estimate); HBM latency under load 0.7 us (estimate)",
        ),
    )
}


def get_gpu(key: str) -> Gpu:
    k = key.lower()
    if k in GPUS:
        return GPUS[k]
    raise ValueError(f"--gpu: got {key!r}; allowed: {', '.join(GPUS)}")


def identify(name: str | None) -> Gpu | None:
    """The table entry whose marketing name matches a topology's GPU name, if any."""
    if not name:
        return None
    n = name.lower()
    for g in GPUS.values():
        if any(s in n for s in g.names):
            return g
    return None
