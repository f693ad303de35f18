"""Hugging Face configs and checkpoint tensor names -> router, experts, shared expert.

Supported ``model_type`` values (a ``text_config`` sub-dict, as in Kimi K2.5, is used
when present):

==============  ===========================================================================
deepseek_v3     sigmoid + ``e_score_correction_bias``, grouped top-k (``topk_method``
kimi_k2         ``noaux_tc``: top-2-sum group score), renormalise, ``routed_scaling_factor``,
glm4_moe        ``n_shared_experts`` shared experts of ``moe_intermediate_size`` each.
                (GLM-4.5's config has no ``topk_method``/``scoring_func``: its router is
                the same sigmoid + correction-bias one, the defaults.)
qwen3_moe       softmax top-k, ``norm_topk_prob``; no shared expert.
mixtral         softmax top-k renormalised (= softmax over the top-k logits).
==============  ===========================================================================

Checkpoint names under the layer prefix (default ``model.layers.{L}.mlp.``, Mixtral
``model.layers.{L}.block_sparse_moe.``)::

    gate.weight [E, H]                     gate.e_score_correction_bias [E]   (DeepSeek/Kimi)
    experts.{e}.{gate_proj,up_proj,down_proj}.<suffixes>    (Mixtral: w1, w3, w2)
    shared_experts.{gate_proj,up_proj,down_proj}.<suffixes> (DeepSeek/Kimi)

where ``<suffixes>`` is one of ``weight`` (bf16/fp16), ``weight`` + ``weight_scale_inv``
(DeepSeek-V3 block FP8, dequantised to bf16 on load), ``weight_packed`` +
``weight_scale`` + ``weight_shape`` (compressed-tensors pack-quantized, Kimi K2),
``qweight`` + ``qzeros`` + ``scales`` [+ ``g_idx``] (GPTQ, or AWQ when
``quantization_config.quant_method == "awq"``). The format is read from the tensors
present, so a checkpoint that quantises only the routed experts (Kimi K2 ignores the
shared experts) loads without extra configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pcie_a2a.quant import (
    from_awq,
    from_compressed_tensors,
    from_gptq,
    random_int4,
    to_awq,
    to_compressed_tensors,
    to_gptq,
)
from pcie_a2a.quant.formats import Int4Weights

from .spec import (  # noqa: F401  (part of this module's interface)
    ARCHS,
    FP8_BLOCK,
    INT4_METHODS,
    MoESpec,
    QuantSpec,
    _fail,
    parse_config,
)

# ---- reading tensors ----------------------------------------------------------------------


class TensorSource:
    """A checkpoint: a ``Mapping[str, Tensor]`` or a safetensors ``safe_open`` handle (any
    object with ``keys()`` and ``get_tensor(name)``)."""

    def __init__(self, weights: Any):
        if isinstance(weights, TensorSource):
            weights = weights._w
        if isinstance(weights, Mapping):
            self._keys = None
            self._get = weights.__getitem__
        elif hasattr(weights, "get_tensor") and hasattr(weights, "keys"):
            self._keys = set(weights.keys())
            self._get = weights.get_tensor
        else:
            raise _fail(
                TypeError,
                "weights",
                type(weights).__name__,
                "a Mapping[str, Tensor] or an object with keys() and get_tensor()",
            )
        self._w = weights

    def has(self, name: str) -> bool:
        return name in (self._w if self._keys is None else self._keys)

    def get(self, name: str) -> torch.Tensor:
        if not self.has(name):
            stem = name.rsplit(".", 2)[0]
            keys = self._w.keys() if self._keys is None else self._keys
            near = sorted(k for k in keys if k.startswith(stem))[:6]
            raise KeyError(
                f"checkpoint tensor {name!r} not found; tensors under {stem!r}: {near or 'none'}"
            )
        return self._get(name)


def _linear_format(src: TensorSource, name: str, quant: QuantSpec | None) -> str:
    """How linear ``name`` (without suffix) is stored: bf16, fp8, ct, gptq or awq."""
    if src.has(f"{name}.weight_packed"):
        return "ct"
    if src.has(f"{name}.qweight"):
        return "awq" if quant is not None and quant.method == "awq" else "gptq"
    if src.has(f"{name}.weight_scale_inv"):
        return "fp8"
    if src.has(f"{name}.weight"):
        return "bf16"
    raise KeyError(
        f"checkpoint has no weight for linear {name!r} (looked for .weight, "
        ".weight_packed, .qweight, .weight_scale_inv)"
    )


def _gs(quant: QuantSpec | None, name: str) -> int:
    if quant is None or quant.method not in INT4_METHODS:
        raise ValueError(
            f"{name} is stored as INT4 but the config has no INT4 "
            "quantization_config (pass the full config.json)"
        )
    return quant.group_size


def read_int4(src: TensorSource, name: str, quant: QuantSpec | None) -> Int4Weights:
    """Linear ``name`` (an INT4 tensor set) -> :class:`Int4Weights` ``[N, K]``."""
    fmt = _linear_format(src, name, quant)
    if fmt == "ct":
        if src.has(f"{name}.weight_g_idx"):
            raise ValueError(
                f"{name}.weight_g_idx: compressed-tensors act-order is not "
                "supported; supported: actorder null"
            )
        zp = src.get(f"{name}.weight_zero_point") if src.has(f"{name}.weight_zero_point") else None
        return from_compressed_tensors(
            src.get(f"{name}.weight_packed"),
            src.get(f"{name}.weight_scale"),
            src.get(f"{name}.weight_shape"),
            group_size=_gs(quant, name),
            weight_zero_point=zp,
        )
    if fmt == "gptq":
        g_idx = src.get(f"{name}.g_idx") if src.has(f"{name}.g_idx") else None
        qz = src.get(f"{name}.qzeros") if src.has(f"{name}.qzeros") else None
        return from_gptq(
            src.get(f"{name}.qweight"),
            qz,
            src.get(f"{name}.scales"),
            g_idx,
            group_size=_gs(quant, name),
            checkpoint_format=quant.checkpoint_format,
        )
    if fmt == "awq":
        return from_awq(
            src.get(f"{name}.qweight"),
            src.get(f"{name}.qzeros"),
            src.get(f"{name}.scales"),
            group_size=_gs(quant, name),
        )
    raise ValueError(f"{name} is stored as {fmt}, not INT4")


def read_dense(
    src: TensorSource, name: str, quant: QuantSpec | None, dtype: torch.dtype
) -> torch.Tensor:
    """Linear ``name`` in any stored format -> ``[N, K]`` in ``dtype`` (INT4 and FP8 are
    dequantised in fp32, then rounded once to ``dtype``)."""
    fmt = _linear_format(src, name, quant)
    if fmt == "bf16":
        return src.get(f"{name}.weight").to(dtype)
    if fmt == "fp8":
        w = src.get(f"{name}.weight").float()
        s = src.get(f"{name}.weight_scale_inv").float()
        n, k = w.shape
        s = s.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
        return (w * s).to(dtype)
    return read_int4(src, name, quant).dequantize().to(dtype)


# ---- random checkpoints (tests, benchmarks) -----------------------------------------------


def random_checkpoint(
    hf_config: Mapping,
    *,
    layer: int | None = None,
    prefix: str | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    num_experts: int | None = None,
) -> dict[str, torch.Tensor]:
    """A random checkpoint of one MoE layer, named and stored like the real model's
    (routed experts in the config's INT4 format when it has one; gate, bias and shared
    experts in ``dtype``). Deterministic in ``seed``. ``num_experts`` limits how many
    routed experts are written (default: all)."""
    spec = parse_config(hf_config)
    p = prefix if prefix is not None else spec.prefix(layer)
    g = torch.Generator().manual_seed(seed)
    h, i = spec.hidden, spec.intermediate
    out: dict[str, torch.Tensor] = {}
    out[f"{p}gate.weight"] = (torch.randn(spec.num_experts, h, generator=g) / h**0.5).to(dtype)
    if spec.correction_bias:
        out[f"{p}gate.e_score_correction_bias"] = torch.randn(spec.num_experts, generator=g) * 0.05
    gn, un, dn = spec.proj_names
    q = spec.quant if spec.quant is not None and spec.quant.method in INT4_METHODS else None
    for e in range(spec.num_experts if num_experts is None else num_experts):
        base = f"{p}experts.{e}."
        if q is None:
            out[f"{base}{gn}.weight"] = (torch.randn(i, h, generator=g) / h**0.5).to(dtype)
            out[f"{base}{un}.weight"] = (torch.randn(i, h, generator=g) / h**0.5).to(dtype)
            out[f"{base}{dn}.weight"] = (torch.randn(h, i, generator=g) / i**0.5).to(dtype)
            continue
        # codes - zero have a standard deviation of about 4.6: scale for unit-variance rows
        act = q.desc_act and q.method == "gptq" and q.group_size != -1
        w13 = random_int4(
            2 * i,
            h,
            group_size=q.group_size,
            symmetric=q.symmetric,
            act_order=act,
            generator=g,
            scale=1.0 / (4.6 * h**0.5),
        )
        w2 = random_int4(
            h,
            i,
            group_size=q.group_size,
            symmetric=q.symmetric,
            act_order=act,
            generator=g,
            scale=1.0 / (4.6 * i**0.5),
        )
        halves = []
        for rows in (slice(0, i), slice(i, 2 * i)):
            halves.append(
                Int4Weights(
                    w13.codes[rows],
                    w13.scales[rows],
                    None if w13.zeros is None else w13.zeros[rows],
                    w13.group_size,
                    w13.g_idx,
                )
            )
        for nm, w in ((gn, halves[0]), (un, halves[1]), (dn, w2)):
            if q.method == "compressed-tensors":
                tensors = to_compressed_tensors(w)
            elif q.method == "gptq":
                w.scales = w.scales.to(torch.float16)  # bf16 values: exact in fp16
                if w.zeros is not None and q.checkpoint_format == "gptq":
                    w.zeros = w.zeros.clamp(min=1)  # v1 stores zero - 1
                tensors = to_gptq(w, checkpoint_format=q.checkpoint_format)
                if not act:
                    tensors.pop("g_idx")
            else:
                w.scales = w.scales.to(torch.float16)
                tensors = to_awq(w)
            for suffix, t in tensors.items():
                out[f"{base}{nm}.{suffix}"] = t
    if spec.shared_intermediate:
        s, base = spec.shared_intermediate, f"{p}shared_experts."
        out[f"{base}gate_proj.weight"] = (torch.randn(s, h, generator=g) / h**0.5).to(dtype)
        out[f"{base}up_proj.weight"] = (torch.randn(s, h, generator=g) / h**0.5).to(dtype)
        out[f"{base}down_proj.weight"] = (torch.randn(h, s, generator=g) / s**0.5).to(dtype)
    return out
