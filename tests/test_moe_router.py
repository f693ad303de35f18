"""Router semantics against values worked out by hand from the models' published code.

Each case states the scores, the groups, and which experts must win, so a reader can
check the expectation without running anything.
"""

from __future__ import annotations

import math

import pytest
import torch

from pcie_a2a.moe import Router, parse_config


def sig(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def by_id(ids: torch.Tensor, w: torch.Tensor) -> dict[int, float]:
    return {int(i): float(x) for i, x in zip(ids.tolist(), w.tolist(), strict=True)}


def check(router: Router, logits: list[float], expected: dict[int, float], tol: float = 1e-6):
    ids, w = router.select(torch.tensor([logits]))
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    got = by_id(ids[0], w[0])
    assert sorted(got) == sorted(expected), (got, expected)
    for e, v in expected.items():
        assert got[e] == pytest.approx(v, rel=tol, abs=tol), (e, got, expected)


# DeepSeek-V3 case: 8 experts in 4 groups {0,1} {2,3} {4,5} {6,7}.
# sigmoid:  s = .881 .047 .731 .711 .622 .599 .269 .953
# bias:     +0.5 on expert 5, -0.8 on expert 7
# choice:   c = .881 .047 .731 .711 .622 1.099 .269 .153
# top-2 sums per group: g0 .928, g1 1.442, g2 1.721, g3 .422 -> keep g2, g1
# top-2 among {2,3,4,5} by choice: 5 (1.099), 2 (.731). Expert 7 (best raw score) loses
# to its bias; expert 0 (second best choice) loses with its group.
DS_LOGITS = [2.0, -3.0, 1.0, 0.9, 0.5, 0.4, -1.0, 3.0]
DS_BIAS = [0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, -0.8]


def ds_router(**kw) -> Router:
    args = dict(
        scoring="sigmoid",
        n_group=4,
        topk_group=2,
        correction_bias=True,
        renormalize=True,
        routed_scaling_factor=2.5,
        dtype=torch.float32,
    )
    args.update(kw)
    r = Router(4, 8, 2, **args)
    r.e_score_correction_bias.data.copy_(torch.tensor(DS_BIAS))
    return r


def test_deepseek_v3_grouped_topk_bias_selects_unbiased_weights():
    s5, s2 = sig(0.4), sig(1.0)  # weights from the unbiased scores
    check(ds_router(), DS_LOGITS, {5: 2.5 * s5 / (s5 + s2), 2: 2.5 * s2 / (s5 + s2)})


def test_deepseek_v3_without_renormalisation_scales_raw_scores():
    check(
        ds_router(renormalize=False, routed_scaling_factor=2.0),
        DS_LOGITS,
        {5: 2.0 * sig(0.4), 2: 2.0 * sig(1.0)},
    )


def test_kimi_k2_single_group_is_plain_biased_topk():
    # n_group=1: no group stage; top-2 of choice = 5 (1.099), 0 (.881).
    r = ds_router(n_group=1, topk_group=1, routed_scaling_factor=2.827)
    s5, s0 = sig(0.4), sig(2.0)
    check(r, DS_LOGITS, {5: 2.827 * s5 / (s5 + s0), 0: 2.827 * s0 / (s5 + s0)})


def test_group_max_score_variant():
    # DeepSeek-V2 group_limited_greedy ranks groups by their best score:
    # g0 .881, g1 .731, g2 1.099, g3 .269 -> keep g2, g0 -> winners 5, 0.
    r = ds_router(group_score="max")
    s5, s0 = sig(0.4), sig(2.0)
    check(r, DS_LOGITS, {5: 2.5 * s5 / (s5 + s0), 0: 2.5 * s0 / (s5 + s0)})


def test_bias_only_selects():
    # A huge bias on expert 1 forces it in, but its weight is its own (tiny) score.
    r = ds_router(n_group=1, topk_group=1, renormalize=False, routed_scaling_factor=1.0)
    r.e_score_correction_bias.data.copy_(torch.tensor([0, 10.0, 0, 0, 0, 0, 0, 0]))
    check(r, DS_LOGITS, {1: sig(-3.0), 7: sig(3.0)})


def test_qwen3_softmax_topk_norm_topk_prob():
    logits = [1.0, 2.0, 0.5, 3.0]
    z = sum(math.exp(v) for v in logits)
    r = Router.qwen3_moe(4, 4, 2, norm_topk_prob=True, dtype=torch.float32)
    top = math.exp(3.0) + math.exp(2.0)
    check(r, logits, {3: math.exp(3.0) / top, 1: math.exp(2.0) / top})
    r = Router.qwen3_moe(4, 4, 2, norm_topk_prob=False, dtype=torch.float32)
    check(r, logits, {3: math.exp(3.0) / z, 1: math.exp(2.0) / z})


def test_mixtral_softmax_over_topk_logits():
    logits = [0.1, -0.2, 2.0, 1.5, 0.3, -1.0, 0.0, 0.7]
    a, b = math.exp(2.0), math.exp(1.5)
    check(Router.mixtral(4, 8, 2, dtype=torch.float32), logits, {2: a / (a + b), 3: b / (a + b)})


def test_mixtral_equals_softmax_of_topk_logits_on_random_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 8, generator=g) * 3
    ids, w = Router.mixtral(4, 8, 2, dtype=torch.float32).select(logits)
    top = logits.topk(2, dim=-1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(w, top.values.softmax(dim=-1), rtol=1e-6, atol=1e-6)


def test_forward_uses_fp32_logits_of_the_gate():
    g = torch.Generator().manual_seed(1)
    r = Router(16, 8, 2, scoring="sigmoid", correction_bias=True, renormalize=True)
    r.weight.data.copy_(torch.randn(8, 16, generator=g).bfloat16())
    x = torch.randn(5, 16, generator=g).bfloat16()
    ids, w = r(x)
    ids2, w2 = r.select(x.float() @ r.weight.float().t())
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(w, w2, rtol=1e-6, atol=1e-7)
    assert torch.allclose(w.sum(-1), torch.ones(5))


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(scoring="relu"), "scoring"),
        (dict(n_group=3, topk_group=1), "n_group"),
        (dict(n_group=4), "n_group"),
        (dict(n_group=4, topk_group=5), "topk_group"),
        (dict(group_score="mean"), "group_score"),
        (dict(routed_scaling_factor=0), "routed_scaling_factor"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        Router(4, 8, 2, **kwargs)


def test_bad_top_k_and_input():
    with pytest.raises(ValueError, match="top_k"):
        Router(4, 8, 9)
    with pytest.raises(ValueError, match="top_k"):
        Router(4, 8, 5, n_group=4, topk_group=2)  # only 4 experts survive the group stage
    with pytest.raises(ValueError, match=r"x\.shape"):
        Router(4, 8, 2)(torch.zeros(3, 5))


KIMI = {
    "model_type": "kimi_k2",
    "hidden_size": 7168,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
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
DEEPSEEK_V3 = dict(
    KIMI,
    model_type="deepseek_v3",
    n_routed_experts=256,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    first_k_dense_replace=3,
)
QWEN3 = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 14336,
}


def test_configs_give_the_published_router_settings():
    k = parse_config(KIMI)
    assert (k.num_experts, k.top_k, k.scoring, k.n_group, k.correction_bias) == (
        384,
        8,
        "sigmoid",
        None,
        True,
    )
    assert k.renormalize and k.routed_scaling_factor == 2.827 and k.shared_intermediate == 2048
    assert k.prefix(None) == "model.layers.1.mlp."
    d = parse_config(DEEPSEEK_V3)
    assert (d.n_group, d.topk_group, d.group_score) == (8, 4, "top2_sum")
    assert d.prefix(None) == "model.layers.3.mlp."
    with pytest.raises(ValueError, match="layer"):
        d.prefix(0)  # a dense layer
    q = parse_config(QWEN3)
    assert (q.scoring, q.renormalize, q.shared_intermediate, q.correction_bias) == (
        "softmax",
        True,
        0,
        False,
    )
    m = parse_config(MIXTRAL)
    assert m.renormalize and m.proj_names == ("w1", "w3", "w2")
    assert m.prefix(5) == "model.layers.5.block_sparse_moe."
    # multimodal wrapper (Kimi K2.5 style)
    assert parse_config({"model_type": "kimi_k25", "text_config": KIMI}).num_experts == 384
    with pytest.raises(ValueError, match="model_type"):
        parse_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="quant_method"):
        parse_config(dict(KIMI, quantization_config={"quant_method": "bitsandbytes"}))
