"""SGLang 0.5.23: PCIE_A2A_ALLREDUCE routes its real GroupCoordinator's TP all-reduce to
pcie_a2a.AllReduce, on 2 CPU ranks (one spawn: SGLang's import dominates the time). The
hooks are applied by SGLang's HookRegistry as the plugin's register() registers them (that
register() does is checked in test_sglang_backend.py, which loads the whole plugin).

In one rank set: installed but off (SGLang's own path, no communicator), on (ours below the
crossover, exact and alike on every rank; the rest on SGLang's gloo path), the fused
all-reduce + RMSNorm entry point, --disable-custom-all-reduce respected, destroy() closes
ours, and the launch refusal of a group across machines.
"""

from __future__ import annotations

import os

from fw_allreduce import check_cases, inputs, run_cases
from fw_utils import import_framework

from dist_utils import run_ok

import_framework("sglang.srt.distributed.parallel_state")


def _worker(rank: int, world: int) -> dict:
    import torch
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from pcie_a2a.allreduce import reference
    from pcie_a2a.integrations import _allreduce
    from pcie_a2a.integrations.sglang import allreduce

    os.environ.pop("PCIE_A2A_ALLREDUCE", None)
    allreduce.register_hooks(HookRegistry, HookType)
    HookRegistry.apply_hooks()  # what SGLang's load_plugins() does after register()

    def group(custom: bool = True):
        return ps.init_model_parallel_group(
            [list(range(world))], rank, "gloo", use_pynccl=False,
            use_custom_allreduce=custom, group_name="tp",
        )  # fmt: skip

    out: dict = {}
    # installed but off: SGLang's own (its CustomAllreduce fails on CPU: None), gloo sums
    g = group()
    xs = inputs(rank, world, 512, torch.bfloat16, 7)
    y = g.all_reduce(xs[rank].clone())
    out["off"] = (type(g.ca_comm).__name__, bool(torch.allclose(y.float(), sum(xs).float())))
    g.destroy()

    os.environ["PCIE_A2A_ALLREDUCE"] = "1"
    g = group()
    ca = g.ca_comm
    out["on"] = type(ca).__name__
    out["cases"] = run_cases(g.all_reduce, ca, rank, world)
    # SGLang's fused entry point (ROCm layers call it; ours serves it on every device)
    xs = inputs(rank, world, 4 * 64, torch.bfloat16, 11)
    residual = inputs(rank, world, 4 * 64, torch.bfloat16, 12)[0].view(4, 64)
    weight = inputs(rank, world, 64, torch.bfloat16, 13)[0]
    got = g.fused_allreduce_rmsnorm(xs[rank].clone().view(4, 64), residual, weight, 1e-6)
    want = reference.add_rmsnorm(
        reference.sum_in_rank_order(xs).view(4, 64), residual, weight, 1e-6
    )
    out["fused"] = got is not None and all(torch.equal(a, b) for a, b in zip(got, want))
    comm = ca.comm
    g.destroy()
    out["closed_by_destroy"] = comm.closed

    # SGLang's own switch: --disable-custom-all-reduce keeps the group on NCCL/gloo
    g = group(custom=False)
    out["disabled"] = type(g.ca_comm).__name__
    g.destroy()

    # a group whose ranks report different hosts is refused while SGLang builds it
    real = _allreduce.socket.gethostname
    _allreduce.socket.gethostname = lambda: f"host{rank}"
    try:
        group()
        out["refused"] = "built"
    except RuntimeError as exc:
        out["refused"] = str(exc)
    finally:
        _allreduce.socket.gethostname = real
    return out


def test_sglang_tp_all_reduce_on_pcie_a2a():
    res = run_ok(2, _worker, timeout=240)
    for r in res:
        assert r["off"] == ("NoneType", True), r["off"]
        assert r["on"] == "CustomAllreduce"
        assert r["fused"] is True
        assert r["closed_by_destroy"] is True
        assert r["disabled"] == "NoneType"
        assert "the group spans several machines (host0, host1)" in r["refused"], r["refused"]
        assert "Unset PCIE_A2A_ALLREDUCE" in r["refused"]
    check_cases([r["cases"] for r in res])
