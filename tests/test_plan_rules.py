"""`pcie-a2a plan`: the framework constraint rules, memory-fit boundaries and the launch
command lines."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest

from pcie_a2a.configplan import launch
from pcie_a2a.configplan.configs import Config, candidates
from pcie_a2a.configplan.memory import memory, stage_layers, weights_per_gpu
from pcie_a2a.configplan.models import from_hf_config, load_model
from pcie_a2a.configplan.rules import reasons
from pcie_a2a.configplan.stacks import GIB, STACKS
from pcie_a2a.gpus import GPUS

PRO = GPUS["rtx-pro-6000"]
VLLM, SGL = STACKS["vllm-tuned"], STACKS["sglang-stock"]


def _why(cfg, model="kimi-k2.6", gpus=8):
    return reasons(cfg, load_model(model) if isinstance(model, str) else model, gpus)


# (config, model, gpus, framework that refuses it or "both", fragment of the reason)
REFUSED = [
    (Config(16), "kimi-k2.6", 8, "both", "needs 16 GPUs, 8 available"),
    (Config(8, ep=3, comm="allreduce"), "kimi-k2.6", 8, "both", "ep_size 3 must divide"),
    (Config(8, attn_dp=3, ep=8, comm="ag-rs"), "kimi-k2.6", 8, "both", "must divide the TP"),
    (Config(6), "kimi-k2.6", 8, "both", "64 attention heads do not split"),
    (Config(16, ep=16, comm="allreduce"), "mixtral-8x7b", 16, "both", "8 experts do not split"),
    (Config(8), "qwen3-235b-a22b-fp8", 8, "both", "multiple of the 128 weight block"),
    (Config(8, 1, 8, 8, "a2a-nccl"), "kimi-k2.6", 8, "sglang", "no NCCL all-to-all"),
    (Config(8, 1, 8, 8, "a2a-nccl"), "kimi-k2.6", 8, "vllm", "#42254"),
    (Config(8, ep=8, comm="pcie_a2a"), "kimi-k2.6", 8, "vllm", "--data-parallel-size > 1"),
    (Config(8, ep=8, comm="ag-rs"), "kimi-k2.6", 8, "sglang", "planned with DP attention"),
    (Config(8, 1, 8, 8, "pcie_a2a", 16), "kimi-k2.6", 8, "vllm", "refuses EPLB / redundant"),
    (Config(8, ep=4, comm="allreduce"), "kimi-k2.6", 8, "vllm", "no MoE TP inside EP"),
    (Config(8, 1, 2, 8, "allreduce"), "kimi-k2.6", 8, "sglang", "the TP-attention layout"),
    (Config(8, 1, 2, 8, "allreduce"), "kimi-k2.6", 8, "vllm", "not all-reduce"),
    (Config(8, 2, 2, 8, "ag-rs"), "kimi-k2.6", 16, "sglang", "pipeline parallelism"),
    (Config(2, 62), "kimi-k2.6", 124, "both", "pp 62 > 61 layers"),
]


@pytest.mark.parametrize("cfg, model, gpus, fw, fragment", REFUSED)
def test_refused_with_the_reason(cfg, model, gpus, fw, fragment):
    why = _why(cfg, model, gpus)
    for f in ("sglang", "vllm") if fw == "both" else (fw,):
        assert any(fragment in r for r in why[f]), (f, why[f])


ACCEPTED = [
    (Config(8), "both"),
    (Config(8, ep=8, comm="allreduce"), "both"),
    (Config(8, ep=4, comm="allreduce"), "sglang"),  # MoE TP 2 inside EP 4
    (Config(8, 1, 8, 8, "ag-rs"), "both"),
    (Config(8, 1, 4, 8, "pcie_a2a"), "both"),
    (Config(8, ep=8, comm="pcie_a2a"), "sglang"),  # TP attention: SGLang scatters the batch
    (Config(8, 1, 8, 8, "pcie_a2a", 16), "sglang"),  # redundant experts through pcie_a2a
    (Config(4, 2), "both"),
    (Config(1, 8), "both"),
]


@pytest.mark.parametrize("cfg, fw", ACCEPTED)
def test_accepted(cfg, fw):
    why = _why(cfg)
    for f in ("sglang", "vllm") if fw == "both" else (fw,):
        assert why[f] == [], (f, why[f])


def test_fp8_and_int4_slices():
    # Qwen3-235B FP8: 1536 / MoE TP 4 = 384 is a multiple of 128; / 8 = 192 is not
    assert _why(Config(4), "qwen3-235b-a22b-fp8", 4)["vllm"] == []
    gptq = {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "vocab_size": 151936,
        "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128},
    }  # fmt: skip
    m = from_hf_config(gptq)
    assert m.fmt("experts").label == "int4-g128" and m.fmt("lm_head").kind == "bf16"
    assert any("multiple of 64" in r for r in _why(Config(8), m)["sglang"])  # 96
    assert any("group size 128" in r for r in _why(Config(4), m)["sglang"])  # 192
    assert _why(Config(2), m, 2)["sglang"] == []  # 384


def test_candidates_cover_the_issue_list():
    names = {c.name for c in candidates(8)}
    for want in (
        "TP8",
        "PP8",
        "TP8+EP8 all-reduce",
        "DP8+EP8 NCCL a2a",
        "DP8+EP8 pcie_a2a",
        "DP8+EP8 AG/RS",
        "TP4xPP2",
        "TP2xPP4",
    ):
        assert want in names
    assert all(c.gpus <= 8 for c in candidates(8) if not c.tried)
    assert any(c.tried and c.gpus > 8 for c in candidates(8))


# ---- memory -------------------------------------------------------------------------------


def test_dp8_weights_by_hand_and_out_of_memory():
    m = load_model("kimi-k2.6")
    cfg = Config(8, 1, 8, 8, "ag-rs")
    split, repl = m.attention_params()
    by_hand = (
        61 * 2 * (split + repl)  # attention replicated on every DP rank
        + 60 * (48 * 24_772_608 + 2 * 384 * 7168 + 3 * 7168 * 2048 * 2)  # experts, gate, shared
        + 3 * 7168 * 18432 * 2  # dense layer 0
        + 2 * 2 * 163840 * 7168  # embedding + LM head
        + 400e6 * 2  # vision tower
    )
    assert weights_per_gpu(m, cfg, 0) == pytest.approx(by_hand)
    mem = memory(m, cfg, PRO, VLLM, 4096, 2.0)
    assert mem.budget == pytest.approx(0.9 * 96 * GIB)
    assert not mem.fits and mem.max_requests == 0 and mem.kv_free < 0
    assert "out of memory by" in mem.summary()


def test_kv_capacity_boundary():
    m = load_model("kimi-k2.6")
    cfg = Config(8)
    base = memory(m, cfg, PRO, VLLM, 1, 2.0)
    per_token = 61 * 1152  # MLA latent per token, every TP rank holds it
    assert base.kv_per_request == per_token
    fits_one = int(base.kv_free // per_token)  # the longest single request that fits
    assert memory(m, cfg, PRO, VLLM, fits_one, 2.0).max_requests == 1
    over = memory(m, cfg, PRO, VLLM, fits_one + 1, 2.0)
    assert over.max_requests == 0 and not over.fits
    half = memory(m, cfg, PRO, VLLM, fits_one // 2, 2.0)
    assert half.max_requests == 2
    assert memory(m, cfg, PRO, VLLM, fits_one, 1.0).max_requests == 2  # fp8 KV: half


def test_sglang_reserve_and_pcie_a2a_buffers():
    m = load_model("kimi-k2.6")
    s = memory(m, Config(8), PRO, SGL, 4096, 2.0)
    # 512 MiB + 8192 x 1.5 MiB + tp*pp/8 GiB (SGLang memory_hook.py), at least 10 GiB
    assert s.budget == pytest.approx(96 * GIB - (512 + 8192 * 1.5 + 1024) * 2**20)
    ag = memory(m, Config(8, 1, 4, 8, "ag-rs"), PRO, VLLM, 4096, 2.0)
    ours = memory(m, Config(8, 1, 4, 8, "pcie_a2a"), PRO, VLLM, 4096, 2.0)
    assert ours.buffers > ag.buffers + 1 * GIB  # 8192 tokens x 8 sources x 2 parities
    assert ours.max_requests < ag.max_requests


def test_stage_layers_split():
    m = load_model("kimi-k2.6")
    assert stage_layers(m, 8) == [(8, 7), (8, 8), (8, 8), (8, 8), (8, 8), (7, 7), (7, 7), (7, 7)]
    assert sum(n for n, _ in stage_layers(m, 3)) == 61


# ---- launch lines -------------------------------------------------------------------------


def _args(line: str) -> dict:
    toks = shlex.split(line)
    out, i = {}, 0
    while i < len(toks):
        if toks[i].startswith("--"):
            val = toks[i + 1] if i + 1 < len(toks) and not toks[i + 1].startswith("--") else ""
            out[toks[i]] = val
        i += 1
    return out


def test_launch_lines_for_pcie_a2a():
    cfg = Config(8, 1, 8, 8, "pcie_a2a")
    sg = launch.sglang(cfg, "moonshotai/Kimi-K2.6", 4096, False, 8192)
    a = _args(sg)
    assert a["--tp-size"] == "8" and a["--dp-size"] == "8" and "--enable-dp-attention" in a
    assert a["--moe-a2a-backend"] == "pcie" and "--disable-shared-experts-fusion" in a
    assert "--disable-cuda-graph" in a and "--ep-size" not in a  # the backend sets ep = tp
    assert sg.startswith("PCIE_A2A_PAYLOAD=fp8 python -m sglang.launch_server")
    vl = launch.vllm(cfg, "moonshotai/Kimi-K2.6", 4096, True, 8192)
    a = _args(vl)
    assert vl.startswith("PCIE_A2A_VLLM=1 ")
    assert a["--tensor-parallel-size"] == "1" and a["--data-parallel-size"] == "8"
    assert "--enable-expert-parallel" in a and "--enforce-eager" in a
    assert a["--kv-cache-dtype"] == "fp8" and a["--max-model-len"] == "4096"
    assert "PCIE_A2A_MAX_TOKENS_PER_RANK=8192" in vl


def test_pcie_a2a_launch_line_with_redundant_experts():
    sg = launch.sglang(Config(8, 1, 8, 8, "pcie_a2a", 16), "m", 0, False, 8192)
    a = _args(sg)
    assert a["--moe-a2a-backend"] == "pcie" and a["--ep-num-redundant-experts"] == "16"
    assert a["--init-expert-location"] == launch.PCIE_A2A_PLACEMENT_FILE
    plain = _args(launch.sglang(Config(8, 1, 8, 8, "pcie_a2a"), "m", 0, False, 8192))
    assert "--ep-num-redundant-experts" not in plain and "--init-expert-location" not in plain


def test_launch_lines_without_pcie_a2a():
    tp = launch.vllm(Config(4, 2), "m", 0, False, 8192)
    assert "PCIE_A2A" not in tp and "--enforce-eager" not in tp
    assert _args(tp)["--pipeline-parallel-size"] == "2"
    ep = launch.sglang(Config(8, ep=8, comm="allreduce", redundant=8), "m", 0, False, 8192)
    a = _args(ep)
    assert a["--ep-size"] == "8" and a["--ep-num-redundant-experts"] == "8"
    assert "--moe-a2a-backend" not in a
    eplb = launch.vllm(replace(Config(8, 1, 8, 8, "ag-rs"), redundant=8), "m", 0, False, 8192)
    assert "--enable-eplb" in eplb and '"num_redundant_experts": 8' in eplb


def test_candidates_with_and_without_redundant_experts():
    names = [c.name for c in candidates(8, redundant=8)]
    assert "TP8+EP8 all-reduce" in names and "TP8+EP8 all-reduce +8 redundant" in names
    assert "DP8+EP8 pcie_a2a" in names and "DP8+EP8 pcie_a2a +8 redundant" in names
    assert "TP8 +8 redundant" not in names
