"""INT4 MoE layers on the pcie backend: loaded weights -> PackedInt4Experts -> moe_int4_mlp.

SGLang's INT4 MoE schemes (compressed-tensors WNA16 for Kimi K2, GPTQ-Marlin, AWQ-Marlin)
call SGLang's Marlin kernel straight from ``apply_weights``, never through the runner's
fused-function table, so a fused function alone never reaches our kernel. For a layer
whose dispatcher is ours the plugin wraps three scheme methods:

* ``create_moe_runner``: refuses, at model construction, what ``moe_int4_mlp`` does not
  compute (an activation other than SiLU, ``swiglu_limit``, gemm1 alpha/clamp as in
  gpt-oss, ``apply_router_weight_on_input``);
* ``process_weights_after_loading``: reads the tensors SGLang loaded (this rank's experts,
  checkpoint packing, SGLang's transposed layout), packs them into
  :class:`pcie_a2a.quant.PackedInt4Experts` on the layer's device, and frees the originals
  (SGLang's Marlin repack is skipped);
* ``apply_weights``: runs ``moe_int4_mlp`` on the received rows. ``routed_scaling_factor``
  is applied where SGLang's Marlin would apply it: on the platforms where SGLang's models
  leave the factor to the experts (CUDA, MUSA, XPU) and unless the top-k already folded
  it into the weights. Elsewhere the model multiplies it itself;
* ``restore_weights_before_loading`` (compressed-tensors): a no-op for converted layers,
  whose online weight updates SGLang's updater refuses (``RELOAD_REFUSED``).

INT4 schemes this module does not convert are refused when their layer is built
(:func:`check_scheme_hooked`).
"""

from __future__ import annotations

from typing import Any

import torch

INT4_ATTR = "pcie_a2a_int4"

_SCHEMES = {
    "compressed_tensors": (
        "sglang.srt.layers.quantization.compressed_tensors.schemes."
        "compressed_tensors_wNa16_moe.CompressedTensorsWNA16MoE"
    ),
    "compressed_tensors_triton": (
        "sglang.srt.layers.quantization.compressed_tensors.schemes."
        "compressed_tensors_wNa16_moe.CompressedTensorsWNA16TritonMoE"
    ),
    "gptq": "sglang.srt.layers.quantization.gptq.schemes.gptq_moe.GPTQMarlinMoEScheme",
    "awq": "sglang.srt.layers.quantization.awq.schemes.awq_moe.AWQMoEScheme",
}


#: SGLang 0.5.23's INT4-weight MoE schemes and methods that ``int4.py`` does not convert
#: (their own kernels would get our rows, or never run on them): refused when built.
UNHOOKED_INT4 = (
    "CompressedTensorsMxInt4MoE",  # flashinfer_trtllm's in-kernel routing
    "NPUCompressedTensorsW4A16Int4DynamicMoE",
    "MoeWNA16Method",
    "GPTQMoEAscendScheme",
    "GPTQIntelAMXMoEScheme",
    "AWQAscendMoEScheme",
    "AWQIntelAMXMoEScheme",
    "QuarkInt4Fp8MoEMethod",
    "ModelSlimW4A4Int4MoE",
)


def check_scheme_hooked(layer: Any) -> str | None:
    """For a MoE layer on our dispatcher: the INT4 format its scheme is converted from
    (None: not an INT4 scheme), or a ValueError for an INT4 scheme this module does not
    convert, or a subclass of a converted one that replaces the hooked methods."""
    scheme = getattr(layer, "scheme", None) or getattr(layer, "quant_method", None)
    cls = type(scheme)
    exact = f"{cls.__module__}.{cls.__qualname__}" in _SCHEMES.values()
    hooked_base = any(
        f"{c.__module__}.{c.__qualname__}" in _SCHEMES.values() for c in cls.__mro__[1:]
    )
    if exact:
        return _format_of(scheme)
    if cls.__name__ in UNHOOKED_INT4 or hooked_base:
        raise ValueError(
            f"pcie_a2a: the MoE layer {getattr(layer, 'prefix', '')} uses the INT4 scheme "
            f"{cls.__name__}, which pcie_a2a does not convert to its INT4 kernel (converted: "
            f"{', '.join(c.rsplit('.', 1)[1] for c in _SCHEMES.values())}); use "
            "--moe-runner-backend auto or marlin, or --moe-a2a-backend none for this model"
        )
    return None


def _ours(layer: Any) -> bool:
    from pcie_a2a.integrations.sglang.dispatcher import PcieA2ADispatcher

    return isinstance(getattr(layer, "dispatcher", None), PcieA2ADispatcher)


def _format_of(scheme: Any) -> str:
    names = {c.__name__ for c in type(scheme).__mro__}
    if "CompressedTensorsWNA16MoE" in names:
        return "compressed_tensors"
    if "GPTQMarlinMoEScheme" in names:
        return "gptq"
    if "AWQMoEScheme" in names:
        return "awq"
    raise TypeError(f"pcie_a2a: no INT4 conversion for {type(scheme).__name__}")


# ---- construction: refuse what the kernel does not compute -----------------------------
def check_runner_config(cfg: Any, where: str) -> None:
    problems = []
    act = getattr(cfg, "activation", "silu")
    if act != "silu":
        problems.append(f"activation={act!r} (moe_int4_mlp computes SiLU(gate) * up)")
    if getattr(cfg, "is_gated", True) is False:
        problems.append("is_gated=False (moe_int4_mlp computes a gated MLP)")
    if getattr(cfg, "swiglu_limit", None) is not None:
        problems.append(f"swiglu_limit={cfg.swiglu_limit} (no clamp in moe_int4_mlp)")
    for name in ("gemm1_alpha", "gemm1_clamp_limit"):
        if getattr(cfg, name, None) is not None:
            problems.append(f"{name}={getattr(cfg, name)} (not in moe_int4_mlp)")
    if getattr(cfg, "apply_router_weight_on_input", False):
        problems.append("apply_router_weight_on_input=True (weights apply to the outputs)")
    if getattr(cfg, "no_combine", False):
        problems.append("no_combine=True (moe_int4_mlp sums each row's experts)")
    if problems:
        raise ValueError(
            f"pcie_a2a: the INT4 MoE layer {where} needs what pcie_a2a's INT4 kernel does "
            f"not compute: {'; '.join(problems)}. Use --moe-a2a-backend none for this model."
        )


def _create_moe_runner(original, self: Any, layer: Any, moe_runner_config: Any, *a, **k):
    # runs inside FusedMoE.__init__ before the dispatcher exists: ask the backend
    from pcie_a2a.integrations.sglang.state import is_active

    if is_active():
        check_runner_config(moe_runner_config, getattr(layer, "prefix", type(layer).__name__))
    return original(self, layer, moe_runner_config, *a, **k)


# ---- loading: SGLang's loaded tensors -> PackedInt4Experts -----------------------------
def _dtype_of(layer: Any, scales: torch.Tensor) -> torch.dtype:
    cfg = getattr(layer, "moe_runner_config", None)
    dtype = getattr(cfg, "params_dtype", None) or scales.dtype
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def _halves(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = t.shape[dim] // 2
    return t.narrow(dim, 0, n), t.narrow(dim, n, n)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous()


def weights_compressed_tensors(scheme: Any, layer: Any):
    """(gate, up, down) Int4Weights from CompressedTensorsWNA16MoE's loaded parameters:
    ``w13_weight_packed [E, H/8, 2I]`` (the checkpoint's ``[N, K/8]`` transposed, gate
    then up along N), ``w13_weight_scale [E, G, 2I]``, ``w2_* [E, I/8, H]`` / ``[E, G, H]``."""
    from pcie_a2a.quant import from_compressed_tensors

    if not getattr(scheme, "sym", True):
        raise ValueError(
            "pcie_a2a: asymmetric compressed-tensors INT4 (weight_zero_point) is not "
            "supported by the pcie backend's INT4 path"
        )
    if getattr(scheme, "num_bits", 4) != 4:
        raise ValueError(f"pcie_a2a: {scheme.num_bits}-bit weights; the INT4 path needs 4-bit")
    group = -1 if scheme.strategy == "channel" else int(scheme.group_size)
    act_order = getattr(scheme, "actorder", None) == "group"
    w13 = _cpu(layer.w13_weight_packed).transpose(1, 2)  # [E, 2I, H/8]
    s13 = _cpu(layer.w13_weight_scale).transpose(1, 2)  # [E, 2I, G]
    w2 = _cpu(layer.w2_weight_packed).transpose(1, 2)  # [E, H, I/8]
    s2 = _cpu(layer.w2_weight_scale).transpose(1, 2)  # [E, H, G2]
    hidden, inter = w2.shape[1], w13.shape[1] // 2
    g13 = _cpu(layer.w13_weight_g_idx) if act_order else None
    g2 = _cpu(layer.w2_weight_g_idx) if act_order else None
    (gw, uw), (gs, us) = _halves(w13, 1), _halves(s13, 1)

    def one(p, s, shape, g):
        return from_compressed_tensors(
            p.contiguous(), s.contiguous(), shape, group_size=group, weight_g_idx=g
        )

    return (
        one(gw, gs, (inter, hidden), g13),
        one(uw, us, (inter, hidden), g13),
        one(w2, s2, (hidden, inter), g2),
    )


def weights_gptq(scheme: Any, layer: Any):
    """From GPTQMarlinMoEScheme's loaded parameters: ``w13_qweight [E, H/8, 2I]`` (GPTQ's
    own ``[K/8, N]``, gate then up along N), ``w13_scales [E, G, 2I]``, ``w13_g_idx``."""
    from pcie_a2a.quant import from_gptq

    qc = scheme.quant_config
    if not getattr(qc, "is_sym", True) or getattr(qc, "weight_bits", 4) != 4:
        raise ValueError("pcie_a2a: the INT4 path takes symmetric 4-bit GPTQ only")
    group = int(qc.group_size)
    act_order = bool(getattr(qc, "desc_act", False))
    (gq, uq), (gs, us) = _halves(_cpu(layer.w13_qweight), 2), _halves(_cpu(layer.w13_scales), 2)
    g13 = _cpu(layer.w13_g_idx) if act_order else None
    g2 = _cpu(layer.w2_g_idx) if act_order else None

    def one(q, s, g):
        return from_gptq(q.contiguous(), None, s.contiguous(), g, group_size=group)

    return (
        one(gq, gs, g13),
        one(uq, us, g13),
        one(_cpu(layer.w2_qweight), _cpu(layer.w2_scales), g2),
    )


def weights_awq(scheme: Any, layer: Any):
    """From AWQMoEScheme's loaded parameters: ``w13_qweight [E, H, 2I/8]`` (AWQ's own
    ``[K, N/8]``, gate then up along N), ``w13_qzeros [E, G, 2I/8]``, ``w13_scales``."""
    from pcie_a2a.quant import from_awq

    qc = scheme.quant_config
    group = int(qc.group_size)
    (gq, uq) = _halves(_cpu(layer.w13_qweight), 2)
    (gz, uz) = _halves(_cpu(layer.w13_qzeros), 2)
    (gs, us) = _halves(_cpu(layer.w13_scales), 2)

    def one(q, z, s):
        return from_awq(q.contiguous(), z.contiguous(), s.contiguous(), group_size=group)

    down = one(_cpu(layer.w2_qweight), _cpu(layer.w2_qzeros), _cpu(layer.w2_scales))
    return one(gq, gz, gs), one(uq, uz, us), down


_READERS = {
    "compressed_tensors": weights_compressed_tensors,
    "gptq": weights_gptq,
    "awq": weights_awq,
}

#: The loaded parameters each format leaves behind once converted (freed).
_LOADED = (
    "w13_weight_packed",
    "w2_weight_packed",
    "w13_weight_scale",
    "w2_weight_scale",
    "w13_weight_zero_point",
    "w2_weight_zero_point",
    "w13_weight_g_idx",
    "w2_weight_g_idx",
    "w13_g_idx_sort_indices",
    "w2_g_idx_sort_indices",
    "w13_qweight",
    "w2_qweight",
    "w13_scales",
    "w2_scales",
    "w13_qzeros",
    "w2_qzeros",
    "w13_g_idx",
    "w2_g_idx",
)


def convert_layer(scheme: Any, layer: Any):
    """Packs the layer's loaded INT4 experts for ``moe_int4_mlp`` and frees the loaded
    tensors; returns the :class:`PackedInt4Experts` (also set on the layer)."""
    from pcie_a2a.quant import PackedInt4Experts

    fmt = _format_of(scheme)
    device = next(t for t in layer.parameters()).device
    gate, up, down = _READERS[fmt](scheme, layer)
    dtype = _dtype_of(layer, gate.scales)
    try:
        experts = PackedInt4Experts.from_weights(gate, up, down, dtype)
    except ValueError as exc:
        raise ValueError(
            f"pcie_a2a: cannot pack the {fmt} INT4 experts of this layer for {dtype} "
            f"activations ({exc}); serve the model with --dtype matching its scales "
            f"({gate.scales.dtype})"
        ) from exc
    experts = experts.to(device)
    for name in _LOADED:
        p = getattr(layer, name, None)
        if isinstance(p, torch.Tensor):
            # keep the attribute (SGLang's code may look it up), drop the storage
            setattr(
                layer,
                name,
                torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), False),
            )
    setattr(layer, INT4_ATTR, experts)
    # SGLang's own seam for weights derived at load: its weight updater returns this
    # message (success False) from update_weights_from_disk / _tensor / _distributed /
    # _ipc before it writes anything, on every rank alike (every rank converts at load)
    layer._derived_weight_cache_error = RELOAD_REFUSED
    return experts


RELOAD_REFUSED = (
    "pcie_a2a: online weight updates are not supported for INT4 MoE layers under "
    "--moe-a2a-backend pcie: their experts run from pcie_a2a's packed copy, made once at "
    "load from the loaded tensors (which are then freed), and an in-place load would not "
    "refresh it; restart the server with the new checkpoint"
)


def _restore_weights_before_loading(original, self: Any, layer: Any, *a, **k):
    # SGLang's restore would re-grow the freed tensors with uninitialised storage that a
    # later process_weights_after_loading could pack: keep them empty, so a write that
    # bypasses the updater's refusal fails on their shape instead
    if getattr(layer, INT4_ATTR, None) is not None and _ours(layer):
        return None
    return original(self, layer, *a, **k)


def _eplb_enabled() -> bool:
    try:
        from sglang.srt.runtime_context import get_exec

        return bool(get_exec().moe.enable_eplb)
    except Exception:  # no published server config (offline use): no runtime EPLB
        return False


def _process_weights_after_loading(original, self: Any, layer: Any, *a, **k):
    if not _ours(layer):
        return original(self, layer, *a, **k)
    if _eplb_enabled():  # launch.py refuses this first; a second line before serving
        raise ValueError(
            "pcie_a2a: --enable-eplb with an INT4 MoE layer under --moe-a2a-backend pcie: "
            "SGLang's expert weight mover would not update pcie_a2a's packed experts; use "
            "--init-expert-location instead (docs/balance.md)"
        )
    if getattr(layer, INT4_ATTR, None) is None:
        convert_layer(self, layer)
    return None


# ---- forward -----------------------------------------------------------------------------
def runner_applies_routed_scaling(layer: Any) -> bool:
    """Whether the experts (not the model) owe ``routed_scaling_factor`` here: where
    SGLang's models leave it to the runner (CUDA, MUSA, XPU: see DeepseekV2MoE and
    Glm4MoeSparseMoeBlock), unless the top-k already folded it into the weights."""
    if getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False):
        return False
    import sglang.srt.utils as su

    return bool(su.is_cuda() or su.is_musa() or su.is_xpu())


def run_rows(layer: Any, dispatch_output: Any):
    """``moe_int4_mlp`` on the dispatcher's STANDARD output (rows, local ids, weights)."""
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

    from pcie_a2a.quant import moe_int4_mlp

    experts = getattr(layer, INT4_ATTR, None)
    if experts is None:
        raise RuntimeError(
            "pcie_a2a: INT4 MoE layer without packed experts: process_weights_after_loading "
            "did not run for this layer"
        )
    t = dispatch_output.topk_output
    weights = t.topk_weights.to(torch.float32)
    factor = getattr(layer.moe_runner_config, "routed_scaling_factor", None)
    if factor is not None and factor != 1.0 and runner_applies_routed_scaling(layer):
        weights = weights * float(factor)
    y = moe_int4_mlp(
        dispatch_output.hidden_states,
        t.topk_ids.to(torch.int32),
        weights,
        experts.w13,
        experts.w2,
    )
    return StandardCombineInput(hidden_states=y)


def expert_major_weights(layer: Any, weights: torch.Tensor) -> torch.Tensor:
    """Router weights for a decode dispatch of this INT4 layer in the expert-major layout,
    where the combine applies them: ``routed_scaling_factor`` folded in where the runner
    owes it (as :func:`run_rows` applies it on rows)."""
    factor = getattr(getattr(layer, "moe_runner_config", None), "routed_scaling_factor", None)
    if factor is not None and factor != 1.0 and runner_applies_routed_scaling(layer):
        return weights * float(factor)
    return weights


def run_expert_major(layer: Any, dispatch_output: Any):
    """``moe_int4_mlp_expert_major`` on the dispatcher's decode output (DeepEP's masked
    layout, ``masked_m`` on the device): unweighted expert outputs in the same layout."""
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPLLCombineInput

    from pcie_a2a.quant import moe_int4_mlp_expert_major

    experts = getattr(layer, INT4_ATTR, None)
    if experts is None:
        raise RuntimeError(
            "pcie_a2a: INT4 MoE layer without packed experts: process_weights_after_loading "
            "did not run for this layer"
        )
    d = dispatch_output
    y = moe_int4_mlp_expert_major(d.hidden_states, d.masked_m, experts.w13, experts.w2)
    return DeepEPLLCombineInput(y, d.topk_ids, d.topk_weights)


def _apply_weights(original, self: Any, layer: Any, dispatch_output: Any, *a, **k):
    if not _ours(layer):
        return original(self, layer, dispatch_output, *a, **k)
    from sglang.srt.layers.moe.token_dispatcher.base import DispatchOutputChecker

    if DispatchOutputChecker.format_is_deepep_ll(dispatch_output):  # decode
        return run_expert_major(layer, dispatch_output)
    return run_rows(layer, dispatch_output)


def hook_targets() -> list[tuple[str, Any]]:
    targets = []
    for cls in _SCHEMES.values():
        targets.append((f"{cls}.create_moe_runner", _create_moe_runner))
        targets.append((f"{cls}.process_weights_after_loading", _process_weights_after_loading))
        targets.append((f"{cls}.apply_weights", _apply_weights))
    # the only INT4 scheme with a restore step (the Triton variant inherits it)
    targets.append(
        (
            f"{_SCHEMES['compressed_tensors']}.restore_weights_before_loading",
            _restore_weights_before_loading,
        )
    )
    return targets
