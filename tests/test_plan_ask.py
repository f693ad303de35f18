"""`pcie-a2a plan`: --config in the frameworks' own flags, --stack-file, the measured pairs
beside a --topo path, and the memory layouts per framework (DCP, fp8 KV, SGLang's DP
attention), each against a hand calculation."""

from __future__ import annotations

import json
import shutil

import pytest

from pcie_a2a.configplan import ask, report
from pcie_a2a.configplan.api import Inputs, make_plan
from pcie_a2a.configplan.calibrate import calibration_env
from pcie_a2a.configplan.configs import Config
from pcie_a2a.configplan.memory import memory, weights_per_gpu
from pcie_a2a.configplan.models import load_model
from pcie_a2a.configplan.stacks import STACKS, load_stack
from pcie_a2a.configplan.tables import Tables
from pcie_a2a.gpus import GPUS
from topology_fixtures import FIXTURES

BOX = "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx"
H, I_SHARED, V = 7168, 2048, 163840


@pytest.mark.parametrize(
    "flags, want",
    [
        ("--tp-size 4 --ep-size 2", Config(4, 1, 1, 2, "allreduce")),
        ("--tp 8 --ep-size 4", Config(8, 1, 1, 4, "allreduce")),
        ("--tp-size 8", Config(8)),
        ("--tp-size 8 --dp-size 4 --enable-dp-attention --ep-size 8", Config(8, 1, 4, 8, "ag-rs")),
        ("--tp-size 8 --dp 8 --enable-dp-attention --moe-a2a-backend pcie", Config(8, 1, 8, 8, "pcie_a2a")),
        ("--tp-size 4 --pp-size 2", Config(4, 2)),
        ("--tp-size 8 --dcp-size 1", Config(8)),
        ("--tensor-parallel-size 8 --enable-expert-parallel", Config(8, 1, 1, 8, "allreduce")),
        ("-tp 2 -dp 4 -ep", Config(8, 1, 4, 8, "ag-rs")),
        ("PCIE_A2A_VLLM=1 -tp 2 --data-parallel-size 4 --enable-expert-parallel",
         Config(8, 1, 4, 8, "pcie_a2a")),
        ("--tensor-parallel-size 4 --pipeline-parallel-size 2", Config(4, 2)),
    ],
)  # fmt: skip
def test_config_flags_read_as_the_frameworks_mean_them(flags, want):
    fw, vals, _ = ask.parse(flags)
    cfg, why = ask.to_config(fw, vals, "fp8")
    assert (cfg, why) == (want, "")


@pytest.mark.parametrize(
    "flags, fragment",
    [
        ("--tp-size x", "--tp-size: got 'x'"),
        ("--tp-size 8 --tensor-parallel-size 8", "mixes SGLang flags"),
        ("--max-model-len 4096", "allowed: SGLang flags"),
        ("--tp-size", "needs a value"),
        ("--tp-size 0", "allowed: an int >= 1"),
    ],
)
def test_config_flags_refused_with_the_reason(flags, fragment):
    with pytest.raises(ValueError, match="--config"):
        try:
            ask.parse(flags)
        except ValueError as exc:
            assert fragment in str(exc)
            raise


def test_config_layouts_not_modelled_say_why():
    for flags, fragment in (
        ("--tp-size 2 --dp-size 4", "4 independent copies"),
        ("--tensor-parallel-size 2 --data-parallel-size 4", "add --enable-expert-parallel"),
        ("--tp-size 8 --moe-a2a-backend deepep", "not modelled"),
    ):
        fw, vals, _ = ask.parse(flags)
        cfg, why = ask.to_config(fw, vals, "fp8")
        assert cfg is None and fragment in why
    fw, vals, _ = ask.parse("-tp 8 -dcp 4 --enable-expert-parallel")
    assert ask.to_config(fw, vals, "fp8") == (Config(8, 1, 1, 8, "allreduce", dcp=4), "")
    fw, vals, _ = ask.parse("--tp-size 8 --decode-context-parallel-size 2")
    assert (fw, ask.to_config(fw, vals, "fp8")) == ("sglang", (Config(8, dcp=2), ""))


def test_config_explains_a_layout_on_fewer_gpus(capsys):
    import argparse

    from pcie_a2a.configplan import cli as plan_cli

    parser = argparse.ArgumentParser()
    plan_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", "--topo", BOX, "--config", "--tp-size 2 --ep-size 4"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    # SGLang nests EP inside TP: --ep-size 4 cannot divide --tp-size 2
    assert "--config '--tp-size 2 --ep-size 4' (sglang flags):" in out
    assert "sglang cannot run it: EP nests inside TP: ep_size 4 must divide tp_size 2" in out
    args = parser.parse_args(["plan", "--topo", BOX, "--config", "--tp-size 4 --ep-size 2"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "= TP4+EP2 all-reduce on 4 of the box's 8 GPUs" in out
    # by hand: 4 GPUs hold 595 GB of weights, ~139 GiB each, more than 96 GiB
    assert "sglang cannot run it: out of memory" in out


def test_stack_file_like_and_points(tmp_path):
    like = tmp_path / "mine.json"
    like.write_text(json.dumps({"framework": "sglang", "allreduce": "pcie_a2a",
                                "env": ["PCIE_A2A_ALLREDUCE=1"], "like": "vllm-tuned"}))  # fmt: skip
    p = make_plan(Inputs(topo=BOX, stack_file=str(like), gpus=8))
    assert p.stack.name == "mine" and p.stack.step_us > 0

    line = report.commands(p, p.recommendation.latency)["sglang"]
    assert line.startswith("PCIE_A2A_ALLREDUCE=1 python -m sglang.launch_server")
    pts = tmp_path / "pts.json"
    pts.write_text(json.dumps({"framework": "vllm", "allreduce": "custom", "points": [
        {"tp": 8, "concurrency": 1, "tok_s": 92.4}, {"tp": 8, "concurrency": 128, "tok_s": 2222.6},
    ]}))  # fmt: skip
    s = load_stack(str(pts))
    assert [pt.tok_s for pt in s.points] == [92.4, 2222.6]
    for doc, fragment in (
        ({"framework": "trt"}, "framework: got 'trt'"),
        ({"framework": "vllm", "allreduce": "x", "like": "vllm-tuned"}, "allreduce: got 'x'"),
        ({"framework": "vllm"}, "exactly one of 'points' and 'like'"),
        ({"framework": "vllm", "like": "nope"}, "like: got 'nope'"),
        ({"framework": "vllm", "points": [{"tok_s": 1}]}, "at least two"),
        ({"framework": "vllm", "like": "vllm-tuned", "color": 1}, "unknown keys"),
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match="--stack-file") as e:
            load_stack(str(bad))
        assert fragment in str(e.value)


def test_stack_file_mtp(tmp_path):
    """'mtp' in a stack file: the user's drafts and accepted length (no shipped claim), a
    'like' stack's MTP unless the file says, null for off; bad values name the key."""
    f = tmp_path / "spec.json"
    mtp = {"draft_tokens": 2, "accept_len": 1.7, "source": "my server's SpecDecoding log"}
    f.write_text(json.dumps({"framework": "vllm", "like": "vllm-tuned", "mtp": mtp}))
    s = load_stack(str(f))
    assert (s.mtp.draft_tokens, s.mtp.accept_len, s.mtp.source) == (2, 1.7, mtp["source"])
    assert {p.name: p.value for p in s.parts()}["MTP"] == "2 draft tokens, 1.7 tokens per step"
    f.write_text(json.dumps({"framework": "vllm", "like": "vllm-tuned-mtp"}))
    assert load_stack(str(f)).mtp == STACKS["vllm-tuned-mtp"].mtp
    f.write_text(json.dumps({"framework": "vllm", "like": "vllm-tuned-mtp", "mtp": None}))
    assert load_stack(str(f)).mtp is None
    for bad, fragment in (
        ({"draft_tokens": 0, "accept_len": 1.0}, "mtp.draft_tokens: got 0; allowed: an int >= 1"),
        ({"draft_tokens": 2, "accept_len": 3.5}, "mtp.accept_len: got 3.5; allowed: a number from 1 to 1 + draft_tokens (3)"),
        ({"draft_tokens": 2, "accept_len": 0.5}, "mtp.accept_len: got 0.5"),
        ({"draft_tokens": 2, "accept_len": "1.7"}, "mtp.accept_len: got '1.7'"),
        ({"draft_tokens": 2}, "mtp: got {'draft_tokens': 2}; allowed: null (off) or"),
        ({"draft_tokens": 2, "accept_len": 1.5, "k": 1}, "mtp: unknown keys ['k']"),
        (True, "mtp: got True"),
    ):  # fmt: skip
        f.write_text(json.dumps({"framework": "vllm", "like": "vllm-tuned", "mtp": bad}))
        with pytest.raises(ValueError, match="--stack-file") as e:
            load_stack(str(f))
        assert fragment in str(e.value)


def test_mtp_stack_plans_and_says_whose_draft_it_is():
    # 2 of the box's GPUs keep it quick (Kimi does not fit there; the plan still predicts)
    p = make_plan(Inputs(topo=BOX, stack="vllm-tuned-mtp", gpus=2))
    tp2 = next(r for r in p.results if r.config == Config(2))
    assert tp2.steps[1].tokens_per_step == pytest.approx(2.278)
    assert not any(a.startswith("MTP:") for a in p.assumed)  # measured on this model
    line = report.commands(p, tp2)["vllm"]
    assert '"method": "eagle3"' in line and '"num_speculative_tokens": 3' in line
    glm = make_plan(Inputs(model="glm-4.5-fp8", topo=BOX, stack="vllm-tuned-mtp", gpus=2))
    assert any("measured on kimi-k2.6, not on glm-4.5-fp8" in a for a in glm.assumed)


def test_topo_path_brings_its_pair_file_and_without_one_says_assumed(tmp_path):
    src = FIXTURES / f"{BOX}.topo.txt"
    shutil.copy(src, tmp_path / f"{BOX}.topo.txt")
    alone = make_plan(Inputs(topo=str(tmp_path / f"{BOX}.topo.txt"), gpus=8))
    assert not alone.measured.probe
    assert any("not measured (--probe FILE)" in a for a in alone.assumed)
    shutil.copy(FIXTURES / f"{BOX}.p2p.txt", tmp_path / f"{BOX}.p2p.txt")
    both = make_plan(Inputs(topo=str(tmp_path / f"{BOX}.topo.txt"), gpus=8))
    assert both.measured.probe and not any("--probe FILE" in a for a in both.assumed)
    assert any(f"{BOX}.p2p.txt used as --probe" in n for n in both.notes)


def test_dcp_and_fp8_kv_memory_by_hand():
    kimi, gpu = load_model("kimi-k2.6"), GPUS["rtx-pro-6000"]
    stack = STACKS["vllm-tuned"]
    ctx = 5120
    # MLA: 512 latent + 64 rope per token and layer, replicated on every TP rank; 61 layers
    full = ctx * 61 * 576 * 2.0
    assert memory(kimi, Config(8), gpu, stack, ctx, 2.0).kv_per_request == full
    assert memory(kimi, Config(8, dcp=8), gpu, stack, ctx, 2.0).kv_per_request == full / 8
    assert memory(kimi, Config(8, kv_fp8=True), gpu, stack, ctx, 2.0).kv_per_request == full / 2


def test_sglang_dp_attention_splits_shared_expert_and_lm_head_over_tp():
    kimi = load_model("kimi-k2.6")
    cfg = Config(8, 1, 4, 8, "ag-rs")  # attention TP 2 inside 4 DP groups
    vllm = weights_per_gpu(kimi, cfg, 0, "vllm")
    sgl = weights_per_gpu(kimi, cfg, 0, "sglang")
    shared = 60 * 3 * H * I_SHARED * 2.0  # bf16, 60 MoE layers
    lm_head = V * H * 2.0
    assert vllm - sgl == pytest.approx((shared + lm_head) * (1 / 2 - 1 / 8), rel=1e-12)
    # an a2a backend keeps them per attention group in SGLang too
    ours = Config(8, 1, 4, 8, "pcie_a2a")
    assert weights_per_gpu(kimi, ours, 0, "sglang") == weights_per_gpu(kimi, ours, 0, "vllm")


def test_dcp_exchange_by_hand():
    """TP8 DCP8 at C = 4: per layer an all-gather of the queries of all 64 heads (4 x 64 x
    576 x 2 B = 294,912 B) and a reduce-scatter of the partial outputs (4 x 64 x (512 x 2 +
    4) B = 263,168 B), from the measured 8-GPU NCCL tables."""
    from pcie_a2a.configplan import comm
    from pcie_a2a.configplan.predict import step

    env = calibration_env(STACKS["vllm-tuned"], Tables())
    t = Tables()
    ag = t.nccl8["all_gather"](4 * 64 * 576 * 2.0)
    rs = t.nccl8["reduce_scatter"](4 * 64 * (512 * 2.0 + 4))
    with_dcp = step(env, Config(8, dcp=8), 4).terms["comm"]
    without = step(env, Config(8), 4).terms["comm"]
    assert with_dcp - without == pytest.approx(61 * (ag + rs), rel=1e-9)
    assert comm.nccl("all_gather", 294912.0, 8, GPUS["rtx-pro-6000"], t).kind == "measured"
