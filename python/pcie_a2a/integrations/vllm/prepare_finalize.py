"""``PcieA2APrepareAndFinalize``: vLLM's ``FusedMoEPrepareAndFinalizeModular`` (0.32/0.33
contract) on a pcie_a2a ``Buffer`` (Standard activation format).

prepare: each DP rank sends its tokens once to every EP rank holding one of their experts
and returns the received rows ``[R, H]``, their top-k ids and weights, and per-local-expert
token counts. Where each expert lives is the layer's ``expert_map`` (gathered from every EP
rank when the Buffer is made), so any placement vLLM builds (linear, round robin, uneven
splits) routes right; a map that later disagrees with it is refused. The ids are handed to
the experts in the space *they* index with:

- experts that read ``expert_map`` (vLLM's GPU experts: Triton, Marlin, CUTLASS, ...) get
  global ids; a slot routed to another rank points at an expert that is not on this rank,
  with weight 0, so ``expert_map`` turns it into -1 (vLLM's DeepEP high-throughput
  convention);
- vLLM's CPU experts index their local weights directly: they get local ids, and a slot
  routed elsewhere points at local expert 0 with weight 0 (it costs a wasted row, never a
  wrong one).

Which is which is read from the experts' class against two lists checked against vLLM
0.33's sources (:data:`GLOBAL_ID_EXPERTS`, :data:`LOCAL_ID_EXPERTS`), never from
``supports_expert_map()``: vLLM itself never calls that method, and a False answer does
not mean "local ids" (``HPCExperts`` and ``MoonEPExperts`` answer False and index
*global* ids). Experts in neither list are refused in ``post_init_setup`` (vLLM calls it
with the experts when it builds the ``FusedMoEKernel``, at model construction). Ids keep the router's dtype. Activation quantization runs after
the dispatch, exactly as vLLM's no-EP path quantizes (``a1_gscale`` for NVFP4, the
experts' scale layout), so scales never cross the wire.

finalize: applies the router weights and the top-k reduction on this rank (unless the
experts already did), sends each row back to its source, and writes the fp32 sum over the
token's ranks into ``output`` in place (``output_is_reduced()``).

Modes: a call whose largest DP rank passes at most ``low_latency_tokens`` tokens (vLLM's
largest CUDA-graph size) runs ``low_latency_dispatch``/``low_latency_combine`` on a Buffer
of that capacity: rows in the ``rows`` layout flattened to ``[world * capacity, H]``
(empty slots carry weight 0 and an off-rank expert), per-expert counts left on the device,
nothing read on the host, so vLLM's graphs capture it. Larger calls (prefill) run the
normal mode. On a device-resident Buffer (the CUDA transport) tensors stay on the device;
on the CPU transport they are staged through host memory (``_common.device_resident``).
"""

from __future__ import annotations

import functools
import inspect
import logging
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
from pcie_a2a.placement import Placement

logger = logging.getLogger("vllm.pcie_a2a")

EXPERT_ID_SPACES = ("auto", "global", "local")


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


_EXPERTS = "vllm.model_executor.layers.fused_moe.experts."

#: Experts whose ``apply`` passes ``expert_map`` to its kernel (global ids in, -1 dropped):
#: class (or base class) -> module. Subclasses inherit the answer.
GLOBAL_ID_EXPERTS = {
    "TritonExperts": _EXPERTS + "triton_moe",  # + TritonWNA16Experts, the emulations
    "MarlinExpertsBase": _EXPERTS + "marlin_moe",
    "DeepGemmExperts": _EXPERTS + "deep_gemm_moe",
    "CutlassExpertsFp8Base": _EXPERTS + "cutlass_moe",
    "FallbackExperts": _EXPERTS + "fallback",  # TritonOrDeepGemm, TritonOrCutlass
}
#: vLLM's CPU experts: ``expert_map`` is in their signature and never read; the ids index
#: this rank's weights as given.
LOCAL_ID_EXPERTS = {
    name: _EXPERTS + "cpu_moe"
    for name in (
        "CPUUnquantizedExperts",  # + its x86, Arm and PowerPC subclasses
        "CPUExpertsFp8",
        "CPUExpertsFp8W8A8",
        "CPUExpertsMxfp4",
        "CPUExpertsInt4",
        "CPUExpertsInt8",
        "ArmCPUExpertsInt8",
        "PowerCPUExpertsInt8",
        "ZenCPUExpertsInt8",
    )
}


def _listed(cls: type, table: dict[str, str]) -> bool:
    return any(table.get(c.__name__) == c.__module__ for c in cls.__mro__)


def expert_id_space(fused_experts: Any) -> str:
    """``"global"`` or ``"local"``: the ids these experts index with, from their class;
    a ValueError naming the class for experts in neither list."""
    cls = type(fused_experts)
    if _listed(cls, GLOBAL_ID_EXPERTS):
        return "global"
    if _listed(cls, LOCAL_ID_EXPERTS):
        return "local"
    known = ", ".join(sorted(GLOBAL_ID_EXPERTS) + sorted(LOCAL_ID_EXPERTS))
    raise ValueError(
        f"pcie_a2a (PCIE_A2A_VLLM=1): the MoE experts {cls.__module__}.{cls.__qualname__} "
        "are not among those whose expert-id convention pcie_a2a has checked (global ids "
        "through expert_map, or this rank's local ids), so the rows could reach the wrong "
        f"experts; supported: {known}. Choose another MoE backend (--moe-backend) or unset "
        "PCIE_A2A_VLLM"
    )


def experts_read_expert_map(fused_experts: Any = None) -> bool:
    """Whether these experts (None: the platform's usual ones, for a prepare/finalize
    used outside a FusedMoEKernel) map global ids through ``expert_map``."""
    if fused_experts is not None:
        return expert_id_space(fused_experts) == "global"
    from vllm.platforms import current_platform

    # vLLM's CPU experts (experts/cpu_moe.py) never read expert_map
    return not current_platform.is_cpu()


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


@functools.cache
def _quantize_kwargs() -> frozenset[str]:
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    return frozenset(inspect.signature(moe_kernel_quantize_input).parameters)


def quantize_input(a: torch.Tensor, quant_config: Any) -> tuple[torch.Tensor, Any]:
    """The received rows quantized as vLLM's no-EP prepare quantizes its input."""
    from vllm.model_executor.layers.fused_moe import utils

    nvfp4 = bool(getattr(quant_config, "use_nvfp4_w4a4", False))
    kwargs = dict(
        quant_dtype=quant_config.quant_dtype,
        per_act_token_quant=quant_config.per_act_token_quant,
        block_shape=quant_config.block_shape,
    )
    accepted = _quantize_kwargs()
    for name in ("is_scale_swizzled", "is_scale_transposed", "mx_alignment"):
        if name in accepted and hasattr(quant_config, name):
            kwargs[name] = getattr(quant_config, name)
    scale = quant_config.a1_gscale if nvfp4 else quant_config.a1_scale
    return utils.moe_kernel_quantize_input(a, scale, **kwargs)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share memory (vLLM may hand finalize an ``output``
    that is a view of its workspace)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def placement_from_expert_maps(maps: list[list[int]], num_experts: int) -> Placement:
    """Every rank's ``expert_map`` (global id -> local index, -1 = elsewhere) as one
    Placement; each expert must live on exactly one rank."""
    replicas: list[list[tuple[int, int]]] = [[] for _ in range(num_experts)]
    for rank, local_map in enumerate(maps):
        if len(local_map) != num_experts:
            raise ValueError(
                f"pcie_a2a: rank {rank}'s expert_map has {len(local_map)} entries, the layer "
                f"has {num_experts} experts"
            )
        for expert, local in enumerate(local_map):
            if local >= 0:
                replicas[expert].append((rank, int(local)))
    for expert, reps in enumerate(replicas):
        if len(reps) != 1:
            raise ValueError(
                f"pcie_a2a: expert {expert} is held by {len(reps)} ranks "
                f"({[r for r, _ in reps]}); exactly one is supported (no redundant experts)"
            )
    return Placement(replicas, len(maps))


class PcieA2APrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    def __init__(
        self,
        num_experts: int,
        num_local_experts: int,
        top_k: int,
        *,
        group: dist.ProcessGroup | None = None,
        max_tokens_per_rank: int | None = None,
        expert_ids: str = "auto",
        low_latency_tokens: int | None = None,
    ):
        super().__init__()
        if expert_ids not in EXPERT_ID_SPACES:
            raise ValueError(
                f"expert_ids: got {expert_ids!r}; allowed: {', '.join(EXPERT_ID_SPACES)}"
            )
        self.num_experts = int(num_experts)
        self.num_local_experts = int(num_local_experts)
        self.top_k = int(top_k)
        self.max_tokens = int(max_tokens_per_rank or _common.max_tokens_per_rank())
        self.expert_ids = expert_ids  # "auto": decided by post_init_setup (or prepare)
        # calls whose largest DP rank passes at most this many tokens run the low-latency
        # mode (static shapes, no host sync: the CUDA-graph sizes); larger ones the normal
        self.low_latency_tokens = min(int(low_latency_tokens or 0), self.max_tokens)
        self._group = group
        self._group_resolved = group is not None
        self._buffer = None
        self._ll_buffer = None
        self._placement_built: Placement | None = None
        self._l2g_on: dict[torch.device, torch.Tensor] = {}
        self._local_to_global: torch.Tensor | None = None  # + an off-rank expert last
        self._local_map: list[int] | None = None  # this rank's expert_map, as built
        self._map_checked: torch.Tensor | None = None
        self._pending: deque = deque()

    @classmethod
    def from_moe_config(cls, moe: Any) -> PcieA2APrepareAndFinalize:
        """One per MoE layer; sized from the server's own limits: a rank never passes more
        than ``--max-num-batched-tokens`` tokens to one MoE call (nor more than the largest
        CUDA graph size)."""
        pc = moe.moe_parallel_config
        if getattr(pc, "enable_eplb", False):
            raise ValueError(
                "pcie_a2a: EPLB (redundant experts) is not supported by the pcie_a2a "
                "prepare/finalize; drop --enable-eplb or unset PCIE_A2A_VLLM"
            )
        in_dtype = getattr(moe, "in_dtype", torch.bfloat16)
        if in_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"pcie_a2a: the MoE activations are {in_dtype}; pcie_a2a moves bfloat16 or "
                "float16 rows: pass --dtype bfloat16 (or float16) or unset PCIE_A2A_VLLM"
            )
        need = max(
            int(getattr(moe, "max_num_tokens", 0) or 0),
            int(getattr(moe, "max_capture_size", 0) or 0),
            1,
        )
        cap = _common.max_tokens_per_rank(need)
        if cap < need:
            raise ValueError(
                f"pcie_a2a: PCIE_A2A_MAX_TOKENS_PER_RANK={cap} is below what one MoE call can "
                f"carry on this server ({need} tokens: --max-num-batched-tokens / the "
                f"largest CUDA graph size); raise it to at least {need} or unset it"
            )
        return cls(
            moe.num_experts,
            moe.num_local_experts,
            moe.experts_per_token,
            max_tokens_per_rank=cap,
            low_latency_tokens=int(getattr(moe, "max_capture_size", 0) or 0),
        )

    # ---- the contract's static answers ---------------------------------------------------
    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self) -> torch.dtype | None:
        return None  # any: prepare hands the ids back in the router's dtype

    def max_num_tokens_per_rank(self) -> int | None:
        return None

    def num_dispatchers(self) -> int:
        return dist.get_world_size(self.group)

    def output_is_reduced(self) -> bool:
        return True  # finalize returns each token's complete sum on its source rank

    def supports_async(self) -> bool:
        return False

    def supports_dbo(self) -> bool:
        return False  # refused at launch (launch.resolve)

    def post_init_setup(self, fused_experts: Any) -> None:
        if self.expert_ids == "auto":  # an explicit expert_ids is the caller's word
            self.expert_ids = expert_id_space(fused_experts)
            logger.debug(
                "pcie_a2a: %s gets %s expert ids", type(fused_experts).__name__, self.expert_ids
            )

    # ---- buffer ----------------------------------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup | None:
        if not self._group_resolved:
            self._group = default_group()
            self._group_resolved = True
        return self._group

    def _placement(self, expert_map: torch.Tensor | None, world: int) -> Placement:
        """Collective over the EP group when ``expert_map`` is given (every rank makes its
        Buffer in the same layer, on the same forward)."""
        if expert_map is None:
            if self.num_experts != self.num_local_experts * world:
                raise ValueError(
                    f"pcie_a2a: {self.num_experts} experts with {self.num_local_experts} "
                    f"per rank do not match an EP group of {world} ranks"
                )
            return Placement.contiguous(self.num_experts, world)
        local_map = [int(v) for v in expert_map.tolist()]
        maps: list[Any] = [None] * world
        dist.all_gather_object(maps, local_map, group=self.group)
        return placement_from_expert_maps(maps, self.num_experts)

    def low_latency_buffer(self, hidden: int, dtype: torch.dtype, expert_map=None):
        """The Buffer of the low-latency calls: one decode (CUDA-graph) batch per rank."""
        self.buffer(hidden, dtype, expert_map)
        if self._ll_buffer is None:
            self._ll_buffer = _common.shared_buffer(self.group, self.num_experts, hidden,
                                                    self.top_k, dtype, self.low_latency_tokens,
                                                    placement=self._placement_built)  # fmt: skip
        return self._ll_buffer

    def _low_latency(self, num_tokens: int) -> bool:
        """The mode of this call, the same on every rank: vLLM's DP metadata gives every
        rank the token counts of all of them (host tensors)."""
        if self.low_latency_tokens <= 0:
            return False
        try:
            from vllm.forward_context import get_forward_context, is_forward_context_available

            if is_forward_context_available():
                dp = get_forward_context().dp_metadata
                if dp is not None:
                    num_tokens = int(dp.num_tokens_across_dp_cpu.max())
        except Exception:  # no forward context (unit tests): this rank's own count
            pass
        return num_tokens <= self.low_latency_tokens

    def _local_to_global_on(self, device: torch.device) -> torch.Tensor:
        t = self._l2g_on.get(device)
        if t is None:
            t = self._l2g_on[device] = self._local_to_global.to(device)
        return t

    def buffer(self, hidden: int, dtype: torch.dtype, expert_map: torch.Tensor | None = None):
        if self._buffer is None:
            world = dist.get_world_size(self.group)
            rank = dist.get_rank(self.group)
            placement = self._placement(expert_map, world)
            self._placement_built = placement
            if placement.num_local_experts(rank) != self.num_local_experts:
                raise ValueError(
                    f"pcie_a2a: expert_map puts {placement.num_local_experts(rank)} experts "
                    f"on EP rank {rank}, the layer holds {self.num_local_experts}"
                )
            self._buffer = _common.shared_buffer(
                self.group,
                self.num_experts,
                hidden,
                self.top_k,
                dtype,
                self.max_tokens,
                placement=placement,
            )
            local = placement.local_experts(rank)
            here = set(local)
            elsewhere = next((e for e in range(self.num_experts) if e not in here), 0)
            self._local_to_global = torch.tensor([*local, elsewhere], dtype=torch.int64)
            self._local_map = [-1] * self.num_experts
            for idx, expert in enumerate(local):
                self._local_map[expert] = idx
        self._check_expert_map(expert_map)
        return self._buffer

    def _check_expert_map(self, expert_map: torch.Tensor | None) -> None:
        if expert_map is None or expert_map is self._map_checked:
            return
        if [int(v) for v in expert_map.tolist()] != self._local_map:
            raise ValueError(
                "pcie_a2a: this layer's expert_map differs from the placement the buffers "
                "were built for (experts moved at run time, e.g. by EPLB); not supported"
            )
        self._map_checked = expert_map

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
        low_latency = self._low_latency(a1.shape[0])
        if low_latency:
            buf = self.low_latency_buffer(a1.shape[1], a1.dtype, expert_map)
        else:
            buf = self.buffer(a1.shape[1], a1.dtype, expert_map)
        x = _common.stage_in(buf, a1, "hidden_states").contiguous()
        ids = _common.stage_in(buf, topk_ids, "topk_ids").contiguous()
        w = _common.stage_in(buf, topk_weights, "topk_weights").to(torch.float32).contiguous()
        if self.expert_ids == "auto":  # built outside a FusedMoEKernel
            self.expert_ids = "global" if experts_read_expert_map() else "local"
        if low_latency:  # the rows layout, flattened: [world * capacity, ...]
            res = _common.dispatch(buf, x, ids, w, layout="rows")
            rx, local, rw = (t.flatten(0, 1) for t in (res.x, res.topk_ids, res.topk_weights))
        else:
            res = _common.dispatch(buf, x, ids, w)
            rx, local, rw = res.x, res.topk_ids, res.topk_weights
        self._pending.append((buf, res.handle, low_latency))
        # local: int32 index on this rank, -1 routed elsewhere (or an empty slot)
        if self.expert_ids == "local":
            out_ids = local.clamp(min=0)  # weight 0 on those slots
        else:  # -1 -> the off-rank expert
            out_ids = self._local_to_global_on(local.device)[local.long()]
        rx = _common.stage_out(buf, rx, device)
        scale = None
        quantize = getattr(quant_config, "quant_dtype", None) is not None
        if quantize and not defer_input_quant and rx.numel():
            rx, scale = quantize_input(rx, quant_config)
        counts = _common.stage_out(buf, res.tokens_per_expert, device)
        if _common.device_resident(buf):
            # counts stay on the device (no host copy: capturable)
            meta = mk.ExpertTokensMetadata(expert_num_tokens=counts, expert_num_tokens_cpu=None)
        elif device.type == "cpu":  # make_from_list pins host memory, which needs a GPU
            counts = counts.to(torch.int32)
            meta = mk.ExpertTokensMetadata(
                expert_num_tokens=counts, expert_num_tokens_cpu=counts.clone()
            )
        else:
            meta = mk.ExpertTokensMetadata.make_from_list(res.tokens_per_expert_list, device=device)
        return (
            rx,
            scale,
            meta,
            _common.stage_out(buf, out_ids, device).to(topk_ids.dtype),
            _common.stage_out(buf, rw, device).to(topk_weights.dtype),
        )

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
        buf, handle, low_latency = self._pending.popleft()
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
        rows = _common.stage_in(buf, y, "expert output").to(buf.dtype).contiguous()
        # straight into vLLM's output when the Buffer can write it (the CUDA path: no copy
        # launch); otherwise (host staging, another dtype, a strided view) through a copy
        direct = (
            output.device == buf.device
            and output.dtype == buf.dtype
            and output.is_contiguous()
            and not _overlap(output, rows)
        )
        into = output if direct else None
        if low_latency:
            rows = rows.view(buf.world, buf.max_tokens_per_rank, rows.shape[-1])
            out = buf.low_latency_combine(rows, handle, out=into)
        else:
            out = buf.combine(rows, handle, out=into)
        if not direct:
            output.copy_(out)  # copy_ crosses devices and casts itself
