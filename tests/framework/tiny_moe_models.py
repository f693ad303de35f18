"""Writes tiny random-weight MoE checkpoints (config, safetensors, tokenizer) that vLLM can
serve: nothing comes from a model hub.

    python tiny_moe_models.py OUT_DIR FAMILY [SEED]      # FAMILY: qwen3_moe | qwen2_moe

Run with the interpreter of the serving environment (its ``transformers`` writes the
files). ``qwen3_moe`` is a plain routed-experts block (Qwen3-MoE-30B-A3B's shape, shrunk);
``qwen2_moe`` adds a gated shared expert (Qwen1.5/2-MoE). The weights are drawn with a wide
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
    else:
        raise ValueError(f"family: got {family!r}; allowed: 'qwen3_moe', 'qwen2_moe'")
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.bfloat16)
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
