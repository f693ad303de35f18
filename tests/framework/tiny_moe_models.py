"""Writes tiny random-weight MoE checkpoints (config, safetensors, tokenizer) that vLLM can
serve: nothing comes from a model hub.

    python tiny_moe_models.py OUT_DIR FAMILY [SEED]  # FAMILY: qwen3_moe | qwen2_moe | deepseek_v3

Run with the interpreter of the serving environment (its ``transformers`` writes the
files). ``qwen3_moe`` is a plain routed-experts block (Qwen3-MoE-30B-A3B's shape, shrunk);
``qwen2_moe`` adds a gated shared expert (Qwen1.5/2-MoE); ``deepseek_v3`` is DeepSeek-V3's
block shrunk: MLA attention (with a query LoRA), one dense layer then a MoE layer with a shared
expert, sigmoid scores with grouped top-k (4 groups, 2 kept) and a non-zero
``e_score_correction_bias``, and ``routed_scaling_factor`` 2.5 (Kimi K2's is 2.827). The weights are drawn with a wide
``initializer_range`` so that the experts' outputs weigh on every next-token distribution: a
token routed to a wrong or missing expert moves the logprobs by far more than a different
summation order does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 384  # word tokens w0..w{VOCAB-5} plus four specials
SPECIALS = ["<unk>", "<pad>", "<s>", "</s>"]

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32: a head size vLLM's CPU attention supports
    num_key_value_heads=1,
    max_position_embeddings=512,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    tie_word_embeddings=False,
    initializer_range=0.35,
    vocab_size=VOCAB,
    bos_token_id=2,
    eos_token_id=3,
    pad_token_id=1,
)

DEEPSEEK_V3 = dict(
    {k: COMMON[k] for k in ("hidden_size", "intermediate_size", "max_position_embeddings",
                            "num_experts_per_tok", "norm_topk_prob", "tie_word_embeddings",
                            "initializer_range", "vocab_size", "bos_token_id", "eos_token_id",
                            "pad_token_id")},
    num_hidden_layers=2,
    first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE (V3: 3 dense of 61)
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    # SGLang's CPU rope for MLA is DeepSeek's YaRN only (rotary_embedding/factory.py
    # get_rope_cpu); at factor 1 it rotates as plain RoPE, as transformers does
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=1.0,
                         original_max_position_embeddings=512, beta_fast=32, beta_slow=1,
                         mscale=1.0, mscale_all_dim=1.0),
    num_nextn_predict_layers=0,  # no MTP layer in the checkpoint
    moe_layer_freq=1,  # SGLang reads it (V3 config.json has it)
    topk_method="noaux_tc",  # SGLang reads these two; transformers' V3 implies them
    scoring_func="sigmoid",
)  # fmt: skip


def word(i: int) -> str:
    return f"w{i}"


def write_tokenizer(out: Path) -> None:
    """A word-level tokenizer over ``w0 w1 ...`` built with ``tokenizers`` (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(VOCAB - len(SPECIALS)):
        vocab[word(i)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    fast.save_pretrained(out)


def write_model(out: Path, family: str, seed: int = 0) -> dict:
    import torch
    import transformers

    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**COMMON)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**COMMON, shared_expert_intermediate_size=64)
        cls = transformers.Qwen2MoeForCausalLM
    elif family == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(**DEEPSEEK_V3)
        cls = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(
            f"family: got {family!r}; allowed: 'qwen3_moe', 'qwen2_moe', 'deepseek_v3'"
        )
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.bfloat16)
    if family == "deepseek_v3":
        # zero at init: a bias that moves the selection is what must survive the transport
        # (it picks the experts, the unbiased scores weigh them)
        with torch.no_grad():
            for layer in model.model.layers[cfg.first_k_dense_replace :]:
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape) * 0.3)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    info = {"family": family, "architectures": cfg.architectures, "dir": str(out)}
    (out / "pcie_a2a_tiny.json").write_text(json.dumps(info))
    return info


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        raise SystemExit(__doc__)
    seed = int(sys.argv[3]) if len(sys.argv) == 4 else 0
    print(json.dumps(write_model(Path(sys.argv[1]), sys.argv[2], seed)))
