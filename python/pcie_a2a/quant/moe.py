"""The fused INT4 expert MLP between dispatch and combine, and its CPU reference.

Rows layout (what dispatch delivers on one rank; see DESIGN.md section 4)::

    rows         [R, H]        bf16/fp16, one row per (token, this rank)
    row_experts  [R, topk]     int32 local expert ids in [0, E), -1 = none
    row_weights  [R, topk]     fp32 routing weights (0 where the id is -1)
    out[r] = sum_k row_weights[r, k] * MLP_{row_experts[r, k]}(rows[r])   (fp32 sum)
    MLP_e(x) = down_e(silu(gate_e(x)) * up_e(x))

The output is already weighted and summed over this rank's experts, so it goes straight
into combine. Rows that have no local expert (all ids -1, e.g. the unused capacity of a
low-latency receive buffer) are not written by the CUDA kernel: their contents are
undefined, as in DeepEP (zeroing them would cost more than the MLP at decode sizes); the
CPU reference returns zeros there. Expert-major layout (DeepEP low-latency style):
``x [E, capacity, H]`` plus ``counts [E]``; the output ``[E, capacity, H]`` holds unweighted
expert outputs and rows ``>= counts[e]`` are undefined (zero on the CPU reference).

:func:`moe_int4_mlp_reference` dequantises (through the lane emulation of the packed
layout, so the reference also checks the layout) and runs fp32 matmuls: it is the oracle
for the CUDA kernel. :func:`moe_int4_mlp` runs the kernel on CUDA tensors and the
reference on CPU tensors.
"""

from __future__ import annotations

import torch

from .layout import PackedInt4Weight, check_expert_pair, dequantize_packed

_DTYPES = (torch.bfloat16, torch.float16)


def _check_rows(rows, row_experts, row_weights, w13: PackedInt4Weight, w2: PackedInt4Weight):
    check_expert_pair(w13, w2)
    if rows.dim() != 2:
        raise ValueError(f"rows must be [R, H], got shape {tuple(rows.shape)}")
    if rows.dtype not in _DTYPES:
        raise ValueError(f"rows dtype {rows.dtype} is not supported; supported: bf16, fp16")
    if rows.dtype != w13.dtype:
        raise ValueError(f"rows dtype {rows.dtype} differs from the packed experts' {w13.dtype}")
    r, h = rows.shape
    if h != w13.k:
        raise ValueError(f"rows hidden size {h} differs from the experts' hidden size {w13.k}")
    if row_experts.dim() != 2 or row_experts.shape[0] != r:
        raise ValueError(f"row_experts must be [{r}, topk], got {tuple(row_experts.shape)}")
    if row_experts.dtype != torch.int32:
        raise ValueError(f"row_experts must be int32, got {row_experts.dtype}")
    if row_weights.shape != row_experts.shape or row_weights.dtype != torch.float32:
        raise ValueError(
            f"row_weights must be float32 {tuple(row_experts.shape)}, got "
            f"{row_weights.dtype} {tuple(row_weights.shape)}"
        )


def _check_expert_major(x, counts, w13: PackedInt4Weight, w2: PackedInt4Weight):
    check_expert_pair(w13, w2)
    if x.dim() != 3 or x.shape[0] != w13.num_experts:
        raise ValueError(
            f"x must be [E={w13.num_experts}, capacity, H], got shape {tuple(x.shape)}"
        )
    if x.dtype != w13.dtype:
        raise ValueError(f"x dtype {x.dtype} differs from the packed experts' {w13.dtype}")
    if x.shape[2] != w13.k:
        raise ValueError(f"x hidden size {x.shape[2]} differs from the experts' {w13.k}")
    if counts.shape != (x.shape[0],) or counts.dtype != torch.int32:
        raise ValueError(
            f"counts must be int32 [{x.shape[0]}], got {counts.dtype} {tuple(counts.shape)}"
        )


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gu = x @ w13.T
    i = w2.shape[1]
    return (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]) @ w2.T


def moe_int4_mlp_reference(
    rows: torch.Tensor,
    row_experts: torch.Tensor,
    row_weights: torch.Tensor,
    w13: PackedInt4Weight,
    w2: PackedInt4Weight,
) -> torch.Tensor:
    """CPU oracle with the signature of :func:`moe_int4_mlp` (fp32 throughout)."""
    _check_rows(rows, row_experts, row_weights, w13, w2)
    e = w13.num_experts
    ids = row_experts.cpu().long()
    bad = (ids < -1) | (ids >= e)
    if bool(bad.any()):
        v = int(ids[bad][0])
        raise ValueError(f"row_experts holds {v}; allowed: -1 or a local expert id in [0, {e})")
    x = rows.cpu().float()
    wts = row_weights.cpu().float()
    out = torch.zeros(x.shape, dtype=torch.float32)
    w13f, w2f = dequantize_packed(w13), dequantize_packed(w2)
    for ex in torch.unique(ids[ids >= 0]).tolist():
        r, kk = torch.nonzero(ids == ex, as_tuple=True)
        y = _expert_mlp(x[r], w13f[ex], w2f[ex])
        out.index_add_(0, r, y * wts[r, kk].unsqueeze(1))
    return out.to(rows.dtype).to(rows.device)


def moe_int4_mlp_expert_major_reference(
    x: torch.Tensor, counts: torch.Tensor, w13: PackedInt4Weight, w2: PackedInt4Weight
) -> torch.Tensor:
    """CPU oracle for the expert-major layout."""
    _check_expert_major(x, counts, w13, w2)
    cap = x.shape[1]
    c = counts.cpu().long()
    if bool(((c < 0) | (c > cap)).any()):
        raise ValueError(f"counts {c.tolist()} must lie in [0, capacity={cap}]")
    out = torch.zeros(x.shape, dtype=torch.float32)
    w13f, w2f = dequantize_packed(w13), dequantize_packed(w2)
    xf = x.cpu().float()
    for ex in range(x.shape[0]):
        n = int(c[ex])
        if n:
            out[ex, :n] = _expert_mlp(xf[ex, :n], w13f[ex], w2f[ex])
    return out.to(x.dtype).to(x.device)


# ---- the CUDA op -------------------------------------------------------------------------

BLOCK_M_CHOICES = (16, 64)
# Rows per active expert from which the 64-row tile pays: below it a 64-row tile would
# run mostly padding rows through the MMA, and a 16-row tile serves any count anyway.
BLOCK_M_64_MIN_ROWS = 48
# Most CTAs of one GEMM per SM on any target (kBlockM 16: 4 on sm_90; 64: 2), i.e. the
# split-K workspace slots per SM; the kernel clamps its use to the slots it is given.
WS_SLOTS_PER_SM = {16: 4, 64: 2}


def _native():
    try:
        from .. import _moe_int4  # type: ignore[attr-defined]
    except ImportError as exc:
        raise RuntimeError(
            "pcie_a2a._moe_int4 is not built (build with nvcc: PCIE_A2A_WITH_CUDA=1); "
            f"use the CPU reference instead: {exc}"
        ) from None
    return _moe_int4


def choose_block_m(rows_per_expert: float | None = None, zero_points: bool = False) -> int:
    """Rows per tile, chosen on the host without reading counts (no device sync).

    16 unless the caller gives a real estimate of the rows per active expert of at least
    ``BLOCK_M_64_MIN_ROWS`` (prefill): the size of a receive buffer is no estimate (a
    low-latency buffer is mostly ``-1`` slots), and 16-row tiles serve any count. Weights
    with zero points (asymmetric GPTQ, AWQ) always take 16 (there is no 64-row variant).
    """
    if zero_points:
        return 16
    if rows_per_expert is not None and rows_per_expert >= BLOCK_M_64_MIN_ROWS:
        return 64
    return 16


class Workspace:
    """Scratch that outlives one call: the split-K workspace and its tickets, the finalise
    tickets (all zero between calls: the kernels leave them zero) and the sticky invalid-id
    flag (host-visible: pinned host memory on CUDA).

    Buffers only grow, and only outside a CUDA-graph capture: growing allocates zeroed
    memory, which inside a capture would become part of the graph (every replay zeroing
    it again). The buffer a growth replaces is kept (``retired``), never freed: a graph
    captured earlier still points at it. Under a capture a buffer too small raises
    (:func:`reserve_graph_workspace` sizes them first).
    """

    def __init__(self, zeros, errors: torch.Tensor, capturing=lambda: False, mirror=None):
        self._zeros = zeros
        self._bufs: dict[str, torch.Tensor] = {}
        self.errors = errors
        self.retired: list[torch.Tensor] = []
        self._capturing = capturing
        # eager calls size the device's graph workspace too, so a capture after any eager
        # call of the same shapes finds it ready
        self._mirror = mirror

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._mirror is not None:
            self._mirror.get(name, numel, dtype)
        t = self._bufs.get(name)
        if t is None or t.numel() < numel:
            if self._capturing():
                raise RuntimeError(
                    f"moe_int4_mlp: its workspace {name!r} needs {numel} elements inside a "
                    "CUDA-graph capture but holds "
                    f"{0 if t is None else t.numel()}; allocating (and zeroing) it there would "
                    "put that work in every replay. Run one eager call of the largest captured "
                    "shape on this device first (the frameworks' warm-up does), or call "
                    "pcie_a2a.quant.moe.reserve_graph_workspace before capturing"
                )
            if t is not None:
                self.retired.append(t)  # an earlier graph may still point at it
            t = self._zeros(max(numel, 1), dtype=dtype)
            self._bufs[name] = t
        return t


_WORKSPACES: dict[tuple[int, int], Workspace] = {}
_GRAPH_WORKSPACES: dict[int, Workspace] = {}
_ERROR_FLAGS: dict[int, torch.Tensor] = {}


def _error_flag(dev: torch.device) -> torch.Tensor:
    """The device's invalid-id flag: pinned host memory the kernel writes (host-visible
    without a sync), made at the first eager call (pinned allocation is not allowed
    inside a CUDA-graph capture)."""
    flag = _ERROR_FLAGS.get(dev.index)
    if flag is None:
        flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        _ERROR_FLAGS[dev.index] = flag
    return flag


def _new_workspace(dev: torch.device, mirror: Workspace | None = None) -> Workspace:
    zeros = lambda *s, dtype: torch.zeros(*s, dtype=dtype, device=dev)  # noqa: E731
    return Workspace(zeros, _error_flag(dev), torch.cuda.is_current_stream_capturing, mirror)


def _graph_workspace(dev: torch.device) -> Workspace:
    ws = _GRAPH_WORKSPACES.get(dev.index)
    if ws is None:
        ws = _GRAPH_WORKSPACES[dev.index] = _new_workspace(dev)
    return ws


def _cuda_workspace(dev: torch.device, stream: torch.cuda.Stream) -> Workspace:
    """Eager calls: one workspace per (device, stream), so calls on two streams never share
    split-K slots. Captured calls: the device's graph workspace (one graph replays at a
    time on a device, as the frameworks replay them), sized by the eager calls before."""
    if torch.cuda.is_current_stream_capturing():
        ws = _GRAPH_WORKSPACES.get(dev.index)
        if ws is None:
            raise RuntimeError(
                "moe_int4_mlp: first call on this device inside a CUDA-graph capture; its "
                "workspace would be allocated and zeroed in the graph. Run one eager call of "
                "the captured shape first (the frameworks' warm-up does), or call "
                "pcie_a2a.quant.moe.reserve_graph_workspace before capturing"
            )
        return ws
    key = (dev.index, stream.cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = _new_workspace(dev, mirror=_graph_workspace(dev))
    return ws


def reserve_graph_workspace(
    x: torch.Tensor,
    w13: PackedInt4Weight,
    w2: PackedInt4Weight,
    *,
    topk_ids: torch.Tensor | None = None,
    expert_major: bool = False,
    block_m: int | None = None,
) -> None:
    """Sizes the device's graph workspace for a call of these shapes without running it
    (call it outside any capture, with the largest shapes you will capture)."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("reserve_graph_workspace: call it before the capture, not inside")
    dev = x.device
    ws = _graph_workspace(dev)
    _launch_fields(
        x, x, w13, w2, expert_major=expert_major, topk_ids=topk_ids,
        topk_weights=None, counts=None, block_m=block_m, num_sms=_num_sms(dev),
        empty=lambda *shape, dtype: None, workspace=ws,
    )  # fmt: skip


def _raise_routing_errors(ws: Workspace, num_experts: int | None) -> None:
    if ws.errors.is_cuda:  # (only inside a first-call capture; reading it would sync)
        return
    bad = int(ws.errors[0])
    if bad:
        ws.errors.zero_()
        e = "E" if num_experts is None else str(num_experts)
        raise ValueError(
            f"row_experts: an earlier moe_int4_mlp call on this device held {bad} expert ids "
            f"outside [-1, {e}) (or counts outside [0, capacity]); the kernel skipped them "
            "(allowed: -1 or a local expert id; check_routing_errors() synchronises and "
            "reports at once)"
        )


def check_routing_errors() -> None:
    """Synchronise and raise ValueError if any call so far had invalid expert ids."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for ws in _WORKSPACES.values():
        _raise_routing_errors(ws, None)


def _weight_fields(prefix: str, w: PackedInt4Weight) -> dict:
    return {
        f"{prefix}_qweight": w.qweight,
        f"{prefix}_scales": w.scales,
        f"{prefix}_zeros": w.zeros,
        f"{prefix}_n_pad": w.n_pad,
        f"{prefix}_k_pad": w.k_pad,
        f"{prefix}_group": w.group_size_eff,
        f"{prefix}_num_groups": w.num_groups,
    }


def _launch_fields(
    x: torch.Tensor,
    out: torch.Tensor,
    w13: PackedInt4Weight,
    w2: PackedInt4Weight,
    *,
    expert_major: bool,
    topk_ids: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    counts: torch.Tensor | None,
    block_m: int | None,
    num_sms: int,
    empty,
    workspace: Workspace,
    rows_per_expert: float | None = None,
) -> dict:
    """Every field of ``pcie_a2a._moe_int4.Args`` but ``device`` and ``stream``.

    Values are ints, or tensors standing for their ``data_ptr()`` (``None`` for 0).
    Per-call scratch comes from ``empty(*shape, dtype=...)`` on the target device (no
    zeroing), the persistent zeroed scratch from ``workspace``. The CUDA path and the host
    emulation of the kernel source both build
    their arguments here, so the emulation runs with exactly the sizes the GPU gets.
    """
    e = w13.num_experts
    h = w13.k
    if expert_major:
        cap = x.shape[1]
        pairs = e * cap
    else:
        r, topk = topk_ids.shape
        pairs = r * topk
    bm = block_m if block_m is not None else choose_block_m(rows_per_expert)
    if bm not in BLOCK_M_CHOICES:
        raise ValueError(f"block_m={bm} is not supported; supported: {BLOCK_M_CHOICES}")
    if bm != 16 and (w13.zeros is not None or w2.zeros is not None):
        raise ValueError(
            f"block_m={bm} is not available with zero points (asymmetric GPTQ, AWQ); use 16"
        )
    max_tiles = e + pairs // bm + 1  # >= sum_e ceil(count_e / bm) for any counts
    h_stride = w13.n_pad // 2
    h_perm = w2.k_perm_inv
    if h_perm is not None and h_perm.shape[1] != h_stride:
        raise ValueError(f"w2.k_perm_inv has {h_perm.shape[1]} columns; h has {h_stride}")
    i32 = torch.int32
    f = dict(
        dtype=0 if x.dtype == torch.bfloat16 else 1,
        expert_major=expert_major,
        x=x,
        hidden=h,
        num_experts=e,
        out=out,
        **_weight_fields("w13", w13),
        **_weight_fields("w2", w2),
        x_perm=w13.k_perm,
        x_perm_buf=None if w13.k_perm is None else empty(max(pairs, 1), w13.k_pad, dtype=x.dtype),
        h_perm=h_perm,
        h_stride=h_stride,
        pair_src=empty(max(pairs, 1), dtype=i32),
        pair_w=empty(max(pairs, 1), dtype=torch.float32),
        tiles=empty(max_tiles * 4, dtype=i32),
        status=empty(4, dtype=i32),  # every entry is written by the schedule kernel
        h=empty(max(pairs, 1), h_stride, dtype=x.dtype),
        split_k=1,
        max_pairs=pairs,
        max_tiles=max_tiles,
        block_m=bm,
        errors=workspace.errors,
    )
    if expert_major:
        f.update(num_rows=e * x.shape[1], capacity=x.shape[1], counts=counts)
    else:
        r = x.shape[0]
        f.update(
            num_rows=r,
            num_topk=topk_ids.shape[1],
            topk_ids=topk_ids,
            topk_weights=topk_weights,
            acc=empty(r, h, dtype=torch.float32),  # rows with a local expert: zeroed on device
            row_pairs=empty(max(r, 1), dtype=i32),
            active_rows=empty(max(r, 1), dtype=i32),
            row_cnt=workspace.get("row_cnt", r * (w2.n_pad // 256), i32),
        )
    # Split-K workspace of the SiLU and expert-major GEMMs: one slot per CTA the grid can
    # have (from the grid, not from the tokens); left zeroed by the kernel.
    ws_items = WS_SLOTS_PER_SM[bm] * num_sms
    f.update(
        split_ws=workspace.get(f"split_ws{bm}", ws_items * bm * 256, torch.float32),
        split_cnt=workspace.get("split_cnt", ws_items, i32),
        ws_items=ws_items,
    )
    return f


_SMS: dict[int, int] = {}


def _num_sms(dev: torch.device) -> int:
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _check_devices(dev: torch.device, tensors: dict) -> None:
    """Every tensor the kernel dereferences must be a dense tensor on ``dev`` (``errors`` is
    host memory the device writes, by design)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or name == "errors":
            continue
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, activations on {dev}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel assumes dense strides)")


def _run_cuda(
    x: torch.Tensor,
    out: torch.Tensor,
    w13: PackedInt4Weight,
    w2: PackedInt4Weight,
    *,
    expert_major: bool,
    topk_ids: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    counts: torch.Tensor | None,
    block_m: int | None,
    rows_per_expert: float | None = None,
) -> None:
    mod = _native()
    dev = x.device
    stream = torch.cuda.current_stream(dev)
    ws = _cuda_workspace(dev, stream)
    _raise_routing_errors(ws, w13.num_experts)
    fields = _launch_fields(
        x,
        out,
        w13,
        w2,
        expert_major=expert_major,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        counts=counts,
        block_m=block_m,
        num_sms=_num_sms(dev),
        empty=lambda *shape, dtype: torch.empty(*shape, dtype=dtype, device=dev),
        workspace=ws,
        rows_per_expert=rows_per_expert,
    )
    # Host pointers (e.g. routing left on the CPU) would be dereferenced by the kernel.
    _check_devices(dev, fields)
    a = mod.Args()
    for name, v in fields.items():
        setattr(a, name, v.data_ptr() if isinstance(v, torch.Tensor) else (v or 0))
    a.device = dev.index if dev.index is not None else torch.cuda.current_device()
    a.stream = stream.cuda_stream
    mod.run(a)
    # The scratch was allocated on this stream; the caching allocator hands it out again
    # only to work ordered after these kernels on the same stream, so freeing it when this
    # function returns is safe (and inside CUDA-graph capture it comes from the graph pool).


# ---- torch.library ops (so CUDA graphs and torch.compile see one opaque op) --------------
# Packed weights cross as tensors plus a list of ints; the CPU implementation is the
# reference, the CUDA one the kernel.


def _weight_args(w: PackedInt4Weight) -> list:
    return [w.qweight, w.scales, w.zeros, w.k_perm, w.k_perm_inv]


def _weight_meta(w: PackedInt4Weight) -> list[int]:
    return [w.n, w.k, w.n_pad, w.k_pad, w.group_size, int(w.gate_up)]


def _rebuild(t: list, meta: list[int], dtype: torch.dtype) -> PackedInt4Weight:
    n, k, n_pad, k_pad, group, gate_up = meta
    return PackedInt4Weight(*t, n, k, n_pad, k_pad, group, dtype, bool(gate_up))


@torch.library.custom_op("pcie_a2a::moe_int4_mlp", mutates_args=())
def _moe_int4_mlp_op(
    rows: torch.Tensor,
    row_experts: torch.Tensor,
    row_weights: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_zeros: torch.Tensor | None,
    w13_k_perm: torch.Tensor | None,
    w13_k_perm_inv: torch.Tensor | None,
    w2_qweight: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_zeros: torch.Tensor | None,
    w2_k_perm: torch.Tensor | None,
    w2_k_perm_inv: torch.Tensor | None,
    meta: list[int],
    block_m: int,
) -> torch.Tensor:
    w13 = _rebuild(
        [w13_qweight, w13_scales, w13_zeros, w13_k_perm, w13_k_perm_inv], meta[:6], rows.dtype
    )
    w2 = _rebuild([w2_qweight, w2_scales, w2_zeros, w2_k_perm, w2_k_perm_inv], meta[6:], rows.dtype)
    if not rows.is_cuda:
        return moe_int4_mlp_reference(rows, row_experts, row_weights, w13, w2)
    rows = rows.contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0] == 0:
        return out
    _run_cuda(
        rows,
        out,
        w13,
        w2,
        expert_major=False,
        topk_ids=row_experts.contiguous(),
        topk_weights=row_weights.contiguous(),
        counts=None,
        block_m=None if block_m <= 0 else block_m,
    )
    return out


@_moe_int4_mlp_op.register_fake
def _(rows, row_experts, row_weights, *args):
    return torch.empty_like(rows)


@torch.library.custom_op("pcie_a2a::moe_int4_mlp_expert_major", mutates_args=())
def _moe_int4_mlp_expert_major_op(
    x: torch.Tensor,
    counts: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_zeros: torch.Tensor | None,
    w13_k_perm: torch.Tensor | None,
    w13_k_perm_inv: torch.Tensor | None,
    w2_qweight: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_zeros: torch.Tensor | None,
    w2_k_perm: torch.Tensor | None,
    w2_k_perm_inv: torch.Tensor | None,
    meta: list[int],
    block_m: int,
) -> torch.Tensor:
    w13 = _rebuild(
        [w13_qweight, w13_scales, w13_zeros, w13_k_perm, w13_k_perm_inv], meta[:6], x.dtype
    )
    w2 = _rebuild([w2_qweight, w2_scales, w2_zeros, w2_k_perm, w2_k_perm_inv], meta[6:], x.dtype)
    if not x.is_cuda:
        return moe_int4_mlp_expert_major_reference(x, counts, w13, w2)
    x = x.contiguous()
    out = torch.empty_like(x)  # rows past counts[e] stay undefined, as in DeepEP
    if x.shape[1] == 0:
        return out
    _run_cuda(
        x,
        out,
        w13,
        w2,
        expert_major=True,
        topk_ids=None,
        topk_weights=None,
        counts=counts.contiguous(),
        block_m=None if block_m <= 0 else block_m,
    )
    return out


@_moe_int4_mlp_expert_major_op.register_fake
def _(x, counts, *args):
    return torch.empty_like(x)


def moe_int4_mlp(
    rows: torch.Tensor,
    row_experts: torch.Tensor,
    row_weights: torch.Tensor,
    w13: PackedInt4Weight,
    w2: PackedInt4Weight,
    *,
    block_m: int | None = None,
    rows_per_expert: float | None = None,
) -> torch.Tensor:
    """Fused W4A16 expert MLP on dispatch rows; returns ``[R, H]`` in ``rows.dtype``.

    Runs ``torch.ops.pcie_a2a.moe_int4_mlp``: on CUDA tensors the kernel (schedule kernel,
    gate/up GEMM with SiLU*up, down GEMM with weighting, per-row reduction and cast; no
    host sync, capturable in a CUDA graph), on CPU tensors :func:`moe_int4_mlp_reference`.
    Rows with no local expert are undefined on CUDA (see the module docstring).
    Expert ids outside ``[-1, E)`` are a ValueError on the CPU; the kernel skips them and
    sets a host-visible flag, so the next call on the device (or
    :func:`check_routing_errors`, which synchronises) raises ValueError.
    ``block_m`` (16 or 64) overrides :func:`choose_block_m`, which takes 16 unless
    ``rows_per_expert`` (a real estimate of the rows per active expert) is large.
    """
    _check_rows(rows, row_experts, row_weights, w13, w2)
    if block_m is None:
        block_m = choose_block_m(rows_per_expert, w13.zeros is not None)
    return torch.ops.pcie_a2a.moe_int4_mlp(
        rows,
        row_experts,
        row_weights,
        *_weight_args(w13),
        *_weight_args(w2),
        _weight_meta(w13) + _weight_meta(w2),
        block_m,
    )


def moe_int4_mlp_expert_major(
    x: torch.Tensor,
    counts: torch.Tensor,
    w13: PackedInt4Weight,
    w2: PackedInt4Weight,
    *,
    block_m: int | None = None,
    rows_per_expert: float | None = None,
) -> torch.Tensor:
    """Expert-major layout: ``x [E, capacity, H]`` + ``counts [E]`` -> ``[E, capacity, H]``
    of unweighted expert outputs (rows beyond ``counts[e]`` are undefined on CUDA, zero on
    the CPU reference). ``block_m`` / ``rows_per_expert`` as in :func:`moe_int4_mlp`."""
    _check_expert_major(x, counts, w13, w2)
    if block_m is None:
        block_m = choose_block_m(rows_per_expert, w13.zeros is not None)
    return torch.ops.pcie_a2a.moe_int4_mlp_expert_major(
        x,
        counts,
        *_weight_args(w13),
        *_weight_args(w2),
        _weight_meta(w13) + _weight_meta(w2),
        -1 if block_m is None else block_m,
    )
