"""What a Hugging Face MoE config says (:class:`MoESpec`, :func:`parse_config`), torch-free:
``pcie-a2a plan`` reads configs without torch. Reading checkpoint tensors is
:mod:`.config`'s; the supported architectures are listed there."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .router import Router

ARCHS = ("deepseek_v3", "kimi_k2", "glm4_moe", "qwen3_moe", "mixtral")
INT4_METHODS = ("compressed-tensors", "gptq", "awq")
FP8_BLOCK = 128


def _fail(kind: type[Exception], arg: str, got: object, allowed: str) -> Exception:
    return kind(f"{arg}: got {got}; allowed: {allowed}")


@dataclass
class QuantSpec:
    """INT4 checkpoint settings from ``quantization_config``."""

    method: str  # "compressed-tensors" | "gptq" | "awq" | "fp8"
    group_size: int = -1  # 32, 64, 128 or -1 (per channel)
    symmetric: bool = True
    checkpoint_format: str = "gptq"  # GPTQ: "gptq" (v1, zero - 1 stored) or "gptq_v2"
    desc_act: bool = False


@dataclass
class MoESpec:
    """Everything the MoE layer needs from a config, independent of the source format."""

    arch: str
    hidden: int
    num_experts: int
    top_k: int
    intermediate: int
    scoring: str
    n_group: int | None
    topk_group: int | None
    group_score: str
    correction_bias: bool
    renormalize: bool
    routed_scaling_factor: float
    shared_intermediate: int  # 0: no shared expert
    quant: QuantSpec | None
    module: str  # "mlp" or "block_sparse_moe"
    proj_names: tuple[str, str, str]  # (gate, up, down) names of an expert's linears
    first_moe_layer: int
    moe_layers: Any  # callable layer -> bool

    def router(self, dtype: torch.dtype | None = None) -> Router:
        """The router of this config (bf16 by default)."""
        import torch  # the spec is torch-free: ``pcie-a2a plan`` reads configs without torch

        from .router import Router

        return Router(
            self.hidden,
            self.num_experts,
            self.top_k,
            scoring=self.scoring,
            n_group=self.n_group,
            topk_group=self.topk_group,
            group_score=self.group_score,
            correction_bias=self.correction_bias,
            renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor,
            dtype=torch.bfloat16 if dtype is None else dtype,
        )

    def prefix(self, layer: int | None) -> str:
        """Checkpoint prefix of MoE layer ``layer`` (default: the first MoE layer)."""
        if layer is None:
            layer = self.first_moe_layer
        if not isinstance(layer, int) or layer < 0 or not self.moe_layers(layer):
            raise _fail(
                ValueError,
                "layer",
                repr(layer),
                f"an MoE layer of this {self.arch} config (the first is {self.first_moe_layer})",
            )
        return f"model.layers.{layer}.{self.module}."


def _get(cfg: Mapping, *names: str, default: Any = KeyError) -> Any:
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    if default is KeyError:
        raise _fail(
            ValueError,
            "hf_config",
            f"no {' / '.join(names)!r} key",
            "a config with that key (is this the model's config.json?)",
        )
    return default


def _quant_spec(q: Mapping | None) -> QuantSpec | None:
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
        if list(block) != [FP8_BLOCK, FP8_BLOCK]:
            raise _fail(
                ValueError,
                "quantization_config.weight_block_size",
                block,
                f"[{FP8_BLOCK}, {FP8_BLOCK}]",
            )
        return QuantSpec("fp8")
    if method == "compressed-tensors":
        fmt = q.get("format")
        if fmt != "pack-quantized":
            raise _fail(ValueError, "quantization_config.format", repr(fmt), "'pack-quantized'")
        groups = q.get("config_groups") or {}
        weights = None
        for g in groups.values():
            if g.get("weights"):
                weights = g["weights"]
                break
        if weights is None:
            raise ValueError("quantization_config.config_groups: no group with 'weights'")
        if weights.get("num_bits") != 4 or weights.get("type", "int") != "int":
            raise _fail(
                ValueError,
                "quantization_config weights",
                f"num_bits={weights.get('num_bits')} type={weights.get('type')}",
                "num_bits=4, type='int'",
            )
        strategy = weights.get("strategy", "group")
        gs = -1 if strategy == "channel" else int(weights.get("group_size") or -1)
        if weights.get("actorder") not in (None, False, "static"):
            raise _fail(
                ValueError,
                "quantization_config weights.actorder",
                repr(weights.get("actorder")),
                "null or 'static' (no g_idx)",
            )
        return QuantSpec(method, gs, bool(weights.get("symmetric", True)))
    if method == "gptq":
        bits = q.get("bits", 4)
        if bits != 4:
            raise _fail(ValueError, "quantization_config.bits", bits, "4")
        fmt = q.get("checkpoint_format", "gptq")
        return QuantSpec(
            method,
            int(q.get("group_size", 128)),
            bool(q.get("sym", True)),
            fmt if fmt in ("gptq", "gptq_v2") else "gptq",
            bool(q.get("desc_act", False)),
        )
    if method == "awq":
        bits = q.get("bits", q.get("w_bit", 4))
        if bits != 4:
            raise _fail(ValueError, "quantization_config.bits", bits, "4")
        gs = int(q.get("group_size", q.get("q_group_size", 128)))
        return QuantSpec(method, gs, not bool(q.get("zero_point", True)))
    raise _fail(
        ValueError,
        "quantization_config.quant_method",
        repr(method),
        "'compressed-tensors', 'gptq', 'awq', 'fp8', or no quantization_config",
    )


def parse_config(hf_config: Mapping) -> MoESpec:
    """Reads a Hugging Face ``config.json`` dict (Kimi K2, DeepSeek-V3, GLM-4.5, Qwen3-MoE,
    Mixtral)."""
    if not isinstance(hf_config, Mapping):
        raise _fail(TypeError, "hf_config", type(hf_config).__name__, "a dict (config.json)")
    quant = hf_config.get("quantization_config")
    cfg = hf_config
    if isinstance(hf_config.get("text_config"), Mapping):  # multimodal wrappers (Kimi K2.5)
        cfg = hf_config["text_config"]
        quant = quant or cfg.get("quantization_config")
    arch = cfg.get("model_type")
    if arch not in ARCHS:
        raise _fail(ValueError, "hf_config['model_type']", repr(arch), ", ".join(map(repr, ARCHS)))
    hidden = int(_get(cfg, "hidden_size"))
    qspec = _quant_spec(quant)
    if arch in ("deepseek_v3", "kimi_k2", "glm4_moe"):
        scoring = _get(cfg, "scoring_func", default="sigmoid")
        method = _get(cfg, "topk_method", default="noaux_tc")
        if method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise _fail(
                ValueError,
                "hf_config['topk_method']",
                repr(method),
                "'noaux_tc', 'greedy', 'group_limited_greedy'",
            )
        n_group = int(_get(cfg, "n_group", default=1))
        topk_group = int(_get(cfg, "topk_group", default=1))
        grouped = method != "greedy" and n_group > 1
        first = int(_get(cfg, "first_k_dense_replace", default=0))
        freq = int(_get(cfg, "moe_layer_freq", default=1))
        num_experts = int(_get(cfg, "n_routed_experts"))
        n_shared = int(_get(cfg, "n_shared_experts", default=0))
        inter = int(_get(cfg, "moe_intermediate_size"))
        return MoESpec(
            arch=arch,
            hidden=hidden,
            num_experts=num_experts,
            top_k=int(_get(cfg, "num_experts_per_tok")),
            intermediate=inter,
            scoring=scoring,
            n_group=n_group if grouped else None,
            topk_group=topk_group if grouped else None,
            group_score="top2_sum" if method == "noaux_tc" else "max",
            correction_bias=method == "noaux_tc",
            renormalize=bool(_get(cfg, "norm_topk_prob", default=True)),
            routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", default=1.0)),
            shared_intermediate=n_shared * inter,
            quant=qspec,
            module="mlp",
            proj_names=("gate_proj", "up_proj", "down_proj"),
            first_moe_layer=first + (-first) % freq,
            moe_layers=lambda layer: layer >= first and layer % freq == 0,
        )
    if arch == "qwen3_moe":
        step = int(_get(cfg, "decoder_sparse_step", default=1))
        dense = {int(v) for v in _get(cfg, "mlp_only_layers", default=[])}

        def is_moe(layer: int) -> bool:
            return layer not in dense and (layer + 1) % step == 0

        first = next(layer for layer in range(10_000) if is_moe(layer))
        return MoESpec(
            arch=arch,
            hidden=hidden,
            num_experts=int(_get(cfg, "num_experts")),
            top_k=int(_get(cfg, "num_experts_per_tok")),
            intermediate=int(_get(cfg, "moe_intermediate_size")),
            scoring="softmax",
            n_group=None,
            topk_group=None,
            group_score="top2_sum",
            correction_bias=False,
            renormalize=bool(_get(cfg, "norm_topk_prob", default=False)),
            routed_scaling_factor=1.0,
            shared_intermediate=0,
            quant=qspec,
            module="mlp",
            proj_names=("gate_proj", "up_proj", "down_proj"),
            first_moe_layer=first,
            moe_layers=is_moe,
        )
    # mixtral
    return MoESpec(
        arch=arch,
        hidden=hidden,
        num_experts=int(_get(cfg, "num_local_experts")),
        top_k=int(_get(cfg, "num_experts_per_tok")),
        intermediate=int(_get(cfg, "intermediate_size")),
        scoring="softmax",
        n_group=None,
        topk_group=None,
        group_score="top2_sum",
        correction_bias=False,
        renormalize=True,
        routed_scaling_factor=1.0,
        shared_intermediate=0,
        quant=qspec,
        module="block_sparse_moe",
        proj_names=("w1", "w3", "w2"),
        first_moe_layer=0,
        moe_layers=lambda layer: True,
    )
