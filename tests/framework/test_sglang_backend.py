"""SGLang 0.5.2x: plugin loading, argument parsing and the dispatcher, on 1-4 CPU ranks.

Every check runs inside spawned ranks (``run_ranks``) so that SGLang's process-global
plugin state and hooks never leak between tests or into the pytest process.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import numpy as np
import pytest
from fw_utils import declare_entry_point, dense_reference, import_framework, moe_problem

from dist_utils import run_ok

import_framework("sglang.srt.layers.moe.token_dispatcher")

from pcie_a2a.integrations import _common  # noqa: E402

declare_entry_point(
    "sglang.srt.plugins", "pcie_a2a.integrations.sglang:register", "PCIE_A2A_FWTEST_SGLANG_EP_DIR"
)


_TINY_QWEN3_MOE = {
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


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.name}: {record.getMessage()}")


def _load_plugins() -> list[str]:
    """SGLang's own loader, as launch_server/Engine/scheduler run it; returns log lines."""
    cap = _Capture()
    root = logging.getLogger()
    root.addHandler(cap)
    root.setLevel(logging.INFO)
    try:
        from sglang.srt.plugins import load_plugins

        load_plugins()
    finally:
        root.removeHandler(cap)
    return cap.lines


def _validated_dispatcher(moe_layer, cfg):
    """SGLang's hooked factory, called as from inside a validated MoE block's __init__
    (what Qwen3MoeSparseMoeBlock -> FusedMoE does; real blocks: test_sglang_models.py)."""
    from pcie_a2a.integrations.sglang import models

    stack = models._stack()
    stack.append("sglang.srt.models.qwen3_moe.Qwen3MoeSparseMoeBlock")
    try:
        return moe_layer.create_moe_dispatcher(cfg, None)
    finally:
        stack.pop()


def _use_backend(name: str) -> None:
    from sglang.srt.layers.moe.utils import MoeA2ABackend
    from sglang.srt.runtime_context import get_flags

    get_flags().moe.a2a_backend = MoeA2ABackend(name)


def _runner_config(world: int, num_experts: int, top_k: int, hidden: int):
    import torch
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    return MoeRunnerConfig(
        num_experts=num_experts,
        num_local_experts=num_experts // world,
        hidden_size=hidden,
        intermediate_size_per_partition=32,
        layer_id=0,
        top_k=top_k,
        num_fused_shared_experts=0,
        params_dtype=torch.bfloat16,
    )


# ---- plugin loading and argument parsing ---------------------------------------------------
def _plugin_worker(rank: int, world: int) -> dict:
    lines = _load_plugins()
    from sglang.srt.arg_groups import overrides
    from sglang.srt.layers.moe import utils as moe_utils
    from sglang.srt.layers.moe.fused_moe_triton import layer as moe_layer
    from sglang.srt.layers.moe.moe_runner.runner import MoeRunner
    from sglang.srt.layers.moe.utils import MoeA2ABackend, MoeRunnerBackend
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    from pcie_a2a.integrations.sglang import PcieA2ADispatcher, is_active

    out: dict = {"log": lines}
    out["alias"] = MoeA2ABackend("pcie").value
    out["enum_none"] = MoeA2ABackend(None).value  # the original _missing_ still runs
    out["enum_deepep"] = MoeA2ABackend("deepep").value
    try:
        MoeA2ABackend("nonsense")
        out["enum_bad"] = "accepted"
    except ValueError:
        out["enum_bad"] = "ValueError"
    # the CLI: both names parse, with EP8-style DP attention flags
    for name in ("pcie", "customized"):
        args = prepare_server_args(
            [
                "--model-path",
                "dummy",
                "--tp-size",
                "4",
                "--dp-size",
                "4",
                "--enable-dp-attention",
                "--moe-a2a-backend",
                name,
            ]
        )
        assert isinstance(args, ServerArgs)
        out[f"parsed_{name}"] = args.moe_a2a_backend
    try:
        prepare_server_args(["--model-path", "dummy", "--moe-a2a-backend", "nonsense"])
        out["bad_name"] = "accepted"
    except SystemExit:
        out["bad_name"] = "rejected"
    # SGLang's own resolution pipeline on a tiny Qwen3-MoE config: the EP-size pass
    # picks up our name (it logs the adjustment)
    model_dir = tempfile.mkdtemp(prefix="pcie_a2a_tinyqwen_")
    try:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(_TINY_QWEN3_MOE, f)
        args = prepare_server_args(
            [
                "--model-path",
                model_dir,
                "--tp-size",
                "4",
                "--dp-size",
                "4",
                "--enable-dp-attention",
                "--moe-a2a-backend",
                "pcie",
                "--skip-tokenizer-init",
                "--device",
                "cpu",
            ]
        )
        cap = _Capture()
        logging.getLogger().addHandler(cap)
        try:
            args.resolve_once()
        finally:
            logging.getLogger().removeHandler(cap)
        out["resolve_log"] = [line for line in cap.lines if "expert parallel size" in line]
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    # the EP-size pass alone: our backend spans EP over the TP group
    view = type("View", (), {"moe_a2a_backend": "pcie", "ep_size": 1, "tp_size": 4})()
    out["ep_pass"] = overrides._a2a_ep_size(view)
    view.moe_a2a_backend = "customized"
    out["ep_pass_customized"] = overrides._a2a_ep_size(view)

    _use_backend("pcie")
    out["active"] = is_active()
    cfg = _runner_config(1, 8, 2, 64)
    # outside a validated MoE block the hooked factory refuses, naming the caller
    try:
        moe_layer.create_moe_dispatcher(cfg, None)
        out["unvalidated"] = "built"
    except ValueError as exc:
        out["unvalidated"] = str(exc)
    disp = _validated_dispatcher(moe_layer, cfg)
    out["dispatcher"] = type(disp).__name__
    out["is_ours"] = isinstance(disp, PcieA2ADispatcher)
    out["hooked"] = hasattr(moe_layer.create_moe_dispatcher, "__wrapped__")
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    out["allreduce_hooked"] = [  # the TP all-reduce hooks (tests: test_sglang_allreduce.py)
        hasattr(getattr(GroupCoordinator, m), "__wrapped__")
        for m in ("__init__", "all_reduce", "destroy")
    ]
    out["complete"] = moe_utils.post_experts_output_is_complete(is_tp_path=False)
    out["complete_tp"] = moe_utils.post_experts_output_is_complete(is_tp_path=True)
    # runners: Triton needs nothing, Marlin needs our fused func under `customized`
    MoeRunner(MoeRunnerBackend.TRITON, cfg)
    marlin = MoeRunner(MoeRunnerBackend.MARLIN, cfg)
    out["marlin_fused"] = getattr(marlin.fused_func, "__name__", None)
    # FusedMoE's own all-reduce is turned off for layers on our dispatcher
    fake = type("FakeMoE", (), {})()
    fake.dispatcher, fake.reduce_results = disp, True
    from pcie_a2a.integrations.sglang.plugin import _fused_moe_init

    _fused_moe_init(None, fake)
    out["reduce_results"] = fake.reduce_results
    # inert with PCIE_A2A_SGLANG=0
    os.environ["PCIE_A2A_SGLANG"] = "0"
    out["inactive"] = is_active()
    del os.environ["PCIE_A2A_SGLANG"]
    # with the `none` backend the original factory runs (it needs SGLang's parallel state,
    # so an error from *inside* the original is the proof that it was called)
    _use_backend("none")
    try:
        d = moe_layer.create_moe_dispatcher(cfg, None)
        out["none_backend"] = type(d).__name__
    except Exception as exc:
        out["none_backend"] = f"original raised {type(exc).__name__}"
    return out


def test_plugin_loads_through_entry_point_and_parses():
    (res,) = run_ok(1, _plugin_worker, timeout=240)
    log = "\n".join(res["log"])
    print(log)
    assert "Loaded plugin pcie_a2a from group sglang.srt.plugins" in log
    assert "pcie_a2a SGLang backend registered" in log
    assert "Executed general plugin: pcie_a2a" in log
    assert res["alias"] == "customized"
    assert (res["enum_none"], res["enum_deepep"], res["enum_bad"]) == (
        "none",
        "deepep",
        "ValueError",
    )
    assert res["parsed_pcie"] == "pcie"
    assert res["parsed_customized"] == "customized"
    assert res["bad_name"] == "rejected"
    assert any(
        "pcie MoE is enabled. The expert parallel size is adjusted from 1 to the tensor "
        "parallel size [4]" in line
        for line in res["resolve_log"]
    ), res["resolve_log"]
    assert res["ep_pass"] == {"ep_size": 4}
    assert res["ep_pass_customized"] == {"ep_size": 4}
    assert res["active"] and res["is_ours"] and res["hooked"]
    assert res["allreduce_hooked"] == [True, True, True]
    assert "builds a MoE layer under --moe-a2a-backend pcie" in res["unvalidated"]
    assert "Qwen3MoeSparseMoeBlock" in res["unvalidated"]
    assert res["dispatcher"] == "PcieA2ADispatcher"
    assert res["complete"] is True and res["complete_tp"] is True
    assert res["marlin_fused"] == "fused_marlin"
    assert res["reduce_results"] is False
    assert res["inactive"] is False
    assert res["none_backend"] != "PcieA2ADispatcher"


# ---- dispatch / combine against a dense reference ------------------------------------------
def _dispatch_worker(rank: int, world: int, fmt: str, split: bool) -> dict:
    from sglang.srt.layers.dp_attention import set_is_extend_in_batch

    _load_plugins()
    _use_backend("pcie")
    os.environ["PCIE_A2A_SGLANG_FORMAT"] = fmt
    from sglang.srt.layers.moe.fused_moe_triton import layer as moe_layer
    from sglang.srt.layers.moe.token_dispatcher.base import (
        CombineInput,
        DispatchOutput,
        DispatchOutputChecker,
    )
    from sglang.srt.layers.moe.token_dispatcher.deepep import (
        DeepEPLLCombineInput,
        DeepEPNormalCombineInput,
    )
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from pcie_a2a.reference import expert_forward, expert_forward_expert_major

    num_experts, top_k, hidden = 4 * world, 3, 64
    e_local = num_experts // world
    cfg = _runner_config(world, num_experts, top_k, hidden)
    disp = _validated_dispatcher(moe_layer, cfg)
    results = []
    try:
        # extend (normal mode) then decode (low-latency), two layers' worth each
        for step in range(4):
            extend = step < 2
            set_is_extend_in_batch(extend)
            x, ids, w, w13, w2 = moe_problem(rank, world, num_experts, top_k, hidden, step)
            topk = StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=None)
            if split:
                disp.dispatch_a(hidden_states=x, topk_output=topk)
                out = disp.dispatch_b()
            else:
                out = disp.dispatch(hidden_states=x, topk_output=topk)
            assert isinstance(out, DispatchOutput)
            lw13 = w13[rank * e_local : (rank + 1) * e_local]
            lw2 = w2[rank * e_local : (rank + 1) * e_local]
            if fmt == "standard":
                assert DispatchOutputChecker.format_is_standard(out)
                t = out.topk_output
                ids_l = t.topk_ids
                assert ids_l.numel() == 0 or int(ids_l.max()) < e_local
                y = expert_forward(out.hidden_states, ids_l, t.topk_weights, lw13, lw2)
                cin = StandardCombineInput(hidden_states=y)
            elif fmt == "deepep_normal" and extend:
                assert DispatchOutputChecker.format_is_deepep_normal(out)
                assert sum(out.num_recv_tokens_per_expert) == int((out.topk_ids >= 0).sum())
                y = expert_forward(out.hidden_states, out.topk_ids, out.topk_weights, lw13, lw2)
                cin = DeepEPNormalCombineInput(y, out.topk_ids, out.topk_weights)
            else:
                assert DispatchOutputChecker.format_is_deepep_ll(out)
                assert out.hidden_states.shape[0] == e_local
                assert out.masked_m.device == x.device and out.masked_m.shape == (e_local,)
                y = expert_forward_expert_major(out.hidden_states, out.masked_m, lw13, lw2)
                cin = DeepEPLLCombineInput(y, out.topk_ids, out.topk_weights)
            assert isinstance(cin, CombineInput)
            if split:
                disp.combine_a(combine_input=cin)
                got = disp.combine_b()
            else:
                got = disp.combine(combine_input=cin)
            want = dense_reference(x, ids, w, w13, w2)
            assert got.shape == x.shape and got.dtype == x.dtype
            err = (got.float() - want).abs().max().item() if x.shape[0] else 0.0
            scale = want.abs().max().item() if x.shape[0] else 1.0
            results.append((x.shape[0], err, scale, "extend" if extend else "decode"))
    finally:
        _common.close_buffers()
    return {"results": results}


@pytest.mark.parametrize(
    "world,fmt,split",
    [
        (2, "standard", False),
        (4, "standard", True),
        (3, "deepep_normal", False),
        (2, "deepep_ll", False),
    ],
)
def test_dispatch_combine_matches_dense_moe(world, fmt, split):
    outs = run_ok(world, _dispatch_worker, fmt, split, timeout=300)
    for rank, res in enumerate(outs):
        for tokens, err, scale, mode in res["results"]:
            assert err <= 0.02 * max(scale, 1e-3) + 1e-2, (rank, tokens, err, scale, mode)
    assert any(t == 0 for r in outs for t, *_ in r["results"]) or world < 3


def test_version_gate_messages():
    args = ("sglang", None, (0, 5, 20), (0, 6), "PCIE_A2A_SGLANG_SKIP_VERSION_CHECK")
    assert _common.check_version(args[0], "0.5.23", *args[2:]) == "0.5.23"
    assert _common.check_version(args[0], "0.5.20", *args[2:]) == "0.5.20"
    for bad in ("0.5.19", "0.4.0", "0.6.0"):
        with pytest.raises(ImportError, match=r"supports sglang >=0\.5\.20,<0\.6"):
            _common.check_version(args[0], bad, *args[2:])
    import pcie_a2a.integrations.sglang as plugin

    assert plugin.SGLANG_VERSION == "0.5.23"
    assert np.array_equal(np.array(_common.parse_version("0.5.23.post1")), [0, 5, 23])


# ---- INT4: SGLang's Marlin runner -> our fused func -> moe_int4_mlp on the rows -------------
def _int4_experts(num_experts: int, hidden: int, inter: int, lo: int, hi: int):
    """Random INT4 experts (same on every rank), packed for experts [lo, hi)."""
    import torch

    from pcie_a2a.quant import Int4Weights, PackedInt4Experts, random_int4

    g = torch.Generator().manual_seed(7)
    gate = random_int4(num_experts, inter, hidden, group_size=32, generator=g, scale=0.05)
    up = random_int4(num_experts, inter, hidden, group_size=32, generator=g, scale=0.05)
    down = random_int4(num_experts, hidden, inter, group_size=32, generator=g, scale=0.05)

    def cut(w: Int4Weights) -> Int4Weights:
        return Int4Weights(w.codes[lo:hi], w.scales[lo:hi], None, w.group_size, None)

    return PackedInt4Experts.from_weights(cut(gate), cut(up), cut(down), torch.bfloat16)


def _int4_worker(rank: int, world: int) -> dict:
    import torch

    _load_plugins()
    _use_backend("pcie")
    from sglang.srt.layers.moe.fused_moe_triton import layer as moe_layer
    from sglang.srt.layers.moe.moe_runner.runner import MoeRunner
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    from pcie_a2a.integrations.sglang import attach_int4_experts
    from pcie_a2a.quant import moe_int4_mlp_reference

    num_experts, top_k, hidden, inter = 4 * world, 3, 128, 64
    e_local = num_experts // world
    cfg = _runner_config(world, num_experts, top_k, hidden)
    cfg.layer = torch.nn.Module()
    attach_int4_experts(cfg.layer, _int4_experts(num_experts, hidden, inter, *_span(rank, e_local)))
    everything = _int4_experts(num_experts, hidden, inter, 0, num_experts)
    disp = _validated_dispatcher(moe_layer, cfg)
    runner = MoeRunner(MoeRunnerBackend.MARLIN, cfg)
    try:
        x, ids, w, _, _ = moe_problem(rank, world, num_experts, top_k, hidden, 3)
        topk = StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=None)
        out = disp.dispatch(hidden_states=x, topk_output=topk)
        got = disp.combine(combine_input=runner.run(out, None))
        want = moe_int4_mlp_reference(x, ids, w, everything.w13, everything.w2).float()
        err = (got.float() - want).abs().max().item() if x.shape[0] else 0.0
        scale = want.abs().max().item() if x.shape[0] else 1.0
    finally:
        _common.close_buffers()
    return {"fused": runner.fused_func.__name__, "err": err, "scale": scale, "t": x.shape[0]}


def _span(rank: int, e_local: int) -> tuple[int, int]:
    return rank * e_local, (rank + 1) * e_local


def test_marlin_runner_runs_moe_int4_mlp_on_rows():
    outs = run_ok(3, _int4_worker, timeout=300)
    for res in outs:
        assert res["fused"] == "fused_marlin"
        assert res["err"] <= 0.02 * max(res["scale"], 1e-3) + 1e-2, res
    assert any(r["t"] == 0 for r in outs)
