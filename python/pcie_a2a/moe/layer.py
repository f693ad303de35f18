"""``MoE``: router -> dispatch -> local experts -> combine (+ shared expert).

One forward on every rank of the expert-parallel group::

    ids, w  = router(x)                       # [T, K] global ids, fp32 weights
    rows    = buffer.dispatch(x, ids, w)      # each token once per destination rank
    y_rows  = experts.forward_rows(rows)      # weighted, summed over this rank's experts
    routed  = buffer.combine(y_rows)          # [T, H]: partials summed in fp32
    out     = routed + shared_expert(x)       # fp32 add, one rounding to x.dtype

Mode: low-latency (static ``[world, max_tokens, H]`` receive, CUDA-graph friendly) for
small batches, normal (compacted rows; batches larger than the Buffer's
``max_tokens_per_rank`` are cut into chunks) for large ones. Every rank of the group must
take the same mode and the same number of chunks in a call, so the choice is made from
the largest token count of the group: pass it (``max_num_tokens=``, as serving frameworks
know it), or let the layer find it with one small ``all_reduce(MAX)`` per forward
(``sync_num_tokens=True``, the default), or set ``sync_num_tokens=False`` when every rank
is known to pass the same token count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pcie_a2a.buffer import Buffer
from pcie_a2a.placement import Placement
from pcie_a2a.quant import PackedInt4Experts, stack_experts

from .config import (
    INT4_METHODS,
    MoESpec,
    TensorSource,
    parse_config,
    random_checkpoint,
    read_dense,
    read_int4,
)
from .experts import BF16Experts, Experts, Int4Experts, SharedExpert
from .router import Router

MODES = ("auto", "normal", "low_latency")
DEFAULT_LOW_LATENCY_MAX_TOKENS = 128


def _fail(kind: type[Exception], arg: str, got: object, allowed: str) -> Exception:
    return kind(f"{arg}: got {got}; allowed: {allowed}")


class MoE(nn.Module):
    """Expert-parallel MoE layer.

    Args:
        router: a :class:`Router` (global expert ids).
        experts: this rank's routed experts (:class:`Experts`), one per local index of the
            placement on this rank; with ``local=True``, all ``router.num_experts``.
        shared_expert: optional :class:`SharedExpert`, run on every token of this rank.
        buffer: an existing :class:`pcie_a2a.Buffer` (it may be shared by every MoE layer of
            a model; the layer does not close it). Its placement and group are used.
        group: process group for a Buffer the layer creates (None: the default group).
        placement: expert placement for a Buffer the layer creates (default contiguous).
        max_tokens_per_rank, payload, backend, timeout_s: arguments of that Buffer.
        local: run every expert in this process, without a Buffer (single process).
        mode: ``"auto"`` (low-latency when the group's largest batch is at most
            ``low_latency_max_tokens``, else normal), ``"normal"`` or ``"low_latency"``;
            ``forward(mode=...)`` overrides it per call.
        low_latency_max_tokens: the auto threshold (default ``min(128, max_tokens_per_rank)``).
        sync_num_tokens: without ``max_num_tokens``, find the group's largest batch with
            an ``all_reduce(MAX)`` (True) or assume every rank has this rank's (False).
        load_window: how many forwards :meth:`expert_load` sums (the tokens this rank
            routed to each global expert; a ring of per-forward counts where the router's
            ids live, no host synchronisation until read).

    Input ``x [..., H]`` in the experts' dtype (bf16/fp16); output the same shape and dtype.
    Without a Buffer and without ``local=True``, a Buffer is created when
    ``torch.distributed`` is initialised (collective: every rank must construct the layer).
    """

    def __init__(
        self,
        router: Router,
        experts: Experts,
        *,
        shared_expert: SharedExpert | None = None,
        buffer: Buffer | None = None,
        group: Any = None,
        placement: Placement | None = None,
        max_tokens_per_rank: int = 256,
        payload: str = "bf16",
        backend: str = "auto",
        timeout_s: float = 30.0,
        local: bool = False,
        mode: str = "auto",
        low_latency_max_tokens: int | None = None,
        sync_num_tokens: bool = True,
        load_window: int = 1000,
    ):
        super().__init__()
        if not isinstance(load_window, int) or isinstance(load_window, bool) or load_window < 1:
            raise _fail(ValueError, "load_window", repr(load_window), "an int >= 1")
        self.load_window = load_window
        self._load_ring: torch.Tensor | None = None  # [load_window, E] int64
        self._load_pos = 0
        if not isinstance(router, Router):
            raise _fail(TypeError, "router", type(router).__name__, "pcie_a2a.moe.Router")
        if not isinstance(experts, Experts):
            raise _fail(
                TypeError,
                "experts",
                type(experts).__name__,
                "a pcie_a2a.moe.Experts (BF16Experts, Int4Experts, or a subclass)",
            )
        if mode not in MODES:
            raise _fail(ValueError, "mode", repr(mode), ", ".join(map(repr, MODES)))
        if experts.hidden != router.hidden:
            raise _fail(
                ValueError, "experts.hidden", experts.hidden, f"router.hidden={router.hidden}"
            )
        if shared_expert is not None and shared_expert.hidden != router.hidden:
            raise _fail(
                ValueError,
                "shared_expert.hidden",
                shared_expert.hidden,
                f"router.hidden={router.hidden}",
            )
        self.router = router
        self.experts = experts
        self.shared_expert = shared_expert
        self.hidden = router.hidden
        self.num_experts = router.num_experts
        self.top_k = router.top_k
        self.dtype = experts.dtype
        self.mode = mode
        self.sync_num_tokens = bool(sync_num_tokens)
        self.last_mode: str | None = None  # the mode of the latest forward (for tests and logs)
        self._owns_buffer = False
        self.buffer: Buffer | None = None
        if local or (buffer is None and not (dist.is_available() and dist.is_initialized())):
            if buffer is not None:
                raise ValueError("local=True and buffer=... exclude each other")
            if experts.num_local_experts != self.num_experts:
                raise _fail(
                    ValueError,
                    "experts.num_local_experts",
                    experts.num_local_experts,
                    f"router.num_experts={self.num_experts} (no expert parallelism)",
                )
            self.rank, self.world = 0, 1
            self.placement = Placement.contiguous(self.num_experts, 1)
            cap = max_tokens_per_rank
        else:
            if buffer is None:
                world = dist.get_world_size(group)
                placement = placement or Placement.contiguous(self.num_experts, world)
                # Bootstrap is collective: check our experts after every rank has joined.
                buffer = Buffer(
                    group,
                    self.num_experts,
                    self.hidden,
                    max_tokens_per_rank,
                    dtype=self.dtype,
                    payload=payload,
                    placement=placement,
                    backend=backend,
                    timeout_s=timeout_s,
                    num_topk=self.top_k,
                )
                self._owns_buffer = True
            if not isinstance(buffer, Buffer):
                raise _fail(TypeError, "buffer", type(buffer).__name__, "a pcie_a2a.Buffer")
            self.buffer = buffer
            buffer.count_expert_load = True  # the load window reads it every forward
            self.rank, self.world = buffer.rank, buffer.world
            self.placement = buffer.placement
            cap = buffer.max_tokens_per_rank
            problems = []
            if buffer.num_experts != self.num_experts:
                problems.append(
                    f"buffer.num_experts={buffer.num_experts} but the router has {self.num_experts}"
                )
            if buffer.hidden != self.hidden:
                problems.append(f"buffer.hidden={buffer.hidden} but hidden={self.hidden}")
            if buffer.dtype != self.dtype:
                problems.append(f"buffer.dtype={buffer.dtype} but experts.dtype={self.dtype}")
            if buffer.num_topk < self.top_k:
                problems.append(f"buffer.num_topk={buffer.num_topk} < top_k={self.top_k}")
            n_local = buffer.num_local_experts
            if experts.num_local_experts != n_local:
                problems.append(
                    f"experts.num_local_experts={experts.num_local_experts} but "
                    f"the placement puts {n_local} experts on rank {self.rank}"
                )
            if problems:
                self.close()
                raise ValueError("MoE: " + "; ".join(problems))
        self.max_tokens_per_rank = cap
        if low_latency_max_tokens is None:
            low_latency_max_tokens = min(DEFAULT_LOW_LATENCY_MAX_TOKENS, cap)
        if not isinstance(low_latency_max_tokens, int) or not 0 <= low_latency_max_tokens <= cap:
            raise _fail(
                ValueError,
                "low_latency_max_tokens",
                repr(low_latency_max_tokens),
                f"an int in [0, max_tokens_per_rank={cap}]",
            )
        self.low_latency_max_tokens = low_latency_max_tokens

    # ---- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Closes the Buffer if this layer created it. Safe to call twice."""
        if self._owns_buffer and self.buffer is not None:
            self.buffer.close()
        self._owns_buffer = False

    def __enter__(self) -> MoE:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def local_experts(self) -> list[int]:
        """Global expert id of each local expert of this rank."""
        return self.placement.local_experts(self.rank)

    # ---- forward -------------------------------------------------------------------------
    def choose_mode(self, max_num_tokens: int, mode: str | None = None) -> str:
        """The mode a call with the group's largest batch ``max_num_tokens`` takes."""
        mode = self.mode if mode is None else mode
        if mode not in MODES:
            raise _fail(ValueError, "mode", repr(mode), ", ".join(map(repr, MODES)))
        if mode == "auto":
            return "low_latency" if max_num_tokens <= self.low_latency_max_tokens else "normal"
        if mode == "low_latency" and max_num_tokens > self.max_tokens_per_rank:
            raise _fail(
                ValueError,
                "mode",
                f"'low_latency' with a batch of {max_num_tokens} tokens",
                f"'normal' or 'auto' above max_tokens_per_rank={self.max_tokens_per_rank} tokens",
            )
        return mode

    def _group_max_tokens(self, num_tokens: int, device: torch.device) -> int:
        if self.world == 1 or not self.sync_num_tokens:
            return num_tokens
        group = self.buffer.group
        on = device if dist.get_backend(group) != "gloo" else torch.device("cpu")
        t = torch.tensor([num_tokens], dtype=torch.int64, device=on)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    def forward(
        self, x: torch.Tensor, *, mode: str | None = None, max_num_tokens: int | None = None
    ) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]`` (same dtype).

        ``mode`` overrides the layer's mode for this call; ``max_num_tokens`` is the
        largest token count any rank of the group passes to this call (skips the sync).
        """
        if not isinstance(x, torch.Tensor):
            raise _fail(TypeError, "x", type(x).__name__, "a torch.Tensor")
        if x.dim() < 1 or x.shape[-1] != self.hidden:
            raise _fail(ValueError, "x.shape", tuple(x.shape), f"[..., {self.hidden}]")
        if x.dtype != self.dtype:
            raise _fail(TypeError, "x.dtype", x.dtype, f"{self.dtype} (the experts' dtype)")
        shape = x.shape
        x2 = x.reshape(-1, self.hidden).contiguous()
        t = x2.shape[0]
        if max_num_tokens is not None and (
            not isinstance(max_num_tokens, int) or max_num_tokens < t
        ):
            raise _fail(
                ValueError,
                "max_num_tokens",
                repr(max_num_tokens),
                f"an int >= this rank's token count {t}",
            )
        ids, weights = self.router(x2)
        if self.buffer is not None:
            self.buffer.expert_load()  # start this forward's count (drop other users' calls)
        if self.buffer is None:
            self.last_mode = "local"
            routed = self.experts.forward_rows(x2, ids, weights)
            flat = ids.reshape(-1)
            counts = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device)
            self._record_load(counts.index_add_(0, flat.clamp_min(0).long(), (flat >= 0).long()))
        else:
            group_max = (
                max_num_tokens
                if max_num_tokens is not None
                else self._group_max_tokens(t, x2.device)
            )
            chosen = self.choose_mode(group_max, mode)
            self.last_mode = chosen
            if chosen == "low_latency":
                routed = self._low_latency(x2, ids, weights)
            else:
                routed = self._normal(x2, ids, weights, group_max)
            self._record_load(self.buffer.expert_load())
        if self.shared_expert is not None:
            out = (routed.float() + self.shared_expert.forward_fp32(x2)).to(x.dtype)
        else:
            out = routed
        return out.reshape(shape)

    def _low_latency(self, x, ids, weights) -> torch.Tensor:
        buf = self.buffer
        recv = buf.low_latency_dispatch(x, ids, weights, layout="rows")
        k = recv.topk_ids.shape[-1]
        y = self.experts.forward_rows(
            recv.x.view(-1, self.hidden), recv.topk_ids.view(-1, k), recv.topk_weights.view(-1, k)
        )
        return buf.low_latency_combine(y.view(recv.x.shape).contiguous(), recv.handle)

    def _normal(self, x, ids, weights, group_max: int) -> torch.Tensor:
        buf = self.buffer
        cap = self.max_tokens_per_rank
        chunks = max(1, -(-group_max // cap))
        outs = []
        for c in range(chunks):
            sl = slice(c * cap, (c + 1) * cap)  # empty on ranks with fewer tokens
            recv = buf.dispatch(x[sl], ids[sl], weights[sl])
            # Every received row has a local expert: rows / experts is a lower bound of the
            # rows per active expert (the low-latency path keeps the default tile).
            rpe = recv.x.shape[0] / max(1, self.experts.num_local_experts)
            y = self.experts.forward_rows(
                recv.x, recv.topk_ids, recv.topk_weights, rows_per_expert=rpe
            )
            outs.append(buf.combine(y.contiguous(), recv.handle))
        return outs[0] if chunks == 1 else torch.cat(outs)

    # ---- expert load and rebalancing ---------------------------------------------------------
    def _record_load(self, counts: torch.Tensor) -> None:
        if self._load_ring is None or self._load_ring.device != counts.device:
            self._load_ring = torch.zeros(
                self.load_window, self.num_experts, dtype=torch.int64, device=counts.device
            )
        self._load_ring[self._load_pos % self.load_window].copy_(counts)
        self._load_pos += 1

    def expert_load(self) -> torch.Tensor:
        """Tokens this rank routed to each global expert over the last ``load_window``
        forwards (``[num_experts]`` int64, CPU)."""
        if self._load_ring is None:
            return torch.zeros(self.num_experts, dtype=torch.int64)
        return self._load_ring.sum(dim=0).cpu()

    def gather_expert_load(self) -> torch.Tensor:
        """Every rank's :meth:`expert_load`, ``[world, num_experts]`` (collective over the
        layer's group): the loads and per-source shares ``pcie_a2a.balance`` takes."""
        mine = self.expert_load()
        if self.buffer is None:
            return mine[None]
        out: list = [None] * self.world
        dist.all_gather_object(out, mine.tolist(), group=self.buffer.group)
        return torch.tensor(out, dtype=torch.int64)

    def rebalance(self, placement: Placement) -> None:
        """Moves this layer's experts to ``placement`` (collective: every rank of the group
        calls it between forwards with the same placement). The weights move rank to rank
        through the process group (pcie_a2a.moe.rebalance); then the layer switches to a
        new Buffer of that placement, so no call sees a mix of old and new. On any error
        every rank raises and the old placement stays. The layer must own its Buffer (a
        Buffer shared by several layers has one placement for all of them)."""
        from .rebalance import move_experts

        if self.buffer is None:
            raise ValueError("MoE.rebalance: this layer runs without a Buffer (one rank)")
        if not self._owns_buffer:
            raise ValueError(
                "MoE.rebalance: the layer was given its Buffer (placement=... of a Buffer is "
                "fixed, and it may serve other layers); let each layer create its own"
            )
        if not isinstance(placement, Placement):
            placement = Placement(placement, self.world)
        if placement.num_experts != self.num_experts or placement.world != self.world:
            raise _fail(
                ValueError,
                "placement",
                f"{placement.num_experts} experts on {placement.world} ranks",
                f"{self.num_experts} experts on {self.world} ranks",
            )
        buf = self.buffer
        busy = None
        if buf._pending_hook is not None:
            busy = f"the receive hook of {buf._pending_hook[0]} has not been called"
        elif placement.num_local_experts(self.rank) < 1:
            busy = "the new placement leaves this rank no expert"
        experts = move_experts(self.experts, self.placement, placement, self.rank, buf.group, busy)
        new_buf = Buffer(
            buf.group,
            buf.num_experts,
            buf.hidden,
            buf.max_tokens_per_rank,
            dtype=buf.dtype,
            payload=buf.payload,
            placement=placement,
            backend=buf.backend,
            timeout_s=buf.timeout_s,
            num_topk=buf.num_topk,
        )
        self.experts = experts
        self.buffer = new_buf
        new_buf.count_expert_load = True
        self.placement = placement
        buf.close()  # every rank is past its last call on it (the agreement above)

    def extra_repr(self) -> str:
        return (
            f"rank={self.rank}, world={self.world}, mode={self.mode}, "
            f"low_latency_max_tokens={self.low_latency_max_tokens}, "
            f"max_tokens_per_rank={self.max_tokens_per_rank}"
        )

    # ---- construction from a Hugging Face config --------------------------------------------
    @classmethod
    def from_config(
        cls,
        hf_config: Mapping,
        *,
        weights: Any = None,
        layer: int | None = None,
        prefix: str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        experts_format: str = "auto",
        allow_inexact_scales: bool = False,
        seed: int = 0,
        **kwargs: Any,
    ) -> MoE:
        """Builds the MoE layer of a Kimi K2, DeepSeek-V3, Qwen3-MoE or Mixtral config.

        Args:
            hf_config: the model's ``config.json`` as a dict (``quantization_config``
                included when the checkpoint is quantised).
            weights: the checkpoint (``Mapping[str, Tensor]`` or a safetensors handle);
                only this rank's experts are read. None: random weights from ``seed``
                (tests and benchmarks; the whole layer is generated, so keep it small).
            layer, prefix: which layer (default: the first MoE layer); ``prefix``
                overrides the tensor name prefix (default ``model.layers.{layer}.mlp.``).
            dtype: activation dtype (bf16 or fp16).
            experts_format: ``"auto"`` (INT4 when the checkpoint stores the routed experts
                in INT4, else bf16), ``"bf16"`` (dequantise INT4/FP8 experts), ``"int4"``.
            allow_inexact_scales: let INT4 scales round to ``dtype`` (e.g. fp16 GPTQ scales
                with bf16 activations).
            **kwargs: the :class:`MoE` arguments (buffer, group, placement,
                max_tokens_per_rank, payload, mode, low_latency_max_tokens, local, ...).
        """
        if experts_format not in ("auto", "bf16", "int4"):
            raise _fail(
                ValueError, "experts_format", repr(experts_format), "'auto', 'bf16', 'int4'"
            )
        if dtype not in (torch.bfloat16, torch.float16):
            raise _fail(TypeError, "dtype", dtype, "torch.bfloat16, torch.float16")
        spec = parse_config(hf_config)
        p = prefix if prefix is not None else spec.prefix(layer)
        if weights is None:
            weights = random_checkpoint(hf_config, prefix=p, seed=seed, dtype=dtype)
        src = TensorSource(weights)
        local_ids = _local_experts(spec, kwargs)
        router = spec.router(dtype)
        with torch.no_grad():
            router.weight.copy_(src.get(f"{p}gate.weight"))
            if spec.correction_bias:
                router.e_score_correction_bias.copy_(src.get(f"{p}gate.e_score_correction_bias"))
        experts = build_experts(
            spec, src, p, local_ids, dtype, experts_format, allow_inexact_scales
        )
        shared = None
        if spec.shared_intermediate:
            shared = SharedExpert(spec.hidden, spec.shared_intermediate, dtype)
            with torch.no_grad():
                for nm in ("gate_proj", "up_proj", "down_proj"):
                    getattr(shared, nm).weight.copy_(
                        read_dense(src, f"{p}shared_experts.{nm}", spec.quant, dtype)
                    )
        moe = cls(router, experts, shared_expert=shared, **kwargs)
        moe.spec = spec
        return moe


def _local_experts(spec: MoESpec, kwargs: dict) -> list[int]:
    """Global ids of this rank's experts, before the Buffer exists."""
    buffer = kwargs.get("buffer")
    if buffer is not None:
        return buffer.placement.local_experts(buffer.rank)
    if kwargs.get("local") or not (dist.is_available() and dist.is_initialized()):
        return list(range(spec.num_experts))
    group = kwargs.get("group")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    placement = kwargs.get("placement")
    if placement is None:
        placement = Placement.contiguous(spec.num_experts, world)
        kwargs["placement"] = placement
    elif not isinstance(placement, Placement):
        placement = Placement(placement, world)
        kwargs["placement"] = placement
    if placement.num_experts != spec.num_experts or placement.world != world:
        raise _fail(
            ValueError,
            "placement",
            f"{placement.num_experts} experts on {placement.world} ranks",
            f"{spec.num_experts} experts on {world} ranks",
        )
    return placement.local_experts(rank)


def build_experts(
    spec: MoESpec,
    src: TensorSource,
    prefix: str,
    local_ids: list[int],
    dtype: torch.dtype,
    experts_format: str = "auto",
    allow_inexact_scales: bool = False,
) -> Experts:
    """Reads experts ``local_ids`` (global ids, in local-index order) from a checkpoint."""
    gn, un, dn = spec.proj_names
    names = [tuple(f"{prefix}experts.{e}.{nm}" for nm in (gn, un, dn)) for e in local_ids]
    if not names:
        raise ValueError("this rank holds no experts; every rank needs at least one")
    stored_int4 = src.has(f"{names[0][0]}.weight_packed") or src.has(f"{names[0][0]}.qweight")
    fmt = experts_format if experts_format != "auto" else ("int4" if stored_int4 else "bf16")
    if fmt == "int4":
        if not stored_int4 or spec.quant is None or spec.quant.method not in INT4_METHODS:
            raise _fail(
                ValueError,
                "experts_format",
                "'int4'",
                "'bf16' or 'auto': the routed experts of this checkpoint are not INT4 "
                "(quantising is not done at load time)",
            )
        per = [[read_int4(src, n, spec.quant) for n in expert] for expert in names]
        gate, up, down = (stack_experts([p[j] for p in per]) for j in range(3))
        packed = PackedInt4Experts.from_weights(
            gate, up, down, dtype, allow_inexact_scales=allow_inexact_scales
        )
        return Int4Experts(packed)
    experts = BF16Experts(len(local_ids), spec.hidden, spec.intermediate, dtype)
    for local, expert in enumerate(names):
        experts.load_expert(local, *(read_dense(src, n, spec.quant, dtype) for n in expert))
    return experts
