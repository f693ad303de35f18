"""``PcieA2ADispatcher``: SGLang's ``BaseDispatcher`` contract on a pcie_a2a ``Buffer``.

Each rank passes its own (DP-attention) tokens and their *global* top-k routes; the
dispatcher sends every token once to each rank that holds one of its experts and hands the
runner the received rows.

Mode, per forward (SGLang's ``is_extend_in_batch``, the same on every rank):

* extend/prefill: the normal ``dispatch``/``combine`` (compacted rows; per-rank counts
  read on the host, as prefill is never captured);
* decode: ``low_latency_dispatch``/``low_latency_combine`` on a second Buffer sized for
  one decode batch per DP rank (static shapes, counts on the device, nothing read on the
  host: capturable in SGLang's CUDA graphs).

Output formats (``PCIE_A2A_SGLANG_FORMAT`` or the ``output_format`` argument):

* ``standard`` (default): ``StandardDispatchOutput`` whose ``topk_output`` carries *local*
  expert ids (-1 = not on this rank), like SGLang's own EP ``StandardDispatcher``; SGLang's
  Triton runner works unchanged. In decode the rows are the low-latency ``rows`` layout
  flattened to ``[world * capacity, H]`` (slots past a source's count carry -1 ids).
  Combine takes ``StandardCombineInput`` rows, router-weighted and summed over this rank's
  experts. Layers running pcie_a2a's INT4 kernel get the ``deepep_ll`` output in decode
  (``moe_int4_mlp_expert_major`` on the expert-major layout, ``int4.py``).
* ``deepep_normal``: ``DeepEPNormalDispatchOutput`` (same rows, int64 local ids, per-expert
  counts list) in extend, ``DeepEPLLDispatchOutput`` in decode, as DeepEP's auto mode.
* ``deepep_ll``: ``DeepEPLLDispatchOutput`` in both modes, DeepEP's masked layout
  ``[E_local, world * capacity, H]`` with ``masked_m`` on the device and ``expected_m``
  from the shapes; combine takes ``DeepEPLLCombineInput`` holding *unweighted* expert
  outputs in that layout (weights are applied on this rank, as DeepEP does).

Where tokens live: on a device-resident Buffer (the CUDA transport) the framework's
tensors go in and come out where they are; on the CPU transport they are staged through
host memory (``_common.device_resident``).

``combine`` returns each source token's complete sum over all its experts, so the MoE
output owes no EP all-reduce (the plugin tells SGLang so).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from dataclasses import dataclass
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


def decode_capacity_from_server() -> int | None:
    """Tokens per rank of one decode batch (the low-latency Buffer's capacity), or None
    outside a server (then the normal capacity)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        server_args = get_server_args()
    except Exception:  # no server published in this process
        return None
    from pcie_a2a.integrations.sglang.launch import decode_tokens_per_rank

    return decode_tokens_per_rank(server_args)


def is_extend_in_batch() -> bool:
    """SGLang's per-forward flag (any DP rank extends): every rank picks the same mode.
    True outside a forward (unit tests that set nothing): the normal mode."""
    try:
        from sglang.srt.layers.dp_attention import get_is_extend_in_batch

        return bool(get_is_extend_in_batch())
    except Exception:  # no forward state in this process
        return True


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
    """SGLang dispatcher over shared pcie_a2a Buffers (created at the first dispatch of
    each mode: every rank runs the same modes in the same order)."""

    def __init__(
        self,
        moe_runner_config: Any,
        *,
        group: dist.ProcessGroup | None = None,
        output_format: str | None = None,
        max_tokens_per_rank: int | None = None,
        decode_tokens_per_rank: int | None = None,
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
        decode = decode_tokens_per_rank or decode_capacity_from_server() or self._max_tokens
        self._decode_tokens = min(decode, self._max_tokens)
        # ids handed to the runner are already local: no global -> local mapping to apply
        self.local_expert_mapping = None
        self.expert_mask_gpu = None
        self._buffers: dict[str, Any] = {}  # "normal" / "low_latency" -> Buffer
        self._layer = None  # the FusedMoE this dispatcher serves (plugin: bind_layer)
        self._pending: deque = deque()  # _Open per dispatch not yet combined
        self._stage: tuple | None = None  # dispatch_a/combine_a state for the _b halves
        global _announced
        if not _announced:
            _announced = True
            logger.info(
                "pcie_a2a: MoE layers use PcieA2ADispatcher (format %s, %d experts, "
                "%d per rank, buffers for %d tokens per rank, %d per decode batch)",
                fmt,
                self.num_experts,
                self.num_local_experts,
                self._max_tokens,
                self._decode_tokens,
            )

    def bind_layer(self, layer: Any) -> None:
        """The MoE layer this dispatcher serves (weakly: it owns us), so decode can hand
        layers that run pcie_a2a's INT4 kernel the expert-major layout."""
        self._layer = weakref.ref(layer)

    # ---- buffer ------------------------------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup | None:
        if not self._group_resolved:
            self._group = default_group()
            self._group_resolved = True
        return self._group

    def buffer(self, hidden: int, dtype: torch.dtype, mode: str = "normal"):
        """The shared Buffer of ``mode`` ("normal": the server's full per-call capacity;
        "low_latency": one decode batch, unless the format runs everything in it)."""
        buf = self._buffers.get(mode)
        if buf is None:
            world = dist.get_world_size(self.group)
            if self.num_experts % world:
                raise ValueError(
                    f"pcie_a2a: {self.num_experts} experts do not split evenly over "
                    f"{world} EP ranks"
                )
            small = mode == "low_latency" and self.output_format != "deepep_ll"
            cap = self._decode_tokens if small else self._max_tokens
            buf = _common.shared_buffer(self.group, self.num_experts, hidden, self.top_k, dtype,
                                        cap)  # fmt: skip
            if buf.num_local_experts != self.num_local_experts:
                raise ValueError(
                    f"pcie_a2a: SGLang expects {self.num_local_experts} local experts, the "
                    f"EP group gives {buf.num_local_experts} (is --ep-size equal to "
                    "the size of the TP group?)"
                )
            self._buffers[mode] = buf
        return buf

    @property
    def _buffer(self):  # the normal-mode Buffer (tests, stats)
        return self._buffers.get("normal")

    def _int4_layer(self) -> Any:
        """The bound layer when it runs pcie_a2a's packed INT4 experts, else None."""
        from pcie_a2a.integrations.sglang.int4 import INT4_ATTR

        layer = self._layer() if self._layer is not None else None
        return layer if getattr(layer, INT4_ATTR, None) is not None else None

    def _layout(self, decode: bool, int4: bool) -> str | None:
        """None: the normal mode; else the low-latency layout."""
        if self.output_format == "deepep_ll":
            return "expert_major"
        if not decode:
            return None
        return "rows" if self.output_format == "standard" and not int4 else "expert_major"

    # ---- dispatch ----------------------------------------------------------------------
    def dispatch(self, hidden_states: torch.Tensor, topk_output: Any, **_: Any):
        device, dtype = hidden_states.device, hidden_states.dtype
        if not hasattr(topk_output, "topk_ids") or not hasattr(topk_output, "topk_weights"):
            raise TypeError(
                f"pcie_a2a: top-k output {type(topk_output).__name__} has no topk_ids/"
                "topk_weights; use a standard top-k (not the packed/bypassed formats)"
            )
        if dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"pcie_a2a: hidden_states dtype {dtype}; expected bf16 or fp16")
        ids, weights = topk_output.topk_ids, topk_output.topk_weights
        _common.check_topk_ids_width(self.top_k, ids.shape[-1], "sglang")
        int4 = self._int4_layer()
        layout = self._layout(not is_extend_in_batch(), int4 is not None)
        buf = self.buffer(hidden_states.shape[1], dtype, "normal" if layout is None else
                          "low_latency")  # fmt: skip
        x = _common.stage_in(buf, hidden_states, "hidden_states").contiguous()
        ids = _common.stage_in(buf, ids, "topk_ids").contiguous()
        weights = _common.stage_in(buf, weights, "topk_weights").to(torch.float32)
        if layout == "expert_major" and int4 is not None:
            from pcie_a2a.integrations.sglang.int4 import expert_major_weights

            # the combine applies the weights on the expert-major path
            weights = expert_major_weights(int4, weights)
        res = _common.dispatch(buf, x, ids, weights.contiguous(), layout=layout)
        self._pending.append(_Open(buf, res, layout, device, dtype))
        return self._output(buf, res, layout, device, x.shape[0])

    def _output(self, buf, res, layout: str | None, device, num_tokens: int):
        def out(t: torch.Tensor) -> torch.Tensor:
            return _common.stage_out(buf, t, device)

        if layout == "expert_major":
            k = res.topk_ids.shape[-1]
            # DeepEP's estimate of rows per local expert, from shapes only (no host read)
            expected = (num_tokens * buf.world * k + self.num_experts) // self.num_experts
            return DeepEPLLDispatchOutput(
                hidden_states=out(res.x),
                hidden_states_scale=None,
                topk_ids=out(res.topk_ids.reshape(-1, k)),
                topk_weights=out(res.topk_weights.reshape(-1, k)),
                masked_m=out(res.tokens_per_expert),
                expected_m=max(1, expected),
            )
        x, ids, w = res.x, res.topk_ids, res.topk_weights
        if layout == "rows":  # [world, capacity, ...] -> the runner's [rows, ...]
            x, ids, w = x.flatten(0, 1), ids.flatten(0, 1), w.flatten(0, 1)
        if self.output_format == "deepep_normal":
            return DeepEPNormalDispatchOutput(
                hidden_states=out(x),
                hidden_states_scale=None,
                topk_ids=out(ids).to(torch.int64),
                topk_weights=out(w),
                num_recv_tokens_per_expert=res.tokens_per_expert_list,
            )
        return StandardDispatchOutput(
            hidden_states=out(x),
            hidden_states_scale=None,
            topk_output=StandardTopKOutput(
                topk_weights=out(w), topk_ids=out(ids), router_logits=None
            ),
        )

    # ---- combine -----------------------------------------------------------------------
    def combine(self, combine_input: Any, **_: Any) -> torch.Tensor:
        if not self._pending:
            raise RuntimeError("pcie_a2a: combine() without a matching dispatch()")
        op = self._pending[0]
        expected = {
            "standard": StandardCombineInput,
            "deepep_normal": DeepEPNormalCombineInput,
            "deepep_ll": DeepEPLLCombineInput,
        }[self.output_format if op.layout != "expert_major" else "deepep_ll"]
        if not isinstance(combine_input, expected) and not hasattr(combine_input, "hidden_states"):
            raise TypeError(
                f"pcie_a2a: combine input {type(combine_input).__name__}; expected "
                f"{expected.__name__} for output format {self.output_format!r}"
            )
        self._pending.popleft()
        buf = op.buffer
        y = _common.stage_in(buf, combine_input.hidden_states, "combine hidden_states")
        y = y.to(buf.dtype).contiguous()
        if op.layout is None:
            out = buf.combine(y, op.result.handle)
        else:
            if op.layout == "rows":
                y = y.view(buf.world, buf.max_tokens_per_rank, y.shape[-1])
            out = buf.low_latency_combine(y, op.result.handle)
        return _common.stage_out(buf, out, op.device).to(op.dtype)

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


@dataclass
class _Open:
    """A dispatch waiting for its combine. It holds the whole result, not only the handle:
    under CUDA-graph capture every tensor the dispatch's kernels wrote must live until the
    combine has been captured too."""

    buffer: Any
    result: Any
    layout: str | None  # None: normal mode
    device: torch.device
    dtype: torch.dtype
