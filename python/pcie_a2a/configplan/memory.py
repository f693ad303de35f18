"""Memory per GPU: weights, communication buffers, activations, KV cache -> fits or not,
and how many requests of a given context the KV cache holds.

Weights per GPU follow the layouts of :mod:`.configs`: attention, shared expert, dense MLPs,
embedding and LM head are split over the attention TP group (replicated across DP-attention
groups); routed experts are split over EP ranks (E / ep each, plus redundant slots) and over
MoE TP. The busiest pipeline stage counts (the most layers, and the embedding or LM head).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pcie_a2a.buffer_memory import transport_memory

from ..gpus import Gpu
from .configs import Config
from .models import ModelShape
from .stacks import GIB, Stack

# Fixed per-GPU allowances (assumed, small next to the weights of these models).
NCCL_BUFFERS = 0.5 * GIB  # "assumed: NCCL channel buffers of the TP/EP/PP communicators"
CUDA_GRAPHS = 1.0 * GIB  # "assumed: CUDA-graph pools (vLLM counts them in its budget)"
ACTIVATION_COPIES = 12  # "assumed: live [tokens, hidden] bf16 tensors at the peak of a step"
PCIE_A2A_MAX_TOKENS = 4096  # PCIE_A2A_MAX_TOKENS_PER_RANK default (docs/sglang.md)


@dataclass(frozen=True)
class Memory:
    weights: float  # bytes per GPU
    buffers: float
    activations: float
    budget: float
    budget_note: str
    kv_per_request: float  # bytes on the GPU holding it, at the planned context
    kv_free: float
    max_requests: int  # across the whole configuration (all DP groups)

    @property
    def fits(self) -> bool:
        return self.max_requests >= 1

    def summary(self) -> str:
        g = GIB
        s = (
            f"weights {self.weights / g:.1f} + buffers {self.buffers / g:.1f} + activations "
            f"{self.activations / g:.1f} GiB of {self.budget / g:.1f} ({self.budget_note})"
        )
        if self.fits:
            return s + f"; KV {self.kv_free / g:.1f} GiB holds {self.max_requests} requests"
        return s + f": out of memory by {-self.kv_free / g:.1f} GiB"


def buffer_bytes(world: int, tokens: int, hidden: int, topk: int, payload: str) -> int:
    """Device bytes of one rank's pcie_a2a Buffer on CUDA: the formula its allocator uses
    (:func:`pcie_a2a.buffer_memory.transport_memory`, as ``Buffer.memory_bytes()``), for
    the largest layout (every P2P pair pulled, copy engine at its default threshold)."""
    return transport_memory(
        "cuda", world, hidden, tokens, topk, payload, with_pull=True
    ).device_bytes


def a2a_tokens_per_rank(framework: str, cfg: Config, chunk: int) -> int:
    """Tokens one rank passes to dispatch in a prefill chunk: SGLang divides the chunk over
    its DP ranks, and with TP attention scatters it over the TP ranks before the MoE; vLLM's
    DP engines each take a whole chunk."""
    if framework != "sglang":
        return chunk
    return -(-chunk // (cfg.attn_dp if cfg.attn_dp > 1 else cfg.tp))


def pcie_a2a_tokens(stack: Stack, cfg: Config, chunk: int) -> int:
    """Tokens per rank pcie_a2a's buffers are sized for: the default, raised to what one
    rank passes in a prefill chunk, as the launch lines set PCIE_A2A_MAX_TOKENS_PER_RANK."""
    return max(PCIE_A2A_MAX_TOKENS, a2a_tokens_per_rank(stack.framework, cfg, chunk))


def stage_layers(model: ModelShape, pp: int) -> list[tuple[int, int]]:
    """(layers, MoE layers) per stage: contiguous, the remainder to the first stages; the
    dense layers come first (DeepSeek/Kimi/GLM put them at the bottom)."""
    base, rem = divmod(model.layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < rem else 0)
        dense = max(0, min(model.dense_layers - start, n))
        out.append((n, n - dense))
        start += n
    return out


def dense_split(cfg: Config, framework: str) -> int:
    """GPUs the shared expert and LM head are split over. SGLang with DP attention and the
    MoE on all-gathered tokens (a2a none) runs them on the gathered batch split over the
    whole TP group (its DeepSeek model: shared experts and the vocab-parallel LM head use
    the tp group); vLLM, and SGLang under an a2a backend, keep them per attention group."""
    if framework == "sglang" and cfg.attn_dp > 1 and cfg.comm == "ag-rs":
        return cfg.tp
    return cfg.attn_tp


def weights_per_gpu(model: ModelShape, cfg: Config, stage: int, framework: str = "vllm") -> float:
    n, n_moe = stage_layers(model, cfg.pp)[stage]
    at = cfg.attn_tp
    ds = dense_split(cfg, framework)
    w = n * model.attention_bytes(at)
    slots = (model.experts + cfg.redundant) / cfg.ep if cfg.ep > 1 else model.experts
    w += n_moe * (slots * model.expert_bytes() / cfg.moe_tp + model.router_bytes())
    if model.shared_intermediate:
        w += n_moe * model.mlp_bytes(model.shared_intermediate, "shared") / ds
    w += (n - n_moe) * model.mlp_bytes(model.dense_intermediate, "dense") / at
    if stage == 0:
        w += model.embedding_bytes() / at
    if stage == cfg.pp - 1 and not model.tie_embeddings:
        w += model.lm_head_bytes() / ds
    return w + model.extra_weight_bytes


def memory(
    model: ModelShape,
    cfg: Config,
    gpu: Gpu,
    stack: Stack,
    context: int,
    kv_bytes: float,
    framework: str | None = None,
) -> Memory:
    """Per GPU on the busiest stage, in ``framework``'s layout and budget (default: the
    stack's own)."""
    if framework is not None and framework != stack.framework:
        stack = replace(stack, framework=framework)
    budget, note = stack.memory_budget(gpu, cfg)
    chunk, _ = stack.prefill_chunk(gpu)
    worst = None
    for s in range(cfg.pp):
        n = stage_layers(model, cfg.pp)[s][0]
        weights = weights_per_gpu(model, cfg, s, stack.framework)
        buffers = NCCL_BUFFERS
        if cfg.comm == "pcie_a2a":
            buffers += buffer_bytes(
                cfg.ep, pcie_a2a_tokens(stack, cfg, chunk), model.hidden, model.top_k, cfg.payload
            )
        tokens = max(chunk // cfg.attn_dp, 1)
        act = ACTIVATION_COPIES * tokens * model.hidden * 2.0
        act += tokens * model.top_k * 2 * model.moe_intermediate / cfg.moe_tp * 2.0 * 2
        if stack.activations_in_budget:
            act += CUDA_GRAPHS
        else:
            act = 0.0  # inside SGLang's reserve
        kvb = 1.0 if cfg.kv_fp8 else kv_bytes
        per_req = max(context, 1) * n * model.kv_bytes_per_token(cfg.attn_tp, kvb) / cfg.dcp
        free = budget - weights - buffers - act
        reqs = int(free // per_req) * cfg.attn_dp if free > 0 else 0
        m = Memory(weights, buffers, act, budget, note, per_req, free, reqs)
        if worst is None or (m.max_requests, m.kv_free) < (worst.max_requests, worst.kv_free):
            worst = m
    assert worst is not None
    return worst


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else a
