"""Expert MLPs that run between dispatch and combine, and the dense shared expert.

Every routed-experts object implements :class:`Experts`: ``forward_rows(x, topk_ids,
topk_weights)`` with the dispatch row semantics of :class:`pcie_a2a.Buffer`::

    x            [R, H]   bf16/fp16 rows received by this rank
    topk_ids     [R, K]   int32/int64 *local* expert ids, -1 = none
    topk_weights [R, K]   fp32 routing weights
    y[r] = sum_k topk_weights[r, k] * MLP_{topk_ids[r, k]}(x[r])     (fp32, cast to x.dtype)
    MLP_e(v) = down_e(silu(gate_e(v)) * up_e(v))

Rows without any expert (all ids -1; e.g. the unused capacity of a low-latency receive)
are never read; their output is undefined (the INT4 CUDA kernel does not write them, as
in DeepEP; the dense experts and the CPU reference give zeros). ``rows_per_expert`` is an
optional host-side estimate of the rows per active expert (it may pick a larger tile).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from pcie_a2a.quant import PackedInt4Experts, moe_int4_mlp

_DTYPES = (torch.bfloat16, torch.float16)


def _fail(kind: type[Exception], arg: str, got: object, allowed: str) -> Exception:
    return kind(f"{arg}: got {got}; allowed: {allowed}")


class Experts(nn.Module):
    """Interface of the routed experts of one rank (``num_local_experts`` of them)."""

    num_local_experts: int
    hidden: int
    intermediate: int
    dtype: torch.dtype
    format: str = "?"

    def forward_rows(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        rows_per_expert: float | None = None,
    ) -> torch.Tensor:
        """``x [R, H]``, ``topk_ids [R, K]`` local ids (-1 = none), ``topk_weights [R, K]``
        fp32 -> ``[R, H]`` in ``x.dtype``, weighted and summed over each row's experts."""
        raise NotImplementedError

    def forward(self, x, topk_ids, topk_weights):
        return self.forward_rows(x, topk_ids, topk_weights)

    # -- moving experts between ranks (MoE.rebalance) -------------------------------------
    def expert_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds expert weights, each ``[num_local_experts, ...]``: local
        expert ``l`` is ``[t[l] for t in expert_tensors()]``."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement expert_tensors()/with_expert_tensors(), "
            "so its experts cannot be moved between ranks"
        )

    def with_expert_tensors(self, tensors: list[torch.Tensor]) -> Experts:
        """A new object of this kind holding ``tensors`` (as :meth:`expert_tensors` lists
        them, any number of experts)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement expert_tensors()/with_expert_tensors()"
        )

    def _check_rows(self, x, topk_ids, topk_weights) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise _fail(ValueError, "x.shape", got, f"[rows, {self.hidden}]")
        if x.dtype != self.dtype:
            raise _fail(TypeError, "x.dtype", x.dtype, f"{self.dtype} (the experts' dtype)")
        if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
            raise _fail(ValueError, "topk_ids.shape", tuple(topk_ids.shape), f"[{x.shape[0]}, k]")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise _fail(TypeError, "topk_ids.dtype", topk_ids.dtype, "torch.int32, torch.int64")
        if tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise _fail(
                ValueError,
                "topk_weights.shape",
                tuple(topk_weights.shape),
                f"the shape of topk_ids {tuple(topk_ids.shape)}",
            )
        if topk_weights.dtype != torch.float32:
            raise _fail(TypeError, "topk_weights.dtype", topk_weights.dtype, "torch.float32")
        if topk_ids.numel():
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            if lo < -1 or hi >= self.num_local_experts:
                bad = lo if lo < -1 else hi
                raise _fail(
                    ValueError,
                    "topk_ids",
                    f"local expert id {bad}",
                    f"-1 or [0, {self.num_local_experts})",
                )

    def extra_repr(self) -> str:
        return (
            f"format={self.format}, num_local_experts={self.num_local_experts}, "
            f"hidden={self.hidden}, intermediate={self.intermediate}, dtype={self.dtype}"
        )


def _mlp_fp32(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w13.float()).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2.float())


class BF16Experts(Experts):
    """Unquantised experts: ``w13 [E_local, 2I, H]`` (gate rows then up rows) and
    ``w2 [E_local, H, I]`` in ``dtype`` (bf16 or fp16), computed in fp32.

    Portable torch implementation (one gather/GEMM/scatter per expert that has rows); it
    is correct on any device but not the fast path on GPU.
    """

    format = "bf16"

    def __init__(
        self,
        num_local_experts: int,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        if dtype not in _DTYPES:
            raise _fail(TypeError, "dtype", dtype, "torch.bfloat16, torch.float16")
        self.num_local_experts = num_local_experts
        self.hidden = hidden
        self.intermediate = intermediate
        self.dtype = dtype
        self.w13 = nn.Parameter(
            torch.zeros(num_local_experts, 2 * intermediate, hidden, dtype=dtype),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.zeros(num_local_experts, hidden, intermediate, dtype=dtype), requires_grad=False
        )

    def load_expert(
        self, local: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> None:
        """Copies one expert: ``gate``/``up`` ``[I, H]``, ``down`` ``[H, I]`` (nn.Linear layout)."""
        i, h = self.intermediate, self.hidden
        for name, t, shape in (("gate", gate, (i, h)), ("up", up, (i, h)), ("down", down, (h, i))):
            if tuple(t.shape) != shape:
                raise _fail(ValueError, f"{name}.shape", tuple(t.shape), str(list(shape)))
        with torch.no_grad():
            self.w13[local, :i].copy_(gate)
            self.w13[local, i:].copy_(up)
            self.w2[local].copy_(down)

    def expert_tensors(self) -> list[torch.Tensor]:
        return [self.w13.data, self.w2.data]

    def with_expert_tensors(self, tensors: list[torch.Tensor]) -> BF16Experts:
        w13, w2 = tensors
        out = BF16Experts(w13.shape[0], self.hidden, self.intermediate, self.dtype)
        out.w13 = nn.Parameter(w13.to(self.w13.device), requires_grad=False)
        out.w2 = nn.Parameter(w2.to(self.w2.device), requires_grad=False)
        return out

    def forward_rows(self, x, topk_ids, topk_weights, *, rows_per_expert=None):
        self._check_rows(x, topk_ids, topk_weights)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        ids = topk_ids.long()
        for e in torch.unique(ids[ids >= 0]).tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            y = _mlp_fp32(x[rows].float(), self.w13[e], self.w2[e])
            out.index_add_(0, rows, y * topk_weights[rows, slot].unsqueeze(1))
        return out.to(x.dtype)


class Int4Experts(Experts):
    """W4A16 experts in the packed kernel layout (:class:`pcie_a2a.quant.PackedInt4Experts`,
    from GPTQ, AWQ or compressed-tensors). Runs :func:`pcie_a2a.quant.moe_int4_mlp`: the
    fused CUDA kernel on CUDA tensors, the dequantising fp32 CPU reference on CPU tensors.

    ``module.to(device)`` moves the packed tensors; dtype casts are ignored (the activation
    dtype is fixed when packing).
    """

    format = "int4"

    def __init__(self, packed: PackedInt4Experts):
        super().__init__()
        if not isinstance(packed, PackedInt4Experts):
            raise _fail(TypeError, "packed", type(packed).__name__, "PackedInt4Experts")
        self.packed = packed
        self.num_local_experts = packed.num_experts
        self.hidden = packed.hidden
        self.intermediate = packed.intermediate
        self.dtype = packed.dtype

    def _apply(self, fn, recurse=True):
        device = fn(torch.empty(0, device=self.packed.w13.qweight.device)).device
        self.packed = self.packed.to(device)
        return super()._apply(fn, recurse)

    _FIELDS = ("qweight", "scales", "zeros", "k_perm", "k_perm_inv")

    def _present(self, w) -> list[str]:
        return [f for f in self._FIELDS if getattr(w, f) is not None]

    def expert_tensors(self) -> list[torch.Tensor]:
        p = self.packed
        return [getattr(p.w13, f) for f in self._present(p.w13)] + [
            getattr(p.w2, f) for f in self._present(p.w2)
        ]

    def with_expert_tensors(self, tensors: list[torch.Tensor]) -> Int4Experts:
        p = self.packed
        n13 = len(self._present(p.w13))
        w13 = dataclasses.replace(p.w13, **dict(zip(self._present(p.w13), tensors[:n13])))
        w2 = dataclasses.replace(p.w2, **dict(zip(self._present(p.w2), tensors[n13:])))
        return Int4Experts(PackedInt4Experts(w13, w2))

    def forward_rows(self, x, topk_ids, topk_weights, *, rows_per_expert=None):
        self._check_rows(x, topk_ids, topk_weights)
        return moe_int4_mlp(
            x,
            topk_ids.to(torch.int32).contiguous(),
            topk_weights.contiguous(),
            self.packed.w13,
            self.packed.w2,
            rows_per_expert=rows_per_expert,
        )


class SharedExpert(nn.Module):
    """The dense expert every token goes through: ``down(silu(gate(x)) * up(x))``.

    ``gate_proj``/``up_proj`` ``[I, H]``, ``down_proj`` ``[H, I]`` (nn.Linear, no bias), in
    ``dtype``; computed in fp32, returned in ``x.dtype``. ``gated=True`` adds Qwen2-MoE's
    ``shared_expert_gate [1, H]``: the output is multiplied by ``sigmoid(x @ gate^T)``.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        gated: bool = False,
    ):
        super().__init__()
        self.hidden = hidden
        self.intermediate = intermediate
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)
        self.expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype) if gated else None
        for p in self.parameters():
            p.requires_grad_(False)

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> fp32 ``[T, H]``."""
        xf = x.float()
        h = F.silu(F.linear(xf, self.gate_proj.weight.float())) * F.linear(
            xf, self.up_proj.weight.float()
        )
        y = F.linear(h, self.down_proj.weight.float())
        if self.expert_gate is not None:
            y = y * torch.sigmoid(F.linear(xf, self.expert_gate.weight.float()))
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_fp32(x).to(x.dtype)
