"""SGLang's dispatcher and vLLM's prepare/finalize on ``Buffer(backend="cuda")`` in the CUDA
execution model (tests/cuda_emu_module.py: the real binding, host code and kernels on CPU
tensors), one decode MoE layer each with pcie_a2a's INT4 expert MLP:

* counted: host synchronisations and launches of dispatch + experts + combine (the torch
  ops a GPU would launch, the transport's stream operations, and the INT4 op's kernels);
  printed as ``sglang decode layer: host syncs: 0, launches: N`` (and ``vllm ...``);
* movement exact: every output equals, bit for bit, the same calls on the CPU transport;
  math: within 2% of the layer's scale of the fp32 reference;
* captured: the dispatch and the combine captured in the emulated runtime's graphs and
  replayed with new tokens and new routing (the experts run between the two replays: the
  model captures only the runtime's stream work, and the INT4 op runs its CPU reference).

World 1 (the emulated Buffer is one process: W ranks would need forked processes sharing
the emulated arena, which the Python module does not offer yet). Run with ``-s`` to see
the counts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from fw_utils import import_framework

from dist_utils import run_ranks
from native_emulation import compiler

import_framework("sglang.srt.layers.moe.token_dispatcher")
import_framework("vllm.model_executor.layers.fused_moe.modular_kernel")

E, H, I, K, M = 8, 256, 128, 4, 12
#: kernels of one moe_int4_mlp call without act order (csrc/cuda/moe_int4/moe_int4.cuh:
#: schedule, gemm13, gemm2); the counter sees the op as one opaque torch op
INT4_KERNELS = 3
LAUNCH_TARGET = 8
_INT4_OPS = ("moe_int4_mlp", "moe_int4_mlp_expert_major")


@pytest.fixture(scope="module")
def emu_so(tmp_path_factory) -> str:
    if compiler() is None:
        pytest.skip("no host C++ compiler to build the emulated CUDA module")
    if sys.platform != "linux":
        pytest.skip("the emulated runtime maps its arena the Linux way")
    import cuda_emu_module

    return str(cuda_emu_module.build(tmp_path_factory.mktemp("cuda_emu_decode")))


def _experts():
    from pcie_a2a.quant import PackedInt4Experts, random_int4

    g = torch.Generator().manual_seed(3)
    kw = dict(group_size=128, scale_dtype=torch.bfloat16, generator=g, scale=0.05)
    parts = [random_int4(E, I, H, **kw), random_int4(E, I, H, **kw), random_int4(E, H, I, **kw)]
    return PackedInt4Experts.from_weights(*parts, torch.bfloat16)


def _inputs(step: int):
    g = torch.Generator().manual_seed(100 + step)
    t = M - 1 - step % 3
    x = (torch.randn(t, H, generator=g) * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).int()
    ids[::4, -1] = -1
    w = torch.rand(t, K, generator=g) * (ids >= 0)
    return x, ids, w


def _reference(ex, x, ids, w) -> torch.Tensor:
    from pcie_a2a.quant import moe_int4_mlp_reference

    return moe_int4_mlp_reference(x, ids, w, ex.w13, ex.w2).float()


def _counted_ops(py: dict) -> tuple[int, int]:
    """(host syncs, launches) the counter saw. The INT4 op runs its CPU reference here,
    whose own host reads are not the kernel's (the CUDA op never reads the device from the
    host): syncs seen while it ran are left out (``int4_syncs``), and the op counts as the
    kernels it launches on a GPU."""
    ops = py["launches"]
    n = sum(INT4_KERNELS if op in _INT4_OPS else 1 for op in ops)
    return len(py["syncs"]) - py.get("int4_syncs", 0), n


def _int4_syncs_excluded(py: dict):
    """Wraps the INT4 ops so the syncs of their CPU reference are set aside in ``py``."""
    import pcie_a2a.quant as Q

    saved = {name: getattr(Q, name) for name in _INT4_OPS}

    def wrap(fn):
        def inner(*a, **k):
            before = len(py["syncs"])
            try:
                return fn(*a, **k)
            finally:
                py["int4_syncs"] = py.get("int4_syncs", 0) + len(py["syncs"]) - before

        return inner

    for name, fn in saved.items():
        setattr(Q, name, wrap(fn))
    return lambda: [setattr(Q, name, fn) for name, fn in saved.items()]


# ---- SGLang -----------------------------------------------------------------------------
def _sglang_layer(ex):
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    from pcie_a2a.integrations.sglang.dispatcher import PcieA2ADispatcher
    from pcie_a2a.integrations.sglang.int4 import INT4_ATTR

    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=H,
                          intermediate_size_per_partition=I, layer_id=0, top_k=K,
                          num_fused_shared_experts=0, params_dtype=torch.bfloat16)  # fmt: skip
    layer = torch.nn.Module()
    setattr(layer, INT4_ATTR, ex)
    layer.moe_runner_config = cfg
    disp = PcieA2ADispatcher(cfg, output_format="standard", max_tokens_per_rank=M,
                             decode_tokens_per_rank=M)  # fmt: skip
    disp.bind_layer(layer)
    return disp, layer


def _sglang_step(disp, layer, x, ids, w):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from pcie_a2a.integrations.sglang.int4 import run_expert_major

    out = disp.dispatch(x, StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=None))
    return out, disp.combine(run_expert_major(layer, out))


def _valid(out) -> torch.Tensor:
    """The received rows that carry data (per expert, masked_m of them), as raw bits."""
    m = out.masked_m.tolist()
    return torch.cat([out.hidden_states[e, : m[e]] for e in range(len(m))]).view(torch.int16)


def _sglang_rank(rank: int, world: int, so: str, backend: str) -> dict:
    import cuda_emu_module
    from sglang.srt.layers.dp_attention import set_is_extend_in_batch
    from test_cuda_backend_emulated import counted

    from pcie_a2a.integrations import _common

    hooks = cuda_emu_module.install(Path(so)) if backend == "cuda" else None
    os.environ["PCIE_A2A_BACKEND"] = backend
    set_is_extend_in_batch(False)  # decode
    ex = _experts()
    disp, layer = _sglang_layer(ex)
    got: dict = {"steps": []}
    try:
        for step in range(3):
            x, ids, w = _inputs(step)
            if step == 1 and hooks is not None:  # the first call warmed up
                l0, s0, _ = hooks.counts()
                with counted() as py:
                    restore = _int4_syncs_excluded(py)
                    out, y = _sglang_step(disp, layer, x, ids, w)
                    restore()
                l1, s1, _ = hooks.counts()
                syncs, launches = _counted_ops(py)
                got["count"] = (s1 - s0 + syncs, l1 - l0 + launches, py["launches"])
            else:
                out, y = _sglang_step(disp, layer, x, ids, w)
            assert _common.device_resident(disp.buffer(H, torch.bfloat16, "low_latency")) == (
                backend == "cuda"
            )
            ref = _reference(ex, x, ids, w)
            got["steps"].append((_valid(out), out.masked_m.clone(), y.view(torch.int16), ref,
                                 y.float()))  # fmt: skip
        if hooks is not None:
            got["replays"] = _sglang_graph(hooks, disp, layer, ex)
    finally:
        _common.close_buffers()
    if hooks is not None:
        assert not cuda_emu_module.leaks(hooks)
    return got


def _sglang_graph(hooks, disp, layer, ex) -> list:
    """Dispatch and combine captured (two graphs) and replayed with new tokens/routing."""
    import cuda_emu_module
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPLLCombineInput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from pcie_a2a.integrations.sglang.int4 import run_expert_major

    stream = cuda_emu_module.EMU_STREAM.current
    x, ids, w = (t.clone() for t in _inputs(0))
    topk = StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=None)
    hooks.begin_capture(stream)
    out = disp.dispatch(x, topk)
    g_dispatch = hooks.end_capture(stream)
    held = list(disp._pending)  # what the captured kernels write stays alive (graph pool)
    y_in = torch.zeros_like(out.hidden_states)
    hooks.begin_capture(stream)
    y = disp.combine(DeepEPLLCombineInput(y_in, out.topk_ids, out.topk_weights))
    g_combine = hooks.end_capture(stream)
    replays = []
    for step in (3, 6):  # the captured token count, new tokens and new routing
        nx, nids, nw = _inputs(step)
        x.copy_(nx)
        ids.copy_(nids)
        w.copy_(nw)
        hooks.launch(g_dispatch, stream)
        y_in.copy_(run_expert_major(layer, out).hidden_states)
        hooks.launch(g_combine, stream)
        disp.buffer(H, torch.bfloat16, "low_latency").check()
        replays.append((y.float().clone(), _reference(ex, nx, nids, nw)))
    hooks.destroy_graph(g_dispatch)
    hooks.destroy_graph(g_combine)
    del held
    return replays


def _check_math(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    scale = max(ref.abs().max().item(), 1e-3)
    err = (y - ref).abs().max().item()
    assert err <= 0.02 * scale, f"{what}: max error {err} vs scale {scale}"


def test_sglang_decode_layer_on_the_emulated_cuda_buffer(emu_so, capsys):
    (cuda,) = (o.unwrap() for o in run_ranks(1, _sglang_rank, emu_so, "cuda", timeout=600))
    (cpu,) = (o.unwrap() for o in run_ranks(1, _sglang_rank, emu_so, "cpu", timeout=600))
    for step, (a, b) in enumerate(zip(cuda["steps"], cpu["steps"])):
        assert torch.equal(a[0], b[0]), f"step {step}: received rows differ from the CPU transport"
        assert torch.equal(a[1], b[1]), f"step {step}: masked_m"
        assert torch.equal(a[2], b[2]), f"step {step}: combine differs from the CPU transport"
        _check_math(a[4], a[3], f"step {step}")
    for n, (y, ref) in enumerate(cuda["replays"]):
        _check_math(y, ref, f"replay {n}")
    syncs, launches, ops = cuda["count"]
    with capsys.disabled():
        print(
            f"\nsglang decode layer: host syncs: {syncs}, launches: {launches}  (torch ops {ops})"
        )
    assert syncs == 0 and launches <= LAUNCH_TARGET, cuda["count"]


# ---- vLLM -------------------------------------------------------------------------------
class _NoQuant:
    quant_dtype = None


def _vllm_step(pf, ex, x, ids, w, out):
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceNoOP,
    )

    import pcie_a2a.quant as Q

    rx, _, meta, rids, rw = pf.prepare(x, w, ids, E, None, False, _NoQuant())
    y = Q.moe_int4_mlp(rx, rids, rw, ex.w13, ex.w2)  # weighted, summed over the row's experts
    pf.finalize(out, y, rw, rids, False, TopKWeightAndReduceNoOP())
    return meta


def _vllm_rank(rank: int, world: int, so: str, backend: str) -> dict:
    import cuda_emu_module
    from test_cuda_backend_emulated import counted

    from pcie_a2a.integrations import _common
    from pcie_a2a.integrations.vllm.prepare_finalize import PcieA2APrepareAndFinalize

    hooks = cuda_emu_module.install(Path(so)) if backend == "cuda" else None
    os.environ["PCIE_A2A_BACKEND"] = backend
    ex = _experts()
    pf = PcieA2APrepareAndFinalize(E, E, K, max_tokens_per_rank=4 * M, low_latency_tokens=M,
                                   expert_ids="local")  # fmt: skip
    got: dict = {"steps": []}
    try:
        for step in range(3):
            x, ids, w = _inputs(step)
            if step == 1 and hooks is not None:
                l0, s0, _ = hooks.counts()
                out = torch.empty_like(x)  # vLLM's output, allocated by vLLM
                with counted() as py:
                    restore = _int4_syncs_excluded(py)
                    meta = _vllm_step(pf, ex, x, ids, w, out)
                    restore()
                l1, s1, _ = hooks.counts()
                syncs, launches = _counted_ops(py)
                got["count"] = (s1 - s0 + syncs, l1 - l0 + launches, py["launches"])
            else:
                out = torch.empty_like(x)
                meta = _vllm_step(pf, ex, x, ids, w, out)
            assert pf._ll_buffer is not None and pf._ll_buffer.max_tokens_per_rank == M
            got["steps"].append((meta.expert_num_tokens.clone(), out.view(torch.int16),
                                 out.float(), _reference(ex, x, ids, w)))  # fmt: skip
    finally:
        _common.close_buffers()
    if hooks is not None:
        assert not cuda_emu_module.leaks(hooks)
    return got


def test_vllm_decode_layer_on_the_emulated_cuda_buffer(emu_so, capsys):
    (cuda,) = (o.unwrap() for o in run_ranks(1, _vllm_rank, emu_so, "cuda", timeout=600))
    (cpu,) = (o.unwrap() for o in run_ranks(1, _vllm_rank, emu_so, "cpu", timeout=600))
    for step, (a, b) in enumerate(zip(cuda["steps"], cpu["steps"])):
        assert torch.equal(a[0], b[0]), f"step {step}: expert_num_tokens"
        assert torch.equal(a[1], b[1]), f"step {step}: finalize differs from the CPU transport"
        _check_math(a[2], a[3], f"step {step}")
    syncs, launches, ops = cuda["count"]
    with capsys.disabled():
        print(f"\nvllm decode layer: host syncs: {syncs}, launches: {launches}  (torch ops {ops})")
    # Finalize combines straight into vLLM's `output` (combine(out=)), so the only launch
    # beyond the transport's and the INT4 op's is the clamp of the -1 slots to a local
    # expert that vLLM's experts need.
    assert syncs == 0 and launches <= LAUNCH_TARGET, cuda["count"]
