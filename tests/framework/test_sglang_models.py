"""SGLang's real MoE blocks under ``--moe-a2a-backend pcie`` against ``none``, on 2 CPU ranks.

DeepseekV2MoE (DeepSeek-V3 / Kimi K2), Qwen2MoeSparseMoeBlock, Glm4MoeSparseMoeBlock and
Qwen3MoeSparseMoeBlock are built by SGLang with SGLang's parallel state (TP 2, EP 2, with
TP attention and with DP attention), loaded with the same weights through SGLang's weight
loaders, and run one layer through SGLang's layer boundary (see sglang_blocks.py for what
is the test's). Under pcie the shared expert must be replicated (SGLang's boundary treats
an a2a backend's MoE output as complete, so a TP-sharded one loses the other ranks'
slice), and the layer output must equal the ``none`` backend's on the same tokens.
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
TP_ATTN_TOKENS = 6
#: tokens per DP rank in each step, by world (a rank idle in a step)
DP_BATCHES = {2: ([5, 3], [4, 0]), 4: ([5, 3, 0, 2], [1, 0, 4, 2])}
ALL_FAMILIES = ("deepseek_v3", "qwen2_moe", "glm4_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def model_root():
    import sglang_blocks as sb

    root = tempfile.mkdtemp(prefix="pcie_a2a_sglang_models_")
    for fam, (cfg, _, _) in sb.FAMILIES.items():
        sb.write_model_dir(root, cfg, fam)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _tokens(rank: int, step: int, count: int, hidden: int, dp: bool):
    import torch

    g = torch.Generator().manual_seed(1000 * step + (rank if dp else 0))
    return torch.randn(count, hidden, generator=g).to(torch.bfloat16)


def _shapes(module) -> dict:
    if module is None:
        return {}
    return {n: tuple(p.shape) for n, p in module.named_parameters()}


def _blocks_worker(
    rank: int, world: int, root: str, dp: bool, families=ALL_FAMILIES, local=None
) -> dict:
    import sglang_blocks as sb
    from sglang.srt.runtime_context import get_parallel

    from pcie_a2a.integrations import _common

    if local is not None:  # simulated nodes of `local` ranks: the EP group spans them
        os.environ["PCIE_A2A_LOCAL_WORLD_SIZE"] = str(local)
    sb.load_plugins_quietly()
    sb.cpu_shims()
    # ar: the `none` reference completes its sum with an all-reduce (SGLang's
    # reduce-scatterv step exists only on NCCL); pcie owes no sum either way
    extra = ("--boundary-reduction", "ar")
    sb.server_state(rank, world, os.path.join(root, "deepseek_v3"), "pcie", dp, extra)
    attn_tp = get_parallel().attn_tp_size
    out: dict = {"attn_tp": attn_tp, "attn_dp": get_parallel().attn_dp_size}
    try:
        for fam in families:
            shared_attr = sb.FAMILIES[fam][2]
            per = {}
            for backend in ("none", "pcie"):
                sb.set_backend(backend)
                block, attn_b, ffn_b, fnorm, hf = sb.build_block(fam)
                sb.load_block(block, seed=3)
                steps = []
                batches = DP_BATCHES[world] if dp else ([TP_ATTN_TOKENS] * world,)
                for step, counts in enumerate(batches):
                    t = counts[rank]
                    x = _tokens(rank, step, t, hf.hidden_size, dp)
                    fb = sb.forward_batch(counts, t, dp, hf.hidden_size)
                    y, seen = sb.run_layer(block, attn_b, ffn_b, fnorm, x, fb, attn_tp)
                    steps.append(
                        {"y": y.float().tolist(), "shape": tuple(y.shape), "seen": seen, "t": t}
                    )
                per[backend] = {
                    "steps": steps,
                    "shared": _shapes(getattr(block, shared_attr) if shared_attr else None),
                    "dispatcher": type(block.experts.dispatcher).__name__,
                }
                if backend == "pcie":
                    per["buffers"] = [
                        (type(b).__name__, b.stats()["internode_bytes"])
                        for b in _common._BUFFERS.values()
                    ]
            out[fam] = per
        # a MoE block nobody validated is refused when it is built, naming the class
        sb.set_backend("pcie")
        from sglang.srt.models.mixtral import MixtralMoE

        try:
            MixtralMoE(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, layer_id=0)
            out["unvalidated"] = "built"
        except ValueError as exc:
            out["unvalidated"] = str(exc)
    finally:
        _common.close_buffers()
    return out


def _check(outs: list[dict], dp: bool, families=ALL_FAMILIES, nodes: int = 1) -> None:
    import torch

    world = len(outs)
    for rank, res in enumerate(outs):
        assert (res["attn_tp"], res["attn_dp"]) == ((1, world) if dp else (world, 1))
        for fam in families:
            none, pcie = res[fam]["none"], res[fam]["pcie"]
            assert pcie["dispatcher"] == "PcieA2ADispatcher", fam
            assert none["dispatcher"] == "StandardDispatcher", fam
            if fam == "qwen3_moe":
                assert pcie["shared"] == {} and none["shared"] == {}
            else:
                # replicated under pcie (full intermediate), TP-sharded under none
                for name, shape in pcie["shared"].items():
                    ref = none["shared"][name]
                    dim = 0 if "gate_up" in name else 1
                    assert shape[dim] == world * ref[dim], (fam, name, shape, ref)
            kinds = {kind for kind, _ in res[fam]["buffers"]}
            assert kinds == {"InternodeBuffer" if nodes > 1 else "Buffer"}, (fam, kinds)
            # across nodes, rows crossed (every step routes tokens to the other node's experts)
            assert all((b > 0) == (nodes > 1) for _, b in res[fam]["buffers"]), res[fam]
            for step, (a, b) in enumerate(zip(pcie["steps"], none["steps"])):
                t = a["t"]
                # pcie: the block sees this rank's rows; none: the rows the boundary
                # gathers (all DP ranks' rows, or the whole TP-attention batch)
                if dp:
                    assert a["seen"] == t and b["seen"] == sum(DP_BATCHES[world][step]), (fam,)
                else:
                    assert a["seen"] == t // world and b["seen"] == t, (fam, a, b)
                assert a["shape"] == b["shape"] == (t, 64), (fam, a["shape"], b["shape"])
                if t:
                    ya, yb = torch.tensor(a["y"]), torch.tensor(b["y"])
                    err = (ya - yb).abs().max().item()
                    # both are bf16 outputs of an RMS norm (|y| ~ 1-4): a few bf16 ulps
                    assert err <= 0.05, (fam, rank, step, err)
        assert res["unvalidated"].startswith(
            "pcie_a2a: sglang.srt.models.mixtral.MixtralMoE builds"
        )
        assert "MixtralMoE" in res["unvalidated"] and "not validated" in res["unvalidated"]


@pytest.mark.parametrize("dp", [False, True], ids=["tp_attention", "dp_attention"])
def test_real_blocks_match_none_backend(model_root, dp):
    outs = run_ok(WORLD, _blocks_worker, model_root, dp, timeout=420)
    _check(outs, dp)


def test_real_blocks_on_an_ep_group_spanning_two_nodes(model_root):
    """4 ranks as 2 simulated nodes of 2 (PCIE_A2A_LOCAL_WORLD_SIZE): the dispatcher's
    Buffer is the multi-node one (pcie_a2a.internode), DP attention as multi-node EP runs
    it, DeepSeek-V3's block (the shared expert beside the routed ones); output equal to
    the ``none`` backend's within the same bf16 bound, inter-node bytes counted."""
    fams = ("deepseek_v3",)
    outs = run_ok(4, _blocks_worker, model_root, True, fams, 2, timeout=420)
    _check(outs, True, fams, nodes=2)


# ---- installed but not selected: the plugin changes nothing -------------------------------
def _unselected_worker(rank: int, world: int, root: str) -> dict:
    """The same `none` server and block built before and after our plugin is loaded, in
    one process: resolution declarations, parameters and outputs must be identical."""
    import sglang_blocks as sb
    import torch
    from sglang.srt.server_args import prepare_server_args

    def resolve():
        args = prepare_server_args(
            [
                "--model-path",
                os.path.join(root, "deepseek_v3"),
                "--device",
                "cpu",
                "--skip-tokenizer-init",
                "--tp-size",
                "1",
                "--moe-a2a-backend",
                "none",
                "--random-seed",  # else drawn at random on every resolution
                "1",
            ]
        )
        args.resolve_once()
        return repr(sorted((s, repr(f)) for s, f in args._resolved_overrides))

    def build():
        block, attn_b, ffn_b, fnorm, hf = sb.build_block("deepseek_v3")
        sb.load_block(block, seed=5)
        x = _tokens(0, 0, 4, hf.hidden_size, False)
        fb = sb.forward_batch([4], 4, False, hf.hidden_size)
        y, _ = sb.run_layer(block, attn_b, ffn_b, fnorm, x, fb, 1)
        return _shapes(block), y

    sb.cpu_shims()
    before_args = resolve()
    sb.server_state(rank, world, os.path.join(root, "deepseek_v3"), "none", False)
    before_shapes, before_y = build()
    from sglang.srt.plugins.hook_registry import HookRegistry

    patched_before = len(HookRegistry._patched)
    sb.load_plugins_quietly()
    after_args = resolve()
    after_shapes, after_y = build()
    return {
        "hooks": len(HookRegistry._patched) - patched_before,
        "args_equal": before_args == after_args,
        "shapes_equal": before_shapes == after_shapes,
        "y_equal": bool(torch.equal(before_y, after_y)),
    }


def test_installed_but_not_selected_changes_nothing(model_root):
    (res,) = run_ok(1, _unselected_worker, model_root, timeout=300)
    assert res["hooks"] > 0  # the plugin did load and patch SGLang
    assert res["args_equal"] and res["shapes_equal"] and res["y_equal"], res


# ---- launch-time resolution ---------------------------------------------------------------
def _resolve_worker(rank: int, world: int, root: str, family: str, extra: list, env: dict):
    import logging

    os.environ.update(env)
    import sglang_blocks as sb

    sb.load_plugins_quietly()
    lines: list[str] = []

    class Cap(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    cap = Cap()
    logging.getLogger("pcie_a2a.integrations.sglang").addHandler(cap)
    logging.getLogger("pcie_a2a.integrations.sglang").setLevel(logging.INFO)
    try:
        return _resolve(_args_of(root, family, extra), lines)
    finally:  # each case sees its own lines only
        logging.getLogger("pcie_a2a.integrations.sglang").removeHandler(cap)


def _args_of(root: str, family: str, extra: list):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(
        [
            "--model-path",
            os.path.join(root, family),
            "--device",
            "cpu",
            "--skip-tokenizer-init",
            "--tp-size",
            "4",
            "--moe-a2a-backend",
            "pcie",
            *extra,
        ]
    )


def _resolve(args, lines: list) -> dict:
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from pcie_a2a.integrations.sglang.launch import capacity_tokens_per_rank

    try:
        args.resolve_once()
    except ValueError as exc:
        return {"error": str(exc)}
    view = resolved_view(args)
    cg = view.cuda_graph_config
    return {
        "lines": lines,
        "graphs": (cg.decode.backend == Backend.DISABLED, cg.prefill.backend == Backend.DISABLED),
        "fusion_off": view.disable_shared_experts_fusion,
        "ep": view.ep_size,
        "capacity": capacity_tokens_per_rank(args),
    }


TWO_NODES = ["--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "127.0.0.1:29999"]
EPLB_OURS = ["--ep-num-redundant-experts", "4", "--eplb-algorithm", "pcie_a2a"]
#: Kimi K2's checkpoint scheme (compressed-tensors W4A16): its layers run from packed INT4
INT4_CT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 32},
        }
    },
    "ignore": ["lm_head"],
}

RESOLVE_CASES = [
    # (family, extra argv, env, expected error substring or None)
    ("qwen3_moe", [], {}, None),
    (
        "deepseek_v3",
        [
            "--dp-size",
            "2",
            "--enable-dp-attention",
            "--chunked-prefill-size",
            "20000",
            "--max-running-requests",
            "64",
        ],
        {},
        None,
    ),
    ("qwen3_moe", ["--chunked-prefill-size", "20000", "--enable-mixed-chunk"], {}, None),
    ("qwen3_moe", ["--enable-two-batch-overlap"], {}, "--enable-two-batch-overlap"),
    ("qwen3_moe", ["--enable-single-batch-overlap"], {}, "--enable-single-batch-overlap"),
    ("qwen3_moe", ["--chunked-prefill-size", "-1"], {}, "--chunked-prefill-size -1"),
    ("qwen3_moe", [], {"PCIE_A2A_MAX_TOKENS_PER_RANK": "100"}, "PCIE_A2A_MAX_TOKENS_PER_RANK=100"),
    ("mixtral", [], {}, "MixtralForCausalLM"),
    # EPLB and redundant experts: SGLang's physical ids, pcie_a2a's layout (docs/balance.md)
    ("qwen3_moe", ["--enable-eplb"], {}, None),
    ("qwen3_moe", [*EPLB_OURS, "--enable-eplb"], {}, None),
    ("qwen3_moe_int4", ["--ep-num-redundant-experts", "4"], {}, None),
    ("qwen3_moe_int4", [*EPLB_OURS, "--enable-eplb"], {}, "--enable-eplb with this compressed"),
    # runners whose top-k is not (ids, weights); DeepEP formats that would lose the
    # routed_scaling_factor (DeepSeek's 2.5) or feed the INT4 path a format it cannot read
    ("qwen3_moe", ["--moe-runner-backend", "flashinfer_trtllm"], {}, "flashinfer_trtllm is not"),
    ("qwen3_moe", ["--moe-runner-backend", "triton_kernel"], {}, "triton_kernel is not"),
    ("qwen3_moe", ["--moe-runner-backend", "flashinfer_mxfp4"], {}, "flashinfer_mxfp4 is not"),
    ("qwen3_moe", ["--moe-runner-backend", "triton"], {}, None),
    ("deepseek_v3", [], {"PCIE_A2A_SGLANG_FORMAT": "deepep_normal"}, "routed_scaling_factor=2.5"),
    ("deepseek_v3", [], {"PCIE_A2A_SGLANG_FORMAT": "deepep_ll"}, "routed_scaling_factor=2.5"),
    ("glm4_moe", [], {"PCIE_A2A_SGLANG_FORMAT": "deepep_ll"}, "routed_scaling_factor=2.5"),
    ("qwen3_moe", [], {"PCIE_A2A_SGLANG_FORMAT": "deepep_normal"}, None),  # no factor
    ("qwen3_moe_int4", [], {"PCIE_A2A_SGLANG_FORMAT": "deepep_ll"}, "with this compressed"),
    # a GPU server as SGLang resolves it (--device cuda on this CPU box): decode graphs
    # stay on; PCIE_A2A_BACKEND=cpu turns them off again
    # across nodes: refused on GPUs (no CUDA stage between nodes), the CPU path says so
    ("qwen3_moe", ["--device", "cuda", *TWO_NODES], {}, "--nnodes 2 on GPUs"),
    ("qwen3_moe", TWO_NODES, {}, None),
    ("qwen3_moe", ["--device", "cuda"], {}, None),
    ("qwen3_moe", ["--device", "cuda"], {"PCIE_A2A_BACKEND": "cpu"}, None),
]


@pytest.fixture(scope="module")
def resolve_root(model_root):
    import sglang_blocks as sb

    mixtral = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
        "torch_dtype": "bfloat16",
    }
    sb.write_model_dir(model_root, mixtral, "mixtral")
    sb.write_model_dir(
        model_root, dict(sb.QWEN3_MOE, quantization_config=INT4_CT), "qwen3_moe_int4"
    )
    return model_root


def _all_cases_worker(rank: int, world: int, root: str) -> list:
    """Every resolution case in one process (SGLang's resolution is per ServerArgs)."""
    results = []
    for fam, extra, env, _ in RESOLVE_CASES:
        saved = {k: os.environ.get(k) for k in env}
        try:
            results.append(_resolve_worker(rank, world, root, fam, extra, env))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return results


def test_launch_refusals_name_the_flag(resolve_root):
    (results,) = run_ok(1, _all_cases_worker, resolve_root, timeout=300)
    for (fam, extra, env, want), got in zip(RESOLVE_CASES, results):
        if want is None:
            assert got.get("error") is None, (fam, extra, got)
        else:
            assert want in got.get("error", ""), (fam, extra, env, got)
    ok = results[0]
    assert ok["graphs"] == (True, True) and ok["fusion_off"] is True and ok["ep"] == 4
    text = "\n".join(ok["lines"])
    assert "CUDA graphs are disabled" in text and "--disable-shared-experts-fusion" in text
    assert "--moe-a2a-backend pcie active" in text
    # capacity from the server's own limits: a 20000-token chunk is 10000 per DP rank
    # (64 running requests are 32 per DP rank); with mixed chunks, chunk + 4096 decodes
    assert results[1]["ep"] == 4 and results[1]["capacity"] == 10000, results[1]
    assert results[2]["capacity"] == 20000 + 4096, results[2]
    # accepted EPLB cases say how experts are placed; the plain case says nothing of it
    eplb = {tuple(c[1]): r for c, r in zip(RESOLVE_CASES, results) if c[0] == "qwen3_moe"}
    placed = "\n".join(eplb[(*EPLB_OURS, "--enable-eplb")]["lines"])
    assert "4 redundant experts" in placed and "EPLB on, --eplb-algorithm pcie_a2a" in placed
    assert "expert placement" not in text
    spans = "\n".join(results[-3]["lines"])
    assert "the EP group spans 2 nodes: the multi-node Buffer" in spans, results[-3]
    assert "spans" not in text
    gpu, gpu_cpu = results[-2], results[-1]
    assert gpu["graphs"] == (False, True), gpu  # (decode disabled, prefill disabled)
    assert any("decode CUDA graphs stay on" in line for line in gpu["lines"]), gpu
    assert gpu_cpu["graphs"] == (True, True), gpu_cpu
    assert any("CUDA graphs are disabled" in line for line in gpu_cpu["lines"]), gpu_cpu
