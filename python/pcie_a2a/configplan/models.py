"""The shape of a model, as the cost terms need it: layers, attention, experts, and the
stored format of every weight group.

The MoE part (experts, top-k, intermediate sizes, which layers are MoE, the quantisation
method) is read by :func:`pcie_a2a.moe.config.parse_config`, the same reader the MoE layer
uses; this module adds what a serving step also touches (attention, dense layers,
embedding, LM head) and which weight groups the checkpoint quantises.

Built-in names (``--model NAME``) carry the ``config.json`` fields of the public
checkpoints; their ``source`` says where the values come from.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pcie_a2a.moe.spec import parse_config

PARTS = ("experts", "attention", "shared", "dense", "lm_head")
# A representative checkpoint name per weight group, matched against the quantisation
# config's ignore list (compressed-tensors ``ignore``, ``modules_to_not_convert``).
_PROBE_NAMES = {
    "experts": "model.layers.{L}.mlp.experts.0.gate_proj",
    "attention": "model.layers.{L}.self_attn.o_proj",
    "shared": "model.layers.{L}.mlp.shared_experts.gate_proj",
    "dense": "model.layers.0.mlp.gate_proj",
    "lm_head": "lm_head",
}


@dataclass(frozen=True)
class WeightFormat:
    """How one weight is stored: ``bf16``, ``fp8`` (block 128x128, fp32 scale per block) or
    ``int4`` (group ``group`` with a bf16 scale per group, plus a 4-bit zero per group when
    asymmetric; group -1 = one scale per output channel)."""

    kind: str  # "bf16" | "fp8" | "int4"
    group: int = 0
    zeros: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("bf16", "fp8", "int4"):
            raise ValueError(f"weight format {self.kind!r}: allowed bf16, fp8, int4")
        if self.kind == "int4" and not (self.group == -1 or self.group >= 8):
            raise ValueError(f"int4 group {self.group}: allowed -1 (per channel) or >= 8")

    def bytes_per_weight(self, k: int) -> float:
        """Stored bytes per weight of a [N, K] matrix (K = input dim, for per-channel)."""
        if self.kind == "bf16":
            return 2.0
        if self.kind == "fp8":
            return 1.0 + 4.0 / (128 * 128)
        g = k if self.group == -1 else self.group
        return 0.5 + 2.0 / g + (0.5 / g if self.zeros else 0.0)

    @property
    def label(self) -> str:
        if self.kind == "int4":
            g = "channel" if self.group == -1 else f"g{self.group}"
            return f"int4-{g}{'-asym' if self.zeros else ''}"
        return self.kind


BF16 = WeightFormat("bf16")


@dataclass(frozen=True)
class ModelShape:
    name: str
    arch: str
    hidden: int
    layers: int
    moe_layers: int
    vocab: int
    # attention
    attention: str  # "mla" | "gqa"
    heads: int
    kv_heads: int
    head_dim: int  # GQA
    q_lora_rank: int | None  # MLA
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    # MLPs
    experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int  # 0: no shared expert
    dense_intermediate: int  # MLP of the dense (non-MoE) layers
    formats: tuple[tuple[str, WeightFormat], ...]
    tie_embeddings: bool = False
    extra_weight_bytes: float = 0.0  # replicated on every GPU (vision tower)
    extra_note: str = ""
    source: str = ""
    hf_id: str | None = None

    # ---- weight groups ------------------------------------------------------------------
    def fmt(self, part: str) -> WeightFormat:
        return dict(self.formats)[part]

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    def attention_params(self) -> tuple[float, float]:
        """(params split over attention TP, params every attention-TP rank holds whole) per
        layer. MLA: q_a and kv_a (the low-rank down-projections) are replicated, as in
        SGLang's and vLLM's DeepSeek models; GQA: k and v are split over the KV heads."""
        h = self.hidden
        if self.attention == "mla":
            qk = self.qk_nope_dim + self.qk_rope_dim
            repl = h * (self.kv_lora_rank + self.qk_rope_dim)
            split = self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_head_dim)
            split += self.heads * self.v_head_dim * h
            if self.q_lora_rank:
                repl += h * self.q_lora_rank
                split += self.q_lora_rank * self.heads * qk
            else:
                split += h * self.heads * qk
            return float(split), float(repl)
        q_o = 2 * h * self.heads * self.head_dim
        kv = 2 * h * self.kv_heads * self.head_dim
        return float(q_o + kv), 0.0

    def attention_params_per_rank(self, tp: int) -> float:
        split, repl = self.attention_params()
        if self.attention == "gqa" and self.kv_heads < tp:
            # KV heads are replicated when TP exceeds them: each rank holds one KV head.
            h = self.hidden
            q_o = 2 * h * self.heads * self.head_dim
            return q_o / tp + 2 * h * self.head_dim + repl
        return split / tp + repl

    def kv_bytes_per_token(self, tp: int, kv_bytes: float) -> float:
        """KV-cache bytes one token adds per layer on one attention-TP rank. MLA caches the
        compressed latent plus the rope key, which every head needs: not split by TP."""
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_dim) * kv_bytes
        per_rank_heads = max(1.0, self.kv_heads / tp)
        return 2 * per_rank_heads * self.head_dim * kv_bytes

    def attention_flops_per_context_token(self) -> float:
        """FLOPs of one query token against one cached token, all heads. MLA decode runs
        absorbed (scores over kv_lora + rope, values over kv_lora), as FlashMLA/FlashInfer do."""
        if self.attention == "mla":
            return self.heads * 2.0 * (2 * self.kv_lora_rank + self.qk_rope_dim)
        return self.heads * 4.0 * self.head_dim

    def expert_params(self) -> float:
        return 3.0 * self.hidden * self.moe_intermediate

    def expert_bytes(self) -> float:
        """One routed expert (gate, up, down) as stored. The down projection's input dim is
        the intermediate size, which only matters for per-channel int4."""
        f = self.fmt("experts")
        h, i = self.hidden, self.moe_intermediate
        return 2 * h * i * f.bytes_per_weight(h) + h * i * f.bytes_per_weight(i)

    def mlp_bytes(self, intermediate: int, part: str) -> float:
        f = self.fmt(part)
        h = self.hidden
        return 2 * h * intermediate * f.bytes_per_weight(h) + h * intermediate * f.bytes_per_weight(
            intermediate
        )

    def attention_bytes(self, tp: int) -> float:
        return self.attention_params_per_rank(tp) * self.fmt("attention").bytes_per_weight(
            self.hidden
        )

    def router_bytes(self) -> float:
        return 2.0 * self.experts * self.hidden

    def embedding_bytes(self) -> float:
        return 2.0 * self.vocab * self.hidden

    def lm_head_bytes(self) -> float:
        return self.vocab * self.hidden * self.fmt("lm_head").bytes_per_weight(self.hidden)

    def total_weight_bytes(self) -> float:
        """The checkpoint's weights as stored (norms and biases left out)."""
        split, repl = self.attention_params()
        attn = (split + repl) * self.fmt("attention").bytes_per_weight(self.hidden)
        moe = self.moe_layers * (
            self.experts * self.expert_bytes()
            + self.router_bytes()
            + (
                self.mlp_bytes(self.shared_intermediate, "shared")
                if self.shared_intermediate
                else 0
            )
        )
        dense = self.dense_layers * self.mlp_bytes(self.dense_intermediate, "dense")
        emb = self.embedding_bytes() + (0 if self.tie_embeddings else self.lm_head_bytes())
        return self.layers * attn + moe + dense + emb + self.extra_weight_bytes

    def active_params_per_token(self) -> float:
        split, repl = self.attention_params()
        mlp_shared = 3.0 * self.hidden * self.shared_intermediate
        return (
            self.layers * (split + repl)
            + self.moe_layers * (self.top_k * self.expert_params() + mlp_shared)
            + self.dense_layers * 3.0 * self.hidden * self.dense_intermediate
            + self.vocab * self.hidden
        )


# ---- from a config.json -------------------------------------------------------------------


def _ignored(patterns: list[str], name: str) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.endswith("." + p) or p in name.split("."):
            return True
    return False


def _formats(quant: Mapping | None, first_moe: int) -> tuple[tuple[str, WeightFormat], ...]:
    """Which weight groups the checkpoint stores quantised, and how."""
    if not quant:
        return tuple((p, BF16) for p in PARTS)
    method = quant.get("quant_method")
    if method == "fp8":
        fmt = WeightFormat("fp8")
        ignore = list(quant.get("modules_to_not_convert") or [])
    elif method == "compressed-tensors":
        groups = quant.get("config_groups") or {}
        w = next((g["weights"] for g in groups.values() if g.get("weights")), {})
        gs = -1 if w.get("strategy") == "channel" else int(w.get("group_size") or -1)
        fmt = WeightFormat("int4", gs, not bool(w.get("symmetric", True)))
        ignore = list(quant.get("ignore") or [])
    elif method in ("gptq", "awq"):
        gs = int(quant.get("group_size", quant.get("q_group_size", 128)))
        zeros = method == "awq" and bool(quant.get("zero_point", True))
        if method == "gptq" and not bool(quant.get("sym", True)):
            zeros = True
        fmt = WeightFormat("int4", gs, zeros)
        ignore = list(quant.get("modules_to_not_convert") or [])
    else:
        raise ValueError(
            f"quantization_config.quant_method: got {method!r}; allowed: 'fp8', "
            "'compressed-tensors', 'gptq', 'awq', or no quantization_config"
        )
    ignore.append("lm_head")  # every engine keeps the LM head in bf16 for these methods
    out = []
    for part in PARTS:
        name = _PROBE_NAMES[part].format(L=first_moe)
        out.append((part, BF16 if _ignored(ignore, name) else fmt))
    return tuple(out)


def _int(cfg: Mapping, key: str, default: Any = KeyError) -> Any:
    v = cfg.get(key)
    if v is None:
        if default is KeyError:
            raise ValueError(
                f"hf_config: no {key!r} key; allowed: a config.json of "
                "Kimi K2/K2.x, DeepSeek-V3, GLM-4.5, Qwen3-MoE or Mixtral"
            )
        return default
    return int(v)


def from_hf_config(hf_config: Mapping, name: str = "config.json", **extra: Any) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` dict."""
    spec = parse_config(hf_config)
    cfg = hf_config
    quant = hf_config.get("quantization_config")
    if isinstance(hf_config.get("text_config"), Mapping):
        cfg = hf_config["text_config"]
        quant = quant or cfg.get("quantization_config")
    layers = _int(cfg, "num_hidden_layers")
    moe_layers = sum(1 for layer in range(layers) if spec.moe_layers(layer))
    heads = _int(cfg, "num_attention_heads")
    mla = cfg.get("kv_lora_rank") is not None
    hidden = spec.hidden
    head_dim = _int(cfg, "head_dim", hidden // heads)
    dense_inter = _int(cfg, "intermediate_size", 0) if moe_layers < layers else 0
    if spec.arch == "mixtral":
        dense_inter = 0
    return ModelShape(
        name=name,
        arch=spec.arch,
        hidden=hidden,
        layers=layers,
        moe_layers=moe_layers,
        vocab=_int(cfg, "vocab_size"),
        attention="mla" if mla else "gqa",
        heads=heads,
        kv_heads=_int(cfg, "num_key_value_heads", heads),
        head_dim=head_dim,
        q_lora_rank=_int(cfg, "q_lora_rank", 0) or None if mla else None,
        kv_lora_rank=_int(cfg, "kv_lora_rank", 0) if mla else 0,
        qk_nope_dim=_int(cfg, "qk_nope_head_dim", 0) if mla else 0,
        qk_rope_dim=_int(cfg, "qk_rope_head_dim", 0) if mla else 0,
        v_head_dim=_int(cfg, "v_head_dim", 0) if mla else 0,
        experts=spec.num_experts,
        top_k=spec.top_k,
        moe_intermediate=spec.intermediate,
        shared_intermediate=spec.shared_intermediate,
        dense_intermediate=dense_inter,
        formats=_formats(quant, spec.first_moe_layer),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **extra,
    )


# ---- built-in models ------------------------------------------------------------------------

_KIMI_K2 = {
    "model_type": "kimi_k2",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 163840,
    "tie_word_embeddings": False,
}
_FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
# Kimi K2 Thinking / K2.5 / K2.6 (native INT4 QAT): routed experts only.
_KIMI_INT4 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 32,
                "symmetric": True,
                "actorder": None,
            },
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ],
}
_DEEPSEEK_V3 = dict(
    _KIMI_K2,
    model_type="deepseek_v3",
    num_attention_heads=128,
    num_key_value_heads=128,
    n_routed_experts=256,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=3,
    routed_scaling_factor=2.5,
    vocab_size=129280,
)
_GLM45 = {
    "model_type": "glm4_moe",
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 92,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "vocab_size": 151552,
}
_QWEN3_235B = {
    "model_type": "qwen3_moe",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
}
_QWEN3_30B = dict(
    _QWEN3_235B,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
)
_MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
}
_HF_CONFIGS = "the checkpoint's config.json on huggingface.co"
# Kimi K2.5/K2.6 add the MoonViT vision tower (~400M params, bf16, replicated on every rank
# by SGLang and vLLM unless the server runs language-only): lambda.ai/inference-models/
# moonshotai/kimi-k2.6 ("MoonViT-3D (~400M parameters)").
_VISION_BYTES = 400e6 * 2

BUILTIN: dict[str, dict[str, Any]] = {
    "kimi-k2.6": {
        "config": {
            "model_type": "kimi_k25",
            "text_config": _KIMI_K2,
            "quantization_config": _KIMI_INT4,
        },
        "hf_id": "moonshotai/Kimi-K2.6",
        "extra_weight_bytes": _VISION_BYTES,
        "extra_note": "vision tower ~400M params bf16 (0.8 GB) on every GPU",
        "source": "text config as Kimi K2 (moonshotai/Kimi-K2-Instruct config.json: 61 layers, "
        "hidden 7168, 64 heads, MLA 1536/512/128/64/128, 384 experts top-8, 1 shared, vocab "
        "163840); INT4 QAT compressed-tensors group 32 on routed experts only (ignore list of "
        "moonshotai/Kimi-K2-Thinking); 1.04T params incl. MoonViT ~400M (lambda.ai model page)",
    },
    "kimi-k2.5": {
        "config": {
            "model_type": "kimi_k25",
            "text_config": _KIMI_K2,
            "quantization_config": _KIMI_INT4,
        },
        "hf_id": "moonshotai/Kimi-K2.5",
        "extra_weight_bytes": _VISION_BYTES,
        "extra_note": "vision tower ~400M params bf16 (0.8 GB) on every GPU",
        "source": "as kimi-k2.6 (same architecture and INT4 format)",
    },
    "kimi-k2-thinking": {
        "config": dict(_KIMI_K2, quantization_config=_KIMI_INT4),
        "hf_id": "moonshotai/Kimi-K2-Thinking",
        "source": "moonshotai/Kimi-K2-Thinking config.json (INT4 QAT, compressed-tensors g32)",
    },
    "kimi-k2": {
        "config": dict(_KIMI_K2, quantization_config=_FP8_BLOCK),
        "hf_id": "moonshotai/Kimi-K2-Instruct",
        "source": "moonshotai/Kimi-K2-Instruct config.json (block FP8 128x128)",
    },
    "deepseek-v3": {
        "config": dict(_DEEPSEEK_V3, quantization_config=_FP8_BLOCK),
        "hf_id": "deepseek-ai/DeepSeek-V3",
        "source": "deepseek-ai/DeepSeek-V3 config.json (also transformers DeepseekV3Config "
        "defaults: 61 layers, 128 heads, 256 experts top-8, groups 8/4, 3 dense layers, vocab "
        "129280; block FP8 128x128)",
    },
    "glm-4.5": {
        "config": _GLM45,
        "hf_id": "zai-org/GLM-4.5",
        "source": "zai-org/GLM-4.5 config.json (92 layers, hidden 5120, 96 heads / 8 KV "
        "heads of 128, 160 experts top-8, 1 shared, 3 dense layers, vocab 151552), bf16",
    },
    "glm-4.5-fp8": {
        "config": dict(_GLM45, quantization_config=_FP8_BLOCK),
        "hf_id": "zai-org/GLM-4.5-FP8",
        "source": "as glm-4.5, block FP8 checkpoint",
    },
    "qwen3-235b-a22b": {
        "config": _QWEN3_235B,
        "hf_id": "Qwen/Qwen3-235B-A22B",
        "source": "Qwen/Qwen3-235B-A22B config.json (94 layers, hidden 4096, 64 heads / 4 KV "
        "heads of 128, 128 experts top-8, moe_intermediate 1536, vocab 151936), bf16",
    },
    "qwen3-235b-a22b-fp8": {
        "config": dict(_QWEN3_235B, quantization_config=_FP8_BLOCK),
        "hf_id": "Qwen/Qwen3-235B-A22B-FP8",
        "source": "as qwen3-235b-a22b, block FP8 checkpoint",
    },
    "qwen3-30b-a3b": {
        "config": _QWEN3_30B,
        "hf_id": "Qwen/Qwen3-30B-A3B",
        "source": "Qwen/Qwen3-30B-A3B config.json (48 layers, hidden 2048, 32 heads / 4 KV "
        "heads, 128 experts top-8, moe_intermediate 768), bf16",
    },
    "mixtral-8x7b": {
        "config": _MIXTRAL_8X7B,
        "hf_id": "mistralai/Mixtral-8x7B-Instruct-v0.1",
        "source": "mistralai/Mixtral-8x7B-v0.1 config.json (32 layers, hidden 4096, 32 heads "
        "/ 8 KV heads, 8 experts top-2, intermediate 14336, vocab 32000), bf16",
    },
}


def load_model(name_or_path: str) -> ModelShape:
    """A built-in name (see :data:`BUILTIN`) or a path to a ``config.json`` (or to a
    directory holding one)."""
    key = name_or_path.lower()
    if key in BUILTIN:
        b = BUILTIN[key]
        return from_hf_config(
            b["config"],
            name=key,
            hf_id=b["hf_id"],
            source=b["source"],
            extra_weight_bytes=b.get("extra_weight_bytes", 0.0),
            extra_note=b.get("extra_note", ""),
        )
    path = name_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"--model: got {name_or_path!r}, which is neither a built-in name nor a "
            f"config.json; allowed: {', '.join(sorted(BUILTIN))} or a path"
        )
    with open(path, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--model {path}: not JSON ({exc})") from None
    model_dir = os.path.dirname(os.path.abspath(path))
    return from_hf_config(
        cfg,
        name=os.path.basename(model_dir) or path,
        hf_id=model_dir,
        source=_HF_CONFIGS + f" ({path})",
    )
