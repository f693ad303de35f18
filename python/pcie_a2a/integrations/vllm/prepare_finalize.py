"""``PcieA2APrepareAndFinalize``: vLLM 0.33's ``FusedMoEPrepareAndFinalizeModular`` on a
pcie_a2a ``Buffer`` (Standard activation format).

prepare: each DP rank sends its tokens once to every EP rank holding one of their experts
and returns the received rows ``[R, H]`` with their top-k ids in vLLM's *global* expert
space (slots routed elsewhere point at an expert that is not on this rank, with weight 0,
so the layer's ``expert_map`` maps them to -1, as vLLM's DeepEP high-throughput path
does) plus per-local-expert token counts. Any Standard-format experts run on that, e.g.
``MarlinExperts`` for INT4 (GPTQ/AWQ/compressed-tensors) checkpoints.

finalize: applies the router weights and the top-k reduction on this rank (unless the
experts already did), sends each row back to its source, and writes the fp32 sum over the
token's ranks into ``output`` in place.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOP,
)

from pcie_a2a.integrations import _common


def default_group() -> dist.ProcessGroup | None:
    """vLLM's EP group as a CPU (gloo) group; the default group when vLLM's parallel
    state is not initialised (unit tests)."""
    try:
        from vllm.distributed.parallel_state import get_ep_group

        group = getattr(get_ep_group(), "cpu_group", None)
        if group is not None:
            return group
    except Exception:  # parallel state not initialised
        pass
    return None


def weight_and_reduce(
    fused_expert_output: torch.Tensor,
    topk_weights: torch.Tensor,
    apply_router_weight_on_input: bool,
) -> torch.Tensor:
    """``[R, K, H]`` unweighted expert outputs -> ``[R, H]`` (fp32 sum, cast back)."""
    r, k = topk_weights.shape
    y = fused_expert_output.reshape(r, k, fused_expert_output.shape[-1]).float()
    if not apply_router_weight_on_input:
        y = y * topk_weights.reshape(r, k, 1).float()
    return y.sum(dim=1).to(fused_expert_output.dtype)


class PcieA2APrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    def __init__(
        self,
        num_experts: int,
        num_local_experts: int,
        top_k: int,
        *,
        group: dist.ProcessGroup | None = None,
        max_tokens_per_rank: int | None = None,
    ):
        super().__init__()
        self.num_experts = int(num_experts)
        self.num_local_experts = int(num_local_experts)
        self.top_k = int(top_k)
        self._group = group
        self._group_resolved = group is not None
        self._max_tokens = max_tokens_per_rank or _common.max_tokens_per_rank()
        self._buffer = None
        self._pending: deque = deque()

    @classmethod
    def from_moe_config(cls, moe: Any) -> PcieA2APrepareAndFinalize:
        pc = moe.moe_parallel_config
        if getattr(pc, "enable_eplb", False):
            raise ValueError(
                "pcie_a2a: EPLB (redundant experts) is not supported by the pcie_a2a "
                "prepare/finalize; drop --enable-eplb or unset PCIE_A2A_VLLM"
            )
        mtpr = max(int(getattr(moe, "max_num_tokens", 0) or 0), _common.DEFAULT_MAX_TOKENS_PER_RANK)
        return cls(
            moe.num_experts,
            moe.num_local_experts,
            moe.experts_per_token,
            max_tokens_per_rank=_common.max_tokens_per_rank(mtpr),
        )

    # ---- the contract's static answers ---------------------------------------------------
    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int64

    def max_num_tokens_per_rank(self) -> int | None:
        return None

    def num_dispatchers(self) -> int:
        return dist.get_world_size(self.group)

    def output_is_reduced(self) -> bool:
        return True  # finalize returns each token's complete sum on its source rank

    def supports_async(self) -> bool:
        return False

    # ---- buffer ----------------------------------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup | None:
        if not self._group_resolved:
            self._group = default_group()
            self._group_resolved = True
        return self._group

    def buffer(self, hidden: int, dtype: torch.dtype):
        if self._buffer is None:
            world = dist.get_world_size(self.group)
            if self.num_experts != self.num_local_experts * world:
                raise ValueError(
                    f"pcie_a2a: {self.num_experts} experts with {self.num_local_experts} "
                    f"per rank do not match an EP group of {world} ranks"
                )
            self._buffer = _common.shared_buffer(
                self.group, self.num_experts, hidden, self.top_k, dtype, self._max_tokens
            )
        return self._buffer

    # ---- prepare / finalize ----------------------------------------------------------------
    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: Any,
        defer_input_quant: bool = False,
    ) -> mk.PrepareResultType:
        device = a1.device
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError(
                    "pcie_a2a: apply_router_weight_on_input needs top-1 routing, got "
                    f"top-{topk_ids.shape[1]}"
                )
            a1 = a1 * topk_weights.to(a1.dtype)
        _common.check_topk_ids_width(self.top_k, topk_ids.shape[1], "vllm")
        x = _common.to_host(a1, "hidden_states").contiguous()
        ids = _common.to_host(topk_ids, "topk_ids").to(torch.int64).contiguous()
        w = _common.to_host(topk_weights, "topk_weights").to(torch.float32).contiguous()
        buf = self.buffer(x.shape[1], x.dtype)
        res = _common.dispatch(buf, x, ids, w)
        self._pending.append(res.handle)
        offset = buf.rank * self.num_local_experts
        off_rank = self.num_experts - 1 if offset == 0 else 0
        local = res.topk_ids.to(torch.int64)
        gids = torch.where(local < 0, torch.full_like(local, off_rank), local + offset)
        rx = res.x.to(device)
        scale = None
        quant_dtype = getattr(quant_config, "quant_dtype", None)
        if quant_dtype is not None and not defer_input_quant and rx.numel():
            from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

            rx, scale = moe_kernel_quantize_input(
                rx,
                quant_config.a1_scale,
                quant_dtype=quant_dtype,
                per_act_token_quant=quant_config.per_act_token_quant,
                block_shape=quant_config.block_shape,
            )
        if device.type == "cpu":  # make_from_list pins host memory, which needs a GPU
            counts = res.tokens_per_expert.to(torch.int32)
            meta = mk.ExpertTokensMetadata(
                expert_num_tokens=counts, expert_num_tokens_cpu=counts.clone()
            )
        else:
            meta = mk.ExpertTokensMetadata.make_from_list(res.tokens_per_expert_list, device=device)
        return rx, scale, meta, gids.to(device), res.topk_weights.to(device)

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: Any,
    ) -> None:
        if not self._pending:
            raise RuntimeError("pcie_a2a: finalize() without a matching prepare()")
        handle = self._pending.popleft()
        y = fused_expert_output
        if isinstance(weight_and_reduce_impl, TopKWeightAndReduceNoOP):
            pass  # the experts already weighted and reduced: [R, H]
        elif y.device.type == "cpu" or isinstance(
            weight_and_reduce_impl, (TopKWeightAndReduceDelegate, TopKWeightAndReduceContiguous)
        ):
            y = weight_and_reduce(y, topk_weights, apply_router_weight_on_input)
        else:
            y = weight_and_reduce_impl.apply(
                output=None,
                fused_expert_output=y,
                topk_weights=topk_weights,
                topk_ids=topk_ids,
                apply_router_weight_on_input=apply_router_weight_on_input,
            )
        buf = self._buffer
        rows = _common.to_host(y, "expert output").to(buf.dtype).contiguous()
        out = buf.combine(rows, handle)
        output.copy_(out.to(device=output.device, dtype=output.dtype))
