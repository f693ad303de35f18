"""Launch-time resolution for ``--moe-a2a-backend pcie``: what is adjusted, what is refused.

Registered as an override of SGLang's ``handle_a2a_moe`` resolution step (SGLang's own
plugin seam, ``arg_groups.resolution_hooks``), so it runs in the launcher right after
SGLang resolved the a2a settings and before any scheduler process starts: whatever this
backend cannot do fails here with a message naming the flag, not at the first forward.

Adjusted (with a log line each):

* CUDA graphs: kept on for a GPU server (``--device cuda``, PCIE_A2A_BACKEND not ``cpu``):
  decode batches run the low-latency calls, which never synchronise with the host and
  capture in SGLang's decode graphs; the low-latency Buffer holds one decode batch per DP
  rank (:func:`decode_tokens_per_rank`, which covers the largest captured batch). Prefill
  graphs are turned off (the normal mode reads per-rank counts on the host). On a CPU
  server or with PCIE_A2A_BACKEND=cpu (the CPU transport stages tokens through host
  memory) graphs are off for both phases, as before.
* shared-experts fusion off (``--disable-shared-experts-fusion``): the shared expert runs
  as its own replicated MLP on every rank (see ``models.py``).

Accepted: redundant experts (``--ep-num-redundant-experts``), ``--init-expert-location``
and ``--enable-eplb``: SGLang's top-k hands the dispatcher *physical* expert ids and the
Buffer places physical expert ``p`` on EP rank ``p // local``, SGLang's own layout, so
SGLang's placements and weight moves apply unchanged; ``--eplb-algorithm pcie_a2a`` picks
pcie_a2a's balancer (``eplb.py``, docs/balance.md).

Refused: an unvalidated model architecture, two-batch / single-batch overlap (see
:func:`validate` for why),
``--enable-eplb`` on an INT4 checkpoint (its layers run from pcie_a2a's packed copy, which
SGLang's weight mover does not update), chunked prefill turned off, a
``PCIE_A2A_MAX_TOKENS_PER_RANK`` below what the server's own limits let one rank pass to
one MoE call, a ``--moe-runner-backend`` whose top-k is not the (ids, weights) pair the
dispatcher moves (:data:`REFUSED_RUNNERS`), and ``PCIE_A2A_SGLANG_FORMAT=deepep_normal|
deepep_ll`` where nothing would apply ``routed_scaling_factor`` or with INT4 experts
(:func:`check_output_format`). The layer-level twins of the last two run again when each
MoE layer is built (``plugin.py``), for what the launcher cannot see.
"""

from __future__ import annotations

import logging
from typing import Any

from pcie_a2a import env
from pcie_a2a.integrations import _common

logger = logging.getLogger("pcie_a2a.integrations.sglang")

NAMES = ("pcie", "customized")

#: SGLang's bound on one DP worker's running requests when ``--max-running-requests`` is
#: unset at model construction (the value it sizes the FlashInfer a2a workspace with).
DEFAULT_DECODE_TOKENS = 4096


def _view(server_args: Any):
    from sglang.srt.arg_groups.overrides import resolved_view

    return resolved_view(server_args)


def selected(server_args: Any) -> bool:
    return env.sglang_enabled() and _view(server_args).moe_a2a_backend in NAMES


def required_tokens_per_rank(server_args: Any) -> int:
    """The most tokens one DP rank can pass to one MoE call under these server limits:
    a prefill chunk (SGLang's own prefill-buffer ceiling, per DP rank), a decode batch
    (``--max-running-requests`` per DP rank, or SGLang's 4096 bound, times the draft
    tokens per request under speculative decoding), or both with ``--enable-mixed-chunk``.
    SGLang captures no decode graph larger than a decode batch, so no graph size adds
    to it."""
    from sglang.srt.arg_groups.overrides import (
        max_prefill_buffer_tokens,
        max_speculative_num_draft_tokens,
    )

    view = _view(server_args)
    prefill = 0 if view.disaggregation_mode == "decode" else max_prefill_buffer_tokens(server_args)
    if view.max_running_requests is not None:
        reqs = max(1, view.max_running_requests // max(1, view.attn_dp_size))
    else:
        reqs = DEFAULT_DECODE_TOKENS
    per_req = 1
    if view.speculative_algorithm:
        per_req = max_speculative_num_draft_tokens(server_args) or 1
    decode = 0 if view.disaggregation_mode == "prefill" else reqs * per_req
    if view.enable_mixed_chunk:
        return max(1, prefill + decode)
    return max(1, prefill, decode)


def decode_tokens_per_rank(server_args: Any) -> int:
    """The most tokens one DP rank passes to one decode MoE call: running requests per DP
    rank (or SGLang's 4096 bound) times the draft tokens per request. SGLang never
    captures a decode graph larger than that, so the low-latency Buffer sized with it
    covers every captured batch."""
    from sglang.srt.arg_groups.overrides import max_speculative_num_draft_tokens

    view = _view(server_args)
    if view.max_running_requests is not None:
        reqs = max(1, view.max_running_requests // max(1, view.attn_dp_size))
    else:
        reqs = DEFAULT_DECODE_TOKENS
    per_req = 1
    if view.speculative_algorithm:
        per_req = max_speculative_num_draft_tokens(server_args) or 1
    return max(1, min(reqs * per_req, capacity_tokens_per_rank(server_args)))


def cuda_path(server_args: Any) -> bool:
    """Whether this server runs the CUDA transport (a GPU device and no explicit
    PCIE_A2A_BACKEND=cpu): the path that keeps decode CUDA graphs on."""
    device = getattr(_view(server_args), "device", None) or getattr(server_args, "device", None)
    return str(device or "cuda").startswith("cuda") and env.backend() != "cpu"


def capacity_tokens_per_rank(server_args: Any) -> int:
    """Buffer capacity for this server: ``PCIE_A2A_MAX_TOKENS_PER_RANK`` when set (it
    must cover :func:`required_tokens_per_rank`), else the requirement itself."""
    required = required_tokens_per_rank(server_args)
    return env.max_tokens_per_rank(required)


#: quantization methods whose MoE schemes ``int4.py`` converts to PackedInt4Experts
_INT4_METHODS = ("gptq", "gptq_marlin", "awq", "awq_marlin")


def int4_checkpoint(server_args: Any) -> str | None:
    """The quantization method when the MoE layers will run from pcie_a2a's packed INT4
    copy (``int4.py``: GPTQ, AWQ, compressed-tensors weight-only int), else None."""
    from sglang.srt.arg_groups.overrides import model_config_of

    qc = getattr(model_config_of(server_args).hf_config, "quantization_config", None) or {}
    if not isinstance(qc, dict):
        qc = getattr(qc, "to_dict", lambda: {})()
    method = getattr(_view(server_args), "quantization", None) or qc.get("quant_method")
    if method in _INT4_METHODS:
        return method
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            if w.get("type") == "int" and not group.get("input_activations"):
                return method  # WNA16: CompressedTensorsWNA16MoE
    return None


def _refuse(flag: str, why: str) -> None:
    raise ValueError(f"pcie_a2a: {flag} is not supported with --moe-a2a-backend pcie: {why}")


_IN_KERNEL = (
    "its kernels route from the router logits inside the kernel (SGLang's BYPASSED top-k "
    "format), so there are no per-token expert ids to dispatch"
)
#: ``--moe-runner-backend`` values refused under our backend, with the reason (SGLang 0.5.23)
REFUSED_RUNNERS = {
    "flashinfer_trtllm": _IN_KERNEL
    + "; its INT4 scheme (CompressedTensorsMxInt4MoE) is not converted by pcie_a2a either",
    "experimental_sgl_trtllm": _IN_KERNEL,
    "flashinfer_mxfp4": _IN_KERNEL,
    "triton_kernel": "its top-k output (TRITON_KERNEL routing data) carries no expert ids "
    "for the dispatcher",
}


def check_runner_backend(value: Any, flag: str = "--moe-runner-backend") -> None:
    name = getattr(value, "value", value)
    if name in REFUSED_RUNNERS:
        _refuse(
            f"{flag} {name}",
            f"{REFUSED_RUNNERS[name]}; use --moe-runner-backend auto (or triton / marlin)",
        )


def check_output_format(fmt: str, routed_scaling_factor: Any, int4: str | None) -> None:
    """``deepep_normal`` / ``deepep_ll`` hand the rows to runners whose permute back to
    those formats (SGLang's DeepGEMM, humming, aiter) never apply ``routed_scaling_factor``,
    while ``DeepseekV2MoE`` and ``Glm4MoeSparseMoeBlock`` leave it to the runner on CUDA
    (they pick ``forward_normal``, not the DeepEP forward, under our backend): the factor
    would be lost. The INT4 path reads the STANDARD top-k only."""
    if fmt == "standard":
        return
    factor = 1.0 if routed_scaling_factor is None else float(routed_scaling_factor)
    if factor != 1.0:
        _refuse(
            f"PCIE_A2A_SGLANG_FORMAT={fmt} with this model (routed_scaling_factor={factor:g})",
            "in this format neither the model nor SGLang's runners apply the factor, so "
            "every MoE output would be off by it; unset PCIE_A2A_SGLANG_FORMAT (standard)",
        )
    if int4:
        _refuse(
            f"PCIE_A2A_SGLANG_FORMAT={fmt} with this {int4} INT4 checkpoint",
            "its layers run pcie_a2a's INT4 kernel on the standard format only; unset "
            "PCIE_A2A_SGLANG_FORMAT (standard)",
        )


def routed_scaling_factor_of(server_args: Any) -> Any:
    from sglang.srt.arg_groups.overrides import model_config_of

    mc = model_config_of(server_args)
    for cfg in (getattr(mc, "hf_text_config", None), mc.hf_config):
        factor = getattr(cfg, "routed_scaling_factor", None)
        if factor is not None:
            return factor
    return None


def validate(server_args: Any) -> list[str]:
    """Checks and adjustments for a server that selected our backend. Returns the log
    lines it emitted (also logged)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, model_config_of
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    from pcie_a2a.integrations.sglang import models

    view = _view(server_args)
    said: list[str] = []

    def say(msg: str) -> None:
        said.append(msg)
        logger.info(msg)

    models.check_architectures(model_config_of(server_args).hf_config.architectures)
    if view.enable_two_batch_overlap:
        _refuse(
            "--enable-two-batch-overlap",
            "the two micro-batches would share one Buffer per mode, and a Buffer keeps "
            "one call in flight (a receive hook must run before the next call starts); "
            "overlap needs a Buffer per micro-batch, which this release does not build",
        )
    if view.enable_single_batch_overlap:
        _refuse(
            "--enable-single-batch-overlap",
            "combine cannot overlap the down projection: it starts after the expert "
            "output is complete",
        )
    int4 = int4_checkpoint(server_args)
    if view.enable_eplb and int4:
        _refuse(
            f"--enable-eplb with this {int4} INT4 checkpoint",
            "its MoE layers run from pcie_a2a's packed copy of the experts "
            "(PackedInt4Experts), which SGLang's expert weight mover does not update; place "
            "the experts at start instead: --ep-num-redundant-experts N --init-expert-location "
            "FILE (from `pcie-a2a balance --sglang-out FILE`, or a logical_count file with "
            "--eplb-algorithm pcie_a2a), docs/balance.md",
        )
    check_runner_backend(view.moe_runner_backend)
    spec_runner = getattr(view, "speculative_moe_runner_backend", None)
    if spec_runner is not None:
        check_runner_backend(spec_runner, "--speculative-moe-runner-backend")
    from pcie_a2a.integrations.sglang.dispatcher import output_format_from_env

    check_output_format(output_format_from_env(), routed_scaling_factor_of(server_args), int4)
    if view.disaggregation_mode != "decode" and (view.chunked_prefill_size or 0) <= 0:
        _refuse(
            f"--chunked-prefill-size {view.chunked_prefill_size}",
            "the buffers are sized for one prefill chunk per rank; keep chunked prefill on",
        )
    required = required_tokens_per_rank(server_args)
    capacity = env.max_tokens_per_rank(required)
    if capacity < required:
        raise ValueError(
            f"pcie_a2a: PCIE_A2A_MAX_TOKENS_PER_RANK={capacity} is below the {required} "
            "tokens one rank can pass to one MoE call with these server limits "
            "(--chunked-prefill-size per DP rank, --max-running-requests per DP rank, "
            f"--enable-mixed-chunk); raise it to at least {required} or unset it"
        )
    if not view.disable_shared_experts_fusion:
        declare_resolution(server_args, "pcie_a2a", disable_shared_experts_fusion=True)
        say(
            "pcie_a2a: --disable-shared-experts-fusion is set automatically: shared "
            "experts run replicated on every rank under --moe-a2a-backend pcie"
        )
    cg = view.cuda_graph_config
    on_gpu = cuda_path(server_args)
    nnodes = int(getattr(view, "nnodes", 1) or 1)
    if nnodes > 1 and on_gpu:
        _refuse(f"--nnodes {nnodes} on GPUs", _common.MULTI_NODE_CUDA)
    if nnodes > 1:
        say(
            f"pcie_a2a: the EP group spans {nnodes} nodes: the multi-node Buffer "
            "(pcie_a2a.internode, CPU transport inside each node, gloo between nodes)"
        )
    if cg is not None:
        phases = (Phase.PREFILL,) if on_gpu else (Phase.DECODE, Phase.PREFILL)
        on = [p for p in phases if getattr(cg, p).backend != Backend.DISABLED]
        for phase in on:
            cg = with_phase(cg, phase, backend=Backend.DISABLED)
        if on:
            declare_resolution(server_args, "pcie_a2a", cuda_graph_config=cg)
        if on_gpu:
            say(
                "pcie_a2a: decode CUDA graphs stay on under --moe-a2a-backend pcie (decode "
                "runs the low-latency dispatch/combine, buffers for "
                f"{decode_tokens_per_rank(server_args)} tokens per DP rank)"
                + ("; prefill graphs off: the normal mode reads counts on the host" if on else "")
            )
        elif on:
            say(
                "pcie_a2a: CUDA graphs are disabled (prefill and decode) under "
                "--moe-a2a-backend pcie on the CPU transport: tokens are staged through "
                "host memory"
            )
    placed = view.init_expert_location not in (None, "", "trivial")
    if view.ep_num_redundant_experts or placed or view.enable_eplb:
        say(
            f"pcie_a2a: expert placement from SGLang ({view.ep_num_redundant_experts or 0} "
            f"redundant experts, --init-expert-location {view.init_expert_location or 'trivial'}"
            f", EPLB {'on' if view.enable_eplb else 'off'}, --eplb-algorithm "
            f"{view.eplb_algorithm}): physical expert p runs on EP rank p // "
            "(physical experts / EP size)"
        )
    say(
        f"pcie_a2a: --moe-a2a-backend pcie active: EP over the TP group ({view.tp_size} "
        f"ranks, attention DP {view.attn_dp_size}), buffers for {capacity} tokens per rank "
        f"per MoE call (needed: {required})"
    )
    return said


def handle_a2a_moe(server_args: Any, previous) -> None:
    """Override of SGLang's ``handle_a2a_moe`` step: SGLang's step first, then ours
    when our backend is selected (other backends: untouched)."""
    previous(server_args)
    if selected(server_args):
        validate(server_args)
