"""Launch-time checks: what pcie_a2a's prepare/finalize cannot do is refused (or turned off)
while vLLM resolves its configuration, before any process loads a model.

The plugin runs :func:`resolve` at the start of ``VllmConfig.__post_init__`` (vLLM's own
resolution pass: it turns the user's flags into the final config in the API-server process,
and again in each engine core), only with ``PCIE_A2A_VLLM=1`` and only for configurations
that put our prepare/finalize into the MoE layers (expert parallelism with
``--data-parallel-size`` > 1). Each refusal names the flag to change.

- CUDA graphs on a GPU (the CUDA transport): left as vLLM resolves them, every mode it
  allows for DeepEP's low-latency kernels. Calls up to the largest captured size run the
  low-latency dispatch/combine (no host sync, static shapes); larger ones, which vLLM runs
  eagerly, the normal mode.
- CUDA graphs on the CPU transport (vLLM's CPU build, ``PCIE_A2A_BACKEND=cpu``): a
  dispatch stages tokens through host memory with a blocking copy, which cannot be
  captured. An unset ``cudagraph_mode`` is set to ``NONE`` (what
  ``-cc.cudagraph_mode=NONE`` does) with a log line; an explicitly requested graph mode
  is refused.
- DBO / micro-batching: both micro-batches would share the prepare/finalize's one Buffer
  per mode, which keeps one call in flight (a receive hook must run before the next call
  starts), so two interleaved micro-batches are refused (``--enable-dbo``,
  ``--ubatch-size``).
- ``--all2all-backend``: ours replaces vLLM's all2all; another explicit backend is refused.
- EPLB, elastic EP, prefill context parallelism and TP > 1 inside a DP rank (vLLM's
  sequence-parallel MoE): not supported, refused.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm.pcie_a2a")

DEFAULT_ALL2ALL = "allgather_reducescatter"


def _refuse(what: str, fix: str) -> ValueError:
    return ValueError(f"pcie_a2a (PCIE_A2A_VLLM=1): {what}; {fix}, or unset PCIE_A2A_VLLM")


def uses_pcie_a2a(vllm_config: Any) -> bool:
    """True when the MoE layers of this config would get pcie_a2a's prepare/finalize."""
    pc = vllm_config.parallel_config
    model = vllm_config.model_config
    if model is None or getattr(model, "is_submodel_config", False):
        return False
    try:
        is_moe = bool(model.is_moe)
    except Exception:  # architectures vLLM cannot classify: let vLLM report them
        return False
    return (
        is_moe
        and bool(pc.enable_expert_parallel)
        and (pc.data_parallel_size > 1 or pc.prefill_context_parallel_size > 1)
    )


def resolve(vllm_config: Any) -> None:
    """Refuses what pcie_a2a cannot run and turns CUDA graphs off; no-op for configs that
    do not use it. Raises ValueError naming the flag."""
    if not uses_pcie_a2a(vllm_config):
        return
    pc = vllm_config.parallel_config
    if pc.all2all_backend != DEFAULT_ALL2ALL:
        raise _refuse(
            f"--all2all-backend {pc.all2all_backend} was given too, but pcie_a2a replaces "
            "vLLM's all2all",
            f"leave --all2all-backend at its default ({DEFAULT_ALL2ALL})",
        )
    if pc.enable_eplb:
        raise _refuse(
            "EPLB (--enable-eplb) moves experts between ranks at run time, which the "
            "pcie_a2a prepare/finalize does not follow",
            "drop --enable-eplb",
        )
    if getattr(pc, "enable_elastic_ep", False):
        raise _refuse("elastic EP (--enable-elastic-ep) is not supported", "drop it")
    if pc.use_ubatching:
        raise _refuse(
            "dual-batch overlap / micro-batching (--enable-dbo, --ubatch-size) is not "
            "supported: both micro-batches would share one Buffer, which keeps one call in "
            "flight at a time",
            "drop --enable-dbo and --ubatch-size",
        )
    if pc.prefill_context_parallel_size > 1:
        raise _refuse(
            "prefill context parallelism (--prefill-context-parallel-size "
            f"{pc.prefill_context_parallel_size}) is not supported",
            "use --prefill-context-parallel-size 1",
        )
    if pc.tensor_parallel_size > 1:
        raise _refuse(
            f"--tensor-parallel-size {pc.tensor_parallel_size} inside each DP rank "
            "(vLLM's sequence-parallel MoE) is not supported yet",
            "use --tensor-parallel-size 1 with --data-parallel-size N",
        )
    nodes = nodes_spanned(pc)
    if nodes > 1 and cuda_path():
        from pcie_a2a.integrations._common import MULTI_NODE_CUDA

        raise _refuse(
            f"data parallelism across {nodes} nodes on GPUs is not supported: " + MULTI_NODE_CUDA,
            "serve from one node",
        )
    if not cuda_path():
        _cuda_graphs_off(vllm_config)
    logger.info(
        "pcie_a2a: expert parallelism over %d DP ranks runs on pcie_a2a's prepare/finalize "
        "(PCIE_A2A_VLLM=1)",
        pc.data_parallel_size,
    )


def nodes_spanned(pc: Any) -> int:
    """Nodes the DP (= EP) group spans, as vLLM's launch states it: ``--nnodes``, or
    ``--data-parallel-size`` over ``--data-parallel-size-local`` (internal or hybrid load
    balancing). External load balancing (one rank per instance) does not say: 1, and
    the Buffer finds the hosts itself."""
    if int(getattr(pc, "nnodes", 1) or 1) > 1:
        return int(pc.nnodes)
    local = int(getattr(pc, "data_parallel_size_local", 0) or 0)
    if getattr(pc, "data_parallel_external_lb", False) or not 0 < local < pc.data_parallel_size:
        return 1
    return -(-pc.data_parallel_size // local)


def cuda_path() -> bool:
    """Whether the prepare/finalize runs the CUDA transport here (a GPU platform and no
    explicit PCIE_A2A_BACKEND=cpu): the path that keeps CUDA graphs on."""
    from vllm.platforms import current_platform

    from pcie_a2a import env

    return bool(current_platform.is_cuda()) and env.backend() != "cpu"


def _cuda_graphs_off(vllm_config: Any) -> None:
    from vllm.config import CUDAGraphMode

    cc = vllm_config.compilation_config
    model = vllm_config.model_config
    if getattr(model, "enforce_eager", False) or cc.cudagraph_mode == CUDAGraphMode.NONE:
        return
    if cc.cudagraph_mode is not None:
        raise _refuse(
            f"CUDA graphs (cudagraph_mode={cc.cudagraph_mode.name}) cannot capture a "
            "dispatch on the CPU transport (tokens are staged through host memory)",
            "drop -cc.cudagraph_mode / --compilation-config cudagraph_mode (pcie_a2a then "
            "turns graphs off itself) or pass --enforce-eager",
        )
    cc.cudagraph_mode = CUDAGraphMode.NONE
    logger.info(
        "pcie_a2a: disabling CUDA graphs (cudagraph_mode=NONE, as -cc.cudagraph_mode=NONE): "
        "on the CPU transport a dispatch stages tokens through host memory and cannot be "
        "captured; torch.compile stays on"
    )
