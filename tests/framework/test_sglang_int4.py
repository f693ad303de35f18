"""INT4 MoE layers of real SGLang blocks under ``--moe-a2a-backend pcie``, on 2 CPU ranks.

A DeepseekV2MoE (DeepSeek-V3 / Kimi K2 shape, routed_scaling_factor 2.5) quantized with
Kimi K2's compressed-tensors W4A16 scheme, and Qwen3-MoE blocks quantized with GPTQ and
AWQ (Marlin schemes), are built by SGLang with its parallel state (TP 2 = EP 2, DP
attention), loaded through SGLang's weight loaders from checkpoint-format tensors, and
post-processed by SGLang's loader step: the plugin must convert the loaded experts to
PackedInt4Experts (originals freed) and run ``moe_int4_mlp`` in ``apply_weights``. Each
rank's output must equal an fp32 reference from the dequantized checkpoint with SGLang's
own router: ``factor * sum_k w_k E_k(x) + shared(x)``, both where the model applies the
factor (CPU) and where the experts must (CUDA: simulated by flipping SGLang's platform
flags, so the factor is applied by exactly one side in each case).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from fw_utils import declare_entry_point, import_framework

from dist_utils import run_ok

import_framework("sglang.srt.layers.moe.token_dispatcher")

declare_entry_point(
    "sglang.srt.plugins", "pcie_a2a.integrations.sglang:register", "PCIE_A2A_FWTEST_SGLANG_EP_DIR"
)

WORLD = 2
GROUP = 32
KIMI_CT = {  # Kimi K2 Thinking's quantization_config (routed experts only)
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": GROUP,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.gate$"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


@pytest.fixture(scope="module")
def model_root():
    import sglang_blocks as sb

    root = tempfile.mkdtemp(prefix="pcie_a2a_sglang_int4_")
    sb.write_model_dir(root, sb.DEEPSEEK, "deepseek_v3")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _experts(num: int, hidden: int, inter: int, seed: int, symmetric: bool):
    import torch

    from pcie_a2a.quant import random_int4

    g = torch.Generator().manual_seed(seed)
    mk = dict(group_size=GROUP, generator=g, scale=0.05, symmetric=symmetric)
    return [
        (
            random_int4(inter, hidden, **mk),
            random_int4(inter, hidden, **mk),
            random_int4(hidden, inter, **mk),
        )
        for _ in range(num)
    ]


def _load_int4(moe, weights, fmt: str, prefix: str) -> None:
    """Checkpoint tensors -> SGLang's FusedMoE.weight_loader, as the model loader does."""
    from pcie_a2a.quant import to_awq, to_compressed_tensors, to_gptq

    write = {"compressed_tensors": to_compressed_tensors, "gptq": to_gptq, "awq": to_awq}[fmt]
    param = {  # checkpoint tensor name -> FusedMoE parameter suffix
        "compressed_tensors": {
            "weight_packed": "weight_packed",
            "weight_scale": "weight_scale",
            "weight_shape": "weight_shape",
        },
        "gptq": {"qweight": "qweight", "scales": "scales"},
        "awq": {"qweight": "qweight", "scales": "scales", "qzeros": "qzeros"},
    }[fmt]
    for e, (gate, up, down) in enumerate(weights):
        for shard, proj, w in (
            ("w1", "gate_proj", gate),
            ("w3", "up_proj", up),
            ("w2", "down_proj", down),
        ):
            tensors = write(w)
            side = "w2" if shard == "w2" else "w13"
            for key, suffix in param.items():
                target = getattr(moe, f"{side}_{suffix}")
                name = f"{prefix}.experts.{e}.{proj}.{key}"
                moe.weight_loader(target, tensors[key], name, shard, e)


def _reference(x, topk_weights, topk_ids, weights, factor: float):
    import torch

    out = torch.zeros(x.shape, dtype=torch.float32)
    xf = x.float()
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            gate, up, down = weights[int(topk_ids[t, k])]
            h = torch.nn.functional.silu(xf[t] @ gate.dequantize().T) * (xf[t] @ up.dequantize().T)
            out[t] += float(topk_weights[t, k]) * (h @ down.dequantize().T)
    return factor * out


def _ct_config():
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    return CompressedTensorsConfig.from_config(KIMI_CT)


def _marlin_config(fmt: str):
    if fmt == "gptq":
        from sglang.srt.layers.quantization.gptq.gptq import GPTQMarlinConfig

        raw = {"bits": 4, "group_size": GROUP, "desc_act": False, "sym": True, "lm_head": False}
        return GPTQMarlinConfig.from_config({**raw, "quant_method": "gptq"})
    from sglang.srt.layers.quantization.awq import awq

    # AWQ-Marlin's config asks the GPU's compute capability (none on CPU); under pcie
    # the layer never runs Marlin, so the test skips that check
    awq.verify_marlin_supported = lambda *a, **k: None
    AWQMarlinConfig = awq.AWQMarlinConfig
    raw = {"bits": 4, "group_size": GROUP, "zero_point": True, "lm_head": False}
    return AWQMarlinConfig.from_config({**raw, "quant_method": "awq"})


def _run_block(block, x, fb):
    import torch

    with torch.no_grad():
        return block(x, fb)


def _int4_worker(rank: int, world: int, root: str) -> dict:
    import sglang_blocks as sb
    import torch
    from sglang.srt.layers.quantization.base_config import QuantizeMethodBase

    from pcie_a2a.integrations import _common
    from pcie_a2a.integrations.sglang.int4 import INT4_ATTR
    from pcie_a2a.quant import PackedInt4Experts

    sb.load_plugins_quietly()
    sb.cpu_shims()
    sb.server_state(rank, world, os.path.join(root, "deepseek_v3"), "pcie", True)
    cfg = sb.DEEPSEEK
    hidden, inter, num = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    out: dict = {}
    try:
        weights = _experts(num, hidden, inter, seed=11, symmetric=True)
        block, *_ = sb.build_block("deepseek_v3", quant_config=_ct_config())
        moe = block.experts
        sb.load_block(block, seed=4)  # router, shared experts (bf16: ignored by the scheme)
        _load_int4(moe, weights, "compressed_tensors", "model.layers.1.mlp")
        assert isinstance(moe.quant_method, QuantizeMethodBase)
        moe.quant_method.process_weights_after_loading(moe)  # SGLang's loader step
        packed = getattr(moe, INT4_ATTR, None)
        out["packed"] = isinstance(packed, PackedInt4Experts) and packed.num_experts == num // world
        out["freed"] = moe.w13_weight_packed.numel() == 0 and moe.w2_weight_scale.numel() == 0
        out["scheme"] = type(moe.scheme).__name__
        t = 5 if rank == 0 else 3
        g = torch.Generator().manual_seed(50 + rank)
        x = (torch.randn(t, hidden, generator=g) * 0.5).to(torch.bfloat16)
        fb = sb.forward_batch([5, 3], t, True, hidden)
        with torch.no_grad():
            topk = block.topk(x, block.gate(x))
            shared = block.shared_experts(x).float()
        factor = cfg["routed_scaling_factor"]
        want = _reference(x, topk.topk_weights, topk.topk_ids, weights, factor) + shared
        scale = want.abs().max().item()
        got_cpu = _run_block(block, x, fb).float()
        out["err_cpu"] = (got_cpu - want).abs().max().item() / scale
        # where SGLang's models leave the factor to the experts (CUDA)
        import sglang.srt.models.deepseek_v2 as dsv2
        import sglang.srt.utils as su

        real = su.is_cuda
        su.is_cuda, dsv2._is_cuda = (lambda: True), True
        try:
            got_cuda = _run_block(block, x, fb).float()
        finally:
            su.is_cuda, dsv2._is_cuda = real, False
        out["err_cuda"] = (got_cuda - want).abs().max().item() / scale
        out["unscaled_gap"] = (want - shared - (want - shared) / factor).abs().max().item() / scale
        out.update(_online_updates(rank, block, moe, x, fb, root, got_cpu))
        out.update(_construction_refusals(cfg))
        # GPTQ (symmetric) and AWQ (zero points) on Qwen3-MoE blocks; Marlin's schemes
        # take only layers with N % 128 == 0 and K % 64 == 0, hence a wider block
        q3 = dict(sb.QWEN3_MOE, hidden_size=128, moe_intermediate_size=64)
        x3 = (torch.randn(t, 128, generator=g) * 0.5).to(torch.bfloat16)
        fb3 = sb.forward_batch([5, 3], t, True, 128)
        for fmt in ("gptq", "awq"):
            qw = _experts(q3["num_experts"], 128, 64, seed=13, symmetric=fmt == "gptq")
            blk, *_ = sb.build_block("qwen3_moe", _marlin_config(fmt), q3)
            sb.load_block(blk, seed=6)
            _load_int4(blk.experts, qw, fmt, "model.layers.1.mlp")
            blk.experts.quant_method.process_weights_after_loading(blk.experts)
            with torch.no_grad():
                tk = blk.topk(x3, blk.gate(x3)[0])
            ref = _reference(x3, tk.topk_weights, tk.topk_ids, qw, 1.0)
            got = _run_block(blk, x3, fb3).float()
            out[f"err_{fmt}"] = (got - ref).abs().max().item() / ref.abs().max().item()
            out[f"scheme_{fmt}"] = type(getattr(blk.experts, "scheme", None)).__name__
            out[f"freed_{fmt}"] = blk.experts.w13_qweight.numel() == 0
        # what the kernel does not compute is refused when the layer is built
        try:
            sb.build_block("deepseek_v3", _ct_config(), dict(cfg, swiglu_limit=7.0))
            out["swiglu"] = "built"
        except ValueError as exc:
            out["swiglu"] = str(exc)
        # the refused block's __init__ ran with SGLang's SGLANG_SHARED_EXPERT_TP1 switch on:
        # it must be off again (the next model built in this process would otherwise
        # replicate its shared experts under any backend)
        out["tp1_after_refusal"] = os.environ.get("SGLANG_SHARED_EXPERT_TP1")
    finally:
        _common.close_buffers()
    return out


def _online_updates(rank, block, moe, x, fb, root, before) -> dict:
    """SGLang's own weight updater on the packed layer: every online update path is
    refused before it writes anything, and a weight-update session's restore + post-
    processing leaves the packed experts serving what they served."""
    import torch
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.model_loader.loader import DefaultModelLoader

    model = torch.nn.Module()  # what the updater walks: the block as a model's module
    model.mlp = block
    wu = WeightUpdater(
        tp_rank=rank,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=lambda *a, **k: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: None,
    )
    name = "mlp.experts.0.gate_proj.weight_packed"
    new = torch.zeros(moe.intermediate_size_per_partition, moe.hidden_size // 8, dtype=torch.int32)
    out = {
        "from_tensor": wu.update_weights_from_tensor([(name, new)]),
        "from_disk": wu.update_weights_from_disk(os.path.join(root, "deepseek_v3"), "auto"),
        "from_distributed": wu.load_weights_from_distributed([(name, new)]),
    }
    cpu = torch.device("cpu")
    DefaultModelLoader.restore_weights_before_loading(model, cpu)  # begin_weight_update
    out["still_freed"] = moe.w13_weight_packed.numel() == 0
    DefaultModelLoader.postprocess_weights(model, cpu)  # end_weight_update
    out["same_after_session"] = bool(
        torch.equal(_run_block(block, x, fb), before.to(torch.bfloat16))
    )
    return out


def _construction_refusals(cfg) -> dict:
    """Refusals when a layer is built on our dispatcher, through SGLang's own blocks:
    DeepSeek (routed_scaling_factor 2.5, left to the runner on CUDA) in the DeepEP
    formats, and a runner backend whose top-k routes inside the kernel."""
    import sglang.srt.utils as su
    import sglang_blocks as sb
    from sglang.srt.layers.moe.utils import MoeRunnerBackend
    from sglang.srt.runtime_context import get_flags

    out = {}
    real = su.is_cuda
    su.is_cuda = lambda: True  # where the experts owe the factor (what the check asks)
    try:
        for fmt in ("deepep_normal", "deepep_ll", "standard"):
            os.environ["PCIE_A2A_SGLANG_FORMAT"] = fmt
            try:
                sb.build_block("deepseek_v3")
                out[f"fmt_{fmt}"] = "built"
            except ValueError as exc:
                out[f"fmt_{fmt}"] = str(exc)
    finally:
        os.environ.pop("PCIE_A2A_SGLANG_FORMAT", None)
        su.is_cuda = real
    os.environ["PCIE_A2A_SGLANG_FORMAT"] = "deepep_normal"  # off CUDA the model scales
    try:
        sb.build_block("deepseek_v3")
        out["fmt_cpu"] = "built"
    except ValueError as exc:
        out["fmt_cpu"] = str(exc)
    finally:
        os.environ.pop("PCIE_A2A_SGLANG_FORMAT", None)
    moe = get_flags().moe
    saved = moe.runner_backend
    moe.runner_backend = MoeRunnerBackend.TRITON_KERNELS
    try:
        sb.build_block("qwen3_moe")
        out["runner"] = "built"
    except Exception as exc:
        out["runner"] = f"{type(exc).__name__}: {exc}"
    finally:
        moe.runner_backend = saved
    return out


def test_compressed_tensors_routed_to_moe_int4_mlp_with_scaling(model_root):
    outs = run_ok(WORLD, _int4_worker, model_root, timeout=420)
    for res in outs:
        assert res["scheme"] == "CompressedTensorsWNA16MoE"
        assert res["packed"] and res["freed"], res
        # bf16 output of an fp32 reference: a few bf16 ulps of the largest value
        assert res["err_cpu"] <= 0.02 and res["err_cuda"] <= 0.02, res
        # a dropped (or doubled) factor would be far outside that tolerance
        assert res["unscaled_gap"] > 0.1, res
        assert "swiglu_limit=7.0" in res["swiglu"] and "not compute" in res["swiglu"], res
        assert res["scheme_gptq"] == "GPTQMarlinMoEScheme", res
        assert res["scheme_awq"] == "AWQMoEScheme", res
        assert res["err_gptq"] <= 0.02 and res["err_awq"] <= 0.02, res
        assert res["freed_gptq"] and res["freed_awq"], res
        assert res["tp1_after_refusal"] is None, res
        for path in ("from_tensor", "from_disk", "from_distributed"):
            ok, msg = res[path]
            assert ok is False and "online weight updates are not supported" in msg, (path, msg)
        assert res["still_freed"] and res["same_after_session"], res
        for fmt in ("deepep_normal", "deepep_ll"):
            assert f"PCIE_A2A_SGLANG_FORMAT={fmt} with this model" in res[f"fmt_{fmt}"], res
            assert "routed_scaling_factor=2.5" in res[f"fmt_{fmt}"], res
        assert res["fmt_standard"] == "built" and res["fmt_cpu"] == "built", res
        assert "--moe-runner-backend triton_kernel is not supported" in res["runner"], res


#: physical -> logical expert (8 experts + 2 redundant, 5 slots per rank): rank 1 holds
#: second copies of experts 0 and 1, so its tokens for them stay on rank 1
REDUNDANT_MAP = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]


def _redundant_worker(rank: int, world: int, root: str) -> dict:
    """Kimi K2's INT4 scheme with redundant experts and a placement file: SGLang loads
    every physical copy, the plugin packs every local slot, SGLang's top-k emits physical
    ids, and each rank's output equals the fp32 reference over the logical experts."""
    import json

    import sglang_blocks as sb
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb import expert_location as el

    from pcie_a2a.integrations import _common
    from pcie_a2a.integrations.sglang.int4 import INT4_ATTR

    sb.load_plugins_quietly()
    sb.cpu_shims()
    model_dir = os.path.join(root, "deepseek_v3")
    placement = os.path.join(root, f"placement_{rank}.json")
    with open(placement, "w") as f:
        json.dump({"physical_to_logical_map": [REDUNDANT_MAP] * 2}, f)
    extra = ["--ep-num-redundant-experts", "2", "--init-expert-location", placement]
    args = sb.server_state(rank, world, model_dir, "pcie", True, extra)
    el.set_global_expert_location_metadata(
        el.compute_initial_expert_location_metadata(ModelConfig.from_server_args(args), rank)
    )
    cfg = sb.DEEPSEEK
    hidden, inter, num = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    out: dict = {}
    try:
        weights = _experts(num, hidden, inter, seed=11, symmetric=True)
        block, *_ = sb.build_block("deepseek_v3", quant_config=_ct_config())
        sb.load_block(block, seed=4)
        _load_int4(block.experts, weights, "compressed_tensors", "model.layers.1.mlp")
        block.experts.quant_method.process_weights_after_loading(block.experts)
        out["slots"] = getattr(block.experts, INT4_ATTR).num_experts
        t = 6 if rank == 0 else 4
        g = torch.Generator().manual_seed(70 + rank)
        x = (torch.randn(t, hidden, generator=g) * 0.5).to(torch.bfloat16)
        fb = sb.forward_batch([6, 4], t, True, hidden)
        with torch.no_grad():
            topk = block.topk(x, block.gate(x))
            shared = block.shared_experts(x).float()
        phys = topk.topk_ids.long()
        out["physical_ids"] = sorted(set(phys.reshape(-1).tolist()))
        logical = torch.tensor(REDUNDANT_MAP)[phys]
        factor = cfg["routed_scaling_factor"]
        want = _reference(x, topk.topk_weights, logical, weights, factor) + shared
        got = _run_block(block, x, fb).float()
        out["err"] = (got - want).abs().max().item() / want.abs().max().item()
    finally:
        _common.close_buffers()
    return out


def test_compressed_tensors_with_redundant_experts_and_a_placement_file(model_root):
    outs = run_ok(WORLD, _redundant_worker, model_root, timeout=420)
    for rank, res in enumerate(outs):
        assert res["slots"] == len(REDUNDANT_MAP) // WORLD, res  # every local slot packed
        assert res["err"] <= 0.02, (rank, res)
        assert all(0 <= p < len(REDUNDANT_MAP) for p in res["physical_ids"]), res
    # rank 1 sends its tokens for experts 0 and 1 to its own copies (physical 8 and 9)
    assert {8, 9} & set(outs[1]["physical_ids"]), outs[1]
    assert not {8, 9} & set(outs[0]["physical_ids"]), outs[0]
