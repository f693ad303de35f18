"""SGLang's EPLB with ``--moe-a2a-backend pcie``, through SGLang's own code on 4 CPU ranks:

* ``--eplb-algorithm pcie_a2a``: SGLang's ``ExpertLocationMetadata.init_by_eplb`` runs our
  balancer (the placement it builds is exactly ``pcie_a2a.balance.balance``'s), SGLang's
  own algorithms still run;
* ``--init-expert-location`` with the file ``pcie-a2a balance --sglang-out`` writes is read
  by SGLang's ``compute_initial_expert_location_metadata``;
* static dispatch: each rank's ``logical_to_rank_dispatch_physical_map`` names, for every
  expert, a replica as near as any on the PCIe tree (4x L40S fixture: two sockets);
* physical expert ids from SGLang's top-k mapping through our dispatcher give the dense
  MoE result (the placement's replicas computed where SGLang put them), before and after
  SGLang's own EPLB weight mover moved the experts (gloo P2P) to our balancer's placement
  (``--enable-eplb`` with bf16 experts: what launch.py accepts).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from fw_utils import declare_entry_point, import_framework

from dist_utils import run_ok

import_framework("sglang.srt.eplb.expert_location")

declare_entry_point(
    "sglang.srt.plugins", "pcie_a2a.integrations.sglang:register", "PCIE_A2A_FWTEST_SGLANG_EP_DIR"
)

TOPO = (
    Path(__file__).resolve().parents[1] / "fixtures" / "topology" / "4x-l40s-dual-socket.topo.txt"
)
E, LAYERS, REDUNDANT, WORLD, K, H = 16, 2, 4, 4, 4, 64
MODEL = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": H,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "num_hidden_layers": LAYERS,
    "num_experts": E,
    "num_experts_per_tok": K,
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


def _loads() -> np.ndarray:
    rng = np.random.default_rng(3)
    w = 1.0 / np.arange(1, E + 1) ** 1.0
    return np.stack([rng.poisson(5000 * w[rng.permutation(E)]) for _ in range(LAYERS)])


def _config_worker(rank: int, world: int, model_dir: str, init_file: str) -> dict:
    """SGLang's config, algorithms and file reader, in one process (they are per rank in a
    server, but need no peers)."""
    import torch
    from sglang.srt.plugins import load_plugins

    os.environ["PCIE_A2A_TOPO_FILE"] = str(TOPO)
    load_plugins()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb import eplb_algorithms as ea
    from sglang.srt.eplb import expert_location as el
    from sglang.srt.layers.moe.utils import MoeA2ABackend
    from sglang.srt.runtime_context import get_flags, publish
    from sglang.srt.server_args import prepare_server_args

    from pcie_a2a.balance import Islands, Options, balance
    from pcie_a2a.integrations.sglang.eplb import OURS
    from pcie_a2a.topology import load

    args = prepare_server_args(
        ["--model-path", model_dir, "--tp-size", str(WORLD), "--moe-a2a-backend", "pcie",
         "--ep-num-redundant-experts", str(REDUNDANT), "--eplb-algorithm", "pcie_a2a",
         "--ep-dispatch-algorithm", "static", "--init-expert-location", init_file,
         "--skip-tokenizer-init", "--device", "cpu"]
    )  # fmt: skip
    args.resolve_once()
    publish(args, role="scheduler")
    get_flags().moe.a2a_backend = MoeA2ABackend("pcie")
    mc = ModelConfig.from_server_args(args)
    out: dict = {}
    out["alg"] = repr(ea.compute_algorithm("pcie_a2a", None, 1))
    out["alg_is_ours"] = ea.compute_algorithm("pcie_a2a", None, 1) is OURS
    out["alg_auto"] = ea.compute_algorithm("auto", None, 1).name
    counts = torch.tensor(_loads())[None]  # [steps, layers, experts], as SGLang records
    by_eplb = el.ExpertLocationMetadata.init_by_eplb(mc, counts)
    ours = balance(_loads(), Islands.from_topology(load(TOPO)), Options(redundant=REDUNDANT))
    out["eplb_ours"] = by_eplb.physical_to_logical_map.tolist()
    out["direct_ours"] = [r.slots.reshape(-1).tolist() for r in ours]
    p = E + REDUNDANT
    phy, _, _ = ea.rebalance_experts(counts, p, p // WORLD, None, 1, ea.EplbAlgorithm.deepseek)
    out["deepseek"] = phy.tolist()
    meta = el.compute_initial_expert_location_metadata(mc, moe_ep_rank=0)
    out["from_file"] = meta.physical_to_logical_map.tolist()
    # each rank's static map, as each rank's server process builds it from the file
    out["dispatch_map"] = [
        el.compute_initial_expert_location_metadata(
            mc, moe_ep_rank=r
        ).logical_to_rank_dispatch_physical_map.tolist()
        for r in range(WORLD)
    ]
    return out


def _moe_worker(rank: int, world: int, maps: list, dispatch_map: list, new_map: list) -> dict:
    """Logical ids -> SGLang's static physical mapping -> our dispatcher -> the experts of
    each physical slot -> combine, against the dense MoE over logical ids; then SGLang's
    EPLB weight mover (``update_expert_weights_single_layer``, gloo P2P) moves the experts
    to our balancer's placement ``new_map`` and the same dispatcher runs the new one."""
    import torch
    from fw_utils import dense_reference, moe_problem
    from sglang.srt.eplb.expert_location_dispatch import (
        ExpertLocationDispatchInfo,
        topk_ids_logical_to_physical,
    )
    from sglang.srt.eplb.expert_location_updater import (
        create_temp_buffers,
        update_expert_weights_single_layer,
    )
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from pcie_a2a.balance import Islands
    from pcie_a2a.integrations import _common
    from pcie_a2a.integrations.sglang import PcieA2ADispatcher
    from pcie_a2a.integrations.sglang.eplb import dispatch_map as nearest_map
    from pcie_a2a.reference import expert_forward
    from pcie_a2a.topology import load

    p, local = E + REDUNDANT, (E + REDUNDANT) // world
    old = torch.tensor(maps[0]).reshape(-1)
    new = torch.tensor(new_map)
    x, ids, w, w13, w2 = moe_problem(rank, world, E, K, H, 0)
    cfg = MoeRunnerConfig(num_experts=p, num_local_experts=local, hidden_size=H,
                          intermediate_size_per_partition=32, layer_id=0, top_k=K,
                          num_fused_shared_experts=0, params_dtype=torch.bfloat16)  # fmt: skip
    disp = PcieA2ADispatcher(cfg, output_format="standard")

    def step(static_map, experts):
        info = ExpertLocationDispatchInfo(
            ep_dispatch_algorithm="static",
            partial_logical_to_rank_dispatch_physical_map=static_map,
            partial_logical_to_all_physical_map=torch.zeros(E, 1, dtype=torch.int64),
            partial_logical_to_all_physical_map_num_valid=torch.ones(E, dtype=torch.int64),
            num_physical_experts=p,
        )
        phys_ids = topk_ids_logical_to_physical(ids.long(), info)
        res = disp.dispatch(
            hidden_states=x,
            topk_output=StandardTopKOutput(topk_weights=w, topk_ids=phys_ids, router_logits=None),
        )
        t = res.topk_output
        y = expert_forward(res.hidden_states, t.topk_ids, t.topk_weights, *experts)
        got = disp.combine(combine_input=StandardCombineInput(hidden_states=y))
        ok = bool(((phys_ids >= 0) & (phys_ids < p)).all())
        return (float((got.float() - want).abs().max()) if x.shape[0] else 0.0), ok

    want = dense_reference(x, ids, w, w13, w2)
    out = {"tokens": int(x.shape[0]), "scale": float(want.abs().max()) if x.shape[0] else 1.0}
    mine = slice(rank * local, (rank + 1) * local)
    try:
        weights = [w13[old[mine]].clone(), w2[old[mine]].clone()]
        out["err"], out["physical"] = step(torch.tensor(dispatch_map[rank][0]), weights)
        update_expert_weights_single_layer(
            routed_experts_weights=weights,
            temp_buffers=create_temp_buffers(weights),
            old_physical_to_logical_map=old.tolist(),
            new_physical_to_logical_map=new.tolist(),
            num_local_physical_experts=local,
            num_gpu_per_node=world,
            rank=rank,
            world_size=world,
        )
        out["moved_exact"] = bool(
            torch.equal(weights[0], w13[new[mine]]) and torch.equal(weights[1], w2[new[mine]])
        )
        out["moved_any"] = bool((old[mine] != new[mine]).any())
        log2phy = torch.full((1, E, p), -1, dtype=torch.int64)
        for q, e in enumerate(new.tolist()):
            log2phy[0, e, int((log2phy[0, e] >= 0).sum())] = q
        static = nearest_map(log2phy, world, p, rank, Islands.from_topology(load(TOPO)))[0]
        out["err_new"], out["physical_new"] = step(static, weights)
        out["new_targets_ok"] = bool((new[static] == torch.arange(E)).all())
    finally:
        _common.close_buffers()
    return out


def _socket(gpu: int) -> int:
    return gpu // 2  # 4x L40S fixture: GPU0,1 on NUMA 0, GPU2,3 on NUMA 1


def _maps() -> list[np.ndarray]:
    """The placement a `pcie-a2a balance --sglang-out` file could hold (no rank holds two
    copies of an expert)."""
    rng = np.random.default_rng(5)
    out = []
    for _ in range(LAYERS):
        phys = np.concatenate([rng.permutation(E), rng.choice(E, REDUNDANT, replace=False)])
        while True:
            m = phys[rng.permutation(E + REDUNDANT)].reshape(WORLD, -1)
            if all(len(set(row)) == len(row) for row in m):
                out.append(m)
                break
    return out


def test_sglang_eplb_runs_our_balancer_and_reads_our_placements():
    from pcie_a2a.balance import io

    model_dir = tempfile.mkdtemp(prefix="pcie_a2a_eplb_")
    maps = _maps()
    try:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(MODEL, f)
        init_file = os.path.join(model_dir, "init_expert_location.json")
        io.write_sglang(init_file, maps)
        (res,) = run_ok(1, _config_worker, model_dir, init_file, timeout=400)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    assert res["alg_is_ours"] and res["alg"] == "EplbAlgorithm.pcie_a2a"
    assert res["alg_auto"] == "deepseek"  # SGLang's choice for the other names is intact
    assert res["eplb_ours"] == res["direct_ours"]  # SGLang ran exactly our balancer
    assert res["deepseek"] != res["eplb_ours"]
    for layer in res["eplb_ours"]:
        assert sorted(set(layer)) == list(range(E)) and len(layer) == E + REDUNDANT
    want = [m.reshape(-1).tolist() for m in maps]
    assert res["from_file"] == want
    local = (E + REDUNDANT) // WORLD
    for rank in range(WORLD):
        for layer, row in enumerate(res["dispatch_map"][rank]):
            flat = want[layer]
            for e, p in enumerate(row):
                assert flat[p] == e, (rank, layer, e)  # a replica of that expert
                homes = [q // local for q, v in enumerate(flat) if v == e]
                if rank in homes:
                    assert p // local == rank, (rank, layer, e)  # own GPU first
                elif any(_socket(h) == _socket(rank) for h in homes):
                    assert _socket(p // local) == _socket(rank), (rank, layer, e)
    # equally near copies are shared out: an expert whose two copies are both on socket 1
    # is sent to one copy by rank 0 and to the other by rank 1 (both on socket 0)
    cases = [
        (layer, e)
        for layer in range(LAYERS)
        for e in range(E)
        if sorted(_socket(q // local) for q, v in enumerate(want[layer]) if v == e) == [1, 1]
    ]
    assert cases, "the seeded map has no expert with both copies on socket 1"
    for layer, e in cases:
        assert res["dispatch_map"][0][layer][e] != res["dispatch_map"][1][layer][e]
    # SGLang's physical ids through our dispatcher: the dense MoE result
    # then SGLang's EPLB weight mover to our balancer's placement, the same dispatcher
    assert res["eplb_ours"][0] != want[0]  # the move is not a no-op
    outs = run_ok(
        WORLD,
        _moe_worker,
        [m.tolist() for m in maps],
        res["dispatch_map"],
        res["eplb_ours"][0],
        timeout=300,
    )
    for rank, out in enumerate(outs):
        assert out["physical"] and out["physical_new"] and out["new_targets_ok"], rank
        tol = 0.02 * max(out["scale"], 1e-3) + 1e-2
        assert out["err"] <= tol and out["err_new"] <= tol, (rank, out)
        assert out["moved_exact"], rank  # every slot holds its new expert, bit for bit
    assert any(o["moved_any"] for o in outs)
    assert sum(o["tokens"] for o in outs) > 0
