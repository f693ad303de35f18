"""Launch command lines for SGLang (0.5.23) and vLLM (0.33.0), with pcie_a2a's switches
where a configuration uses it (docs/sglang.md: ``--moe-a2a-backend pcie``; docs/vllm.md:
``PCIE_A2A_VLLM=1`` with ``--enable-expert-parallel`` and ``--data-parallel-size``)."""

from __future__ import annotations

import json
import shlex

from .configs import Config
from .memory import PCIE_A2A_MAX_TOKENS, a2a_tokens_per_rank

#: where a pcie_a2a launch line with redundant experts reads its placement; written by
#: ``pcie-a2a balance --load FILE --redundant N --sglang-out PCIE_A2A_PLACEMENT_FILE``
PCIE_A2A_PLACEMENT_FILE = "init_expert_location.json"


def _model_arg(model_id: str) -> str:
    return shlex.quote(model_id)


def sglang(cfg: Config, model_id: str, context: int, kv_fp8: bool, chunk: int, stack=None) -> str:
    """``context``: the longest request (prompt + output), SGLang's --context-length."""
    env = list(stack.env) if stack is not None else []
    args = ["python -m sglang.launch_server", "--model-path", _model_arg(model_id)]
    args += ["--trust-remote-code", "--tp-size", str(cfg.tp)]
    if cfg.pp > 1:
        args += ["--pp-size", str(cfg.pp)]
    if cfg.attn_dp > 1:
        # docs/sglang.md; SGLang 0.5.23 also accepts --attn-dp-size N for the same layout
        args += ["--dp-size", str(cfg.attn_dp), "--enable-dp-attention"]
    if cfg.comm == "pcie_a2a":
        args += ["--moe-a2a-backend", "pcie", "--disable-shared-experts-fusion"]
        args += ["--disable-cuda-graph"]  # the backend reads counts on the host (docs/sglang.md)
        if cfg.payload == "fp8":
            env.append("PCIE_A2A_PAYLOAD=fp8")
        per_rank = a2a_tokens_per_rank("sglang", cfg, chunk)
        if per_rank > PCIE_A2A_MAX_TOKENS:
            env.append(f"PCIE_A2A_MAX_TOKENS_PER_RANK={per_rank}")
        if cfg.redundant:  # the placement file: `pcie-a2a balance --sglang-out` (docs/balance.md)
            args += ["--ep-num-redundant-experts", str(cfg.redundant)]
            args += ["--init-expert-location", PCIE_A2A_PLACEMENT_FILE]
    elif cfg.ep > 1:
        args += ["--ep-size", str(cfg.ep)]
        if cfg.redundant:
            args += ["--ep-num-redundant-experts", str(cfg.redundant)]
    if context:
        args += ["--context-length", str(context)]
    if cfg.dcp > 1:
        args += ["--dcp-size", str(cfg.dcp)]
    if kv_fp8 or cfg.kv_fp8:
        args += ["--kv-cache-dtype", "fp8_e4m3"]
    if stack is not None:
        if not stack.cuda_graphs and cfg.comm != "pcie_a2a":
            args += ["--disable-cuda-graph"]
        args += list(stack.flags.get("sglang", ()))
    return " ".join(env + args)


def vllm(cfg: Config, model_id: str, context: int, kv_fp8: bool, chunk: int, stack=None) -> str:
    """``context``: the longest request (prompt + output), vLLM's --max-model-len."""
    env = list(stack.env) if stack is not None else []
    args = ["vllm serve", _model_arg(model_id), "--trust-remote-code"]
    args += ["--tensor-parallel-size", str(cfg.attn_tp)]
    if cfg.pp > 1:
        args += ["--pipeline-parallel-size", str(cfg.pp)]
    if cfg.attn_dp > 1:
        args += ["--data-parallel-size", str(cfg.attn_dp)]
    if cfg.ep > 1:
        args += ["--enable-expert-parallel"]
    if cfg.comm == "pcie_a2a":
        env.append("PCIE_A2A_VLLM=1")
        if cfg.payload == "fp8":
            env.append("PCIE_A2A_PAYLOAD=fp8")
        if chunk > PCIE_A2A_MAX_TOKENS:
            env.append(f"PCIE_A2A_MAX_TOKENS_PER_RANK={chunk}")
        args += ["--enforce-eager"]  # host-side counts, no CUDA graphs (docs/vllm.md)
    elif cfg.redundant:
        eplb = json.dumps({"num_redundant_experts": cfg.redundant})
        args += ["--enable-eplb", "--eplb-config", shlex.quote(eplb)]
    if context:
        args += ["--max-model-len", str(context)]
    if cfg.dcp > 1:
        args += ["--decode-context-parallel-size", str(cfg.dcp)]
    if kv_fp8 or cfg.kv_fp8:
        args += ["--kv-cache-dtype", "fp8"]
    if stack is not None:
        if not stack.cuda_graphs and cfg.comm != "pcie_a2a":
            args += ["--enforce-eager"]
        args += list(stack.flags.get("vllm", ()))
    return " ".join(env + args)


def commands(
    cfg: Config, model_id: str, context: int, kv_fp8: bool, chunks: dict, stack=None
) -> dict:
    """Both frameworks' lines with what the stack's numbers assume (its environment and
    flags); ``context`` is prompt + output tokens."""
    return {
        "sglang": sglang(cfg, model_id, context, kv_fp8, chunks["sglang"], stack),
        "vllm": vllm(cfg, model_id, context, kv_fp8, chunks["vllm"], stack),
    }
