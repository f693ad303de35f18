"""vLLM 0.33: general-plugin loading and the modular-kernel prepare/finalize on CPU ranks.

Each check runs in spawned ranks so vLLM's process-global plugin state stays contained.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
from fw_utils import declare_entry_point, dense_reference, import_framework, moe_problem

from dist_utils import run_ok

import_framework("vllm.model_executor.layers.fused_moe.modular_kernel")

from pcie_a2a.integrations import _common  # noqa: E402

declare_entry_point(
    "vllm.general_plugins", "pcie_a2a.integrations.vllm:register", "PCIE_A2A_FWTEST_VLLM_EP_DIR"
)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.name}: {record.getMessage()}")


def _load_plugins(enable: bool) -> list[str]:
    """vLLM's own loader, as EngineArgs / the engine core / workers run it."""
    os.environ["PCIE_A2A_VLLM"] = "1" if enable else "0"
    cap = _Capture()
    ours = logging.getLogger("vllm.pcie_a2a")
    ours.addHandler(cap)
    ours.setLevel(logging.INFO)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return cap.lines


class _NS:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _fake_moe(world: int, num_experts: int, top_k: int, hidden: int, all2all: bool):
    pc = _NS(
        use_all2all_kernels=all2all,
        use_passthrough_all2all=False,
        enable_eplb=False,
        dp_size=world if all2all else 1,
        ep_size=world,
    )
    return _NS(
        num_experts=num_experts,
        num_local_experts=num_experts // world,
        experts_per_token=top_k,
        hidden_dim=hidden,
        max_num_tokens=256,
        moe_parallel_config=pc,
    )


def _plugin_worker(rank: int, world: int) -> dict:
    lines = _load_plugins(enable=True)
    import vllm.model_executor.layers.fused_moe.all2all_utils as a2u

    from pcie_a2a.integrations.vllm import PcieA2APrepareAndFinalize

    out: dict = {"log": lines}
    f = a2u.maybe_make_prepare_finalize
    out["wrapped"] = bool(getattr(f, "__pcie_a2a__", False))
    # a module that imported the name before the plugin ran sees the wrapper too
    out["rebound"] = sorted(
        n
        for n, m in sys.modules.items()
        if n.startswith("vllm")
        and m is not None
        and getattr(m, "maybe_make_prepare_finalize", None) is f
    )
    pf = f(_fake_moe(2, 8, 2, 64, all2all=True), None)
    out["ep_dp"] = type(pf).__name__
    out["is_ours"] = isinstance(pf, PcieA2APrepareAndFinalize)
    out["format"] = pf.activation_format.name
    out["reduced"] = pf.output_is_reduced()
    # without all2all kernels (TP-only EP, DP=1) vLLM's own choice stands (None here)
    out["no_dp"] = repr(f(_fake_moe(2, 8, 2, 64, all2all=False), None))
    os.environ["PCIE_A2A_VLLM"] = "0"
    # disabled: vLLM's own path runs (it needs vLLM's EP group, so an error raised from
    # inside the original is the proof that it was called)
    try:
        out["disabled"] = type(f(_fake_moe(2, 8, 2, 64, all2all=True), None)).__name__
    except Exception as exc:
        out["disabled"] = f"original raised {type(exc).__name__}"
    return out


def test_plugin_loads_through_entry_point():
    (res,) = run_ok(1, _plugin_worker, timeout=240)
    log = "\n".join(res["log"])
    print(log)
    assert "pcie_a2a vLLM plugin registered (vllm 0.33.0, PCIE_A2A_VLLM=1)" in log
    assert res["wrapped"]
    assert "vllm.model_executor.layers.fused_moe.all2all_utils" in res["rebound"]
    assert res["ep_dp"] == "PcieA2APrepareAndFinalize" and res["is_ours"]
    assert res["format"] == "Standard"
    assert res["reduced"] is True
    assert res["no_dp"] == "None"
    assert res["disabled"] != "PcieA2APrepareAndFinalize"


def _reference_experts(x, gids, w, expert_map, w13, w2, reduce: bool):
    """A Standard-format experts stand-in: global ids through expert_map, like vLLM's."""
    import torch

    from pcie_a2a.reference import expert_mlp

    r, k = gids.shape
    local = expert_map[gids]
    y = torch.zeros(r, k, x.shape[1], dtype=torch.float32)
    for e in torch.unique(local[local >= 0]).tolist():
        rows, slot = (local == e).nonzero(as_tuple=True)
        y[rows, slot] = expert_mlp(x[rows], w13[e], w2[e])
    if reduce:
        return (y * w.unsqueeze(-1)).sum(1).to(x.dtype)
    return y.to(x.dtype)


def _pf_worker(rank: int, world: int, reduce_in_experts: bool) -> dict:
    import torch

    _load_plugins(enable=True)
    import vllm.model_executor.layers.fused_moe.all2all_utils as a2u
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate,
        TopKWeightAndReduceNoOP,
    )

    num_experts, top_k, hidden = 4 * world, 3, 64
    e_local = num_experts // world
    pf = a2u.maybe_make_prepare_finalize(_fake_moe(world, num_experts, top_k, hidden, True), None)
    expert_map = torch.full((num_experts,), -1, dtype=torch.int64)
    expert_map[rank * e_local : (rank + 1) * e_local] = torch.arange(e_local)
    quant = _NS(quant_dtype=None)
    results = []
    try:
        for step in range(2):
            x, ids, w, w13, w2 = moe_problem(rank, world, num_experts, top_k, hidden, step)
            lw13, lw2 = w13[rank * e_local : (rank + 1) * e_local], w2[rank * e_local :][:e_local]
            a, scale, meta, gids, gw = pf.prepare(
                x, w, ids.long(), num_experts, expert_map, False, quant, False
            )
            assert scale is None and a.shape[1] == hidden
            assert gids.dtype == pf.topk_indices_dtype()
            local = expert_map[gids]
            counts = [int((local == e).sum()) for e in range(e_local)]
            assert meta.expert_num_tokens.tolist() == counts
            y = _reference_experts(a, gids, gw, expert_map, lw13, lw2, reduce_in_experts)
            impl = TopKWeightAndReduceNoOP() if reduce_in_experts else TopKWeightAndReduceDelegate()
            out = torch.empty_like(x)
            pf.finalize(out, y, gw, gids, False, impl)
            want = dense_reference(x, ids, w, w13, w2)
            err = (out.float() - want).abs().max().item() if x.shape[0] else 0.0
            scale_ = want.abs().max().item() if x.shape[0] else 1.0
            results.append((x.shape[0], err, scale_))
    finally:
        _common.close_buffers()
    return {"results": results}


@pytest.mark.parametrize("world,reduce_in_experts", [(2, False), (3, True)])
def test_prepare_finalize_matches_dense_moe(world, reduce_in_experts):
    outs = run_ok(world, _pf_worker, reduce_in_experts, timeout=300)
    for rank, res in enumerate(outs):
        for tokens, err, scale in res["results"]:
            assert err <= 0.02 * max(scale, 1e-3) + 1e-2, (rank, tokens, err, scale)


def test_version_gate():
    args = ((0, 33), (0, 34), "PCIE_A2A_VLLM_SKIP_VERSION_CHECK")
    assert _common.check_version("vllm", "0.33.0", *args) == "0.33.0"
    for bad in ("0.32.1", "0.34.0", "0.11.0"):
        with pytest.raises(ImportError, match=r"supports vllm >=0\.33,<0\.34"):
            _common.check_version("vllm", bad, *args)


def test_weight_and_reduce_handles_empty_and_weights():
    import torch

    from pcie_a2a.integrations.vllm.prepare_finalize import weight_and_reduce

    empty = weight_and_reduce(torch.zeros(0, 3, 8), torch.zeros(0, 3), False)
    assert empty.shape == (0, 8)
    y = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    w = torch.tensor([[0.5, 0.25, 0.0], [1.0, 0.0, 2.0]])
    assert torch.allclose(weight_and_reduce(y, w, False), (y * w[..., None]).sum(1))
    assert torch.allclose(weight_and_reduce(y, w, True), y.sum(1))
