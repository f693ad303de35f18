"""``PcieA2ADispatcher``: SGLang's ``BaseDispatcher`` contract on a pcie_a2a ``Buffer``.

Each rank passes its own (DP-attention) tokens and their *global* top-k routes; the
dispatcher sends every token once to each rank that holds one of its experts and hands the
runner the received rows. Output formats (``PCIE_A2A_SGLANG_FORMAT`` or the
``output_format`` argument):

* ``standard`` (default): ``StandardDispatchOutput`` whose ``topk_output`` carries *local*
  expert ids (-1 = not on this rank), like SGLang's own EP ``StandardDispatcher``; SGLang's
  Triton and Marlin runners work unchanged. Combine takes ``StandardCombineInput`` rows that
  are router-weighted and summed over this rank's experts.
* ``deepep_normal``: ``DeepEPNormalDispatchOutput`` (same rows, int64 local ids, per-expert
  counts list); combine takes ``DeepEPNormalCombineInput`` (weighted, summed rows).
* ``deepep_ll``: ``DeepEPLLDispatchOutput`` in DeepEP's low-latency masked layout
  ``[E_local, world * max_tokens, H]`` with ``masked_m``/``expected_m``; combine takes
  ``DeepEPLLCombineInput`` holding *unweighted* expert outputs in that layout (weights are
  applied on this rank, as DeepEP does).

``combine`` returns each source token's complete sum over all its experts, so the MoE
output owes no EP all-reduce (the plugin tells SGLang so).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher
from sglang.srt.layers.moe.token_dispatcher.deepep import (
    DeepEPLLCombineInput,
    DeepEPLLDispatchOutput,
    DeepEPNormalCombineInput,
    DeepEPNormalDispatchOutput,
)
from sglang.srt.layers.moe.token_dispatcher.standard import (
    StandardCombineInput,
    StandardDispatchOutput,
)
from sglang.srt.layers.moe.topk import StandardTopKOutput

from pcie_a2a import env
from pcie_a2a.integrations import _common

OUTPUT_FORMATS = ("standard", "deepep_normal", "deepep_ll")
FORMAT_ENV = "PCIE_A2A_SGLANG_FORMAT"

logger = logging.getLogger("pcie_a2a.integrations.sglang")
_announced = False


def capacity_from_server() -> int:
    """Tokens per rank per MoE call the buffers hold: derived from the published server
    arguments (``launch.capacity_tokens_per_rank``: chunked prefill per DP rank, running
    requests, mixed chunks; ``PCIE_A2A_MAX_TOKENS_PER_RANK`` overrides), or the default
    4096 outside a server (unit tests)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        server_args = get_server_args()
    except Exception:  # no server published in this process
        return _common.max_tokens_per_rank()
    from pcie_a2a.integrations.sglang.launch import capacity_tokens_per_rank

    return capacity_tokens_per_rank(server_args)


def output_format_from_env() -> str:
    return env.sglang_output_format(OUTPUT_FORMATS)


def default_group() -> dist.ProcessGroup | None:
    """SGLang's MoE EP group (= its TP group when the a2a backend spans EP over TP), as a
    CPU (gloo) group for the Buffer's bootstrap; the default group when SGLang's parallel
    state is not initialised (unit tests)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        tp = get_parallel().tp_group
        group = getattr(tp, "cpu_group", None)
        if group is not None:
            return group
    except Exception:  # parallel state not initialised: fall back to WORLD
        pass
    return None


class PcieA2ADispatcher(BaseDispatcher):
    """SGLang dispatcher over a shared pcie_a2a Buffer (created at the first dispatch)."""

    def __init__(
        self,
        moe_runner_config: Any,
        *,
        group: dist.ProcessGroup | None = None,
        output_format: str | None = None,
        max_tokens_per_rank: int | None = None,
    ):
        super().__init__()
        fmt = output_format or output_format_from_env()
        if fmt not in OUTPUT_FORMATS:
            raise ValueError(f"output_format={fmt!r}: expected one of {', '.join(OUTPUT_FORMATS)}")
        cfg = moe_runner_config
        num_shared = int(getattr(cfg, "num_fused_shared_experts", 0) or 0)
        if num_shared:
            raise ValueError(
                "pcie_a2a: fused shared experts are not supported by the pcie a2a backend; "
                "launch SGLang with --disable-shared-experts-fusion"
            )
        self.output_format = fmt
        self.moe_runner_config = cfg
        self.runner_backend = getattr(cfg, "runner_backend", None)
        self.num_experts = int(cfg.num_experts)
        self.num_local_experts = int(cfg.num_local_experts)
        self.top_k = int(cfg.top_k)
        self.params_dtype = getattr(cfg, "params_dtype", None)
        self._group = group
        self._group_resolved = group is not None
        self._max_tokens = max_tokens_per_rank or capacity_from_server()
        # ids handed to the runner are already local: no global -> local mapping to apply
        self.local_expert_mapping = None
        self.expert_mask_gpu = None
        self._buffer = None
        self._pending: deque = deque()  # (handle, source device, dtype) per open dispatch
        self._stage: tuple | None = None  # dispatch_a/combine_a state for the _b halves
        global _announced
        if not _announced:
            _announced = True
            logger.info(
                "pcie_a2a: MoE layers use PcieA2ADispatcher (format %s, %d experts, "
                "%d per rank, buffers for %d tokens per rank)",
                fmt,
                self.num_experts,
                self.num_local_experts,
                self._max_tokens,
            )

    # ---- buffer ------------------------------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup | None:
        if not self._group_resolved:
            self._group = default_group()
            self._group_resolved = True
        return self._group

    def buffer(self, hidden: int, dtype: torch.dtype):
        if self._buffer is None:
            if self.num_experts % dist.get_world_size(self.group):
                raise ValueError(
                    f"pcie_a2a: {self.num_experts} experts do not split evenly over "
                    f"{dist.get_world_size(self.group)} EP ranks"
                )
            self._buffer = _common.shared_buffer(
                self.group, self.num_experts, hidden, self.top_k, dtype, self._max_tokens
            )
            if self._buffer.num_local_experts != self.num_local_experts:
                raise ValueError(
                    f"pcie_a2a: SGLang expects {self.num_local_experts} local experts, the "
                    f"EP group gives {self._buffer.num_local_experts} (is --ep-size equal to "
                    "the size of the TP group?)"
                )
        return self._buffer

    # ---- dispatch ----------------------------------------------------------------------
    def dispatch(self, hidden_states: torch.Tensor, topk_output: Any, **_: Any):
        device, dtype = hidden_states.device, hidden_states.dtype
        if not hasattr(topk_output, "topk_ids") or not hasattr(topk_output, "topk_weights"):
            raise TypeError(
                f"pcie_a2a: top-k output {type(topk_output).__name__} has no topk_ids/"
                "topk_weights; use a standard top-k (not the packed/bypassed formats)"
            )
        ids, weights = topk_output.topk_ids, topk_output.topk_weights
        _common.check_topk_ids_width(self.top_k, ids.shape[-1], "sglang")
        x = _common.to_host(hidden_states, "hidden_states").contiguous()
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"pcie_a2a: hidden_states dtype {x.dtype}; expected bf16 or fp16")
        ids = _common.to_host(ids, "topk_ids").to(torch.int64).contiguous()
        weights = _common.to_host(weights, "topk_weights").to(torch.float32).contiguous()
        buf = self.buffer(x.shape[1], x.dtype)
        if self.output_format == "deepep_ll":
            res = _common.dispatch(buf, x, ids, weights, layout="expert_major")
        else:
            res = _common.dispatch(buf, x, ids, weights)
        self._pending.append((res.handle, device, dtype))
        to = device
        if self.output_format == "standard":
            return StandardDispatchOutput(
                hidden_states=res.x.to(to),
                hidden_states_scale=None,
                topk_output=StandardTopKOutput(
                    topk_weights=res.topk_weights.to(to),
                    topk_ids=res.topk_ids.to(to),
                    router_logits=None,
                ),
            )
        if self.output_format == "deepep_normal":
            return DeepEPNormalDispatchOutput(
                hidden_states=res.x.to(to),
                hidden_states_scale=None,
                topk_ids=res.topk_ids.to(torch.int64).to(to),
                topk_weights=res.topk_weights.to(to),
                num_recv_tokens_per_expert=res.tokens_per_expert_list,
            )
        e_local = max(1, self.num_local_experts)
        total = int(res.tokens_per_expert.sum())
        return DeepEPLLDispatchOutput(
            hidden_states=res.x.to(to),
            hidden_states_scale=None,
            topk_ids=res.topk_ids.reshape(-1, res.topk_ids.shape[-1]).to(torch.int64).to(to),
            topk_weights=res.topk_weights.reshape(-1, res.topk_weights.shape[-1]).to(to),
            masked_m=res.tokens_per_expert.to(to),
            expected_m=max(1, -(-total // e_local)),
        )

    # ---- combine -----------------------------------------------------------------------
    def combine(self, combine_input: Any, **_: Any) -> torch.Tensor:
        if not self._pending:
            raise RuntimeError("pcie_a2a: combine() without a matching dispatch()")
        expected = {
            "standard": StandardCombineInput,
            "deepep_normal": DeepEPNormalCombineInput,
            "deepep_ll": DeepEPLLCombineInput,
        }[self.output_format]
        if not isinstance(combine_input, expected) and not hasattr(combine_input, "hidden_states"):
            raise TypeError(
                f"pcie_a2a: combine input {type(combine_input).__name__}; expected "
                f"{expected.__name__} for output format {self.output_format!r}"
            )
        handle, device, dtype = self._pending.popleft()
        buf = self._buffer
        y = _common.to_host(combine_input.hidden_states, "combine hidden_states")
        y = y.to(buf.dtype).contiguous()
        if self.output_format == "deepep_ll":
            out = buf.low_latency_combine(y, handle)
        else:
            out = buf.combine(y, handle)
        return out.to(device=device, dtype=dtype)

    # ---- split API used by two-batch overlap and models' op lists ----------------------
    def dispatch_a(self, hidden_states: torch.Tensor, topk_output: Any, **_: Any) -> None:
        if self._stage is not None:
            raise RuntimeError(f"pcie_a2a: dispatch_a() while {self._stage[0]} is open")
        self._stage = ("dispatch", self.dispatch(hidden_states, topk_output))

    def dispatch_b(self, **_: Any):
        if self._stage is None or self._stage[0] != "dispatch":
            raise RuntimeError("pcie_a2a: dispatch_b() without dispatch_a()")
        out = self._stage[1]
        self._stage = None
        return out

    def combine_a(self, combine_input: Any, **_: Any) -> None:
        if self._stage is not None:
            raise RuntimeError(f"pcie_a2a: combine_a() while {self._stage[0]} is open")
        self._stage = ("combine", self.combine(combine_input))

    def combine_b(self, **_: Any) -> torch.Tensor:
        if self._stage is None or self._stage[0] != "combine":
            raise RuntimeError("pcie_a2a: combine_b() without combine_a()")
        out = self._stage[1]
        self._stage = None
        return out
