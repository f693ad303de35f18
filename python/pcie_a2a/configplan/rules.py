"""Which configurations a framework can launch, and why not.

Model rules hold for both frameworks (a split must divide what it splits). SGLang
(0.5.23) and vLLM (0.33.0) rules are each framework's own, with the file that enforces
them named in the reason. The pcie_a2a rules are this package's integration limits
(docs/sglang.md, docs/vllm.md).
"""

from __future__ import annotations

from .configs import Config
from .models import ModelShape

FRAMEWORKS = ("sglang", "vllm")


def model_reasons(cfg: Config, model: ModelShape, gpus_available: int) -> list[str]:
    out = []
    if cfg.gpus > gpus_available:
        out.append(f"needs {cfg.gpus} GPUs, {gpus_available} available")
    if cfg.tp % cfg.attn_dp:
        out.append(
            f"DP attention size {cfg.attn_dp} must divide the TP size {cfg.tp} "
            "(SGLang arg_groups/parallel_hook.py: tp_size % attn_dp_size == 0)"
        )
    if cfg.tp % cfg.ep:
        out.append(
            f"EP nests inside TP: ep_size {cfg.ep} must divide tp_size {cfg.tp} (SGLang "
            "moe_ep_setup.py: 'tp_size must be divisible by ep_size')"
        )
    if cfg.pp > model.layers:
        out.append(f"pp {cfg.pp} > {model.layers} layers")
    if out:
        return out
    at = cfg.attn_tp
    if model.heads % at:
        out.append(f"{model.heads} attention heads do not split over attention TP {at}")
    if model.attention == "gqa" and model.kv_heads % at and at % model.kv_heads:
        out.append(
            f"{model.kv_heads} KV heads: attention TP {at} must divide them or be a multiple of them"
        )
    slots = model.experts + cfg.redundant
    if cfg.ep > 1 and slots % cfg.ep:
        out.append(
            f"{model.experts} experts"
            + (f" + {cfg.redundant} redundant" if cfg.redundant else "")
            + f" do not split evenly over EP {cfg.ep}"
        )
    mt = cfg.moe_tp
    inter = model.moe_intermediate
    if inter % mt:
        out.append(f"moe_intermediate_size {inter} does not split over MoE TP {mt}")
    else:
        f = model.fmt("experts")
        if f.kind == "fp8" and (inter // mt) % 128:
            out.append(
                f"block-FP8 experts: moe_intermediate_size / MoE TP = {inter // mt} is not a "
                "multiple of the 128 weight block (SGLang moe_ep_setup.py, vLLM fp8 block check)"
            )
        if f.kind == "int4" and ((inter // mt) % 64 or (f.group > 0 and (inter // mt) % f.group)):
            out.append(
                f"INT4 experts: the MoE TP slice {inter // mt} of the intermediate size must be a "
                f"multiple of 64 (Marlin tiles) and of the group size {f.group}"
            )
    if cfg.redundant and cfg.ep == 1:
        out.append("redundant experts need expert parallelism (ep > 1)")
    if cfg.dcp > 1:
        if cfg.attn_tp % cfg.dcp:
            out.append(
                f"DCP {cfg.dcp} must divide the attention TP size {cfg.attn_tp} (vLLM "
                "config/parallel.py: 'tp_size must be divisible by dcp_size')"
            )
        if model.attention != "mla":
            out.append("DCP is planned for MLA models only (the cache TP replicates)")
        if cfg.attn_dp > 1 or cfg.pp > 1:
            out.append("not planned: DCP together with DP attention or pipeline stages")
    return out


def sglang_reasons(cfg: Config) -> list[str]:
    out = []
    if cfg.comm == "a2a-nccl":
        out.append(
            "SGLang 0.5.23 has no NCCL all-to-all MoE backend (--moe-a2a-backend choices: none, "
            "deepep, mooncake, nixl, mori, ...; deepep needs NVLink or RDMA and DeepGEMM, SM90+)"
        )
    # pcie_a2a with TP attention is valid: SGLang scatters the batch over the TP ranks for
    # an a2a backend (LayerCommunicator), which the prediction's ceil(tokens / tp) per rank is.
    if cfg.comm in ("ag-rs", "a2a-nccl") and cfg.attn_dp == 1:
        out.append(
            f"{cfg.comm} is planned with DP attention: with TP attention every rank holds every "
            "token (that is the 'allreduce' configuration)"
        )
    if cfg.comm == "allreduce" and cfg.attn_dp > 1:
        out.append("all-reduce EP is the TP-attention layout; with DP attention it is AG/RS")
    if cfg.attn_dp > 1 and cfg.pp > 1:
        out.append("not planned: DP attention together with pipeline parallelism")
    # redundant experts are accepted under pcie: SGLang's physical ids with pcie_a2a's
    # placement file or --eplb-algorithm pcie_a2a (integrations/sglang/launch.py)
    if cfg.comm == "pcie_a2a" and cfg.ep != cfg.tp:
        out.append("--moe-a2a-backend pcie sets ep_size = tp_size (docs/sglang.md)")
    return out


def vllm_reasons(cfg: Config) -> list[str]:
    out = []
    if cfg.ep > 1 and cfg.ep != cfg.tp:
        out.append(
            f"vLLM's expert parallelism spans TP x DP (EP = {cfg.tp}); it has no MoE TP inside "
            f"EP, so EP {cfg.ep} with MoE TP {cfg.moe_tp} cannot be expressed"
        )
    if cfg.comm == "a2a-nccl":
        out.append(
            "vLLM 0.33 has no plain NCCL all-to-all backend (naive was removed; "
            "--all2all-backend nccl_alltoall is vllm-project/vllm#42254, open)"
        )
    if cfg.comm == "allreduce" and cfg.attn_dp > 1:
        out.append(
            "with --data-parallel-size > 1 vLLM's EP uses an all2all backend, not all-reduce"
        )
    if cfg.comm in ("ag-rs", "pcie_a2a") and cfg.attn_dp == 1:
        out.append(
            "vLLM uses an all2all backend (and so pcie_a2a) only with --data-parallel-size > 1: "
            "TP-only EP all-reduces (vllm fused_moe config.py use_all2all_kernels; docs/vllm.md)"
        )
    if cfg.comm == "pcie_a2a" and cfg.redundant:
        out.append(
            "PCIE_A2A_VLLM=1 refuses EPLB / redundant experts: vLLM 0.33's EPLB policy is "
            "fixed ('default'), with no hook for pcie_a2a's placement (docs/vllm.md)"
        )
    return out


def reasons(cfg: Config, model: ModelShape, gpus_available: int) -> dict[str, list[str]]:
    """framework -> reasons it cannot launch ``cfg`` (empty list: it can)."""
    base = model_reasons(cfg, model, gpus_available)
    return {"sglang": base + sglang_reasons(cfg), "vllm": base + vllm_reasons(cfg)}
