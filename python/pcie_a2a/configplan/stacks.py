"""Serving stacks: the framework defaults a stack runs with (sourced) and its per-step
overhead (fitted on the calibration numbers only; :mod:`.calibrate`).

The overhead a stack adds on top of the physical terms has two constants, each a time with a
meaning:

* ``layer_us``: per decoder layer and step, the floors of the layer's small kernels
  (launches or graph nodes, norms, rope, quantise, sampling share) that bytes and FLOPs do
  not account for;
* ``expert_us``: per expert GEMM a GPU runs in a layer (each distinct local expert, or each
  expert slice under MoE TP): the per-expert setup and tail of the MoE kernel.

``vllm-tuned`` keeps ``expert_us`` at 0: its fused Marlin MoE schedules all experts of a
layer in one grid (research/marlin_anchors.md s1, item 4), and its two calibration numbers
(TP8 at C = 1 and 128) cannot tell a per-expert cost from bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .configs import Config
from .gpus import Gpu

GIB = float(1 << 30)


@dataclass(frozen=True)
class CalPoint:
    config: Config
    concurrency: int | None  # None: the peak over concurrency
    tok_s: float
    source: str


_STOCK_SRC = (
    "the measurements that started this project: Kimi K2.6 INT4, 8x RTX PRO 6000, SGLang "
    "stock settings (research/field_2026.md s1; DESIGN.md s1). EP8 taken as --tp 8 --ep 8 "
    "with --moe-a2a-backend none, the EP that runs on these boxes (field_2026.md s1)"
)
_TUNED_SRC = (
    "local-inference-lab/rtx6kpro models/kimi-k26-v4.md (2026-05), Kimi K2.6 INT4, 8x RTX "
    "PRO 6000, vLLM TP8, PCIe custom all-reduce up to ~56 KB, patched NCCL, CUDA graphs, no "
    "MTP, context ~0 (research/field_2026.md s1)"
)


@dataclass(frozen=True)
class Stack:
    name: str
    framework: str  # sglang | vllm
    description: str
    allreduce: str  # nccl | tuned
    points: tuple[CalPoint, ...]
    fit_expert: bool
    layer_us: float = 0.0
    expert_us: float = 0.0
    fitted: bool = False
    residuals: tuple[tuple[str, float, float], ...] = ()  # (point, measured, predicted)

    def with_fit(self, layer_us: float, expert_us: float, residuals) -> Stack:
        return replace(
            self, layer_us=layer_us, expert_us=expert_us, fitted=True, residuals=tuple(residuals)
        )

    # ---- framework defaults -------------------------------------------------------------
    def max_batch(self, gpu: Gpu, cfg: Config) -> tuple[int, str]:
        """Most running requests per DP group the stack batches by default."""
        if self.framework == "sglang":
            mem = gpu.memory_gib
            if mem < 20:
                bs = 8
            elif mem < 60:
                bs = 160 if cfg.tp >= 4 else (48 if mem < 35 else 32)
            elif mem < 160:
                bs = 512 if cfg.tp >= 4 else 256
            else:
                bs = 512
            return bs, "SGLang 0.5.23 arg_groups/memory_hook.py: decode CUDA-graph max batch"
        bs = 1024 if gpu.memory_gib >= 70 else 256
        return bs, "vLLM 0.33.0 engine/arg_utils.py: default max_num_seqs (server)"

    def prefill_chunk(self, gpu: Gpu) -> tuple[int, str]:
        if self.framework == "sglang":
            mem = gpu.memory_gib
            n = 2048 if mem < 20 else 4096 if mem < 60 else 8192 if mem < 160 else 16384
            return n, "SGLang 0.5.23 arg_groups/memory_hook.py: chunked_prefill_size"
        n = 8192 if gpu.memory_gib >= 70 else 2048
        return n, "vLLM 0.33.0 engine/arg_utils.py: default max_num_batched_tokens (server)"

    def memory_budget(self, gpu: Gpu, cfg: Config) -> tuple[float, str]:
        """Bytes per GPU for weights, buffers and KV cache, and how it was computed."""
        total = gpu.memory_gib * GIB
        if self.framework == "sglang":
            chunk, _ = self.prefill_chunk(gpu)
            reserve = 512 + max(chunk, 2048) * 1.5 + cfg.tp * cfg.pp / 8 * 1024  # MiB
            if gpu.memory_gib > 60:
                reserve = max(reserve, 10 * 1024)
            return total - reserve * (1 << 20), (
                f"{gpu.memory_gib:g} GiB less SGLang's reserve {reserve / 1024:.1f} GiB "
                "(arg_groups/memory_hook.py: mem_fraction_static)"
            )
        return 0.9 * total, (
            f"0.9 x {gpu.memory_gib:g} GiB (vLLM --gpu-memory-utilization default 0.9)"
        )

    @property
    def activations_in_budget(self) -> bool:
        """vLLM's budget also holds the profiled activations; SGLang's reserve does."""
        return self.framework == "vllm"


def _k(tp: int, **kw) -> Config:
    return Config(tp, **kw)


STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        Stack(
            "sglang-stock",
            "sglang",
            "SGLang, stock settings: NCCL all-reduce (custom all-reduce is off above 2 PCIe "
            "GPUs, research/field_2026.md s2), CUDA graphs",
            "nccl",
            (
                CalPoint(_k(8), 1, 26.0, _STOCK_SRC),
                CalPoint(_k(8, ep=8, comm="allreduce"), 1, 65.0, _STOCK_SRC),
                CalPoint(_k(8, ep=8, comm="allreduce"), None, 961.0, _STOCK_SRC),
            ),
            fit_expert=True,
        ),
        Stack(
            "vllm-tuned",
            "vllm",
            "vLLM, community-tuned: PCIe custom all-reduce up to ~56 KB, patched NCCL above, "
            "CUDA graphs",
            "tuned",
            (
                CalPoint(_k(8), 1, 92.4, _TUNED_SRC),
                CalPoint(_k(8), 128, 2222.6, _TUNED_SRC),
            ),
            fit_expert=False,
        ),
    )
}


def get_stack(name: str) -> Stack:
    if name not in STACKS:
        raise ValueError(f"--stack: got {name!r}; allowed: {', '.join(STACKS)}")
    return STACKS[name]
