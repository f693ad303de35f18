"""SGLang's real MoE blocks on CPU gloo ranks: server state, weights, one layer's boundary.

Imported by tests/framework/test_sglang_models.py in the pytest process and in the
spawned ranks. What is SGLang's own here: argument parsing and resolution (with our
plugin's resolution hook), ``publish``, the parallel groups, the MoE blocks (router,
``FusedMoE``, dispatcher, shared experts), the layer boundary that moves rows before and
after the FFN and decides which sums are owed. What is the test's:

* ``honest_experts``: SGLang's CPU expert loop (``moe_forward_native``) scatters ``-1``
  ids and so cannot run expert parallel; this stand-in computes the same SiLU MLP over
  the layer's *local* experts and skips ``-1`` (fp32 accumulate, like the reference);
* platform shims for a machine without an accelerator: SGLang's group collectives take
  their CPU branch and the DP gather its CPU copy (``_is_cpu``, normally set by SGLang's
  CPU engine, which needs ``sgl_kernel``), the standard dispatcher's expert map lives on "cpu", the DP
  gather buffers are sized for CPU bf16, and Qwen2-MoE's Triton shared-expert gate kernel
  is replaced by its torch form;
* a stand-in attention (identity, returned as the partial sum the boundary expects).
"""

from __future__ import annotations

import json
import os
import zlib

DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "rope_theta": 10000.0,
}
GLM4_MOE = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "partial_rotary_factor": 0.5,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "use_qk_norm": False,
}
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "mlp_only_layers": [],
}

#: family -> (config, "module.Class" of its MoE block, shared-expert attribute or None)
FAMILIES = {
    "deepseek_v3": (DEEPSEEK, "deepseek_v2.DeepseekV2MoE", "shared_experts"),
    "qwen2_moe": (QWEN2_MOE, "qwen2_moe.Qwen2MoeSparseMoeBlock", "shared_expert"),
    "glm4_moe": (GLM4_MOE, "glm4_moe.Glm4MoeSparseMoeBlock", "shared_experts"),
    "qwen3_moe": (QWEN3_MOE, "qwen3_moe.Qwen3MoeSparseMoeBlock", None),
}


def write_model_dir(root: str, config: dict, name: str) -> str:
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def honest_experts(layer, x, topk_output, moe_runner_config):
    """Test-only stand-in for SGLang's ``moe_forward_native``: SiLU MLP over the layer's
    local experts, ``-1`` ids skipped, fp32 accumulation."""
    import torch

    if moe_runner_config.activation != "silu":
        raise ValueError(f"honest_experts: activation {moe_runner_config.activation}")
    w, ids, _ = topk_output
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = layer.w2_weight.shape[2]
    for e in range(layer.w13_weight.shape[0]):
        r, k = torch.nonzero(ids == e, as_tuple=True)
        if r.numel() == 0:
            continue
        gu = x[r].float() @ layer.w13_weight[e].float().T
        y = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ layer.w2_weight[e].float().T
        out.index_add_(0, r, y * w[r, k].float().unsqueeze(1))
    return out.to(x.dtype)


def _gate_sigmoid_mul_add(x, gate_weight, shared, out):
    """Torch form of Qwen2-MoE's Triton ``fused_gate_sigmoid_mul_add`` (in place)."""
    import torch

    gate = torch.sigmoid(x.float() @ gate_weight.float()).unsqueeze(-1)
    out.add_((gate * shared.float()).to(out.dtype))
    return out


def cpu_shims() -> None:
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention
    from sglang.srt.layers.moe import fused_moe_native
    from sglang.srt.layers.moe.token_dispatcher import standard
    from sglang.srt.models import qwen2_moe

    parallel_state._is_cpu = True
    dp_attention._is_cpu = True
    dp_attention.memcpy_func = dp_attention.memcpy_cpu
    standard.get_device = lambda *a, **k: "cpu"
    fused_moe_native.moe_forward_native = honest_experts
    qwen2_moe.fused_gate_sigmoid_mul_add = _gate_sigmoid_mul_add


def load_plugins_quietly() -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()


def server_state(rank: int, world: int, model_dir: str, backend: str, dp: bool, extra=()):
    """Parses, resolves and publishes server arguments the way a scheduler does, then
    builds SGLang's parallel groups on the gloo world the test already created."""
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    argv = [
        "--model-path",
        model_dir,
        "--tp-size",
        str(world),
        "--moe-a2a-backend",
        backend,
        "--device",
        "cpu",
        "--skip-tokenizer-init",
        "--ep-size",
        str(world),
        *extra,
    ]
    if dp:
        argv += ["--dp-size", str(world), "--enable-dp-attention"]
    args = prepare_server_args(argv)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=None))
    init_distributed_environment(
        backend="gloo",
        world_size=world,
        rank=rank,
        local_rank=rank,
        distributed_init_method="env://",
    )
    initialize_model_parallel()
    initialize_dp_attention(server_args=args)
    initialize_moe_config()
    return args


def set_backend(name: str) -> None:
    from sglang.srt.layers.moe.utils import MoeA2ABackend
    from sglang.srt.runtime_context import get_flags

    get_flags().moe.a2a_backend = MoeA2ABackend(name)


def _full(gen, *shape):
    import torch

    return (torch.randn(*shape, generator=gen) * 0.2).to(torch.bfloat16)


def load_block(block, seed: int) -> None:
    """Loads the same global weights on every rank and backend through SGLang's own
    weight loaders (each parameter keeps its rank's shard)."""
    import torch
    from sglang.srt.layers.linear import (
        MergedColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    for name, m in block.named_modules():
        g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
        if isinstance(m, FusedMoE):
            if not hasattr(m, "w13_weight"):  # quantized experts: the test loads them
                continue
            inter = m.intermediate_size_per_partition * m.moe_tp_size
            hidden = m.hidden_size
            for e in range(m.num_experts):  # SGLang's loader reads the kind from the name
                for shard, proj in (("w1", "gate_proj"), ("w3", "up_proj")):
                    w = _full(g, inter, hidden)
                    m.weight_loader(m.w13_weight, w, f"{name}.{e}.{proj}.weight", shard, e)
                w = _full(g, hidden, inter)
                m.weight_loader(m.w2_weight, w, f"{name}.{e}.down_proj.weight", "w2", e)
        elif isinstance(m, MergedColumnParallelLinear):
            for i, n in enumerate(m.output_sizes):
                m.weight_loader(m.weight, _full(g, n, m.input_size), i)
        elif isinstance(m, RowParallelLinear):
            m.weight_loader(m.weight, _full(g, m.output_size, m.input_size))
        elif isinstance(m, (ReplicatedLinear, torch.nn.Linear)):
            m.weight.data.copy_(_full(g, *m.weight.shape).to(m.weight.dtype))
        elif type(m).__name__ in ("MoEGate", "Glm4MoeGate"):
            m.weight.data.copy_(_full(g, *m.weight.shape).to(m.weight.dtype))
            bias = getattr(m, "e_score_correction_bias", None)
            if bias is not None:
                bias.data.copy_(torch.randn(bias.shape, generator=g) * 0.1)


def build_block(family: str, quant_config=None, config: dict | None = None):
    """The family's real MoE block inside a one-layer stack (attention + FFN stages);
    ``config`` replaces the family's tiny config."""
    import importlib

    import torch
    from sglang.srt.layers.layer_boundary import (
        append_stages,
        declare_attn,
        declare_ffn,
        layer_stack,
    )
    from sglang.srt.layers.layernorm import RMSNorm

    default, target, _ = FAMILIES[family]
    hf = _hf_config(config or default)
    module, cls = target.split(".")
    block_cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), cls)
    torch.set_default_dtype(torch.bfloat16)
    kw = dict(config=hf, layer_id=1, quant_config=quant_config, prefix="model.layers.1.mlp")
    if family in ("deepseek_v3", "qwen2_moe"):
        kw["reduce_results"] = False  # as their decoder layers build them under a boundary
    with layer_stack():
        block = block_cls(**kw)
        norms = [RMSNorm(hf.hidden_size) for _ in range(3)]
        attn_b, ffn_b = append_stages(
            (declare_attn(), norms[0]), (declare_ffn(sparse=True), norms[1])
        )
    return block, attn_b, ffn_b, norms[2], hf


def _hf_config(config: dict):
    from transformers import AutoConfig

    cfg = dict(config)
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg)


def forward_batch(counts: list[int], rank_tokens: int, dp: bool, hidden: int):
    """A ForwardBatch carrying what the boundary reads: the mode, the rows, and the DP
    gather sizes ``prepare_mlp_sync_batch`` would publish."""
    import torch
    from sglang.srt.layers.dp_attention import (
        DpPaddingMode,
        _DpGatheredBufferWrapper,
        set_dp_buffer_len_from_batch,
    )
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    t = rank_tokens
    mode = ForwardMode.EXTEND if t else ForwardMode.IDLE
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=1 if t else 0,
        input_ids=torch.zeros(t, dtype=torch.int64),
        req_pool_indices=torch.zeros(1 if t else 0, dtype=torch.int64),
        seq_lens=torch.tensor([t] if t else [], dtype=torch.int64),
        out_cache_loc=torch.zeros(t, dtype=torch.int64),
        seq_lens_sum=t,
    )
    _DpGatheredBufferWrapper.set_metadata(
        hidden_size=hidden, dtype=torch.bfloat16, device=torch.device("cpu")
    )
    glob = list(counts) if dp else [t]
    fb.global_num_tokens_cpu = glob
    fb.global_num_tokens_padded_cpu = glob
    fb.global_num_tokens_for_logprob_cpu = glob
    fb.global_num_tokens_gpu = torch.tensor(glob, dtype=torch.int32)
    fb.dp_padding_mode = DpPaddingMode.SUM_LEN
    fb.global_dp_buffer_len = sum(glob)
    fb.is_extend_in_batch = any(glob)
    set_dp_buffer_len_from_batch(fb)
    return fb


def run_layer(block, attn_b, ffn_b, final_norm, x, fb, attn_tp_size: int):
    """embeddings -> attention stage (identity) -> FFN stage (the MoE block) -> final
    norm, all through SGLang's boundary; returns (output rows, rows the block saw)."""
    import torch
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

    with torch.no_grad():
        residual_batch.start(fb)
        h = attn_b.prepare(x, fb)
        h = attn_b.finish(h / attn_tp_size, fb)  # attention leaves a partial sum
        h = ffn_b.prepare(h, fb)
        seen = h.shape[0]
        out = block(h, fb)
        h = ffn_b.finish(out, fb)
        y = residual_batch.final_norm(h, fb, final_norm)
    return y, seen
