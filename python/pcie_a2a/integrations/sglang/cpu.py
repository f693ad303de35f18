"""What SGLang's CPU engine needs under ``--moe-a2a-backend pcie`` (CPU servers only).

Two things, both in code SGLang runs only on its CPU engine, so CUDA servers are untouched.

**Padded rows.** Any a2a backend other than ``none`` turns on SGLang's MLP-sync padding
(``ForwardBatch.prepare_mlp_sync_batch`` -> ``_pad_inputs_to_size``), which on CPU asks the
attention backend for ``get_cpu_graph_seq_len_fill_value()``: the sequence length given to
the padded rows. ``TorchNativeAttnBackend`` (the CPU engine's ``--attention-backend
torch_native``) has none in SGLang 0.5.23, so the first forward died with AttributeError.
Every backend that defines it (and every CUDA backend's ``get_cuda_graph_seq_len_fill_value``)
returns 1: a padded row is a one-token sequence, whose attention reads one valid KV slot.

**The CPU expert loop.** Our dispatcher hands the runner local expert ids with -1 for
experts held elsewhere (SGLang's own EP format), and a rank may receive no rows at all.
SGLang's CPU runner ``moe_forward_native`` takes neither: it scatters every id into a
per-row count (-1 is out of bounds; a repeated id misaligns its token sort) and reshapes
its output by ``-1`` (ambiguous for zero rows). Under our backend an AROUND hook on it
(:func:`moe_forward_native_hook`) returns zeros for zero rows and gives each -1 slot a
distinct local expert the row does not use, with weight 0.
"""

from __future__ import annotations

import torch

#: the fill value SGLang 0.5.23's other attention backends return for padded rows
SEQ_LEN_FILL_VALUE = 1


def _cpu_graph_seq_len_fill_value(self) -> int:
    return SEQ_LEN_FILL_VALUE


def patch_torch_native_backend() -> bool:
    """Gives ``TorchNativeAttnBackend`` the method when SGLang lacks it; True if added."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value"):
        return False
    TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = _cpu_graph_seq_len_fill_value
    return True


def fill_dropped_slots(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local top-k ids (-1: expert held elsewhere) in the form SGLang's CPU expert loop
    (``moe_forward_native``) can take: it scatters every id into a per-row count, so -1
    crashes it, and a repeated id in one row misaligns its token sort. Each -1 slot gets a
    distinct local expert the row does not use, with weight 0 (its output adds nothing)."""
    k = topk_ids.shape[-1]
    if num_local_experts < k:
        raise ValueError(
            f"pcie_a2a: SGLang's CPU experts need num_local_experts >= top_k to pad dropped "
            f"slots; got num_local_experts={num_local_experts}, top_k={k}"
        )
    valid = topk_ids >= 0
    if bool(valid.all()):
        return topk_ids, topk_weights
    used = torch.zeros(topk_ids.shape[0], num_local_experts, dtype=torch.int8)
    # add, not write: a -1 slot clamped onto expert 0 must not clear a real use of it
    used.scatter_add_(1, topk_ids.clamp(min=0).long(), valid.to(torch.int8))
    unused_first = torch.argsort(used, dim=1, stable=True)  # 0 (unused) sorts first
    nth_dropped = (torch.cumsum((~valid).long(), dim=1) - 1).clamp(min=0)
    fill = torch.gather(unused_first, 1, nth_dropped).to(topk_ids.dtype)
    ids = torch.where(valid, topk_ids, fill)
    weights = torch.where(valid, topk_weights, torch.zeros_like(topk_weights))
    return ids, weights


def moe_forward_native_hook(original, layer, x, topk_output, moe_runner_config):
    """AROUND hook on ``sglang.srt.layers.moe.fused_moe_native.moe_forward_native``."""
    from pcie_a2a.integrations.sglang.state import is_active

    if not is_active():
        return original(layer, x, topk_output, moe_runner_config)
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    ids, weights = fill_dropped_slots(
        topk_output.topk_ids, topk_output.topk_weights, int(layer.w13_weight.shape[0])
    )
    return original(
        layer, x, topk_output._replace(topk_ids=ids, topk_weights=weights), moe_runner_config
    )


HOOK_TARGETS = [
    ("sglang.srt.layers.moe.fused_moe_native.moe_forward_native", moe_forward_native_hook),
]
