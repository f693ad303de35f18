"""End-to-end MoE layer: 4 ranks on the CPU transport against a single-process dense
reference MoE, for bf16 and INT4 (compressed-tensors, GPTQ act-order, AWQ) experts, in
low-latency and normal mode (with chunking), plus single-process checks of loading and
argument errors.

The reference (in this file) reads the checkpoint with the quant package's *oracle*
dequantisers (written against the on-disk tensors, independent of the loaders the layer
uses), routes with its own sort-based implementation of each model's semantics, runs
every expert on every token in fp32 (dense), and rounds once.

Tolerance (per element): the layer rounds each rank's partial row to bf16 before
combine, the combined routed sum to bf16, and the final sum to bf16; the reference
rounds once. With unit roundoff u = 2^-9 for bf16 the difference is at most
``u * (sum_r |P_r| + |routed|) + 2u * |ref|`` where ``P_r`` is the fp32 partial of rank r
(computed by the reference from the placement). We allow twice that plus 1e-4 for fp32
summation-order differences: ``tol = 2^-8 * (sum_r |P_r| + |routed| + 2|ref|) + 1e-4``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_ok
from pcie_a2a import Buffer, Placement
from pcie_a2a.moe import MoE, parse_config, random_checkpoint
from pcie_a2a.quant import dequantize_awq, dequantize_compressed_tensors, dequantize_gptq
from pcie_a2a.reference import fp8_roundtrip

WORLD = 4
CAP = 64  # max_tokens_per_rank of the Buffer; also the auto low-latency threshold

KIMI_SMALL = {  # Kimi K2 semantics, small shapes
    "model_type": "kimi_k2",
    "hidden_size": 512,
    "n_routed_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 256,
    "n_shared_experts": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
}
KIMI_SMALL_INT4 = dict(
    KIMI_SMALL,
    quantization_config={
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 32,
                    "actorder": None,
                },
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"],
    },
)
DSV3_SMALL_GPTQ = dict(
    KIMI_SMALL,
    model_type="deepseek_v3",
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    quantization_config={
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": True,
        "sym": True,
    },
)
QWEN3_SMALL_AWQ = {
    "model_type": "qwen3_moe",
    "hidden_size": 512,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 256,
    "norm_topk_prob": True,
    "quantization_config": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "version": "gemm",
    },
}
MIXTRAL_SMALL = {
    "model_type": "mixtral",
    "hidden_size": 512,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 256,
}

# name -> (config, [(call name, tokens per rank, mode, pass max_num_tokens)], expected modes)
CASES = {
    "kimi_bf16": (
        KIMI_SMALL,
        [
            ("ll", [40, 0, 64, 17], "low_latency", False),
            ("normal", [40, 0, 64, 17], "normal", False),
            ("auto_small", [5, 9, 1, 3], "auto", True),
            ("auto_large_chunked", [150, 3, 0, 90], "auto", False),
        ],
    ),
    "kimi_int4_ct_g32": (
        KIMI_SMALL_INT4,
        [
            ("ll", [40, 0, 64, 17], "low_latency", False),
            ("normal_chunked", [100, 7, 64, 0], "normal", False),
        ],
    ),
    "dsv3_grouped_gptq_actorder": (
        DSV3_SMALL_GPTQ,
        [
            ("auto_small", [12, 30, 2, 0], "auto", False),
            ("normal", [12, 30, 2, 0], "normal", True),
        ],
    ),
    "qwen3_awq_g64": (
        QWEN3_SMALL_AWQ,
        [
            ("ll", [8, 16, 33, 1], "low_latency", False),
            ("normal", [70, 16, 33, 1], "normal", False),
        ],
    ),
    "kimi_bf16_random_placement": (
        KIMI_SMALL,
        [
            ("ll", [10, 20, 30, 40], "low_latency", False),
            ("normal", [10, 20, 30, 40], "normal", False),
        ],
    ),
    "kimi_int4_fp8_payload": (
        KIMI_SMALL_INT4,
        [
            ("ll", [10, 20, 30, 40], "low_latency", False),
            ("normal", [100, 20, 30, 40], "normal", False),
        ],
    ),
    "mixtral_bf16": (
        MIXTRAL_SMALL,
        [
            ("auto", [20, 20, 20, 20], "auto", False),
        ],
    ),
}


def _placement(case: str, num_experts: int, world: int) -> Placement:
    if case.endswith("random_placement"):
        return Placement.random_permutation(num_experts, world, seed=3)
    return Placement.contiguous(num_experts, world)


def _payload(case: str) -> str:
    return "fp8" if case.endswith("fp8_payload") else "bf16"


def _seed(case: str) -> int:
    return sum(map(ord, case))


def _x(case: str, call: int, rank: int, n: int, hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(_seed(case) * 100 + call * 10 + rank)
    return torch.randn(n, hidden, generator=g).bfloat16()


# ---- the ranks ----------------------------------------------------------------------------


def _all_cases(rank: int, world: int):
    out = {}
    for case, (cfg, calls) in CASES.items():
        ckpt = random_checkpoint(cfg, seed=_seed(case))
        placement = _placement(case, parse_config(cfg).num_experts, world)
        with MoE.from_config(
            cfg,
            weights=ckpt,
            max_tokens_per_rank=CAP,
            placement=placement,
            payload=_payload(case),
        ) as moe:
            assert moe.local_experts == placement.local_experts(rank)
            res = []
            for i, (_, counts, mode, hint) in enumerate(calls):
                x = _x(case, i, rank, counts[rank], moe.hidden)
                y = moe(x, mode=mode, max_num_tokens=max(counts) if hint else None)
                # numpy, not tensors: torch shares tensors through the sender's file
                # descriptors, which vanish when this process exits
                res.append((y.float().numpy(), moe.last_mode, type(moe.experts).__name__))
            out[case] = res
    out["shared_buffer"] = _shared_buffer(rank)
    return out


def _shared_buffer(rank: int):
    """Two layers (bf16, then INT4) on one Buffer, the second fed the first's output."""
    buf = Buffer(None, 64, 512, CAP, num_topk=8)
    try:
        a = MoE.from_config(KIMI_SMALL, weights=random_checkpoint(KIMI_SMALL, seed=1), buffer=buf)
        b = MoE.from_config(
            KIMI_SMALL_INT4, weights=random_checkpoint(KIMI_SMALL_INT4, seed=2), buffer=buf
        )
        x = _x("shared", 0, rank, 20 + 10 * rank, 512)
        ya = a(x)
        yb = b(ya, mode="normal")
        a.close()  # does not close a Buffer the layer did not create
        yc = a(x, mode="low_latency")
        return [t.float().numpy() for t in (ya, yb, yc)]
    finally:
        buf.close()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The references are small; OpenMP threads spinning next to the 4 ranks cost more
    than they gain on a 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def results():
    return run_ok(WORLD, _all_cases, timeout=240)


# ---- the reference ------------------------------------------------------------------------


def _dense_weight(ckpt, name, quant) -> torch.Tensor:
    """fp32 [N, K] from the on-disk tensors through the quant package's oracles."""
    if f"{name}.weight" in ckpt:
        return ckpt[f"{name}.weight"].float()
    if f"{name}.weight_packed" in ckpt:
        w = quant["config_groups"]["group_0"]["weights"]
        return dequantize_compressed_tensors(
            ckpt[f"{name}.weight_packed"],
            ckpt[f"{name}.weight_scale"],
            ckpt[f"{name}.weight_shape"],
            group_size=-1 if w["strategy"] == "channel" else w["group_size"],
        )
    if quant["quant_method"] == "gptq":
        return dequantize_gptq(
            ckpt[f"{name}.qweight"],
            ckpt[f"{name}.qzeros"],
            ckpt[f"{name}.scales"],
            ckpt.get(f"{name}.g_idx"),
            group_size=quant["group_size"],
            checkpoint_format=quant.get("checkpoint_format", "gptq"),
        )
    return dequantize_awq(
        ckpt[f"{name}.qweight"],
        ckpt[f"{name}.qzeros"],
        ckpt[f"{name}.scales"],
        group_size=quant["group_size"],
    )


def _route(cfg, logits: torch.Tensor, bias: torch.Tensor | None):
    """Dense routing weights [T, E] from the published semantics (sort-based)."""
    t, e = logits.shape
    k = cfg["num_experts_per_tok"]
    if cfg["model_type"] in ("kimi_k2", "deepseek_v3"):
        scores = torch.sigmoid(logits)
        choice = scores + bias
        n_group, topk_group = cfg["n_group"], cfg["topk_group"]
        if n_group > 1:
            per = e // n_group
            best2 = choice.view(t, n_group, per).sort(dim=-1, descending=True).values[..., :2]
            groups = best2.sum(-1).argsort(dim=-1, descending=True)[:, :topk_group]
            allowed = torch.zeros(t, n_group, dtype=torch.bool)
            allowed[torch.arange(t).unsqueeze(1), groups] = True
            choice = torch.where(
                allowed.repeat_interleave(per, dim=1), choice, torch.full_like(choice, -1e30)
            )
        ids = choice.argsort(dim=-1, descending=True)[:, :k]
        w = torch.gather(scores, 1, ids)
        w = w / w.sum(-1, keepdim=True) * cfg["routed_scaling_factor"]
    elif cfg["model_type"] == "qwen3_moe":
        p = torch.softmax(logits, dim=-1)
        ids = p.argsort(dim=-1, descending=True)[:, :k]
        w = torch.gather(p, 1, ids)
        w = w / w.sum(-1, keepdim=True)
    else:  # mixtral: softmax over the top-k logits
        ids = logits.argsort(dim=-1, descending=True)[:, :k]
        w = torch.softmax(torch.gather(logits, 1, ids), dim=-1)
    dense = torch.zeros(t, e)
    dense[torch.arange(t).unsqueeze(1), ids] = w
    return dense


class _Dense:
    """Every weight of one checkpoint in fp32, read once."""

    def __init__(self, cfg, ckpt):
        spec = parse_config(cfg)
        p = spec.prefix(None)
        quant = cfg.get("quantization_config")
        self.cfg, self.spec = cfg, spec
        self.bias = ckpt.get(f"{p}gate.e_score_correction_bias")
        self.gate = ckpt[f"{p}gate.weight"]
        gn, un, dn = spec.proj_names
        base = [f"{p}experts.{e}." for e in range(spec.num_experts)]
        self.w_gate = torch.stack([_dense_weight(ckpt, b + gn, quant) for b in base])
        self.w_up = torch.stack([_dense_weight(ckpt, b + un, quant) for b in base])
        self.w_down = torch.stack([_dense_weight(ckpt, b + dn, quant) for b in base])
        self.shared = None
        if spec.shared_intermediate:
            s = f"{p}shared_experts."
            self.shared = [
                ckpt[s + n + ".weight"].float() for n in ("gate_proj", "up_proj", "down_proj")
            ]


def _reference(dense: _Dense, x: torch.Tensor, placement: Placement, payload: str = "bf16"):
    """(out bf16 [T, H], tolerance fp32 [T, H]) for tokens x of one rank.

    With the fp8 payload the experts see the e4m3 round trip of x (the router and the
    shared expert see x itself).
    """
    logits = F.linear(x.float(), dense.gate.float())
    wd = _route(dense.cfg, logits, dense.bias)  # [T, E]
    xf = (fp8_roundtrip(x) if payload == "fp8" else x).float()
    gate = torch.einsum("th,eih->tei", xf, dense.w_gate)
    up = torch.einsum("th,eih->tei", xf, dense.w_up)
    y = torch.einsum("tei,ehi->teh", F.silu(gate) * up, dense.w_down)  # every expert, dense
    y = y * wd.unsqueeze(-1)
    rank_of = torch.tensor([reps[0][0] for reps in placement.replicas])
    partials = torch.zeros(x.shape[0], placement.world, x.shape[1])
    partials.index_add_(1, rank_of, y)  # [T, world, H]: what each rank sends back
    routed = partials.sum(1)
    out = routed
    if dense.shared is not None:
        g, u, d = dense.shared
        xs = x.float()
        out = routed + (F.silu(xs @ g.t()) * (xs @ u.t())) @ d.t()
    ref = out.bfloat16()
    tol = 2.0**-8 * (partials.abs().sum(1) + routed.abs() + 2 * ref.float().abs()) + 1e-4
    return ref, tol


def _expected_mode(mode: str, counts: list[int]) -> str:
    if mode != "auto":
        return mode
    return "low_latency" if max(counts) <= CAP else "normal"


@pytest.mark.parametrize("case", list(CASES))
def test_moe_4_ranks_matches_dense_reference(results, case):
    cfg, calls = CASES[case]
    dense = _Dense(cfg, random_checkpoint(cfg, seed=_seed(case)))
    int4 = "quantization_config" in cfg
    for i, (call, counts, mode, _) in enumerate(calls):
        for r in range(WORLD):
            y, last_mode, experts_type = results[r][case][i]
            y = torch.from_numpy(y).bfloat16()  # exact: the values are bf16
            assert experts_type == ("Int4Experts" if int4 else "BF16Experts")
            assert last_mode == _expected_mode(mode, counts), (call, r)
            x = _x(case, i, r, counts[r], cfg["hidden_size"])
            assert y.shape == x.shape and y.dtype == torch.bfloat16
            if counts[r] == 0:
                continue
            ref, tol = _reference(
                dense, x, _placement(case, dense.spec.num_experts, WORLD), _payload(case)
            )
            err = (y.float() - ref.float()).abs()
            worst = int((err - tol).argmax())
            assert bool((err <= tol).all()), (
                f"{case}/{call} rank {r}: max err {err.max():.3g}, at the worst element "
                f"err {err.flatten()[worst]:.3g} > tol {tol.flatten()[worst]:.3g}"
            )
            assert float(err.mean()) < 0.01 * float(ref.float().abs().mean())


# ---- single process -------------------------------------------------------------------------


def test_layers_share_one_buffer(results):
    dense_a = _Dense(KIMI_SMALL, random_checkpoint(KIMI_SMALL, seed=1))
    dense_b = _Dense(KIMI_SMALL_INT4, random_checkpoint(KIMI_SMALL_INT4, seed=2))
    placement = Placement.contiguous(64, WORLD)
    for r in range(WORLD):
        ya, yb, yc = (torch.from_numpy(t).bfloat16() for t in results[r]["shared_buffer"])
        x = _x("shared", 0, r, 20 + 10 * r, 512)
        for y, dense, inp in ((ya, dense_a, x), (yb, dense_b, ya), (yc, dense_a, x)):
            ref, tol = _reference(dense, inp, placement)
            assert bool(((y.float() - ref.float()).abs() <= tol).all()), r


def test_local_mode_matches_reference_and_reads_safetensors_style_sources():
    class SafeOpenLike:  # what safetensors.safe_open returns: keys() and get_tensor()
        def __init__(self, d):
            self.d = d

        def keys(self):
            return self.d.keys()

        def get_tensor(self, name):
            return self.d[name]

    ckpt = random_checkpoint(KIMI_SMALL_INT4, seed=3)
    moe = MoE.from_config(KIMI_SMALL_INT4, weights=SafeOpenLike(ckpt), local=True)
    x = _x("local", 0, 0, 9, 512)
    y = moe(x.view(3, 3, 512))
    assert moe.last_mode == "local" and y.shape == (3, 3, 512)
    ref, tol = _reference(_Dense(KIMI_SMALL_INT4, ckpt), x, Placement.contiguous(64, 1))
    assert bool(((y.view(9, 512).float() - ref.float()).abs() <= tol).all())


SMALL = {  # DeepSeek-V3 semantics, smaller still: for the single-process format matrix
    "model_type": "deepseek_v3", "hidden_size": 256, "n_routed_experts": 8,
    "num_experts_per_tok": 4, "moe_intermediate_size": 128, "n_shared_experts": 0,
    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
}  # fmt: skip
INT4_VARIANTS = {
    "gptq_channel_sym": {"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": True},
    "gptq_v2_g64_asym": {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False,
                         "checkpoint_format": "gptq_v2"},
    "gptq_v1_g32_asym": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False},
    "awq_g128": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
    "ct_channel": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                   "config_groups": {"group_0": {"weights": {
                       "num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}}}},
    "ct_g128": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 128}}}},
}  # fmt: skip


@pytest.mark.parametrize("variant", list(INT4_VARIANTS))
def test_int4_format_variants_single_process(variant):
    cfg = dict(SMALL, quantization_config=INT4_VARIANTS[variant])
    ckpt = random_checkpoint(cfg, seed=9)
    moe = MoE.from_config(cfg, weights=ckpt, local=True)
    assert type(moe.experts).__name__ == "Int4Experts"
    x = _x(variant, 0, 0, 24, 256)
    ref, tol = _reference(_Dense(cfg, ckpt), x, Placement.contiguous(8, 1))
    assert bool(((moe(x).float() - ref.float()).abs() <= tol).all())


def test_fp8_block_checkpoint_dequantises_to_bf16_experts():
    cfg = dict(
        MIXTRAL_SMALL, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}
    )
    ckpt = random_checkpoint(MIXTRAL_SMALL, seed=5)
    fp8 = {}
    for name, t in ckpt.items():
        if ".experts." in name:
            w = t.float()
            # a power-of-two scale keeps fp8 * scale exact in bf16
            s = 2.0 ** torch.round(torch.log2(w.abs().amax() / 448.0))
            fp8[name] = (w / s).to(torch.float8_e4m3fn)
            n, k = w.shape
            fp8[name.replace(".weight", ".weight_scale_inv")] = torch.full(
                (-(-n // 128), -(-k // 128)), float(s)
            )
        else:
            fp8[name] = t
    moe = MoE.from_config(cfg, weights=fp8, local=True)
    assert type(moe.experts).__name__ == "BF16Experts"
    deq = {
        n: (fp8[n].float() * fp8[n.replace(".weight", ".weight_scale_inv")][0, 0])
        if n.endswith(".weight") and ".experts." in n
        else t
        for n, t in fp8.items()
    }
    x = _x("fp8", 0, 0, 7, 512)
    ref, tol = _reference(_Dense(MIXTRAL_SMALL, deq), x, Placement.contiguous(8, 1))
    assert bool(((moe(x).float() - ref.float()).abs() <= tol).all())


def test_errors_name_the_argument():
    ckpt = random_checkpoint(MIXTRAL_SMALL, seed=1)
    with pytest.raises(ValueError, match="experts_format"):
        MoE.from_config(MIXTRAL_SMALL, weights=ckpt, local=True, experts_format="int4")
    with pytest.raises(ValueError, match="mode"):
        MoE.from_config(MIXTRAL_SMALL, weights=ckpt, local=True, mode="fast")
    missing = {k: v for k, v in ckpt.items() if "experts.3.w2" not in k}
    with pytest.raises(KeyError, match=r"experts\.3\.w2"):
        MoE.from_config(MIXTRAL_SMALL, weights=missing, local=True)
    moe = MoE.from_config(MIXTRAL_SMALL, weights=ckpt, local=True)
    with pytest.raises(TypeError, match=r"x\.dtype"):
        moe(torch.zeros(2, 512))
    with pytest.raises(ValueError, match=r"x\.shape"):
        moe(torch.zeros(2, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="low_latency"):
        moe.choose_mode(1000, "low_latency")
    assert moe.choose_mode(CAP, "auto") == "low_latency"
    assert moe.choose_mode(129, "auto") == "normal"
