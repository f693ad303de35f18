"""The GPU table: memory, memory bandwidth, dense tensor throughput per dtype, PCIe
generation, and where each number comes from.

Tensor throughput is the *dense* (no 2:4 sparsity) peak with fp32 accumulation, the mode
serving kernels use; a dtype the GPU has no tensor-core path for is absent (the kernels then
run that weight format on the bf16 path: FP8 weights as W8A16 Marlin on Ampere). Memory is
the marketed capacity read as GiB (the chips are binary-sized); the serving frameworks'
reserves (:mod:`.stacks`) come off it.
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

    def peak_tflops(self, dtype: str) -> float:
        table = dict(self.tflops)
        return table.get(dtype, table["bf16"])

    def has(self, dtype: str) -> bool:
        return dtype in dict(self.tflops)


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
