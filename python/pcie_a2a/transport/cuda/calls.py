"""The graph-capturable call API of the CUDA transport: each call with its tensors given
(the Buffer's low-latency path and the in-process harness use it). Nothing here reads the
device from the host."""

from __future__ import annotations

import torch

from pcie_a2a.transport.cuda.common import _check, _ptr


class AsyncCalls:
    """The ``*_async`` half of :class:`pcie_a2a.transport.cuda.CudaTransport`."""

    def dispatch_send_async(self, ticket, op, x, topk_ids, topk_weights, send_token, send_count):
        """Begins a dispatch call and pushes one row per (token, destination rank).
        x [T, H] contiguous, 16-byte aligned, in the transport's dtype; topk_ids int32 or
        int64 [T, k]; topk_weights fp32 [T, k]; outputs send_token int32
        [world * max_tokens], send_count int32 [world]. The ids' values are checked on the
        device (looking at them here would synchronise): ids outside [-1, num_experts) and
        an expert a token lists twice are skipped and raised as ValueError by the next
        :meth:`check` (the Buffer's next call)."""
        self._launch_dispatch(ticket, op, x, topk_ids, topk_weights, send_token, send_count)
        self._advance(None, op, None)  # after the launch: a refused call consumes no number

    def _check_send_inputs(self, x, topk_ids, topk_weights) -> None:
        """What the kernels cannot check and the graph path does not get from the Buffer:
        device, dtype, shape, contiguity and alignment (16 bytes for vector loads)."""
        _check(x, "x", self.device, (self.dtype,), (None, self.hidden))
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"x.shape[0]: got {x.shape[0]}, expected <= {self.max_tokens}")
        t = x.shape[0]
        ids_t = (torch.int32, torch.int64)
        align = 8 if getattr(topk_ids, "dtype", None) == torch.int64 else 4
        _check(topk_ids, "topk_ids", self.device, ids_t, (t, None), align=align)
        if topk_ids.shape[1] > self.num_topk:
            raise ValueError(
                f"topk_ids.shape[1]: got {topk_ids.shape[1]}, expected <= {self.num_topk}"
            )
        shape = tuple(topk_ids.shape)
        _check(topk_weights, "topk_weights", self.device, (torch.float32,), shape, align=4)

    def _launch_dispatch(
        self, ticket, op, x, topk_ids, topk_weights, send_token, send_count, min_bytes=None
    ):
        """Warp stores, or (min_bytes given) the copy-engine path for pairs that large."""
        self._check_send_inputs(x, topk_ids, topk_weights)
        args = [
            _ptr(ticket),
            op,
            _ptr(x),
            x.shape[0],
            _ptr(topk_ids),
            _ptr(topk_weights),
            topk_ids.shape[1],
            _ptr(send_token),
            _ptr(send_count),
        ]
        ids64 = topk_ids.dtype == torch.int64
        if min_bytes is None:
            self._tx().dispatch_send(*args, self._stream(), ids64)
        else:
            self._tx().dispatch_send_ce(*args, min_bytes, self._stream(), ids64)
        self._last_counts = ("send", send_count)

    def recv_rows_async(
        self,
        ticket,
        counts,
        x_out,
        fp8_out,
        scales_out,
        src_rank,
        src_token,
        topk_ids,
        topk_weights,
        expert_count,
        *,
        wait=True,
        row_base=None,
    ):
        """Rows layout. wait=True (low latency): acquires each flag on the device, writes
        counts [world]; outputs [world * max_tokens, ...], every element written (rows past
        a count: ids -1, weights 0, src -1; x unspecified). wait=False: counts come from
        :meth:`wait` and row_base int64 [world] gives compacted output rows."""
        self._tx().unpack_rows(
            _ptr(ticket),
            wait,
            _ptr(counts),
            _ptr(row_base),
            _ptr(x_out),
            _ptr(fp8_out),
            _ptr(scales_out),
            _ptr(src_rank),
            _ptr(src_token),
            _ptr(topk_ids),
            _ptr(topk_weights),
            _ptr(expert_count),
            self.timeout_s,
            self._stream(),
        )

    def recv_expert_major_async(
        self,
        ticket,
        counts,
        x_out,
        fp8_out,
        scales_out,
        expert_count,
        src_info,
        layout_range,
        expert_pos,
        row_experts,
        row_weights,
    ):
        """Expert-major layout ``[E_local, world * max_tokens, H]`` (DeepEP LL layout); every
        output but x is written whole (src_info -1 past each expert's count)."""
        self._tx().unpack_expert_major(
            _ptr(ticket),
            _ptr(counts),
            _ptr(x_out),
            _ptr(fp8_out),
            _ptr(scales_out),
            _ptr(expert_count),
            _ptr(src_info),
            _ptr(layout_range),
            _ptr(expert_pos),
            _ptr(row_experts),
            _ptr(row_weights),
            self.timeout_s,
            self._stream(),
        )

    def combine_send_async(
        self,
        ticket,
        op,
        y,
        recv_count,
        row_base=None,
        expert_pos=None,
        row_experts=None,
        row_weights=None,
    ):
        """Begins a combine call. Rows layout: y rows (row_base None: [world * max_tokens]).
        Expert-major (expert_pos given): y [E_local, world * max_tokens, H] unweighted; the
        weighted fp32 pre-reduction is fused into the push."""
        self._launch_combine(
            ticket, op, y, recv_count, row_base, expert_pos, row_experts, row_weights
        )
        self._advance(None, op, None)

    def _launch_combine(
        self, ticket, op, y, recv_count, row_base, expert_pos, row_experts, row_weights
    ):
        rank = y.dim() if isinstance(y, torch.Tensor) else 1
        _check(y, "y", self.device, (self.dtype,), (None,) * (rank - 1) + (self.hidden,))
        self._tx().combine_send(
            _ptr(ticket),
            op,
            _ptr(y),
            _ptr(recv_count),
            _ptr(row_base),
            _ptr(expert_pos),
            _ptr(row_experts),
            _ptr(row_weights),
            self._stream(),
        )
        self._last_counts = ("recv", recv_count)

    def combine_recv_async(self, ticket, send_token, send_count, num_tokens, out):
        self._tx().combine_recv(
            _ptr(ticket),
            _ptr(send_token),
            _ptr(send_count),
            num_tokens,
            _ptr(out),
            self.timeout_s,
            self._stream(),
        )
